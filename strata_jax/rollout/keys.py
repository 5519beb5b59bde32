"""Per-row PRNG keys from global ids, never from row positions (docs/method.md §1.4).

A row's key is a `jax.random.fold_in` chain over its global ids:
``fold_in(...fold_in(fold_in(base, purpose), task_uid)..., step)``. The ids are the same on
every host and in every batch layout (task uid = the task's index in the iteration's global
task list; strategy / episode / step indices inside that task), so which host, cohort or batch
row an episode lands on never changes its tokens (the sampler's tokens depend only on the
prompt and the key).

The chain runs as one jitted ``vmap`` over a row-count bucket (powers of two), so building
512 keys is one small program, not 2,500 eager ops.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.buckets import bucket

PURPOSE_STRATEGY = 0
"""First id of a strategy-candidate key: (PURPOSE_STRATEGY, task_uid, candidate)."""
PURPOSE_ACTION = 1
"""First id of a step key: (PURPOSE_ACTION, task_uid, strategy_id, trajectory_id, step)."""
PURPOSE_JUDGE = 2
"""First id of a judge key: (PURPOSE_JUDGE, task_uid, strategy_id, trajectory_id)."""
PURPOSE_REVISION = 3
"""First id of a strategy-revision key: (PURPOSE_REVISION, task_uid, strategy_id,
trajectory_id, step), step = the env steps the episode had taken when it revised."""

ID_WIDTH = 5
"""Ids per row; shorter id tuples are right-padded with 0 (a fixed width keeps one program)."""


def base_key_data(key: Any) -> np.ndarray:
    """A PRNG key (typed, or raw uint32 [2] threefry data, or an int seed) -> raw uint32 [2].

    Raises ValueError for anything else (pass ``jax.random.key(seed)``).
    """
    if isinstance(key, (int, np.integer)):
        return np.asarray(jax.random.key_data(jax.random.key(int(key))), np.uint32)
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    raw = np.asarray(key)
    if raw.dtype != np.uint32 or raw.shape != (2,):
        raise ValueError(f"base key must be a typed PRNG key, raw uint32[2] key data or an int "
                         f"seed; got shape {raw.shape} dtype {raw.dtype} "
                         f"(pass jax.random.key(seed))")
    return raw


@jax.jit
def _chain(base: jax.Array, ids: jax.Array) -> jax.Array:
    """base: uint32 [2]; ids: int32 [B, ID_WIDTH] -> raw key data uint32 [B, 2]."""

    def one(row):
        k = jax.random.wrap_key_data(base)
        for j in range(ID_WIDTH):
            k = jax.random.fold_in(k, row[j])
        return jax.random.key_data(k)

    return jax.vmap(one)(ids)


def row_keys(key: Any, ids: Sequence[Sequence[int]]) -> np.ndarray:
    """One PRNG key per row from that row's global ids.

    Args:
      key: the iteration's base key (typed, raw uint32 [2], or an int seed).
      ids: B tuples of at most `ID_WIDTH` non-negative ints, e.g.
        ``(PURPOSE_ACTION, task_uid, strategy_id, trajectory_id, step)``.
    Returns:
      raw threefry key data, uint32 [B, 2] (the sampler accepts it directly).
    Raises:
      ValueError: an id tuple longer than ID_WIDTH or a negative id.
    """
    n = len(ids)
    if n == 0:
        return np.zeros((0, 2), np.uint32)
    arr = np.zeros((bucket(n, 8), ID_WIDTH), np.int64)
    for i, t in enumerate(ids):
        if len(t) > ID_WIDTH:
            raise ValueError(f"row {i}: {len(t)} ids, at most {ID_WIDTH} allowed")
        arr[i, : len(t)] = t
    if arr.min() < 0 or arr.max() >= 2**31:
        raise ValueError("row key ids must be in [0, 2^31)")
    out = _chain(jnp.asarray(base_key_data(key)), jnp.asarray(arr, jnp.int32))
    return np.asarray(jax.device_get(out))[:n]
