"""The fair memory_key study's report, the analysis its write-up registers: per policy and eval
set the success with its Wilson interval (and, under StraTA prompting, the strategies carrying
the code and the successes whose code reached the keypad some other way); each trained policy
against its start on the same tasks (one-sided Fisher and exact McNemar); per arm the mean
gain over seeds with its t interval; between arms Welch's t on the per-seed gains; the training
curves. Reads what the queue left in --out (kept jobs restored first); writes
``--out/memory_key_fair.json`` and the same under --results."""
from __future__ import annotations

import json
import os

from studies.memory_key import queue as mq
from studies.memory_key.episodes import episode_rows, read_jsonl, summary
from studies.memory_key.report import training_curve


def _rows(wd: str, step: int) -> list[dict]:
    return episode_rows(read_jsonl(os.path.join(wd, f"eval_test_step{step}_trajectories.jsonl")))


def report(a) -> dict:
    """Everything that ran, analysed (every run reported; an arm's statistics over the seeds
    that finished, their number stated)."""
    from studies.memory_key import stats as st   # scipy: only when reporting
    from studies.memory_key_fair.run import ARMS, EVAL_SETS, PROMPTING, SEEDS, jobs, resolve
    queue = jobs(a)
    for job in queue:
        j = resolve(a, job) or job
        if mq.is_kept(a, j, queue):
            mq.restore(a, j)
    out = a.out
    res: dict = dict(policies={}, tests={}, curves={}, gains={}, between={})
    starts = {}
    for prompting in ("strata", "flat"):
        for s in EVAL_SETS:
            name = f"start_{prompting}" + ("" if s == "test" else f"_{s}")
            rows = _rows(os.path.join(out, name), 0)
            if rows:
                starts[(prompting, s)] = rows
                res["policies"][name] = summary(rows)
    for arm in ARMS:
        for seed in SEEDS[arm]:
            run = f"{arm}_s{seed}"
            cur = training_curve(os.path.join(out, f"run_{run}"))
            if cur["iterations"]:
                cur["trend_z"], cur["trend_p"] = st.cochran_armitage(cur["successes"],
                                                                      cur["episodes"])
                res["curves"][run] = cur
            for s in EVAL_SETS:
                rows = _rows(os.path.join(out, f"final_{run}_{s}"), a.iterations)
                base = starts.get((PROMPTING[arm], s))
                if not rows:
                    continue
                res["policies"][f"{run}_{s}"] = p = summary(rows)
                if not base:
                    continue
                b = summary(base)
                by_var = {r["variation"]: r["success"] for r in base}
                paired = [(r["success"], by_var[r["variation"]]) for r in rows
                          if r["variation"] in by_var]
                p_mc, only_t, only_s = st.mcnemar_greater([x for x, _ in paired],
                                                          [y for _, y in paired])
                res["tests"][f"{run}_{s}"] = dict(
                    gain=p["success"] - b["success"],
                    fisher_p=st.fisher_greater(p["k"], p["n"], b["k"], b["n"]),
                    mcnemar_p=p_mc, only_trained=only_t, only_start=only_s)
    for s in EVAL_SETS:
        per_arm = {arm: [res["tests"][f"{arm}_s{seed}_{s}"]["gain"] for seed in SEEDS[arm]
                         if f"{arm}_s{seed}_{s}" in res["tests"]] for arm in ARMS}
        for arm, g in per_arm.items():
            if g:
                m, lo, hi = st.mean_t_interval(g)
                res["gains"][f"{arm}_{s}"] = dict(seeds=len(g), mean=m, t95=[lo, hi], each=g)
        for other in ("grpo_full", "strata_traj"):
            if per_arm["strata"] and per_arm[other]:
                res["between"][f"strata_vs_{other}_{s}"] = dict(
                    diff=(sum(per_arm["strata"]) / len(per_arm["strata"])
                          - sum(per_arm[other]) / len(per_arm[other])),
                    welch_p=st.welch_p(per_arm["strata"], per_arm[other]))
    res["summary"] = {k: round(v["mean"], 3) for k, v in res["gains"].items()}
    for d in (out, a.results):
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "memory_key_fair.json"), "w") as f:
            json.dump(res, f, indent=1)
    print_report(res)
    return res


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def print_report(res: dict) -> None:
    """The report's markdown tables (the write-up pastes them)."""
    print("| policy / eval set | success | 95% Wilson | strategies carrying the code | "
          "leaked successes |")
    print("|---|---|---|---|---|")
    for name, p in res["policies"].items():
        car = "-" if p["carries"] is None else f"{100 * p['carries']:.0f}%"
        print(f"| {name} | {p['k']} / {p['n']} | [{_pct(p['ci95'][0])}, {_pct(p['ci95'][1])}] "
              f"| {car} | {p['leaked_successes']} |")
    print()
    print("| run / eval set | gain (points) | Fisher p | McNemar p (only trained / only start) |")
    print("|---|---|---|---|")
    for name, t in res["tests"].items():
        print(f"| {name} | {100 * t['gain']:+.1f} | {t['fisher_p']:.3g} | {t['mcnemar_p']:.3g} "
              f"({t['only_trained']} / {t['only_start']}) |")
    print()
    for name, g in res["gains"].items():
        print(f"{name}: mean gain {100 * g['mean']:+.1f} points over {g['seeds']} seed(s), "
              f"t95 [{_pct(g['t95'][0])}, {_pct(g['t95'][1])}]")
    for name, b in res["between"].items():
        print(f"{name}: difference of mean gains {100 * b['diff']:+.1f} points, Welch p = "
              f"{b['welch_p']:.3g}")
    for name, c in res["curves"].items():
        print(f"{name} training: successes {c['successes']} of {c['episodes']}, trend p = "
              f"{c['trend_p']:.3g}")
