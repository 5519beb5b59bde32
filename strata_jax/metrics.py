"""Run logging: tensorboardX scalars, the same scalars as JSONL, trajectory dumps, progress line.

One `MetricsWriter` per run directory (process 0 only on multi-host). Scalars go to
TensorBoard (``<workdir>/tb``) and, one JSON object per iteration, to
``<workdir>/metrics.jsonl`` so that curves can be plotted without TensorBoard. Sample
trajectories (strategy, steps, verdict) go to ``<workdir>/trajectories.jsonl``.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import logging
import math
import os
import sys
import time
import warnings
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
        resumed run logs each step once; the TensorBoard file starts with a SessionLog.START event
        at resume_step+1 (what tensorboardX's ``purge_step`` writes: TensorBoard drops the older
        events of those steps, so its curves match metrics.jsonl). TensorBoard events are
        written synchronously, before the JSONL row. `resumed_tags` holds the tags already logged AT resume_step
        (e.g. an eval row written after that checkpoint), so the caller does not log them twice.
        A torn last line (a write cut short by a kill or a full disk) is dropped with a warning.
    """

    def __init__(self, workdir: str, *, enabled: bool = True, tensorboard: bool = True,
                 resume_step: int | None = None) -> None:
        self.workdir = workdir
        self.enabled = enabled
        self._tb = None
        self.resumed_tags: set[str] = set()
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        for name in ("metrics.jsonl", "trajectories.jsonl"):
            kept = _truncate_after(os.path.join(workdir, name), resume_step)
            if name == "metrics.jsonl" and resume_step is not None:
                self.resumed_tags = {k for r in kept if r.get("step") == resume_step
                                     for k in r if k not in ("step", "time")}
        if tensorboard:
            # tensorboardX's own event writer, used synchronously: its SummaryWriter queues
            # events to a thread that writes them up to 120 s later, so a kill -9 lost points
            # that metrics.jsonl already had. A unique, time-ordered file name: tensorboardX
            # names event files by the second and opens them "wb", so a writer reopened within
            # the same second would erase the previous file; readers take files in name order.
            from tensorboardX.event_file_writer import EventsWriter
            from tensorboardX.proto.event_pb2 import Event, SessionLog
            tb_dir = os.path.join(workdir, "tb")
            os.makedirs(tb_dir, exist_ok=True)
            self._tb = EventsWriter(os.path.join(tb_dir, "events"),
                                    filename_suffix=f".{time.time_ns():020d}")
            if resume_step is not None:   # what SummaryWriter(purge_step=...) writes
                self._tb.write_event(Event(step=int(resume_step) + 1, wall_time=time.time(),
                                           session_log=SessionLog(status=SessionLog.START)))
            self._tb.flush()
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
        if self._tb is not None:   # TensorBoard first, on disk before the JSONL row
            from tensorboardX.proto.event_pb2 import Event
            from tensorboardX.summary import scalar
            now = time.time()
            for k, f in clean.items():
                self._tb.write_event(Event(wall_time=now, step=int(step), summary=scalar(k, f)))
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
            from tensorboardX.proto.event_pb2 import Event
            from tensorboardX.summary import text as text_summary
            self._tb.write_event(Event(wall_time=time.time(), step=int(step),
                                       summary=text_summary(tag, text)))
            self._tb.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._tb is not None:
            self._tb.close()
        self._scalars.close()
        self._trajs.close()


def _truncate_after(path: str, step: int | None) -> list[dict]:
    """Rewrite a JSONL log keeping rows with "step" <= step (all rows when step is None) and
    without a torn last line (atomic replace); returns the kept rows."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    n_read = len(lines)
    rows = _parse_lines(path, lines)   # drops a torn last line from `lines`
    keep = [(line, r) for line, r in zip(lines, rows)
            if step is None or r.get("step", 0) <= step]
    if len(keep) == n_read and (not lines or lines[-1].endswith("\n")):
        return rows
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(line if line.endswith("\n") else line + "\n" for line, _ in keep)
    os.replace(tmp, path)
    return [r for _, r in keep]


class DamagedLogError(ValueError):
    """A JSONL run log with an unparsable line before its last one: not a write cut short (that
    is dropped with a warning) but a damaged file. The message names the file and the line."""


def _parse_lines(path: str, lines: list[str]) -> list[dict]:
    """JSON rows of `lines`; a torn LAST line is dropped with a warning naming `path`.

    Raises DamagedLogError (a ValueError naming the file and line) for an unparsable line
    before the last one: that is not a cut-short append but a damaged file.
    """
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                msg = (f"{path}: dropping a torn last line (line {i + 1}, {len(line)} chars: "
                       f"{line[:60]!r}...), left by a write cut short (kill, full disk)")
                warnings.warn(msg, RuntimeWarning, stacklevel=3)
                logging.getLogger(__name__).warning(msg)
                lines.pop()
                break
            raise DamagedLogError(f"{path}: line {i + 1} is not JSON ({e}); the file is "
                                  "damaged before its end: repair or remove that line") from None
    return rows


def read_jsonl(path: str) -> list[dict]:
    """All rows of a JSONL file (the metrics or trajectory log).

    A torn last line (what a kill or a full disk leaves) is dropped with a RuntimeWarning that
    names the file; an unparsable earlier line raises DamagedLogError naming file and line.
    """
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    return _parse_lines(path, lines)


def read_tensorboard(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """The scalars of a tensorboardX log dir as TensorBoard shows them: {tag: [(step, value)]}.

    Event files are read in name order; a SessionLog.START event at step s (what a writer with
    ``purge_step=s`` writes on resume) drops the values of steps >= s read so far, as
    TensorBoard's event accumulator does (tensorboard/backend/event_processing/
    event_accumulator.py, ``_CheckForRestartAndMaybePurge``). Points stay in the order they
    were written, so a step logged twice without a purge shows up twice.
    """
    import glob
    import struct

    from tensorboardX.proto import event_pb2
    from tensorboardX.proto.event_pb2 import SessionLog

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        with open(path, "rb") as f:
            data = f.read()
        i = 0
        while i + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            if i + 12 + n > len(data):
                break   # a record cut short by a kill: TensorBoard stops there too
            ev = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            if ev.HasField("session_log") and ev.session_log.status == SessionLog.START:
                for tag, series in out.items():
                    out[tag] = [(s, v) for s, v in series if s < ev.step]
            for v in ev.summary.value:
                if v.WhichOneof("value") == "simple_value":   # text tab entries are not scalars
                    out.setdefault(v.tag, []).append((int(ev.step), float(v.simple_value)))
    return out


def eta_seconds(done: int, total: int, first_done: int, first_end_s: float, now_s: float,
                settle: int = 1) -> float | None:
    """Seconds left of a loop of `total` steps, estimated from the steps after the first one
    of this process (which compiles its programs, so it is no guide to the others).

    done: steps finished; first_done: the step count when the first step of this process
    ended (1 for a fresh loop, restored step + 1 on a resume); first_end_s: the time it ended;
    now_s: the time now (seconds, one clock). The rate is (now_s - first_end_s) per
    (done - first_done) steps. Returns None (the caller prints "eta after compile") until
    `settle` (>= 1) steps ran after the first: later steps may compile too (new shapes), so a
    caller whose early steps vary in shape asks for more. 0.0 when nothing is left.
    """
    if done >= total:
        return 0.0
    n = done - first_done
    if n < max(settle, 1):
        return None
    return (now_s - first_end_s) / n * (total - done)


def format_eta(eta_s: float | None) -> str:
    """``eta 52 s`` / ``eta 4.1 min`` (from two minutes on) for `eta_seconds`'s value; None:
    ``eta after compile``."""
    if eta_s is None:
        return "eta after compile"
    return f"eta {eta_s:.0f} s" if eta_s < 120 else f"eta {eta_s / 60:.1f} min"


class Progress:
    """A one-line console progress bar with ETA, updated once per iteration; the ETA follows
    the iterations after this process's first (`eta_seconds`), which compiles."""

    def __init__(self, total: int, start: int = 0, stream=sys.stderr) -> None:
        self.total, self.start, self.stream = total, start, stream
        self.t0 = time.time()
        self.first: tuple[int, float] | None = None   # (done, time) when the first step ended

    def update(self, done: int, info: str = "") -> str:
        now = time.time()
        elapsed = now - self.t0
        if self.first is None:
            self.first = (done, now)
        eta = format_eta(eta_seconds(done, self.total, self.first[0], self.first[1], now))
        width = 24
        filled = int(width * done / max(self.total, 1))
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} "
                f"elapsed {elapsed:6.1f}s {eta} {info}")
        print(line, file=self.stream, flush=True)
        return line


def _proc_status(path: str = "/proc/self/status") -> dict[str, float]:
    """The ``Vm*`` lines of a Linux ``/proc/<pid>/status`` (e.g. VmRSS, VmHWM) as {name: KiB}
    floats; {} where the file cannot be read (not Linux)."""
    out: dict[str, float] = {}
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("Vm") and line.rstrip().endswith("kB"):
                    key, value = line.split(":", 1)
                    out[key] = float(value.split()[0])
    except OSError:
        pass
    return out


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (malloc.h, glibc >= 2.33): every field a size_t."""
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def host_memory_parts() -> dict[str, float]:
    """What holds this process's host memory now, as metric keys, so that a resident set that
    grows over a run can be put on its cause (docs/performance.md, "Host memory over a run"):

    - ``mem/live_arrays``, ``mem/live_array_gb``: the live jax arrays (`jax.live_arrays`) and
      their bytes; on XLA's CPU backend these are host memory.
    - ``mem/malloc_in_use_gb``, ``mem/malloc_free_gb``, ``mem/malloc_mmapped_gb``: glibc's
      allocator (``mallinfo2``): bytes allocated and not freed in its arenas (XLA's compiled
      programs and buffers, Python's large objects), bytes freed but kept by the arenas (what
      ``malloc_trim`` could return), and bytes in mmapped chunks. Left out without glibc 2.33+.
    - ``mem/gc_objects``: objects the Python garbage collector tracks, counted after a full
      collection (``gc.collect()``), so that cyclic garbage not yet collected neither fakes nor
      hides a growth (it moved the raw count by hundreds between iterations of a tiny run): a
      growing count is a Python-side leak; their bytes are in malloc_in_use.
    - ``mem/python_heap_gb``: Python's allocations as `tracemalloc` traces them, only while it
      traces (``python -X tracemalloc``; off by default: it slows Python down).

    Cheap enough for every iteration (one pass over the live arrays, one full collection and
    one pass over the gc lists); frees nothing but the collection's garbage. Keys whose source
    is unavailable are left out, never guessed.
    """
    import gc
    import tracemalloc

    import jax

    gc.collect()
    arrays = jax.live_arrays()
    out = {"mem/live_arrays": float(len(arrays)),
           "mem/live_array_gb": sum(a.nbytes for a in arrays) / 2**30,
           "mem/gc_objects": float(len(gc.get_objects()))}
    info = _mallinfo2()
    if info is not None:
        out["mem/malloc_in_use_gb"] = info.uordblks / 2**30
        out["mem/malloc_free_gb"] = info.fordblks / 2**30
        out["mem/malloc_mmapped_gb"] = info.hblkhd / 2**30
    if tracemalloc.is_tracing():
        out["mem/python_heap_gb"] = tracemalloc.get_traced_memory()[0] / 2**30
    return out


@functools.lru_cache(maxsize=1)
def _mallinfo2_fn():
    """The C library's ``mallinfo2`` (restype set once), or None where it has none."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


def _mallinfo2() -> "_MallInfo2 | None":
    """glibc's allocator statistics now, or None where the C library has no ``mallinfo2``."""
    fn = _mallinfo2_fn()
    return fn() if fn is not None else None


def memory_metrics(devices: Iterable[Any] | None = None) -> dict[str, float]:
    """Memory as metric keys (GiB, floats): the peak so far, ``mem/host_peak_rss_gb`` and,
    where the backend reports it (GPU, TPU; not XLA's CPU client), ``mem/device_peak_gb``; on
    Linux also ``mem/host_rss_gb``, the resident set now. The peak is a high-water mark that only rises;
    the current figure at each iteration's end tells memory kept between iterations (cached
    programs, allocator arenas) apart from a transient peak inside one.

    Host: this process's peak resident set, not its children's (e.g. the JVMs): ``VmHWM`` of
    ``/proc/self/status`` on Linux, ``getrusage(RUSAGE_SELF).ru_maxrss`` elsewhere (Linux's
    ru_maxrss would carry the parent's resident set at fork time across exec: a run started by
    a large process would report that process's peak). Device: the largest
    ``peak_bytes_in_use`` (else ``bytes_in_use``) of `devices` (default: this host's local
    devices). Both are high-water marks since the process started, so a row shows the peak up
    to its iteration. Keys whose source is unavailable are left out, never guessed.
    """
    out: dict[str, float] = {}
    status = _proc_status()
    kib = status.get("VmHWM")
    if "VmRSS" in status:
        out["mem/host_rss_gb"] = status["VmRSS"] / 2**20
    if kib is None:   # not Linux, or a kernel without VmHWM
        try:
            import resource
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            kib = rss / 1024 if sys.platform == "darwin" else rss   # bytes on macOS
        except (ImportError, OSError):
            pass
    if kib is not None:
        out["mem/host_peak_rss_gb"] = kib / 2**20
    if devices is None:
        import jax
        devices = jax.local_devices()
    peaks = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:   # noqa: BLE001  (backends without the call raise various errors)
            stats = None
        if stats:
            peak = stats.get("peak_bytes_in_use", stats.get("bytes_in_use"))
            if peak is not None:
                peaks.append(float(peak))
    if peaks:
        out["mem/device_peak_gb"] = max(peaks) / 2**30
    return out


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
    """Our INFO lines on stderr; orbax / absl / jax chatter only from WARNING up; transformers
    only from ERROR up (without torch it warns at import that models are unavailable: this
    project uses only its tokenizers)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
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
    up as a rising line. A program loaded from the persistent compilation cache
    (`experiment.use_compilation_cache`) counts too (jax's compile event wraps the load; its
    seconds are the load's), and also in ``cache_hits`` (``compile/cache_hits``). Register once
    per process (`install`)."""

    EVENT = "/jax/core/compile/backend_compile_duration"
    HIT = "/jax/compilation_cache/cache_hits"
    count = 0
    seconds = 0.0
    cache_hits = 0
    _installed = False

    @classmethod
    def install(cls) -> type["CompileCounter"]:
        if not cls._installed:
            import jax

            def listener(name, duration, **_):
                if name == cls.EVENT:
                    cls.count += 1
                    cls.seconds += float(duration)

            def hits(name, **_):
                if name == cls.HIT:
                    cls.cache_hits += 1

            jax.monitoring.register_event_duration_secs_listener(listener)
            jax.monitoring.register_event_listener(hits)
            cls._installed = True
        return cls
