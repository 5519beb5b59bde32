"""A minimal iterate -> update -> checkpoint loop with clean preemption (used by the trainer
tests' driver; the entry-points issue owns the full rollout loop and may reuse it).

Checkpoints: every `checkpointer.every` iterations, when SIGTERM arrived (after the iteration in
flight finishes: the handler only sets a flag), and at exit — also when an exception escapes,
in which case the last COMPLETED state is saved before the error propagates.
"""
from __future__ import annotations

from typing import Any, Callable

import jax

from strata_jax.algos import SampleBatch
from strata_jax.training.checkpoint import Checkpointer, PreemptionFlag
from strata_jax.training.state import TrainState
from strata_jax.training.update import Trainer


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

    def save(s):
        if checkpointer is not None:
            checkpointer.save(s, sampler_state=sampler_state(), config=config)

    try:
        while int(jax.device_get(state.step)) < iterations:
            batch = next_batch(state)
            state, metrics = trainer.update(state, batch, ref_params)
            step = int(jax.device_get(state.step))
            if on_metrics is not None:
                on_metrics(step, metrics)
            if flag.requested:
                save(state)
                return state, "preempted"
            if checkpointer is not None:
                checkpointer.maybe_save(state, sampler_state=sampler_state(), config=config)
        save(state)
        return state, "done"
    except BaseException:
        save(state)
        raise
    finally:
        if own:
            flag.uninstall()
