"""Evaluation: one strategy per task at the eval temperature, per-family success and score.

docs/method.md §10: one strategy per task (no FPS, no judge), temperature 0.4; report the success
rate (ALFWorld won, WebShop, ScienceWorld score == 100), the mean score (WebShop score,
ScienceWorld final score 0-100), overall and per task family. Baselines (flat rollout) are
evaluated with one episode per task and no strategy.

`run_eval` is eval.py's job (load a checkpoint, play `eval_tasks`, write JSON + episodes);
`format_metrics` its printed report.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from strata_jax.rollout import RolloutConfig, collect_rollout, dump_trajectories, rollout_stats
from strata_jax.rollout.episodes import LoopStats

# Score units: an episode return in [0,1]-scale units times this gives the env's own score.
SCORE_SCALE = {"scienceworld": 100.0, "webshop": 100.0}


def spread_over_families(tasks: Sequence[Any], n: int) -> list[Any]:
    """The first `n` tasks taken round-robin over families (task ids), in list order within
    a family, so that a capped eval set still covers every family it can."""
    by: dict[str, list[Any]] = {}
    for t in tasks:
        by.setdefault(str(t.task_id).split("/")[0], []).append(t)
    out: list[Any] = []
    queues = list(by.values())
    i = 0
    while len(out) < min(n, len(tasks)):
        q = queues[i % len(queues)]
        idx = i // len(queues)
        if idx < len(q):
            out.append(q[idx])
        i += 1
    return out


def per_family(tasks: Sequence[Any], k: int) -> list[Any]:
    """`k` tasks of every family (task id), round-robin over families: each family's tasks in
    list order, cycled when it has fewer than `k` (a repeat is another episode of the same
    variation, with its own sampling key)."""
    by: dict[str, list[Any]] = {}
    for t in tasks:
        by.setdefault(str(t.task_id).split("/")[0], []).append(t)
    return [q[i % len(q)] for i in range(k) for q in by.values()]


def eval_tasks(c: Any, split: str) -> list[Any]:
    """The episodes an eval plays: ``eval.episodes_per_family`` per task family of `split`
    (`per_family`; 0 = every task of the split once), at most ``eval.max_tasks`` in all
    (0 = no cap; the cap keeps the round-robin order, so it still covers every family it can).
    An eval list file (``env.eval_list`` with split "test") is played as listed, capped."""
    from strata_jax import experiment as ex
    tasks = ex.task_list(c, split)
    cap = int(c.eval.max_tasks)
    k = int(c.eval.get("episodes_per_family", 0))
    if not (split == "test" and c.env.eval_list):
        tasks = per_family(tasks, k) if k > 0 else spread_over_families(tasks, len(tasks))
    return list(tasks[:cap]) if cap > 0 else list(tasks)


def eval_rollout_config(c: Any) -> RolloutConfig:
    """The training rollout config turned into the eval protocol: N = M = sigma = 1 (StraTA) or
    group_size = 1 (baselines), no FPS, no judge, temperature c.eval.temperature."""
    base = RolloutConfig.from_config(c)
    return dataclasses.replace(base, num_strategies=1, episodes_per_strategy=1, oversample=1,
                               group_size=1, diverse_sampling=False, self_judgment=False,
                               temperature=float(c.eval.temperature), dapo_refill=False)


def summarize(trajectories: Sequence[Any], env_name: str, prefix: str = "eval"
              ) -> dict[str, float]:
    """Success rate and mean score overall and per family (the task id) from played episodes.

    Score is in the env's own units (ScienceWorld / WebShop 0-100, else the [0,1] return).
    Crashed episodes count as failures with score 0 (an eval number must not improve because
    an env died). Keys (prefix "eval"; train.py logs its rollouts with prefix "train"):
    <prefix>/success, /score, /episodes, /crashed, <prefix>/family/<family>/success and /score.
    """
    scale = SCORE_SCALE.get(env_name, 1.0)
    by: dict[str, list[tuple[float, float]]] = {}
    crashed = 0
    for tr in trajectories:
        fam = str(tr.spec.task.task_id).split("/")[0]
        ok = not tr.crashed
        crashed += int(tr.crashed)
        by.setdefault(fam, []).append((float(ok and tr.success),
                                       scale * tr.episode_return if ok else 0.0))
    allv = [v for vs in by.values() for v in vs]
    p = prefix
    out = {f"{p}/episodes": float(len(allv)), f"{p}/crashed": float(crashed),
           f"{p}/success": float(np.mean([s for s, _ in allv])) if allv else 0.0,
           f"{p}/score": float(np.mean([x for _, x in allv])) if allv else 0.0}
    for fam, vs in sorted(by.items()):
        out[f"{p}/family/{fam}/success"] = float(np.mean([s for s, _ in vs]))
        out[f"{p}/family/{fam}/score"] = float(np.mean([x for _, x in vs]))
    return out


def evaluate(c: Any, policy: Any, pool: Any, builder: Any, tasks: Sequence[Any], key: Any,
             batch_tasks: int = 16) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Play one episode per task with the eval protocol.

    Returns (metrics, episode records). Metrics: `summarize`'s (eval/success, eval/score,
    per family, ...) plus what the rollout measured, renamed ``rollout/x`` -> ``eval/x``
    (invalid_step_frac, env_rejected_frac, strategy_format_fail_frac, mean_episode_steps,
    ...; `rollout_stats` over all episodes). Records: `dump_trajectories` of every episode.
    Tasks run in chunks of `batch_tasks` (one rollout call each, so the sampler batch stays
    bounded); each chunk's task uids continue the previous ones so row keys never repeat.
    """
    rc = eval_rollout_config(c)
    trajs, groups, loop = [], [], LoopStats()
    for start in range(0, len(tasks), batch_tasks):
        chunk = list(tasks[start:start + batch_tasks])
        result = collect_rollout(policy, pool, builder, chunk, key=key, config=rc,
                                 task_uid_start=start)
        trajs.extend(result.trajectories)
        groups.extend(result.strategies)
    stats = {"eval/" + k.split("/", 1)[1]: v
             for k, v in rollout_stats(trajs, groups, loop).items()
             if k.startswith("rollout/") and k not in ("rollout/episodes", "rollout/success_rate",
                                                       "rollout/crashed_episodes")}
    return {**summarize(trajs, c.env.name), **stats}, dump_trajectories(trajs, groups)


def run_eval(c, split: str | None = None, step: int | None = None,
             use_checkpoint: bool = True) -> dict:
    """Evaluate and return the metrics dict (see strata_jax.evaluation.evaluate) plus "step"
    and "files" (the JSON and trajectory paths written, process 0 only).

    Loads the run's checkpoint (``<workdir>/ckpt``, the newest restorable or `step`), or with
    ``use_checkpoint=False`` the config's model (``model.path`` / ``model.preset`` plus a warm
    start that is already cached), and nothing else: no warm start is ever trained here. Plays
    `eval_tasks` with `evaluate` and writes ``<workdir>/eval_<split>_step<k>.json`` (metrics)
    and ``..._trajectories.jsonl`` (every episode, `dump_trajectories` records).

    Raises ConfigError (bad config; with use_checkpoint=False a warm start that is not cached)
    and FileNotFoundError (no restorable checkpoint in the run folder).
    """
    import json
    import os

    from strata_jax import experiment as ex
    from strata_jax.rollout import SamplerPolicy, make_prompt_builder
    from strata_jax.sampling import Sampler
    from strata_jax.training import Checkpointer, Trainer, TrainConfig

    ex.validate(c)
    ex.resolve(c)
    ex.check_env(c)   # e.g. the WebShop server answers
    split = split or c.eval.split
    ckpt_dir = os.path.join(c.workdir, "ckpt")
    if use_checkpoint and not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"no checkpoint in {ckpt_dir}; train first (python train.py "
                                "with the same --config) or pass --no_checkpoint to evaluate "
                                "config.model as is")
    mesh = ex.build_mesh(c)
    tokenizer = ex.build_tokenizer(c)
    at = 0
    if use_checkpoint:
        trainer = Trainer(ex.model_config(c, tokenizer), TrainConfig.from_config(c), mesh)
        model_cfg = trainer.model
        # LoRA adapters need their frozen base (the run's initial params); full fine-tuning
        # needs only the shapes: nothing is loaded or trained besides the checkpoint.
        base = (ex.build_model(c, tokenizer, mesh, train_warm_start=False)[1] if trainer.lora
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
        print(f"evaluating checkpoint step {at} of {c.workdir}", flush=True)
    else:
        model_cfg, params = ex.build_model(c, tokenizer, mesh, train_warm_start=False)
        print(f"evaluating the config's model as is ({c.model.path or 'preset ' + c.model.preset}"
              + (f", warm start {c.model.warm_start}" if c.model.warm_start else "") + ")",
              flush=True)
    tasks = eval_tasks(c, split)
    sampler = Sampler(model_cfg, mesh=mesh, max_cache_len=ex.max_cache_len(c, model_cfg))
    policy = SamplerPolicy(sampler, ex.sampler_layout(c, model_cfg,
                                                      ex.sampler_params(c, params)))
    builder = make_prompt_builder(tokenizer, c)
    pool = ex.build_pool(c)
    print(f"playing {len(tasks)} episodes on split {split!r} "
          f"({int(c.eval.get('episodes_per_family', 0))} per family) ...", flush=True)
    try:
        metrics, episodes = evaluate(c, policy, pool, builder, tasks, key=ex.seed_key(c, 2, at))
    finally:
        pool.close()
    metrics["step"] = at
    metrics["files"] = []
    if jax.process_index() == 0:   # multi-host: process 0 writes
        os.makedirs(c.workdir, exist_ok=True)
        stem = os.path.join(c.workdir, f"eval_{split}_step{at}")
        with open(stem + ".json", "w") as f:
            json.dump({k: v for k, v in metrics.items() if k != "files"}, f, indent=1)
        with open(stem + "_trajectories.jsonl", "w") as f:
            for rec in episodes:
                f.write(json.dumps({"step": at, **rec}, default=str) + "\n")
        metrics["files"] = [stem + ".json", stem + "_trajectories.jsonl"]
    return metrics


def format_metrics(metrics: dict) -> str:
    """The eval's printed report: one line per family, the overall line, the step fractions
    and the files written."""
    lines = []
    for k, v in sorted(metrics.items()):
        if k.startswith("eval/family/") and k.endswith("/success"):
            fam = k[len("eval/family/"):-len("/success")]
            score = metrics.get(f"eval/family/{fam}/score", float("nan"))
            lines.append(f"  {fam:<50s} success {v:6.3f}  score {score:8.2f}")
    lines.append(f"overall: success {metrics['eval/success']:.3f}  score {metrics['eval/score']:.2f}"
                 f"  episodes {int(metrics['eval/episodes'])}  (step {metrics['step']})")
    lines.append(f"steps: invalid (format) {metrics.get('eval/invalid_step_frac', 0.0):.3f}  "
                 f"rejected by the env {metrics.get('eval/env_rejected_frac', 0.0):.3f}  "
                 f"strategy format failures {metrics.get('eval/strategy_format_fail_frac', 0.0):.3f}")
    for path in metrics.get("files", []):
        lines.append(f"wrote {path}")
    return "\n".join(lines)
