"""Checkpoints with orbax: save every K iterations, on SIGTERM and at exit; exact resume;
restore onto another device count / mesh; fall back past a corrupt or partial latest step.

Layout (one orbax CheckpointManager directory, async off, keep the last n):

  <dir>/<step>/state/   the TrainState as a dict {"params", "opt_state", "critic_params",
                        "critic_opt_state", "step", "rng"} (orbax StandardSave, OCDBT);
                        empty subtrees ({} critic when there is none) are stored as a 0-d
                        placeholder so orbax never sees an empty node.
  <dir>/<step>/meta/    JSON: {"step": int, "sampler_state": <the caller's opaque JSON-able
                        dict, e.g. the task sampler's get_state()>, "config": <the experiment
                        config as JSON text or a dict>, "format": 1}
  <step> = TrainState.step (iterations completed).

Restore: `Checkpointer.restore(abstract_state)` with `Trainer.abstract_state()` (ShapeDtypeStructs
carrying the target NamedShardings) puts every array straight onto the target mesh, whatever
mesh wrote it (design.md "JAX version notes"). A step that fails to restore (truncated file,
missing metadata) is skipped with a warning in favour of the next older one.
Source: orbax-checkpoint 0.12 CheckpointManager docs; issue 7.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from strata_jax.training.state import TrainState

log = logging.getLogger(__name__)

_EMPTY = "__empty__"
_FIELDS = ("params", "opt_state", "critic_params", "critic_opt_state", "step", "rng")


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
      keep: number of most recent checkpoints kept (c.ckpt.keep).
      every: save period in iterations for `maybe_save` (c.ckpt.every; <= 0 = never periodic).
    """

    def __init__(self, directory: str, keep: int = 3, every: int = 10):
        self.directory = os.path.abspath(directory)
        self.every = int(every)
        opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                            enable_async_checkpointing=False)
        self._mngr = ocp.CheckpointManager(self.directory, options=opts,
                                           item_names=("state", "meta"))

    # -- save --------------------------------------------------------------------------

    def save(self, state: TrainState, *, sampler_state: dict | None = None,
             config: Any = None, force: bool = True) -> int:
        """Write a checkpoint at step int(state.step) and wait for it; returns the step.

        sampler_state: JSON-able dict (task-sampler position); config: JSON text, a dict, or an
        ml_collections ConfigDict (stored via to_json). A step that already exists is replaced
        only with force=True (the default) — resaving the same step after a resume is harmless.
        """
        step = int(jax.device_get(state.step))
        if isinstance(config, str):
            cfg = json.loads(config)
        elif hasattr(config, "to_json"):
            cfg = json.loads(config.to_json())
        else:
            cfg = config
        meta = {"format": 1, "step": step, "sampler_state": sampler_state, "config": cfg}
        if step in self._mngr.all_steps():
            if not force:
                return step
            self._mngr.delete(step)
        self._mngr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state_to_dict(state)),
            meta=ocp.args.JsonSave(meta)), force=True)
        self._mngr.wait_until_finished()
        return step

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
        Returns (state, meta dict with "step", "sampler_state", "config"), or None when the
        directory holds no checkpoint. Raises RuntimeError when checkpoints exist but none can
        be restored (each failure was warned), or the error of an explicit `step`.
        """
        target = state_to_dict(abstract_state, abstract=True)
        steps = [step] if step is not None else sorted(self.all_steps(), reverse=True)
        if not steps:
            return None
        errors = []
        for s in steps:
            try:
                out = self._mngr.restore(s, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
                d = out["state"]
                state = TrainState(**{f: _decode(d[f]) for f in _FIELDS})
                return state, dict(out["meta"])
            except Exception as e:  # noqa: BLE001 — any failure means "unusable checkpoint"
                if step is not None:
                    raise
                msg = (f"checkpoint step {s} in {self.directory} could not be restored "
                       f"({type(e).__name__}: {str(e)[:200]}); falling back to an older one")
                warnings.warn(msg, RuntimeWarning, stacklevel=2)
                log.warning(msg)
                errors.append(s)
        raise RuntimeError(f"no restorable checkpoint in {self.directory} (tried steps {errors})")

    def close(self) -> None:
        """Wait for pending writes and release the manager (its threads and event loop)."""
        self._mngr.wait_until_finished()
        self._mngr.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
        log.warning("signal %d received: will checkpoint and stop after this iteration", signum)
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


__all__ = ["Checkpointer", "PreemptionFlag", "state_to_dict", "tree_to_numpy"]
