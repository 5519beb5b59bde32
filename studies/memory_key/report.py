"""The memory_key study's report: per policy its held-out success, each trained policy against
its start (Fisher, McNemar), the mean gains, the training curves with their trend test, and the
figure. Reads what the queue left in --out (kept jobs restored first)."""
from __future__ import annotations

import json
import os

from studies.memory_key.episodes import episode_rows, read_jsonl, summary
from studies.memory_key.queue import is_kept, jobs, restore

def eval_rows(path: str) -> list[dict]:
    return episode_rows(read_jsonl(path[:-len(".json")] + "_trajectories.jsonl"))


def training_curve(workdir: str) -> dict:
    """Per iteration of a run: successes / episodes of its rollout and the fraction of its
    strategies carrying the code (from the dumped trajectories)."""
    by_step: dict[int, list[dict]] = {}
    for tr in read_jsonl(os.path.join(workdir, "trajectories.jsonl")):
        by_step.setdefault(int(tr["step"]), []).append(tr)
    steps = sorted(by_step)
    rows = [episode_rows(by_step[s]) for s in steps]
    return dict(iterations=steps, successes=[sum(r["success"] for r in rs) for rs in rows],
                episodes=[len(rs) for rs in rows],
                carries=[(sum(r["carries"] for r in rs if r["strategy"]) /
                          max(1, sum(r["strategy"] for r in rs))) for rs in rows])


def report(args) -> dict:
    from studies.memory_key import stats as st   # scipy: only when reporting
    queue = jobs(args)
    for job in queue:   # a fresh clone: the kept outputs back where the report reads them
        if is_kept(args, job, queue):
            restore(args, job)
    out, split, e = args.out, "test", args.eval_episodes
    res: dict = dict(settings={k: v for k, v in vars(args).items() if k not in ("only",)},
                     policies={}, tests={}, curves={})
    start = {}
    for prompting in ("strata", "flat"):
        rows = eval_rows(os.path.join(out, f"start_{prompting}", f"eval_{split}_step0.json"))
        if rows:
            start[prompting] = rows
            res["policies"][f"start_{prompting}"] = summary(rows)
    gains: dict[str, list[float]] = {}
    for seed in range(args.seeds):
        for algo in args.algos:
            wd = os.path.join(out, f"run_{algo}_s{seed}")
            res["curves"][f"{algo}_s{seed}"] = cur = training_curve(wd)
            if cur["iterations"]:
                cur["trend_z"], cur["trend_p"] = st.cochran_armitage(cur["successes"],
                                                                      cur["episodes"])
            rows = eval_rows(os.path.join(wd, f"eval_{split}_step{args.iterations}.json"))
            if not rows:
                continue
            name = f"{algo}_s{seed}"
            res["policies"][name] = s = summary(rows)
            base = start.get("strata" if algo == "strata" else "flat")
            if base:
                b = summary(base)
                by_var = {r["variation"]: r["success"] for r in base}
                paired = [(r["success"], by_var[r["variation"]]) for r in rows
                          if r["variation"] in by_var]
                p_mc, nb, nc = st.mcnemar_greater([a for a, _ in paired], [o for _, o in paired])
                res["tests"][name] = dict(
                    start=f"start_{'strata' if algo == 'strata' else 'flat'}",
                    gain=s["success"] - b["success"],
                    fisher_p=st.fisher_greater(s["k"], s["n"], b["k"], b["n"]),
                    mcnemar_p=p_mc, only_trained=nb, only_start=nc)
                gains.setdefault(algo, []).append(s["success"] - b["success"])
    if gains:
        res["gains"] = {a: sum(g) / len(g) for a, g in gains.items()}
        if "strata" in gains and "grpo" in gains:
            res["gains"]["strata_minus_grpo"] = res["gains"]["strata"] - res["gains"]["grpo"]
    if "start_strata" in res["policies"]:
        p0 = res["policies"]["start_strata"]["success"]
        res["detectable_rate"] = dict(start=p0, n=e, rate=st.detectable_rate(p0, e))
    os.makedirs(out, exist_ok=True)   # --report on an --out that no kept job matches
    json.dump(res, open(os.path.join(out, "learning_study.json"), "w"), indent=1)
    print_report(res)
    if any(c["iterations"] for c in res["curves"].values()):
        plot(res, os.path.join(out, "learning_study.png"))
    return res


def print_report(res: dict) -> None:
    print("| policy | success | 95% CI | strategies carrying the code | leaked successes | "
          "invalid steps |")
    print("|---|---|---|---|---|---|")
    for name, s in res["policies"].items():
        car = "-" if s["carries"] is None else f"{100 * s['carries']:.0f}%"
        print(f"| {name} | {s['k']} / {s['n']} ({100 * s['success']:.1f}%) | "
              f"[{100 * s['ci95'][0]:.1f}, {100 * s['ci95'][1]:.1f}] | {car} | "
              f"{s['leaked_successes']} | {100 * s['invalid_step_frac']:.1f}% |")
    for name, t in res["tests"].items():
        print(f"{name} vs {t['start']}: gain {100 * t['gain']:+.1f} points, Fisher p = "
              f"{t['fisher_p']:.3g}, McNemar p = {t['mcnemar_p']:.3g} "
              f"({t['only_trained']} tasks only trained, {t['only_start']} only start)")
    for name, c in res["curves"].items():
        if c["iterations"]:
            print(f"{name} training: successes {c['successes']} of {c['episodes']}, carrying "
                  f"{[round(x, 2) for x in c['carries']]}, trend p = {c['trend_p']:.3g}")
    if "gains" in res:
        print("mean gains:", {k: round(v, 3) for k, v in res["gains"].items()})
    if "detectable_rate" in res:
        d = res["detectable_rate"]
        print(f"detectable at n={d['n']} (80% power, one-sided 5%): {100 * d['start']:.1f}% -> "
              f"{100 * d['rate']:.0f}%")


def eval_points(res: dict, algo: str) -> list[tuple[int, dict]]:
    """The held-out evals of one method as (iteration, `summary`) points: its start (StraTA's
    or flat prompting's) at 0, each seed's final checkpoint at the study's --iterations (where
    it was evaluated, whatever share of a curve a partial queue has run)."""
    start = res["policies"].get("start_" + ("strata" if algo == "strata" else "flat"))
    points = [(0, start)] if start else []
    return points + [(int(res["settings"]["iterations"]), s)
                     for k, s in res["policies"].items() if k.startswith(algo + "_")]


def plot(res: dict, path: str) -> None:
    """Training success and code-carrying fraction per iteration: per method the mean over
    seeds and the min-max band; beside them the held-out evals (squares with their 95% Wilson
    intervals): each method's start at iteration 0, its final checkpoints at the last."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for algo, color in (("strata", "tab:blue"), ("grpo", "tab:orange")):
        curves = [c for k, c in res["curves"].items()
                  if k.startswith(algo + "_") and c["iterations"]]
        if not curves:
            continue
        n = min(len(c["iterations"]) for c in curves)
        x = np.array(curves[0]["iterations"][:n])
        for ax, key in zip(axes, ("success", "carries")):
            if key == "carries" and algo != "strata":
                continue
            ys = np.array([[s / e for s, e in zip(c["successes"][:n], c["episodes"][:n])]
                           if key == "success" else c["carries"][:n] for c in curves])
            ax.plot(x, ys.mean(0), color=color, label=f"{algo} ({len(curves)} seeds)")
            ax.fill_between(x, ys.min(0), ys.max(0), color=color, alpha=0.2)
        for it, s in eval_points(res, algo):
            lo, hi = s["ci95"]
            axes[0].errorbar([it], [s["success"]], yerr=[[s["success"] - lo], [hi - s["success"]]],
                             fmt="s", color=color, capsize=3)
            if algo == "strata" and s["carries"] is not None:
                axes[1].plot([it], [s["carries"]], "s", color=color)
    axes[0].set_title("success rate (line: training; squares: held-out eval)")
    axes[1].set_title("strategies carrying the code")
    for ax in axes:
        ax.set_xlabel("iteration")
        ax.set_ylim(-0.02, 1.02)
        if ax.get_legend_handles_labels()[0]:   # GRPO alone draws no carrying curve
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
