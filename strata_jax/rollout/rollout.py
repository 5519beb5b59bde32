"""Rollout modes -> `SampleBatch`: StraTA's hierarchical rollout, the flat rollout of the
baselines, cumulative prompts (STAPO) and DAPO's refill (docs/method.md §5-§7).

StraTA (`mode="strata"`), per task (docs/method.md §5.1-§5.4):
  1. reset one env on the task for its first observation (then release it);
  2. sample sigma*N strategy candidates from the strategy prompt (one batched call over all
     tasks, keys (PURPOSE_STRATEGY, task_uid, candidate));
  3. format check (P_fmt, |z|), embed the candidates with the policy (mean-pooled final hidden
     states), keep N by farthest-point selection (format failures only as fill; the first
     point drawn from ``np.random.default_rng([*key_data, task_uid])``);
     ``diverse_sampling=False`` samples N candidates and keeps them all (no FPS);
  4. M episodes per kept strategy on identical copies of the task (`run_episodes`);
  5. self-judgment: one greedy call per finished, non-crashed trajectory -> judge flags.
Steps 1-3 are `strategy.strategy_stage`, step 5 is `judge.judge_stage`; this module wires the
stages and turns their output into batch rows.
Flat (`mode="flat"`): ``group_size`` episodes per task, no strategy, no judge.
Every stage's generation ends with its closing tag, checked on device by the sampler
(`SamplingParams.stop_text`; `prompts.ACTION_STOP`, `STRATEGY_STOP`, `JUDGE_STOP`).
Cumulative prompts: the `PromptBuilder` built with ``history_length=None``
(`make_prompt_builder` does it when ``config.rollout.cumulative_prompts``).
DAPO refill (`dapo_rollout`): roll out tasks, keep the task groups whose episode returns are not
all equal, roll out more tasks for the missing groups, at most ``dapo_max_tries`` tries; the
last try keeps every group.

Rows of the batch (see `strata_jax.algos.batch` for the contract):
  * strategy rows (StraTA, the N kept strategies of each task): kind=KIND_STRATEGY,
    strategy_id = rank in the kept order, trajectory_id = N*M + strategy_id (a label of its own,
    no episode has it), step_index 0, anchor_id 0, strategy_len = |z|, format_fail = P_fmt,
    valid = the strategy has a valid episode (one not crashed, with a step; a strategy without
    one has no reward and stays out of the loss, docs/method.md §1.2);
  * action rows: one per env step, kind=KIND_ACTION, task_id = task_uid, strategy_id,
    trajectory_id, step_index (0-based), anchor_id = `anchor_hash(raw observation)`,
    score = episode return, step_reward, invalid, judge_flag, valid = not crashed;
  * revision rows (only with strategy revision on, `revision.revision_records`): strategy rows
    with anchor_id = the revision's ordinal r >= 1, the episode's trajectory_id, step_index =
    the steps taken before it, score = the return from there on.
  prompt_ids = exactly the prefix + suffix ids the policy saw; response_ids / sampler_logprobs
  = the policy's generated ids (the stop id, or the token that completes the stage's closing
  tag, included) and logprobs, never re-tokenised;
  response_mask = those generated tokens only.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Sequence

import numpy as np

from envs_bridge.base import Task
from envs_bridge.pool import EnvPool
from strata_jax.algos.batch import KIND_ACTION, SampleBatch, make_sample_batch
from strata_jax.algos.dapo_filter import keep_informative_groups
from strata_jax.algos.table import get_algorithm
from strata_jax.config import read_fields, section_sources
from strata_jax.models import stop_token_ids
from strata_jax.models.tokenizer import ENDOFTEXT_ID
from strata_jax.rollout.episodes import anchor_hash, run_episodes
from strata_jax.rollout.records import EpisodeSpec, Interval, LoopStats, Trajectory
from strata_jax.rollout.judge import JudgeModel, judge_flags, judge_stage
from strata_jax.rollout.report import dump_trajectories, rollout_stats
from strata_jax.rollout.policy import Policy
from strata_jax.rollout.prompts import ACTION_STOP, JUDGE_STOP, STRATEGY_STOP, PromptBuilder
from strata_jax.rollout.revision import (RevisionConfig, StrategyReviser, revision_records,
                                         revision_stats)
from strata_jax.rollout.strategy import (StrategyGroup, check_strategy_embedding, strategy_records,
                                         strategy_stage)
from strata_jax.sampling import SamplingParams
from strata_jax.sampling.stops import StopText, build_stop_text


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Rollout settings (defaults = configs/base.py's ``c.rollout``, the paper setting of
    docs/method.md §5.8; see `from_config`).

    mode: "strata" or "flat". num_strategies N, episodes_per_strategy M, oversample sigma,
    diverse_sampling (FPS), strategy_embedding (what FPS measures: "policy" or "sentence",
    docs/method.md §5.2), self_judgment; group_size (flat); temperature / top_p / top_k;
    max_action_tokens / max_strategy_tokens / max_judge_tokens; cohorts; tasks_per_batch,
    dapo_refill, dapo_max_tries; invalid_tail_chars; SampleBatch bucketing (row_buckets,
    prompt_buckets, response_buckets, row_multiple) and pad_token_id; strategy revision
    (StraTA only, off by default: docs/method.md §5.9): revise_every (K, 0 = off), revise_on
    ("" or "stuck"), revise_stuck_steps (k).
    """

    mode: str = "strata"
    num_strategies: int = 4
    episodes_per_strategy: int = 8
    oversample: int = 8
    diverse_sampling: bool = True
    strategy_embedding: str = "policy"
    self_judgment: bool = True
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_action_tokens: int = 512
    max_strategy_tokens: int = 512
    max_judge_tokens: int = 256
    cohorts: int = 0
    tasks_per_batch: int = 16
    dapo_refill: bool = False
    dapo_max_tries: int = 10
    invalid_tail_chars: int = 30
    row_buckets: tuple[int, ...] | None = None
    prompt_buckets: tuple[int, ...] | None = None
    response_buckets: tuple[int, ...] | None = None
    row_multiple: int = 8
    pad_token_id: int = ENDOFTEXT_ID  # <|endoftext|>, Qwen2.5's pad
    revise_every: int = 0
    revise_on: str = ""
    revise_stuck_steps: int = 3

    def __post_init__(self) -> None:
        if self.mode not in ("strata", "flat"):
            raise ValueError(f"rollout mode must be 'strata' or 'flat', got {self.mode!r}")
        if self.revision.enabled and self.mode != "strata":
            raise ValueError("strategy revision (rollout.revise_every / revise_on) revises a "
                             "StraTA strategy: use algo=strata or turn it off")
        for name in ("num_strategies", "episodes_per_strategy", "oversample", "group_size",
                     "tasks_per_batch", "dapo_max_tries"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout {name} must be >= 1, got {getattr(self, name)}")
        check_strategy_embedding(self.strategy_embedding)
        if self.cohorts < 0:
            raise ValueError(f"rollout cohorts must be >= 0 (0 = auto), got {self.cohorts}")

    @property
    def revision(self) -> RevisionConfig:
        """The revision triggers (`RevisionConfig`; validates them)."""
        return RevisionConfig(self.revise_every, self.revise_on, self.revise_stuck_steps)

    # Derived from c.algo's `ALGORITHMS` entry, not set: mode (its rollout), dapo_refill (refill).
    DERIVED: ClassVar[tuple[str, ...]] = ("mode", "dapo_refill")

    @classmethod
    def config_sources(cls) -> dict[str, str]:
        """{field: dotted config key}: ``rollout.<field>`` for every field but `DERIVED`."""
        return section_sources(cls, "rollout", exclude=cls.DERIVED)

    @classmethod
    def from_config(cls, c: Any, **overrides: Any) -> "RolloutConfig":
        """From the experiment ConfigDict (configs/base.py), every field read from its
        ``rollout.<field>`` key; mode and dapo_refill from ``c.algo``'s `ALGORITHMS` entry
        (rollout "strata" / "flat", refill). Raises ConfigError on a missing key or an
        unknown algo."""
        alg = get_algorithm(c.algo)
        kw = read_fields(cls, c, cls.config_sources(), convert={
            k: _buckets for k in ("row_buckets", "prompt_buckets", "response_buckets")})
        kw.update(mode=alg.rollout, dapo_refill=alg.refill)
        kw.update(overrides)
        return cls(**kw)


def _buckets(v: Any) -> tuple[int, ...] | None:
    """A bucket list of the config (None, or a tuple / list of sizes) as a hashable tuple."""
    return None if v is None else tuple(int(x) for x in v)


def make_prompt_builder(tokenizer: Any, c: Any, cumulative: bool | None = None) -> PromptBuilder:
    """`PromptBuilder` from the experiment config: env.max_prompt_tokens, env.history_length,
    the whole trajectory (history_length=None) when `cumulative` (None: the config's
    rollout.cumulative_prompts; the warm start renders a form otherwise when asked), and the
    answer templates when rollout.format_examples."""
    if cumulative is None:
        cumulative = bool(c.rollout.cumulative_prompts)
    hist = None if cumulative else c.env.history_length
    return PromptBuilder(tokenizer, c.env.max_prompt_tokens, hist,
                         format_examples=bool(c.rollout.format_examples))


@dataclasses.dataclass
class RolloutResult:
    """What a rollout returns.

    Attributes:
      batch: the padded `SampleBatch` (numpy leaves).
      records: the per-row dicts it was built from (row i of the batch = records[i]).
      trajectories: every played episode (texts: strategy, outputs, actions, observations,
        verdict).
      strategies: the strategy stage of each task (StraTA; [] for flat).
      stats: scalar rollout metrics (see `rollout_stats`).
      intervals: recorded policy calls and env tickets (overlap analysis).
      skipped_tasks: tasks whose first reset crashed twice (no rows).
    """

    batch: SampleBatch
    records: list[dict[str, Any]]
    trajectories: list[Trajectory]
    strategies: list[StrategyGroup]
    stats: dict[str, float]
    intervals: list[Interval]
    skipped_tasks: list[Task] = dataclasses.field(default_factory=list)

    def dump(self) -> list[dict[str, Any]]:
        """JSON-able episode records (`dump_trajectories`; fields: docs/metrics.md "Trajectories")."""
        return dump_trajectories(self.trajectories, self.strategies)


def stage_sampling(cfg: RolloutConfig, stops: Sequence[int], max_new: int,
                   stop_text: StopText | None = None, greedy: bool = False) -> SamplingParams:
    """The `SamplingParams` of one generation stage: cfg's temperature / top-p / top-k (greedy:
    temperature 0), at most max_new tokens, stopping on the ids `stops` or on stop_text."""
    if greedy:
        return SamplingParams(temperature=0.0, max_new_tokens=max_new, stop_token_ids=stops,
                              stop_text=stop_text)
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                          max_new_tokens=max_new, stop_token_ids=stops, stop_text=stop_text)


def _action_records(trajs: Sequence[Trajectory]) -> list[dict]:
    recs = []
    for tr in trajs:
        flags = judge_flags(tr.bad_steps, len(tr.steps))
        ret = tr.episode_return
        for t, s in enumerate(tr.steps):
            recs.append(dict(
                prompt_ids=s.prompt.ids, response_ids=s.generation.token_ids,
                sampler_logprobs=s.generation.logprobs, task_id=tr.spec.task_uid,
                strategy_id=tr.spec.strategy_id, trajectory_id=tr.spec.trajectory_id,
                step_index=t, kind=KIND_ACTION, anchor_id=anchor_hash(s.observation),
                score=ret, step_reward=s.reward, invalid=s.invalid, judge_flag=bool(flags[t]),
                valid=not tr.crashed))
    return recs


@dataclasses.dataclass
class _Part:
    records: list[dict]
    trajectories: list[Trajectory]
    strategies: list[StrategyGroup]
    stats: LoopStats
    skipped: list[Task]


def _rollout_part(policy: Policy, pool: EnvPool, builder: PromptBuilder, tasks: Sequence[Task],
                  key: Any, cfg: RolloutConfig, task_uid_start: int,
                  judge: JudgeModel | None) -> _Part:
    import time

    t_start = time.perf_counter()
    stops = stop_token_ids(builder.tokenizer)
    uids = list(range(task_uid_start, task_uid_start + len(tasks)))
    pre = LoopStats()
    specs: list[EpisodeSpec] = []
    groups: list[StrategyGroup] = []
    skipped: list[Task] = []
    strategy_sampling = stage_sampling(cfg, stops, cfg.max_strategy_tokens,
                                       build_stop_text(builder.tokenizer, STRATEGY_STOP))
    reviser = None
    if cfg.revision.enabled:
        reviser = StrategyReviser(builder, key, cfg.revision, strategy_sampling)
    if cfg.mode == "strata":
        m = cfg.episodes_per_strategy
        for task, g in zip(tasks, strategy_stage(
                policy, pool, builder, tasks, uids, key, num_keep=cfg.num_strategies,
                oversample=cfg.oversample, diverse=cfg.diverse_sampling,
                sampling=strategy_sampling, stats=pre, embedding=cfg.strategy_embedding)):
            if g is None:
                skipped.append(task)
                continue
            groups.append(g)
            for sid, c in enumerate(g.kept):
                z = g.checks[c].text
                specs += [EpisodeSpec(task, g.task_uid, sid, sid * m + j, z) for j in range(m)]
    else:
        for task, uid in zip(tasks, uids):
            specs += [EpisodeSpec(task, uid, 0, j, None) for j in range(cfg.group_size)]
    trajs, loop = run_episodes(policy, pool, builder, specs, key=key,
                               sampling=stage_sampling(
                                   cfg, stops, cfg.max_action_tokens,
                                   build_stop_text(builder.tokenizer, ACTION_STOP)),
                               cohorts=cfg.cohorts, invalid_tail_chars=cfg.invalid_tail_chars,
                               reviser=reviser)
    if cfg.mode == "strata" and cfg.self_judgment:
        j_policy, j_builder = (judge.policy, judge.builder) if judge else (policy, builder)
        judge_stage(j_policy, j_builder, trajs, key,
                    sampling=stage_sampling(cfg, stop_token_ids(j_builder.tokenizer),
                                            cfg.max_judge_tokens,
                                            build_stop_text(j_builder.tokenizer, JUDGE_STOP),
                                            greedy=True),
                    invalid_tail_chars=cfg.invalid_tail_chars, stats=pre)
    stats = LoopStats(wall_s=time.perf_counter() - t_start, env_wait_s=loop.env_wait_s,
                      sampler_s=loop.sampler_s + pre.sampler_s,
                      sampler_calls=loop.sampler_calls + pre.sampler_calls,
                      intervals=pre.intervals + loop.intervals)
    played = {(tr.spec.task_uid, tr.spec.strategy_id) for tr in trajs
              if tr.steps and not tr.crashed}
    records = (strategy_records(groups, cfg.num_strategies * cfg.episodes_per_strategy, played)
               + _action_records(trajs) + revision_records(trajs))
    return _Part(records, list(trajs), groups, stats, skipped)


def _finish(parts: Sequence[_Part], cfg: RolloutConfig, extra: dict[str, float]) -> RolloutResult:
    records = [r for p in parts for r in p.records]
    trajs = [t for p in parts for t in p.trajectories]
    groups = [g for p in parts for g in p.strategies]
    loop = LoopStats(wall_s=sum(p.stats.wall_s for p in parts),
                     env_wait_s=sum(p.stats.env_wait_s for p in parts),
                     sampler_s=sum(p.stats.sampler_s for p in parts),
                     sampler_calls=sum(p.stats.sampler_calls for p in parts),
                     intervals=[iv for p in parts for iv in p.stats.intervals])
    if not records:
        raise RuntimeError("the rollout produced no samples (every task's env crashed); check "
                           "the env pool's errors")
    batch = make_sample_batch(records, row_buckets=cfg.row_buckets,
                              prompt_buckets=cfg.prompt_buckets,
                              response_buckets=cfg.response_buckets,
                              row_multiple=cfg.row_multiple, pad_token_id=cfg.pad_token_id)
    stats = {**rollout_stats(trajs, groups, loop, strategies=cfg.mode == "strata"), **extra}
    if cfg.revision.enabled:
        stats.update(revision_stats(trajs))
    return RolloutResult(batch, records, trajs, groups, stats, loop.intervals,
                         [t for p in parts for t in p.skipped])


def collect_rollout(policy: Policy, pool: EnvPool, builder: PromptBuilder,
                    tasks: Sequence[Task], *, key: Any, config: RolloutConfig,
                    task_uid_start: int = 0, judge: JudgeModel | None = None) -> RolloutResult:
    """One rollout over `tasks` in the config's mode (StraTA or flat), no refill.

    Args:
      policy: a `Policy` (`SamplerPolicy` or a scripted double).
      pool: an `EnvPool` for the tasks' env with all slots free; its env kwargs set the step
        limit (env.max_steps).
      builder: a `PromptBuilder` (`make_prompt_builder`).
      tasks: the iteration's tasks; task i gets task_uid = task_uid_start + i.
      key: the iteration's base PRNG key (typed, raw uint32 [2] or int); every row key is
        derived from it and the row's global ids.
      config: `RolloutConfig`.
      judge: a separate `JudgeModel` for the self-judgment prompts (`build_judge_model`);
        None = the policy judges itself.
    Returns:
      `RolloutResult`.
    Raises:
      RuntimeError when no task produced a sample.
    """
    part = _rollout_part(policy, pool, builder, tasks, key, config, task_uid_start, judge)
    return _finish([part], config, {})


def _select_groups(part: _Part, groups_wanted: int, keep_all: bool) -> tuple[_Part, int]:
    """Keep the first `groups_wanted` task groups whose returns differ (all when keep_all)."""
    ep_task = [tr.spec.task_uid for tr in part.trajectories]
    ep_ret = [tr.episode_return for tr in part.trajectories]
    ep_valid = [not tr.crashed for tr in part.trajectories]
    keep = keep_informative_groups(ep_task, ep_ret, ep_valid) if ep_task else np.zeros(0, bool)
    informative = {t for t, k in zip(ep_task, keep) if k}
    order = list(dict.fromkeys(ep_task))
    chosen = [t for t in order if keep_all or t in informative][:groups_wanted]
    sel = set(chosen)
    return _Part([r for r in part.records if r["task_id"] in sel],
                 [t for t in part.trajectories if t.spec.task_uid in sel],
                 [g for g in part.strategies if g.task_uid in sel], part.stats,
                 part.skipped), len(chosen)


def dapo_rollout(policy: Policy, pool: EnvPool, builder: PromptBuilder,
                 sample_tasks: Callable[[int], Sequence[Task]], *, key: Any,
                 config: RolloutConfig, judge: JudgeModel | None = None) -> RolloutResult:
    """DAPO dynamic sampling with refill (docs/method.md §6.5).

    Try k rolls out as many new tasks as groups are still missing (``sample_tasks(n)``, e.g.
    `TaskSampler.sample`), keeps the groups whose valid episode returns are not all equal and
    stops once ``tasks_per_batch`` groups are kept; try ``dapo_max_tries`` keeps every group.
    Task uids keep counting across tries, so row keys never repeat.
    Extra stats: dapo/tries, dapo/kept_groups, dapo/rolled_out_groups.
    """
    parts, kept, uid, tries, rolled = [], 0, 0, 0, 0
    for attempt in range(config.dapo_max_tries):
        need = config.tasks_per_batch - kept
        tasks = list(sample_tasks(need))
        part = _rollout_part(policy, pool, builder, tasks, key, config, uid, judge)
        uid += len(tasks)
        rolled += len(tasks)
        tries = attempt + 1
        part, n = _select_groups(part, need, keep_all=attempt == config.dapo_max_tries - 1)
        parts.append(part)
        kept += n
        if kept >= config.tasks_per_batch:
            break
    return _finish(parts, config, {"dapo/tries": float(tries), "dapo/kept_groups": float(kept),
                                   "dapo/rolled_out_groups": float(rolled)})


def rollout(policy: Policy, pool: EnvPool, builder: PromptBuilder,
            sample_tasks: Callable[[int], Sequence[Task]], *, key: Any,
            config: RolloutConfig, judge: JudgeModel | None = None) -> RolloutResult:
    """The iteration's rollout: `dapo_rollout` when ``config.dapo_refill``, else
    `collect_rollout` over ``sample_tasks(config.tasks_per_batch)`` (judge: see there)."""
    if config.dapo_refill:
        return dapo_rollout(policy, pool, builder, sample_tasks, key=key, config=config,
                            judge=judge)
    return collect_rollout(policy, pool, builder, list(sample_tasks(config.tasks_per_batch)),
                           key=key, config=config, judge=judge)
