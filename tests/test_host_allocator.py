"""`experiment.use_host_allocator`: a fixed glibc mmap threshold, read back from the allocator.

In a fresh process (the setting is process-wide): after a freed 4 MiB buffer glibc's adaptive
threshold sits at 4 MiB, so a 1.5 MiB malloc comes from the heap (no new mapped chunk in
mallinfo2's hblks); with host_mmap_threshold_mb=1 the same malloc is mapped (one new chunk) and a
0.5 MiB one still is not. glibc >= 2.33 only (mallinfo2).
"""
import json
import os
import subprocess
import sys

import pytest

from strata_jax import experiment as ex
from strata_jax.config import ConfigError
from strata_jax.validation import validate
from tests.fixtures.paths import REPO_ROOT

ROOT = REPO_ROOT

_PROBE = r"""
import ctypes, json
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def mapped(n):
    before = libc.mallinfo2().hblks
    p = libc.malloc(n)
    d = libc.mallinfo2().hblks - before
    libc.free(p)
    return d
libc.free(libc.malloc(4 << 20))          # glibc's adaptive threshold rises to 4 MiB
out = [mapped(3 << 19)]
from configs import base
from strata_jax import experiment as ex
c = base.get_base_config()
c.host_mmap_threshold_mb = 1.0
out.append(ex.use_host_allocator(c))
out += [mapped(3 << 19), mapped(1 << 19)]
print(json.dumps(out))
"""


def _glibc_with_mallinfo2() -> bool:
    import ctypes
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_fixed_threshold_maps_buffers_the_adaptive_one_keeps_in_the_heap():
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    # adaptive (default): heap; fixed at 1 MiB: set, 1.5 MiB mapped, 0.5 MiB from the heap
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [0, True, 1, 0]


def test_off_by_default_and_bounds():
    from configs import base
    c = base.get_base_config()
    assert c.host_mmap_threshold_mb == 0.0 and ex.use_host_allocator(c) is False
    c.host_mmap_threshold_mb = 0.5          # fractions of a MiB are valid
    validate(c)
    for bad in (64.0, -1.0):                # above glibc's 32 MiB maximum, negative
        c.host_mmap_threshold_mb = bad
        with pytest.raises(ConfigError, match="host_mmap_threshold_mb must be a number of MiB"):
            validate(c)
