"""The rollout options beyond the paper, measured on real weights: strategy revision, test-time
strategy scaling, a separate judge model, each against the paper's one-strategy eval.

    python -m studies.options.run                            # the fetched 0.5B, every cell
    python -m studies.options.run --cells paper revise_every3 tts2_judge
    python -m studies.options.run --episodes 2 --max-steps 15
    python -m studies.options.run --table                    # the table from the cache

Every cell is one ``eval.py --no_checkpoint`` run of the same model on the same tasks (the
ScienceWorld dev split restricted to the families whose gold path has at most 11 steps, as in
studies/zero_shot/run.py; ``--env memory_key`` for the 3-digit vault code) with StraTA
prompting, the eval protocol (one strategy per task, temperature ``eval.temperature`` = 0.4) and the
action-format examples in the prompt (without them the 0.5B model fails the strategy format on
every ScienceWorld task: docs/results.md). Only the option differs:

    paper              the paper's eval: one strategy, fixed for the episode
    revise_every3      rollout.revise_every=3: a revised strategy at steps 3, 6, 9
    revise_stuck       rollout.revise_on=stuck: revise once the last revise_stuck_steps (3) steps were
                       all invalid, one repeated action or rewardless
    tts2_judge         eval.py --strategy_samples=2 --strategy_choice=judge --probe_steps=3:
                       2 FPS-selected strategies, a 3-step probe each, the policy judges the probes
    tts2_judge_1.5b    the same with rollout.judge_model.path=<--judge> judging
    tts4_judge         --strategy_samples=4, judge, 3-step probes
    tts4_first_action  --strategy_samples=4 --strategy_choice=first_action --probe_steps=1: the
                       majority first action of 4 one-step probes (with 2 candidates the vote
                       can only skip a candidate whose first step is invalid; 4 can outvote)

Same env-step limit per episode in every cell (``--max-steps``); the probes of test-time scaling
are env steps on top of it, so the table gives the cost per task (sampled tokens, env steps) from
eval.py's own accounting. Each cell runs in its own subprocess (its wall time is its own) and is
cached in ``--out/<cell>.json``: a stopped run continues with the cells it has not finished
(``--force`` replays them). Measures, never asserts. Results: ``--out/options.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from studies.cells import cached_cell, run_cells, write_summary  # noqa: E402
from studies.test_time_scaling.run import family_rows  # noqa: E402
from studies.zero_shot.run import add_budget_args, cell_variant  # noqa: E402

TTS_PROBE = 3
# name -> (config overrides, eval.py flags); "{judge}" is replaced by --judge
CELLS: dict[str, tuple[list[str], list[str]]] = {
    "paper": ([], []),
    "revise_every3": (["rollout.revise_every=3"], []),
    "revise_stuck": (["rollout.revise_on=stuck"], []),
    "tts2_judge": ([], ["--strategy_samples=2", "--strategy_choice=judge",
                        f"--probe_steps={TTS_PROBE}"]),
    "tts2_judge_1.5b": (["rollout.judge_model.path={judge}"],
                        ["--strategy_samples=2", "--strategy_choice=judge",
                         f"--probe_steps={TTS_PROBE}"]),
    "tts4_judge": ([], ["--strategy_samples=4", "--strategy_choice=judge",
                        f"--probe_steps={TTS_PROBE}"]),
    "tts4_first_action": ([], ["--strategy_samples=4", "--strategy_choice=first_action",
                               "--probe_steps=1"]),
}
# the fractions of the chosen episodes' steps / strategies that the table shows
FRACTIONS = ("invalid_step_frac", "env_rejected_frac", "strategy_format_fail_frac")


def cell_command(args, name: str) -> list[str]:
    """eval.py argv of one cell: the zero-shot study's StraTA cell with the format examples, plus
    the cell's option."""
    overrides, flags = CELLS[name]
    cfg, variant = cell_variant(
        args, args.model, args.env, "strata",
        workdir=os.path.abspath(os.path.join(args.out, name)),
        extra=("rollout.format_examples=true", *(o.format(judge=args.judge) for o in overrides)))
    episodes = args.episodes if args.env == "scienceworld" else args.mk_episodes
    return [sys.executable, os.path.join(REPO, "eval.py"), f"--config={cfg}:{variant}",
            "--split=dev", "--no_checkpoint", f"--episodes_per_family={episodes}", *flags]


def run_cell(args, name: str) -> dict:
    cmd = cell_command(args, name)

    def result(log_path: str) -> dict | None:
        written = re.findall(r"^wrote (.+\.json)$", open(log_path).read(), re.M)
        if not written:
            return None
        metrics = json.load(open(written[0]))
        print(f"[{name}] success {metrics['eval/success']:.3f}, score {metrics['eval/score']:.1f}",
              flush=True)
        revising = "eval/revisions" in metrics   # the eval's revision_stats, when it revises
        return {"env": args.env, "model": args.model, "command": cmd[1:], "metrics": metrics,
                "families": family_rows(metrics),
                "revisions_per_episode": (metrics["eval/revisions"] / metrics["eval/episodes"]
                                          if revising else 0.0),
                "revision_format_fail": (metrics["eval/revision_format_fail_frac"]
                                         if revising and metrics["eval/revisions"] else None)}

    return cached_cell(args.out, name, cmd, REPO, args.force, result)


def print_table(results: list[dict]) -> None:
    print("| option | success | mean score | format-invalid steps | env-rejected steps | "
          "strategy format fail | revisions / episode (format fail) | sampled tokens / task | "
          "env steps / task | episodes | cell wall |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['cell']} | failed: {r['error']} |" + " |" * 9)
            continue
        m = r["metrics"]
        fr = [f"{m['eval/' + k]:.0%}" if "eval/" + k in m else "-" for k in FRACTIONS]
        print(f"| {r['cell']} | {m['eval/success']:.2f} | {m['eval/score']:.1f} | "
              + " | ".join(fr)
              + f" | {r['revisions_per_episode']:.1f}"
              + ("" if r["revision_format_fail"] is None else f" ({r['revision_format_fail']:.0%})")
              + f" | {m['eval/cost/sampled_tokens']:.0f} | "
              f"{m['eval/cost/env_steps']:.1f} | {m['eval/episodes']:.0f} | "
              f"{r['wall_s'] / 60:.1f} min (load {r['load_start']}) |")


def print_family_table(results: list[dict]) -> None:
    fams = sorted({f for r in results if "error" not in r for f in r["families"]})
    ok = [r for r in results if "error" not in r]
    if not ok:
        return
    print("| family | " + " | ".join(r["cell"] for r in ok) + " |")
    print("|---|" + "---|" * len(ok))
    for fam in fams:
        cells = []
        for r in ok:
            f = r["families"].get(fam)
            cells.append("-" if f is None else f"{f['success']:.0f} / {f['score']:.0f}")
        print(f"| {fam} | " + " | ".join(cells) + " |")


def build_parser() -> argparse.ArgumentParser:
    """The command line (its defaults are the cells' shared budgets)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", nargs="+", default=list(CELLS), choices=tuple(CELLS))
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct",
                    help="fetch name, .gguf file or HF dir of the policy")
    ap.add_argument("--judge", default="qwen2.5-coder-1.5b-instruct",
                    help="the separate judge of the tts2_judge_1.5b cell")
    ap.add_argument("--env", default="scienceworld", choices=("scienceworld", "memory_key"))
    add_budget_args(ap, episodes=1, mk_episodes=8, max_steps=10, strategy_tokens=96,
                    out="runs/options")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = run_cells(args.out, [(n, n) for n in args.cells], args.table,
                        lambda n: run_cell(args, n))
    write_summary(args.out, "options.json", args)
    print_table(results)
    print()
    print("success / score per family:")
    print_family_table(results)


if __name__ == "__main__":
    main()
