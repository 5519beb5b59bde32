"""Test-time strategy scaling for eval.py: S candidates per task, a chooser, one played outcome.

An option of the eval protocol, off by default (``eval.strategy_samples = 1`` is the protocol of
docs/method.md §10, unchanged); docs/method.md §10.1 describes it:

1. Candidates. StraTA: the strategy stage of training (`strategy.strategy_stage`: sigma*S
   candidates at the eval temperature, format check, farthest-point selection of S, as
   ``rollout.oversample`` / ``rollout.diverse_sampling`` say). Flat baselines write no
   strategy: their S candidates are S independent episodes of the task.
2. Probes. One episode per candidate, cut after ``eval.probe_steps`` steps (0 = played to
   the end). Candidate s is the episode (task_uid, strategy_id, trajectory_id) = (u, s, s)
   (StraTA) or (u, 0, s) (flat), so its action keys are those of a one-episode eval of that
   strategy.
3. Choice (``eval.strategy_choice``), ties to the lowest candidate:
   * "judge": the self-judgment prompt (docs/method.md §5.4; ``rollout.judge_model`` when
     set) over each probe; score = 1 - |bad steps| / steps. A crashed or step-less probe
     scores -inf.
   * "critic": the checkpoint's critic V(h_t) (PPO's separate critic or STAPO's value head,
     `strata_jax.training.critic`) at the last step of the probe: the state value of where
     the probe got to, an estimate of the episode's return. A checkpoint without a critic
     is a ConfigError.
   * "first_action": majority vote over the probes' first actions (format-invalid first
     steps do not vote); the lowest candidate whose first action is the most frequent one
     (between equally frequent actions, the one a lower candidate took).
4. Outcome. Full-episode probes: the chosen probe is the task's episode. Short probes: the
   chosen candidate's episode is played from the start to the end with the same keys, so with
   a deterministic env and policy its first steps repeat the probe.

Cost (per task, reported per family): sampled tokens = every generated token (strategy
candidates, probe actions, judge verdicts, the final episode's actions); env steps = probe
steps + the final episode's steps. The critic's forward passes sample nothing and are not
counted. The one-strategy protocol reports the same two figures (`cost_metrics`).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import numpy as np

from strata_jax.config import read_fields, section_sources
from strata_jax.rollout.episodes import run_episodes
from strata_jax.rollout.records import EpisodeSpec, LoopStats, Trajectory
from strata_jax.rollout.judge import JudgeModel, judge_stage
from strata_jax.rollout.report import dump_trajectories
from strata_jax.rollout.strategy import StrategyGroup, strategy_stage

CHOICES = ("judge", "critic", "first_action")

CriticFn = Callable[[Sequence[tuple[Sequence[int], Sequence[int]]]], np.ndarray]
"""(prompt ids, response ids) rows -> [n] float32 values V(h_t) (`CriticScorer`)."""


@dataclasses.dataclass(frozen=True)
class TestTimeConfig:
    """The eval's test-time scaling settings (``c.eval``).

    Attributes:
      strategy_samples: S candidates per task (1 = the one-strategy protocol, nothing else runs).
      strategy_choice: "judge" | "critic" | "first_action" (see the module docstring).
      probe_steps: steps of each probe episode (0 = full episodes).
    Raises ValueError on S < 1, probe_steps < 0 or an unknown choice.
    """

    __test__ = False   # not a pytest class

    strategy_samples: int = 1
    strategy_choice: str = "judge"
    probe_steps: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.strategy_samples, bool) or int(self.strategy_samples) < 1:
            raise ValueError(f"eval.strategy_samples must be an integer >= 1 (1 = one strategy "
                             f"per task), got {self.strategy_samples!r}")
        if isinstance(self.probe_steps, bool) or int(self.probe_steps) < 0:
            raise ValueError(f"eval.probe_steps must be an integer >= 0 (0 = full episodes), "
                             f"got {self.probe_steps!r}")
        if self.strategy_choice not in CHOICES:
            raise ValueError(f"eval.strategy_choice must be one of {CHOICES}, got "
                             f"{self.strategy_choice!r}")

    @property
    def enabled(self) -> bool:
        """True when S > 1 (otherwise the eval is the one-strategy protocol)."""
        return self.strategy_samples > 1

    @classmethod
    def config_sources(cls) -> dict[str, str]:
        """{field: dotted config key}: every field is ``eval.<field>``."""
        return section_sources(cls, "eval")

    @classmethod
    def from_config(cls, c: Any) -> "TestTimeConfig":
        """From the experiment ConfigDict (configs/base.py ``eval.*``), every field read; a
        missing key is a ConfigError."""
        return cls(**read_fields(cls, c, cls.config_sources()))


# ----------------------------------------------------------------------------- choosers


def judge_scores(probes: Sequence[Trajectory]) -> list[float]:
    """1 - |bad steps| / steps per judged probe; -inf for a crashed, unjudged or empty one."""
    out = []
    for tr in probes:
        ok = tr.steps and not tr.crashed and tr.verdict is not None
        out.append(1.0 - len(tr.bad_steps) / len(tr.steps) if ok else -math.inf)
    return out


def critic_scores(probes: Sequence[Trajectory], critic: CriticFn) -> list[float]:
    """V(h_t) at each probe's last step (its prompt and generated ids, as the trainer scores
    an action row); -inf for a crashed or step-less probe."""
    rows, where = [], []
    for i, tr in enumerate(probes):
        if tr.steps and not tr.crashed:
            last = tr.steps[-1]
            rows.append((last.prompt.ids, [int(t) for t in last.generation.token_ids]))
            where.append(i)
    out = [-math.inf] * len(probes)
    if rows:
        values = np.asarray(critic(rows), np.float64)
        if values.shape != (len(rows),):
            raise ValueError(f"the critic returned shape {values.shape} for {len(rows)} rows")
        for i, v in zip(where, values):
            out[i] = float(v)
    return out


def first_action_votes(probes: Sequence[Trajectory]) -> list[float]:
    """Per probe: how many probes took the same first action (0 for a probe whose first step
    was format-invalid or that has no step). Its argmax (lowest index on ties) is the
    majority choice, and among equally frequent actions the one a lower candidate took."""
    firsts = [tr.steps[0].action if tr.steps else None for tr in probes]
    counts = collections.Counter(a for a in firsts if a is not None)
    return [float(counts[a]) if a is not None else 0.0 for a in firsts]


def choose(scores: Sequence[float]) -> int:
    """Index of the highest score, the lowest index among equal ones (0 when all are -inf)."""
    best = 0
    for i, s in enumerate(scores):
        if s > scores[best]:
            best = i
    return best


# ----------------------------------------------------------------------------- critic


class CriticScorer:
    """V(h_t) of (prompt, response) rows with a trained critic (`strata_jax.training.critic`).

    h_t = the trunk's final hidden state at the last response token, as the trainer reads it
    (`training.scoring.response_states`; `training.per_row.score_batch` gives the same values
    without dropout). Rows are left-padded (prompts) / right-padded (responses) to
    power-of-two buckets and run `rows_per_call` at a time.

    Args:
      model: the trunk's `Qwen2Config`. trunk: its params (STAPO: the policy's own; PPO: the
        critic's trunk, LoRA adapters already applied). head: {"w": [D], "b": []}.
      compute_dtype: the trainer's (``train.compute_dtype``). rows_per_call: batch rows.
    Returns (call): [n] float32.
    """

    def __init__(self, model: Any, trunk: Any, head: Any, compute_dtype: str = "float32",
                 rows_per_call: int = 8, length_floor: int = 64) -> None:
        self.model, self.trunk, self.head = model, trunk, head
        self.compute_dtype = compute_dtype
        self.rows_per_call, self.length_floor = int(rows_per_call), int(length_floor)

    def __call__(self, rows: Sequence[tuple[Sequence[int], Sequence[int]]]) -> np.ndarray:
        import jax.numpy as jnp

        from strata_jax.sampling import bucket
        out = np.zeros((len(rows),), np.float32)
        for start in range(0, len(rows), self.rows_per_call):
            chunk = rows[start:start + self.rows_per_call]
            tp = bucket(max(len(p) for p, _ in chunk), self.length_floor)
            tr = bucket(max(max(len(r) for _, r in chunk), 1), 16)
            b = self.rows_per_call
            pi, pm = np.zeros((b, tp), np.int32), np.zeros((b, tp), bool)
            ri, rm = np.zeros((b, tr), np.int32), np.zeros((b, tr), bool)
            for j, (p, r) in enumerate(chunk):
                pi[j, tp - len(p):], pm[j, tp - len(p):] = p, True
                ri[j, :len(r)], rm[j, :len(r)] = r, True
            for j in range(len(chunk), b):   # padding rows: one token, never read
                pm[j, -1] = True
            v = _values(self.trunk, self.head, jnp.asarray(pi), jnp.asarray(pm), jnp.asarray(ri),
                        jnp.asarray(rm), model=self.model, compute_dtype=self.compute_dtype)
            out[start:start + len(chunk)] = np.asarray(v)[:len(chunk)]
        return out


@functools.lru_cache(maxsize=None)
def _values_fn():
    import jax

    from strata_jax.training.critic import value_from_hidden
    from strata_jax.training.scoring import response_states

    def f(trunk, head, pi, pm, ri, rm, *, model, compute_dtype):
        _, last = response_states(trunk, model, pi, pm, ri, rm, compute_dtype=compute_dtype)
        return value_from_hidden(head, last)

    return jax.jit(f, static_argnames=("model", "compute_dtype"))


def _values(*args, **kw):
    return _values_fn()(*args, **kw)


def critic_scorer(trainer: Any, state: Any, base: Any = None) -> CriticScorer:
    """The `CriticScorer` of a restored run: `trainer` (`training.Trainer`), its `state`
    (`TrainState`) and, with LoRA, the frozen `base` params.

    Raises ValueError when the state has no critic (``train.critic`` resolved to "none":
    every algo but ppo / stapo unless set), saying what to use instead."""
    from strata_jax.training.steps import effective_params
    cfg = trainer.cfg
    if cfg.critic_kind == "none" or not state.critic_params:
        raise ValueError(f"eval.strategy_choice=critic needs a critic, and this run has none "
                         f"(algo {cfg.algo!r}, train.critic {cfg.critic!r} -> none): evaluate a "
                         f"ppo / stapo run, or use strategy_choice=judge or first_action")
    if cfg.critic_kind == "head":
        trunk = effective_params(state.params, base, cfg)
    else:
        trunk = effective_params(state.critic_params["trunk"], base, cfg)
    return CriticScorer(trainer.model, trunk, state.critic_params["head"], cfg.compute_dtype)


# ----------------------------------------------------------------------------- cost


# ----------------------------------------------------------------------------- the eval


def evaluate_scaled(c: Any, policy: Any, pool: Any, builder: Any, tasks: Sequence[Any], key: Any,
                    *, critic: CriticFn | None = None, judge: JudgeModel | None = None,
                    batch_tasks: int = 16) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The eval with test-time strategy scaling (module docstring; ``c.eval.strategy_samples``
    > 1). Same contract as `strata_jax.evaluation.evaluate`.

    Args:
      c: the experiment ConfigDict. policy / pool / builder: as for `evaluate`.
      tasks: the eval's tasks (one outcome each). key: the eval's base key.
      critic: the value function for strategy_choice="critic" (`critic_scorer`).
      judge: a separate judge (`build_judge_model`); None = the policy judges its probes.
      batch_tasks: tasks per chunk (S probes each).
    Returns:
      (metrics, records). Metrics: `summarize`'s over the chosen outcomes, the rollout
      fractions of those episodes (eval/invalid_step_frac, ...), `cost_metrics`, and
      eval/tts/strategy_samples, eval/tts/probe_steps, eval/tts/probe_success (mean success of
      all probes; full-episode probes only) and eval/tts/oracle_success (a task counts when
      any of its full-episode probes succeeded). Records: `dump_trajectories` of the
      outcomes, each with "test_time": choice, chosen (candidate index), scores, probe
      returns / steps / first actions.
    Raises:
      ValueError: strategy_choice="critic" without a critic, or a bad eval.* setting.
    """
    from strata_jax.evaluation.protocol import (family_of, cost_metrics, episode_stats, episode_tokens,
                                       eval_rollout_config, summarize)
    from strata_jax.models import stop_token_ids
    from strata_jax.rollout.prompts import ACTION_STOP, JUDGE_STOP, STRATEGY_STOP
    from strata_jax.rollout.rollout import stage_sampling
    from strata_jax.sampling.stops import build_stop_text

    tt = TestTimeConfig.from_config(c)
    if tt.strategy_choice == "critic" and critic is None:
        raise ValueError("eval.strategy_choice=critic needs the checkpoint's critic; use "
                         "judge or first_action for a run without one")
    rc = eval_rollout_config(c)
    s_count, tok = tt.strategy_samples, builder.tokenizer
    stops = stop_token_ids(tok)
    act_sampling = stage_sampling(rc, stops, rc.max_action_tokens,
                                  build_stop_text(tok, ACTION_STOP))
    strat_sampling = stage_sampling(rc, stops, rc.max_strategy_tokens,
                                    build_stop_text(tok, STRATEGY_STOP))
    j_policy, j_builder = (judge.policy, judge.builder) if judge else (policy, builder)
    judge_sampling = stage_sampling(rc, stop_token_ids(j_builder.tokenizer),
                                    rc.max_judge_tokens,
                                    build_stop_text(j_builder.tokenizer, JUDGE_STOP), greedy=True)
    probe_cap = tt.probe_steps or None
    finals: list[Trajectory] = []
    groups: list[StrategyGroup] = []
    costs: list[tuple[str, float, float]] = []
    extras: list[dict[str, Any]] = []
    probe_ok: list[float] = []
    oracle: list[float] = []
    loop = LoopStats()
    for start in range(0, len(tasks), batch_tasks):
        chunk = list(tasks[start:start + batch_tasks])
        uids = list(range(start, start + len(chunk)))
        strat_tokens: dict[int, int] = {}
        specs: list[EpisodeSpec] = []
        if rc.mode == "strata":
            for g in strategy_stage(policy, pool, builder, chunk, uids, key, num_keep=s_count,
                                    oversample=int(c.rollout.oversample),
                                    diverse=bool(c.rollout.diverse_sampling),
                                    sampling=strat_sampling, stats=loop,
                                    embedding=rc.strategy_embedding):
                if g is None:
                    continue
                groups.append(g)
                strat_tokens[g.task_uid] = sum(int(gen.length) for gen in g.generations)
                specs += [EpisodeSpec(g.task, g.task_uid, s, s, g.checks[cand].text)
                          for s, cand in enumerate(g.kept)]
        else:
            specs = [EpisodeSpec(t, u, 0, s, None) for t, u in zip(chunk, uids)
                     for s in range(s_count)]
        probes, st = run_episodes(policy, pool, builder, specs, key=key, sampling=act_sampling,
                                  cohorts=rc.cohorts, invalid_tail_chars=rc.invalid_tail_chars,
                                  max_steps=probe_cap)
        loop.sampler_calls += st.sampler_calls
        if tt.strategy_choice == "judge":
            judge_stage(j_policy, j_builder, probes, key, sampling=judge_sampling,
                        invalid_tail_chars=rc.invalid_tail_chars, stats=loop)
        by_task: dict[int, list[Trajectory]] = {}
        for tr in probes:
            by_task.setdefault(tr.spec.task_uid, []).append(tr)
        chosen: dict[int, Trajectory] = {}
        for u, ps in by_task.items():
            if tt.strategy_choice == "judge":
                scores = judge_scores(ps)
            elif tt.strategy_choice == "critic":
                scores = critic_scores(ps, critic)
            else:
                scores = first_action_votes(ps)
            pick = choose(scores)
            chosen[u] = ps[pick]
            extras.append(dict(task_uid=u, choice=tt.strategy_choice, chosen=pick,
                               scores=[float(x) for x in scores],
                               probe_returns=[t.episode_return for t in ps],
                               probe_steps=[len(t.steps) for t in ps],
                               probe_first_actions=[t.steps[0].action if t.steps else None
                                                    for t in ps]))
            if probe_cap is None:
                probe_ok += [float(t.success and not t.crashed) for t in ps]
                oracle.append(float(any(t.success and not t.crashed for t in ps)))
        if probe_cap is None:
            outcome = {u: chosen[u] for u in chosen}
        else:   # the chosen candidates' episodes, from the start, with the probes' keys
            played, st = run_episodes(policy, pool, builder, [chosen[u].spec for u in chosen],
                                      key=key, sampling=act_sampling, cohorts=rc.cohorts,
                                      invalid_tail_chars=rc.invalid_tail_chars)
            loop.sampler_calls += st.sampler_calls
            outcome = {tr.spec.task_uid: tr for tr in played}
        for u, ps in by_task.items():
            fin = outcome[u]
            extra_tok = episode_tokens(fin) if probe_cap is not None else 0
            extra_steps = len(fin.steps) if probe_cap is not None else 0
            costs.append((family_of(fin),
                          float(strat_tokens.get(u, 0) + sum(episode_tokens(t) for t in ps)
                                + extra_tok),
                          float(sum(len(t.steps) for t in ps) + extra_steps)))
            finals.append(fin)
    stats = episode_stats(finals, groups, loop, rc)
    metrics = {**summarize(finals, c.env.name), **stats, **cost_metrics(costs),
               "eval/tts/strategy_samples": float(s_count),
               "eval/tts/probe_steps": float(tt.probe_steps)}
    if probe_cap is None and probe_ok:
        metrics["eval/tts/probe_success"] = float(np.mean(probe_ok))
        metrics["eval/tts/oracle_success"] = float(np.mean(oracle))
    records = dump_trajectories(finals, groups)
    by_uid = {e["task_uid"]: e for e in extras}
    for rec in records:
        rec["test_time"] = {k: v for k, v in by_uid[rec["task_uid"]].items() if k != "task_uid"}
    return metrics, records
