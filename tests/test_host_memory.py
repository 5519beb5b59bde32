"""strata_jax.host_memory: malloc_trim returns the heap's free pages (the resident set falls by
what was freed), and leaves memory in use alone."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from strata_jax.host_memory import release_free_memory, resident_gb

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc, /proc")


def test_trim_gives_back_freed_heap_blocks_and_keeps_live_ones():
    release_free_memory()
    # 64 KiB blocks are below glibc's mmap threshold: they come from the heap, and freeing
    # them leaves their pages resident (every other block stays alive: no top trim)
    blocks = [np.ones(64 * 1024 // 8) for _ in range(4096)]   # 256 MiB, touched
    keep = blocks[1::2]
    del blocks
    before = resident_gb()
    out = release_free_memory()
    assert set(out) == {"mem/trim_released_gb", "time/trim_s"}
    assert out["mem/trim_released_gb"] > 0.06          # most of the 128 MiB freed
    assert before - resident_gb() > 0.06
    assert all(float(b[0]) == 1.0 for b in keep)       # live blocks untouched
    again = release_free_memory()
    assert again["mem/trim_released_gb"] < 0.02        # nothing left to give back
