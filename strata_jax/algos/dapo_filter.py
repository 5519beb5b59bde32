"""DAPO dynamic sampling, host side: keep only task groups whose returns are not all equal
(equal as the estimators see them: `segments.is_constant`, so a group the filter keeps is one
whose advantages are not all 0).

The rollout calls `keep_informative_groups` after each try, rolls out more tasks to refill
the dropped ones, and stops after `max_tries` (10); the last try keeps every group
(docs/method.md §6.5). Pure numpy: it runs between rollouts, outside jit.
"""
from __future__ import annotations

import numpy as np

from strata_jax.algos.segments import is_constant


def keep_informative_groups(task_ids, returns, valid=None) -> np.ndarray:
    """Per-row keep mask: True for rows of task groups whose episode returns are not all equal.

    Args:
        task_ids: [n] ints, the task group of each row (episode or step sample).
        returns:  [n] floats, the episode return of each row.
        valid:    optional [n] bool; invalid rows (crashed) neither count nor are kept.
    Returns:
        [n] bool keep mask. A group is dropped when its returns are one value by the
        estimators' constancy rule (`segments.is_constant`: 0.58 + 0.09 and 0.67 are one
        value); a group of one valid episode is dropped too (it has zero variance).
    Raises ValueError if the arrays differ in length.
    """
    task_ids = np.asarray(task_ids)
    returns = np.asarray(returns, np.float64)
    valid = np.ones(task_ids.shape, bool) if valid is None else np.asarray(valid, bool)
    if not (task_ids.shape == returns.shape == valid.shape):
        raise ValueError(f"task_ids {task_ids.shape}, returns {returns.shape} and valid "
                         f"{valid.shape} must have the same length")
    keep = np.zeros(task_ids.shape, bool)
    for t in np.unique(task_ids[valid]):
        rows = valid & (task_ids == t)
        r = returns[rows]
        keep[rows] = not bool(is_constant(r.max(), r.min(), xp=np))
    return keep
