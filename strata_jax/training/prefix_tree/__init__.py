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

Modules: layout.py (the radix tree and `pack_rows`), masks.py (the rule's block-sparse key
index), micro.py (the packed micro-batches of the update). The bucket rules of their shapes
(`micro_widths`, `key_index_width`, `response_slots`) are strata_jax/buckets.py's.
"""
from strata_jax.training.prefix_tree.layout import PackedLayout, last_real_index, pack_rows
from strata_jax.training.prefix_tree.masks import block_key_index
from strata_jax.training.prefix_tree.micro import (PackedMicroBatch, micro_row_counts,
                                                   packed_micro_batches, parse_shape_marks,
                                                   slots_without_rows)

__all__ = ["PackedLayout", "pack_rows", "last_real_index", "PackedMicroBatch",
           "packed_micro_batches", "micro_row_counts", "block_key_index", "parse_shape_marks",
           "slots_without_rows"]
