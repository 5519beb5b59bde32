"""The prefix-tree packed layout of a batch's rows (host, numpy): the radix tree of the rows'
token sequences, its units, and `pack_rows`, which writes them in pre-order into packed rows
(the package docstring, training/prefix_tree/__init__.py, describes the layout and its rule).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from strata_jax.buckets import bucket_size
from strata_jax.models.attention import QUERY_CHUNK
from strata_jax.training.prefix_tree.masks import block_key_index


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
        return last_real_index(self.token_index)

    def key_index(self, block: int = QUERY_CHUNK) -> np.ndarray:
        """[P, ceil(W / block), A] int32 `masks.block_key_index` of the packed rows."""
        return block_key_index(self.mask, self.key_end, block)

    def visible(self) -> np.ndarray:
        """[P, W, W] bool dense attention rule (query, key): for tests and small inspections
        only; the model builds it per query block from `key_end`."""
        col = np.arange(self.width)
        q, k = col[:, None], col[None, :]
        return (k <= q)[None] & (q[None] < self.key_end[:, None, :]) & self.mask[:, None, :]


def last_real_index(ti: np.ndarray) -> np.ndarray:
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


__all__ = ["PackedLayout", "pack_rows", "last_real_index"]
