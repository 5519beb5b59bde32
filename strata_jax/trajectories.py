"""Read played episodes: ``python -m strata_jax.trajectories <workdir> --iteration 3``.

Reads the episodes a run logged (``<workdir>/trajectories.jsonl``; or any trajectory JSONL
file, e.g. eval.py's ``eval_<split>_step<k>_trajectories.jsonl``). An iteration's episodes are
listed one line each (an eval file holds dozens: a screenful of full episodes would hide the
overview); ``--episode K`` or ``--all`` prints them in full: the task and its goal, the strategy
(parsed plan, or the raw output when the format check failed), then per step what the model
wrote, the action sent and the env's answer, with format-invalid and env-rejected steps marked.
The record fields are described in docs/metrics.md ("Trajectories");
`strata_jax.rollout.dump_trajectories` writes them. `format_episode` is also what train.py
writes into TensorBoard's text tab.

    python -m strata_jax.trajectories runs/sciworld_tiny                 # the last iteration, listed
    python -m strata_jax.trajectories runs/sciworld_tiny --iteration 1 --episode 2 --full
    python -m strata_jax.trajectories runs/sciworld_tiny/eval_dev_step3_trajectories.jsonl --all
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Mapping, Sequence


def _clip(text: Any, limit: int | None) -> str:
    s = "" if text is None else str(text).strip()
    if limit is not None and len(s) > limit:
        s = s[:limit].rstrip() + f" ... [{len(s) - limit} more chars]"
    return s.replace("\n", "\n" + " " * 15)


def format_episode(rec: Mapping[str, Any], limit: int | None = 300, index: str = "") -> str:
    """A readable multi-line text of one trajectory record (`dump_trajectories`' dict).

    `limit` caps each observation / output at that many characters (None: everything); `index`
    (e.g. "2/8") is shown in the header. Records of older runs without some fields print what
    they have.
    """
    lines = []
    head = f"=== episode {index} " if index else "=== episode "
    if "step" in rec:
        head += f"(iteration {rec['step']}) "
    head += (f"{rec.get('task_id')} variation {rec.get('variation')}  [task_uid "
             f"{rec.get('task_uid')}, strategy {rec.get('strategy_id')}, trajectory "
             f"{rec.get('trajectory_id')}]")
    lines.append(head)
    if rec.get("goal"):
        lines.append(f"goal:          {_clip(rec['goal'], limit)}")
    if rec.get("strategy_format_ok") is True:
        lines.append(f"strategy:      {_clip(rec.get('strategy'), limit)}")
    elif rec.get("strategy_format_ok") is False:
        lines.append(f"strategy:      FORMAT FAILED ({rec.get('strategy_fail_reason')}); raw "
                     f"output: {_clip(rec.get('strategy_raw'), limit)}")
    elif rec.get("strategy"):   # records written before strategy_raw existed
        lines.append(f"strategy:      {_clip(rec['strategy'], limit)}")
    verdict = f", judge bad steps {rec.get('bad_steps')}" if rec.get("verdict") is not None else ""
    lines.append(f"outcome:       return {float(rec.get('episode_return', 0.0)):+.3f}, "
                 f"success {bool(rec.get('success'))}, crashed {bool(rec.get('crashed'))}"
                 f"{verdict}" + (f", error: {rec['error']}" if rec.get("error") else ""))
    for t, s in enumerate(rec.get("steps", ()), start=1):
        marks = [m for m, on in (("FORMAT-INVALID: nothing sent", s.get("invalid")),
                                 ("REJECTED by the env", s.get("env_rejected")),
                                 ("judge: bad step", s.get("judge_flag"))) if on]
        lines.append(f"--- step {t}  reward {float(s.get('reward', 0.0)):+.3f}"
                     + (f"  [{'; '.join(marks)}]" if marks else ""))
        lines.append(f"  observation: {_clip(s.get('observation'), limit)}")
        lines.append(f"  model wrote: {_clip(s.get('output'), limit)}")
        lines.append(f"  action:      {s.get('action') if s.get('action') is not None else '-'}"
                     + (f"  (ambiguous: chose {s['ambiguous_resolved']!r})"
                        if s.get("ambiguous_resolved") else ""))
        if s.get("feedback") is not None:
            lines.append(f"  env answer:  {_clip(s['feedback'], limit)}")
    return "\n".join(lines)


def summary_line(rec: Mapping[str, Any], index: str) -> str:
    """One line for an episode: index, task, outcome, strategy check, step counts."""
    steps = rec.get("steps", ())
    invalid = sum(bool(s.get("invalid")) for s in steps)
    rejected = sum(bool(s.get("env_rejected")) for s in steps)
    ok = rec.get("strategy_format_ok")
    strategy = {True: "strategy ok", False: "strategy FAILED", None: "no strategy"}[ok]
    return (f"{index:>7}  {rec.get('task_id')} v{rec.get('variation')}  return "
            f"{float(rec.get('episode_return', 0.0)):+.3f}  success {int(bool(rec.get('success')))}"
            f"  {strategy}  {len(steps)} steps ({invalid} invalid, {rejected} rejected)")


def trajectory_file(path: str) -> str:
    """`path` itself when it is a file, else ``<path>/trajectories.jsonl``. Raises
    FileNotFoundError saying what was looked for."""
    f = path if os.path.isfile(path) else os.path.join(path, "trajectories.jsonl")
    if not os.path.isfile(f):
        raise FileNotFoundError(f"no trajectory log at {f} (give a run folder or a "
                                "*trajectories.jsonl file)")
    return f


def load(path: str, iteration: int | None = None) -> tuple[list[dict], list[int]]:
    """(records of `iteration`, every iteration in the file). `iteration` None: the last one.
    Lines that do not parse (a torn last line) are skipped."""
    rows = []
    with open(trajectory_file(path)) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    steps = sorted({int(r.get("step", 0)) for r in rows})
    if not steps:
        return [], []
    it = steps[-1] if iteration is None else iteration
    return [r for r in rows if int(r.get("step", 0)) == it], steps


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strata_jax.trajectories",
                                description="Print logged episodes readably.")
    p.add_argument("path", help="run folder (reads trajectories.jsonl) or a trajectory JSONL file")
    p.add_argument("--iteration", type=int, default=None, help="iteration (default: the last)")
    p.add_argument("--episode", type=int, default=None, help="only this episode (1-based)")
    p.add_argument("--all", action="store_true", help="print every episode in full")
    p.add_argument("--full", action="store_true", help="do not shorten long texts")
    a = p.parse_args(argv)
    try:
        recs, steps = load(a.path, a.iteration)
    except FileNotFoundError as e:
        print(f"{p.prog}: {e}", file=sys.stderr)
        return 2
    if not recs:
        print(f"{p.prog}: no episodes of iteration {a.iteration} in {a.path}; logged "
              f"iterations: {steps}", file=sys.stderr)
        return 2
    if a.episode is None and not a.all and len(recs) > 1:
        where = f"iteration {recs[0]['step']}, " if "step" in recs[0] else ""
        print(f"{len(recs)} episodes ({where}{a.path}):")
        for i, rec in enumerate(recs):
            print(summary_line(rec, f"{i + 1}/{len(recs)}"))
        print("one in full: --episode K; all of them: --all (--full: without shortening)")
        return 0
    pick = range(len(recs)) if a.episode is None else [a.episode - 1]
    for i in pick:
        if not 0 <= i < len(recs):
            print(f"{p.prog}: --episode {a.episode} out of 1..{len(recs)}", file=sys.stderr)
            return 2
        print(format_episode(recs[i], None if a.full else 300, f"{i + 1}/{len(recs)}"))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
