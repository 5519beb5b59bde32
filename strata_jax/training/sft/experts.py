"""Expert play for behaviour cloning (one pass over the env, outside jit).

* experts: the built-in envs' ``expert_action()`` (optimal policies) and ScienceWorld's gold
  action sequences (``ScienceWorldEnv(generate_gold=True).gold_actions()``);
* noise: with probability ``noise`` a step takes a random admissible action instead (built-ins;
  the expert then recovers from the new state) or inserts a harmless ``look around`` /
  ``inventory`` before the next gold action (ScienceWorld, whose gold path is fixed). Noisy
  steps are cloned like the others, which keeps the warm start deliberately imperfect, and
  they are the "bad steps" of the judge targets;
* the plan: the CLEAN expert's action list (merged into the strategy text z by
  `render.plan_text`);
* environment prompt pieces are read from the live env before each step, as the thread-backend
  rollout does; actions are the parsed actions (`envs_bridge.parse_action`), as in the rollout.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any, Sequence

from envs_bridge.base import PromptPieces, Task
from envs_bridge.parsing import parse_action
from envs_bridge.registry import make_env

# ScienceWorld noise actions: they change nothing in the world, so the gold path still solves it.
SCIWORLD_NOISE_ACTIONS = ("look around", "inventory")


@dataclasses.dataclass(frozen=True)
class ExpertStep:
    """One expert step: the env's prompt pieces and raw observation BEFORE the step, the parsed
    action taken (lower-cased, as the rollout sends it), and whether it was a noise action."""

    pieces: PromptPieces
    observation: str
    action: str
    noisy: bool = False


@dataclasses.dataclass(frozen=True)
class ExpertEpisode:
    """An expert episode: task, pieces at reset (strategy / judge prompts), first observation,
    steps, the clean expert's plan (action list, merged into z by `plan_text`), final return."""

    task: Task
    pieces0: PromptPieces
    first_observation: str
    steps: tuple[ExpertStep, ...]
    plan: tuple[str, ...]
    episode_return: float
    success: bool


def _parsed(action: str) -> str:
    """The action as the rollout would send it: parse_action of the rendered response."""
    p = parse_action(f"<think>x</think><action>{action}</action>")
    if not p.valid:
        raise ValueError(f"expert action {action!r} does not survive the action format")
    return p.action


def _noise_choices_builtin(env: Any, expert: str) -> list[str]:
    """Admissible actions a noisy step may take instead of `expert`: never a template, and
    never an ``enter`` (memory_key's vault lists concrete codes: cloning a wrong code would
    teach guessing, and with limited attempts it ends the episode)."""
    return [a for a in env.admissible_actions()
            if "<" not in a and a != expert and not a.startswith("enter")]


def play_builtin_expert(env: Any, task: Task, noise: float, rng: random.Random) -> ExpertEpisode:
    """Play `task` with ``env.expert_action()`` (a built-in env), taking a random admissible
    action with probability `noise` (the expert recovers from wherever it lands).

    Stops at done or the env's step limit. The plan is the clean expert's action list (the
    env is a pure function of the seed, so a second reset replays it)."""
    env.reset(task)
    plan: list[str] = []
    done = False
    while not done:
        a = _parsed(env.expert_action())
        plan.append(a)
        _, _, done, _ = env.step(a)
    obs, _ = env.reset(task)
    pieces0 = env.prompt_pieces()
    steps, ret, done, info = [], 0.0, False, {}
    while not done:
        pieces = env.prompt_pieces()
        expert = _parsed(env.expert_action())
        choices = _noise_choices_builtin(env, expert)
        noisy = bool(choices) and rng.random() < noise
        a = _parsed(rng.choice(choices)) if noisy else expert
        steps.append(ExpertStep(pieces, obs, a, noisy))
        obs, r, done, info = env.step(a)
        ret += r
    return ExpertEpisode(task, pieces0, steps[0].observation, tuple(steps), tuple(plan), ret,
                         bool(info.get("success", False)))


def play_gold(env: Any, task: Task, noise: float, rng: random.Random,
              max_gold_steps: int = 30) -> ExpertEpisode | None:
    """Replay ScienceWorld's gold action sequence on `task` (env built with generate_gold=True),
    inserting a harmless noise action before a gold step with probability `noise`.

    Returns None when the gold path is longer than `max_gold_steps` (docs/method.md §11.1:
    behaviour cloning uses pairs whose gold length fits)."""
    obs, _ = env.reset(task)
    pieces0 = env.prompt_pieces()
    gold = [_parsed(a) for a in env.gold_actions()]
    if len(gold) > max_gold_steps:
        return None
    steps, ret, done, info = [], 0.0, False, {}
    for a in gold:
        for act, noisy in ([(rng.choice(SCIWORLD_NOISE_ACTIONS), True)] if rng.random() < noise
                           else []) + [(a, False)]:
            if done:
                break
            steps.append(ExpertStep(env.prompt_pieces(), obs, act, noisy))
            obs, r, done, info = env.step(act)
            ret += r
    return ExpertEpisode(task, pieces0, steps[0].observation, tuple(steps), tuple(gold), ret,
                         bool(info.get("success", False)))


def collect_expert_episodes(env_name: str, tasks: Sequence[Task], *, noise: float = 0.0,
                            seed: int = 0, max_gold_steps: int = 30,
                            env_kwargs: dict[str, Any] | None = None) -> list[ExpertEpisode]:
    """Expert episodes of `tasks` on one env instance of `env_name`.

    Built-in envs play ``expert_action()``; "scienceworld" replays gold sequences (skipping
    paths over `max_gold_steps`; its step limit is raised to fit them plus noise).
    Raises ValueError for an env with neither an expert policy nor gold sequences.
    """
    kw = dict(env_kwargs or {})
    rng = random.Random(seed)
    if env_name == "scienceworld":
        kw["max_steps"] = max(int(kw.get("max_steps", 30)), 2 * max_gold_steps + 2)
        kw["generate_gold"] = True
        kw.pop("fetch_valid_actions", None)
    env = make_env(env_name, **kw)
    try:
        out = []
        for task in tasks:
            if hasattr(env, "expert_action"):
                out.append(play_builtin_expert(env, task, noise, rng))
            elif hasattr(env, "gold_actions"):
                ep = play_gold(env, task, noise, rng, max_gold_steps)
                if ep is not None:
                    out.append(ep)
            else:
                raise ValueError(f"env {env_name!r} has no expert policy (expert_action) or gold "
                                 "action sequences (gold_actions): behaviour cloning needs one")
        return out
    finally:
        env.close()


__all__ = ["ExpertStep", "ExpertEpisode", "play_builtin_expert", "play_gold",
           "collect_expert_episodes", "SCIWORLD_NOISE_ACTIONS"]
