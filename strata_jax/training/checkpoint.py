"""Checkpoints with orbax: save every K iterations, on SIGTERM and at exit; exact resume;
restore onto another device count / mesh; fall back past a corrupt or partial latest step.

Layout (one orbax CheckpointManager directory, async off, keep the last n):

  <dir>/<step>/state/   the TrainState as a dict {"params", "opt_state", "critic_params",
                        "critic_opt_state", "step", "rng"} (orbax StandardSave, OCDBT);
                        empty subtrees ({} critic when there is none) are stored as a 0-d
                        placeholder so orbax never sees an empty node.
  <dir>/<step>/meta/    JSON: {"step": int, "sampler_state": <the caller's opaque JSON-able
                        dict, e.g. the task sampler's get_state()>, "trainer_state": <the
                        trainer's host state, e.g. its shape marks, or null>, "config": <the
                        experiment config as JSON text or a dict>, "format": 2}
  <dir>/<step>/host/arrays.npz  only when the trainer state holds "host_arrays" ({name:
                        numpy array}, e.g. the replay pool's rows): those arrays, returned
                        under the meta's trainer_state "host_arrays" on restore.
  <dir>/<step>/checksums.json   {"algorithm": "sha256", "files": {relative path: [bytes,
                        hex digest]}} of every file under state/, meta/ and host/, written
                        (atomically) after orbax committed the step (and host/ was written). A
                        step is COMMITTED once this manifest
                        exists; only then are steps beyond `keep` deleted, so a good checkpoint
                        is never removed before its replacement is complete.
  <step> = TrainState.step (iterations completed).

Integrity: restore re-hashes the step's files against its manifest; a mismatch (a bit flip of
the same size, a truncated or missing file) or a format-2 step without a manifest (a save cut
short) is skipped with a warning naming the file, in favour of the next older step, and so is a
step whose folder name, meta "step" and state step disagree (a renamed or swapped folder keeps
matching checksums). Steps written before manifests existed (format 1) restore unverified with
a warning, except in a directory whose other steps are format 2: there a step without a
manifest was stripped of it and is skipped. Malformed trainer shape marks are dropped from the
returned meta with a warning (the next batches re-derive them). Cost: one sha256 pass over
the checkpoint bytes at save and at restore, a minor share of either next to orbax's own I/O
(benchmarks/checkpoint_integrity.py measures it; docs/results.md has the figures).

Saving: a step already committed on disk is never deleted and written again (the forced final
save of a finished run, the save on Ctrl-C right after a periodic one); a step on disk that is
not committed (no or a wrong manifest) is replaced. A full disk (ENOSPC) raises
`CheckpointWriteError` with one line naming the directory, the bytes needed and free; the
partial step and orbax's tmp directory are removed (until they stay gone: orbax's writer threads
may still be finishing), older steps are untouched, and orbax's per-thread reports of the
condition (absl log records, "Event loop is closed" unraisables) are dropped.

Restore: `Checkpointer.restore(abstract_state)` with `Trainer.abstract_state()` (ShapeDtypeStructs
carrying the target NamedShardings) puts every array straight onto the target mesh, whatever
mesh wrote it (docs/design.md §10). A step that fails to restore (truncated file,
missing metadata) is skipped with a warning in favour of the next older one.
Source: orbax-checkpoint 0.12 CheckpointManager docs; docs/design.md §10.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from strata_jax.exits import exception_chain
from strata_jax.training.checkpoint_files import (FORMAT, MANIFEST, CorruptCheckpointError,
                                                  check_step, checked_trainer_state, meta_step,
                                                  split_host_arrays, step_format, verify_step,
                                                  with_host_arrays, write_host_arrays,
                                                  write_manifest)
from strata_jax.training.state import TrainState

log = logging.getLogger(__name__)

_EMPTY = "__empty__"
_FIELDS = ("params", "opt_state", "critic_params", "critic_opt_state", "step", "rng")


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (e.g. no space left on device); the message names the
    directory and the space needed. The partial step was removed; older steps are intact."""

    def __str__(self) -> str:   # the sentence alone: it is the one line the user sees
        return str(self.strerror) if self.strerror else super().__str__()


class NoRestorableCheckpointError(RuntimeError):
    """Checkpoints exist but none can be restored (or an explicit step cannot): the message
    names each step tried and why, and says what to do (restore the named file, or move the
    directory aside to start afresh). Nothing was changed on disk."""


class _DiskFullNoise(logging.Filter):
    """Drops orbax's own error records of a full disk (one per writer thread, each with a
    traceback, some logged after the save has already failed) and asyncio's "exception was
    never retrieved" records of its abandoned writes: `Checkpointer.save` reports the condition
    as one `CheckpointWriteError` line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not ("orbax" in record.pathname
                                                  or record.name == "asyncio"):
            return True
        text = record.getMessage() + str(record.exc_info[1] if record.exc_info else "")
        return not ("RESOURCE_EXHAUSTED" in text or "No space left on device" in text)


_DISK_FULL_NOISE = _DiskFullNoise()


class _ClosedLoopNoise:
    """A chaining `sys.unraisablehook` that drops the "Event loop is closed" RuntimeErrors of
    orbax's writer callbacks while a save runs and after one failed: on a full disk orbax
    closes its event loop when the save fails, and every tensorstore write still in flight then
    reports into that closed loop (one unraisable traceback each, some after the save has
    raised). `Checkpointer.save` reports the failure as one line; anything else goes on to the
    previous hook."""

    def __init__(self) -> None:
        self.active = False
        self._previous = sys.unraisablehook

    def install(self) -> None:
        if sys.unraisablehook is not self:
            self._previous, sys.unraisablehook = sys.unraisablehook, self

    def __call__(self, unraisable) -> None:
        exc = unraisable.exc_value
        if self.active and isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        self._previous(unraisable)


_CLOSED_LOOP_NOISE = _ClosedLoopNoise()
# A failed save's writers may still be creating files in its tmp folder: it is removed until it
# stays gone for _SETTLE_S (at most _REMOVE_TIMEOUT_S).
_SETTLE_S = 0.5
_REMOVE_TIMEOUT_S = 20.0


def _sync_hosts(name: str) -> None:
    """Barrier across processes (multi-host runs); a no-op for one process."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def _is_disk_full(e: BaseException) -> bool:
    """ENOSPC anywhere in the exception chain (orbax / tensorstore wrap the OSError)."""
    return any(getattr(x, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
               or "No space left on device" in str(x) for x in exception_chain(e))


def _encode(tree: Any) -> Any:
    """Replace empty dicts (no critic) by a placeholder leaf so orbax stores a real node."""
    if isinstance(tree, dict) and not tree:
        return {_EMPTY: np.zeros((), np.int8)}
    return tree


def _encode_abstract(tree: Any) -> Any:
    if isinstance(tree, dict) and not tree:
        return {_EMPTY: jax.ShapeDtypeStruct((), np.int8)}
    return tree


def _decode(tree: Any) -> Any:
    if isinstance(tree, dict) and set(tree) == {_EMPTY}:
        return {}
    return tree


def state_to_dict(state: TrainState, abstract: bool = False) -> dict:
    """The TrainState as the dict orbax saves (see the module docstring)."""
    enc = _encode_abstract if abstract else _encode
    return {f: enc(getattr(state, f)) for f in _FIELDS}


class Checkpointer:
    """Thin wrapper over ``ocp.CheckpointManager`` (synchronous saves, keep the last `keep`).

    Args:
      directory: checkpoint root (created; absolute path used).
      keep: number of most recent committed checkpoints kept (c.ckpt.keep); older ones are
        deleted only after a newer step's manifest is written.
      every: save period in iterations for `maybe_save` (c.ckpt.every; <= 0 = never periodic).
      clean_tmp: remove the ``<step>.orbax-checkpoint-tmp*`` folders saves cut short left
        (a kill or a full disk mid-save) when the manager opens. Only for the directory's
        one writer (train.py, under its workdir lock): a reader such as eval.py next to a
        running training must not delete the save in progress.
    """

    def __init__(self, directory: str, keep: int = 3, every: int = 10, clean_tmp: bool = False):
        self.directory = os.path.abspath(directory)
        self.every = int(every)
        self.keep = int(keep)
        self._bad_steps: set[int] = set()   # steps `restore` skipped: a save replaces them
        logging.getLogger("absl").addFilter(_DISK_FULL_NOISE)   # orbax logs through absl
        logging.getLogger("asyncio").addFilter(_DISK_FULL_NOISE)
        _CLOSED_LOOP_NOISE.install()
        # Retention is done here, after the manifest commits a step (orbax would delete the
        # old steps before that).
        opts = ocp.CheckpointManagerOptions(max_to_keep=None, create=True,
                                            enable_async_checkpointing=False,
                                            cleanup_tmp_directories=bool(clean_tmp))
        self._mngr = ocp.CheckpointManager(self.directory, options=opts,
                                           item_names=("state", "meta"))

    # -- save --------------------------------------------------------------------------

    def save(self, state: TrainState, *, sampler_state: dict | None = None,
             config: Any = None, force: bool = True, trainer_state: dict | None = None) -> int:
        """Write a checkpoint at step int(state.step), wait for it and commit it; returns the step.

        sampler_state: JSON-able dict (task-sampler position); trainer_state: JSON-able dict
        (the trainer's host state, `Trainer.host_state`; its "host_arrays" go to host/, the
        rest to the meta); config: JSON text, a dict, or an
        ml_collections ConfigDict (stored via to_json). A step already committed on disk is
        kept as it is (not deleted, not rewritten; logged; checked by manifest and file sizes,
        not re-hashed); a step on disk without a valid manifest, or one that `restore` skipped
        as corrupt, is replaced. `force` is kept for callers of the old API and ignored.
        Raises CheckpointWriteError on a full disk (one line: directory, bytes needed, free).
        """
        del force
        step = int(jax.device_get(state.step))
        step_dir = os.path.join(self.directory, str(step))
        if step in self._mngr.all_steps():
            try:
                if step in self._bad_steps:
                    raise CorruptCheckpointError(f"{step_dir} failed to restore")
                if meta_step(step_dir) != step:
                    raise CorruptCheckpointError(f"{step_dir} holds step "
                                                 f"{meta_step(step_dir)}")
                verify_step(step_dir, contents=False)   # committed, complete: keep it
                log.info("checkpoint step %d is already on disk in %s; not saving it again",
                         step, self.directory)
                return step
            except CorruptCheckpointError as e:
                log.warning("replacing checkpoint step %d (%s)", step, e)
                self._mngr.delete(step)
        if isinstance(config, str):
            cfg = json.loads(config)
        elif hasattr(config, "to_json"):
            cfg = json.loads(config.to_json())
        else:
            cfg = config
        trainer_state, host_arrays = split_host_arrays(trainer_state)   # -> host/arrays.npz
        meta = {"format": FORMAT, "step": step, "sampler_state": sampler_state,
                "trainer_state": trainer_state, "config": cfg}
        _CLOSED_LOOP_NOISE.install()   # again: a test harness may have swapped the hook
        _CLOSED_LOOP_NOISE.active = True
        try:
            self._mngr.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state_to_dict(state)),
                meta=ocp.args.JsonSave(meta)), force=True)
            self._mngr.wait_until_finished()
            if jax.process_index() == 0:   # one writer; the other hosts wait for the commit
                if host_arrays is not None:
                    write_host_arrays(step_dir, host_arrays)
                write_manifest(step_dir)
            _sync_hosts(f"strata_ckpt_commit_{step}")
        except BaseException as e:   # Ctrl-C / a stop signal mid-save too: leave no tmp folder
            self._remove_partial(step)
            if not _is_disk_full(e):
                raise
            need = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                       for x in jax.tree.leaves(state_to_dict(state)))
            free = shutil.disk_usage(self.directory).free
            raise CheckpointWriteError(
                errno.ENOSPC, f"no space left on device for checkpoint step {step} in "
                f"{self.directory}: it needs ~{need / 2**20:.1f} MiB, {free / 2**20:.1f} MiB "
                f"free; free space there or use another --config.workdir ("
                f"{_intact(self._committed_steps())})") from None
        _CLOSED_LOOP_NOISE.active = False   # (stays on after a failure: its writers linger)
        self._apply_retention()
        return step

    def _committed_steps(self) -> list[int]:
        """Steps on disk with a manifest (committed), ascending."""
        return [s for s in sorted(self._mngr.all_steps())
                if os.path.exists(os.path.join(self.directory, str(s), MANIFEST))]

    def _apply_retention(self) -> None:
        """Delete the oldest steps beyond `keep`, counting only committed steps."""
        self._mngr.reload()
        committed = self._committed_steps()
        if len(committed) <= self.keep:
            return
        newest_kept = committed[-self.keep:]
        for s in sorted(self._mngr.all_steps()):
            if s < newest_kept[0]:
                self._mngr.delete(s)

    def _remove_partial(self, step: int) -> None:
        """Remove what a failed save of `step` left: the uncommitted step dir, orbax tmp dirs.

        orbax's writer threads may still be writing there (a removal races them, or they
        recreate the folder): removed again until it stays gone for _SETTLE_S; a folder still
        there after _REMOVE_TIMEOUT_S is named in one warning."""
        deadline = time.monotonic() + _REMOVE_TIMEOUT_S
        gone_since = None
        while True:
            left = self._partial_entries(step)
            for full in left:
                shutil.rmtree(full, ignore_errors=True)
            now = time.monotonic()
            if left:
                gone_since = None
            elif gone_since is None:
                gone_since = now
            elif now - gone_since >= _SETTLE_S:
                break
            if now > deadline:
                if left:
                    log.warning("could not remove the partial checkpoint %s; delete it",
                                ", ".join(left))
                break
            time.sleep(0.05)
        try:
            self._mngr.reload()
        except Exception:  # noqa: BLE001 — the manager is only used for listing afterwards
            pass

    def _partial_entries(self, step: int) -> list[str]:
        """Paths of what an unfinished save of `step` leaves: the step dir without a manifest,
        orbax's ``<step>.orbax-checkpoint-tmp*`` dirs."""
        out = []
        for name in os.listdir(self.directory):
            full = os.path.join(self.directory, name)
            partial_step = name == str(step) and not os.path.exists(os.path.join(full, MANIFEST))
            if partial_step or (name.startswith(f"{step}.") and "tmp" in name):
                out.append(full)
        return out

    def maybe_save(self, state: TrainState, **kw) -> bool:
        """Save when state.step is a positive multiple of `every`; returns whether it saved."""
        step = int(jax.device_get(state.step))
        if self.every > 0 and step > 0 and step % self.every == 0:
            self.save(state, **kw)
            return True
        return False

    # -- restore -----------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Steps present on disk, ascending (re-read from the directory)."""
        self._mngr.reload()
        return sorted(self._mngr.all_steps())

    def latest_step(self) -> int | None:
        """The newest step on disk (not necessarily restorable), or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def restore(self, abstract_state: TrainState, step: int | None = None
                ) -> tuple[TrainState, dict] | None:
        """Restore the newest restorable checkpoint (or `step`) onto `abstract_state`'s shardings.

        Args:
          abstract_state: ``Trainer.abstract_state()`` (ShapeDtypeStructs with shardings).
          step: a specific step (no fallback), or None = newest, falling back to older ones.
        Returns (state, meta dict with "step", "sampler_state", "trainer_state" (absent in
        older checkpoints), "config"), or None when the
        directory holds no checkpoint. Each step that fails is warned (naming the step, the
        file and the older step tried next) only when an older step is left to try.
        Raises NoRestorableCheckpointError (one line: every step tried and why, what to do)
        when checkpoints exist but none can be restored, or `step` cannot be.
        """
        target = state_to_dict(abstract_state, abstract=True)
        steps = [step] if step is not None else sorted(self.all_steps(), reverse=True)
        if not steps:
            return None
        errors = []
        for i, s in enumerate(steps):
            try:
                if step is not None and s not in self.all_steps():
                    raise FileNotFoundError(f"there is no step {s} (steps on disk: "
                                            f"{self.all_steps()})")
                step_dir = os.path.join(self.directory, str(s))
                verified = verify_step(step_dir)
                if not verified:
                    self._check_unverified_format(s)
                out = self._mngr.restore(s, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
                d = out["state"]
                state = TrainState(**{f: _decode(d[f]) for f in _FIELDS})
                meta = with_host_arrays(step_dir, dict(out["meta"]))
                check_step(s, meta, state)
                if not verified:
                    msg = (f"checkpoint step {s} in {self.directory} has no checksum manifest "
                           "(format 1, written before manifests existed): restored unverified")
                    warnings.warn(msg, RuntimeWarning, stacklevel=2)
                    log.warning(msg)
                return state, checked_trainer_state(s, self.directory, meta)
            except Exception as e:  # noqa: BLE001 — any failure means "unusable checkpoint"
                self._bad_steps.add(s)
                why = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                errors.append(f"step {s}: {why}")
                if i + 1 < len(steps):
                    msg = (f"checkpoint step {s} in {self.directory} could not be restored "
                           f"({why}); falling back to step {steps[i + 1]}")
                    warnings.warn(msg, RuntimeWarning, stacklevel=2)
                    log.warning(msg)
        what = (f"checkpoint step {step} in {self.directory} cannot be restored"
                if step is not None else f"no restorable checkpoint in {self.directory}")
        raise NoRestorableCheckpointError(
            f"{what} ({'; '.join(errors)}). Restore the named file from a copy, or move "
            f"{self.directory} aside to start the run afresh")

    def _check_unverified_format(self, step: int) -> None:
        """A step without a manifest restores unverified only where manifests are unknown: in
        a directory whose other steps are format 2 it is refused (CorruptCheckpointError), so
        deleting a manifest and calling the step format 1 cannot switch verification off."""
        newer = [s for s in self.all_steps() if s != step
                 and step_format(os.path.join(self.directory, str(s))) >= FORMAT]
        if newer:
            raise CorruptCheckpointError(
                f"step {step} claims format 1 (no checksum manifest) but step"
                f"{'s' if len(newer) > 1 else ''} {', '.join(map(str, newer))} in this "
                f"directory are format {FORMAT}: its manifest was removed")

    def close(self) -> None:
        """Wait for pending writes and release the manager (its threads and event loop)."""
        self._mngr.wait_until_finished()
        self._mngr.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _intact(steps: list[int]) -> str:
    if not steps:
        return "no earlier step is on disk"
    return f"earlier step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))} intact"


class PreemptionFlag:
    """SIGTERM (and optionally SIGINT) handler that only sets a flag; the training loop checks
    `requested` between iterations, saves a checkpoint and exits cleanly.

    Use as a context manager (restores the previous handlers on exit) or call install().
    Only installable from the main thread (a Python signal rule).
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)):
        self.signals = signals
        self._event = threading.Event()
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        """True once one of the signals arrived."""
        return self._event.is_set()

    def _handler(self, signum, frame) -> None:  # noqa: ARG002
        log.warning("%s received: will checkpoint and stop after this iteration",
                    signal.Signals(signum).name)
        self._event.set()

    def install(self) -> "PreemptionFlag":
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handler)
        return self

    def uninstall(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def __enter__(self) -> "PreemptionFlag":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()


def tree_to_numpy(tree: Any) -> Any:
    """Host copy of a pytree (for comparisons in tests and logging)."""
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


__all__ = ["Checkpointer", "CheckpointWriteError", "CorruptCheckpointError",
           "NoRestorableCheckpointError", "PreemptionFlag",
           "state_to_dict", "tree_to_numpy", "verify_step", "write_manifest"]
