"""The step loop: episodes of many tasks played on the env pool, decoding overlapped with env
stepping (docs/method.md §2-§3;
docs/design.md §7.2).

Cohorts. The live episodes are split into ``cohorts`` groups that take turns:
a cohort's turn is (1) collect its outstanding env tickets, (2) one batched policy call over
its live episodes (one sampler call per step per cohort), (3) submit the parsed actions to
the pool without waiting (`EnvPool.submit`), (4) start new episodes on free slots
(`submit_reset`). While cohort A's envs step, cohort B decodes, and vice versa. Each cohort
holds at most ceil(max_live_envs / cohorts) episodes; more episodes start as earlier ones end.
``cohorts=0`` (the config default) picks the count from the env (`resolve_cohorts`): 1 when its
steps are instant (nothing to overlap: one decode call per step over every live episode, the
largest batch the sampler can fill), else 2.

Per step: the prompt is rebuilt from the task, the strategy (StraTA), the history window and
the current observation (`PromptBuilder.step_prompt`); the output is parsed with
`envs_bridge.parse_action`; a format-invalid output (or one cut at the token limit) is not
sent to the simulator: the pool gets ``None`` (the env counts the step, returns the same
observation, reward 0) and the next prompt shows a short notice. With strategy revision on
(`run_episodes(reviser=...)`, docs/method.md §5.9) the cohort's turn first lets the reviser
write new plans for the episodes whose trigger fires (one more batched policy call); the step
prompts then carry each episode's plan in force (`Trajectory.strategy`).

Keys: step t of episode (task_uid, strategy_id, trajectory_id) samples with
``row_keys(key, (PURPOSE_ACTION, task_uid, strategy_id, trajectory_id, t))``, independent of
the cohort, batch row or host.

Stop: the action sampling params carry the stop string ``("</think>", "<action>", "</action>")``
(`action_stop_text`), so a row's generation ends on the token that completes the first action
block after the closed think block, the block the parser executes; nothing the model would have
written after it (a fabricated "Observation: ...", a second action) is generated or trained, and
a complete action is valid however long the rest would have been.

Timing: every policy call and every env ticket is recorded as an `Interval` (env tickets from
submit to the moment their last request finished, via future callbacks); `LoopStats` gives
the wall time and the fraction of it the loop spent blocked in `EnvPool.collect`.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import threading
import time
from typing import Any, Callable, Sequence


from envs_bridge.base import PromptPieces
from envs_bridge.parsing import parse_action
from envs_bridge.pool import EnvPool, StepOutcome, Ticket
from strata_jax.models import stop_token_ids
from strata_jax.rollout.keys import PURPOSE_ACTION, row_keys
from strata_jax.rollout.policy import Policy
from strata_jax.rollout.prompts import (ACTION_STOP, HistoryEntry, PromptBuilder, PromptIds,
                                        invalid_history_action)
from strata_jax.rollout.records import EpisodeSpec, Interval, LoopStats, StepRecord, Trajectory
from strata_jax.sampling import FINISH_STOP, Generation, SamplingParams


def anchor_hash(observation: str) -> int:
    """GiGPO anchor id of a raw observation: the first 31 bits of its blake2b digest (>= 0,
    so it never collides with the PAD_ROW_ID -1 of padding rows). Same on every host."""
    digest = hashlib.blake2b(observation.encode("utf-8"), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def content_ids(tokenizer: Any, gen: Generation) -> list[int]:
    """A generation's ids without its final stop id (<|im_end|> / <|endoftext|>), if it ended on
    one. A row stopped by a stop string (`SamplingParams.stop_text`) ends on an ordinary text
    token (the one completing ``</action>``), which is kept."""
    ids = [int(i) for i in gen.token_ids]
    if gen.finish_reason == FINISH_STOP and ids and ids[-1] in stop_token_ids(tokenizer):
        ids = ids[:-1]
    return ids


def action_stop_text(tokenizer: Any) -> Any:
    """The action stop string (`ACTION_STOP`) compiled for `tokenizer` (cached)."""
    from strata_jax.sampling.stops import build_stop_text
    return build_stop_text(tokenizer, ACTION_STOP)


def decode_generation(tokenizer: Any, gen: Generation) -> str:
    """Text of a generation without its stop id (the ids themselves are kept as they are).

    Special ids the model emitted elsewhere decode to their strings (``<|im_start|>``); the
    prompt builder spells such text with plain tokens when it re-enters a prompt."""
    return tokenizer.decode(content_ids(tokenizer, gen))


def prompt_pieces_for(outcome: StepOutcome, fallback_env: str) -> PromptPieces:
    """The env's prompt pieces after a reset / step: ``outcome.pieces`` (read by the pool in
    the same env call, on either backend); for an outcome without them (a crash, a pool
    double) the info dict's task_description and admissible_actions, no templates, with
    `fallback_env` as the role name."""
    if outcome.pieces is not None:
        return outcome.pieces
    adm = outcome.info.get("admissible_actions")
    return PromptPieces(fallback_env, str(outcome.info.get("task_description", "")),
                        (), tuple(adm) if adm is not None else None)


@dataclasses.dataclass
class _Cohort:
    live: list[int] = dataclasses.field(default_factory=list)
    step_ticket: Ticket | None = None
    step_rows: list[int] = dataclasses.field(default_factory=list)
    reset_ticket: Ticket | None = None
    reset_rows: list[int] = dataclasses.field(default_factory=list)


def resolve_cohorts(cohorts: int, env_name: str) -> int:
    """The cohort count a rollout runs with: `cohorts` when >= 1; for 0 (auto) 1 if the env
    class registered as `env_name` declares ``instant_steps`` (a pure-Python simulator: a
    second cohort would only halve the decode batch), else 2 (decode one half while the other
    half's simulators step). Depends on the env class only, never on timing, so the rows that
    share a decode call, and with them the results, are the same in every run.

    Raises ValueError for a negative count, KeyError for an unregistered env name."""
    from envs_bridge.registry import get_env_factory
    if int(cohorts) < 0:
        raise ValueError(f"rollout.cohorts must be >= 0 (0 = auto), got {cohorts}")
    if int(cohorts) >= 1:
        return int(cohorts)
    return 1 if getattr(get_env_factory(env_name), "instant_steps", False) else 2


class _Loop:
    def __init__(self, policy: Policy, pool: EnvPool, builder: PromptBuilder,
                 specs: Sequence[EpisodeSpec], key: Any, sampling: SamplingParams,
                 cohorts: int, invalid_tail_chars: int, reviser: Any,
                 max_steps: int | None = None) -> None:
        self.policy, self.pool, self.builder, self.reviser = policy, pool, builder, reviser
        self.max_steps = max_steps
        self.key, self.sampling = key, sampling
        self.trajs = [Trajectory(s) for s in specs]
        self.n_cohorts = resolve_cohorts(cohorts, pool.env_name)
        self.cap = max(1, math.ceil(pool.max_live_envs / self.n_cohorts))
        self.tail = invalid_tail_chars
        self.stats = LoopStats()
        self._lock = threading.Lock()

    # -- timing helpers
    def _track(self, ticket: Ticket, kind: str, cohort: int) -> None:
        iv = Interval(kind, cohort, ticket.submitted_at, ticket.submitted_at, len(ticket.episode_ids))
        self.stats.intervals.append(iv)

        def done(_f: Any) -> None:
            now = time.perf_counter()
            with self._lock:
                iv.end = max(iv.end, now)

        for f in ticket.futures:
            f.add_done_callback(done)

    def _collect(self, ticket: Ticket) -> list[StepOutcome]:
        t0 = time.perf_counter()
        outs = self.pool.collect(ticket)
        self.stats.env_wait_s += time.perf_counter() - t0
        return outs

    # -- turn pieces
    def _on_reset(self, c: _Cohort) -> None:
        outs = self._collect(c.reset_ticket)
        for i, out in zip(c.reset_rows, outs):
            tr = self.trajs[i]
            tr.episode_id = out.episode_id
            tr.observations.append(out.observation)
            tr.family = str(out.info.get("family", "") or "")
            if out.crashed or out.done:
                tr.done, tr.crashed, tr.error = True, out.crashed, out.error
                continue
            tr.pieces = tr.current_pieces = prompt_pieces_for(out, tr.spec.task.env)
            c.live.append(i)
        c.reset_ticket, c.reset_rows = None, []

    def _on_step(self, c: _Cohort) -> None:
        outs = self._collect(c.step_ticket)
        for i, out in zip(c.step_rows, outs):
            tr = self.trajs[i]
            step = tr.steps[-1]
            step.reward, step.info = float(out.reward), dict(out.info)
            tr.observations.append(out.observation)
            tr.history.append(HistoryEntry(
                step.observation, step.action if step.action is not None
                else invalid_history_action(step.output_text, self.tail)))
            if out.crashed:
                tr.crashed, tr.error = True, out.error
            if out.done:
                tr.done = True
                tr.success = bool(out.info.get("success", False)) and not out.crashed
                c.live.remove(i)
            elif self.max_steps is not None and len(tr.steps) >= self.max_steps:
                c.live.remove(i)   # a probe cut short: done stays False, its slot is freed
                self.pool.release([tr.episode_id])
            else:
                tr.current_pieces = prompt_pieces_for(out, tr.current_pieces.environment)
        c.step_ticket, c.step_rows = None, []

    def _decode_and_submit(self, c: _Cohort, ci: int) -> None:
        rows = list(c.live)
        if self.reviser is not None:
            self.reviser(self.policy, [self.trajs[i] for i in rows], self.stats, ci)
        prompts, ids = [], []
        for i in rows:
            tr = self.trajs[i]
            last_invalid = bool(tr.steps) and tr.steps[-1].invalid
            prompts.append(self.builder.step_prompt(tr.current_pieces, tr.observations[-1],
                                                    tr.history, tr.strategy, last_invalid))
            s = tr.spec
            ids.append((PURPOSE_ACTION, s.task_uid, s.strategy_id, s.trajectory_id, len(tr.steps)))
        gens = generate_timed(self.policy, prompts, row_keys(self.key, ids), self.sampling,
                              self.stats, ci)
        actions: list[str | None] = []
        for b, i in enumerate(rows):
            tr = self.trajs[i]
            gen = gens[b]
            text = decode_generation(self.builder.tokenizer, gen)
            parsed = parse_action(text)
            invalid = (not parsed.valid) or gen.finish_reason != FINISH_STOP
            action = None if invalid else parsed.action
            tr.steps.append(StepRecord(prompts[b], gen, text, action, invalid, tr.observations[-1]))
            actions.append(action)
        c.step_ticket = self.pool.submit([self.trajs[i].episode_id for i in rows], actions)
        c.step_rows = rows
        self._track(c.step_ticket, "env", ci)

    def _admit(self, c: _Cohort, ci: int, pending: collections.deque) -> None:
        room = min(self.pool.num_free, self.cap - len(c.live) - len(c.reset_rows))
        if not pending or room <= 0 or c.reset_ticket is not None:
            return
        rows = [pending.popleft() for _ in range(min(room, len(pending)))]
        c.reset_ticket = self.pool.submit_reset([self.trajs[i].spec.task for i in rows])
        c.reset_rows = rows
        self._track(c.reset_ticket, "reset", ci)

    def run(self) -> tuple[list[Trajectory], LoopStats]:
        t_start = time.perf_counter()
        pending = collections.deque(range(len(self.trajs)))
        cohorts = [_Cohort() for _ in range(self.n_cohorts)]
        while True:
            busy = False
            for ci, c in enumerate(cohorts):
                if c.step_ticket is not None:
                    self._on_step(c)
                if c.reset_ticket is not None:
                    self._on_reset(c)
                if c.live:
                    self._decode_and_submit(c, ci)
                self._admit(c, ci, pending)
                busy |= bool(c.live or c.step_ticket or c.reset_ticket)
            if not busy and not pending:
                break
            if not busy and self.pool.num_free == 0:
                raise RuntimeError("env pool has no free slot and no episode of this rollout is "
                                   "live: release or finish the pool's other episodes first")
        self.stats.wall_s = time.perf_counter() - t_start
        return self.trajs, self.stats


def dedupe_prefixes(prompts: Sequence[PromptIds]) -> tuple[list[tuple[int, ...]], list[int]]:
    """Unique prefixes (first-seen order) and each prompt's index into them."""
    table: dict[tuple[int, ...], int] = {}
    index = []
    for p in prompts:
        index.append(table.setdefault(p.prefix_ids, len(table)))
    return list(table), index


def generate_timed(policy: Policy, prompts: Sequence[PromptIds], keys: Any,
                   sampling: SamplingParams, stats: LoopStats, cohort: int) -> Any:
    """One batched policy call over `prompts` (shared prefixes deduplicated), timed into
    `stats`: an `Interval("sampler", cohort, ...)`, ``sampler_s`` and ``sampler_calls``.

    Args:
      policy: a `Policy`. prompts: one `PromptIds` per row. keys: the rows' keys
        (`row_keys`, [B] typed or [B, 2] uint32). sampling: the stage's `SamplingParams`.
      stats: the `LoopStats` to add to. cohort: the interval's label (a cohort index >= 0,
        or -1 for the strategy stage and -2 for the judge stage).
    Returns:
      the policy's generations, row-indexable (``gens[b]`` is row b's `Generation`).
    """
    prefixes, index = dedupe_prefixes(prompts)
    t0 = time.perf_counter()
    gens = policy.generate(prefixes, index, [p.suffix_ids for p in prompts], sampling, keys)
    t1 = time.perf_counter()
    stats.intervals.append(Interval("sampler", cohort, t0, t1, len(prompts)))
    stats.sampler_s += t1 - t0
    stats.sampler_calls += 1
    return gens


Reviser = Callable[[Policy, Sequence[Trajectory], LoopStats, int], None]
"""The strategy-revision hook of the step loop (`revision.StrategyReviser`): called once per
cohort turn, before the step prompts are built, with (policy, the cohort's live episodes,
stats, cohort index); it appends a `Revision` to each episode that revises now (its
`Trajectory.strategy` changes) and times its policy call into the stats."""


def run_episodes(policy: Policy, pool: EnvPool, builder: PromptBuilder,
                 specs: Sequence[EpisodeSpec], *, key: Any, sampling: SamplingParams,
                 cohorts: int = 0, invalid_tail_chars: int = 30,
                 reviser: Reviser | None = None,
                 max_steps: int | None = None) -> tuple[list[Trajectory], LoopStats]:
    """Play every episode to the end (done, step limit or crash).

    Args:
      policy: a `Policy`. pool: an `EnvPool` for the specs' env (its slots should be free).
      builder: the `PromptBuilder` (history window, budget; history_length=None = cumulative).
      specs: the episodes, in a fixed order (task-major); they start in this order.
      key: the iteration's base PRNG key (see `keys.row_keys`).
      sampling: action sampling params (max_new_tokens = max action tokens, stop ids set).
      cohorts: cohorts alternating between the policy and the pool (1 = no overlap; 0 = auto,
        `resolve_cohorts`).
      invalid_tail_chars: chars of an invalid output shown in the history.
      reviser: the strategy-revision hook (None = no revision: the paper setting).
      max_steps: stop each episode after this many steps even if the env is not done (a
        probe, `strata_jax.evaluation.scaling`): its env is released and ``done`` stays
        False. None = play to the end.
    Returns:
      (trajectories in spec order, `LoopStats`).
    Raises:
      RuntimeError when the pool has no free slot for any episode.
    """
    if max_steps is not None and max_steps < 1:
        raise ValueError(f"max_steps must be >= 1 (None = play to the end), got {max_steps}")
    return _Loop(policy, pool, builder, specs, key, sampling, cohorts, invalid_tail_chars,
                 reviser, max_steps).run()
