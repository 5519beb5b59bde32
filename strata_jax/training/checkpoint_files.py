"""The files of one checkpoint step: their checksum manifest, and the checks a step must pass
before it is restored (checksums, its format, the step it holds).

A step folder `<dir>/<step>/` holds `state/` and `meta/` (orbax items), optionally `host/`
(the trainer's host arrays, e.g. the replay pool: `write_host_arrays`), and `checksums.json`,
{"algorithm": "sha256", "files": {relative path: [bytes, hex digest]}} of every file under
state/, meta/ and host/ (the layout: strata_jax/training/checkpoint.py). A step is committed
once the manifest exists. Source: docs/reliability.md (integrity checks).
"""
from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import logging
import os
import warnings

import jax

from strata_jax.training.prefix_tree import parse_shape_marks
from strata_jax.training.state import TrainState

log = logging.getLogger(__name__)

FORMAT = 2
MANIFEST = "checksums.json"
_HASHED = ("state", "meta", "host")   # the step's items; orbax's top-level files may be rewritten
HOST_ARRAYS = "host_arrays"
"""The key of a trainer state ({name: numpy array}) whose arrays are kept in the step's
`host/arrays.npz` instead of the JSON meta (`split_host_arrays`, `write_host_arrays`)."""
_HOST_FILE = os.path.join("host", "arrays.npz")


class CorruptCheckpointError(RuntimeError):
    """A step's files do not match its checksum manifest (or a committed-format step has none)."""


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _step_files(step_dir: str) -> list[str]:
    """Relative paths of the files of a step's items (state/, meta/), sorted."""
    out = []
    for item in _HASHED:
        for root, _, files in os.walk(os.path.join(step_dir, item)):
            out += [os.path.relpath(os.path.join(root, f), step_dir) for f in files]
    return sorted(out)


def _hash_files(step_dir: str, rel: list[str]) -> dict[str, list]:
    """{relative path: [size, sha256 hex]} computed on a few threads (hashlib frees the GIL)."""
    workers = min(8, os.cpu_count() or 1, max(len(rel), 1))
    with cf.ThreadPoolExecutor(workers) as ex:
        digests = list(ex.map(lambda r: _sha256(os.path.join(step_dir, r)), rel))
    return {r: [os.path.getsize(os.path.join(step_dir, r)), d] for r, d in zip(rel, digests)}


def write_manifest(step_dir: str) -> dict:
    """Hash every file of a step and write `<step_dir>/checksums.json` atomically (tmp + rename
    + fsync). Returns the manifest dict."""
    manifest = {"algorithm": "sha256", "files": _hash_files(step_dir, _step_files(step_dir))}
    tmp = os.path.join(step_dir, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(step_dir, MANIFEST))
    return manifest


def split_host_arrays(trainer_state: dict | None) -> tuple[dict | None, dict | None]:
    """(the trainer state without its `HOST_ARRAYS`, those arrays or None)."""
    if not isinstance(trainer_state, dict) or HOST_ARRAYS not in trainer_state:
        return trainer_state, None
    rest = {k: v for k, v in trainer_state.items() if k != HOST_ARRAYS}
    return rest, dict(trainer_state[HOST_ARRAYS])


def write_host_arrays(step_dir: str, arrays: dict) -> None:
    """Write {name: numpy array} to `<step_dir>/host/arrays.npz` (compressed; tmp + rename),
    before the step's manifest is written (so the manifest covers it)."""
    import numpy as np
    os.makedirs(os.path.join(step_dir, "host"), exist_ok=True)
    path = os.path.join(step_dir, _HOST_FILE)
    tmp = path + ".tmp.npz"
    np.savez_compressed(tmp, **{k: np.asarray(v) for k, v in arrays.items()})
    os.replace(tmp, path)


def with_host_arrays(step_dir: str, meta: dict) -> dict:
    """`meta` with its trainer state's `HOST_ARRAYS` read back from the step's host/ file
    ({name: numpy array}); meta unchanged when the step has none."""
    import numpy as np
    path = os.path.join(step_dir, _HOST_FILE)
    if not os.path.exists(path):
        return meta
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    return {**meta, "trainer_state": {**(meta.get("trainer_state") or {}), HOST_ARRAYS: arrays}}


def verify_step(step_dir: str, contents: bool = True) -> bool:
    """Check a step directory against its checksum manifest.

    contents=False checks presence and sizes only (no hashing: for a step this process has just
    committed). Returns True when verified, False for a format-1 step (no manifest, written
    before manifests existed). Raises CorruptCheckpointError naming the first bad file: a size
    or sha256 mismatch, a missing file, or a format-2 step without a manifest (never committed).
    """
    path = os.path.join(step_dir, MANIFEST)
    if not os.path.exists(path):
        if step_format(step_dir) >= 2:
            raise CorruptCheckpointError(f"{path} is missing: the save of this step did not "
                                         "complete")
        return False
    with open(path) as f:
        files = json.load(f)["files"]
    for rel, (size, _) in files.items():
        full = os.path.join(step_dir, rel)
        if not os.path.exists(full):
            raise CorruptCheckpointError(f"{full} is missing")
        if os.path.getsize(full) != size:
            raise CorruptCheckpointError(f"{full} has {os.path.getsize(full)} bytes, the "
                                         f"manifest says {size}")
    if not contents:
        return True
    got = _hash_files(step_dir, sorted(files))
    for rel, (_, digest) in files.items():
        if got[rel][1] != digest:
            raise CorruptCheckpointError(f"{os.path.join(step_dir, rel)} does not match its "
                                         "sha256 in the manifest (corrupted on disk)")
    return True


def step_format(step_dir: str) -> int:
    """A step's format: 2 with a manifest, else its meta's "format" (1 when absent; 2 when the
    meta cannot be read, as a save cut short leaves it)."""
    if os.path.exists(os.path.join(step_dir, MANIFEST)):
        return FORMAT
    try:
        with open(os.path.join(step_dir, "meta", "metadata")) as f:
            return int(json.load(f).get("format", 1))
    except (OSError, ValueError, TypeError, AttributeError):
        return FORMAT


def meta_step(step_dir: str) -> int | None:
    """The step a step folder's meta records, or None when it cannot be read."""
    try:
        with open(os.path.join(step_dir, "meta", "metadata")) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def check_step(folder: int, meta: dict, state: TrainState) -> None:
    """The folder's step, the meta's and the state's must agree (a renamed or swapped step
    folder keeps matching checksums): CorruptCheckpointError naming the numbers otherwise."""
    got = meta.get("step")
    if got != folder:
        raise CorruptCheckpointError(f"folder {folder} holds step {got} (the step its meta records): "
                                     "a renamed or swapped step folder")
    held = int(jax.device_get(state.step))
    if held != folder:
        raise CorruptCheckpointError(f"folder {folder} and its meta say step {folder} but its "
                                     f"state holds step {held}: a renamed or edited step")


def checked_trainer_state(step: int, directory: str, meta: dict) -> dict:
    """meta with its trainer state's shape marks set to None, and one warning, when they are
    malformed: they only pre-size padded shapes, which the next batches raise again, so
    ignoring them loses nothing (refusing the step would lose its progress)."""
    host = meta.get("trainer_state")
    if not isinstance(host, dict) or host.get("shape_marks") is None:
        return meta
    try:
        parse_shape_marks(host["shape_marks"])
    except (ValueError, TypeError) as e:
        msg = (f"checkpoint step {step} in {directory}: its trainer's shape marks are "
               f"malformed and ignored ({' '.join(str(e).split())[:200]}); the update "
               "re-derives them")
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        log.warning(msg)
        return {**meta, "trainer_state": {**host, "shape_marks": None}}
    return meta


__all__ = ["CorruptCheckpointError", "FORMAT", "HOST_ARRAYS", "MANIFEST", "check_step",
           "checked_trainer_state", "split_host_arrays", "with_host_arrays", "write_host_arrays",
           "meta_step", "step_format", "verify_step", "write_manifest"]
