"""The eval protocol: one strategy per task at the eval temperature, per-family success and score.

Test-time strategy scaling (``eval.strategy_samples`` > 1, eval.py only) is
`strata_jax.evaluation.scaling`.

docs/method.md §10: one strategy per task (no FPS, no judge), temperature 0.4; report the success
rate (ALFWorld won, WebShop, ScienceWorld score == 100), the mean score (WebShop score,
ScienceWorld final score 0-100), overall and per task family. Baselines (flat rollout) are
evaluated with one episode per task and no strategy.

`format_metrics` is eval.py's printed report; eval.py's job itself (load a checkpoint, play
`eval_tasks`, write JSON + episodes) is `strata_jax.jobs.evaluate.run_eval`, the one module
that also reaches the test-time scaling, so neither imports the other.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from strata_jax.rollout import RolloutConfig, collect_rollout, dump_trajectories, rollout_stats
from strata_jax.rollout.revision import revision_stats
from strata_jax.rollout.records import LoopStats

# Score units: an episode return in [0,1]-scale units times this gives the env's own score.
SCORE_SCALE = {"scienceworld": 100.0, "webshop": 100.0}


def task_family(task: Any) -> str:
    """The task family of a `Task` before it is played: ALFWorld's ALFRED task type
    (`envs_bridge.alfworld_env.family_from_game_path` of the game path), else the task id up
    to its first "/" (ScienceWorld task name, WebShop "goal", built-in env name)."""
    if task.env == "alfworld":
        from envs_bridge.alfworld_env import family_from_game_path
        try:
            return family_from_game_path(str(task.task_id))
        except ValueError:
            pass
    return str(task.task_id).split("/")[0]


def spread_over_families(tasks: Sequence[Any], n: int) -> list[Any]:
    """The first `n` tasks taken round-robin over families (`task_family`), in list order
    within a family, so that a capped eval set still covers every family it can."""
    by: dict[str, list[Any]] = {}
    for t in tasks:
        by.setdefault(task_family(t), []).append(t)
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
    """`k` tasks of every family (`task_family`), round-robin over families: each family's
    tasks in list order, cycled when it has fewer than `k` (a repeat is another episode of the
    same variation, with its own sampling key)."""
    by: dict[str, list[Any]] = {}
    for t in tasks:
        by.setdefault(task_family(t), []).append(t)
    return [q[i % len(q)] for i in range(k) for q in by.values()]


def eval_tasks(c: Any, split: str) -> list[Any]:
    """The episodes an eval plays: ``eval.episodes_per_family`` per task family of `split`
    (`per_family`; 0 = every task of the split once), at most ``eval.max_tasks`` in all
    (0 = no cap; the cap keeps the round-robin order, so it still covers every family it can).
    An eval list file (``env.eval_list`` with split "test") is played as listed, capped."""
    from strata_jax import experiment as ex
    tasks = ex.task_list(c, split)
    cap = int(c.eval.max_tasks)
    k = int(c.eval.episodes_per_family)
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
    """Success rate and mean score overall and per family from played episodes.

    The family is the one the env named at reset (`Trajectory.family`, the reset info's
    "family": ALFWorld's ALFRED task type, not its game path), else `task_family`.

    Score is in the env's own units (ScienceWorld / WebShop 0-100, else the [0,1] return).
    Crashed episodes count as failures with score 0 (an eval number must not improve because
    an env died). Keys (prefix "eval"; train.py logs its rollouts with prefix "train"):
    <prefix>/success, /score, /episodes, /crashed, <prefix>/family/<family>/success and /score.
    """
    scale = SCORE_SCALE.get(env_name, 1.0)
    by: dict[str, list[tuple[float, float]]] = {}
    crashed = 0
    for tr in trajectories:
        fam = getattr(tr, "family", "") or task_family(tr.spec.task)
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


def episode_stats(trajs: Sequence[Any], groups: Sequence[Any], loop: LoopStats,
                  rc: RolloutConfig, prefix: str = "eval") -> dict[str, float]:
    """What the rollout measures of played episodes, renamed ``rollout/x`` -> ``<prefix>/x``:
    `rollout_stats` (invalid_step_frac, env_rejected_frac, strategy_format_fail_frac for
    StraTA, ...) plus, when `rc` revises strategies, `revision_stats` (revisions,
    revision_format_fail_frac, ...), the same figures `collect_rollout` reports in training.
    Without episodes / success_rate / crashed_episodes (`summarize` gives those per family)."""
    raw = rollout_stats(trajs, groups, loop, strategies=rc.mode == "strata")
    if rc.revision.enabled:
        raw.update(revision_stats(trajs))
    skip = ("rollout/episodes", "rollout/success_rate", "rollout/crashed_episodes")
    return {f"{prefix}/{k.split('/', 1)[1]}": v for k, v in raw.items()
            if k.startswith("rollout/") and k not in skip}


def evaluate(c: Any, policy: Any, pool: Any, builder: Any, tasks: Sequence[Any], key: Any,
             batch_tasks: int = 16, progress: Any = None
             ) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Play one episode per task with the eval protocol.

    Returns (metrics, episode records). Metrics: `summarize`'s (eval/success, eval/score,
    per family, ...) plus what the rollout measured, renamed ``rollout/x`` -> ``eval/x``
    (`episode_stats` over all episodes: invalid_step_frac, env_rejected_frac,
    strategy_format_fail_frac (StraTA only), the revision figures when revising, ...) and the
    cost per task
    (`cost_metrics`: eval/cost/sampled_tokens, eval/cost/env_steps, per family).
    Records: `dump_trajectories` of every episode. This is the one-strategy protocol whatever
    ``eval.strategy_samples`` says (train.py's periodic eval); eval.py's `run_eval` runs
    `test_time.evaluate_scaled` when it is > 1.
    Tasks run in chunks of `batch_tasks` (one rollout call each, so the sampler batch stays
    bounded); each chunk's task uids continue the previous ones so row keys never repeat.
    `progress(done, total, trajectories so far)` is called after each chunk (eval.py's
    progress line: a real model's eval runs for many minutes).
    """
    rc = eval_rollout_config(c)
    trajs, groups, loop = [], [], LoopStats()
    for start in range(0, len(tasks), batch_tasks):
        chunk = list(tasks[start:start + batch_tasks])
        result = collect_rollout(policy, pool, builder, chunk, key=key, config=rc,
                                 task_uid_start=start)
        trajs.extend(result.trajectories)
        groups.extend(result.strategies)
        if progress is not None:
            progress(len(trajs), len(tasks), trajs)
    stats = episode_stats(trajs, groups, loop, rc)
    return ({**summarize(trajs, c.env.name), **stats,
             **cost_metrics(protocol_costs(trajs, groups))}, dump_trajectories(trajs, groups))


# ----------------------------------------------------------------------------- cost


def family_of(tr: Any) -> str:
    """The task family of a played trajectory."""
    return tr.family or task_family(tr.spec.task)


def episode_tokens(tr: Any) -> int:
    """Generated tokens of an episode: its actions, revisions and judge verdict."""
    return (sum(int(s.generation.length) for s in tr.steps)
            + sum(int(rv.generation.length) for rv in tr.revisions) + int(tr.judge_tokens))


def cost_metrics(costs: Sequence[tuple[str, float, float]], prefix: str = "eval"
                 ) -> dict[str, float]:
    """Mean cost per task overall and per family from (family, sampled tokens, env steps)
    triples: <prefix>/cost/sampled_tokens, /cost/env_steps and
    <prefix>/family/<family>/sampled_tokens, /env_steps."""
    out: dict[str, float] = {}
    if not costs:
        return out
    by: dict[str, list[tuple[float, float]]] = {}
    for fam, tok, steps in costs:
        by.setdefault(fam, []).append((tok, steps))
    out[f"{prefix}/cost/sampled_tokens"] = float(np.mean([c[1] for c in costs]))
    out[f"{prefix}/cost/env_steps"] = float(np.mean([c[2] for c in costs]))
    for fam, vs in sorted(by.items()):
        out[f"{prefix}/family/{fam}/sampled_tokens"] = float(np.mean([t for t, _ in vs]))
        out[f"{prefix}/family/{fam}/env_steps"] = float(np.mean([s for _, s in vs]))
    return out


def protocol_costs(trajs: Sequence[Any], groups: Sequence[Any]
                   ) -> list[tuple[str, float, float]]:
    """(family, sampled tokens, env steps) per task of a rollout (`cost_metrics`' input):
    the task's strategy candidates plus its episodes."""
    strat = {g.task_uid: sum(int(gen.length) for gen in g.generations) for g in groups}
    by: dict[int, list[Any]] = {}
    for tr in trajs:
        by.setdefault(tr.spec.task_uid, []).append(tr)
    return [(family_of(ts[0]), float(strat.get(u, 0) + sum(episode_tokens(t) for t in ts)),
             float(sum(len(t.steps) for t in ts))) for u, ts in by.items()]


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
    if "eval/cost/sampled_tokens" in metrics:
        s = int(metrics.get("eval/tts/strategy_samples", 1))
        lines.append(f"cost per task: {metrics['eval/cost/sampled_tokens']:.0f} sampled tokens, "
                     f"{metrics['eval/cost/env_steps']:.1f} env steps"
                     + (f"  ({s} candidates per task)" if s > 1 else ""))
    line = (f"steps: invalid (format) {metrics.get('eval/invalid_step_frac', 0.0):.3f}  "
            f"rejected by the env {metrics.get('eval/env_rejected_frac', 0.0):.3f}")
    if "eval/strategy_format_fail_frac" in metrics:   # absent for flat baselines
        line += f"  strategy format failures {metrics['eval/strategy_format_fail_frac']:.3f}"
    lines.append(line)
    for path in metrics.get("files", []):
        lines.append(f"wrote {path}")
    return "\n".join(lines)
