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
    valid = True (the estimator ignores a strategy whose episodes all crashed);
  * action rows: one per env step, kind=KIND_ACTION, task_id = task_uid, strategy_id,
    trajectory_id, step_index (0-based), anchor_id = `anchor_hash(raw observation)`,
    score = episode return, step_reward, invalid, judge_flag, valid = not crashed.
  prompt_ids = exactly the prefix + suffix ids the policy saw; response_ids / sampler_logprobs
  = the policy's generated ids (the stop id, or the token that completes the stage's closing
  tag, included) and logprobs, never re-tokenised;
  response_mask = those generated tokens only.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Sequence

import numpy as np

from envs_bridge.base import PromptPieces, Task
from envs_bridge.pool import EnvPool
from strata_jax.algos.batch import KIND_ACTION, KIND_STRATEGY, SampleBatch, make_sample_batch
from strata_jax.algos.dapo_filter import keep_informative_groups
from strata_jax.algos.table import get_algorithm
from strata_jax.config import read_fields, section_sources
from strata_jax.models import stop_token_ids
from strata_jax.rollout.episodes import (EpisodeSpec, Interval, LoopStats, StepRecord,
                                         Trajectory, anchor_hash, content_ids,
                                         decode_generation, dedupe_prefixes, prompt_pieces_for,
                                         run_episodes)
from strata_jax.rollout.judge import judge_flags, parse_bad_steps
from strata_jax.rollout.keys import PURPOSE_JUDGE, PURPOSE_STRATEGY, base_key_data, row_keys
from strata_jax.rollout.policy import Policy
from strata_jax.rollout.prompts import (ACTION_STOP, JUDGE_STOP, STRATEGY_STOP, HistoryEntry,
                                        PromptBuilder, PromptIds, invalid_history_action)
from strata_jax.rollout.strategy import StrategyCheck, check_strategy, select_strategies
from strata_jax.sampling import FINISH_LENGTH, Generation, SamplingParams
from strata_jax.sampling.stops import StopText, build_stop_text


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Rollout settings (defaults = configs/base.py's ``c.rollout``, the paper setting of
    docs/method.md §5.8; see `from_config`).

    mode: "strata" or "flat". num_strategies N, episodes_per_strategy M, oversample sigma,
    diverse_sampling (FPS), self_judgment; group_size (flat); temperature / top_p / top_k;
    max_action_tokens / max_strategy_tokens / max_judge_tokens; cohorts; tasks_per_batch,
    dapo_refill, dapo_max_tries; invalid_tail_chars; SampleBatch bucketing (row_buckets,
    prompt_buckets, response_buckets, row_multiple) and pad_token_id.
    """

    mode: str = "strata"
    num_strategies: int = 4
    episodes_per_strategy: int = 8
    oversample: int = 8
    diverse_sampling: bool = True
    self_judgment: bool = True
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_action_tokens: int = 512
    max_strategy_tokens: int = 512
    max_judge_tokens: int = 256
    cohorts: int = 2
    tasks_per_batch: int = 16
    dapo_refill: bool = False
    dapo_max_tries: int = 10
    invalid_tail_chars: int = 30
    row_buckets: tuple[int, ...] | None = None
    prompt_buckets: tuple[int, ...] | None = None
    response_buckets: tuple[int, ...] | None = None
    row_multiple: int = 8
    pad_token_id: int = 151643  # <|endoftext|>, Qwen2.5's pad

    def __post_init__(self) -> None:
        if self.mode not in ("strata", "flat"):
            raise ValueError(f"rollout mode must be 'strata' or 'flat', got {self.mode!r}")
        for name in ("num_strategies", "episodes_per_strategy", "oversample", "group_size",
                     "cohorts", "tasks_per_batch", "dapo_max_tries"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout {name} must be >= 1, got {getattr(self, name)}")

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


def make_prompt_builder(tokenizer: Any, c: Any) -> PromptBuilder:
    """`PromptBuilder` from the experiment config: env.max_prompt_tokens, env.history_length,
    and the whole trajectory (history_length=None) when rollout.cumulative_prompts."""
    hist = None if c.rollout.cumulative_prompts else c.env.history_length
    return PromptBuilder(tokenizer, c.env.max_prompt_tokens, hist)


@dataclasses.dataclass
class StrategyGroup:
    """The strategy stage of one task (logs, dumps).

    Attributes: task, task_uid; prompt (the strategy prompt); candidates (decoded texts);
    checks (`StrategyCheck` per candidate); generations; kept (candidate indices, in
    strategy_id order); first_observation.
    """

    task: Task
    task_uid: int
    prompt: PromptIds
    candidates: list[str]
    checks: list[StrategyCheck]
    generations: list[Generation]
    kept: list[int]
    first_observation: str


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
        """JSON-able episode records (`dump_trajectories`; fields: README "Trajectories")."""
        return dump_trajectories(self.trajectories, self.strategies)


def env_rejected(step: StepRecord) -> bool:
    """Whether the env refused a step's action although it passed the format check: the env's
    ``info["invalid"]`` (ScienceWorld: "No known action matches that input."; ALFWorld:
    "Nothing happens."; WebShop: an action that is not one of the page's ``search`` / ``click``
    actions; built-in envs: "Nothing happens."). A format-invalid step sent nothing: False."""
    return bool(step.action is not None and not step.invalid and step.info.get("invalid", False))


def dump_trajectories(trajectories: Sequence[Trajectory],
                      strategies: Sequence[StrategyGroup] = ()) -> list[dict[str, Any]]:
    """JSON-able records of played episodes, one dict per episode (what ``trajectories.jsonl``
    and the eval's ``*_trajectories.jsonl`` hold; every field is described in the README,
    section "Trajectories").

    Episode: env, task_id, variation, task_uid, goal (the env's task text), strategy_id,
    trajectory_id; the strategy stage (StraTA; all None for flat rollouts): strategy_raw (the
    model's whole strategy output), strategy (the parsed plan, the body of its ``<strategy>``
    block; None when the format check failed), strategy_format_ok, strategy_fail_reason,
    strategy_in_prompt (the text every step prompt carried: the plan, or the raw output of a
    failed candidate used as fill); episode_return, success, crashed, error, verdict, bad_steps,
    env_rejected_steps, final_observation. Step: observation (what the step acted on), output
    (the model's raw text), action (the parsed action sent; None when `invalid`), invalid (the
    output failed the action format or hit the token limit: nothing was sent), env_rejected
    (`env_rejected`), feedback (the env's answer to the action), reward, judge_flag,
    ambiguous_resolved (ScienceWorld's option-0 choice of an ambiguous command, else None).
    """
    by_strategy = {(g.task_uid, sid): (g, cand) for g in strategies
                   for sid, cand in enumerate(g.kept)}
    out = []
    for tr in trajectories:
        flags = judge_flags(tr.bad_steps, len(tr.steps))
        g, cand = by_strategy.get((tr.spec.task_uid, tr.spec.strategy_id), (None, None))
        check = g.checks[cand] if g is not None else None
        steps = []
        for t, s in enumerate(tr.steps):
            feedback = tr.observations[t + 1] if t + 1 < len(tr.observations) else None
            steps.append(dict(observation=s.observation, output=s.output_text, action=s.action,
                              invalid=s.invalid, env_rejected=env_rejected(s), feedback=feedback,
                              reward=s.reward, judge_flag=bool(flags[t]),
                              ambiguous_resolved=s.info.get("ambiguous_resolved")))
        out.append(dict(
            env=tr.spec.task.env, task_id=tr.spec.task.task_id,
            variation=tr.spec.task.variation, task_uid=tr.spec.task_uid,
            goal=tr.pieces.task_description if tr.pieces is not None else None,
            strategy_id=tr.spec.strategy_id, trajectory_id=tr.spec.trajectory_id,
            strategy_raw=g.candidates[cand] if g is not None else None,
            strategy=(check.text if not check.format_fail else None) if check else None,
            strategy_format_ok=(not check.format_fail) if check else None,
            strategy_fail_reason=check.reason if check else None,
            strategy_in_prompt=tr.spec.strategy,
            episode_return=tr.episode_return, success=tr.success, crashed=tr.crashed,
            error=tr.error, verdict=tr.verdict, bad_steps=list(tr.bad_steps),
            env_rejected_steps=sum(st["env_rejected"] for st in steps), steps=steps,
            final_observation=tr.observations[-1] if tr.observations else ""))
    return out


def _sampling(cfg: RolloutConfig, stops: Sequence[int], max_new: int,
              stop_text: StopText | None = None, greedy: bool = False) -> SamplingParams:
    if greedy:
        return SamplingParams(temperature=0.0, max_new_tokens=max_new, stop_token_ids=stops,
                              stop_text=stop_text)
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                          max_new_tokens=max_new, stop_token_ids=stops, stop_text=stop_text)


def _first_observations(pool: EnvPool, tasks: Sequence[Task]
                        ) -> list[tuple[str, PromptPieces] | None]:
    """Reset each task once (in waves of free slots, one retry) for the strategy prompt."""
    out: list[tuple[str, PromptPieces] | None] = [None] * len(tasks)
    todo = list(range(len(tasks)))
    for _attempt in range(2):
        if _attempt and todo:
            pool.note_retries(len(todo))   # logged as rollout/env_retries
        retry = []
        while todo:
            wave, todo = todo[: max(pool.num_free, 1)], todo[max(pool.num_free, 1):]
            outs = pool.reset([tasks[i] for i in wave])
            for i, o in zip(wave, outs):
                if o.crashed:
                    retry.append(i)
                else:
                    out[i] = (o.observation, prompt_pieces_for(pool, o, tasks[i].env))
            pool.release([o.episode_id for o in outs if not o.done])
        todo = retry
    return out


def _strategy_stage(policy: Policy, pool: EnvPool, builder: PromptBuilder,
                    tasks: Sequence[Task], uids: Sequence[int], key: Any, cfg: RolloutConfig,
                    stops: Sequence[int], stats: LoopStats) -> list[StrategyGroup | None]:
    """Strategy candidates, format check, embeddings and selection for every task."""
    import time

    firsts = _first_observations(pool, tasks)
    n_keep = cfg.num_strategies
    n_cand = cfg.oversample * n_keep if cfg.diverse_sampling else n_keep
    live = [i for i, f in enumerate(firsts) if f is not None]
    groups: list[StrategyGroup | None] = [None] * len(tasks)
    if not live:
        return groups
    prompts = {i: builder.strategy_prompt(firsts[i][1], firsts[i][0]) for i in live}
    rows = [(i, c) for i in live for c in range(n_cand)]
    prefixes, index = dedupe_prefixes([prompts[i] for i, _ in rows])
    keys = row_keys(key, [(PURPOSE_STRATEGY, uids[i], c) for i, c in rows])
    t0 = time.perf_counter()
    gens = policy.generate(prefixes, index, [prompts[i].suffix_ids for i, _ in rows],
                           _sampling(cfg, stops, cfg.max_strategy_tokens,
                                     build_stop_text(builder.tokenizer, STRATEGY_STOP)), keys)
    t1 = time.perf_counter()
    stats.intervals.append(Interval("sampler", -1, t0, t1, len(rows)))
    stats.sampler_s += t1 - t0
    stats.sampler_calls += 1
    gen_list = [gens[r] for r in range(len(rows))]
    texts = [decode_generation(builder.tokenizer, g) for g in gen_list]
    checks = [check_strategy(t, g.finish_reason == FINISH_LENGTH, builder.count_tokens)
              for t, g in zip(texts, gen_list)]
    emb = None
    if cfg.diverse_sampling:
        emb = policy.embed([content_ids(builder.tokenizer, g) for g in gen_list])
    seed = [int(x) for x in base_key_data(key)]
    for j, i in enumerate(live):
        sl = slice(j * n_cand, (j + 1) * n_cand)
        task_emb = emb[sl] if emb is not None else np.zeros((n_cand, 1))
        kept = select_strategies(task_emb, [c.format_fail for c in checks[sl]], n_keep,
                                 diverse=cfg.diverse_sampling,
                                 rng=np.random.default_rng(seed + [uids[i]]))
        groups[i] = StrategyGroup(tasks[i], uids[i], prompts[i], texts[sl], checks[sl],
                                  gen_list[sl], kept, firsts[i][0])
    return groups


def _judge_stage(policy: Policy, builder: PromptBuilder, trajs: Sequence[Trajectory], key: Any,
                 cfg: RolloutConfig, stops: Sequence[int], stats: LoopStats) -> None:
    """One greedy judge call per finished, non-crashed trajectory with steps (in place)."""
    import time

    todo = [tr for tr in trajs if tr.steps and not tr.crashed and tr.pieces is not None]
    if not todo:
        return
    prompts = []
    for tr in todo:
        steps = [HistoryEntry(s.observation, s.action if s.action is not None
                              else invalid_history_action(s.output_text, cfg.invalid_tail_chars))
                 for s in tr.steps]
        prompts.append(builder.judge_prompt(tr.pieces, tr.spec.strategy, steps))
    prefixes, index = dedupe_prefixes(prompts)
    keys = row_keys(key, [(PURPOSE_JUDGE, tr.spec.task_uid, tr.spec.strategy_id,
                           tr.spec.trajectory_id) for tr in todo])
    t0 = time.perf_counter()
    gens = policy.generate(prefixes, index, [p.suffix_ids for p in prompts],
                           _sampling(cfg, stops, cfg.max_judge_tokens,
                                     build_stop_text(builder.tokenizer, JUDGE_STOP), greedy=True),
                           keys)
    t1 = time.perf_counter()
    stats.intervals.append(Interval("sampler", -2, t0, t1, len(todo)))
    stats.sampler_s += t1 - t0
    stats.sampler_calls += 1
    for b, tr in enumerate(todo):
        tr.verdict = decode_generation(builder.tokenizer, gens[b])
        tr.bad_steps = parse_bad_steps(tr.verdict, len(tr.steps))


def _strategy_records(groups: Sequence[StrategyGroup], cfg: RolloutConfig) -> list[dict]:
    recs = []
    n_eps = cfg.num_strategies * cfg.episodes_per_strategy
    for g in groups:
        for sid, c in enumerate(g.kept):
            gen = g.generations[c]
            recs.append(dict(
                prompt_ids=g.prompt.ids, response_ids=gen.token_ids,
                sampler_logprobs=gen.logprobs, task_id=g.task_uid, strategy_id=sid,
                trajectory_id=n_eps + sid, step_index=0, kind=KIND_STRATEGY, anchor_id=0,
                score=0.0, step_reward=0.0, valid=True, strategy_len=g.checks[c].token_len,
                format_fail=g.checks[c].format_fail))
    return recs


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
                  key: Any, cfg: RolloutConfig, task_uid_start: int) -> _Part:
    import time

    t_start = time.perf_counter()
    stops = stop_token_ids(builder.tokenizer)
    uids = list(range(task_uid_start, task_uid_start + len(tasks)))
    pre = LoopStats()
    specs: list[EpisodeSpec] = []
    groups: list[StrategyGroup] = []
    skipped: list[Task] = []
    if cfg.mode == "strata":
        m = cfg.episodes_per_strategy
        for task, g in zip(tasks, _strategy_stage(policy, pool, builder, tasks, uids, key, cfg,
                                                  stops, pre)):
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
                               sampling=_sampling(cfg, stops, cfg.max_action_tokens,
                                                  build_stop_text(builder.tokenizer, ACTION_STOP)),
                               cohorts=cfg.cohorts, invalid_tail_chars=cfg.invalid_tail_chars)
    if cfg.mode == "strata" and cfg.self_judgment:
        _judge_stage(policy, builder, trajs, key, cfg, stops, pre)
    stats = LoopStats(wall_s=time.perf_counter() - t_start, env_wait_s=loop.env_wait_s,
                      sampler_s=loop.sampler_s + pre.sampler_s,
                      sampler_calls=loop.sampler_calls + pre.sampler_calls,
                      intervals=pre.intervals + loop.intervals)
    records = _strategy_records(groups, cfg) + _action_records(trajs)
    return _Part(records, list(trajs), groups, stats, skipped)


def rollout_stats(trajs: Sequence[Trajectory], groups: Sequence[StrategyGroup],
                  loop: LoopStats) -> dict[str, float]:
    """Scalar metrics: episodes, steps, mean_return, success_rate, invalid_step_frac (format
    failures), env_rejected_frac (steps whose action the env refused, `env_rejected`),
    ambiguous_resolved_frac (ScienceWorld commands it resolved to option 0), crashed_episodes, judge_bad_step_frac, strategy_format_fail_frac (of kept strategies),
    candidate_format_fail_frac, mean_strategy_len, and timing: wall_s, sampler_s,
    sampler_calls, env_wait_s, env_wait_frac (fraction of rollout wall time blocked on envs)."""
    steps = [s for tr in trajs for s in tr.steps]
    ok = [tr for tr in trajs if not tr.crashed]
    judged = [tr for tr in trajs if tr.verdict is not None]
    kept = [g.checks[c] for g in groups for c in g.kept]
    cands = [c for g in groups for c in g.checks]
    mean = lambda xs: float(np.mean(xs)) if len(xs) else 0.0  # noqa: E731
    return {
        "rollout/episodes": float(len(trajs)),
        "rollout/steps": float(len(steps)),
        "rollout/mean_return": mean([tr.episode_return for tr in ok]),
        "rollout/success_rate": mean([float(tr.success) for tr in ok]),
        "rollout/mean_episode_steps": mean([len(tr.steps) for tr in trajs]),
        "rollout/invalid_step_frac": mean([float(s.invalid) for s in steps]),
        "rollout/env_rejected_frac": mean([float(env_rejected(s)) for s in steps]),
        "rollout/ambiguous_resolved_frac": mean([float(s.info.get("ambiguous_resolved")
                                                       is not None) for s in steps]),
        "rollout/crashed_episodes": float(sum(tr.crashed for tr in trajs)),
        "rollout/judge_bad_step_frac": mean([len(tr.bad_steps) / len(tr.steps) for tr in judged]),
        "rollout/strategy_format_fail_frac": mean([float(c.format_fail) for c in kept]),
        "rollout/candidate_format_fail_frac": mean([float(c.format_fail) for c in cands]),
        "rollout/mean_strategy_len": mean([c.token_len for c in kept]),
        "time/rollout_wall_s": loop.wall_s,
        "time/sampler_s": loop.sampler_s,
        "time/sampler_calls": float(loop.sampler_calls),
        "time/env_wait_s": loop.env_wait_s,
        "time/env_wait_frac": loop.env_wait_frac,
    }


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
    stats = {**rollout_stats(trajs, groups, loop), **extra}
    return RolloutResult(batch, records, trajs, groups, stats, loop.intervals,
                         [t for p in parts for t in p.skipped])


def collect_rollout(policy: Policy, pool: EnvPool, builder: PromptBuilder,
                    tasks: Sequence[Task], *, key: Any, config: RolloutConfig,
                    task_uid_start: int = 0) -> RolloutResult:
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
    Returns:
      `RolloutResult`.
    Raises:
      RuntimeError when no task produced a sample.
    """
    part = _rollout_part(policy, pool, builder, tasks, key, config, task_uid_start)
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
                 config: RolloutConfig) -> RolloutResult:
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
        part = _rollout_part(policy, pool, builder, tasks, key, config, uid)
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
            config: RolloutConfig) -> RolloutResult:
    """The iteration's rollout: `dapo_rollout` when ``config.dapo_refill``, else
    `collect_rollout` over ``sample_tasks(config.tasks_per_batch)``."""
    if config.dapo_refill:
        return dapo_rollout(policy, pool, builder, sample_tasks, key=key, config=config)
    return collect_rollout(policy, pool, builder, list(sample_tasks(config.tasks_per_batch)),
                           key=key, config=config)
