"""DAPO dynamic sampling, host side: keep only task groups whose returns are not all equal.

The rollout calls `keep_informative_groups` after each try, rolls out more tasks to refill
the dropped ones, and stops after `max_tries` (10); the last try keeps every group
(docs/method.md §6.5). Pure numpy: it runs between rollouts, outside jit.
"""
from __future__ import annotations

import numpy as np


def keep_informative_groups(task_ids, returns, valid=None, *, atol: float = 0.0) -> np.ndarray:
    """Per-row keep mask: True for rows of task groups whose episode returns are not all equal.

    Args:
        task_ids: [n] ints, the task group of each row (episode or step sample).
        returns:  [n] floats, the episode return of each row.
        valid:    optional [n] bool; invalid rows (crashed) neither count nor are kept.
        atol:     returns within atol of each other count as equal (0 = exact).
    Returns:
        [n] bool keep mask (a group of one valid episode is dropped: it has zero variance).
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
        keep[rows] = (r.max() - r.min()) > atol
    return keep
