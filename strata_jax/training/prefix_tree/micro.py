"""The packing plan of the packed update (host, numpy): a batch's rows as packed
micro-batches of static shapes (`packed_micro_batches`), and how many packed rows each holds
(`micro_row_counts`). The shapes' bucket rules are strata_jax/buckets.py's.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from strata_jax.buckets import (bucket, key_index_width, micro_widths, response_columns,
                                response_slots)
from strata_jax.models.attention import QUERY_CHUNK
from strata_jax.training.prefix_tree.layout import last_real_index, pack_rows
from strata_jax.training.prefix_tree.masks import block_key_index


@dataclasses.dataclass(frozen=True)
class PackedMicroBatch:
    """One micro-batch of the packed update: P packed rows and the batch rows they score.

    Attributes:
      idx: [m] int32 batch row of each micro-batch row (padding entries: row 0, real False).
      real: [m] bool.
      response_width: wr, the response columns the micro-batch keeps (bucketed).
      tokens, positions, mask, key_end: [P, w] (`PackedLayout` fields of its packed rows, the
        width w bucketed; all-padding packed rows fill P up to its multiple).
      score_index: [m, wr] int32 flat index p * w + c of the state that scores response column
        j of row i (0 for padding entries and columns).
      last_index: [m] int32 flat index of row i's last real token (0 for padding entries).
      response_slot: [S, n] int32 flat index i * wr + j of each real response token (row i,
        column j) of the micro-batch, dealt round the S rows in row-major order of the tokens
        (token k at [k % S, k // S], so the real ones fill the first columns of every row and
        the LM head's chunks of padding only are skipped on every shard), padded with m * wr
        (no slot); S = the
        row_multiple (the mesh's batch shards, so the LM head's positions shard like the packed
        rows), S x n = `response_slots`. The LM head runs on these positions only
        (`scoring.response_logprobs`), not on all m x wr: the row count pads to a power of two
        and the columns to the longest response, and a vocabulary-wide head on padding is
        the most expensive padding there is.
      key_index: [P, ceil(w / block), A] int32 `block_key_index` of the packed rows (the
        block-sparse attention's keys per query block), padded with -1 to A = block x a power
        of two (a static shape with few values).
      block: the query block the index was built for (the forward's query_chunk).
    """

    idx: np.ndarray
    real: np.ndarray
    response_width: int
    tokens: np.ndarray
    positions: np.ndarray
    mask: np.ndarray
    key_end: np.ndarray
    score_index: np.ndarray
    last_index: np.ndarray
    response_slot: np.ndarray
    key_index: np.ndarray
    block: int

    @property
    def width(self) -> int:
        """w, the packed rows' columns (what the forward runs over)."""
        return int(self.tokens.shape[1])

    @property
    def num_slots(self) -> int:
        """P x w, the slots the forward computes (real tokens and padding)."""
        return int(self.tokens.size)


def micro_row_counts(n_packed: int, rows_per_micro: int, row_multiple: int = 1) -> list[int]:
    """How many packed rows each micro-batch holds: `rows_per_micro` (rounded up to a multiple
    of row_multiple) while at least that many are left, then one last micro-batch of the
    remaining ones rounded up to row_multiple x a power of two (capped at rows_per_micro):
    few distinct P, so few compiled programs, and little all-padding work.

    Example: n_packed 11, rows_per_micro 4, row_multiple 2 -> [4, 4, 4] (the last: 3 left ->
    2 x 2); n_packed 9 -> [4, 4, 2]. Raises ValueError when rows_per_micro or row_multiple < 1.
    """
    if rows_per_micro < 1 or row_multiple < 1:
        raise ValueError(f"rows_per_micro and row_multiple must be >= 1; got {rows_per_micro}, "
                         f"{row_multiple}")
    full = -(-rows_per_micro // row_multiple) * row_multiple
    out, left = [], int(n_packed)
    while left > 0:
        if left >= full:
            out.append(full)
            left -= full
            continue
        units = -(-left // row_multiple)
        out.append(min(full, row_multiple * (1 << (units - 1).bit_length())))
        left = 0
    return out


def packed_micro_batches(prompt_ids, prompt_mask, response_ids, response_mask, idx, real, *,
                         max_width: int, rows_per_micro: int = 1, row_multiple: int = 1,
                         block: int = QUERY_CHUNK, response_floor: int = 0,
                         marks: dict | None = None, mark_key: object = None,
                         fixed_rows: int = 0) -> list[PackedMicroBatch]:
    """The rows idx[real] of a batch as packed micro-batches: `pack_rows` of those rows into
    packed rows of at most max_width slots, grouped `rows_per_micro` packed rows per
    micro-batch (`micro_row_counts`), each micro-batch holding the rows whose tokens its packed
    rows carry (every row lives in exactly one packed row).

    Args: the batch's prompt_ids / prompt_mask [R, Tp], response_ids / response_mask [R, Tr]
    (numpy, `pack_rows`' contract); idx [n] int, real [n] bool (a `minibatch_plan` entry, or
    every row with real = valid); max_width: slots of one packed row (the longest row must
    fit); rows_per_micro: packed rows per micro-batch (P x max_width is the micro-batch's
    token budget); row_multiple: P is a multiple of it (the mesh's batch shards, so a
    micro-batch's packed rows shard over the data axes instead of being replicated); block:
    the query_chunk the forward will run (each micro-batch's `block_key_index` is built for
    it); response_floor: the response columns' buckets (`buckets.response_columns`);
    marks: optional dict the caller keeps across calls (`Trainer.shape_marks`): per
    (mark_key, P, w) the largest (m, wr, A, N) met so far; each micro-batch pads its m, wr (up
    to Tr), A and its response slots N up to them, then raises them. Padding rows, columns,
    key slots and response slots change no number (masked or dropped), and a run then meets
    one program per (P, w) instead of one per combination of its drifting m, wr, A and N;
    mark_key separates callers whose programs differ
    (the scoring pass and the training step); fixed_rows > 0: one shape for every micro-batch
    whatever the rows, from the first call on (`bounds.ShapeBounds`): P = rows_per_micro
    (rounded up to row_multiple; the last micro-batch padded with all-padding packed rows), w =
    max_width, m = max(fixed_rows, the next power of two of its rows), wr = Tr (the caller
    fixes the batch's response columns), A = `key_index_width` of the keys before a row's last query block (every key a block
    can see), N = m x
    wr (the LM head skips chunks of padding slots, `scoring.response_logprobs`), so a run
    compiles one program per pass instead of growing them with its batches.
    Returns: [`PackedMicroBatch`], the fullest packed rows first. Static shapes, so that a
    run's compilations plateau after its first iterations (each new shape is a new compile of
    the whole forward and backward): the width w one of `micro_widths(max_width)` (3W / 4 or
    W of the caller's per-run W: the smaller when it holds the micro-batch's fullest packed
    row); the row count m the next power of two; the key-index width A `key_index_width`
    (two sizes per octave of blocks, or 0); the response columns wr `response_columns`,
    capped at Tr; the response slots N = S x n `response_slots` of the real response tokens;
    P from `micro_row_counts`. Two widths, not one: a packed row's tokens
    never split, so with rows of a third of W or more many packed rows end well short of W
    (two rows of 700 tokens fill 1400 of 2048 and a third does not fit), where a width
    bucketed freely per micro-batch multiplied the programs by every other shape's values.
    Real rows without any token (no prompt, no response) are left out: they hold nothing to
    score.
    Raises ValueError as `pack_rows` (a row longer than max_width, malformed masks) and
    `micro_row_counts`.
    """
    idx, real = np.asarray(idx), np.asarray(real, bool)
    rows = idx[real]
    pm, rm = np.asarray(prompt_mask, bool), np.asarray(response_mask, bool)
    lay = pack_rows(np.asarray(prompt_ids)[rows], pm[rows], np.asarray(response_ids)[rows],
                    rm[rows], max_width=max_width)
    big_w, tp, tr = lay.width, lay.prompt_width, rm.shape[1]
    ti = lay.token_index.astype(np.int64)
    owner = np.where((ti >= 0).any(1), ti.max(1) // big_w, -1)
    # packed rows holding a token, fullest first: micro-batches of like fill, so each runs at
    # the smallest of the micro widths that holds its fullest row (a packed row's tokens sit
    # in its first fill[p] columns)
    fill = lay.mask.sum(1)
    filled = np.flatnonzero(fill > 0)
    filled = filled[np.argsort(-fill[filled], kind="stable")]
    widths = (max_width,) if fixed_rows else micro_widths(max_width)
    counts = micro_row_counts(filled.size, rows_per_micro, row_multiple) if filled.size else []
    if fixed_rows:
        counts = [-(-rows_per_micro // row_multiple) * row_multiple] * len(counts)
    out, first = [], 0
    for n_p in counts:
        packed = filled[first:first + n_p]
        first += n_p
        sel = np.flatnonzero(np.isin(owner, packed))
        w = next(x for x in widths if x >= int(fill[packed].max()))
        wr = min(tr, response_columns(int(rm[rows[sel]].sum(1).max()), response_floor))
        m = bucket(sel.size)
        if fixed_rows:
            wr, m = tr, max(m, bucket(fixed_rows))
        key = (mark_key, int(n_p), int(w))
        # the largest (m, wr, A, N) met for this (P, w): this micro-batch pads up to them
        m_mark, wr_mark, a_mark, n_mark = (marks or {}).get(key, (0, 0, 0, 0))
        m, wr = max(m, m_mark), max(wr, min(tr, wr_mark))
        resp = rm[rows[sel], :wr]
        n_slots = response_slots(int(resp.sum()), m * wr, row_multiple,
                                 m * wr if fixed_rows else n_mark)
        i_resp, j_resp = np.nonzero(resp)
        slot = np.full(n_slots, m * wr, np.int32)
        slot[:i_resp.size] = i_resp * wr + j_resp
        # flat big-layout index -> flat index in this micro-batch's [n_p, w] rows
        local_row = np.full(lay.tokens.shape[0], -1, np.int64)
        local_row[packed] = np.arange(packed.size)
        t = ti[sel]
        local = np.where(t >= 0, local_row[np.maximum(t, 0) // big_w] * w + t % big_w, -1)
        score = np.zeros((m, wr), np.int32)
        score[:sel.size] = np.maximum(local[:, tp - 1:tp - 1 + wr], 0)
        last = np.zeros(m, np.int32)
        last[:sel.size] = last_real_index(local)
        mb_idx = np.zeros(m, np.int32)
        mb_idx[:sel.size] = rows[sel]
        mb_real = np.arange(m) < sel.size

        cols = min(w, big_w)         # every real token of these rows sits in [0, cols)

        def cut(x, pad):
            y = np.empty((n_p, w), x.dtype)
            y[:] = pad
            y[:packed.size, :cols] = x[packed, :cols]
            return y

        tokens, positions, mask = cut(lay.tokens, 0), cut(lay.positions, 0), cut(lay.mask, False)
        # padding slots (past the layout's width, and all-padding packed rows) see themselves
        key_end = cut(lay.key_end, 0)
        key_end[:, cols:] = np.arange(cols + 1, w + 1, dtype=key_end.dtype)
        key_end[packed.size:] = np.arange(1, w + 1, dtype=key_end.dtype)
        index = block_key_index(mask, key_end, block)
        # fixed: the most keys a query block can have before it, all the row's earlier blocks
        a_need = (-(-w // block) - 1) * block if fixed_rows else index.shape[2]
        a = max(key_index_width(a_need, block), a_mark)
        if marks is not None:   # raise the marks (wr and N may sit below a mark met at a
            # larger Tr, where the cap at Tr or at m x wr kept them lower)
            marks[key] = tuple(max(x, y) for x, y in zip((m_mark, wr_mark, a_mark, n_mark),
                                                         (m, wr, a, n_slots)))
        index = np.pad(index, ((0, 0), (0, 0), (0, a - index.shape[2])), constant_values=-1)
        out.append(PackedMicroBatch(idx=mb_idx, real=mb_real, response_width=int(wr),
                                    tokens=tokens, positions=positions, mask=mask,
                                    key_end=key_end, score_index=score, last_index=last,
                                    response_slot=slot.reshape(-1, row_multiple).T.copy(),
                                    key_index=index, block=int(block)))
    return out


def slots_without_rows(mb: PackedMicroBatch, skip: np.ndarray) -> np.ndarray:
    """`mb.response_slot` [S, n] int32 with the slots of the micro-batch rows whose batch row
    is in `skip` ([R] bool over the batch rows; padding entries count as kept) taken out and
    the rest dealt round the S rows again in the same order, padded with m * wr: the same
    shape, so the LM head's all-padding chunks skip those rows' tokens in the same program
    (`scoring.response_logprobs`)."""
    s_rows = mb.response_slot.shape[0]
    flat = mb.response_slot.T.reshape(-1)           # token k at [k % S, k // S]
    m, wr = mb.idx.shape[0], mb.response_width
    row = np.minimum(flat // max(wr, 1), m - 1)
    drop = (flat < m * wr) & mb.real[row] & skip[mb.idx[row]]
    keep = flat[~drop & (flat < m * wr)]
    out = np.full(flat.shape, m * wr, np.int32)
    out[:keep.size] = keep
    return out.reshape(-1, s_rows).T.copy()


def parse_shape_marks(rows) -> dict[tuple[str, int, int], tuple[int, int, int, int]]:
    """The trainer's shape marks from their JSON rows (`Trainer.host_state`'s "shape_marks").

    rows: None or a list of [pass, P, W, m, wr, A, N] (a row of 6, from a checkpoint written
    before the response-slot mark, gets N = 0). Returns {(pass, P, W): (m, wr, A, N)}.
    Raises ValueError (one line) on a row that is not such a list of a name and integers.
    """
    if rows is not None and not isinstance(rows, (list, tuple)):
        raise ValueError(f"shape marks must be a list of [pass, P, W, m, wr, A, N]; got {rows!r}")
    marks = {}
    for row in rows or []:
        if isinstance(row, (list, tuple)) and len(row) == 6:
            row = [*row, 0]
        try:
            if len(row) != 7 or not isinstance(row[0], str):
                raise TypeError
            marks[(row[0], int(row[1]), int(row[2]))] = tuple(int(x) for x in row[3:])
        except (TypeError, ValueError):
            raise ValueError(f"a shape mark must be [pass, P, W, m, wr, A, N]; got {row!r}"
                             ) from None
    return marks


__all__ = ["PackedMicroBatch", "packed_micro_batches", "micro_row_counts", "parse_shape_marks",
           "slots_without_rows"]
