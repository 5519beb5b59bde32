"""Prefix-tree packing of a batch's rows (host, numpy): each shared prompt prefix is laid out
once, and the rows' unique suffixes follow it in packed rows of bucketed width.

The rows of an update batch repeat each other's prompts at several levels (the batch-wide
instruction block, then a task's goal, a strategy's text, the row's own step). The ids are the
sampler's, so a common prefix found on ids is exact. `pack_rows` builds the compressed prefix
tree (radix tree) of the rows' token sequences (prompt ++ response, real tokens only): every
node holds the tokens its rows share past their parent node, as deep as the data gives. The
nodes ("segments") are written in pre-order into packed rows [P, W]; rows that share nothing
are packed end to end, so padding between rows disappears too.

The attention rule (docs/design.md §12.1): a token sees, causally, the earlier tokens of its own
segment and every token of its ancestor segments, nothing else. In a pre-order layout the
descendants of a segment follow it contiguously, so per key column k the end of its segment's
subtree, ``key_end[k]``, gives the whole rule: key k is visible to query q iff
``k <= q < key_end[k]`` (padding: ``key_end[k] = k + 1``, visible to itself only).
Positions continue the parent's (a token's position is its index in its row's sequence), so
RoPE, and with it every hidden state, equals the per-row forward's.

A subtree wider than the largest packed width is split: its children are grouped into units
that fit, and each unit carries a copy of its ancestor path (the copy is recomputed, never
shared across packed rows, so every packed row is self-contained).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from strata_jax.algos.batch import bucket_size
from strata_jax.models.attention import QUERY_CHUNK
from strata_jax.sampling.buckets import bucket
from strata_jax.training.batching import response_columns


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """The packed rows of a batch and where each original row's tokens sit in them.

    Attributes (numpy):
      tokens: [P, W] int32 token ids (0 on padding).
      positions: [P, W] int32 RoPE position = the token's index in its row's sequence (0 on
        padding).
      mask: [P, W] bool, True on real tokens.
      key_end: [P, W] int32 exclusive end column of the subtree of the token's segment (in
        its packed row): key k is visible to query q iff k <= q < key_end[k]. Padding:
        k + 1.
      segment_ids: [P, W] int32 tree node id of each token (-1 on padding); a copied ancestor
        path keeps its node ids.
      parent: [N] int32 parent node id of each tree node (-1: a root segment).
      token_index: [R, Tp + Tr] int32 flat index p * W + c of the packed token that is the
        original row's token at column t of prompt ++ response (-1 on padding columns).
      prompt_width: Tp, the original batch's prompt columns (responses start there).
    """

    tokens: np.ndarray
    positions: np.ndarray
    mask: np.ndarray
    key_end: np.ndarray
    segment_ids: np.ndarray
    parent: np.ndarray
    token_index: np.ndarray
    prompt_width: int

    @property
    def width(self) -> int:
        """W, the packed rows' width."""
        return int(self.tokens.shape[1])

    @property
    def num_packed_tokens(self) -> int:
        """Real tokens the packed forward computes (shared prefixes once, copies included)."""
        return int(self.mask.sum())

    @property
    def num_row_tokens(self) -> int:
        """Real tokens of the original rows (what a per-row forward computes, padding aside)."""
        return int((self.token_index >= 0).sum())

    def score_index(self, response_width: int | None = None) -> np.ndarray:
        """[R, Tr] int32 flat packed index of the state that predicts response column j (the
        row's token at prompt ++ response column Tp - 1 + j; 0 where that column is padding,
        so gathers stay in range and the caller's response mask drops them)."""
        tp = self.prompt_width
        tr = self.token_index.shape[1] - tp if response_width is None else response_width
        return np.maximum(self.token_index[:, tp - 1:tp - 1 + tr], 0).astype(np.int32)

    def last_index(self) -> np.ndarray:
        """[R] int32 flat packed index of each row's last real token (the last response token;
        the last prompt token of a row without response; 0 for an empty row): where
        `scoring.response_states` reads the value head's state."""
        return _last_real(self.token_index)

    def key_index(self, block: int = QUERY_CHUNK) -> np.ndarray:
        """[P, ceil(W / block), A] int32 `block_key_index` of the packed rows."""
        return block_key_index(self.mask, self.key_end, block)

    def visible(self) -> np.ndarray:
        """[P, W, W] bool dense attention rule (query, key): for tests and small inspections
        only; the model builds it per query block from `key_end`."""
        col = np.arange(self.width)
        q, k = col[:, None], col[None, :]
        return (k <= q)[None] & (q[None] < self.key_end[:, None, :]) & self.mask[:, None, :]


def block_key_index(mask: np.ndarray, key_end: np.ndarray, block: int) -> np.ndarray:
    """Per query block of a packed layout, the earlier key slots its queries may see: the
    block-sparse form of the tree rule (`qwen2.TreeMask.index`).

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


def key_index_width(a: int, block: int) -> int:
    """The static key-index width A a micro-batch pads `block_key_index`'s a columns to (a is
    a multiple of block): block x the next of two sizes per octave of blocks (1, 2, 3, 4, 6, 8,
    12, 16, ...; `bucket_size`), or 0. Few values, so few compiled programs, at most 1.5x the
    ancestor keys a query block needs (powers of two cost up to 2x: on a ScienceWorld batch
    whose blocks need 6 blocks of keys, 8 scored a third more per block)."""
    return block * bucket_size(a // block, None) if a else 0


def micro_widths(max_width: int) -> tuple[int, int]:
    """The packed widths a micro-batch may run at: 3 max_width / 4 (rounded up to a multiple of
    8) and max_width. A micro-batch runs at the smaller when it holds its fullest packed row:
    packed rows fill unevenly (a row's tokens never split across packed rows, so rows of a
    third of W or more leave many packed rows well short of W), and two widths bound the
    compiled programs to two per packed-row count (a third, W / 2, multiplied the programs a
    drifting run meets for little more saving). Raises ValueError when max_width < 8."""
    if max_width < 8:
        raise ValueError(f"max_width must be >= 8; got {max_width}")
    return -(-(3 * max_width // 4) // 8) * 8, max_width


def response_slots(n: int, slots: int, row_multiple: int = 1, mark: int = 0) -> int:
    """N, the positions the LM head runs on for n real response tokens in a micro-batch of
    `slots` = m x wr response slots: `bucket_size` of max(n, slots / 2, mark), a multiple of
    8 x row_multiple, at most `slots` rounded up to that multiple.

    Why the floor slots / 2: N is a static shape, and a run's response lengths drift; from
    slots / 2 up there are three sizes (slots / 2, 3 slots / 4 or the power of two between,
    slots), so with the shape marks (`mark`, the largest N met) a (P, w) compiles at most two
    more programs for N over a whole run, while the head still skips up to half of the
    padding (rows padded to a power of two, columns to the longest response).

    >>> response_slots(40, 128), response_slots(100, 128), response_slots(200, 384)
    (64, 128, 256)
    """
    unit = 8 * row_multiple
    cap = -(-slots // unit) * unit
    return min(cap, bucket_size(max(n, slots // 2, mark, 1), None, multiple=unit))


def _last_real(ti: np.ndarray) -> np.ndarray:
    """[R] int32 entry of each row's last non-negative column of ti [R, T] (0 if none)."""
    real = ti >= 0
    cols = np.where(real.any(1), ti.shape[1] - 1 - np.argmax(real[:, ::-1], axis=1), 0)
    return np.maximum(ti[np.arange(ti.shape[0]), cols], 0).astype(np.int32)


@dataclasses.dataclass
class _Node:
    start: int            # depth (position) of the node's first token
    end: int              # depth past its last token
    row: int              # a row that holds the tokens (any member)
    parent: int           # node id, -1 under the (empty, virtual) root
    children: list[int]


def _row_sequences(prompt_ids, prompt_mask, response_ids, response_mask) -> list[np.ndarray]:
    """Each row's real tokens (prompt ++ response). Raises ValueError when a prompt mask is not
    a suffix (left padding), a response mask not a prefix (right padding), or a row has
    response tokens but no prompt: the per-row path scores response token j from column
    Tp - 1 + j, which is then not the previous real token."""
    pm, rm = np.asarray(prompt_mask, bool), np.asarray(response_mask, bool)
    pi, ri = np.asarray(prompt_ids), np.asarray(response_ids)
    if pm.shape != pi.shape or rm.shape != ri.shape or pm.shape[0] != rm.shape[0]:
        raise ValueError(f"ids and masks must be [R, Tp] and [R, Tr]; got {pi.shape}, "
                         f"{pm.shape}, {ri.shape}, {rm.shape}")
    n_p, n_r = pm.sum(1), rm.sum(1)
    tp = pm.shape[1]
    left = np.arange(tp)[None, :] >= (tp - n_p)[:, None]
    right = np.arange(rm.shape[1])[None, :] < n_r[:, None]
    bad = np.flatnonzero((pm != left).any(1) | (rm != right).any(1) | ((n_p == 0) & (n_r > 0)))
    if bad.size:
        raise ValueError(f"rows {bad.tolist()} are not a left-padded prompt followed by a "
                         "right-padded response (or have a response without a prompt)")
    return [np.concatenate([pi[r, tp - n_p[r]:], ri[r, :n_r[r]]]).astype(np.int64)
            for r in range(pm.shape[0])]


def _build_tree(seqs: list[np.ndarray]) -> tuple[list[_Node], list[int], list[int]]:
    """Radix tree of the sequences. Returns (nodes, roots, end_node): roots = node ids under
    the virtual empty root, end_node[r] = node where row r's sequence ends (-1 for an empty
    row). Children are ordered by their tokens (the rows are visited in lexicographic order of
    their sequences), so the tree, and with it the packing and every compiled shape, depends
    on the set of rows only, not on their order: the update draws its mini-batches shuffled
    anew every iteration, and a layout that followed the shuffle met new shapes (new programs)
    on the same rows."""
    nodes: list[_Node] = []
    roots: list[int] = []
    end_node = [-1] * len(seqs)
    rows = sorted((r for r, s in enumerate(seqs) if s.size), key=lambda r: seqs[r].tolist())
    stack = [(-1, rows, 0)]
    while stack:
        parent, members, depth = stack.pop()
        groups: dict[int, list[int]] = {}
        for r in members:
            groups.setdefault(int(seqs[r][depth]), []).append(r)
        made = []
        for group in groups.values():
            first = seqs[group[0]]
            end = min(seqs[r].size for r in group)
            for r in group[1:]:
                diff = np.flatnonzero(seqs[r][depth:end] != first[depth:end])
                if diff.size:
                    end = depth + int(diff[0])
            nid = len(nodes)
            nodes.append(_Node(depth, end, group[0], parent, []))
            (nodes[parent].children if parent >= 0 else roots).append(nid)
            rest = []
            for r in group:
                if seqs[r].size == end:
                    end_node[r] = nid
                else:
                    rest.append(r)
            if rest:
                made.append((nid, rest, end))
        stack.extend(reversed(made))
    return nodes, roots, end_node


def _subtree_sizes(nodes: list[_Node]) -> np.ndarray:
    size = np.array([n.end - n.start for n in nodes], np.int64)
    for nid in range(len(nodes) - 1, -1, -1):   # children have larger ids than their parent
        if nodes[nid].parent >= 0:
            size[nodes[nid].parent] += size[nid]
    return size


def _units(nodes, size, path: list[int], siblings: list[int], width: int) -> list:
    """Split `siblings` (subtrees under `path`) into units (path, [subtree roots]) of at most
    `width` tokens, path included; a subtree too wide alone is split below its root (the root
    joins the path). First fit over the siblings in order."""
    base = sum(nodes[p].end - nodes[p].start for p in path)
    groups: list[list] = []          # [tokens, [node ids]]
    out: list = []
    for c in siblings:
        s = int(size[c])
        if base + s > width:
            if not nodes[c].children or base + nodes[c].end - nodes[c].start > width:
                raise ValueError(f"a row of at least {nodes[c].end} tokens exceeds the largest "
                                 f"packed width {width}; raise the packing width")
            out += _units(nodes, size, path + [c], nodes[c].children, width)
            continue
        for g in groups:
            if base + g[0] + s <= width:
                g[0] += s
                g[1].append(c)
                break
        else:
            groups.append([s, [c]])
    return [(path, g[1], base + g[0]) for g in groups] + out


def pack_rows(prompt_ids, prompt_mask, response_ids, response_mask, *, max_width: int,
              widths: Sequence[int] | None = None, row_multiple: int = 1) -> PackedLayout:
    """The prefix-tree packed layout of a batch of rows.

    Args:
      prompt_ids, prompt_mask: [R, Tp] int / bool, left-padded prompts.
      response_ids, response_mask: [R, Tr] int / bool, right-padded responses (a SampleBatch's
        fields, numpy or host-addressable arrays). A row with no real token (a padding row)
        takes no packed column; its `token_index` is all -1.
      max_width: the largest packed row width (token budget of one packed row); every row's
        sequence must fit in it.
      widths: optional explicit width buckets (the packed width W is the smallest one >= the
        fullest packed row); None: `bucket_size`'s two sizes per octave, multiples of 8, capped
        at max_width.
      row_multiple: P is rounded up to a multiple of it with all-padding packed rows.
    Returns: `PackedLayout`. Units (a subtree or a group of sibling subtrees with their copied
    ancestor path) are placed first-fit decreasing into packed rows; a row's tokens are read
    from the first unit holding its last token (all its ancestors are in that unit too).
    Raises: ValueError on malformed masks (`_row_sequences`), a row longer than max_width, or
    a widths bucket list whose largest entry exceeds max_width or fits nothing.
    """
    if widths is not None and max(widths) > max_width:
        raise ValueError(f"width buckets {sorted(widths)} exceed max_width {max_width}")
    seqs = _row_sequences(prompt_ids, prompt_mask, response_ids, response_mask)
    nodes, roots, end_node = _build_tree(seqs)
    size = _subtree_sizes(nodes)
    units = _units(nodes, size, [], roots, max_width) if roots else []
    # first-fit decreasing (stable) into packed rows of max_width tokens
    order = sorted(range(len(units)), key=lambda i: -units[i][2])
    bins: list[list] = []            # [fill, [unit ids]]
    for u in order:
        for b in bins:
            if b[0] + units[u][2] <= max_width:
                b[0] += units[u][2]
                b[1].append(u)
                break
        else:
            bins.append([units[u][2], [u]])
    fill = max((b[0] for b in bins), default=1)
    width = bucket_size(fill, widths, 1) if widths else min(max_width, bucket_size(fill, None, 8))
    n_rows = max(1, len(bins))
    n_rows = -(-n_rows // row_multiple) * row_multiple
    tokens = np.zeros((n_rows, width), np.int32)
    positions = np.zeros((n_rows, width), np.int32)
    mask = np.zeros((n_rows, width), bool)
    key_end = np.broadcast_to(np.arange(1, width + 1, dtype=np.int32), (n_rows, width)).copy()
    segment = np.full((n_rows, width), -1, np.int32)
    unit_of: dict[int, int] = {}     # node id -> the first unit holding a copy of it
    starts: dict[tuple[int, int], int] = {}   # (unit, node) -> flat start

    def write(p, col, nid, end_col, u):
        n = nodes[nid]
        ln = n.end - n.start
        tokens[p, col:col + ln] = seqs[n.row][n.start:n.end]
        positions[p, col:col + ln] = np.arange(n.start, n.end)
        mask[p, col:col + ln] = True
        key_end[p, col:col + ln] = end_col
        segment[p, col:col + ln] = nid
        starts[(u, nid)] = p * width + col
        unit_of.setdefault(nid, u)
        return col + ln

    for p, (_, members) in enumerate(bins):
        col = 0
        for u in members:
            path, subtrees, total = units[u]
            end_unit = col + total
            for nid in path:
                col = write(p, col, nid, end_unit, u)
            pre = list(reversed(subtrees))
            while pre:               # pre-order over the unit's subtrees
                nid = pre.pop()
                col = write(p, col, nid, col + int(size[nid]), u)
                pre.extend(reversed(nodes[nid].children))
            assert col == end_unit
    tp, tr = np.asarray(prompt_mask).shape[1], np.asarray(response_mask).shape[1]
    token_index = np.full((len(seqs), tp + tr), -1, np.int64)
    n_p = np.asarray(prompt_mask, bool).sum(1)
    for r, seq in enumerate(seqs):
        if not seq.size:
            continue
        u = unit_of[end_node[r]]
        flat = np.empty(seq.size, np.int64)
        nid = end_node[r]
        while nid >= 0:
            n = nodes[nid]
            flat[n.start:n.end] = starts[(u, nid)] + np.arange(n.end - n.start)
            nid = n.parent
        first = tp - int(n_p[r])
        token_index[r, first:first + seq.size] = flat
    parent = np.array([n.parent for n in nodes], np.int32)
    return PackedLayout(tokens=tokens, positions=positions, mask=mask, key_end=key_end,
                        segment_ids=segment, parent=parent,
                        token_index=token_index.astype(np.int32), prompt_width=tp)


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
        column j) of the micro-batch, row-major, padded with m * wr (no slot); S = the
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
                         marks: dict | None = None, mark_key: object = None
                         ) -> list[PackedMicroBatch]:
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
    it); response_floor: the response columns' buckets (`batching.response_columns`);
    marks: optional dict the caller keeps across calls (`Trainer.shape_marks`): per
    (mark_key, P, w) the largest (m, wr, A, N) met so far; each micro-batch pads its m, wr (up
    to Tr), A and its response slots N up to them, then raises them. Padding rows, columns,
    key slots and response slots change no number (masked or dropped), and a run then meets
    one program per (P, w) instead of one per combination of its drifting m, wr, A and N;
    mark_key separates callers whose programs differ
    (the scoring pass and the training step).
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
    widths = micro_widths(max_width)
    out, first = [], 0
    for n_p in (micro_row_counts(filled.size, rows_per_micro, row_multiple)
                if filled.size else []):
        packed = filled[first:first + n_p]
        first += n_p
        sel = np.flatnonzero(np.isin(owner, packed))
        w = next(x for x in widths if x >= int(fill[packed].max()))
        wr = min(tr, response_columns(int(rm[rows[sel]].sum(1).max()), response_floor))
        m = bucket(sel.size)
        key = (mark_key, int(n_p), int(w))
        # the largest (m, wr, A, N) met for this (P, w): this micro-batch pads up to them
        m_mark, wr_mark, a_mark, n_mark = (marks or {}).get(key, (0, 0, 0, 0))
        m, wr = max(m, m_mark), max(wr, min(tr, wr_mark))
        resp = rm[rows[sel], :wr]
        n_slots = response_slots(int(resp.sum()), m * wr, row_multiple, n_mark)
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
        last[:sel.size] = _last_real(local)
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
        a = max(key_index_width(index.shape[2], block), a_mark)
        if marks is not None:   # raise the marks (wr and N may sit below a mark met at a
            # larger Tr, where the cap at Tr or at m x wr kept them lower)
            marks[key] = tuple(max(x, y) for x, y in zip((m_mark, wr_mark, a_mark, n_mark),
                                                         (m, wr, a, n_slots)))
        index = np.pad(index, ((0, 0), (0, 0), (0, a - index.shape[2])), constant_values=-1)
        out.append(PackedMicroBatch(idx=mb_idx, real=mb_real, response_width=int(wr),
                                    tokens=tokens, positions=positions, mask=mask,
                                    key_end=key_end, score_index=score, last_index=last,
                                    response_slot=slot.reshape(row_multiple, -1),
                                    key_index=index, block=int(block)))
    return out


__all__ = ["PackedLayout", "pack_rows", "PackedMicroBatch", "packed_micro_batches",
           "micro_row_counts", "micro_widths", "block_key_index", "key_index_width",
           "response_slots"]
