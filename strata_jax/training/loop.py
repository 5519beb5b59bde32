"""A minimal iterate -> update -> checkpoint loop with clean preemption (used by the trainer
tests' driver; the entry-points issue owns the full rollout loop and may reuse it).

Checkpoints: every `checkpointer.every` iterations, when SIGTERM arrived (after the iteration in
flight finishes: the handler only sets a flag), and at exit — also when an exception escapes
(Ctrl-C, an env or update error), in which case the state from BEFORE the interrupted iteration
began is saved: params, optimizer, PRNG and the task sampler's position all as they were when
that iteration started, so the resumed run redoes it exactly (the metrics writer drops the rows
logged after the saved step on resume). A step already committed on disk is not saved again,
and an exception raised by the checkpointer itself (a full disk) is not followed by a second
save attempt.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import jax

from strata_jax.algos import SampleBatch
from strata_jax.training.checkpoint import Checkpointer, PreemptionFlag
from strata_jax.training.state import TrainState
from strata_jax.training.update import Trainer

log = logging.getLogger(__name__)


def run_loop(trainer: Trainer, state: TrainState, next_batch: Callable[[TrainState], SampleBatch],
             *, iterations: int, checkpointer: Checkpointer | None = None,
             ref_params: Any = None, sampler_state: Callable[[], dict | None] = lambda: None,
             config: Any = None, on_metrics: Callable[[int, dict], None] | None = None,
             flag: PreemptionFlag | None = None) -> tuple[TrainState, str]:
    """Run iterations until state.step == iterations (or preemption).

    Args:
      trainer, state: the update and its state (a restored state resumes at its step).
      next_batch: state -> SampleBatch of the next iteration (rollout, or a stub in tests).
      iterations: total iterations (c.iterations). checkpointer: optional Checkpointer.
      ref_params: frozen reference params for the KL term.
      sampler_state: returns the task sampler's JSON-able position, saved in each checkpoint.
      config: experiment config stored in each checkpoint. on_metrics(step, metrics) callback.
      flag: a PreemptionFlag already installed by the caller (default: one is installed here).
    Returns (state, "done" | "preempted").
    """
    own = flag is None
    flag = flag or PreemptionFlag().install()
    saving = [False]   # True while the checkpointer runs: its own errors are not retried

    def save(s, sampler):
        if checkpointer is not None:
            saving[0] = True
            checkpointer.save(s, sampler_state=sampler, config=config)
            saving[0] = False

    # The state and task-sampler position at the start of the iteration in flight.
    start_state, start_sampler = state, sampler_state()
    try:
        while int(jax.device_get(state.step)) < iterations:
            start_state, start_sampler = state, sampler_state()
            batch = next_batch(state)
            state, metrics = trainer.update(state, batch, ref_params)
            step = int(jax.device_get(state.step))
            if on_metrics is not None:
                on_metrics(step, metrics)
            if flag.requested:
                save(state, sampler_state())
                return state, "preempted"
            if checkpointer is not None and checkpointer.every > 0 and step > 0 \
                    and step % checkpointer.every == 0:
                save(state, sampler_state())
            start_state, start_sampler = state, sampler_state()
        save(state, sampler_state())
        return state, "done"
    except BaseException:
        if not saving[0]:
            try:
                save(start_state, start_sampler)
            except Exception as e:  # noqa: BLE001 — the original error is the one to raise
                log.error("could not checkpoint after the error below: %s: %s",
                          type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        raise
    finally:
        if own:
            flag.uninstall()
