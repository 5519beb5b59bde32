"""Parallel env pool: steps many episodes between decode calls (docs/design.md §8.3;
the cohort overlap: docs/design.md §7.2).

Model
-----
The pool owns `max_live_envs` slots; each slot holds one live env (one ScienceWorld JVM,
one ALFWorld game, one HTTP env). An *episode* is a task played on a slot. Episodes are
started with `submit_reset(tasks)` (M copies of one task = a group-synchronised reset:
every copy starts from the identical state, and the call returns when all are reset) and
stepped with `submit(episode_ids, actions)`. Both return a `Ticket` at once; `collect(ticket)`
blocks until that cohort's outcomes are in. So the rollout can decode cohort B while
cohort A's envs step. `reset` / `step` are the blocking forms. A finished (done or crashed)
episode frees its slot, so any number of tasks can be played in waves of `max_live_envs`
(the rollout's step loop does; a paper-scale iteration has 512 episodes; one ScienceWorld JVM takes
~210-240 MB resident on short tasks with the default 384 MB heap cap (at most ~450 MB
when a task fills the heap), ~660 MB uncapped, so 512 live JVMs would not fit: bound the
slots by free memory / ~0.45 GB).

Threads vs processes (ScienceWorld; compare them with benchmarks/envs.py)
------------------------------------------------------------------------
`backend="thread"` (default): envs live in this process and are stepped by a thread pool.
ScienceWorld's work happens in its JVM (py4j releases the GIL while waiting on the socket),
ALFWorld steps are milliseconds of Python, WebShop is HTTP I/O: threads give the same
parallelism as processes without pickling, without a second Python interpreter per env
(~80-100 MB each) and with direct access to the env objects. `backend="process"`: one
spawned worker process per slot, talking over a pipe; it isolates envs whose Python side
holds the GIL for long (pure-Python simulators) or leaks memory, and a hung step is ended
by killing the worker. Both backends have the same API and give identical transcripts, and
every reset / step outcome carries the env's `PromptPieces` read in the same env call (in
the worker for processes), so prompts never depend on the backend.
The JVMs do the work, so neither backend scales past about one worker per core and the two
step at the same rate (benchmarks/envs.py; benchmarks/results/envs/README.md); threads win
on memory and simplicity, hence the default.

Failures
--------
A step or reset that raises (a killed JVM, a dead server) or exceeds `step_timeout_s`
marks that episode `crashed` (outcome.done = True, outcome.crashed = True; docs/method.md
§1.2: the episode is kept for logging but masked out of the loss); the slot's env is
closed and a fresh one is started in the background (stats["restarts"]), while the other
episodes continue. Bad input (an unknown task: ValueError / KeyError) is re-raised.
Every crash is logged once, as ONE warning line (env, task, reset/step, the error's first line);
the counters crashes / timeouts / restarts / retries (resets re-submitted by the rollout,
`note_retries`) are in `stats()` and logged per iteration as rollout/env_* metrics.
`close()` cancels restarts not yet begun and waits for running ones before closing the envs,
so no simulator (JVM) outlives the pool.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import itertools
import logging
import threading
import time
from typing import Any, Sequence

from envs_bridge.base import Env, PromptPieces, Task
from envs_bridge.slots import USER_ERRORS, PoolClosedError, ProcessSlot, ThreadSlot

__all__ = ["EnvPool", "StepOutcome", "Ticket", "PoolClosedError", "pool_metrics",
           "POOL_COUNTERS"]
log = logging.getLogger(__name__)


@dataclasses.dataclass
class StepOutcome:
    """Result of one reset or step of one episode.

    Attributes:
      episode_id: pool-wide episode id.
      observation: env observation text ("" when crashed).
      reward: step reward (0.0 on reset and crash).
      done: episode over (success, failure, step limit, or crash).
      info: env info dict (see envs_bridge.base).
      crashed: the env failed (exception or timeout); the episode is over.
      error: the failure message when crashed.
      pieces: the env's `prompt_pieces()` right after this reset / step, read in the same
        call on the slot (thread and process backends alike); None when crashed.
    """

    episode_id: int
    observation: str
    reward: float
    done: bool
    info: dict[str, Any]
    crashed: bool = False
    error: str = ""
    pieces: PromptPieces | None = None


@dataclasses.dataclass
class Ticket:
    """Handle of a submitted cohort (see EnvPool.submit / collect)."""

    ident: int
    episode_ids: list[int]
    futures: list[cf.Future]
    submitted_at: float
    timeout_s: float
    kind: str  # "reset" | "step"


# --------------------------------------------------------------------------- pool


@dataclasses.dataclass
class _Episode:
    episode_id: int
    task: Task
    slot: int
    done: bool = False
    pending: bool = False


class EnvPool:
    """Bounded pool of live envs stepped in parallel (see the module docstring).

    Args:
      env_name: registry name of the env (see envs_bridge.registry).
      env_kwargs: keyword arguments for the env constructor (picklable for processes).
      max_live_envs: number of slots = live envs at most (episodes run in waves).
      num_workers: threads stepping envs (default = max_live_envs). With the process
        backend every slot steps in its own process; the threads only wait on pipes.
      backend: "thread" (default) or "process".
      step_timeout_s: per-step limit (seconds); a step over it crashes its episode.
      reset_timeout_s: limit for a reset, which may include starting the env (a JVM: ~1-3 s).
    Raises:
      ValueError on a bad backend or sizes; KeyError on an unknown env name.
    """

    def __init__(self, env_name: str, env_kwargs: dict[str, Any] | None = None, *, max_live_envs: int = 8,
                 num_workers: int | None = None, backend: str = "thread", step_timeout_s: float = 60.0,
                 reset_timeout_s: float = 180.0) -> None:
        from envs_bridge.registry import get_env_factory

        if backend not in ("thread", "process"):
            raise ValueError(f"backend must be 'thread' or 'process', got {backend!r}")
        if max_live_envs < 1:
            raise ValueError(f"max_live_envs must be >= 1, got {max_live_envs}")
        self.env_name = env_name
        self.env_kwargs = dict(env_kwargs or {})
        self.backend = backend
        self.max_live_envs = max_live_envs
        self.step_timeout_s = step_timeout_s
        self.reset_timeout_s = reset_timeout_s
        factory = get_env_factory(env_name)  # fail fast on an unknown name
        if backend == "thread":
            self._slots: list[Any] = [ThreadSlot(lambda: factory(**self.env_kwargs)) for _ in range(max_live_envs)]
            workers = num_workers or max_live_envs
        else:
            self._slots = [ProcessSlot(env_name, self.env_kwargs, step_timeout_s) for _ in range(max_live_envs)]
            workers = max_live_envs
        self._workers = workers
        self._executor = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="envpool")
        self._free = list(range(max_live_envs))
        self._episodes: dict[int, _Episode] = {}
        self._ids = itertools.count()
        self._tickets = itertools.count()
        self._lock = threading.Lock()
        self._stats = dict(steps=0, resets=0, crashes=0, timeouts=0, restarts=0, retries=0,
                           env_time_s=0.0, wait_time_s=0.0)
        self._restarts: list[cf.Future] = []   # background env restarts (see close)
        self._t_first: float | None = None
        self._t_last = 0.0

    # ---- lifecycle

    def warm_up(self) -> None:
        """Start every slot's env now (in parallel) instead of at first reset."""
        for f in [self._executor.submit(s.ensure_started) for s in self._slots]:
            f.result()

    def close(self) -> None:
        """Close every env and the worker threads.

        Background restarts not yet begun are cancelled; running ones (an env being started,
        e.g. a JVM) are waited for (up to `reset_timeout_s`) and their env is closed, so no
        simulator process outlives the pool.
        """
        for f in self._restarts:
            f.cancel()
        for s in self._slots:
            s.closed = True
        pending = [f for f in self._restarts if not f.done()]
        if pending:
            cf.wait(pending, timeout=self.reset_timeout_s)
        for s in self._slots:
            s.close()
        self._restarts.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "EnvPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def num_episodes(self) -> int:
        """Episodes started and not finished (a finished one is no longer held)."""
        return len(self._episodes)

    @property
    def num_free(self) -> int:
        """Slots free for new episodes."""
        return len(self._free)

    def env_for(self, episode_id: int) -> Env:
        """The live env object of an episode (thread backend only; for tests and experts;
        the rollout reads `StepOutcome.pieces` instead, which both backends fill)."""
        if self.backend != "thread":
            raise RuntimeError("env_for() needs backend='thread'; process envs live in workers")
        env = self._slots[self._episodes[episode_id].slot].env
        if env is None:
            raise RuntimeError(f"episode {episode_id}'s env is not running (crashed or not started)")
        return env

    def worker_pid(self, episode_id: int) -> int | None:
        """Worker process id of an episode (process backend only)."""
        if self.backend != "process":
            raise RuntimeError("worker_pid() needs backend='process'")
        return self._slots[self._episodes[episode_id].slot].pid

    # ---- timed env calls (run on the executor)

    def _timed(self, slot: Any, method: str, *args: Any) -> tuple[Any, float]:
        """((result, prompt pieces), seconds) of one reset / step on `slot`."""
        t = time.perf_counter()
        out = slot.call_with_pieces(method, *args)
        return out, time.perf_counter() - t

    def _mark(self) -> float:
        now = time.perf_counter()
        if self._t_first is None:
            self._t_first = now
        return now

    # ---- submit / collect

    def submit_reset(self, tasks: Sequence[Task]) -> Ticket:
        """Start one episode per task on free slots; returns at once.

        For a group-synchronised reset pass M copies of one task. Raises RuntimeError when
        there are fewer free slots than tasks (start more as episodes finish).
        """
        with self._lock:
            if len(tasks) > len(self._free):
                raise RuntimeError(
                    f"{len(tasks)} episodes requested but only {len(self._free)} of {self.max_live_envs} "
                    "slots are free; finish or release episodes first and start the rest in waves"
                )
            eps = []
            for task in tasks:
                ep = _Episode(next(self._ids), task, self._free.pop(0), pending=True)
                self._episodes[ep.episode_id] = ep
                eps.append(ep)
        now = self._mark()
        futs = [self._executor.submit(self._timed, self._slots[ep.slot], "reset", ep.task) for ep in eps]
        return Ticket(next(self._tickets), [ep.episode_id for ep in eps], futs, now, self.reset_timeout_s, "reset")

    def submit(self, episode_ids: Sequence[int], actions: Sequence[str | None]) -> Ticket:
        """Step each episode with its action (None = format-invalid output); returns at once.

        Raises ValueError on length mismatch, an unknown / finished episode, or an episode
        whose previous request has not been collected.
        """
        if len(episode_ids) != len(actions):
            raise ValueError(f"{len(episode_ids)} episode ids but {len(actions)} actions")
        eps = []
        for eid in episode_ids:
            ep = self._episodes.get(eid)
            if ep is None or ep.done:
                raise ValueError(f"episode {eid} is unknown or finished; start a new one with submit_reset")
            if ep.pending:
                raise ValueError(f"episode {eid} has an uncollected request; collect() its ticket first")
            eps.append(ep)
        for ep in eps:
            ep.pending = True
        now = self._mark()
        futs = [self._executor.submit(self._timed, self._slots[ep.slot], "step", a) for ep, a in zip(eps, actions)]
        return Ticket(next(self._tickets), list(episode_ids), futs, now, self.step_timeout_s, "step")

    def ready(self, ticket: Ticket) -> bool:
        """True when every request of the ticket has finished (collect will not block)."""
        return all(f.done() for f in ticket.futures)

    def collect(self, ticket: Ticket) -> list[StepOutcome]:
        """Wait for a ticket's outcomes (same order as submitted). Crashes and timeouts become
        crashed outcomes; bad input (ValueError / KeyError / TypeError from reset) is re-raised."""
        t0 = time.perf_counter()
        deadline = ticket.submitted_at + ticket.timeout_s
        outcomes = []
        user_error: BaseException | None = None
        for eid, fut in zip(ticket.episode_ids, ticket.futures):
            ep = self._episodes[eid]
            try:
                (result, pieces), dt = fut.result(timeout=max(0.0, deadline - time.perf_counter()))
                self._stats["env_time_s"] += dt
                if ticket.kind == "reset":
                    obs, info = result
                    self._stats["resets"] += 1
                    out = StepOutcome(eid, obs, 0.0, False, info, pieces=pieces)
                else:
                    obs, reward, done, info = result
                    self._stats["steps"] += 1
                    out = StepOutcome(eid, obs, reward, done, info, pieces=pieces)
            except cf.TimeoutError:
                self._stats["timeouts"] += 1
                out = self._crash(ep, f"timeout: no answer within {ticket.timeout_s:.1f}s",
                                  hung=True, kind=ticket.kind)
            except USER_ERRORS as e:
                if ticket.kind == "reset":
                    user_error = user_error or e
                out = self._crash(ep, f"{type(e).__name__}: {e}", restart=False, kind=ticket.kind)
            except Exception as e:
                out = self._crash(ep, f"{type(e).__name__}: {e}", kind=ticket.kind)
            ep.pending = False
            if out.done:
                self._finish(ep)
            outcomes.append(out)
        now = time.perf_counter()
        self._stats["wait_time_s"] += now - t0
        self._t_last = now
        if user_error is not None:
            # The caller gets an exception instead of the outcomes, so it never learns the
            # other episodes' ids and could not release them: free their slots here (their
            # envs stay alive for reuse) instead of leaking them.
            for eid in ticket.episode_ids:
                ep = self._episodes.get(eid)
                if ep is not None:
                    self._finish(ep)
            raise user_error
        return outcomes

    def _crash(self, ep: _Episode, error: str, restart: bool = True, hung: bool = False,
               kind: str = "step") -> StepOutcome:
        """Crashed outcome for `ep`; with `restart` the slot's env is replaced. Logs one line.

        `hung` (a timeout): the call may still be running and holds the thread slot's lock
        and an executor thread. Thread backend: abandon that slot object and executor (the
        hung call finishes, or dies with its simulator, on its own) and give the slot a new
        `ThreadSlot` and the pool a new executor, so the next episode on the slot does not
        queue behind the hung call. Process backend: `discard` kills the worker process.
        """
        self._stats["crashes"] += 1
        first = error.strip().splitlines()[0][:300] if error.strip() else "(no message)"
        log.warning("%s env crashed in %s of task %s (variation %s, slot %d): %s%s",
                    self.env_name, kind, ep.task.task_id, ep.task.variation, ep.slot, first,
                    "; restarting it" if restart else "")
        if restart:
            slot = self._slots[ep.slot]
            slot.discard()
            if hung and isinstance(slot, ThreadSlot):
                slot = ThreadSlot(slot._factory)
                self._slots[ep.slot] = slot
                old, self._executor = self._executor, cf.ThreadPoolExecutor(
                    max_workers=self._workers, thread_name_prefix="envpool")
                old.shutdown(wait=False)  # queued / running calls of other tickets still finish
            self._stats["restarts"] += 1
            self._restarts = [f for f in self._restarts if not f.done()]
            self._restarts.append(self._executor.submit(self._restart, slot))
        return StepOutcome(ep.episode_id, "", 0.0, True, {"crashed": True}, crashed=True, error=error)

    @staticmethod
    def _restart(slot: Any) -> None:
        """Start a slot's fresh env in the background; a failure is logged once (the next
        call on the slot tries again and crashes its episode with the cause)."""
        try:
            slot.ensure_started()
        except PoolClosedError:
            pass
        except Exception as e:  # noqa: BLE001 — logged, retried by the next call
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            log.warning("restarting an env failed: %s: %s", type(e).__name__, first)

    def note_retries(self, n: int) -> None:
        """Count `n` crashed resets the caller submits again (stats()["retries"])."""
        self._stats["retries"] += int(n)

    def _finish(self, ep: _Episode) -> None:
        # a finished episode is dropped: a run's pool plays thousands of episodes, and one
        # record (with its task) kept per episode ever played grew the process every iteration
        with self._lock:
            ep.done = True
            self._episodes.pop(ep.episode_id, None)
            self._free.append(ep.slot)
            self._free.sort()

    def release(self, episode_ids: Sequence[int]) -> None:
        """Abandon unfinished episodes and free their slots (their envs stay alive for reuse)."""
        for eid in episode_ids:
            ep = self._episodes.get(eid)
            if ep is None:   # finished (or never started): nothing to free
                continue
            if ep.pending:
                raise ValueError(f"episode {eid} has an uncollected request; collect() it first")
            self._finish(ep)

    # ---- blocking forms

    def reset(self, tasks: Sequence[Task]) -> list[StepOutcome]:
        """Blocking submit_reset + collect."""
        return self.collect(self.submit_reset(tasks))

    def reset_group(self, task: Task, m: int) -> list[StepOutcome]:
        """Group-synchronised reset: M episodes on identical copies of `task`."""
        return self.reset([task] * m)

    def step(self, episode_ids: Sequence[int], actions: Sequence[str | None]) -> list[StepOutcome]:
        """Blocking submit + collect."""
        return self.collect(self.submit(episode_ids, actions))

    # ---- stats

    def stats(self) -> dict[str, float]:
        """Counters and timings: steps, resets, crashes, timeouts, restarts, retries (resets
        submitted again, see note_retries), env_time_s (sum of
        env call durations), wait_time_s (caller blocked in collect), wall_s (first submit to
        last collect), steps_per_s (steps / wall_s), live_envs."""
        out: dict[str, float] = dict(self._stats)
        wall = (self._t_last - self._t_first) if self._t_first is not None else 0.0
        out["wall_s"] = max(wall, 0.0)
        out["steps_per_s"] = self._stats["steps"] / wall if wall > 0 else 0.0
        out["live_envs"] = sum(
            1 for s in self._slots if (getattr(s, "env", None) is not None or getattr(s, "proc", None) is not None)
        )
        return out


POOL_COUNTERS = ("crashes", "timeouts", "restarts", "retries")


def pool_metrics(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The env failure counters of one iteration as metrics: ``rollout/env_<counter>`` =
    after - before for crashes, timeouts, restarts, retries (two `EnvPool.stats()` snapshots)."""
    return {f"rollout/env_{k}": float(after.get(k, 0) - before.get(k, 0)) for k in POOL_COUNTERS}
