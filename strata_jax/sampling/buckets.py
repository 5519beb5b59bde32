"""Shape buckets: pad batch and lengths to a small set of sizes so compilations stay bounded.

docs/design.md §6.3: each extra compilation costs
seconds, so the sampler pads the batch, the prompt length and the generation length up to
powers of two with a floor; a rollout with varying prompt lengths then compiles a handful of
programs instead of one per shape.
"""

from __future__ import annotations


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
