"""One training run of many iterations in one process, per iteration: what holds host memory,
what compiled, what the update computed, and the wall time. Does a run hold?

    python -m benchmarks.long_run --config=configs/builtin.py:tiny --iterations 12
    python -m benchmarks.long_run --config=configs/builtin.py:tiny,real \\
        --set model.path=qwen2.5-coder-0.5b-instruct lora.rank=16 --iterations 30

It runs `strata_jax.jobs.train.run` (the same job as train.py) in this process on a fresh
workdir (``--workdir``, default ``runs/long_run/<config name>``; an existing one is refused, so
every iteration of the table ran in this process), then reads the run's metrics.jsonl and prints
one row per iteration: host RSS and its parts (`strata_jax.metrics.host_memory_parts`: live jax
arrays, glibc's in-use and freed-but-kept bytes, gc-tracked objects), compilations so far and
their seconds, the update's tokens, and the iteration's wall and CPU seconds. The summary gives
the resident set's growth from iteration ``--from`` (default 3) to the last, the compilations
after iteration 2, and the growth of live arrays and gc objects from ``--from`` on; the machine's
load average is recorded at the start and the end (a loaded box stretches the walls, not the
memory). ``--out`` writes the rows and the summary as JSON (``benchmarks/results/long_run/``
keeps the reported ones; the write-up: benchmarks/results/long_run/README.md once one ran).

Run with ``python -X tracemalloc=1`` to add Python's own heap (``mem/python_heap_gb``) to every
row (it slows Python down). Nothing else may run on the box beside a real-model run: the
figures are this process's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

COLUMNS = (("rss", "mem/host_rss_gb", "{:.3f}"), ("in_use", "mem/malloc_in_use_gb", "{:.3f}"),
           ("kept_free", "mem/malloc_free_gb", "{:.3f}"), ("arrays", "mem/live_arrays", "{:.0f}"),
           ("array_gb", "mem/live_array_gb", "{:.3f}"), ("gc_obj", "mem/gc_objects", "{:.0f}"),
           ("py_heap", "mem/python_heap_gb", "{:.3f}"), ("compiles", "compile/count", "{:.0f}"),
           ("compile_s", "compile/seconds", "{:.1f}"), ("tokens", "train/tokens", "{:.0f}"),
           ("iter_s", "time/iteration_s", "{:.1f}"), ("cpu_s", "time/iteration_cpu_s", "{:.1f}"))


def growth(rows: list[dict], key: str, start: int) -> dict | None:
    """{from, to, first, last, delta, percent} of metric `key` between the row of step `start`
    and the last row (None when either lacks it or `start` was not logged). Rows are
    metrics.jsonl lines (dicts with "step")."""
    by_step = {int(r["step"]): r for r in rows}
    if start not in by_step or not rows:
        return None
    last = max(by_step)
    a, b = by_step[start].get(key), by_step[last].get(key)
    if a is None or b is None:
        return None
    return {"from": start, "to": last, "first": a, "last": b, "delta": b - a,
            "percent": 100.0 * (b - a) / a if a else float("nan")}


def summary(rows: list[dict], start: int = 3) -> dict:
    """What a reviewer of a long run asks: resident-set growth from step `start` to the last
    (`growth` of mem/host_rss_gb), compilations after step 2 (compile/count at the last step
    minus at step 2), and the growth of live arrays and gc objects from `start` on."""
    by_step = {int(r["step"]): r for r in rows}
    out = {k: growth(rows, m, start) for k, m in (
        ("host_rss", "mem/host_rss_gb"), ("malloc_in_use", "mem/malloc_in_use_gb"),
        ("live_arrays", "mem/live_arrays"), ("gc_objects", "mem/gc_objects"))}
    if 2 in by_step and by_step:
        last = by_step[max(by_step)]
        out["compiles_after_step_2"] = (last.get("compile/count", 0.0)
                                        - by_step[2].get("compile/count", 0.0))
    return out


def table(rows: list[dict]) -> str:
    """The per-iteration rows as aligned text (a column only when some row has its metric)."""
    cols = [c for c in COLUMNS if any(c[1] in r for r in rows)]
    head = ["step"] + [c[0] for c in cols]
    body = [[str(int(r["step"]))] + [c[2].format(r[c[1]]) if c[1] in r else "-" for c in cols]
            for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(x.rjust(w) for x, w in zip(line, widths))
                     for line in [head, *body])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="path[:variant], as train.py takes it")
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="config overrides, parsed by each field's type")
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--workdir", default="")
    p.add_argument("--from", dest="start", type=int, default=3)
    p.add_argument("--out", default="", help="JSON file for the rows and the summary")
    args = p.parse_args(argv)

    from strata_jax.config import set_override
    from strata_jax.jobs.cli import load_config
    from strata_jax.jobs.train import run
    from strata_jax.metrics import quiet_logs, read_jsonl

    quiet_logs()
    c = load_config(args.config)
    for item in args.set:
        key, _, text = item.partition("=")
        set_override(c, key, text)
    c.iterations = int(args.iterations)
    name = os.path.basename(args.config.split(":")[0]).removesuffix(".py")
    c.workdir = args.workdir or os.path.join("runs", "long_run", name)
    if os.path.exists(os.path.join(c.workdir, "metrics.jsonl")):
        raise SystemExit(f"{c.workdir} holds a run already: every row must come from this "
                         "process; pass another --workdir or delete it")
    load0, t0 = os.getloadavg(), time.time()
    result = run(c)
    rows = read_jsonl(os.path.join(c.workdir, "metrics.jsonl"))
    rows = [r for r in rows if "train/tokens" in r or "mem/host_rss_gb" in r]
    summ = summary(rows, args.start)
    print(table(rows))
    print(json.dumps(summ, indent=1))
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"command": " ".join([sys.executable, "-m", "benchmarks.long_run",
                                            *(argv if argv is not None else sys.argv[1:])]),
                       "commit": commit, "status": result["status"],
                       "wall_s": time.time() - t0, "load_start": load0,
                       "load_end": os.getloadavg(), "summary": summ, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
