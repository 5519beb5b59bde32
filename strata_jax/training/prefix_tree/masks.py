"""The tree attention rule of a packed layout in its block-sparse form (host, numpy): per
query block, the earlier key slots its queries may see (`block_key_index`, the forward's
``TreeMask.index``, models/attention.py). The dense rule itself is the layout's ``key_end``.
"""
from __future__ import annotations

import numpy as np


def block_key_index(mask: np.ndarray, key_end: np.ndarray, block: int) -> np.ndarray:
    """Per query block of a packed layout, the earlier key slots its queries may see: the
    block-sparse form of the tree rule (`models.attention.TreeMask.index`).

    Args: mask [P, W] bool (real slots), key_end [P, W] int (the layout's `key_end`), block:
    the forward's query_chunk (queries per attention block; the forward raises ValueError on
    another).
    Returns: [P, ceil(W / block), A] int32. Entry [p, j] lists, ascending, the slots
    {k < j * block : mask[p, k] and key_end[p, k] > j * block}, i.e. the keys of the segments
    still open at the block's start (its ancestor chain, plus the earlier part of a segment
    the block starts inside); -1 pads. Under the rule (k visible to q iff k <= q <
    key_end[k]) a query of block j sees no other key before the block, so the block attends
    to these and its own slots only. A is the largest such set over the rows and blocks,
    rounded up to a multiple of block (0 when none): A is a static shape (one compiled program
    per value), and the multiple bounds the values to ceil(L / block) + 1 for rows of at most
    L tokens (a chain is at most one row's tokens) while wasting fewer key columns per block
    than the block's own; the forward keeps the causal slice for the blocks j with
    j * block <= A, where that is no larger.
    Raises: ValueError when block < 1 or the shapes differ.
    """
    mask, key_end = np.asarray(mask, bool), np.asarray(key_end)
    if block < 1 or mask.ndim != 2 or key_end.shape != mask.shape:
        raise ValueError(f"need block >= 1 and mask, key_end [P, W]; got block {block}, "
                         f"{mask.shape}, {key_end.shape}")
    p, w = mask.shape
    starts = np.arange(0, w, block)                            # [nb]
    col = np.arange(w)
    open_ = (mask[:, None, :] & (col[None, None, :] < starts[None, :, None])
             & (key_end[:, None, :] > starts[None, :, None]))  # [P, nb, W]
    count = open_.sum(-1)
    a = -(-int(count.max(initial=0)) // block) * block
    # stable sort puts the open slots first, ascending; the rest become -1
    order = np.argsort(~open_, axis=-1, kind="stable")[..., :a]
    keep = np.arange(a)[None, None, :] < count[..., None]
    return np.where(keep, order, -1).astype(np.int32)


__all__ = ["block_key_index"]
