"""One cached study cell = one subprocess whose result is kept as ``<out>/<name>.json``.

The real-model studies (zero_shot, options, test_time_scaling) run many cells of several
minutes each on a CPU box; a stopped run must continue with the cells it has not finished.
This is the one place that decides "read the cached cell, or run it and time it".
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Any, Callable, Sequence


def _load() -> str:
    return open("/proc/loadavg").read().split()[0]


def cached_cell(out: str, name: str, cmd: list[str], cwd: str, force: bool,
                result: Callable[[str], dict[str, Any] | None]) -> dict[str, Any]:
    """Return the cell's cached result, or run ``cmd`` and cache what ``result`` makes of it.

    Args:
      out: results folder; the cell's files are ``<out>/<name>.json`` and ``<out>/<name>.log``.
      name: cell name. cmd: the subprocess argv (stdout and stderr go to the log). cwd: its cwd.
      force: rerun even when a cached result exists.
      result: given the log path after a zero exit, returns the cell's figures (a dict), or
        None when the run wrote nothing usable.
    Returns the result dict with ``wall_s``, ``load_start`` and ``load_end`` (1-minute load
    averages, so figures can be read against the machine's load) added; a failed cell returns
    ``{"cell": name, "error": rc or "no result"}`` and is not cached (the next run retries it).
    """
    cache = os.path.join(out, name + ".json")
    if os.path.exists(cache) and not force:
        return json.load(open(cache))
    print(f"[{name}] {' '.join(cmd[1:])}", flush=True)
    log_path = os.path.join(out, name + ".log")
    t0, load0 = time.time(), _load()
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.time() - t0
    res = None if rc else result(log_path)
    if res is None:
        print(f"[{name}] failed (rc {rc}); see {log_path}", flush=True)
        return {"cell": name, "error": rc or "no result"}
    res = {"cell": name, **res, "wall_s": wall, "load_start": load0, "load_end": _load()}
    json.dump(res, open(cache, "w"), indent=1)
    print(f"[{name}] done in {wall:.0f} s", flush=True)
    return res


def write_summary(out: str, filename: str, args: Any) -> str:
    """Write ``<out>/<filename>``: every cell cached in `out` (each ``<name>.json`` but the
    summary itself, sorted by name) and the arguments of the run that wrote it, as
    {"last_args": ..., "cells": [...]}. A run that plays a subset of the cells (``--models
    ...``) adds to the summary instead of replacing it. Returns the summary's path."""
    path = os.path.join(out, filename)
    cells = [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out))
             if f.endswith(".json") and f != filename]
    with open(path, "w") as f:
        json.dump({"last_args": vars(args), "cells": cells}, f, indent=1)
    return path


def run_cells(out: str, cells: Sequence[tuple[str, Any]], table: bool,
              run: Callable[[Any], dict[str, Any]]) -> list[dict[str, Any]]:
    """Every cell's result in order: ``run(key)`` for each (name, key) of `cells` (which reads
    the cache or runs the cell, `cached_cell`), or with `table` only the cached results (cells
    never run are left out)."""
    results = []
    for name, key in cells:
        if table:
            cache = os.path.join(out, name + ".json")
            if os.path.exists(cache):
                results.append(json.load(open(cache)))
            continue
        results.append(run(key))
    return results
