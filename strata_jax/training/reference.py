"""The per-row reference of the update: `RowTrainer`, the `Trainer` with every forward run over
each row's own prompt + response (the plain per-row forward, ``packed=None``) instead of the
prefix-tree packed rows. The same flow (scoring, advantages, mini-batch plan, gradient
accumulation, optimizer step, metrics), so the packed Trainer's scores, gradients and steps
can be compared with it; it computes every shared prompt prefix once per row.

For tests and benchmarks only: train.py never builds it (the production update is
`Trainer`'s packed path, docs/design.md §12.1).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from strata_jax.training.trainer import Trainer


@dataclasses.dataclass
class RowTrainer(Trainer):
    """`Trainer` whose micro-batches (and scoring chunks) are plain rows: micro_batch_size
    (score_rows) rows each, at the batch's full prompt + response width, in mini-batch order;
    chunks of padding entries only are left out. Same arguments and methods as `Trainer`."""

    def _plan(self, ids, idx, real, rows_budget: int):
        """[(idx [m] int32, real [m] bool, (Tp, Tr), None)] of consecutive chunks of
        rows_budget entries holding a real row, and their computed tokens (chunks x m x
        (Tp + Tr)). Raises ValueError when idx's length is not a multiple of rows_budget (the
        mini-batch plan and the scoring pad make it one)."""
        idx, real = np.asarray(idx), np.asarray(real, bool)
        m = int(rows_budget)
        if idx.size % m:
            raise ValueError(f"{idx.size} rows are not a multiple of the micro-batch size {m}")
        widths = (ids[0].shape[1], ids[2].shape[1])
        plan = [(idx[s:s + m].astype(np.int32), real[s:s + m], widths, None)
                for s in range(0, idx.size, m) if real[s:s + m].any()]
        return plan, len(plan) * m * sum(widths)


__all__ = ["RowTrainer"]
