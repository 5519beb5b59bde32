"""The batch contract between rollout, advantage estimators, losses and the trainer.

One row of a `SampleBatch` is one *sample* = one generation of the policy:
either a strategy z (kind = STRATEGY) or one step's action a_t (kind = ACTION).
Rows are padded to a static row count R and token axes to static lengths Tp / Tr
(bucketed, so jit compiles once per bucket; docs/design.md §6.3).

Conventions (docs/method.md §1.2, §1.3, §4):

* ids are plain int32 labels, **not** row positions and **not** required to be dense:
  estimators group by *value* (a jit-safe dense remap, `segments.dense_group_ids`),
  so the rows of a group may be interleaved with other groups anywhere in the batch.
  Group keys are tuples: the task group is `task_id`; StraTA's action group is
  `(task_id, strategy_id)`; a trajectory is `(task_id, trajectory_id)`; a GiGPO step
  group is `(task_id, anchor_id)`. Padding rows hold PAD_ROW_ID (-1) in every id field.
* `score` is the per-sample score the estimator groups: the episode return R_ij on
  every action row of the episode (the same value on each step), and on strategy
  rows it is unused (StraTA's R(z) is computed by the estimator from the episode
  returns of the strategy's episodes plus `strategy_len` / `format_fail`; we chose to
  compute R(z) in the estimator so the top-delta / penalty convention is pinned and
  tested in one place). Scores are in [0,1]-scale units (ScienceWorld score / 100).
* Strategy revision (a rollout option, docs/method.md §5.9): a revision written during an
  episode is a strategy row of its own level: `anchor_id` = its ordinal r >= 1 (the task's
  strategies hold 0), `trajectory_id` / `step_index` = its episode and the steps taken before
  it, `score` = the episode's return from that step on.
* `step_reward` is the per-step env reward r_t (GiGPO's discounted step returns and
  GAE are computed from it inside the estimator).
* `valid` excludes padding rows and rows of crashed episodes from all group
  statistics and the loss (docs/method.md §1.2).
* `response_mask` marks generated tokens only: EOS included, nothing after it, no
  prompt / observation / judge tokens (docs/method.md §1.3).
* The last step of a trajectory present in the batch is terminal for GAE (next value 0):
  the estimator runs on the whole rollout batch, before mini-batching.

Source: docs/method.md §1.2; verl-agent's DataProto fields
(uid / traj_uid / anchor_obs / step_rewards) for the naming of the ids.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import flax.struct
import jax
import numpy as np

from strata_jax.buckets import bucket_size

PAD_ROW_ID = -1
"""Sentinel in every id field (task_id, strategy_id, ..., kind, anchor_id) of a padding row (not
a token id: token columns pad with the batch's pad token, `pad_batch`'s added columns with 0)."""

KIND_ACTION = 0
"""`kind` of a step sample (one env step's generation)."""

KIND_STRATEGY = 1
"""`kind` of a strategy sample (StraTA's z)."""


@flax.struct.dataclass
class SampleBatch:
    """A padded batch of R samples; a registered pytree (every field is a leaf).

    Token fields (Tp = padded prompt length, Tr = padded response length):
        prompt_ids:      [R, Tp] int32, LEFT-padded with the pad id (prompt ends at column Tp-1).
        prompt_mask:     [R, Tp] bool, True on real prompt tokens.
        response_ids:    [R, Tr] int32, RIGHT-padded; the sampler's token ids (no re-encode).
        response_mask:   [R, Tr] bool, True on generated tokens (EOS included, nothing after).

    Ids ([R] int32; PAD_ROW_ID = -1 on padding rows; labels, not positions):
        task_id:         task group (one task instance; the GRPO / strategy-level group).
        strategy_id:     which strategy z of the task (StraTA); 0 (or any constant) without.
        trajectory_id:   which episode of the task.
        step_index:      0-based env step of an action row; 0 on strategy rows (a revision:
                         the steps taken before it).
        kind:            KIND_ACTION (0) or KIND_STRATEGY (1).
        anchor_id:       hash of the raw env observation at this step (host-side, no history);
                         GiGPO groups step samples by (task_id, anchor_id). Strategy rows:
                         the strategy level, 0 = the task's z, r >= 1 = an episode's r-th
                         revision.

    Per-sample data ([R]):
        score:           f32, episode return R_ij on action rows (same on every step); unused
                         on strategy rows (see module doc), except revision rows (the return
                         from the revision point).
        step_reward:     f32, env reward of this step (GiGPO, GAE).
        invalid:         bool, the action failed the format (0.1 penalty on this step only).
        judge_flag:      bool, self-judgment named this step a bad step (StraTA, kappa).
        valid:           bool, False for padding rows and crashed episodes.
        strategy_len:    int32, |z| = token count of the first <strategy> body (strategy rows).
        format_fail:     bool, P_fmt = 1 for this strategy (strategy rows).

    Slots the trainer fills (zeros until then):
        sampler_logprobs: [R, Tr] f32, the sampler's logprobs (mismatch logging only).
        old_logprobs:     [R, Tr] f32, the trainer's recomputation at the start of the update.
        ref_logprobs:     [R, Tr] f32, the frozen reference policy's logprobs.
        values:           [R] f32, critic value V(h_t) at the last token of the response.
        value_std:        [R] f32, std of V over K dropout passes (STAPO's uncertainty).

    Build one with `make_sample_batch`; replace a slot with `batch.replace(old_logprobs=...)`.
    """

    prompt_ids: jax.Array
    prompt_mask: jax.Array
    response_ids: jax.Array
    response_mask: jax.Array
    task_id: jax.Array
    strategy_id: jax.Array
    trajectory_id: jax.Array
    step_index: jax.Array
    kind: jax.Array
    anchor_id: jax.Array
    score: jax.Array
    step_reward: jax.Array
    invalid: jax.Array
    judge_flag: jax.Array
    valid: jax.Array
    strategy_len: jax.Array
    format_fail: jax.Array
    sampler_logprobs: jax.Array
    old_logprobs: jax.Array
    ref_logprobs: jax.Array
    values: jax.Array
    value_std: jax.Array

    @property
    def num_rows(self) -> int:
        """R, the static padded row count."""
        return self.response_ids.shape[0]

    @property
    def response_len(self) -> int:
        """Tr, the static padded response length."""
        return self.response_ids.shape[1]


ID_FIELDS = ("task_id", "strategy_id", "trajectory_id", "step_index", "kind", "anchor_id")
"""The id fields of a `SampleBatch`: PAD_ROW_ID on padding rows (every other field pads with
0)."""
_F32_ROW_FIELDS = ("score", "step_reward", "values", "value_std")
_BOOL_ROW_FIELDS = ("invalid", "judge_flag", "format_fail")
_TOKEN_F32_FIELDS = ("sampler_logprobs", "old_logprobs", "ref_logprobs")
_REQUIRED = ("prompt_ids", "response_ids", "task_id", "trajectory_id", "kind")


def make_sample_batch(
    records: Sequence[Mapping[str, Any]],
    *,
    row_buckets: Sequence[int] | None = None,
    prompt_buckets: Sequence[int] | None = None,
    response_buckets: Sequence[int] | None = None,
    row_multiple: int = 8,
    pad_token_id: int = 0,
) -> SampleBatch:
    """Pad a list of per-sample records (host numpy) into a `SampleBatch` with static sizes.

    Each record is a mapping with keys
        prompt_ids (1-D ints), response_ids (1-D ints), task_id, trajectory_id, kind  (required);
        strategy_id (0), step_index (0), anchor_id (0), score (0.), step_reward (0.),
        invalid (False), judge_flag (False), valid (True), strategy_len (0),
        format_fail (False), values (0.), value_std (0.), response_mask (1-D bool,
        default all True: every response token is generated; the rollout must already
        have cut everything after EOS), sampler_logprobs / old_logprobs / ref_logprobs
        (1-D floats, default zeros)                                           (optional).

    Sizes: R = smallest of `row_buckets` >= len(records) (or len rounded up to
    `row_multiple`, default 8 so the row axis shards over an 8-device mesh); Tp / Tr the
    smallest bucket >= the longest prompt / response (or the longest, rounded up to 8).
    Padding rows get PAD_ROW_ID ids, valid = False and all-False masks.

    Returns a SampleBatch of numpy arrays (device_put or jit it as you like).
    Raises ValueError on a missing required key or mismatched per-token lengths.
    """
    n = len(records)
    for i, rec in enumerate(records):
        missing = [k for k in _REQUIRED if k not in rec]
        if missing:
            raise ValueError(f"record {i} lacks required keys {missing}; see make_sample_batch doc")
    R = bucket_size(n, row_buckets, row_multiple)
    tp = bucket_size(max((len(r["prompt_ids"]) for r in records), default=1), prompt_buckets, 8)
    tr = bucket_size(max((len(r["response_ids"]) for r in records), default=1), response_buckets, 8)

    out: dict[str, np.ndarray] = {
        "prompt_ids": np.full((R, tp), pad_token_id, np.int32),
        "prompt_mask": np.zeros((R, tp), bool),
        "response_ids": np.full((R, tr), pad_token_id, np.int32),
        "response_mask": np.zeros((R, tr), bool),
        "valid": np.zeros((R,), bool),
        "strategy_len": np.zeros((R,), np.int32),
    }
    for f in ID_FIELDS:
        out[f] = np.full((R,), PAD_ROW_ID, np.int32)
    for f in _F32_ROW_FIELDS:
        out[f] = np.zeros((R,), np.float32)
    for f in _BOOL_ROW_FIELDS:
        out[f] = np.zeros((R,), bool)
    for f in _TOKEN_F32_FIELDS:
        out[f] = np.zeros((R, tr), np.float32)

    for i, rec in enumerate(records):
        p = np.asarray(rec["prompt_ids"], np.int32)
        r = np.asarray(rec["response_ids"], np.int32)
        if p.size:
            out["prompt_ids"][i, tp - p.size:] = p
            out["prompt_mask"][i, tp - p.size:] = True
        out["response_ids"][i, : r.size] = r
        m = np.asarray(rec.get("response_mask", np.ones(r.size, bool)), bool)
        if m.size != r.size:
            raise ValueError(f"record {i}: response_mask has {m.size} entries for {r.size} tokens")
        out["response_mask"][i, : r.size] = m
        for f in _TOKEN_F32_FIELDS:
            if f in rec:
                v = np.asarray(rec[f], np.float32)
                if v.size != r.size:
                    raise ValueError(f"record {i}: {f} has {v.size} entries for {r.size} tokens")
                out[f][i, : r.size] = v
        for f in ID_FIELDS:
            default = 0 if f in ("strategy_id", "step_index", "anchor_id") else None
            out[f][i] = int(rec.get(f, default))
        for f in _F32_ROW_FIELDS:
            out[f][i] = float(rec.get(f, 0.0))
        for f in _BOOL_ROW_FIELDS:
            out[f][i] = bool(rec.get(f, False))
        out["valid"][i] = bool(rec.get("valid", True))
        out["strategy_len"][i] = int(rec.get("strategy_len", 0))
    return SampleBatch(**out)


def pad_batch(batch: SampleBatch, rows: int, prompt_len: int | None = None,
              response_len: int | None = None) -> SampleBatch:
    """A numpy copy of `batch` padded to `rows` rows and, optionally, wider token columns.

    Padding rows hold PAD_ROW_ID in the `ID_FIELDS` and 0 / False everywhere else (so valid False
    and all-False masks: no group statistic or loss sees them). `prompt_len` widens the prompt
    fields ([R, Tp]) on the LEFT, `response_len` every other [R, T] field on the RIGHT, with 0 /
    False (masked everywhere), keeping the layout of `make_sample_batch`. None keeps a width.
    Works on numpy or host-addressable jax leaves; returns numpy leaves.
    Raises ValueError when a target is smaller than the batch.
    """
    r, tp, tr = batch.num_rows, batch.prompt_ids.shape[1], batch.response_len
    prompt_len = tp if prompt_len is None else int(prompt_len)
    response_len = tr if response_len is None else int(response_len)
    if rows < r or prompt_len < tp or response_len < tr:
        raise ValueError(f"pad_batch cannot shrink a batch of {r} rows x ({tp}, {tr}) columns to "
                         f"{rows} rows x ({prompt_len}, {response_len})")
    out = {}
    for f in dataclasses.fields(batch):
        x = np.asarray(getattr(batch, f.name))
        fill = PAD_ROW_ID if f.name in ID_FIELDS else 0
        x = np.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1), constant_values=fill)
        if x.ndim == 2:
            left = f.name.startswith("prompt_")
            extra = (prompt_len if left else response_len) - x.shape[1]
            x = np.pad(x, [(0, 0), (extra, 0) if left else (0, extra)], constant_values=0)
        out[f.name] = x
    return SampleBatch(**out)


def pad_rows(batch: SampleBatch, multiple: int) -> SampleBatch:
    """`batch` with padding rows appended (`pad_batch`) so its row count is a multiple of
    `multiple`; the batch itself (numpy or jax leaves) when it already is."""
    extra = (-batch.num_rows) % max(int(multiple), 1)
    return pad_batch(batch, batch.num_rows + extra) if extra else batch


BATCH_FILE_VERSION = 1
"""Layout version of `save_sample_batch` files (bumped when a field changes meaning)."""


def save_sample_batch(batch: SampleBatch, path: str, **meta: Any) -> None:
    """Write `batch` (every field, host values) to `path` as a compressed ``.npz``.

    Why: stored runs otherwise keep only trajectory text, and re-encoding text does not give the
    sampler's exact ids, so a benchmark or a test that replays a real update needs the batch
    itself (`load_sample_batch`). `meta`: small JSON-able values stored beside the fields (e.g.
    the iteration, algo, env), returned by `load_sample_batch`. The file is written to a
    temporary name and renamed, so a killed run never leaves a half-written batch.
    """
    import json
    import os
    arrays = {f.name: np.asarray(jax.device_get(getattr(batch, f.name)))
              for f in dataclasses.fields(batch)}
    arrays["__meta__"] = np.frombuffer(json.dumps(
        dict(meta, version=BATCH_FILE_VERSION), default=str).encode(), np.uint8)
    tmp = f"{path}.tmp{os.getpid()}.npz"
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, path)


def load_sample_batch(path: str) -> tuple[SampleBatch, dict[str, Any]]:
    """(SampleBatch with numpy leaves, meta dict) from a `save_sample_batch` file.

    Raises ValueError when the file is not such a batch (a missing field or another layout
    version): say which, so the user re-dumps it with this code (``log.dump_batches``)."""
    import json
    with np.load(path) as z:
        names = set(z.files)
        meta = json.loads(bytes(z["__meta__"]).decode()) if "__meta__" in names else {}
        want = [f.name for f in dataclasses.fields(SampleBatch)]
        missing = [n for n in want if n not in names]
        if missing or meta.get("version") != BATCH_FILE_VERSION:
            raise ValueError(f"{path} is not a SampleBatch file of layout version "
                             f"{BATCH_FILE_VERSION} (missing {missing}, version "
                             f"{meta.get('version')}); dump it again with log.dump_batches")
        return SampleBatch(**{n: z[n] for n in want}), meta
