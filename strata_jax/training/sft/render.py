"""Rendering expert episodes into behaviour-cloning examples with the rollout's own prompts.

Every example is rendered with `strata_jax.rollout.PromptBuilder`, i.e. exactly the prompt the
rollout builds for that state (docs/method.md §3): step prompts with the history window and,
for StraTA rows, the plan z (`plan_text`: the clean expert's actions, runs merged, numbered) in
the prefix; the strategy prompt; the judge prompt. Responses are
``<think>{think}</think><action>{a}</action>``, ``<strategy>{z}</strategy>`` and
``<bad_steps>none</bad_steps>`` / ``<bad_steps>2, 5</bad_steps>``, as the rollout's sampler
produces them: ending on the token that completes the stage's stop string (the closing tag,
`prompts.ACTION_STOP` / `STRATEGY_STOP` / `JUDGE_STOP`), or with ``<|im_end|>`` when the text
never completes it.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from strata_jax.models.tokenizer import IM_END_ID
from strata_jax.rollout.prompts import (ACTION_STOP, JUDGE_STOP, STRATEGY_STOP, HistoryEntry,
                                        PromptBuilder, PromptIds)
from strata_jax.rollout.strategy import check_strategy
from strata_jax.sampling import build_stop_text
from strata_jax.training.sft.config import SFTConfig
from strata_jax.training.sft.experts import ExpertEpisode

KINDS = ("action", "strategy", "judge")


def plan_text(actions: Sequence[str], max_items: int = 12) -> str:
    """The strategy z of an expert plan: runs of one action merged, numbered, one per line.

    >>> plan_text(["go north", "go north", "enter 471"])
    '1. go north (2 times)\\n2. enter 471'
    """
    items: list[list] = []
    for a in actions:
        if items and items[-1][0] == a:
            items[-1][1] += 1
        else:
            items.append([a, 1])
    lines = [f"{i}. {a}" + (f" ({n} times)" if n > 1 else "")
             for i, (a, n) in enumerate(items[:max_items], start=1)]
    return "\n".join(lines)


# What a masked plan says instead of a typed code (`mask_codes`).
MASKED_CODE = "enter the vault code"


def mask_codes(actions: Sequence[str]) -> list[str]:
    """The plan's actions with every ``enter <code>`` written as `MASKED_CODE`: a strategy that
    names the step but not the secret (behaviour cloning with ``sft.plan_code="mask"``).

    >>> mask_codes(["go north", "enter 471"])
    ['go north', 'enter the vault code']
    """
    return [MASKED_CODE if a == "enter" or a.startswith("enter ") else a for a in actions]


def action_response(action: str, think: str) -> str:
    """Response text of one step (docs/method.md §2.1 format); the stop token is added at
    encoding."""
    return f"<think>{think}</think><action>{action}</action>"


def judge_response(bad_steps: Sequence[int]) -> str:
    """Judge answer text: ``<bad_steps>none</bad_steps>`` or ``<bad_steps>2, 5</bad_steps>``."""
    body = ", ".join(str(i) for i in bad_steps) if bad_steps else "none"
    return f"<bad_steps>{body}</bad_steps>"


@dataclasses.dataclass(frozen=True)
class SFTExample:
    """One training example: the rollout's prompt and the target response.

    Attributes:
      prompt: `PromptIds` from the PromptBuilder (the model sees ``prompt.ids``).
      response_ids: target ids (the only trained tokens): encode(response_text) up to the token
        that completes the kind's stop string, else + [<|im_end|>]; what the sampler emits.
      response_text: the target text. kind: "action" | "strategy" | "judge".
      with_strategy: StraTA form (z in the prompt / a strategy or judge row).
      step_index: 0-based step of action rows (-1 otherwise).
    """

    prompt: PromptIds
    response_ids: tuple[int, ...]
    response_text: str
    kind: str
    with_strategy: bool
    step_index: int = -1


def _example(builder: PromptBuilder, prompt: PromptIds, text: str, kind: str, strat: bool,
             t: int = -1) -> SFTExample:
    ids = builder.encode(text)
    stop = {"action": ACTION_STOP, "strategy": STRATEGY_STOP, "judge": JUDGE_STOP}[kind]
    n = build_stop_text(builder.tokenizer, stop).scan(ids)
    ids = ids[:n] if n else ids + [IM_END_ID]
    return SFTExample(prompt, tuple(ids), text, kind, strat, t)


def render_episode(builder: PromptBuilder, ep: ExpertEpisode, *, with_strategy: bool,
                   think: str = SFTConfig.think, judge: bool = True,
                   max_plan_items: int = 12, plan_code: str = "keep",
                   train_strategies: bool = True,
                   clone_guesses: bool = True) -> list[SFTExample]:
    """Examples of one expert episode, rendered exactly as the rollout renders its prompts.

    StraTA form (`with_strategy`): the strategy example (strategy prompt of the first
    observation -> ``<strategy>{plan}</strategy>``), one action example per step whose prompt
    holds z = the body of that block as `check_strategy` extracts it (what the rollout prepends),
    and (``judge``) the judge example listing the noisy steps. Flat form: action examples only.
    ``plan_code="mask"`` renders the plan through `mask_codes` (the action targets are the
    expert's own actions either way); ``train_strategies=False`` leaves the strategy example out
    (z still goes into the step prompts). ``clone_guesses=False`` (StraTA form) leaves out the
    action rows that type a code their prompt cannot show: a masked z, and the first
    observation (the note) out of the history window. Their target is a guess, and cloning it
    teaches typing a code without reading z; left out, every code row of that form reads the
    code from z or the history. The flat form keeps them: a flat policy can only guess.
    """
    out: list[SFTExample] = []
    z = None
    if with_strategy:
        plan = mask_codes(ep.plan) if plan_code == "mask" else ep.plan
        text = f"<strategy>{plan_text(plan, max_plan_items)}</strategy>"
        check = check_strategy(text, False, builder.count_tokens)
        if check.format_fail:
            raise ValueError(f"expert strategy fails the strategy format: {check.reason}")
        z = check.text
        if train_strategies:
            out.append(_example(builder, builder.strategy_prompt(ep.pieces0, ep.first_observation),
                                text, "strategy", True))
    history: list[HistoryEntry] = []
    for t, s in enumerate(ep.steps):
        prompt = builder.step_prompt(s.pieces, s.observation, history, z)
        # the note (step 0's observation) is in view while the window reaches back to it
        guess = (with_strategy and plan_code == "mask" and mask_codes([s.action]) != [s.action]
                 and t > prompt.history_used)
        if clone_guesses or not guess:
            out.append(_example(builder, prompt, action_response(s.action, think), "action",
                                with_strategy, t))
        history.append(HistoryEntry(s.observation, s.action))
    if with_strategy and judge and history:
        bad = [t + 1 for t, s in enumerate(ep.steps) if s.noisy]
        out.append(_example(builder, builder.judge_prompt(ep.pieces0, z, history),
                            judge_response(bad), "judge", True))
    return out


def keeps_code(cfg: SFTConfig, n: int) -> np.ndarray:
    """[n] bool: which of n expert episodes render their plan with its code under
    ``plan_code="mask"`` (all of them under "keep"): a draw of probability
    ``cfg.plan_code_keep`` per episode from ``cfg.seed`` alone, so the same episodes keep it
    in every process and every rerun."""
    if cfg.plan_code == "keep":
        return np.ones(n, bool)
    return np.random.default_rng([cfg.seed, 0x9C0DE]).random(n) < cfg.plan_code_keep


def build_examples(builder: PromptBuilder, episodes: Sequence[ExpertEpisode],
                   cfg: SFTConfig, flat_builder: PromptBuilder | None = None
                   ) -> list[SFTExample]:
    """Every example of `episodes` in the forms of ``cfg.strategy_mode`` (the plan's code kept
    or masked per episode: `keeps_code`): the StraTA form rendered with `builder`, the flat
    form with `flat_builder` (None: `builder` too; `SFTConfig.flat_prompts`)."""
    forms = {"both": (True, False), "strata": (True,), "flat": (False,)}[cfg.strategy_mode]
    keep = keeps_code(cfg, len(episodes))
    out = []
    for ep, k in zip(episodes, keep):
        for strat in forms:
            out += render_episode(builder if strat else (flat_builder or builder), ep,
                                  with_strategy=strat, think=cfg.think,
                                  judge=cfg.judge, max_plan_items=cfg.max_plan_items,
                                  plan_code="keep" if k else "mask",
                                  train_strategies=cfg.train_strategies,
                                  clone_guesses=cfg.clone_guesses)
    return out


__all__ = ["KINDS", "SFTExample", "plan_text", "mask_codes", "MASKED_CODE", "action_response",
           "judge_response",
           "render_episode", "build_examples"]
