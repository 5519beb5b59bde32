"""Does it learn? StraTA vs GRPO from the same behaviour-cloning warm start, on CPU.

    python -m studies.learning.run            # full: (a) 3 seeds x 8 it, (b) 1 seed x 5 it
    python -m studies.learning.run --iterations 3 --seeds 1 --sw-iterations 2   # short check

(a) memory_key (configs/builtin.py:tiny; the 1-digit vault code is shown ONLY in the first
    observation, so a policy without memory succeeds by guessing 1 time in 10),
    StraTA (N=2 strategies x M=4 episodes per task) vs GRPO with the matched budget
    (group_size = N*M = 8), 4 tasks per iteration = 32 episodes per iteration for both;
    ``--seeds`` seeds each.
(b) ScienceWorld tasks with short gold paths (configs/sciworld.py:tiny with a raised step limit
    and the tasks below), same comparison, ``--sw-seeds`` seed each.

Each env's warm start is trained ONCE (sft.py's `run`, cached in ``<out>/warm_start_<env>``;
not counted in the RL time) and every RL run starts from that export
(``model.warm_start=<export>``). Printed per iteration: success rate (and
ScienceWorld score = 100 x mean episode return) as mean and spread (min-max) over seeds, the
rollouts of iteration i being played by the policy after i updates. Before the memory_key runs
it probes the warm start: p(correct code digit) on strategy rows and on StraTA / flat vault rows
of clean dev-split experts (`code_copy_probe`; chance = 0.1). Saves ``<out>/learning.png`` and
``<out>/learning.json``. Measures, never asserts.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time


# ScienceWorld families with the shortest gold paths (docs/method.md §11.1): 5-7 steps.
SW_TASKS = ("find-non-living-thing", "lifespan-longest-lived", "lifespan-shortest-lived")


def memory_key_config(args, algo: str, seed: int):
    from configs import builtin
    c = builtin.get_config("tiny")
    c.algo, c.seed, c.iterations = algo, seed, args.iterations
    if args.sft_steps:
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
    c.sft.episodes = 24            # 8 gold paths per task family (+ 15% noise, the tiny's SFT)
    if args.sft_steps:
        c.sft.steps = args.sft_steps
    c.ckpt.every = 100
    return c


def warm_start(make, args, env: str) -> str:
    """Train (or reuse) the env's warm start; returns the export dir."""
    from strata_jax.jobs.warm_start import export_warm_start
    c = make(args, "strata", 0)
    out = os.path.join(args.out, f"warm_start_{env}")
    t0 = time.time()
    res = export_warm_start(c, out, log_fn=print)
    m = res["meta"]
    print(f"[{env}] warm start {'(cached) ' if res['cached'] else ''}{out}: "
          f"{m['episodes']} expert episodes, examples {m['examples']}, loss "
          f"{m['first_loss']:.3f} -> {m['final_loss']:.3f}, {time.time() - t0:.0f} s", flush=True)
    return out


def code_copy_probe(args, export: str, episodes: int = 48) -> dict:
    """How well the memory_key warm start copies the vault code, on clean dev-split experts.

    For three row types it scores the code digit of the target (the last digit token of the
    response) under the export: the strategy row (the code is in the first observation of the
    prompt), StraTA action rows at the vault (the code is only in z) and flat action rows at the
    vault (the code is nowhere in the prompt). Returns {row type: (mean NLL, mean p(correct))};
    chance is (ln 10 = 2.303, 0.1) with a 1-digit code.
    """
    import jax
    import numpy as np
    from strata_jax.models import Qwen2Config, load_params, load_tokenizer
    from strata_jax.training import sft
    from strata_jax.jobs.warm_start import sft_examples
    from strata_jax.training.scoring import response_logprobs, response_states

    c = memory_key_config(args, "strata", 0)
    c.sft.episodes, c.sft.split, c.sft.noise = episodes, "dev", 0.0
    tok = load_tokenizer(None)
    examples, _ = sft_examples(c, tok)
    cfg = Qwen2Config.from_pretrained(export)
    params = load_params(export, cfg)
    digits = {tok.encode(str(d))[0] for d in range(10)}

    @jax.jit
    def logprobs(p, b):
        h, _ = response_states(p, cfg, b["prompt_ids"], b["prompt_mask"], b["response_ids"],
                               b["response_mask"])
        return response_logprobs(p, cfg, h, b["response_ids"], b["response_mask"])[0]

    vault = [e for e in examples if e.kind == "action" and "enter " in e.response_text]
    groups = {"strategy": [e for e in examples if e.kind == "strategy"],
              "vault_with_z": [e for e in vault if e.with_strategy],
              "vault_flat": [e for e in vault if not e.with_strategy]}
    out = {}
    for name, rows in groups.items():
        nll = []
        for i in range(0, len(rows), 16):
            chunk = rows[i:i + 16]
            lp = np.asarray(logprobs(params, sft.make_sft_batch(chunk, 16)))
            for r, e in enumerate(chunk):
                j = max(k for k, t in enumerate(e.response_ids) if t in digits)
                nll.append(-float(lp[r, j]))
        out[name] = (float(np.mean(nll)), float(np.mean(np.exp(-np.array(nll)))))
        print(f"[memory_key] warm start code digit, {name:12s} ({len(rows)} dev rows): "
              f"NLL {out[name][0]:.3f}, p(correct) {out[name][1]:.3f}  (chance 2.303, 0.100)",
              flush=True)
    return out


def rl_run(make, args, env: str, algo: str, seed: int, export: str) -> dict:
    """One RL run from the export; returns per-iteration metrics."""
    from strata_jax.jobs import train
    from strata_jax.algos.table import get_algorithm
    from strata_jax.metrics import read_jsonl
    c = make(args, algo, seed)
    if get_algorithm(algo).rollout == "flat":   # a baseline gets StraTA's episode budget
        c.rollout.group_size = c.rollout.num_strategies * c.rollout.episodes_per_strategy
    c.model.warm_start = export    # the run's own init, replaced by the export (shape-checked)
    c.workdir = os.path.join(args.out, env, f"{algo}_s{seed}")
    shutil.rmtree(c.workdir, ignore_errors=True)
    t0 = time.time()
    summary = train.run(c)
    wall = time.time() - t0
    rows = read_jsonl(os.path.join(c.workdir, "metrics.jsonl"))
    succ = [r.get("rollout/success_rate") or 0.0 for r in rows]
    ret = [r.get("rollout/mean_return") or 0.0 for r in rows]
    eps = [r.get("rollout/episodes") or 0.0 for r in rows]
    invalid = [r.get("rollout/invalid_step_frac") or 0.0 for r in rows]
    print(f"[{env}] {algo} seed {seed}: {summary['status']} after {summary['step']} iterations, "
          f"{wall:.0f} s; success {['%.2f' % s for s in succ]}", flush=True)
    return dict(env=env, algo=algo, seed=seed, success=succ, mean_return=ret, episodes=eps,
                invalid_step_frac=invalid, wall_s=wall, iterations=len(rows))


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
        inv = np.array([r["invalid_step_frac"][:n] for r in rs])
        # strategy-format failures: StraTA rows only (the flat baselines write no strategy)
        sff = (np.array([r["strategy_format_fail"][:n] for r in rs])
               if algo == "strata" and all("strategy_format_fail" in r for r in rs) else None)
        out[algo] = dict(seeds=len(rs), iterations=n, success_mean=s.mean(0).tolist(),
                         success_min=s.min(0).tolist(), success_max=s.max(0).tolist(),
                         score_mean=(100 * ret.mean(0)).tolist(),
                         score_min=(100 * ret.min(0)).tolist(),
                         score_max=(100 * ret.max(0)).tolist(),
                         invalid_mean=inv.mean(0).tolist(), invalid_min=inv.min(0).tolist(),
                         invalid_max=inv.max(0).tolist(),
                         episodes_per_iteration=float(np.mean([r["episodes"][0] for r in rs])),
                         wall_s=float(sum(r["wall_s"] for r in rs)))
        if sff is not None:
            out[algo].update(strategy_fail_mean=sff.mean(0).tolist(),
                             strategy_fail_min=sff.min(0).tolist(),
                             strategy_fail_max=sff.max(0).tolist())
    print(f"\n== {env}: success rate per iteration (mean [min, max] over seeds)"
          + (", ScienceWorld score" if env == "sciworld" else ""))
    for algo, d in out.items():
        print(f"{algo}: {d['seeds']} seed(s) x {d['iterations']} iterations, "
              f"{d['episodes_per_iteration']:.0f} episodes/iteration, RL wall {d['wall_s']:.0f} s")
        for i in range(d["iterations"]):
            line = (f"  it {i:2d}  success {d['success_mean'][i]:.3f} "
                    f"[{d['success_min'][i]:.3f}, {d['success_max'][i]:.3f}]"
                    f"  invalid steps {d['invalid_mean'][i]:.3f}")
            if env == "sciworld":
                line += (f"  score {d['score_mean'][i]:6.1f} "
                         f"[{d['score_min'][i]:.1f}, {d['score_max'][i]:.1f}]")
            print(line)
    return out


def plot(results: dict, path: str, chance: dict | None = None) -> None:
    """One row of panels per env: success rate (with `chance`[env] as a dashed line), the
    ScienceWorld score, the invalid-step fraction; mean line and min-max band over seeds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    titles = {"success": "success rate", "score": "score (0-100)", "invalid": "invalid-step fraction",
              "strategy_fail": "strategy format failures"}
    rows = {}
    for env, by_algo in results.items():
        keys = ("success", "invalid") if env == "memory_key" else ("success", "score", "invalid")
        if any("strategy_fail_mean" in d for d in by_algo.values()):
            keys += ("strategy_fail",)
        rows[env] = keys
    ncols = max(len(k) for k in rows.values())
    fig, axes = plt.subplots(len(rows), ncols, figsize=(4.6 * ncols, 3.4 * len(rows)),
                             squeeze=False)
    panels, used = [], set()
    for i, (env, keys) in enumerate(rows.items()):
        for j, key in enumerate(keys):
            panels.append((axes[i][j], env, key))
            used.add((i, j))
    for i in range(len(rows)):
        for j in range(ncols):
            if (i, j) not in used:
                axes[i][j].axis("off")
    for ax, env, key in panels:
        for algo, d in results[env].items():
            if f"{key}_mean" not in d:
                continue
            x = list(range(d["iterations"]))
            ax.plot(x, d[f"{key}_mean"], marker="o", label=f"{algo} ({d['seeds']} seeds)")
            if f"{key}_min" in d:
                ax.fill_between(x, d[f"{key}_min"], d[f"{key}_max"], alpha=0.2)
        if key == "success" and (chance or {}).get(env):
            ax.axhline(chance[env], color="gray", ls="--", lw=1, label="guessing")
        ax.set_title(f"{env}: {titles[key]}")
        ax.set_xlabel("iteration (rollout after i updates)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="runs/learning")
    ap.add_argument("--iterations", type=int, default=8, help="memory_key iterations per run")
    ap.add_argument("--seeds", type=int, default=3, help="memory_key seeds per method")
    ap.add_argument("--sw-iterations", type=int, default=5, help="ScienceWorld iterations per run")
    ap.add_argument("--sw-seeds", type=int, default=1, help="ScienceWorld seeds per method (0 = skip)")
    ap.add_argument("--sft-steps", type=int, default=0,
                    help="behaviour-cloning steps (0 = the config's sft.steps)")
    ap.add_argument("--algos", default="strata,grpo")
    ap.add_argument("--replot", action="store_true",
                    help="only reprint the tables and redraw <out>/learning.png from <out>/learning.json")
    args = ap.parse_args()
    chance = {"memory_key": 10.0 ** -memory_key_config(args, "grpo", 0).env.code_digits}
    if args.replot:  # the tables and the plot again, from the saved per-run curves
        with open(os.path.join(args.out, "learning.json")) as f:
            runs = json.load(f)["runs"]
        envs = [e for e in ("memory_key", "sciworld") if any(r["env"] == e for r in runs)]
        plot({e: summarise(runs, e) for e in envs}, os.path.join(args.out, "learning.png"), chance)
        return 0
    from strata_jax.metrics import quiet_logs
    quiet_logs()
    os.makedirs(args.out, exist_ok=True)
    algos = [a for a in args.algos.split(",") if a]
    results, runs, probes, t_rl = {}, [], {}, 0.0
    for env, make, seeds in (("memory_key", memory_key_config, args.seeds),
                             ("sciworld", sciworld_config, args.sw_seeds)):
        if seeds <= 0:
            continue
        export = warm_start(make, args, env)
        if env == "memory_key":
            probes["memory_key_code_copy"] = code_copy_probe(args, export)
        for seed in range(seeds):
            for algo in algos:
                r = rl_run(make, args, env, algo, seed, export)
                t_rl += r["wall_s"]
                runs.append(r)
        results[env] = summarise(runs, env)
    print(f"\nRL wall time, all runs: {t_rl:.0f} s ({t_rl / 60:.1f} min)")
    with open(os.path.join(args.out, "learning.json"), "w") as f:
        json.dump(dict(args=vars(args), results=results, runs=runs, probes=probes, rl_wall_s=t_rl),
                  f, indent=1)
    plot(results, os.path.join(args.out, "learning.png"), chance)
    return 0


if __name__ == "__main__":
    sys.exit(main())
