"""Where a process's resident memory peaks: a sampling thread that records the resident set
(Linux /proc/self/status) with what the main thread is doing at that moment, so a peak can be
put on a phase (a compilation, or the execution of one of the update's functions).

Labels: "compile:<fn>" while XLA compiles (a backend compile frame is on the main thread's
stack; <fn> the innermost strata_jax function above it), else the innermost strata_jax
function on the stack ("exec:<fn>"). JAX dispatches CPU programs asynchronously, so an
execution label names the Python call that was waiting, not necessarily the program whose
buffers are live (``jax.config.update("jax_cpu_enable_async_dispatch", False)`` makes it
exact, at the cost of host / device overlap). Compile labels are exact either way.
"""
from __future__ import annotations

import os
import sys
import threading
import time

# frames of JAX's backend compile (jax._src.compiler); present on the stack while XLA compiles
_COMPILE_FRAMES = ("backend_compile", "backend_compile_and_load", "compile_or_get_cached",
                   "_cached_compilation")


def rss_gb() -> float:
    """This process's current resident set, GiB (`strata_jax.metrics.memory_metrics`'
    ``mem/host_rss_gb``: Linux /proc; 0.0 elsewhere)."""
    from strata_jax.metrics import memory_metrics
    return memory_metrics(devices=[]).get("mem/host_rss_gb", 0.0)


def _label(frame) -> str:
    """The phase of a stack (innermost frame first): see the module docstring."""
    fn, compiling = "", False
    while frame is not None:
        code = frame.f_code
        if code.co_name in _COMPILE_FRAMES and "jax" in code.co_filename:
            compiling = True
        if not fn and f"{os.sep}strata_jax{os.sep}" in code.co_filename:
            fn = code.co_name
        frame = frame.f_back
    return ("compile:" if compiling else "exec:") + (fn or "other")


class RssTrace:
    """Samples (seconds since start, resident GiB, label) every `interval` s while running.

    Use as a context manager around the work; then `summary()`. The sampling thread reads the
    main thread's stack (sys._current_frames), so it costs microseconds per sample."""

    def __init__(self, interval: float = 0.1):
        self.interval = interval
        self.samples: list[tuple[float, float, str]] = []
        self._stop = threading.Event()
        self._main = threading.main_thread().ident

    def _run(self) -> None:
        t0 = time.perf_counter()
        while not self._stop.is_set():
            frame = sys._current_frames().get(self._main)
            self.samples.append((time.perf_counter() - t0, rss_gb(), _label(frame)))
            self._stop.wait(self.interval)

    def __enter__(self) -> "RssTrace":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self, top: int = 8) -> dict:
        """{"peak_gb", "peak_at_s", "peak_label", "by_label": {label: max GiB} (the `top`
        highest), "compile_peak_gb", "exec_peak_gb"}; empty without samples."""
        if not self.samples:
            return {}
        t, peak, label = max(self.samples, key=lambda s: s[1])
        by: dict[str, float] = {}
        for _, gb, lab in self.samples:
            by[lab] = max(by.get(lab, 0.0), gb)
        best = dict(sorted(by.items(), key=lambda kv: -kv[1])[:top])
        phase = lambda p: max((v for k, v in by.items() if k.startswith(p)), default=0.0)  # noqa
        return dict(peak_gb=peak, peak_at_s=t, peak_label=label, by_label=best,
                    compile_peak_gb=phase("compile:"), exec_peak_gb=phase("exec:"))
