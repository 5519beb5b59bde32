"""Jit-safe group statistics over id labels: dense remap, segment mean/std, per-trajectory scans.

All functions take [R] arrays and a boolean mask of the rows that take part, and use static
segment counts (R + 1: R possible groups plus one trash bucket for masked-out rows), so a
batch compiles once per row bucket and no Python loop runs over samples.
Source: docs/method.md §4 (group by id, not position; size-1 and zero-variance
groups; ddof; fp32 one-pass variance residue).
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp


def dense_group_ids(keys: Sequence[jax.Array], mask: jax.Array) -> jax.Array:
    """Map each masked row's key tuple to a dense group id in [0, R); masked-out rows get R.

    Args:
        keys: one or more [R] int arrays; rows with equal key tuples share a group,
              wherever they sit in the batch (grouping by value, not by position).
        mask: [R] bool, rows that take part.
    Returns:
        [R] int32 group ids; use with num_segments = R + 1 (bucket R is the trash bucket).
    Source: a sort-based jit-safe replacement of `np.unique(..., return_inverse=True)`.
    """
    mask = mask.astype(bool)
    R = mask.shape[0]
    # jnp.lexsort: the last key is the primary one. Masked-out rows sort last.
    order = jnp.lexsort(tuple(k.astype(jnp.int32) for k in reversed(list(keys))) + (~mask,))
    sorted_keys = [k[order] for k in keys]
    changed = jnp.zeros((R,), bool).at[0].set(True)
    for k in sorted_keys:
        changed = changed.at[1:].set(changed[1:] | (k[1:] != k[:-1]))
    dense_sorted = jnp.cumsum(changed.astype(jnp.int32)) - 1
    dense = jnp.zeros((R,), jnp.int32).at[order].set(dense_sorted)
    return jnp.where(mask, dense, R).astype(jnp.int32)


# A group is constant when its values spread by at most this fraction of their magnitude (at
# least of 1, a reward unit): float32 and float64 sums of the same rewards in another order
# (an episode return summed from other deltas, a discounted return scanned at another offset,
# a top-mean of another k) land a few ulps apart, and (x - mean) / (std + eps) would turn those
# ulps into advantages of order 0.1. A few hundred ulps of float32, far below any reward step.
CONSTANT_RTOL = 1e-5


def is_constant(vmax, vmin, xp=jnp):
    """True where a group of values is one value at the estimators' precision.

    Args: vmax, vmin: the group's largest and smallest value (arrays or scalars, any shape);
    xp: the array module, jax.numpy (jit-safe, the default) or numpy (host side, DAPO's filter).
    Returns: bool array, vmax - vmin <= CONSTANT_RTOL * max(|vmax|, |vmin|, 1).
    The one constancy rule of the estimators' zero-variance groups and of DAPO's dynamic
    sampling (docs/method.md §4.1, §6.5).
    """
    scale = xp.maximum(xp.maximum(xp.abs(vmax), xp.abs(vmin)), 1.0)
    return (vmax - vmin) <= CONSTANT_RTOL * scale


def segment_stats(values: jax.Array, seg: jax.Array, mask: jax.Array, ddof: int) -> dict:
    """Per-row group count, mean, std (two-pass, ddof) and zero-variance flag.

    Args:
        values: [R] f32; seg: [R] int32 from `dense_group_ids` (R = trash); mask: [R] bool.
        ddof:   0 (population std, StraTA's pin) or 1 (unbiased, torch.std / verl).
    Returns:
        dict of [R] arrays gathered back to rows: count (f32), mean, std, constant (bool:
        the group's values are one value, `is_constant` of its max and min, so neither fp32
        residue of the mean nor an ulp of summation order leaks a non-zero advantage), plus `num_groups` (scalar int32) and
        `num_constant_groups` (groups of size >= 2 whose values are all equal).
    """
    R = values.shape[0]
    n = R + 1
    m = mask.astype(values.dtype)
    v = jnp.where(mask, values, 0.0)
    count = jax.ops.segment_sum(m, seg, num_segments=n)
    total = jax.ops.segment_sum(v, seg, num_segments=n)
    mean = total / jnp.maximum(count, 1.0)
    centred = jnp.where(mask, values - mean[seg], 0.0)
    ssq = jax.ops.segment_sum(centred * centred, seg, num_segments=n)
    var = ssq / jnp.maximum(count - ddof, 1.0)
    vmax = jax.ops.segment_max(jnp.where(mask, values, -jnp.inf), seg, num_segments=n)
    vmin = jax.ops.segment_min(jnp.where(mask, values, jnp.inf), seg, num_segments=n)
    constant_g = is_constant(vmax, vmin) & (count >= 1)
    live = (count > 0).at[R].set(False)
    return dict(
        count=count[seg], mean=mean[seg], std=jnp.sqrt(var)[seg], constant=constant_g[seg],
        num_groups=jnp.sum(live).astype(jnp.int32),
        num_constant_groups=jnp.sum(live & constant_g & (count >= 2)).astype(jnp.int32),
    )


def group_normalize(
    values: jax.Array,
    seg: jax.Array,
    mask: jax.Array,
    *,
    norm_by_std: bool,
    ddof: int,
    eps: float,
    singleton: str,
) -> tuple[jax.Array, dict]:
    """Group-relative advantage (S - mean_g) [/ (std_g + eps)] with the pinned edge cases.

    Args:
        values: [R] f32 scores; seg: [R] int32 dense group ids; mask: [R] bool.
        norm_by_std: divide by std_g + eps (GRPO) or not (Dr.GRPO, GiGPO mean_norm).
        ddof: std degrees of freedom (0 StraTA, 1 verl).
        eps: added to the std (1e-6).
        singleton: size-1 group convention: "grpo" = verl's mean 0, std 1, so A = S / (1 + eps)
            (or S without std normalisation); "zero" = A = 0 (GiGPO step groups, RLOO).
    Returns:
        ([R] f32 advantages, 0 on masked-out rows and exactly 0 in zero-variance groups of
        size >= 2; stats dict from `segment_stats`).
    Source: docs/method.md §4.1 (GRPO, zero-variance groups give exactly 0 and are kept).
    """
    if singleton not in ("grpo", "zero"):
        raise ValueError(f"singleton must be 'grpo' or 'zero', got {singleton!r}")
    st = segment_stats(values, seg, mask, ddof)
    centred = values - st["mean"]
    adv = centred / (st["std"] + eps) if norm_by_std else centred
    single = st["count"] <= 1.0
    if singleton == "grpo":
        single_adv = values / (1.0 + eps) if norm_by_std else values
    else:
        single_adv = jnp.zeros_like(values)
    adv = jnp.where(single, single_adv, jnp.where(st["constant"], 0.0, adv))
    return jnp.where(mask, adv, 0.0).astype(jnp.float32), st


def trajectory_order(traj_seg: jax.Array, step_index: jax.Array, mask: jax.Array):
    """Sort rows by (trajectory, step) and say which sorted row has a successor in its trajectory.

    Args:
        traj_seg: [R] int32 dense trajectory ids; step_index: [R] int32; mask: [R] bool.
    Returns:
        (order [R] int32: sorted position -> row, has_next [R] bool in sorted order).
    """
    order = jnp.lexsort((step_index, traj_seg, ~mask.astype(bool)))
    t = traj_seg[order]
    m = mask.astype(bool)[order]
    has_next = jnp.concatenate([(t[1:] == t[:-1]) & m[1:] & m[:-1], jnp.zeros((1,), bool)])
    return order, has_next


def reverse_linear_recurrence(b: jax.Array, a: jax.Array) -> jax.Array:
    """x_i = b_i + a_i * x_{i+1} (x_R = 0), as a parallel associative scan.

    Args: b, a: [R] f32 in sorted (trajectory, step) order; a_i = 0 ends a trajectory.
    Returns: [R] f32 x. Used for discounted returns (a = gamma) and GAE (a = gamma * lambda).
    """
    def combine(later, earlier):
        # Each element is the affine map y -> b + a*y; compose earlier ∘ later.
        a_l, b_l = later
        a_e, b_e = earlier
        return a_e * a_l, b_e + a_e * b_l

    # A reverse scan feeds (accumulated later elements, current element) to `combine`.
    _, x = jax.lax.associative_scan(lambda l, e: combine(l, e), (a, b), reverse=True)
    return x


def per_trajectory_reverse(
    b: jax.Array, coef: float | jax.Array, traj_seg: jax.Array, step_index: jax.Array,
    mask: jax.Array,
) -> jax.Array:
    """Per-trajectory x_t = b_t + coef * x_{t+1}, x after the trajectory's last step = 0.

    Args: b [R] f32 (row order); coef scalar; traj_seg, step_index [R] int32; mask [R] bool.
    Returns: [R] f32 in row order, 0 on masked-out rows.
    """
    order, has_next = trajectory_order(traj_seg, step_index, mask)
    a = jnp.where(has_next, coef, 0.0).astype(jnp.float32)
    xs = reverse_linear_recurrence(jnp.where(mask, b, 0.0)[order].astype(jnp.float32), a)
    x = jnp.zeros_like(xs).at[order].set(xs)
    return jnp.where(mask, x, 0.0)
