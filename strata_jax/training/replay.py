"""STAPO's prioritised replay pool and its weight-stratified draw (docs/method.md §7.5; the
STAPO write-up sec. 4.3), host-side numpy.

The pool keeps the rows an update trained on across iterations: their tokens (the prompt holds
the trajectory context under cumulative prompts; `trajectory_id` / `step_index` say where the
row sat in its episode), the sampler's logprobs (the behaviour policy's, as the rollout
recorded them), the estimator's advantage, sample weight and value target at the time, and the
iteration they came from. Each update of `Trainer.update` (trainer.py) then:

1. `ReplayPool.draw`: drops rows older than ``max_age`` iterations, and draws
   ``n = min(eligible, floor(fraction * n_fresh / (1 - fraction)))`` rows (n_fresh = the
   iteration's valid rows, so the replayed rows are about ``fraction`` of the rows trained):
   the eligible rows (weight > 0) sorted by stored advantage and cut into ``strata``
   equal-count bins, n split evenly over the bins, within a bin drawn without replacement
   with probability proportional to the weight (the priority), from a numpy generator
   seeded by the run's PRNG state. The drawn rows are appended to the iteration's rows
   (`ReplayDraw.batch`).
2. After scoring: the replayed rows' pi_old is their STORED sampler logprobs, not the trainer's
   recomputation with the current params (`ReplayDraw.split_scored`); the estimator sees them
   as padding (they are not re-estimated: their group is gone), and `ReplayDraw.merge` puts
   their stored advantage, weight and value target into the arrays the loss reads.
3. `ReplayPool.absorb`: the iteration's own valid rows with weight > 0 enter the pool; over
   ``capacity`` rows the lowest weight goes first, ties the oldest iteration, then the earliest
   inserted (`eviction_order`).

The pool is part of the checkpoint (`ReplayPool.state` / `from_state`: arrays beside the
train state, docs/design.md §10), so a resumed run draws what the uninterrupted one draws.
Arrays are replaced, never written in place, so a state taken earlier (the loop's marked
state) stays what it was.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import numpy as np

from strata_jax.algos.batch import ID_FIELDS, PAD_ROW_ID, SampleBatch, pad_batch
from strata_jax.algos.losses import loss_mask, mean_kl
from strata_jax.config import from_section, section_sources
from strata_jax.distributed import host_values
from strata_jax.training.batching import trim_padding

# The SampleBatch fields a pool row keeps (the scoring slots are recomputed; valid is implied).
_ROW_FIELDS = ID_FIELDS + ("score", "step_reward", "invalid", "judge_flag", "strategy_len",
                           "format_fail")
_PROMPT_FIELDS = ("prompt_ids", "prompt_mask")                      # left-padded
_RESPONSE_FIELDS = ("response_ids", "response_mask", "sampler_logprobs")   # right-padded
# What the estimator gave the row, and where it came from.
_OWN_FIELDS = ("advantage", "weight", "target", "iteration", "serial")
FIELDS = _PROMPT_FIELDS + _RESPONSE_FIELDS + _ROW_FIELDS + _OWN_FIELDS
"""The arrays of a pool (`ReplayPool.arrays`), [N] or [N, T] each."""

REPLAY_SALT = 0x5EB1A7
"""Folded into the state's PRNG key for the draw's seed (the update's own splits stay as they
are, so turning replay on changes no other random number)."""


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    """``c.replay`` (configs/base.py; docs/method.md §7.5). Defaults = configs/base.py.

    Attributes:
      enabled: keep a pool and replay from it (off: the update is the one without a pool).
      capacity: rows the pool holds at most (>= 1).
      max_age: iterations a row stays replayable: a row of iteration i is drawn at iterations
        i + 1 .. i + max_age (>= 1).
      fraction: target share of replayed rows among the rows an update trains, in [0, 1).
      strata: equal-count advantage bins the draw is spread over (>= 1).
    Raises ValueError on a value out of range.
    """

    enabled: bool = False
    capacity: int = 2048
    max_age: int = 4
    fraction: float = 0.25
    strata: int = 3

    SECTION: ClassVar[str] = "replay"

    def validate(self) -> None:
        """Raise ValueError (one line: the key and what to set) on a bad value."""
        for name in ("capacity", "max_age", "strata"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"replay.{name} must be an integer >= 1, got {v!r}")
        if not 0.0 <= float(self.fraction) < 1.0:
            raise ValueError(f"replay.fraction must be in [0, 1) (the share of replayed rows "
                             f"among the rows trained), got {self.fraction!r}")

    @classmethod
    def config_sources(cls) -> dict[str, str]:
        """{field: "replay.<field>"}."""
        return section_sources(cls, cls.SECTION)

    @classmethod
    def from_config(cls, cfg: Any, **overrides) -> "ReplayConfig":
        """From the ``c.replay`` section (exactly these keys) or a ReplayConfig. Raises
        ConfigError on a missing or unknown key, ValueError on a bad value."""
        return from_section(cls, cfg, **overrides)


def stratified_draw(advantage: np.ndarray, weight: np.ndarray, n: int, strata: int,
                    rng: np.random.Generator) -> np.ndarray:
    """Indices of n rows drawn by weight within equal-count advantage strata.

    Args: advantage, weight [N] float (priority = weight; rows with weight <= 0 are never
    drawn); n: rows wanted (capped at the eligible count); strata: k; rng: the draw's generator.
    The eligible rows, sorted by advantage (stable: ties keep pool order), are cut into
    min(k, eligible) bins of sizes differing by at most one (`np.array_split`, the larger bins
    first); bin b gets n // k rows, the first n % k bins one more (each bin has room); within a
    bin rows are drawn without replacement, P(row) proportional to its weight (numpy's
    `Generator.choice`).
    Returns sorted int64 indices [min(n, eligible)]; the same rng state gives the same rows.
    """
    advantage, weight = np.asarray(advantage, np.float64), np.asarray(weight, np.float64)
    idx = np.flatnonzero(weight > 0)
    n = min(int(n), idx.size)
    if n <= 0:
        return np.zeros((0,), np.int64)
    order = idx[np.argsort(advantage[idx], kind="stable")]
    bins = np.array_split(order, min(int(strata), order.size))
    k = len(bins)
    # bin b holds N // k (+1 for b < N % k) rows and n <= N: every bin can give its share
    quota = [n // k + (1 if b < n % k else 0) for b in range(k)]
    out = []
    for rows, q in zip(bins, quota):
        if q:
            p = weight[rows] / weight[rows].sum()
            out.append(rng.choice(rows, size=q, replace=False, p=p))
    return np.sort(np.concatenate(out)).astype(np.int64)


def eviction_order(weight: np.ndarray, iteration: np.ndarray, serial: np.ndarray) -> np.ndarray:
    """Row indices in the order the pool evicts them: lowest weight first, then the oldest
    iteration, then the earliest inserted (serial). [N] float / int / int -> [N] int64."""
    return np.lexsort((np.asarray(serial), np.asarray(iteration),
                       np.asarray(weight, np.float64))).astype(np.int64)


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    a.flags.writeable = False
    return a


def _widen(a: np.ndarray, width: int, left: bool) -> np.ndarray:
    extra = width - a.shape[1]
    return a if extra <= 0 else np.pad(a, [(0, 0), (extra, 0) if left else (0, extra)])


def _empty(prompt_width: int = 1, response_width: int = 1) -> dict[str, np.ndarray]:
    out = {f: np.zeros((0, prompt_width), bool if f.endswith("mask") else np.int32)
           for f in _PROMPT_FIELDS}
    out.update(response_ids=np.zeros((0, response_width), np.int32),
               response_mask=np.zeros((0, response_width), bool),
               sampler_logprobs=np.zeros((0, response_width), np.float32))
    for f in _ROW_FIELDS:
        dt = bool if f in ("invalid", "judge_flag", "format_fail") else (
            np.float32 if f in ("score", "step_reward") else np.int32)
        out[f] = np.zeros((0,), dt)
    out.update(advantage=np.zeros((0,), np.float32), weight=np.zeros((0,), np.float32),
               target=np.zeros((0,), np.float32), iteration=np.zeros((0,), np.int64),
               serial=np.zeros((0,), np.int64))
    return {k: _frozen(v) for k, v in out.items()}


def _concat(a: dict, b: dict) -> dict:
    """Rows of pool arrays a then b, token fields widened to the wider of the two."""
    tp = max(a["prompt_ids"].shape[1], b["prompt_ids"].shape[1])
    tr = max(a["response_ids"].shape[1], b["response_ids"].shape[1])
    out = {}
    for f in FIELDS:
        x, y = a[f], b[f]
        if x.ndim == 2:
            width, left = (tp, True) if f in _PROMPT_FIELDS else (tr, False)
            x, y = _widen(x, width, left), _widen(y, width, left)
        out[f] = np.concatenate([x, y.astype(x.dtype)])
    return out


def _take(arrays: dict, idx: np.ndarray) -> dict:
    return {f: _frozen(arrays[f][idx]) for f in FIELDS}


@dataclasses.dataclass
class ReplayDraw:
    """One update's replayed rows (`ReplayPool.draw`).

    Attributes:
      batch: the update's batch: the iteration's rows [0, fresh_rows), then the replayed rows
        (valid; old_logprobs = their stored sampler logprobs), token fields at the wider widths
        of the two; the iteration's own batch itself when nothing is replayed.
      fresh_rows: rows of the iteration's batch (its padding rows included).
      rows: replayed rows (0: nothing replayed).
      advantage, weight, target: [rows] f32, stored; age: [rows] int64 (iterations since the
        row's own); iteration: the update's iteration (state.step before it).
    """

    batch: SampleBatch
    fresh_rows: int
    rows: int
    advantage: np.ndarray
    weight: np.ndarray
    target: np.ndarray
    age: np.ndarray
    iteration: int

    @classmethod
    def nothing(cls, batch: SampleBatch, iteration: int) -> "ReplayDraw":
        """The draw of an update that replays no row: `batch` itself."""
        none = np.zeros((0,), np.float32)
        return cls(batch, batch.num_rows, 0, none, none, none, np.zeros((0,), np.int64),
                   iteration)

    def replayed(self, num_rows: int) -> np.ndarray:
        """[num_rows] bool: True on the replayed rows (the batch may be padded after them)."""
        out = np.zeros((num_rows,), bool)
        out[self.fresh_rows: self.fresh_rows + self.rows] = True
        return out

    def stored_old(self, num_rows: int, enabled: bool) -> np.ndarray | None:
        """[num_rows] bool, the rows whose pi_old is stored (`replayed`), for `Trainer.score`;
        None without replay (every iteration of a replay run passes a mask, drawn or not, so
        its scoring program is the same one from the first iteration)."""
        return self.replayed(num_rows) if enabled else None

    def split_scored(self, scored: SampleBatch) -> tuple[SampleBatch, SampleBatch]:
        """(the batch the loss trains on: the replayed rows' old_logprobs set to their stored
        sampler logprobs; the batch the estimator sees: the replayed rows as padding rows
        (invalid, PAD_ROW_ID ids), so the iteration's advantages are those without them).
        scored: the scored `batch` (possibly padded with rows after it)."""
        if not self.rows:
            return scored, scored
        rep = self.replayed(scored.num_rows)
        on = jax.numpy.asarray(rep)
        old = jax.numpy.where(on[:, None], scored.sampler_logprobs, scored.old_logprobs)
        train = scored.replace(old_logprobs=old)
        ids = {f: jax.numpy.where(on, PAD_ROW_ID, getattr(scored, f)) for f in ID_FIELDS}
        est = scored.replace(valid=scored.valid & ~on, **ids)
        return train, est

    def merge(self, adv, weight, target):
        """adv, weight, target [R] f32 of the estimator with the replayed rows' stored values
        in their rows (the loss reads these; they are never re-estimated)."""
        if not self.rows:
            return adv, weight, target
        r = adv.shape[0]
        rep = jax.numpy.asarray(self.replayed(r))

        def put(x, stored):
            full = np.zeros((r,), np.float32)
            full[self.fresh_rows: self.fresh_rows + self.rows] = stored
            return jax.numpy.where(rep, jax.numpy.asarray(full), x)

        return put(adv, self.advantage), put(weight, self.weight), put(target, self.target)


def draw_size(fresh: int, config: ReplayConfig) -> int:
    """Rows a draw asks for beside `fresh` valid rows of the iteration, so that replayed rows
    are config.fraction of the rows trained: floor(fraction x fresh / (1 - fraction)) (the
    pool may hold fewer)."""
    return int(np.floor(config.fraction * fresh / (1.0 - config.fraction) + 1e-9))


class ReplayPool:
    """The replay pool of one run (see the module docstring). Host numpy; one per `Trainer`,
    which passes its `ReplayConfig` to every call (a pool of a run without replay stays empty).

    Attributes: arrays: {field: read-only array} (`FIELDS`), rows first axis; serial: the next
    insertion number (tie-break of the eviction, saved with the pool).
    """

    def __init__(self) -> None:
        self.arrays = _empty()
        self.serial = 0

    @property
    def rows(self) -> int:
        """Rows in the pool."""
        return int(self.arrays["weight"].shape[0])

    def expire(self, iteration: int, config: ReplayConfig) -> None:
        """Drop the rows older than max_age at `iteration` (iteration - row's > max_age)."""
        keep = iteration - self.arrays["iteration"] <= config.max_age
        if not keep.all():
            self.arrays = _take(self.arrays, np.flatnonzero(keep))

    def draw(self, batch: SampleBatch, iteration: int, seed: int,
             config: ReplayConfig) -> ReplayDraw:
        """Expire, then draw this update's replayed rows and append them to `batch`.

        Args: batch: the iteration's SampleBatch (numpy or jax leaves); iteration: the update's
        iteration (state.step before it); seed: the draw's seed (from the run's PRNG state:
        `replay_draw`). Returns a `ReplayDraw` (rows 0 and `batch` itself when nothing is
        drawn)."""
        self.expire(iteration, config)
        n_fresh = int(np.sum(host_values(batch.valid)))
        want = draw_size(n_fresh, config)
        a = self.arrays
        idx = stratified_draw(a["advantage"], a["weight"], want, config.strata,
                              np.random.default_rng(seed))
        if not idx.size:
            return ReplayDraw.nothing(batch, iteration)
        drawn = _take(a, idx)
        return ReplayDraw(join_rows(batch, drawn), batch.num_rows, int(idx.size),
                          drawn["advantage"], drawn["weight"], drawn["target"],
                          iteration - drawn["iteration"], iteration)

    def absorb(self, batch: SampleBatch, adv, weight, target, iteration: int,
               config: ReplayConfig) -> None:
        """Add the valid rows of `batch` (the iteration's own: `ReplayDraw.split_scored`'s
        estimator view) that have weight > 0, with their advantage / weight / target [R] f32
        and `iteration`; then evict beyond capacity (`eviction_order`)."""
        w = host_values(weight).astype(np.float32)
        keep = np.flatnonzero(host_values(batch.valid) & (w > 0))
        if keep.size:
            new = {f: host_values(getattr(batch, f))[keep] for f in
                   _PROMPT_FIELDS + _RESPONSE_FIELDS + _ROW_FIELDS}
            new.update(advantage=host_values(adv).astype(np.float32)[keep], weight=w[keep],
                       target=host_values(target).astype(np.float32)[keep],
                       iteration=np.full(keep.size, iteration, np.int64),
                       serial=self.serial + np.arange(keep.size, dtype=np.int64))
            self.serial += int(keep.size)
            self.arrays = {f: _frozen(v) for f, v in _concat(self.arrays, new).items()}
        over = self.rows - config.capacity
        if over > 0:
            a = self.arrays
            drop = eviction_order(a["weight"], a["iteration"], a["serial"])[:over]
            self.arrays = _take(a, np.setdiff1d(np.arange(self.rows), drop))

    # -- checkpoint ----------------------------------------------------------------------

    def host_state(self, config: ReplayConfig) -> dict:
        """{} without replay, else {"replay": {"serial", "rows"}, "host_arrays":
        {"replay/<field>": array}}: what the checkpoint keeps (`Trainer.host_state`; the
        arrays go beside the meta, `Checkpointer.save`). The pool's own read-only arrays, no
        copy."""
        if not config.enabled:
            return {}
        return {"replay": {"serial": self.serial, "rows": self.rows},
                "host_arrays": {f"replay/{f}": v for f, v in self.arrays.items()}}

    def set_host_state(self, host: dict | None, config: ReplayConfig,
                       vocab_size: int | None = None, step: int | None = None) -> None:
        """Restore from a trainer state `host` (`host_state`'s keys; none: an empty pool) of a
        checkpoint at iteration `step` (None: unknown) for a model of `vocab_size` tokens
        (None: unchecked).
        Raises ValueError when its arrays miss a field, disagree in rows or hold what the pool
        cannot hold (`_malformed`)."""
        meta = (host or {}).get("replay")
        arrays = (host or {}).get("host_arrays") or {}
        if not config.enabled or not meta:
            self.arrays, self.serial = _empty(), 0
            return
        missing = [f for f in FIELDS if f"replay/{f}" not in arrays]
        got = {f: np.asarray(arrays[f"replay/{f}"]) for f in FIELDS if f not in missing}
        rows = {v.shape[0] for v in got.values()}
        if missing or rows != {int(meta["rows"])}:
            raise ValueError(f"the checkpoint's replay pool is malformed (missing {missing}, "
                             f"row counts {sorted(rows)} for {meta['rows']} rows); resume "
                             "from another step")
        bad = _malformed(got, int(meta["rows"]), meta.get("serial"), config, vocab_size, step)
        if bad:
            raise ValueError(f"the checkpoint's replay pool is malformed ({bad}); resume from "
                             "another step")
        self.arrays = {f: _frozen(v) for f, v in got.items()}
        self.serial = int(meta["serial"])


def _malformed(arrays: dict[str, np.ndarray], rows: int, serial, config: ReplayConfig,
               vocab_size: int | None = None, step: int | None = None) -> str:
    """What is wrong with restored pool `arrays` ("" when nothing): more rows than the
    capacity, token fields that are not 2-D integer (ids in [0, vocab_size)) or bool (masks),
    stored numbers that are not finite, a weight <= 0 (only w > 0 rows enter), an iteration
    below 0 or after the checkpoint's `step` (its age would be negative), a serial that is not
    an int above every stored one."""
    if rows > config.capacity:
        return f"{rows} rows for a capacity of {config.capacity}"
    for f in _PROMPT_FIELDS + _RESPONSE_FIELDS:
        v = arrays[f]
        want = bool if f.endswith("mask") else (np.floating if f == "sampler_logprobs"
                                                else np.integer)
        if v.ndim != 2 or not (v.dtype == bool if want is bool else np.issubdtype(v.dtype, want)):
            return f"{f} is {v.dtype} of shape {v.shape}"
        if want is np.integer and v.size and v.min() < 0:
            return f"{f} holds negative token ids"
        if want is np.integer and v.size and vocab_size is not None and v.max() >= vocab_size:
            return f"{f} holds token id {int(v.max())}, beyond the model's {vocab_size} tokens"
    for f in ("advantage", "weight", "target", "sampler_logprobs"):
        v = arrays[f]
        if not np.issubdtype(v.dtype, np.floating) or not np.all(np.isfinite(v)):
            return f"{f} is not finite numbers"
    if arrays["weight"].size and arrays["weight"].min() <= 0:
        return "a stored weight <= 0"
    it = arrays["iteration"]
    if it.size and (it.min() < 0 or (step is not None and it.max() > step)):
        return (f"rows of iterations {int(it.min())}..{int(it.max())} in a checkpoint of "
                f"iteration {step}")
    if not isinstance(serial, int) or isinstance(serial, bool) or (
            arrays["serial"].size and serial <= int(arrays["serial"].max())):
        return f"serial {serial!r} is not an integer above every stored serial"
    return ""


def replay_draw(pool: ReplayPool, batch: SampleBatch, state, cfg) -> tuple[SampleBatch,
                                                                           ReplayDraw]:
    """`Trainer.update`'s first hook: (the batch to score, the draw). Without replay
    (cfg.replay.enabled False) `batch` itself and an empty draw. The seed comes from
    state.rng folded with `REPLAY_SALT` (the update's own key splits are untouched); a joined
    batch is trimmed again (`trim_padding`) when cfg.trim_padding."""
    iteration = int(jax.device_get(state.step))
    if not cfg.replay.enabled:
        return batch, ReplayDraw.nothing(batch, iteration)
    key = jax.random.fold_in(jax.numpy.asarray(state.rng, jax.numpy.uint32), REPLAY_SALT)
    seed = int(jax.device_get(jax.random.randint(key, (), 0, 2 ** 31 - 1)))
    draw = pool.draw(batch, iteration, seed, cfg.replay)
    if draw.rows and cfg.trim_padding:
        draw.batch = trim_padding(draw.batch, cfg.response_floor)
    return draw.batch, draw


def replay_merge(pool: ReplayPool, draw: ReplayDraw, est: SampleBatch, adv, weight,
                 adv_metrics: dict, cfg):
    """`Trainer.update`'s second hook, after the estimator ran on `est` (the iteration's own
    rows): the value targets (``row/value_targets`` of adv_metrics, else 0); with replay the
    iteration's rows enter the pool (`ReplayPool.absorb`) and the replayed rows get their
    stored advantage, weight and target (`ReplayDraw.merge`). Returns (adv, weight, targets)
    [R] f32."""
    target = adv_metrics.get("row/value_targets", jax.numpy.zeros_like(adv))
    if cfg.replay.enabled:
        pool.absorb(est, adv, weight, target, draw.iteration, cfg.replay)
    return draw.merge(adv, weight, target)


def replay_metrics(pool: ReplayPool, draw: ReplayDraw, scored: SampleBatch, est: SampleBatch,
                   on_policy: bool, metrics: dict, cfg) -> dict[str, float]:
    """`Trainer.update`'s last hook: the monitoring of STAPO sec. 4.3.

    `kl/whole_batch` (loss.kl_coef != 0): the loss's KL term to the reference (`mean_kl`) over
    every valid row of the iteration, whatever its weight, at the params the update starts
    from (the scoring pass; on-policy, the one step's `train/kl`, which is that). With replay:
    `replay/fraction` (replayed / valid rows trained), `replay/rows`, `replay/mean_age`
    (iterations; 0 when nothing was replayed), `replay/pool_rows` (after the insertion)."""
    out = {}
    if cfg.loss.kl_coef and not on_policy:
        out["kl/whole_batch"] = float(mean_kl(est.old_logprobs, est.ref_logprobs,
                                              loss_mask(est), cfg.loss))
    elif cfg.loss.kl_coef and "train/kl" in metrics:
        out["kl/whole_batch"] = metrics["train/kl"]
    if cfg.replay.enabled:
        trained = int(np.sum(host_values(scored.valid)))
        out.update({"replay/fraction": draw.rows / max(trained, 1),
                    "replay/rows": float(draw.rows),
                    "replay/mean_age": float(np.mean(draw.age)) if draw.rows else 0.0,
                    "replay/pool_rows": float(pool.rows)})
    return out


def join_rows(batch: SampleBatch, rows: dict) -> SampleBatch:
    """`batch` (host copy) with the pool rows `rows` (`FIELDS` arrays) appended as valid rows
    whose old_logprobs are their stored sampler logprobs; token fields padded to the wider
    widths (prompts on the left, responses on the right). Returns numpy leaves."""
    n = rows["weight"].shape[0]
    fresh = SampleBatch(**{f.name: host_values(getattr(batch, f.name))
                           for f in dataclasses.fields(SampleBatch)})
    tp = max(fresh.prompt_ids.shape[1], rows["prompt_ids"].shape[1])
    tr = max(fresh.response_len, rows["response_ids"].shape[1])
    fresh = pad_batch(fresh, fresh.num_rows, prompt_len=tp, response_len=tr)
    extra = {}
    for f in dataclasses.fields(SampleBatch):
        x = getattr(fresh, f.name)
        if f.name in rows:
            y = rows[f.name]
        elif f.name == "old_logprobs":
            y = rows["sampler_logprobs"]
        elif f.name == "valid":
            y = np.ones((n,), bool)
        else:
            y = np.zeros((n,) + x.shape[1:], x.dtype)
        if y.ndim == 2:
            y = _widen(y, tp if f.name in _PROMPT_FIELDS else tr, f.name in _PROMPT_FIELDS)
        extra[f.name] = np.concatenate([x, y.astype(x.dtype)])
    return SampleBatch(**extra)


__all__ = ["FIELDS", "REPLAY_SALT", "ReplayConfig", "ReplayDraw", "ReplayPool", "eviction_order",
           "draw_size", "join_rows", "replay_draw", "replay_merge", "replay_metrics", "stratified_draw"]
