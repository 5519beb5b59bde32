"""What a rollout reports: its scalar metrics (`rollout_stats`) and the JSON-able episode
records of the trajectory dumps (`dump_trajectories`; fields: docs/metrics.md "Trajectories")."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from strata_jax.rollout.records import LoopStats, Trajectory, env_rejected
from strata_jax.rollout.judge import judge_flags
from strata_jax.rollout.strategy import StrategyGroup


def dump_trajectories(trajectories: Sequence[Trajectory],
                      strategies: Sequence[StrategyGroup] = ()) -> list[dict[str, Any]]:
    """JSON-able records of played episodes, one dict per episode (what ``trajectories.jsonl``
    and the eval's ``*_trajectories.jsonl`` hold; every field is described in docs/metrics.md,
    section "Trajectories").

    Episode: env, task_id, variation, task_uid, goal (the env's task text), strategy_id,
    trajectory_id; the strategy stage (StraTA; all None for flat rollouts): strategy_raw (the
    model's whole strategy output), strategy (the parsed plan, the body of its ``<strategy>``
    block; None when the format check failed), strategy_format_ok, strategy_fail_reason,
    strategy_in_prompt (the text every step prompt carried: the plan, or the raw output of a
    failed candidate used as fill); episode_return, success, crashed, error, verdict, bad_steps,
    env_rejected_steps, final_observation. Step: observation (what the step acted on), output
    (the model's raw text), action (the parsed action sent; None when `invalid`), invalid (the
    output failed the action format or hit the token limit: nothing was sent), env_rejected
    (`env_rejected`), feedback (the env's answer to the action), reward, judge_flag,
    ambiguous_resolved (ScienceWorld's option-0 choice of an ambiguous command, else None),
    prompt_tokens / output_tokens (the step prompt's and the generation's token counts: what
    the update's rows are made of).
    With strategy revision (docs/method.md §5.9), an episode that revised also has revisions:
    one dict per revision: step (steps taken before it), trigger ("every" / "stuck"), output
    (the raw text), strategy (the plan in force afterwards), format_ok.
    """
    by_strategy = {(g.task_uid, sid): (g, cand) for g in strategies
                   for sid, cand in enumerate(g.kept)}
    out = []
    for tr in trajectories:
        flags = judge_flags(tr.bad_steps, len(tr.steps))
        g, cand = by_strategy.get((tr.spec.task_uid, tr.spec.strategy_id), (None, None))
        check = g.checks[cand] if g is not None else None
        steps = []
        for t, s in enumerate(tr.steps):
            feedback = tr.observations[t + 1] if t + 1 < len(tr.observations) else None
            steps.append(dict(observation=s.observation, output=s.output_text, action=s.action,
                              invalid=s.invalid, env_rejected=env_rejected(s), feedback=feedback,
                              reward=s.reward, judge_flag=bool(flags[t]),
                              ambiguous_resolved=s.info.get("ambiguous_resolved"),
                              prompt_tokens=s.prompt.num_tokens,
                              output_tokens=int(s.generation.length)))
        out.append(dict(
            env=tr.spec.task.env, task_id=tr.spec.task.task_id,
            variation=tr.spec.task.variation, task_uid=tr.spec.task_uid,
            goal=tr.pieces.task_description if tr.pieces is not None else None,
            strategy_id=tr.spec.strategy_id, trajectory_id=tr.spec.trajectory_id,
            strategy_raw=g.candidates[cand] if g is not None else None,
            strategy=(check.text if not check.format_fail else None) if check else None,
            strategy_format_ok=(not check.format_fail) if check else None,
            strategy_fail_reason=check.reason if check else None,
            strategy_in_prompt=tr.spec.strategy,
            episode_return=tr.episode_return, success=tr.success, crashed=tr.crashed,
            error=tr.error, verdict=tr.verdict, bad_steps=list(tr.bad_steps),
            env_rejected_steps=sum(st["env_rejected"] for st in steps), steps=steps,
            final_observation=tr.observations[-1] if tr.observations else ""))
        if tr.revisions:
            out[-1]["revisions"] = [dict(step=rv.step, trigger=rv.trigger, output=rv.output_text,
                                         strategy=rv.strategy, format_ok=not rv.format_fail)
                                    for rv in tr.revisions]
    return out


def rollout_stats(trajs: Sequence[Trajectory], groups: Sequence[StrategyGroup],
                  loop: LoopStats, strategies: bool = True) -> dict[str, float]:
    """Scalar metrics: episodes, steps, mean_return, success_rate, invalid_step_frac (format
    failures), env_rejected_frac (steps whose action the env refused, `env_rejected`),
    ambiguous_resolved_frac (ScienceWorld commands it resolved to option 0), crashed_episodes,
    judge_bad_step_frac, strategy_format_fail_frac (of kept strategies),
    candidate_format_fail_frac, mean_strategy_len, and timing: wall_s, sampler_s,
    sampler_calls, env_wait_s, env_wait_frac (fraction of rollout wall time blocked on envs).
    ``strategies=False`` (a flat rollout: no strategy is written) leaves the three strategy
    keys out rather than reporting a 0 that reads as "no format failures"."""
    steps = [s for tr in trajs for s in tr.steps]
    ok = [tr for tr in trajs if not tr.crashed]
    judged = [tr for tr in trajs if tr.verdict is not None]
    kept = [g.checks[c] for g in groups for c in g.kept]
    cands = [c for g in groups for c in g.checks]
    mean = lambda xs: float(np.mean(xs)) if len(xs) else 0.0  # noqa: E731
    out = {
        "rollout/episodes": float(len(trajs)),
        "rollout/steps": float(len(steps)),
        "rollout/mean_return": mean([tr.episode_return for tr in ok]),
        "rollout/success_rate": mean([float(tr.success) for tr in ok]),
        "rollout/mean_episode_steps": mean([len(tr.steps) for tr in trajs]),
        "rollout/invalid_step_frac": mean([float(s.invalid) for s in steps]),
        "rollout/env_rejected_frac": mean([float(env_rejected(s)) for s in steps]),
        "rollout/ambiguous_resolved_frac": mean([float(s.info.get("ambiguous_resolved")
                                                       is not None) for s in steps]),
        "rollout/crashed_episodes": float(sum(tr.crashed for tr in trajs)),
        "rollout/judge_bad_step_frac": mean([len(tr.bad_steps) / len(tr.steps) for tr in judged]),
        "rollout/strategy_format_fail_frac": mean([float(c.format_fail) for c in kept]),
        "rollout/candidate_format_fail_frac": mean([float(c.format_fail) for c in cands]),
        "rollout/mean_strategy_len": mean([c.token_len for c in kept]),
        "time/rollout_wall_s": loop.wall_s,
        "time/sampler_s": loop.sampler_s,
        "time/sampler_calls": float(loop.sampler_calls),
        "time/env_wait_s": loop.env_wait_s,
        "time/env_wait_frac": loop.env_wait_frac,
    }
    if not strategies:
        for k in ("strategy_format_fail_frac", "candidate_format_fail_frac", "mean_strategy_len"):
            del out[f"rollout/{k}"]
    return out
