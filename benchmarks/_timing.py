"""Timing of whole `Trainer.update` calls, shared by the update benchmarks (iteration.py's
grouping part, gpu.py): one warm-up call (compilation included), then `repeats` timed calls.
jax + the repo only, so it runs on a bare accelerator image."""
from __future__ import annotations

import time
from typing import Any, Callable


def time_updates(trainer: Any, state: Any, batch: Any, ref_params: Any, repeats: int,
                 after_warmup: Callable[[], None] | None = None
                 ) -> tuple[Any, float, list[float], dict]:
    """Returns (state after every call, warm-up seconds, the timed calls' seconds, the last
    call's metrics). after_warmup runs between the warm-up and the timed calls (e.g. to read a
    compilation counter). Each call blocks until the new state is computed."""
    import jax

    t = time.perf_counter()
    state, metrics = trainer.update(state, batch, ref_params=ref_params)
    jax.block_until_ready(state)
    warm = time.perf_counter() - t
    if after_warmup is not None:
        after_warmup()
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        state, metrics = trainer.update(state, batch, ref_params=ref_params)
        jax.block_until_ready(state)
        runs.append(time.perf_counter() - t)
    return state, warm, runs, metrics
