"""What the sampler returns: per-row generations and their padded batch form."""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclasses.dataclass(frozen=True)
class Generation:
    """One row's generation.

    Attributes:
      token_ids: [n] int32 generated ids, the stop token included, no padding. A row stopped
        by a stop string ends with the ordinary token that completed it.
      logprobs: [n] float32, ``log_softmax(logits / T)`` of each generated id before top-k /
        top-p renormalisation (T = 1 for greedy), natural log.
      length: n.
      finish_reason: ``"stop"`` (emitted a stop id, which is the last id, or completed the
        stop string with the last id) or ``"length"`` (reached max_new_tokens; also for
        max_new_tokens == 0).
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    length: int
    finish_reason: str


@dataclasses.dataclass(frozen=True)
class GenerationBatch:
    """All rows of one sampler call, padded (handy for building training batches).

    Attributes:
      token_ids: [B, N] int32, N = max_new_tokens; entries at t >= lengths[b] are 0.
      logprobs: [B, N] float32; entries at t >= lengths[b] are 0.
      lengths: [B] int32.
      stopped: [B] bool, True when the row ended on a stop id or completed the stop string.
    Index it (``batch[i]``) or iterate it to get `Generation` rows.
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    stopped: np.ndarray

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def __getitem__(self, i: int) -> Generation:
        n = int(self.lengths[i])
        return Generation(
            token_ids=self.token_ids[i, :n].copy(),
            logprobs=self.logprobs[i, :n].copy(),
            length=n,
            finish_reason=FINISH_STOP if bool(self.stopped[i]) else FINISH_LENGTH,
        )

    def __iter__(self) -> Iterator[Generation]:
        return (self[i] for i in range(len(self)))

    @property
    def finish_reasons(self) -> list[str]:
        """``"stop"`` or ``"length"`` per row."""
        return [FINISH_STOP if s else FINISH_LENGTH for s in self.stopped]
