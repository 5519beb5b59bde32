"""Checkpoint saves of a training loop, including the save on the exception path.

`train.py` writes its iteration loop out in full (rollout -> update -> log -> checkpoint ->
eval); this class holds the one piece of it that is subtle to get right:

    with LoopCheckpoints(checkpointer, config) as saves:
        for step in range(start, iterations):
            saves.mark(state, sampler.get_state(), trainer.host_state())  # what an error saves
            ...                                       # rollout, update, log
            if saves.due(step + 1):
                saves.save(state, sampler.get_state())
        saves.save(state, sampler.get_state())        # the end of the run

Checkpoints are written every `checkpointer.every` iterations (`due`), when the caller asks
(preemption, the end of the run), and when an exception escapes the ``with`` block (Ctrl-C, an
env or update error): then the MARKED state is saved, i.e. the one from before the interrupted
iteration began: params, optimizer, PRNG and the task sampler's position all as they were when
that iteration started, so the resumed run redoes it exactly (the metrics writer drops the rows
logged after the saved step on resume). A step already committed on disk is not saved again
(`Checkpointer.save`), and an exception raised by the checkpointer itself (a full disk) is not
followed by a second save attempt. With ``train.donate_state`` an error inside the update itself
finds that state donated (its buffers reused by the optimizer step): nothing is saved then, the
log says so, and the resume starts from the newest checkpoint on disk.
"""
from __future__ import annotations

import logging
from typing import Any

import jax

from strata_jax.training.checkpoint import Checkpointer
from strata_jax.training.state import TrainState

log = logging.getLogger(__name__)


class LoopCheckpoints:
    """The checkpoint saves of one training loop (see the module docstring).

    Args:
      checkpointer: where to save; None saves nothing (a loop without checkpoints).
      config: the experiment config stored with every checkpoint (JSON-able or None).
    """

    def __init__(self, checkpointer: Checkpointer | None, config: Any = None) -> None:
        self.checkpointer, self.config = checkpointer, config
        self._marked: tuple[TrainState, dict | None, dict | None] | None = None
        self._saving = False   # True while the checkpointer runs: its own errors are not retried

    def mark(self, state: TrainState, sampler_state: dict | None = None,
             trainer_state: dict | None = None) -> None:
        """Remember the state (and task-sampler position, and the trainer's host state) an
        exception should save: the one the iteration about to run starts from."""
        self._marked = (state, sampler_state, trainer_state)

    def due(self, step: int) -> bool:
        """True when `step` (iterations done) is on the checkpointer's ``every`` cadence."""
        ck = self.checkpointer
        return ck is not None and ck.every > 0 and step > 0 and step % ck.every == 0

    def save(self, state: TrainState, sampler_state: dict | None = None,
             trainer_state: dict | None = None) -> None:
        """Save `state` now (a no-op without a checkpointer); it becomes the marked state."""
        self._marked = (state, sampler_state, trainer_state)
        if self.checkpointer is None:
            return
        self._saving = True
        self.checkpointer.save(state, sampler_state=sampler_state, config=self.config,
                               trainer_state=trainer_state)
        self._saving = False

    def __enter__(self) -> "LoopCheckpoints":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None or self._saving or self._marked is None:
            return
        if _deleted(self._marked[0]):
            log.error("the state this iteration started from was donated to the update "
                      "(train.donate_state) and is gone, so nothing is saved after the error "
                      "below: a resume restarts from the newest checkpoint on disk (set "
                      "ckpt.every=1 to lose at most one iteration)")
            return
        try:
            self.save(*self._marked)
        except Exception as e:  # noqa: BLE001 — the original error is the one to raise
            log.error("could not checkpoint after the error below: %s: %s",
                      type(e).__name__, str(e).splitlines()[0] if str(e) else "")


def _deleted(state: TrainState) -> bool:
    """True when any array of `state` was deleted (donated to a jitted step)."""
    return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(state))


__all__ = ["LoopCheckpoints"]
