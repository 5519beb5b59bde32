"""Host-side helpers of the update (numpy, outside jit): dropping all-padding columns, the
mini-batch plan of an epoch (docs/method.md §9.2); the buckets are strata_jax/buckets.py's.
The packed micro-batches are in `prefix_tree`; the jitted steps they feed are in
`strata_jax.training.steps`; `Trainer.update` (trainer.py) calls both.
"""
from __future__ import annotations

import math

import jax
import numpy as np

from strata_jax.algos import KIND_ACTION, KIND_STRATEGY, SampleBatch
from strata_jax.algos.batch import pad_batch
from strata_jax.buckets import bucket_size, response_columns
from strata_jax.distributed import host_values

_TOKEN_FIELDS = ("response_ids", "response_mask", "sampler_logprobs", "old_logprobs",
                 "ref_logprobs")
_PROMPT_FIELDS = ("prompt_ids", "prompt_mask")


def trim_padding(batch: SampleBatch, response_floor: int = 0) -> SampleBatch:
    """Drop the columns that are padding in every row: prompt columns left of the longest
    prompt, kept width rounded up to a `bucket_size` size (..., 48, 64, 96, 128, ...: at most
    two compiled shapes per octave), and set the response columns to `response_columns` of the
    longest response (response_floor): dropped right of it, or, with a floor above the batch's
    response width, padding columns added (so the micro-batches' response widths come from the
    floor's buckets, not from how the rollout happened to pad).

    Scores and losses are unchanged: a causal forward's output at a column depends only on the
    columns before it, padded keys are masked, RoPE positions count real tokens only, and the
    dropped or added response columns are off every mask. Returns the batch unchanged when its
    widths already are those, or a field is a multi-process array (not host-addressable).
    Numpy or jax leaves.
    """
    leaves = [getattr(batch, f) for f in _TOKEN_FIELDS + _PROMPT_FIELDS]
    if any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves):
        return batch
    pm = np.asarray(batch.prompt_mask, bool)
    rm = np.asarray(batch.response_mask, bool)
    tp, tr = pm.shape[1], rm.shape[1]
    cols_p = np.flatnonzero(pm.any(axis=0))
    cols_r = np.flatnonzero(rm.any(axis=0))
    need_p = tp - int(cols_p[0]) if cols_p.size else 1
    need_r = int(cols_r[-1]) + 1 if cols_r.size else 1
    new_p = min(tp, bucket_size(need_p, None, 8))
    new_r = response_columns(need_r, response_floor)
    if response_floor <= 0:   # without a floor only drop columns (explicit rollout buckets may
        new_r = min(tr, new_r)   # be narrower than a bucket_size size)
    if (new_p, new_r) == (tp, tr):
        return batch
    if new_r > tr:
        batch = pad_batch(batch, batch.num_rows, response_len=new_r)
    return trim_columns(batch, new_p, new_r)


def fit_to_bounds(batch: SampleBatch, bounds, response_floor: int = 0,
                  row_multiple: int = 1, trim: bool = True) -> SampleBatch:
    """The batch at the shape of `bounds` (`bounds.ShapeBounds`; None: `trim_padding` only
    when trim, else the batch as it is): all-padding columns dropped (`trim_padding`, always
    with bounds), then padded to bounds.prompt_width() prompt and
    bounds.response_width(response_floor) response columns and to bounds.rows rows rounded up
    to row_multiple (padding rows invalid, padding columns off every mask: the same scores and
    losses). A batch beyond a bound keeps its own (larger) size there. Returns numpy leaves
    when it pads; the batch as `trim_padding` returns it when nothing is to pad, or a field is
    a multi-process array (not host-addressable).
    """
    if bounds is None and not trim:
        return batch
    batch = trim_padding(batch, response_floor)
    leaves = [getattr(batch, f) for f in _TOKEN_FIELDS + _PROMPT_FIELDS]
    if bounds is None or any(isinstance(x, jax.Array) and not x.is_fully_addressable
                             for x in leaves):
        return batch
    tp, tr = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    rows = max(batch.num_rows, int(bounds.rows))
    rows = -(-rows // max(int(row_multiple), 1)) * max(int(row_multiple), 1)
    new_p, new_r = max(tp, bounds.prompt_width()), max(tr, bounds.response_width(response_floor))
    if (rows, new_p, new_r) == (batch.num_rows, tp, tr):
        return batch
    return pad_batch(batch, rows, prompt_len=new_p, response_len=new_r)


def trim_columns(batch: SampleBatch, prompt_width: int, response_width: int) -> SampleBatch:
    """The last `prompt_width` prompt columns and the first `response_width` response columns
    of every token field (prompts are left-padded, responses right-padded). Plain slicing: works
    on numpy and jax arrays, inside jit too. The caller guarantees every row fits."""
    tp = batch.prompt_ids.shape[1]
    out = {f: getattr(batch, f)[:, tp - prompt_width:] for f in _PROMPT_FIELDS}
    out.update({f: getattr(batch, f)[:, :response_width] for f in _TOKEN_FIELDS})
    return batch.replace(**out)


def row_widths(prompt_mask: np.ndarray, response_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Columns each row needs: (prompt [R] int: from its first prompt token to the end of the
    left-padded prompt, response [R] int: up to its last response token), 0 for an empty part."""
    pm, rm = np.asarray(prompt_mask, bool), np.asarray(response_mask, bool)
    need_p = np.where(pm.any(1), pm.shape[1] - np.argmax(pm, axis=1), 0)
    need_r = np.where(rm.any(1), rm.shape[1] - np.argmax(rm[:, ::-1], axis=1), 0)
    return need_p.astype(np.int64), need_r.astype(np.int64)


def num_minibatches(valid: np.ndarray, kind: np.ndarray, mini_batch_size: int) -> int:
    """Mini-batches per epoch that `minibatch_plan` makes: ceil(#valid step samples /
    mini_batch_size) (of the strategy samples when there are no step samples), at least 1."""
    n_act = int(np.sum(valid & (kind == KIND_ACTION)))
    n = n_act or int(np.sum(valid & (kind == KIND_STRATEGY)))
    return max(1, math.ceil(n / mini_batch_size))


def minibatch_plan(valid: np.ndarray, kind: np.ndarray, mini_batch_size: int, row_multiple: int,
                   rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """Row indices of each mini-batch of one epoch.

    The valid step samples are shuffled and split evenly into n = ceil(#step / mini_batch_size)
    mini-batches (at least 1); the valid strategy samples are shuffled and split evenly over the
    same n mini-batches (docs/method.md §9.2). Every mini-batch is padded to the same static
    row count rows = round_up(mini_batch_size + ceil(#strategy / n), row_multiple) so one compilation
    serves every mini-batch and iteration with the same n.
    Returns a list of (idx [rows] int32, real [rows] bool); padding entries point at row 0 with
    real False (the gather marks them invalid).
    """
    act = np.flatnonzero(valid & (kind == KIND_ACTION))
    strat = np.flatnonzero(valid & (kind == KIND_STRATEGY))
    n = num_minibatches(valid, kind, mini_batch_size)
    act, strat = rng.permutation(act), rng.permutation(strat)
    a_chunks, s_chunks = np.array_split(act, n), np.array_split(strat, n)
    share = math.ceil(len(strat) / n)
    rows = max(mini_batch_size + share, max(len(a) + len(s) for a, s in zip(a_chunks, s_chunks)))
    rows = int(math.ceil(rows / row_multiple) * row_multiple)
    plan = []
    for a, s in zip(a_chunks, s_chunks):
        real_idx = np.concatenate([a, s]).astype(np.int32)
        idx = np.zeros(rows, np.int32)
        idx[: real_idx.size] = real_idx
        real = np.zeros(rows, bool)
        real[: real_idx.size] = True
        plan.append((idx, real))
    return plan



def host_ids(batch: SampleBatch) -> tuple[np.ndarray, ...]:
    """The batch's (prompt_ids, prompt_mask, response_ids, response_mask) on the host (a
    multi-host global batch gathered: every process plans the same micro-batches)."""
    return tuple(host_values(getattr(batch, f)) for f in
                 ("prompt_ids", "prompt_mask", "response_ids", "response_mask"))


__all__ = ["host_ids", "trim_padding", "fit_to_bounds", "trim_columns", "row_widths",
           "num_minibatches", "minibatch_plan"]
