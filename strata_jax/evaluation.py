"""Evaluation: one strategy per task at the eval temperature, per-family success and score.

method.md 2.10: one strategy per task (no FPS, no judge), temperature 0.4; report the success
rate (ALFWorld won, WebShop, ScienceWorld score == 100), the mean score (WebShop score,
ScienceWorld final score 0-100), overall and per task family. Baselines (flat rollout) are
evaluated with one episode per task and no strategy.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

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
