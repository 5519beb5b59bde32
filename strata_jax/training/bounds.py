"""Shape bounds from the config: the batch shape and the packed micro-batch shape a run's
update pads to from its first iteration on (`ShapeBounds`), and the sampler's bucket floors
(`sampler_floors`), so that a run's compiled programs do not grow with its batches
(docs/performance.md, "Compiled shapes over a run").

Why: every new static shape is a new compile of the whole forward and backward (minutes on a
real model), and the packed update's shapes (`prefix_tree.packed_micro_batches`) follow the
batch: its rows, prompt and response widths, how its rows pack, how many rows and response
tokens each micro-batch carries. Padding them up to what the config allows makes them the same
at every iteration; the padding is inert (masked rows, columns and slots), so the update's
numbers stay those of the unpadded one up to float summation order.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from strata_jax.buckets import bucket, bucket_size, response_columns


@dataclasses.dataclass(frozen=True)
class ShapeBounds:
    """What one iteration's update batch can hold at most, per the config.

    Attributes:
      prompt: prompt tokens of a row (env.max_prompt_tokens).
      response: response tokens of a row (rollout.max_action_tokens, and with StraTA's
        strategy rows max_strategy_tokens; the judge's verdicts are no rows).
      rows: rows of a batch (the rollout's episodes x env.max_steps, plus its strategy rows);
        a floor, not a cap: a batch with more rows (a refill, revisions) gets the next row
        bucket above it, a compile more rather than an error.
      mini_batch_rows: rows of one mini-batch (optim.mini_batch_size plus the strategy rows
        spread over it, `batching.minibatch_plan`), likewise a floor.
    Raises ValueError on a non-positive field.
    """

    prompt: int
    response: int
    rows: int
    mini_batch_rows: int

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"shape bound {f.name} must be >= 1, got {getattr(self, f.name)}")

    def prompt_width(self) -> int:
        """Tp of the update batch: `bucket_size` of the prompt bound (a multiple of 8, as
        `make_sample_batch` and `batching.trim_padding` size prompts)."""
        return bucket_size(self.prompt, None, 8)

    def response_width(self, response_floor: int) -> int:
        """Tr of the update batch: `response_columns` of the response bound."""
        return response_columns(self.response, response_floor)

    def micro_rows(self, mark_key: str, row_multiple: int = 1) -> int:
        """m, the rows every packed micro-batch of pass `mark_key` pads to: a power of two
        >= the rows its pass can hand one micro-batch ("train": a mini-batch, "score": the
        batch), a multiple of row_multiple."""
        n = self.mini_batch_rows if mark_key == "train" else self.rows
        return bucket(min(n, self.rows), 1, row_multiple)

    @classmethod
    def from_config(cls, c: Any) -> "ShapeBounds":
        """The bounds of experiment config `c` (configs/base.py): prompt = env.max_prompt_tokens;
        response = rollout.max_action_tokens (StraTA: the larger of it and
        max_strategy_tokens); rows = tasks_per_batch x (episodes x env.max_steps +
        strategies), episodes = num_strategies x episodes_per_strategy (StraTA) or group_size
        (the flat algorithms, no strategy rows), plus the rows a replay draw can append to
        them (`replay_rows`), rounded up to rollout.row_multiple;
        mini_batch_rows = optim.mini_batch_size + the strategy rows, rounded up to
        optim.micro_batch_rows."""
        from strata_jax.algos.table import get_algorithm
        r = c.rollout
        flat = get_algorithm(c.algo).rollout != "strata"
        strategies = 0 if flat else int(r.num_strategies)
        episodes = int(r.group_size) if flat else int(r.num_strategies * r.episodes_per_strategy)
        tasks = int(r.tasks_per_batch)
        rows = tasks * (episodes * int(c.env.max_steps) + strategies)
        rows += replay_rows(c, rows)
        rows = -(-rows // int(r.row_multiple)) * int(r.row_multiple)
        mini = int(c.optim.mini_batch_size) + tasks * strategies
        mini = math.ceil(mini / int(c.optim.micro_batch_rows)) * int(c.optim.micro_batch_rows)
        response = r.max_action_tokens if flat else max(r.max_action_tokens,
                                                         r.max_strategy_tokens)
        return cls(prompt=int(c.env.max_prompt_tokens), response=int(response), rows=rows,
                   mini_batch_rows=mini)


def replay_rows(c: Any, fresh: int) -> int:
    """The most rows STAPO's replay pool appends to a batch of `fresh` valid rows of experiment
    config `c` (0 without a ``replay`` section or with replay off: `replay.draw_size` at the
    pool's capacity, training/replay.py)."""
    from strata_jax.training.replay import ReplayConfig, draw_size
    if "replay" not in c:
        return 0
    rc = ReplayConfig.from_config(c.replay)
    return min(rc.capacity, draw_size(fresh, rc)) if rc.enabled else 0


# the rows' cache buckets a fixed-shape sampler call decodes over: the prompt budget's bucket
# and its halvings down to 1 / ROWS_LADDER of it (4 rungs), so a short call's attention is not
# the whole budget's, for 3 more compiled shapes per call shape
ROWS_LADDER = 8


def sampler_floors(c: Any) -> dict[str, Any]:
    """The `Sampler` bucket settings of experiment config `c`: with rollout.sampler_fixed_shapes,
    batch_rungs = the row counts of the rollout's decode calls, each rounded up to a power of
    two (StraTA's strategy candidates, tasks_per_batch x num_strategies x oversample; the
    most episodes one cohort holds, min(tasks_per_batch x group, ceil(env.num_workers /
    cohorts)), which bounds the revisions' calls too; the judge's call, every episode at
    once), length_floor = the prompt budget env.max_prompt_tokens rounded up to a power of
    two, so every call's rows, prefixes and prompt lengths land on buckets met in the first
    iteration (the decode budget, max_new_tokens, is bucketed per stage as always), and the
    rows' cache ladder (rows_floor = that bucket / `ROWS_LADDER`, at least 16; warm_ladder:
    the whole ladder compiled the first time a call shape is met); without it, {} (the
    sampler's own floors: each call's shapes follow its rows).

    What the fixed shapes cost: the prefill skips all-padding chunks of the wide prompt
    bucket (`strata_jax.sampling.programs.prefill_chunks`), so prompts cost their own tokens;
    decoding attends over the rows' ladder bucket (at most twice the longest row, or
    rows_floor), a call with fewer live rows than its rung computes the filler rows, and the
    first iteration compiles the ladder (docs/performance.md, "Compiled shapes over a
    run")."""
    from strata_jax.algos.table import get_algorithm
    from strata_jax.rollout.episodes import resolve_cohorts
    r = c.rollout
    if not r.get("sampler_fixed_shapes", False):
        return {}
    tasks = int(r.tasks_per_batch)
    rungs = set()
    if get_algorithm(c.algo).rollout == "strata":
        rungs.add(bucket(tasks * int(r.num_strategies) * int(r.oversample)))
        episodes = tasks * int(r.num_strategies) * int(r.episodes_per_strategy)
    else:
        episodes = tasks * int(r.group_size)
    per_cohort = -(-int(c.env.num_workers) // resolve_cohorts(r.cohorts, c.env.name))
    rungs.add(bucket(min(episodes, per_cohort)))   # the episode loop's admission cap
    rungs.add(bucket(episodes))                    # the judge's one call over every episode
    width = bucket(int(c.env.max_prompt_tokens))
    return dict(batch_rungs=tuple(sorted(rungs)), length_floor=width,
                rows_floor=max(16, width // ROWS_LADDER), warm_ladder=True)


def embed_floors(c: Any) -> tuple[int, int]:
    """The (rows, width) floors of `SamplerPolicy`'s strategy-embedding forward: with
    rollout.sampler_fixed_shapes, the candidates of one rollout (tasks_per_batch x
    num_strategies x oversample) and the strategy budget (rollout.max_strategy_tokens), each
    rounded up to a power of two, so every call's shape is the first one; without it (1, 16)
    (each call's shape follows its strategies)."""
    r = c.rollout
    if not r.get("sampler_fixed_shapes", False):
        return (1, 16)
    rows = int(r.tasks_per_batch) * int(r.num_strategies) * int(r.oversample)
    return (bucket(rows), bucket(int(r.max_strategy_tokens)))


__all__ = ["ROWS_LADDER", "ShapeBounds", "embed_floors", "replay_rows", "sampler_floors"]
