"""Does it learn? StraTA vs GRPO from the same behaviour-cloning warm start, on CPU (issue 10).

    python benchmarks/learning.py                      # full: (a) 3 seeds x 12 it, (b) 1 seed x 6 it
    python benchmarks/learning.py --iterations 3 --seeds 1 --sw-iterations 2   # short check

(a) memory_key (configs/builtin.py:tiny; the vault code is shown ONLY in the first observation),
    StraTA (N=2 strategies x M=4 episodes per task) vs GRPO with the matched budget
    (group_size = N*M = 8), 4 tasks per iteration = 32 episodes per iteration for both;
    ``--seeds`` seeds each.
(b) ScienceWorld tasks with short gold paths (configs/sciworld.py:tiny with a raised step limit
    and the tasks below), same comparison, ``--sw-seeds`` seed each.

Each env's warm start is trained ONCE (sft.py's `run`, cached in ``<out>/warm_start_<env>``;
not counted in the RL time) and every RL run starts from that export
(``model.path=<export>``, offline tokenizer). Printed per iteration: success rate (and
ScienceWorld score = 100 x mean episode return) as mean and spread (min-max) over seeds, the
rollouts of iteration i being played by the policy after i updates. Saves ``<out>/learning.png``
and ``<out>/learning.json``. Measures, never asserts.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ScienceWorld families with the shortest gold paths (docs: scienceworld_tasks.md): 5-7 steps.
SW_TASKS = ("find-non-living-thing", "lifespan-longest-lived", "lifespan-shortest-lived")


def memory_key_config(args, algo: str, seed: int):
    from configs import builtin
    c = builtin.get_config("tiny")
    c.algo, c.seed, c.iterations = algo, seed, args.iterations
    c.sft.steps = args.sft_steps
    return c


def sciworld_config(args, algo: str, seed: int):
    from configs import sciworld
    c = sciworld.get_config("tiny")
    c.algo, c.seed, c.iterations = algo, seed, args.sw_iterations
    c.env.tasks = SW_TASKS
    c.env.max_steps = 10           # gold 5-7 steps + slack (the tiny run's 4 cannot succeed)
    c.env.max_prompt_tokens = 1024
    c.rollout.tasks_per_batch = 2
    c.rollout.num_strategies, c.rollout.episodes_per_strategy, c.rollout.oversample = 2, 2, 2
    c.rollout.group_size = 4       # = N * M
    c.rollout.max_action_tokens = 48
    c.rollout.max_strategy_tokens = 128
    c.rollout.max_judge_tokens = 16
    c.sft.episodes, c.sft.steps, c.sft.noise, c.sft.lr = 24, args.sft_steps, 0.15, 5e-3
    c.ckpt.every = 100
    return c


def warm_start(make, args, env: str) -> str:
    """Train (or reuse) the env's warm start; returns the export dir."""
    from strata_jax.training import sft
    c = make(args, "strata", 0)
    out = os.path.join(args.out, f"warm_start_{env}")
    t0 = time.time()
    res = sft.export_warm_start(c, out, log_fn=print)
    m = res["meta"]
    print(f"[{env}] warm start {'(cached) ' if res['cached'] else ''}{out}: "
          f"{m['episodes']} expert episodes, examples {m['examples']}, loss "
          f"{m['first_loss']:.3f} -> {m['final_loss']:.3f}, {time.time() - t0:.0f} s", flush=True)
    return out


def rl_run(make, args, env: str, algo: str, seed: int, export: str) -> dict:
    """One RL run from the export; returns per-iteration metrics."""
    import train
    from strata_jax.metrics import read_jsonl
    c = make(args, algo, seed)
    if algo == "grpo":
        c.rollout.group_size = c.rollout.num_strategies * c.rollout.episodes_per_strategy
    c.model.path, c.model.preset, c.model.tokenizer, c.model.warm_start = export, "", "offline", ""
    c.workdir = os.path.join(args.out, env, f"{algo}_s{seed}")
    shutil.rmtree(c.workdir, ignore_errors=True)
    t0 = time.time()
    summary = train.run(c)
    wall = time.time() - t0
    rows = read_jsonl(os.path.join(c.workdir, "metrics.jsonl"))
    succ = [r.get("rollout/success_rate") or 0.0 for r in rows]
    ret = [r.get("rollout/mean_return") or 0.0 for r in rows]
    eps = [r.get("rollout/episodes") or 0.0 for r in rows]
    print(f"[{env}] {algo} seed {seed}: {summary['status']} after {summary['step']} iterations, "
          f"{wall:.0f} s; success {['%.2f' % s for s in succ]}", flush=True)
    return dict(env=env, algo=algo, seed=seed, success=succ, mean_return=ret, episodes=eps,
                wall_s=wall, iterations=len(rows))


def summarise(runs: list[dict], env: str) -> dict:
    """Mean and min-max over seeds per iteration, per algo; prints the table."""
    import numpy as np
    out = {}
    for algo in ("strata", "grpo"):
        rs = [r for r in runs if r["env"] == env and r["algo"] == algo]
        if not rs:
            continue
        n = min(r["iterations"] for r in rs)
        s = np.array([r["success"][:n] for r in rs])
        ret = np.array([r["mean_return"][:n] for r in rs])
        out[algo] = dict(seeds=len(rs), iterations=n, success_mean=s.mean(0).tolist(),
                         success_min=s.min(0).tolist(), success_max=s.max(0).tolist(),
                         score_mean=(100 * ret.mean(0)).tolist(),
                         score_min=(100 * ret.min(0)).tolist(),
                         score_max=(100 * ret.max(0)).tolist(),
                         episodes_per_iteration=float(np.mean([r["episodes"][0] for r in rs])),
                         wall_s=float(sum(r["wall_s"] for r in rs)))
    print(f"\n== {env}: success rate per iteration (mean [min, max] over seeds)"
          + (", ScienceWorld score" if env == "sciworld" else ""))
    for algo, d in out.items():
        print(f"{algo}: {d['seeds']} seed(s) x {d['iterations']} iterations, "
              f"{d['episodes_per_iteration']:.0f} episodes/iteration, RL wall {d['wall_s']:.0f} s")
        for i in range(d["iterations"]):
            line = (f"  it {i:2d}  success {d['success_mean'][i]:.3f} "
                    f"[{d['success_min'][i]:.3f}, {d['success_max'][i]:.3f}]")
            if env == "sciworld":
                line += (f"  score {d['score_mean'][i]:6.1f} "
                         f"[{d['score_min'][i]:.1f}, {d['score_max'][i]:.1f}]")
            print(line)
    return out


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [(env, key) for env in results for key in
              (("success",) if env == "memory_key" else ("success", "score"))]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    for ax, (env, key) in zip(axes[0], panels):
        for algo, d in results[env].items():
            x = list(range(d["iterations"]))
            ax.plot(x, d[f"{key}_mean"], marker="o", label=f"{algo} ({d['seeds']} seeds)")
            ax.fill_between(x, d[f"{key}_min"], d[f"{key}_max"], alpha=0.2)
        ax.set_title(f"{env}: {'success rate' if key == 'success' else 'score (0-100)'}")
        ax.set_xlabel("iteration (rollout after i updates)")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="runs/learning")
    ap.add_argument("--iterations", type=int, default=12, help="memory_key iterations per run")
    ap.add_argument("--seeds", type=int, default=3, help="memory_key seeds per method")
    ap.add_argument("--sw-iterations", type=int, default=6, help="ScienceWorld iterations per run")
    ap.add_argument("--sw-seeds", type=int, default=1, help="ScienceWorld seeds per method (0 = skip)")
    ap.add_argument("--sft-steps", type=int, default=300, help="behaviour-cloning steps")
    ap.add_argument("--algos", default="strata,grpo")
    args = ap.parse_args()
    from strata_jax.metrics import quiet_logs
    quiet_logs()
    os.makedirs(args.out, exist_ok=True)
    algos = [a for a in args.algos.split(",") if a]
    results, runs, t_rl = {}, [], 0.0
    for env, make, seeds in (("memory_key", memory_key_config, args.seeds),
                             ("sciworld", sciworld_config, args.sw_seeds)):
        if seeds <= 0:
            continue
        export = warm_start(make, args, env)
        for seed in range(seeds):
            for algo in algos:
                r = rl_run(make, args, env, algo, seed, export)
                t_rl += r["wall_s"]
                runs.append(r)
        results[env] = summarise(runs, env)
    print(f"\nRL wall time, all runs: {t_rl:.0f} s ({t_rl / 60:.1f} min)")
    with open(os.path.join(args.out, "learning.json"), "w") as f:
        json.dump(dict(args=vars(args), results=results, runs=runs, rl_wall_s=t_rl), f, indent=1)
    plot(results, os.path.join(args.out, "learning.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
