"""jax's persistent compilation cache, made safe to share between runs (`runs/jax_cache`).

jax trusts its cache: an entry is loaded by file name alone. Two entries whose contents were
swapped load as hits and run each other's program (wrong shapes, wrong results), and an entry
damaged on disk (a torn write, a bit flip) fails to load, is recompiled, and is never rewritten
(jax does not replace an existing file), so every later run warns and compiles it again. This
module adds two things on top of jax's cache:

  * `cache_subdir`: one folder per jax / jaxlib version and device set under the configured
    directory, so runs of another installation or another machine never read each other's
    entries, and an old installation's folder can be deleted as a whole.
  * `SealedCache`: every entry is written as ``MAGIC + sha256(key + value) + value`` and
    checked on every read. An entry that is not its key's (swapped, copied, torn, flipped, or
    written before sealing) is deleted with one warning and reported as a miss: jax compiles
    the program and writes a good entry in its place.

Cost: one sha256 pass over an entry's bytes (compressed executables, kilobytes to a few
megabytes) per load and per store, against the compile it saves. Guarantee: a loaded entry
holds exactly the bytes jax stored under that key; it does not protect against someone who
can write the folder and recompute digests (jax's cache runs code it loads: keep it private).

The hook wraps ``jax._src.compilation_cache.get_file_cache`` (jax's private API, checked by
tests/jobs/test_entrypoints.py); if a jax version lacks it, a warning says the entries are unsealed.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
from typing import Any

log = logging.getLogger(__name__)

MAGIC = b"strata-sealed-v1\n"
_DIGEST = 32


def cache_subdir() -> str:
    """The folder name for this installation and device set, e.g.
    ``jax-0.4.38_jaxlib-0.4.38_cpu-cpu-x8``: jax and jaxlib versions, platform, device kind and
    the global device count. Initializes jax's backends (call after jax.distributed)."""
    import jax
    import jaxlib
    devices = jax.devices()
    kind = re.sub(r"[^A-Za-z0-9.]+", "-", devices[0].device_kind).strip("-").lower()
    return (f"jax-{jax.__version__}_jaxlib-{jaxlib.__version__}_{devices[0].platform}-"
            f"{kind}-x{len(devices)}")


def seal(key: str, value: bytes) -> bytes:
    """The stored form of `value` under `key`: MAGIC, sha256(key + value), value."""
    return MAGIC + hashlib.sha256(key.encode() + value).digest() + value


def unseal(key: str, stored: bytes) -> bytes | None:
    """The value of a sealed entry when it is `key`'s and intact; None otherwise."""
    head = len(MAGIC) + _DIGEST
    if len(stored) < head or not stored.startswith(MAGIC):
        return None
    value = stored[head:]
    if hashlib.sha256(key.encode() + value).digest() != stored[len(MAGIC):head]:
        return None
    return value


class SealedCache:
    """A jax cache (``CacheInterface``: ``get(key)``, ``put(key, value)``, ``_path``) whose
    entries are sealed (`seal`); an entry that fails the check is deleted and read as a miss.

    Attributes:
      evicted: keys deleted by this process because their entry failed the check.
    """

    def __init__(self, base: Any) -> None:
        self._base = base
        self.evicted: list[str] = []

    @property
    def _path(self) -> Any:
        return self._base._path

    @_path.setter
    def _path(self, value: Any) -> None:
        self._base._path = value

    def get(self, key: str) -> bytes | None:
        """The entry's value, or None (a miss) when absent or not intact (then deleted)."""
        stored = self._base.get(key)
        if stored is None:
            return None
        value = unseal(key, stored)
        if value is None:
            self._evict(key)
        return value

    def put(self, key: str, value: bytes) -> None:
        """Store `value` sealed under `key` (jax's cache keeps an existing entry as it is)."""
        self._base.put(key, seal(key, value))

    def _evict(self, key: str) -> None:
        path = os.path.join(str(self._base._path), f"{key}-cache")
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("compilation cache entry %s failed its check and cannot be removed "
                        "(%s); it is recompiled on every run until it is deleted", path, e)
            return
        self.evicted.append(key)
        log.warning("compilation cache entry %s was damaged or not its key's: removed; the "
                    "program is compiled again and stored anew", os.path.basename(path))

    def __getattr__(self, name: str) -> Any:   # anything else jax asks of its cache
        return getattr(self._base, name)


_installed = False


def install() -> bool:
    """Make jax build its file cache as a `SealedCache` (idempotent; a cache jax already built
    in this process is wrapped in place). Returns False, with a warning, when this jax has no
    such hook (its entries then stay unsealed)."""
    global _installed
    if _installed:
        return True
    try:
        from jax._src import compilation_cache as cc
        original = cc.get_file_cache
    except (ImportError, AttributeError) as e:
        log.warning("this jax has no compilation-cache hook (%s): cache entries are not "
                    "checked; a damaged entry is recompiled on every run until deleted", e)
        return False

    def sealed_file_cache(path: str):
        out = original(path)
        return None if out is None else (SealedCache(out[0]), out[1])

    cc.get_file_cache = sealed_file_cache
    if getattr(cc, "_cache", None) is not None and not isinstance(cc._cache, SealedCache):
        cc._cache = SealedCache(cc._cache)
    _installed = True
    return True


__all__ = ["MAGIC", "SealedCache", "cache_subdir", "install", "seal", "unseal"]
