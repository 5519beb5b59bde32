"""Host-side packing of ragged token-id lists into padded, left-aligned device arrays.

Prompts are LEFT padded: every row's last real token sits in the last column, so one
``hidden[:, -1]`` gives every row's next-token state and decode slot ``T + step`` is the same
for all rows. RoPE positions are explicit per token (``start + cumsum(mask) - 1``), as the
pinned model interface requires (docs/design.md
§6.1, §11.1).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """Left-padded rows.

    Attributes:
      tokens: [B, T] int32 ids (0 in padding).
      positions: [B, T] int32 RoPE positions; real tokens of row b get
        ``start[b], start[b] + 1, ...``; padding gets ``start[b]`` (masked out anyway).
      mask: [B, T] bool, True for real tokens.
      lengths: [B] int32 number of real tokens.
    """

    tokens: np.ndarray
    positions: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray


def as_id_lists(seqs: Sequence[Sequence[int]], what: str, vocab_size: int,
                allow_empty: bool = False) -> list[np.ndarray]:
    """Validate ragged token ids and convert each row to an int32 numpy array.

    Raises:
      ValueError: an empty row (unless ``allow_empty``), a non-1-D row, non-integer ids
        (floats, strings: int32 casting would silently truncate them), or an id outside
        ``[0, vocab_size)`` (the embedding lookup would silently clamp it).
    """
    out = []
    for i, s in enumerate(seqs):
        a = np.asarray(s)
        if a.size and a.dtype.kind not in "iu":
            # Python ints beyond int64 arrive as an object array; floats / strings are not ids.
            flat = a.reshape(-1).tolist()
            if a.dtype.kind == "O" and all(type(x) is int for x in flat):
                raise ValueError(f"{what} {i} has token ids outside [0, {vocab_size}): "
                                 f"min {min(flat)}, max {max(flat)}")
            raise ValueError(f"{what} {i} must hold integer token ids, got dtype {a.dtype} "
                             f"(first value {a.reshape(-1)[0].item()!r}); pass the tokenizer's ids as ints")
        a = a.astype(np.int64) if a.size else np.zeros(a.shape, np.int64)
        if a.ndim != 1:
            raise ValueError(f"{what} {i} must be a flat list of token ids, got shape {a.shape}")
        if a.size == 0 and not allow_empty:
            raise ValueError(f"{what} {i} is empty: every row needs at least one token "
                             f"(e.g. start it with the chat template's first token)")
        if a.size and (a.min() < 0 or a.max() >= vocab_size):
            raise ValueError(f"{what} {i} has token ids outside [0, {vocab_size}): "
                             f"min {a.min()}, max {a.max()}")
        out.append(a.astype(np.int32))
    return out


def pack_left(seqs: Sequence[np.ndarray], length: int, batch: int,
              start: np.ndarray | None = None) -> PackedRows:
    """Left-pad ``seqs`` into ``[batch, length]`` arrays.

    Args:
      seqs: ragged int32 id arrays, each of length <= ``length``; len(seqs) <= batch.
      length: padded length T (a bucket).
      batch: padded batch B (a bucket). Filler rows hold one real token (id 0) so that no row
        is fully masked; the sampler marks them finished from the start.
      start: [len(seqs)] int32 position of each row's first token (default 0).
    Returns:
      `PackedRows`.
    Raises:
      ValueError: a row longer than ``length`` or more rows than ``batch``.
    """
    if len(seqs) > batch:
        raise ValueError(f"{len(seqs)} rows do not fit a batch of {batch}")
    tokens = np.zeros((batch, length), np.int32)
    mask = np.zeros((batch, length), bool)
    starts = np.zeros((batch,), np.int32)
    if start is not None:
        starts[: len(seqs)] = np.asarray(start, np.int32)
    lengths = np.ones((batch,), np.int32)
    for i, s in enumerate(seqs):
        n = len(s)
        if n > length:
            raise ValueError(f"row {i} has {n} tokens, more than the padded length {length}")
        if n:
            tokens[i, length - n:] = s
        mask[i, length - n:] = True
        lengths[i] = n
    mask[len(seqs):, -1] = True  # filler rows: one real token (id 0)
    positions = starts[:, None] + np.maximum(np.cumsum(mask, axis=1, dtype=np.int32) - 1, 0)
    return PackedRows(tokens=tokens, positions=positions.astype(np.int32), mask=mask,
                      lengths=lengths)
