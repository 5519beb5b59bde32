"""Self-judgment: the judge stage of a rollout, verdicts -> per-step judge flags
(docs/method.md §5.4), and the optional separate judge model (docs/method.md §5.10).

The judge answers ``<bad_steps>1, 4</bad_steps>`` or ``<bad_steps>none</bad_steps>``. Rules
[P]: the first block counts; its body is ``none`` (any case) or a list of integers (optionally
signed) separated by commas and / or whitespace; the rule is "keep the integers in [1, T]":
integers outside it (0, negatives, > T) are dropped, the others kept
(``<bad_steps>3, 2, -1</bad_steps>`` with T = 3 gives (2, 3)); anything else in the body
(words, decimals), a number of more than `MAX_STEP_DIGITS` significant digits, a missing or
unclosed block, or CJK text means "unparsable" = no bad steps.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import numpy as np

from envs_bridge.parsing import contains_cjk
from strata_jax.rollout.episodes import decode_generation, generate_timed
from strata_jax.rollout.records import LoopStats, Trajectory
from strata_jax.rollout.keys import PURPOSE_JUDGE, row_keys
from strata_jax.rollout.policy import Policy
from strata_jax.rollout.prompts import HistoryEntry, PromptBuilder, invalid_history_action
from strata_jax.sampling import SamplingParams

# Two plain searches, not one lazy pattern: "<bad_steps>(.*?)</bad_steps>" retries the lazy
# scan from every unclosed opening tag, quadratic in a verdict of many of them.
_OPEN_RE = re.compile(r"<bad_steps>", re.IGNORECASE)
_CLOSE_RE = re.compile(r"</bad_steps>", re.IGNORECASE)
# Step indices are 1..T with T = env.max_steps; nine digits is far above any horizon.
MAX_STEP_DIGITS = 9


def parse_bad_steps(verdict: str, num_steps: int) -> tuple[int, ...]:
    """The 1-based bad step indices named by a judge verdict.

    Args:
      verdict: the judge's decoded output.
      num_steps: T, the trajectory's step count.
    Returns:
      sorted unique ints in [1, T]; () for "none" or unparsable output. Never raises on any
      string (a malformed verdict flags no step).
    """
    if contains_cjk(verdict):
        return ()
    # the first opening tag with a closing tag after it: the first one, if any closes
    opened = _OPEN_RE.search(verdict)
    closed = None if opened is None else _CLOSE_RE.search(verdict, opened.end())
    if closed is None:
        return ()
    body = verdict[opened.end():closed.start()].strip()
    if not body or body.lower() == "none":
        return ()
    parts = [p for p in re.split(r"[,\s]+", body) if p]
    if not all(re.fullmatch(r"[+-]?\d+", p) for p in parts):
        return ()
    # A number longer than MAX_STEP_DIGITS significant digits names no step any trajectory has;
    # such a verdict is malformed. int() sees only the significant digits: a 5000-character
    # string (leading zeros included) raises past Python's int conversion limit.
    digits = [p.lstrip("+-").lstrip("0") for p in parts]
    if any(len(d) > MAX_STEP_DIGITS for d in digits):
        return ()
    values = [(-1 if p.startswith("-") else 1) * int(d or "0") for p, d in zip(parts, digits)]
    return tuple(sorted({v for v in values if 1 <= v <= num_steps}))


def judge_flags(bad_steps: tuple[int, ...], num_steps: int) -> np.ndarray:
    """[T] bool, True at 0-based step t when t + 1 is in `bad_steps`."""
    flags = np.zeros((num_steps,), bool)
    for s in bad_steps:
        if 1 <= s <= num_steps:
            flags[s - 1] = True
    return flags


def judge_stage(policy: Policy, builder: PromptBuilder, trajs: Sequence[Trajectory], key: Any, *,
                sampling: SamplingParams, invalid_tail_chars: int, stats: LoopStats) -> None:
    """Self-judgment of the finished episodes, in place (docs/method.md §5.4).

    One greedy call per finished, non-crashed trajectory with steps sets its ``verdict`` (the
    decoded output), ``bad_steps`` (`parse_bad_steps`) and ``judge_tokens`` (the verdict's
    generated token count). Keys: ``(PURPOSE_JUDGE, task_uid, strategy_id, trajectory_id)``
    (unused by a greedy `sampling`, kept for a sampled judge).

    Args:
      policy / builder: the judge's `Policy` and `PromptBuilder` (its tokenizer encodes the
        prompts and decodes the verdicts).
      trajs: the played episodes. key: the iteration's base key.
      sampling: the judge sampling params (greedy, stop text ``</bad_steps>``).
      invalid_tail_chars: chars of a format-invalid output shown in the judged history.
      stats: `LoopStats` the one batched call is timed into (cohort label -2).
    """
    todo = [tr for tr in trajs if tr.steps and not tr.crashed and tr.pieces is not None]
    if not todo:
        return
    prompts = []
    for tr in todo:
        steps = [HistoryEntry(s.observation, s.action if s.action is not None
                              else invalid_history_action(s.output_text, invalid_tail_chars))
                 for s in tr.steps]
        prompts.append(builder.judge_prompt(tr.pieces, tr.spec.strategy, steps))
    keys = row_keys(key, [(PURPOSE_JUDGE, tr.spec.task_uid, tr.spec.strategy_id,
                           tr.spec.trajectory_id) for tr in todo])
    gens = generate_timed(policy, prompts, keys, sampling, stats, -2)
    for b, tr in enumerate(todo):
        tr.verdict = decode_generation(builder.tokenizer, gens[b])
        tr.judge_tokens = int(gens[b].length)
        tr.bad_steps = parse_bad_steps(tr.verdict, len(tr.steps))


@dataclasses.dataclass(frozen=True)
class JudgeModel:
    """Who answers the self-judgment prompts when it is not the policy (docs/method.md §5.10).

    Attributes:
      policy: the judge's `Policy` (a `SamplerPolicy` on its own sampler and params).
      builder: a `PromptBuilder` on the judge's tokenizer (encodes the judge prompts, decodes
        the verdicts; same budget as the policy's).
    """

    policy: Policy
    builder: PromptBuilder


def build_judge_model(c: Any, mesh: Any = None) -> JudgeModel | None:
    """The separate judge of ``c.rollout.judge_model`` (None when ``path`` is empty: the
    policy judges itself).

    Loads ``path`` with `strata_jax.models.load_checkpoint` (a local HF dir, a GGUF file or a
    hub id) in ``rollout.sampler_dtype``, hands the params through the run's
    `strata_jax.sampling.SamplerCopy` (``rollout.sampler_layout``), its tokenizer (``judge_model.tokenizer``: "" = the
    checkpoint's own, "offline" = the shipped Qwen BPE, else a dir or GGUF file), and a
    `Sampler` whose cache holds ``env.max_prompt_tokens + rollout.max_judge_tokens``.

    Args:
      c: the experiment ConfigDict (configs/base.py). mesh: the sampler's (local) mesh or None.
    Raises:
      ValueError when the judge's context is shorter than that cache; the loaders' errors for
      a missing checkpoint or tokenizer.
    """
    jm = c.rollout.judge_model
    path = str(jm.path or "")
    if not path:
        return None
    import jax.numpy as jnp

    from strata_jax.models import load_checkpoint, load_tokenizer
    from strata_jax.models.loading import resolve_checkpoint
    from strata_jax.rollout.policy import SamplerPolicy
    from strata_jax.sampling import Sampler, SamplerCopy

    dtype = jnp.dtype(c.rollout.get("sampler_dtype", "") or c.model.dtype)
    config, params = load_checkpoint(path, dtype=dtype, mesh=mesh)   # already on `mesh`
    tok_spec = str(jm.tokenizer or "")
    tokenizer = load_tokenizer(None if tok_spec == "offline"
                               else tok_spec or resolve_checkpoint(path))
    need = int(c.env.max_prompt_tokens) + int(c.rollout.max_judge_tokens)
    if need > config.max_position_embeddings:
        raise ValueError(f"the judge model {path!r} has a context of "
                         f"{config.max_position_embeddings} tokens, less than env.max_prompt_tokens"
                         f" + rollout.max_judge_tokens = {need}: lower them or pick another judge")
    sampler = Sampler(config, mesh=mesh, max_cache_len=need)
    return JudgeModel(SamplerPolicy(sampler, SamplerCopy.from_config(c, config)(params)),
                      PromptBuilder(tokenizer, c.env.max_prompt_tokens))
