"""eval.py's job: load a run's checkpoint (or the config's model), play the eval protocol
(`strata_jax.evaluation.protocol`) or, with ``eval.strategy_samples`` > 1, its test-time
strategy scaling (`strata_jax.evaluation.scaling`), and write the metrics JSON and every
episode (docs/method.md §10).
"""
from __future__ import annotations

from typing import Any

import jax

from strata_jax.evaluation.protocol import eval_tasks, evaluate


def run_eval(c, split: str | None = None, step: int | None = None,
             use_checkpoint: bool = True) -> dict:
    """Evaluate and return the metrics dict (see strata_jax.evaluation.protocol.evaluate) plus "step"
    and "files" (the JSON and trajectory paths written, process 0 only).

    Loads the run's checkpoint (``<workdir>/ckpt``, the newest restorable or `step`), or with
    ``use_checkpoint=False`` the config's model (``model.path`` / ``model.preset`` plus a warm
    start that is already cached), and nothing else: no warm start is ever trained here. Plays
    `eval_tasks` with `evaluate` and writes ``<workdir>/eval_<split>_step<k>.json`` (metrics)
    and ``..._trajectories.jsonl`` (every episode, `dump_trajectories` records).
    With ``eval.strategy_samples`` S > 1 it runs `test_time.evaluate_scaled` instead (the
    chooser ``eval.strategy_choice``: "critic" takes the checkpoint's critic, "judge" the
    ``rollout.judge_model`` if set) and the files get the suffix ``_s<S>_<choice>`` (plus
    ``_probe<k>`` with ``eval.probe_steps`` = k).

    The metrics add the prefill's work (`strata_jax.rollout.prefix_metrics` as ``eval/...``:
    prompt_tokens, prefill_tokens, and with ``rollout.prefix_cache_mb`` > 0 the prefix cache's
    computed / reused tokens).

    Raises ConfigError (bad config; with use_checkpoint=False a warm start that is not cached;
    strategy_choice="critic" for a run or model without a critic) and FileNotFoundError (no
    restorable checkpoint in the run folder).
    """
    import json
    import os

    from strata_jax import experiment as ex
    from strata_jax.rollout import SamplerPolicy, make_prompt_builder, prefix_metrics
    from strata_jax.sampling import Sampler
    from strata_jax.training import Checkpointer, Trainer, TrainConfig

    from strata_jax.rollout import build_judge_model
    from strata_jax.evaluation.scaling import TestTimeConfig, critic_scorer, evaluate_scaled

    ex.validate(c)
    ex.use_compilation_cache(c)
    ex.use_host_allocator(c)
    ex.resolve(c)
    try:
        tt = TestTimeConfig.from_config(c)
    except ValueError as e:
        raise ex.ConfigError(str(e)) from None
    wants_critic = tt.enabled and tt.strategy_choice == "critic"
    if wants_critic and not use_checkpoint:
        raise ex.ConfigError("eval.strategy_choice=critic needs a trained critic: evaluate a "
                             "ppo / stapo checkpoint (not --no_checkpoint), or use "
                             "strategy_choice=judge or first_action")
    if wants_critic and TrainConfig.from_config(c).critic_kind == "none":
        raise ex.ConfigError(f"eval.strategy_choice=critic needs a critic and a {c.algo} run "
                             f"has none (train.critic={c.train.critic!r}); evaluate a ppo / "
                             "stapo run or use strategy_choice=judge or first_action")
    ex.check_env(c)   # e.g. the WebShop server answers
    split = split or c.eval.split
    ckpt_dir = os.path.join(c.workdir, "ckpt")
    if use_checkpoint and not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"no checkpoint in {ckpt_dir}; train first (python train.py "
                                "with the same --config) or pass --no_checkpoint to evaluate "
                                "config.model as is")
    mesh = ex.build_mesh(c)
    tokenizer = ex.build_tokenizer(c)
    at, critic = 0, None
    if use_checkpoint:
        trainer = Trainer(ex.model_config(c, tokenizer), TrainConfig.from_config(c), mesh)
        model_cfg = trainer.model
        # LoRA adapters need their frozen base (the run's initial params); full fine-tuning
        # needs only the shapes: nothing is loaded or trained besides the checkpoint.
        base = (_initial_params(c, tokenizer, mesh)[1] if trainer.lora
                else ex.abstract_params(c, model_cfg))
        ckpt = Checkpointer(ckpt_dir, keep=c.ckpt.keep)
        restored = ckpt.restore(trainer.abstract_state(base), step=step)
        ckpt.close()
        if restored is None:
            raise FileNotFoundError(f"no restorable checkpoint in {ckpt_dir}"
                                    + (f" at step {step}" if step is not None else "")
                                    + "; train first or pass --no_checkpoint")
        state, meta = restored
        # LoRA: the adapters merged into the base; otherwise the trained params themselves
        params, at = trainer.policy_params(state, base), int(meta["step"])
        if wants_critic:
            try:
                critic = critic_scorer(trainer, state, base if trainer.lora else None)
            except ValueError as e:
                raise ex.ConfigError(str(e)) from None
        print(f"evaluating checkpoint step {at} of {c.workdir}", flush=True)
    else:
        model_cfg, params = _initial_params(c, tokenizer, mesh)
        print(f"evaluating the config's model as is ({c.model.path or 'preset ' + c.model.preset}"
              + (f", warm start {c.model.warm_start}" if c.model.warm_start else "") + ")",
              flush=True)
    tasks = eval_tasks(c, split)
    sampler = Sampler(model_cfg, mesh=mesh, max_cache_len=ex.max_cache_len(c, model_cfg))
    policy = SamplerPolicy(sampler, ex.sampler_layout(c, model_cfg,
                                                      ex.sampler_params(c, params)),
                           prefix_cache_mb=c.rollout.prefix_cache_mb)
    builder = make_prompt_builder(tokenizer, c)
    pool = ex.build_pool(c)
    print(f"playing {len(tasks)} tasks on split {split!r} "
          f"({int(c.eval.episodes_per_family)} per family)"
          + (f", {tt.strategy_samples} candidates each ({tt.strategy_choice} chooses, "
             + (f"{tt.probe_steps}-step probes)" if tt.probe_steps else "full episodes)")
             if tt.enabled else "") + " (the first batch of 16 includes compiling the sampler: "
          "minutes on a CPU for a real model) ...", flush=True)
    prefill0 = policy.prefix_stats()
    try:
        if tt.enabled:
            judge = build_judge_model(c, mesh) if tt.strategy_choice == "judge" else None
            metrics, episodes = evaluate_scaled(c, policy, pool, builder, tasks,
                                                key=ex.seed_key(c, 2, at), critic=critic,
                                                judge=judge)
        else:
            metrics, episodes = evaluate(c, policy, pool, builder, tasks,
                                         key=ex.seed_key(c, 2, at), progress=_progress_line())
    finally:
        pool.close()
    # the prefill's work over the whole eval (eval/prompt_tokens, eval/prefill_tokens, ...)
    metrics.update(prefix_metrics(prefill0, policy.prefix_stats(), prefix="eval"))
    metrics["step"] = at
    metrics["files"] = []
    if jax.process_index() == 0:   # multi-host: process 0 writes
        os.makedirs(c.workdir, exist_ok=True)
        stem = os.path.join(c.workdir, f"eval_{split}_step{at}")
        if tt.enabled:   # test-time scaling never overwrites the one-strategy protocol's files
            stem += f"_s{tt.strategy_samples}_{tt.strategy_choice}" + (
                f"_probe{tt.probe_steps}" if tt.probe_steps else "")
        with open(stem + ".json", "w") as f:
            json.dump({k: v for k, v in metrics.items() if k != "files"}, f, indent=1)
        with open(stem + "_trajectories.jsonl", "w") as f:
            for rec in episodes:
                f.write(json.dumps({"step": at, **rec}, default=str) + "\n")
        metrics["files"] = [stem + ".json", stem + "_trajectories.jsonl"]
    return metrics


def _progress_line():
    """`evaluate`'s progress callback: one line per batch of episodes, with the success so far
    and the elapsed time."""
    import time
    t0 = time.time()

    def show(done: int, total: int, trajectories: Any) -> None:
        wins = sum(bool(t.success) for t in trajectories)
        print(f"  {done}/{total} episodes played, {wins} succeeded, {time.time() - t0:.0f} s",
              flush=True)
    return show


def _initial_params(c: Any, tokenizer: Any, mesh: Any) -> tuple[Any, Any]:
    """The run's initial params for evaluation: `experiment.build_model`, then the warm start
    only when it is already cached (eval never trains one: a ConfigError says to run sft.py)."""
    from strata_jax import experiment as ex
    from strata_jax.warm_start import maybe_warm_start
    model_cfg, params = ex.build_model(c, tokenizer, mesh)
    return model_cfg, maybe_warm_start(c, model_cfg, params, tokenizer, c.workdir, mesh=mesh,
                                       train=False)
