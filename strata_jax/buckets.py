"""Shape buckets: every rule that rounds a batch's rows, lengths or slots up to one of a few
sizes, so that the compiled programs a run meets stay few (each new shape is a new compile).

docs/design.md §6.3 lists who uses which rule:

* `bucket`: next power of two with a floor (the sampler's batch and lengths, per-row keys,
  the packed update's micro-batch rows, eval widths, SFT widths under ``sft.max_shapes=0``);
* `bucket_size`: two sizes per octave or an explicit bucket list (`SampleBatch` rows and
  widths, `trim_padding`'s prompt columns);
* `response_columns`: the update's response columns (``train.response_floor``);
* `plan_rungs`, `rung_for`: a few sizes planned from a whole run's known lengths (the warm
  start's batch widths, ``sft.max_shapes``);
* `pack_shape`, `micro_widths`, `key_index_width`, `response_slots`: the packed update's
  packed-row width and count, micro-batch widths, key-index width and LM-head slots
  (training/prefix_tree/, `Trainer.pack_shape`).

Plain Python (no numpy, no jax), so every module may import it.
"""
from __future__ import annotations

import math
from typing import Sequence


def bucket(n: int, floor: int = 1, multiple: int = 1) -> int:
    """Smallest power of two >= max(n, floor), rounded up to a multiple of ``multiple``.

    Args:
      n: the size needed (>= 0).
      floor: smallest bucket returned (>= 1).
      multiple: the result is divisible by it (e.g. the number of batch shards of a mesh).
    Returns:
      the bucket size, an int >= max(n, floor, 1).
    Raises:
      ValueError: negative ``n`` or non-positive ``floor`` / ``multiple``.

    >>> bucket(5), bucket(5, floor=16), bucket(3, multiple=8), bucket(24, multiple=6)
    (8, 16, 8, 36)
    """
    if n < 0:
        raise ValueError(f"bucket size needs n >= 0, got {n}")
    if floor < 1 or multiple < 1:
        raise ValueError(f"floor and multiple must be >= 1, got floor={floor}, multiple={multiple}")
    size = 1
    target = max(n, floor)
    while size < target:
        size *= 2
    return -(-size // multiple) * multiple


def bucket_size(n: int, buckets: Sequence[int] | None, multiple: int = 1) -> int:
    """Smallest bucket >= n; without explicit buckets, the smallest of 2^k and 3 * 2^(k-2)
    (..., 48, 64, 96, 128, ...) that is >= n, at least `multiple` and rounded up to a multiple of
    it.

    These sizes (at most 1.5x padding waste, two shapes per octave) bound the number of shapes a
    run ever compiles (log2 of the largest size), where rounding to a multiple of 8 recompiled the update for nearly every iteration as prompt
    lengths drift (docs/design.md §6.3).
    Raises ValueError when n exceeds the largest bucket (say which config to raise).
    """
    if buckets:
        for b in sorted(buckets):
            if b >= n:
                return int(b)
        raise ValueError(
            f"{n} exceeds the largest bucket {max(buckets)}; add a larger bucket to the config")
    p2 = 1 << (max(n, 1) - 1).bit_length()
    size = p2 * 3 // 4 if p2 >= 4 and n <= p2 * 3 // 4 else p2
    return int(max(multiple, math.ceil(size / multiple) * multiple))


def response_columns(n: int, floor: int = 0) -> int:
    """The response columns (an int) a batch or micro-batch keeps for a longest response of n
    tokens (n >= 0; 0 counts as 1).

    floor 0: a `bucket_size` size (two per octave, multiples of 8: 8, 16, 24, 32, 48, ...);
    floor > 0: the smallest power of two >= max(n, floor) (32, 64, 128, ... for floor 32).
    Used by `batching.trim_padding` and `prefix_tree.packed_micro_batches` (``train.response_floor``,
    docs/design.md §6.3).

    Why a floor: a micro-batch's compiled gradient step is keyed by its (prompt, response)
    width pair, and a real run's longest responses drift from iteration to iteration (an action
    of 9 tokens, a strategy of 70, a format-invalid ramble of 96), so two sizes per octave from
    8 up keep adding new pairs, each a new compilation of the forward and backward (minutes for
    a 0.5B model on CPU, docs/results.md). Response columns are a small share of a row (prompts
    are hundreds of tokens), so padding them to a coarse bucket costs little and the pairs a run
    meets stop growing after its first iterations.
    """
    if floor <= 0:
        return bucket_size(max(int(n), 1), None, 8)
    return 1 << (max(int(n), int(floor), 1) - 1).bit_length()


def pack_shape(rows: int, tp: int, tr: int, shards: int = 1, pack_width: int = 0,
               tokens: int = 0) -> tuple[int, int]:
    """(W, P) of the packed micro-batches for a budget of `tokens` slots (0: `rows` per-row
    rows of tp + tr columns) over `shards` batch shards: W slots per packed row, never less
    than tp + tr (the longest row must fit): `pack_width` (rounded up to a multiple of 8) when set, or when 0
    the budget over the batch shards rounded down to a power of two, capped at 2048 (at least
    tp + tr rounded up to one); P = budget // W packed rows per micro-batch, rounded down to a
    power of two, then up to a multiple of the shards (so a micro-batch shards over the data
    axes instead of being replicated, and holds about the tokens of a per-row micro-batch).

    Why a bounded W: one packed row of the whole budget compiles a forward of budget / block
    query blocks per layer and cannot shard over the data axes; a bounded W keeps the compiled
    program the per-row one's size and P spreads the budget over devices (each micro-batch
    then runs at 3W / 4 or W, `micro_widths`). Why powers of two: tp drifts from iteration to
    iteration, and every new (W, P) compiles the forward and backward again; rounded, a run
    meets one or two values.
    """
    row = tp + tr
    budget = int(tokens) if tokens else rows * row

    def floor2(n):
        return 1 << (max(int(n), 1).bit_length() - 1)

    if pack_width:
        width = -(-max(row, int(pack_width)) // 8) * 8
    else:
        width = max(bucket(row), min(2048, floor2(budget // shards)))
    rows_per_micro = floor2(max(1, budget // width))
    rows_per_micro = -(-rows_per_micro // shards) * shards
    return width, rows_per_micro


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


def key_index_width(a: int, block: int) -> int:
    """The static key-index width A a micro-batch pads `block_key_index`'s a columns to (a is
    a multiple of block): block x the next of two sizes per octave of blocks (1, 2, 3, 4, 6, 8,
    12, 16, ...; `bucket_size`), or 0. Few values, so few compiled programs, at most 1.5x the
    ancestor keys a query block needs (powers of two cost up to 2x: on a ScienceWorld batch
    whose blocks need 6 blocks of keys, 8 scored a third more per block)."""
    return block * bucket_size(a // block, None) if a else 0


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


def plan_rungs(sizes: Sequence[int], k: int, multiple: int = 1) -> tuple[int, ...]:
    """At most `k` sizes ("rungs") that hold every entry of `sizes` (one entry per batch: the
    width that batch needs) at the least total padded width, each a multiple of `multiple`.

    Each entry is rounded up to `multiple`, then padded to the smallest rung that holds it;
    the rungs minimise the sum of those padded widths over the entries (an optimal 1-D
    segmentation of the sorted distinct sizes, dynamic programming in O(k n^2) for n distinct
    sizes), and the largest rung is the largest rounded entry, so the padding never exceeds
    what the worst batch needs. Fewer than `k` rungs come back only when there are fewer
    distinct rounded sizes.

    Why: when every batch of a run is known before the first step (behaviour cloning draws
    its batch order upfront), the widths its programs compile can be chosen for the run
    rather than per batch, so a run compiles at most `k` widths per axis instead of one per
    distinct bucket it happens to meet, with less padding than powers of two at the same count.

    Args:
      sizes: the widths needed, ints >= 0 (0 counts as 1), at least one.
      k: the most rungs returned, >= 1.
      multiple: every rung is divisible by it, >= 1.
    Returns:
      the rungs, ascending ints (1 to k of them).
    Raises:
      ValueError: empty `sizes`, a negative size, or `k` / `multiple` < 1.

    >>> plan_rungs([10, 12, 30, 31, 100], k=2, multiple=8)
    (32, 104)
    """
    if k < 1 or multiple < 1:
        raise ValueError(f"plan_rungs needs k >= 1 and multiple >= 1, got k={k}, "
                         f"multiple={multiple}")
    if not len(sizes) or min(sizes) < 0:
        raise ValueError(f"plan_rungs needs at least one size, all >= 0, got {list(sizes)[:8]}")
    counts: dict[int, int] = {}
    for n in sizes:
        r = -(-max(int(n), 1) // multiple) * multiple
        counts[r] = counts.get(r, 0) + 1
    vals = sorted(counts)
    below = [0]   # below[j]: entries whose size is < vals[j]
    for v in vals:
        below.append(below[-1] + counts[v])
    inf = float("inf")
    # cost[m][j]: least padded sum of the entries up to vals[j] with m rungs, the top one vals[j]
    cost = [[inf] * len(vals) for _ in range(k + 1)]
    back = [[-1] * len(vals) for _ in range(k + 1)]
    for j, v in enumerate(vals):
        cost[1][j] = v * below[j + 1]
    for m in range(2, k + 1):
        for j, v in enumerate(vals):
            for i in range(j):
                c = cost[m - 1][i] + v * (below[j + 1] - below[i + 1])
                if c < cost[m][j]:
                    cost[m][j], back[m][j] = c, i
    top = len(vals) - 1
    best = min(range(1, k + 1), key=lambda m: (cost[m][top], m))
    rungs, j = [], top
    for m in range(best, 0, -1):
        rungs.append(vals[j])
        j = back[m][j]
    return tuple(sorted(rungs))


def rung_for(n: int, rungs: Sequence[int]) -> int:
    """The smallest of `rungs` that holds `n` (an int).
    Raises ValueError when `n` exceeds every rung (the plan did not cover it)."""
    for r in sorted(rungs):
        if r >= n:
            return int(r)
    raise ValueError(f"size {n} exceeds every planned rung {tuple(rungs)}: plan the rungs "
                     "over every size the run meets (plan_rungs)")


__all__ = ["bucket", "bucket_size", "response_columns", "plan_rungs", "rung_for", "pack_shape",
           "micro_widths", "key_index_width", "response_slots"]
