"""Run logging: tensorboardX scalars, the same scalars as JSONL, trajectory dumps, progress line.

One `MetricsWriter` per run directory (process 0 only on multi-host). Scalars go to
TensorBoard (``<workdir>/tb``) and, one JSON object per iteration, to
``<workdir>/metrics.jsonl`` so that curves can be plotted without TensorBoard. Sample
trajectories (strategy, steps, verdict) go to ``<workdir>/trajectories.jsonl``.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from typing import Any, Iterable, Mapping

import numpy as np


def _to_float(v: Any) -> float | None:
    try:
        f = float(np.asarray(v))
    except (TypeError, ValueError):
        return None
    return f


class MetricsWriter:
    """Writes scalars to tensorboardX and JSONL, trajectories to JSONL.

    Args:
      workdir: run directory (created).
      enabled: False on non-zero hosts: every method becomes a no-op.
      tensorboard: set False to skip tensorboardX (e.g. on images without it).
      resume_step: the step a run resumed from: JSONL rows with a larger step (written by
        iterations after the last checkpoint, which will be redone) are dropped, so a killed and
        resumed run logs each step once.
    """

    def __init__(self, workdir: str, *, enabled: bool = True, tensorboard: bool = True,
                 resume_step: int | None = None) -> None:
        self.workdir = workdir
        self.enabled = enabled
        self._tb = None
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        if resume_step is not None:
            for name in ("metrics.jsonl", "trajectories.jsonl"):
                _truncate_after(os.path.join(workdir, name), resume_step)
        if tensorboard:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(os.path.join(workdir, "tb"))
        self._scalars = open(os.path.join(workdir, "metrics.jsonl"), "a", buffering=1)
        self._trajs = open(os.path.join(workdir, "trajectories.jsonl"), "a", buffering=1)

    def scalars(self, step: int, values: Mapping[str, Any]) -> dict[str, float]:
        """Log a dict of scalars at `step`; non-numeric values are skipped, NaN kept as null.

        Returns the floats that were written (tag -> value).
        """
        clean = {}
        for k, v in values.items():
            f = _to_float(v)
            if f is not None:
                clean[k] = f
        if not self.enabled:
            return clean
        if self._tb is not None:
            for k, f in clean.items():
                self._tb.add_scalar(k, f, step)
            self._tb.flush()
        row = {"step": int(step), "time": time.time(),
               **{k: (None if not math.isfinite(f) else f) for k, f in clean.items()}}
        self._scalars.write(json.dumps(row) + "\n")
        return clean

    def trajectories(self, step: int, records: Iterable[Mapping[str, Any]]) -> None:
        """Append trajectory records (JSON-able dicts) tagged with the iteration."""
        if not self.enabled:
            return
        for r in records:
            self._trajs.write(json.dumps({"step": int(step), **r}, default=str) + "\n")

    def text(self, step: int, tag: str, text: str) -> None:
        """Write `text` (markdown) under `tag` into TensorBoard's text tab at `step` (e.g. a
        sample episode, `strata_jax.trajectories.format_episode`). No-op without TensorBoard."""
        if self.enabled and self._tb is not None:
            self._tb.add_text(tag, text, step)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._tb is not None:
            self._tb.close()
        self._scalars.close()
        self._trajs.close()


def _truncate_after(path: str, step: int) -> None:
    """Rewrite a JSONL log keeping rows with "step" <= step (atomic replace)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    keep = [line for line in lines if json.loads(line).get("step", 0) <= step]
    if len(keep) == len(lines):
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
    os.replace(tmp, path)


def read_jsonl(path: str) -> list[dict]:
    """All rows of a JSONL file (the metrics or trajectory log)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class Progress:
    """A one-line console progress bar with ETA, updated once per iteration."""

    def __init__(self, total: int, start: int = 0, stream=sys.stderr) -> None:
        self.total, self.start, self.stream = total, start, stream
        self.t0 = time.time()

    def update(self, done: int, info: str = "") -> str:
        n = done - self.start
        elapsed = time.time() - self.t0
        eta = elapsed / n * (self.total - done) if n > 0 else float("nan")
        width = 24
        filled = int(width * done / max(self.total, 1))
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} "
                f"elapsed {elapsed:6.1f}s eta {eta:6.1f}s {info}")
        print(line, file=self.stream, flush=True)
        return line


def cpu_seconds() -> float:
    """CPU seconds (user + system, all threads) used so far by this process and its live
    descendants (e.g. ScienceWorld's JVMs), for the per-iteration ``time/iteration_cpu_s``.

    Linux: summed from ``/proc/<pid>/stat`` of this process and every descendant (clock ticks /
    ``SC_CLK_TCK``); a descendant that exits between two calls takes its seconds with it.
    Elsewhere: `os.times` (this process and its waited-for children only).
    """
    try:
        tick = os.sysconf("SC_CLK_TCK")
        stats: dict[int, tuple[int, float]] = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            # fields after "(comm)": state ppid ... utime(12) stime(13), 0-based from state
            stats[int(pid)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / tick)
        mine, total, frontier = {os.getpid()}, 0.0, [os.getpid()]
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        while frontier:
            pid = frontier.pop()
            total += stats.get(pid, (0, 0.0))[1]
            for ch in children.get(pid, ()):
                if ch not in mine:
                    mine.add(ch)
                    frontier.append(ch)
        return total
    except (OSError, ValueError, IndexError):
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system


def quiet_logs() -> None:
    """Our INFO lines on stderr; orbax / absl / jax chatter only from WARNING up."""
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.WARNING)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    for name in ("strata_jax", "envs_bridge"):
        lg = logging.getLogger(name)
        lg.setLevel(logging.INFO)
        if not lg.handlers:
            lg.addHandler(handler)
        lg.propagate = False


class CompileCounter:
    """Counts XLA backend compilations in this process (every jit, eager op and sampler program)
    through ``jax.monitoring``; logged as ``compile/count`` so recompilation after warm-up shows
    up as a rising line. Register once per process (`install`)."""

    EVENT = "/jax/core/compile/backend_compile_duration"
    count = 0
    seconds = 0.0
    _installed = False

    @classmethod
    def install(cls) -> type["CompileCounter"]:
        if not cls._installed:
            import jax

            def listener(name, duration, **_):
                if name == cls.EVENT:
                    cls.count += 1
                    cls.seconds += float(duration)

            jax.monitoring.register_event_duration_secs_listener(listener)
            cls._installed = True
        return cls
