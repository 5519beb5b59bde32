"""Test-time strategy scaling: success vs S and its token cost, per task family.

    python -m studies.test_time_scaling.run --config=configs/sciworld.py:tiny,real \\
        --no-checkpoint --set env.tasks=find-animal+find-plant env.max_steps=15 --episodes 4
    python -m studies.test_time_scaling.run --config=configs/sciworld.py:tiny,stapo \\
        --choices critic judge
    python -m studies.test_time_scaling.run --config=configs/builtin.py:tiny --no-checkpoint \\
        --set model.warm_start= --episodes 1 --samples 1 2          # a CPU smoke run
    python -m studies.test_time_scaling.run --config=... --table    # the table from the cache

Cells: (S, chooser, probe length) for S in ``--samples`` (default 1 2 4 8), every chooser of
``--choices`` (S = 1 is the one-strategy eval protocol whatever the chooser: one cell) and every
``--probe-steps`` (0 = full-episode probes). Each cell is one ``eval.py`` run (the run's newest
checkpoint, or ``--no-checkpoint`` for the config's model as is) with
``--strategy_samples=S --strategy_choice=... --probe_steps=...`` on ``--split`` with
``--episodes`` tasks per family, in its own subprocess; its metrics are cached in
``--out/<cell>.json``, so a stopped run continues with the cells it has not finished
(``--force`` replays them). Per family the table gives success, mean score, and the cost per
task: sampled tokens (strategy candidates, probe and final actions, judge verdicts) and env
steps; full-episode probes also give the oracle success (any candidate succeeded).
Measures, never asserts. Results: ``--out/test_time.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from studies.cells import cached_cell, run_cells, write_summary  # noqa: E402


def cells(args) -> list[tuple[int, str, int]]:
    """(S, chooser, probe steps) of every cell, S = 1 once."""
    out = []
    for s in args.samples:
        for probe in (args.probe_steps if s > 1 else [0]):
            for choice in (args.choices if s > 1 else ["-"]):
                out.append((s, choice, probe))
    return out


def run_workdir(cfg: str, variant: str) -> str:
    """The run folder of config file `cfg` with `variant` (where its checkpoint is)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("_bench_config", cfg)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(variant or None).workdir


def cell_name(s: int, choice: str, probe: int) -> str:
    return "s1" if s == 1 else f"s{s}_{choice}" + (f"_probe{probe}" if probe else "")


def family_rows(metrics: dict) -> dict[str, dict]:
    """Per-family figures from an eval's metrics (eval/family/<fam>/<figure>)."""
    fams: dict[str, dict] = {}
    for k, v in metrics.items():
        m = re.fullmatch(r"eval/family/(.+)/(success|score|sampled_tokens|env_steps)", k)
        if m:
            fams.setdefault(m.group(1), {})[m.group(2)] = v
    return fams


def run_cell(args, s: int, choice: str, probe: int) -> dict:
    name = cell_name(s, choice, probe)
    cfg, _, variant = args.config.partition(":")
    toks = [t for t in variant.split(",") if t] + list(args.set)
    if args.no_checkpoint:   # nothing to restore: each cell writes into its own folder
        toks.append(f"workdir={os.path.abspath(os.path.join(args.out, name))}")
    elif args.set and not any(t.startswith("workdir=") for t in toks):
        # variant tokens name the run folder; the extra overrides must not rename it
        toks.append(f"workdir={run_workdir(cfg, variant)}")
    cmd = [sys.executable, os.path.join(REPO, "eval.py"), f"--config={cfg}:{','.join(toks)}",
           f"--split={args.split}", f"--episodes_per_family={args.episodes}",
           f"--strategy_samples={s}", f"--probe_steps={probe}"]
    if s > 1:
        cmd.append(f"--strategy_choice={choice}")
    if args.no_checkpoint:
        cmd.append("--no_checkpoint")

    def result(log_path: str) -> dict | None:
        written = re.findall(r"^wrote (.+\.json)$", open(log_path).read(), re.M)
        if not written:
            return None
        metrics = json.load(open(written[0]))
        print(f"[{name}] success {metrics['eval/success']:.3f}, "
              f"{metrics.get('eval/cost/sampled_tokens', float('nan')):.0f} tokens / task",
              flush=True)
        return {"samples": s, "choice": choice if s > 1 else "protocol", "probe_steps": probe,
                "command": cmd[1:], "metrics": metrics, "families": family_rows(metrics)}

    return cached_cell(args.out, name, cmd, REPO, args.force, result)


def print_table(results: list[dict]) -> None:
    print("| S | choice | probe | family | success | score | sampled tokens / task | "
          "env steps / task | oracle success | cell wall |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['cell']} | failed: {r['error']} | | | | | | | | |")
            continue
        m = r["metrics"]
        oracle = m.get("eval/tts/oracle_success")
        rows = sorted(r["families"].items()) + [("(all)", {
            "success": m["eval/success"], "score": m["eval/score"],
            "sampled_tokens": m.get("eval/cost/sampled_tokens"),
            "env_steps": m.get("eval/cost/env_steps")})]
        for fam, f in rows:
            tok = f.get("sampled_tokens")
            steps = f.get("env_steps")
            print(f"| {r['samples']} | {r['choice']} | {r['probe_steps'] or 'full'} | {fam} | "
                  f"{f['success']:.2f} | {f['score']:.1f} | "
                  f"{'-' if tok is None else f'{tok:.0f}'} | "
                  f"{'-' if steps is None else f'{steps:.1f}'} | "
                  f"{'-' if oracle is None or fam != '(all)' else f'{oracle:.2f}'} | "
                  f"{r['wall_s'] / 60:.1f} min (load {r['load_start']}) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True,
                    help="config file:variant as for eval.py, e.g. configs/sciworld.py:tiny,real")
    ap.add_argument("--samples", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--choices", nargs="+", default=["judge"],
                    choices=["judge", "critic", "first_action"])
    ap.add_argument("--probe-steps", nargs="+", type=int, default=[0],
                    help="probe lengths (0 = full episodes)")
    ap.add_argument("--split", default="dev")
    ap.add_argument("--episodes", type=int, default=2, help="tasks per family")
    ap.add_argument("--no-checkpoint", action="store_true",
                    help="evaluate the config's model as is (no run checkpoint)")
    ap.add_argument("--set", nargs="*", default=[], help="extra key=value config overrides")
    ap.add_argument("--out", default="runs/test_time")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--table", action="store_true", help="print the table of the cached cells")
    args = ap.parse_args()
    if any(s < 1 for s in args.samples) or any(p < 0 for p in args.probe_steps):
        ap.error("--samples must be >= 1 and --probe-steps >= 0")
    os.makedirs(args.out, exist_ok=True)
    results = run_cells(args.out, [(cell_name(*c), c) for c in cells(args)], args.table,
                        lambda c: run_cell(args, *c))
    write_summary(args.out, "test_time.json", args)
    print_table(results)


if __name__ == "__main__":
    main()
