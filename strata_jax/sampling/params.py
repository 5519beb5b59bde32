"""Sampling parameters of one sampler call (docs/design.md §6.2).

One ``SamplingParams`` applies to every row of a call. The rollout runs greedy evaluation and
sampled training rollouts as separate calls, so per-row parameters are not needed; per-row
randomness comes from the caller's per-row PRNG keys instead.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from strata_jax.sampling.stops import StopText


# The smallest non-zero temperature accepted. Logits are divided by the temperature in
# float32: a temperature near float32's smallest normal (1e-38) or below it (1e-39 is
# subnormal, 1e-46 rounds to 0) overflows logits / T to inf and gives NaN logprobs. Anything
# below this floor samples the argmax in all but name; ask for it with 0 (greedy) instead.
MIN_TEMPERATURE = 1e-6


def check_temperature(temperature: float, name: str = "temperature", *,
                      allow_greedy: bool = True) -> float:
    """`temperature` as a float when it is usable, else ValueError.

    Usable: finite and either 0 (greedy, when `allow_greedy`) or >= `MIN_TEMPERATURE`.
    `name` is the field named in the message (e.g. ``rollout.temperature``).
    """
    t = float(temperature)
    if t == 0.0 and allow_greedy:
        return t
    if not (math.isfinite(t) and t >= MIN_TEMPERATURE):
        greedy = " or 0 (greedy)" if allow_greedy else ""
        raise ValueError(
            f"{name} must be a finite number >= {MIN_TEMPERATURE:g}{greedy}, got {temperature!r} "
            "(smaller temperatures overflow float32 logits / temperature into NaN logprobs)")
    return t


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen and when a row stops.

    Attributes:
      temperature: softmax temperature (>= `MIN_TEMPERATURE`), or 0 meaning greedy. Logprobs
        are reported as ``log_softmax(logits / temperature)`` of the chosen token, BEFORE
        top-k / top-p renormalisation, so that the trainer's recomputation of pi_old matches
        (docs/method.md §9.1).
      top_p: nucleus mass in (0, 1]; 1 disables it. Keeps the smallest set of most likely
        tokens whose mass (after temperature and top-k) reaches ``top_p``; ties at the
        threshold are all kept.
      top_k: keep the ``top_k`` most likely tokens (ties at the k-th value all kept); 0
        disables it.
      greedy: argmax decoding (also implied by ``temperature == 0``). Greedy rows report
        temperature-1 logprobs.
      max_new_tokens: generation limit per row (>= 0); 0 returns empty generations.
      stop_token_ids: a row finishes when it emits one of these ids (the stop token is kept
        in the output).
      stop_text: a compiled stop string (`strata_jax.sampling.stops.build_stop_text`), or
        None: a row also finishes (finish reason "stop") on the token that completes it,
        checked on device whatever the tokens' boundaries; that token is kept in the output.

    Raises:
      ValueError: on a temperature that is negative, not finite or in (0, MIN_TEMPERATURE)
        (`check_temperature`), top_p outside (0, 1], a top_k, max_new_tokens or
        stop id that is not an integer (2.0 included) or is negative, or a stop_text that is
        not a `StopText`.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    max_new_tokens: int = 256
    stop_token_ids: Sequence[int] = ()
    stop_text: StopText | None = None

    def __post_init__(self) -> None:
        if self.stop_text is not None and not isinstance(self.stop_text, StopText):
            raise ValueError(f"stop_text must be a StopText (build_stop_text(tokenizer, "
                             f"patterns)) or None, got {type(self.stop_text).__name__}")
        # Counts and ids must be whole numbers: int(2.7) would silently change what was asked.
        for name in ("top_k", "max_new_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"{name} must be an integer, got {v!r} ({type(v).__name__})")
            object.__setattr__(self, name, int(v))
        if any(isinstance(s, bool) or not isinstance(s, (int, np.integer))
               for s in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integer token ids, got {self.stop_token_ids!r}")
        # Normalise to a tuple so the dataclass stays hashable whatever the caller passed.
        object.__setattr__(self, "stop_token_ids", tuple(int(s) for s in self.stop_token_ids))
        check_temperature(self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if any(s < 0 for s in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ids, got {self.stop_token_ids}")

    @property
    def is_greedy(self) -> bool:
        """True when tokens are chosen by argmax (``greedy`` or ``temperature == 0``)."""
        return self.greedy or self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        """Temperature used for the reported logprobs: 1 for greedy rows, else ``temperature``."""
        return 1.0 if self.is_greedy else float(self.temperature)
