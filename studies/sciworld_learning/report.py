"""The ScienceWorld learning study's report, the analysis its write-up registers: per policy,
family and overall the success (Wilson interval) and mean score; each trained policy against
the start of its prompting on the same test variations (success: one-sided Fisher and exact
McNemar on the pairs; score: one-sided paired Wilcoxon and a bootstrap interval of the mean
paired difference); per run the training curve (mean score and success per iteration) and its
zero-variance groups, invalid and rejected steps. Reads what the queue left in --out (kept
jobs restored first); writes ``<out>/sciworld_learning.json`` and the same under --results."""
from __future__ import annotations

import json
import os

from studies.memory_key import queue as mq
from studies.memory_key.episodes import read_jsonl


def episode_rows(trajs: list[dict]) -> list[dict]:
    """One row per eval episode: family (task_id), variation, success, score (0-100: the
    episode's return x 100, ScienceWorld's own scale), steps, invalid and rejected steps."""
    rows = []
    for t in trajs:
        steps = t.get("steps") or []
        rows.append(dict(family=t["task_id"], variation=int(t.get("variation", -1)),
                         success=bool(t.get("success")),
                         score=100.0 * float(t.get("episode_return") or 0.0), steps=len(steps),
                         invalid=sum(bool(s.get("invalid")) for s in steps),
                         rejected=sum(bool(s.get("env_rejected")) for s in steps)))
    return rows


def policy_summary(rows: list[dict]) -> dict:
    """Success k / n with its Wilson interval, mean score, invalid and rejected step fractions."""
    from studies.memory_key.stats import wilson
    n, k = len(rows), sum(r["success"] for r in rows)
    steps = sum(r["steps"] for r in rows) or 1
    lo, hi = wilson(k, n) if n else (0.0, 0.0)
    return dict(n=n, k=k, success=k / n if n else 0.0, ci95=[lo, hi],
                score=sum(r["score"] for r in rows) / n if n else 0.0,
                invalid_frac=sum(r["invalid"] for r in rows) / steps,
                rejected_frac=sum(r["rejected"] for r in rows) / steps)


def against_start(rows: list[dict], start: list[dict]) -> dict:
    """A trained policy's episodes against the start's on the same (family, variation) pairs
    (episodes without a partner are left out, their count reported)."""
    from studies.memory_key import stats as st
    base = {(r["family"], r["variation"]): r for r in start}
    pairs = [(r, base[(r["family"], r["variation"])]) for r in rows
             if (r["family"], r["variation"]) in base]
    if not pairs:
        return dict(pairs=0, unpaired=len(rows))
    after, before = [a["success"] for a, _ in pairs], [b["success"] for _, b in pairs]
    diffs = [a["score"] - b["score"] for a, b in pairs]
    m, lo, hi = st.bootstrap_mean_interval(diffs)
    p_mc, gained, lost = st.mcnemar_greater(after, before)
    return dict(pairs=len(pairs), unpaired=len(rows) - len(pairs),
                fisher_p=st.fisher_greater(sum(after), len(after), sum(before), len(before)),
                mcnemar_p=p_mc, gained=gained, lost=lost,
                score_diff=m, score_diff_ci95=[lo, hi], wilcoxon_p=st.wilcoxon_greater(diffs))


def training_curve(workdir: str) -> dict:
    """Per iteration of a run's metrics.jsonl: mean training return x 100 (score), success,
    the fraction of groups with zero reward variance, invalid and env-rejected step fractions
    (None where the run did not log the metric)."""
    rows = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))
            if "rollout/mean_return" in r]
    keys = dict(score="rollout/mean_return", success="rollout/success_rate",
                zero_var_groups="adv/zero_var_group_frac", invalid="rollout/invalid_step_frac",
                rejected="rollout/env_rejected_frac")
    out = {k: [r.get(m) for r in rows] for k, m in keys.items()}
    out["score"] = [100.0 * v for v in out["score"]]
    out["iterations"] = [int(r["step"]) for r in rows]
    return out


def report(a) -> dict:
    """Everything that ran, analysed: every run reported, an arm's means over the seeds that
    finished (their number stated)."""
    from studies.sciworld_learning.run import ARMS, PROMPTING, SEEDS, jobs, resolve
    queue = jobs(a)
    for job in queue:
        j = resolve(a, job) or job
        if mq.is_kept(a, j, queue):
            mq.restore(a, j)
    res: dict = dict(policies={}, tests={}, curves={}, families={})
    screen = os.path.join(a.out, "screen", "eval_dev_step0_trajectories.jsonl")
    res["policies"]["screen"] = _by_family(episode_rows(read_jsonl(screen)))
    starts = {}
    for prompting in ("strata", "flat"):
        rows = episode_rows(read_jsonl(os.path.join(a.out, f"start_{prompting}",
                                                    "eval_test_step0_trajectories.jsonl")))
        if rows:
            starts[prompting] = rows
            res["policies"][f"start_{prompting}"] = _by_family(rows)
    for arm in ARMS:
        for seed in SEEDS[arm]:
            run = f"{arm}_s{seed}"
            cur = training_curve(os.path.join(a.out, f"run_{run}"))
            if cur["iterations"]:
                res["curves"][run] = cur
            rows = episode_rows(read_jsonl(os.path.join(
                a.out, f"final_{run}", f"eval_test_step{a.iterations}_trajectories.jsonl")))
            if not rows:
                continue
            res["policies"][run] = _by_family(rows)
            start = starts.get(PROMPTING[arm], [])
            res["tests"][run] = {f: against_start([r for r in rows if f == "overall"
                                                   or r["family"] == f], start)
                                 for f in ["overall"] + sorted({r["family"] for r in rows})}
    for path in (os.path.join(a.out, "sciworld_learning.json"),
                 os.path.join(a.results, "sciworld_learning.json")):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    return res


def _by_family(rows: list[dict]) -> dict:
    """{"overall": policy_summary, <family>: policy_summary} ({} without rows)."""
    if not rows:
        return {}
    out = {"overall": policy_summary(rows)}
    for fam in sorted({r["family"] for r in rows}):
        out[fam] = policy_summary([r for r in rows if r["family"] == fam])
    return out


__all__ = ["episode_rows", "policy_summary", "against_start", "training_curve", "report"]
