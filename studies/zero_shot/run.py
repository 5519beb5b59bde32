"""Zero-shot table: a real Qwen2.5 checkpoint on ScienceWorld's short families and memory_key.

    python -m studies.zero_shot.run                              # fetched 0.5B, flat and StraTA
    python -m studies.zero_shot.run --models qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct
    python -m studies.zero_shot.run --episodes 4 --max-steps 15 --set rollout.max_action_tokens=128
    python -m studies.zero_shot.run --table                      # print the table from the cache

Cells: (model, env, prompting). env is ScienceWorld's dev split restricted to the families whose
gold path has at most 11 steps (docs/method.md §11.1), or memory_key with the 3-digit vault code
(chance 1e-3); prompting is flat (the baselines' prompt, ``algo=grpo``) or StraTA (one strategy
per task, ``algo=strata``). Every cell is one ``eval.py --no_checkpoint`` run with the eval
protocol (temperature ``eval.temperature`` = 0.4, no judge, no FPS), in its own subprocess so
its wall time and peak RSS are its own; its metrics and trajectories are cached in
``--out/<cell>/`` so a stopped run continues with the cells it has not finished (``--force``
replays them). Per family the table gives success, mean score, the fraction of format-invalid
steps, of steps the env rejected, and of strategies that failed the format check, the episodes,
and the cell's wall time. Measures, never asserts. Results: ``--out/zero_shot.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from studies.cells import cached_cell, run_cells, write_summary  # noqa: E402

# ScienceWorld families with gold paths of at most 11 steps (docs/method.md §11.1).
SHORT_FAMILIES = ("find-non-living-thing", "lifespan-longest-lived", "lifespan-shortest-lived",
                  "lifespan-longest-lived-then-shortest-lived", "find-animal",
                  "find-living-thing", "find-plant", "power-component")
PROMPTING = {"flat": "grpo", "strata": "strata"}


def cell_variant(args, model: str, env: str, prompting: str, workdir: str | None = None,
                 extra: tuple[str, ...] = ()) -> tuple[str, str]:
    """(config file, variant string) of one eval cell: `model` on `env` with `prompting`, the
    budgets of ``args`` (max_steps, action / strategy / prompt tokens, dtype), then `extra`
    overrides and ``args.set``. workdir: the cell's folder (default ``args.out/<cell_name>``)."""
    workdir = workdir or os.path.join(args.out, cell_name(model, env, prompting))
    common = ["tiny", "real", PROMPTING[prompting], f"model.path={model}",
              f"workdir={workdir}", f"env.max_steps={args.max_steps}",
              f"rollout.max_action_tokens={args.action_tokens}",
              f"rollout.max_strategy_tokens={args.strategy_tokens}",
              f"env.max_prompt_tokens={args.prompt_tokens}",
              f"rollout.sampler_dtype={args.dtype}", f"model.dtype={args.dtype}"]
    if env == "scienceworld":
        common += ["env.tasks=" + "+".join(SHORT_FAMILIES), "env.num_workers=4"]
        cfg = "sciworld.py"
    else:
        common += ["env.code_digits=3", "env.num_workers=8"]
        cfg = "builtin.py"
    return os.path.join(REPO, "configs", cfg), ",".join(common + list(extra) + list(args.set))


def add_budget_args(ap, *, episodes: int, mk_episodes: int, max_steps: int,
                    strategy_tokens: int, out: str) -> None:
    """The flags every real-weight eval benchmark shares (tasks, budgets, dtype, cache)."""
    ap.add_argument("--episodes", type=int, default=episodes, help="ScienceWorld tasks per family")
    ap.add_argument("--mk-episodes", type=int, default=mk_episodes, help="memory_key tasks")
    ap.add_argument("--max-steps", type=int, default=max_steps)
    ap.add_argument("--action-tokens", type=int, default=96)
    ap.add_argument("--strategy-tokens", type=int, default=strategy_tokens)
    ap.add_argument("--prompt-tokens", type=int, default=1536)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--set", nargs="*", default=[], help="extra key=value config overrides")
    ap.add_argument("--out", default=out)
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--table", action="store_true", help="print the table of the cached cells")


def cell_name(model: str, env: str, prompting: str) -> str:
    return f"{os.path.basename(model).replace('.gguf', '')}__{env}__{prompting}"


def family_rows(traj_path: str, env: str) -> dict[str, dict]:
    """Per-family figures from an eval's trajectories file (`strata_jax.evaluation`'s records)."""
    fams: dict[str, dict] = {}
    for line in open(traj_path):
        r = json.loads(line)
        fam = str(r["task_id"]).split("/")[0] if env == "scienceworld" else env
        f = fams.setdefault(fam, dict(episodes=0, success=0.0, score=0.0, steps=0, invalid=0,
                                      rejected=0, strategies=0, strategy_fail=0))
        f["episodes"] += 1
        f["success"] += float(bool(r["success"]) and not r["crashed"])
        f["score"] += (100.0 if env == "scienceworld" else 1.0) * float(r["episode_return"])
        f["steps"] += len(r["steps"])
        f["invalid"] += sum(bool(s["invalid"]) for s in r["steps"])
        f["rejected"] += sum(bool(s.get("env_rejected")) for s in r["steps"])
        if r.get("strategy_raw") is not None:
            f["strategies"] += 1
            f["strategy_fail"] += int(not r["strategy_format_ok"])
    for f in fams.values():
        n = max(f["episodes"], 1)
        f["success"] /= n
        f["score"] /= n
        f["invalid_frac"] = f["invalid"] / max(f["steps"], 1)
        f["rejected_frac"] = f["rejected"] / max(f["steps"], 1)
        f["strategy_fail_frac"] = (f["strategy_fail"] / f["strategies"]) if f["strategies"] else None
    return fams


def run_cell(args, model: str, env: str, prompting: str) -> dict:
    name = cell_name(model, env, prompting)
    cfg, variant = cell_variant(args, model, env, prompting)
    episodes = args.episodes if env == "scienceworld" else args.mk_episodes
    cmd = [sys.executable, os.path.join(REPO, "eval.py"), f"--config={cfg}:{variant}",
           "--split=dev", "--no_checkpoint", f"--episodes_per_family={episodes}"]
    workdir = os.path.join(args.out, name)

    def result(_log: str) -> dict:
        metrics = json.load(open(os.path.join(workdir, "eval_dev_step0.json")))
        print(f"[{name}] success {metrics['eval/success']:.3f}", flush=True)
        return {"model": model, "env": env, "prompting": prompting,
                # RUSAGE_CHILDREN's max is over every child this process waited for so far: the
                # largest cell's peak up to now, not this cell's own (run one cell to get its own)
                "max_child_rss_gb_so_far":
                    resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20,
                "variant": variant, "metrics": metrics,
                "families": family_rows(
                    os.path.join(workdir, "eval_dev_step0_trajectories.jsonl"), env)}

    return cached_cell(args.out, name, cmd, REPO, args.force, result)


def print_table(results: list[dict]) -> None:
    print("| model | prompting | family | success | score | invalid steps | env-rejected | "
          "strategy format fail | episodes | cell wall |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            continue
        model = os.path.basename(r["model"]).replace(".gguf", "")
        for fam, f in sorted(r["families"].items()):
            sf = "-" if f["strategy_fail_frac"] is None else f"{f['strategy_fail_frac']:.0%}"
            print(f"| {model} | {r['prompting']} | {fam} | {f['success']:.2f} | {f['score']:.1f} | "
                  f"{f['invalid_frac']:.0%} | {f['rejected_frac']:.0%} | {sf} | {f['episodes']} | "
                  f"{r['wall_s'] / 60:.0f} min (load {r['load_start']}) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b-instruct"],
                    help="fetch names, .gguf files or HF dirs")
    ap.add_argument("--envs", nargs="+", default=["scienceworld", "memory_key"])
    ap.add_argument("--prompting", nargs="+", default=["flat", "strata"], choices=tuple(PROMPTING))
    add_budget_args(ap, episodes=2, mk_episodes=16, max_steps=15, strategy_tokens=192,
                    out="runs/zero_shot")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    keys = [(m, e, p) for m in args.models for e in args.envs for p in args.prompting]
    results = run_cells(args.out, [(cell_name(*k), k) for k in keys], args.table,
                        lambda k: run_cell(args, *k))
    write_summary(args.out, "zero_shot.json", args)
    print_table(results)


if __name__ == "__main__":
    main()
