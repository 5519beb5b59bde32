"""Environment protocol shared by every adapter (docs/design.md §8.1).

A `Task` names one episode's start state; an `Env` is reset onto a task and stepped with
action text. Adapters subclass `TextEnv`, which owns the bookkeeping every env needs the
same way: the step counter and step limit, format-invalid steps (nothing is sent to
the simulator, the step counts toward the step limit and
the observation repeats; docs/method.md §2.2), and the `done` latch.

Info keys (all adapters):
  reset: task_description (str), admissible_actions (list[str] | None), score (float),
         family (str, task family for per-family metrics).
  step:  score (float, env units: ScienceWorld 0-100, ALFWorld 0/1, WebShop 0-1),
         success (bool), won (bool, alias of success), admissible_actions (list[str] | None),
         invalid (bool: the env rejected the action text, e.g. "No known action matches"),
         invalid_format (bool: action was None, not sent), truncated (bool: step limit hit),
         steps (int, steps taken so far, invalid ones included).
"""
from __future__ import annotations

import abc
import dataclasses
import math
import numbers
from typing import Any, Protocol, runtime_checkable

SPLITS = ("train", "dev", "test")


@dataclasses.dataclass(frozen=True, order=True)
class Task:
    """One episode's start state.

    Attributes:
      env: registry name of the env ("scienceworld", "alfworld", "webshop", "memory_key", ...).
      task_id: env-specific task name (ScienceWorld task name, ALFWorld game file path,
        WebShop "goal", built-in task name).
      variation: ScienceWorld variation index, WebShop goal (session) index, built-in seed.
        ALFWorld games have no variation: 0.
      split: "train", "dev" or "test" (ALFWorld: "train", "eval_in_distribution",
        "eval_out_of_distribution" are accepted too).
    Hashable and ordered, so group ids can be built from it.
    """

    env: str
    task_id: str
    variation: int = 0
    split: str = "train"


@dataclasses.dataclass(frozen=True)
class PromptPieces:
    """What an adapter gives the rollout's prompt builder (docs/method.md §3).

    Attributes:
      environment: human name for the role line ("ScienceWorld", "ALFWorld", "WebShop").
      task_description: the task text of the current episode.
      action_templates: action templates (ScienceWorld) or an empty tuple.
      admissible_actions: the current admissible actions (ALFWorld list with `help` removed;
        WebShop `search[...]` / `click[...]`), or None when the env does not list them.
    """

    environment: str
    task_description: str
    action_templates: tuple[str, ...] = ()
    admissible_actions: tuple[str, ...] | None = None


class EnvError(RuntimeError):
    """An env failed in a way the pool treats as a crash (dead simulator, server down)."""


@runtime_checkable
class Env(Protocol):
    """The protocol every env satisfies (structural: no inheritance required)."""

    name: str
    max_steps: int

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Start `task`; returns (first observation, info)."""

    def step(self, action: str | None) -> tuple[str, float, bool, dict[str, Any]]:
        """Apply one action (None = format-invalid output); returns (obs, reward, done, info)."""

    def prompt_pieces(self) -> PromptPieces:
        """Prompt pieces of the current episode."""

    def close(self) -> None:
        """Free the simulator (JVM, game, HTTP env)."""


def _checked_step(env_name: str, result: Any) -> tuple[str, float, bool, dict[str, Any]]:
    """Validate an adapter's `_step` result before it reaches returns and advantages.

    A NaN / inf reward would poison every advantage of its group, and a non-bool `done`
    ("no" is truthy) would end episodes at random, so both are env errors, not data.
    Accepts numpy scalars (np.float32 rewards, np.bool_ done). Raises EnvError (the pool
    turns it into a crashed episode) naming the env and the offending value.
    """
    if not isinstance(result, tuple) or len(result) != 4:
        raise EnvError(f"{env_name}: _step must return (obs, reward, done, info), got {result!r:.200}")
    obs, reward, done, info = result
    if not isinstance(obs, str):
        raise EnvError(f"{env_name}: observation must be str, got {type(obs).__name__} {obs!r:.100}")
    if not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise EnvError(f"{env_name}: reward must be a finite real number, got {reward!r}")
    is_np_bool = type(done).__module__ == "numpy" and type(done).__name__ in ("bool_", "bool")
    if not (isinstance(done, bool) or is_np_bool):
        raise EnvError(f"{env_name}: done must be a bool, got {type(done).__name__} {done!r:.100}")
    if not isinstance(info, dict):
        raise EnvError(f"{env_name}: info must be a dict, got {type(info).__name__} {info!r:.100}")
    return obs, float(reward), bool(done), info


class TextEnv(abc.ABC):
    """Base class with the shared step bookkeeping; subclasses implement `_reset`/`_step`.

    `step(None)` is a format-invalid step: nothing is sent to the simulator, reward 0, the
    observation repeats, the step counts toward `max_steps` (docs/method.md §2.2).
    Stepping after `done` raises RuntimeError (the rollout must start a new episode).
    """

    name: str = "text_env"
    environment: str = "a text environment"
    # True when a step is pure Python that returns in microseconds (the built-ins): there is no
    # env time for decoding to overlap, so ``rollout.cohorts=0`` (auto) decodes every live
    # episode in one call per step instead of splitting them into turn-taking cohorts.
    instant_steps: bool = False

    def __init__(self, max_steps: int) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.max_steps = int(max_steps)
        self._steps = 0
        self._done = True
        self._task: Task | None = None
        self._last_obs = ""
        self._last_info: dict[str, Any] = {}

    @property
    def task(self) -> Task | None:
        """The task of the current episode (None before the first reset)."""
        return self._task

    @property
    def steps(self) -> int:
        """Steps taken in the current episode, format-invalid ones included."""
        return self._steps

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Start `task`. Raises ValueError when the task belongs to another env."""
        if task.env != self.name:
            raise ValueError(f"task {task} is for env {task.env!r}, this env is {self.name!r}")
        obs, info = self._reset(task)
        self._task = task
        self._steps = 0
        self._done = False
        self._last_obs = obs
        info.setdefault("steps", 0)
        self._last_info = info
        return obs, info

    def step(self, action: str | None) -> tuple[str, float, bool, dict[str, Any]]:
        """One step; see the class docstring for `None`. Raises RuntimeError after done."""
        if self._done:
            raise RuntimeError(f"{self.name}: step() called on a finished episode; call reset(task) first")
        self._steps += 1
        if action is None:
            obs, reward, done = self._last_obs, 0.0, False
            info = {k: v for k, v in self._last_info.items() if k != "invalid"}
            info.update(invalid=False, invalid_format=True)
        else:
            obs, reward, done, info = _checked_step(self.name, self._step(action))
            info.setdefault("invalid_format", False)
        truncated = not done and self._steps >= self.max_steps
        info["truncated"] = truncated
        info["steps"] = self._steps
        self._done = done or truncated
        self._last_obs, self._last_info = obs, info
        return obs, float(reward), self._done, info

    @abc.abstractmethod
    def _reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Env-specific reset; must put task_description and admissible_actions in info."""

    @abc.abstractmethod
    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """Env-specific step on a format-valid action."""

    @abc.abstractmethod
    def prompt_pieces(self) -> PromptPieces:
        """Prompt pieces of the current episode."""

    def close(self) -> None:
        """Free resources (default: nothing)."""
