"""Give the host memory that glibc's allocator holds free back to the OS, once per iteration.

XLA:CPU and orbax malloc and free buffers of many sizes; glibc keeps freed heap memory in its
arenas (``mallinfo2().fordblks``, the ``mem/malloc_free_gb`` metric) and returns only the top
of each heap by itself, so a long run's resident set grows with memory nothing uses
(docs/performance.md, "Host memory over a run"). ``malloc_trim(0)`` releases every free page
of every arena (madvise MADV_DONTNEED), whatever its place in the heap. Source: glibc
malloc_trim(3).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import time


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """The C library's ``malloc_trim`` (looked up once), or None where it has none."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def resident_gb() -> float | None:
    """This process's resident set now, GiB (``VmRSS`` of /proc/self/status); None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


def release_free_memory() -> dict[str, float]:
    """Run ``malloc_trim(0)`` and return its metrics: ``mem/trim_released_gb`` (GiB the
    resident set fell, >= 0) and ``time/trim_s`` (seconds it took). Empty where the C library
    has no malloc_trim (not glibc) or the resident set cannot be read. Frees nothing a program
    uses: only pages the allocator already holds free. Raises nothing."""
    fn = _malloc_trim()
    before = resident_gb()
    if fn is None or before is None:
        return {}
    t0 = time.perf_counter()
    fn(0)
    after = resident_gb()
    return {"mem/trim_released_gb": max(0.0, before - (after if after is not None else before)),
            "time/trim_s": time.perf_counter() - t0}


__all__ = ["release_free_memory", "resident_gb"]
