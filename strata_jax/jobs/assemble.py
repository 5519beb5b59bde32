"""The one assembly of a run's pieces from its config, shared by training, evaluation and the
notebook: `assemble(c, train=..., mesh=...) -> Run`.

    tokenizer -> model config + params -> warm start (`strata_jax.jobs.warm_start`)
      -> sampler mesh -> Sampler + SamplerCopy + SamplerPolicy -> PromptBuilder -> judge
      -> TaskSampler (training) -> EnvPool -> Trainer (training)

It lives here, above `strata_jax.experiment` (the builders) and the warm start (which itself
builds from the experiment), so neither of those imports the other's caller. Nothing here
restores a checkpoint or runs a loop: the jobs do (`strata_jax.jobs.train`,
`strata_jax.jobs.evaluate`). Source: docs/design.md §2.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from strata_jax import distributed
from strata_jax import experiment as ex


@dataclasses.dataclass(frozen=True)
class Run:
    """Every piece of one run, built from its config (`assemble`).

    Attributes:
      model: the `Qwen2Config`.
      mesh: the device mesh of ``c.mesh`` (training: spans every host).
      sampler_mesh: the sampler's mesh: training samples per host (`distributed.local_mesh`),
        evaluation on `mesh` itself.
      tokenizer: the run's tokenizer (`experiment.build_tokenizer`).
      init_params: the initial params after the warm start (``model.dtype``, placed on `mesh`),
        or with ``initial=False`` only their ``jax.ShapeDtypeStruct`` tree (a restore target).
      sampler: the `Sampler` (cache of `experiment.max_cache_len`).
      copy: the `SamplerCopy` that turns params into what `sampler` reads.
      policy: the `SamplerPolicy` on `sampler`, with NO params yet: the job sets them once it
        knows them (``policy.set_params(copy(...))``: a restored checkpoint's, or `init_params`).
      builder: the `PromptBuilder` (`make_prompt_builder`).
      pool: the `EnvPool` (``env.num_workers`` live envs); the job closes it.
      task_sampler: the training `TaskSampler` over ``env.split`` (seed ``c.seed``); None when
        not training (evaluation plays `strata_jax.evaluation.eval_tasks`).
      judge: the separate `JudgeModel` of ``rollout.judge_model``, or None (the policy judges
        itself; also None in an evaluation that does not choose by judge).
      trainer: the `Trainer` (None when not training).
    """

    model: Any
    mesh: Any
    sampler_mesh: Any
    tokenizer: Any
    init_params: Any
    sampler: Any
    copy: Any
    policy: Any
    builder: Any
    pool: Any
    task_sampler: Any
    judge: Any
    trainer: Any


def assemble(c: Any, *, train: bool, mesh: Any, initial: bool = True) -> Run:
    """Build the `Run` of config `c` (prepared: `strata_jax.jobs.prepare`) on `mesh`.

    Args:
      c: the experiment ConfigDict, validated and resolved.
      train: True: the training run's pieces (a Trainer, the task sampler, the sampler on this
        host's devices, the judge when ``rollout.judge_model`` is set, a warm start trained
        when not cached). False: evaluation's (no trainer, no task sampler, the sampler on
        `mesh`, the judge only for ``eval.strategy_choice=judge`` with strategy_samples > 1,
        an uncached "sft" warm start is a ConfigError).
      mesh: the device mesh (`Prepared.mesh`).
      initial: False: `Run.init_params` is only the shape tree (`experiment.abstract_params`):
        nothing is loaded or trained (evaluation of a full fine-tuning checkpoint).
    Raises ConfigError (bad task filter, a bad ``rollout.sampler_layout``, an uncached warm
    start in evaluation), the loaders' errors for a missing model or judge, ValueError for a
    warm-start export of another shape or a judge whose context is too short.
    """
    from strata_jax.jobs.warm_start import maybe_warm_start
    from strata_jax.rollout import SamplerPolicy, build_judge_model, make_prompt_builder
    from strata_jax.sampling import Sampler, SamplerCopy
    from strata_jax.training import Trainer, TrainConfig
    from strata_jax.training.bounds import ShapeBounds, embed_floors, sampler_floors

    tokenizer = ex.build_tokenizer(c)
    if initial:
        model_cfg, params = ex.build_model(c, tokenizer, mesh)
        params = maybe_warm_start(c, model_cfg, params, tokenizer, c.workdir, mesh=mesh,
                                  train=train)
    else:
        model_cfg = ex.model_config(c, tokenizer)
        params = ex.abstract_params(c, model_cfg)
    # rollouts are per host: the training sampler stays local; evaluation samples on the mesh
    sampler_mesh = distributed.local_mesh(mesh) if train else mesh
    sampler = Sampler(model_cfg, mesh=sampler_mesh, max_cache_len=ex.max_cache_len(c, model_cfg),
                      **sampler_floors(c))
    copy = SamplerCopy.from_config(c, model_cfg, gather_to=sampler_mesh if train else None)
    # the update's shapes padded to the config's bounds from the first iteration on: the
    # compiled programs stop growing with the batches (training/bounds.py)
    trainer = (Trainer(model_cfg, TrainConfig.from_config(c), mesh,
                       bounds=ShapeBounds.from_config(c)) if train else None)
    builder = make_prompt_builder(tokenizer, c)
    judge = build_judge_model(c, sampler_mesh) if train or _judge_chooses(c) else None
    task_sampler = ex.TaskSampler(ex.task_list(c), seed=c.seed) if train else None
    policy = SamplerPolicy(sampler, None, prefix_cache_mb=c.rollout.prefix_cache_mb,
                           embed_floors=embed_floors(c))
    return Run(model=model_cfg, mesh=mesh, sampler_mesh=sampler_mesh, tokenizer=tokenizer,
               init_params=params, sampler=sampler, copy=copy, policy=policy, builder=builder,
               pool=ex.build_pool(c), task_sampler=task_sampler, judge=judge, trainer=trainer)


def _judge_chooses(c: Any) -> bool:
    """Whether evaluation's test-time scaling picks its candidates by judge (the one eval use
    of a separate judge model; `c` passed evaluation's check of those settings)."""
    from strata_jax.evaluation.scaling import TestTimeConfig
    tt = TestTimeConfig.from_config(c)
    return tt.enabled and tt.strategy_choice == "judge"


__all__ = ["Run", "assemble"]
