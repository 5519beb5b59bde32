"""Behaviour cloning (SFT) warm start on expert trajectories rendered with the rollout's prompts.

Why: a randomly initialised tiny model never emits a parsable ``<action>``, so RL from scratch
on CPU has no signal. Cloning an expert first gives a policy whose actions reach the env from
the first iteration, with room left for RL (the data holds a little noise).

Data (one pass over the env, outside jit):
  * experts: the built-in envs' ``expert_action()`` (optimal policies) and ScienceWorld's gold
    action sequences (``ScienceWorldEnv(generate_gold=True).gold_actions()``);
  * noise: with probability ``noise`` a step takes a random admissible action instead (built-ins;
    the expert then recovers from the new state) or inserts a harmless ``look around`` /
    ``inventory`` before the next gold action (ScienceWorld, whose gold path is fixed). Noisy
    steps are cloned like the others, which keeps the warm start deliberately imperfect, and
    they are the "bad steps" of the judge targets;
  * the plan: the CLEAN expert's action list with runs of one action merged, as a numbered list
    ("1. go north (4 times)\\n2. enter 471"): the strategy text z of StraTA;
  * every example is rendered with `strata_jax.rollout.PromptBuilder`, i.e. exactly the prompt
    the rollout builds for that state (docs/method.md §3): step prompts with the history window
    and, for StraTA rows, z in the prefix; the strategy prompt; the judge prompt. Environment
    prompt pieces are read from the live env after each step, as the thread-backend rollout does;
    history actions are the parsed actions (`envs_bridge.parse_action`), as in the rollout.
  * responses: ``<think>{think}</think><action>{a}</action>``, ``<strategy>{z}</strategy>`` and
    ``<bad_steps>none</bad_steps>`` / ``<bad_steps>2, 5</bad_steps>``, as the rollout's sampler
    produces them: ending on the token that completes the stage's stop string (the closing tag,
    `prompts.ACTION_STOP` / `STRATEGY_STOP` / `JUDGE_STOP`), or with ``<|im_end|>`` when the
    text never completes it.

Training: cross-entropy on response tokens only (the prompt is context, never a target; docs/method.md
§1.3), token-mean over the batch, AdamW with global-norm clipping (`make_optimizer`), one jitted
step per batch; prompts are left-padded and responses right-padded to power-of-two buckets so a
run compiles a handful of programs (docs/design.md §6.3). The forward and the
chunked LM-head logprobs are the trainer's own (`response_states` / `response_logprobs`), so the
model scores exactly the columns the RL update scores.

Warm start of a run: `maybe_warm_start` (called by `experiment.build_model`) trains on the fly
or loads the cached HF export from ``<sft.cache_dir>/<fingerprint>/`` (default
``runs/warm_start/<fingerprint>``: one folder beside the runs, shared by every variant, run
folder and eval of the same setting, since the fingerprint covers all the warm start depends
on; ``sft.cache_dir=""`` keeps it per run in ``<workdir>/warm_start``).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import random
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from envs_bridge.base import PromptPieces, Task
from envs_bridge.parsing import parse_action
from strata_jax.config import read_fields, section_sources
from strata_jax.models import Qwen2Config, export_params, load_params
from strata_jax.models.tokenizer import IM_END_ID
from strata_jax.rollout.prompts import (ACTION_STOP, JUDGE_STOP, STRATEGY_STOP, HistoryEntry,
                                        PromptBuilder, PromptIds)
from strata_jax.rollout.strategy import check_strategy
from strata_jax.sampling import bucket, build_stop_text
from strata_jax.training.config import TrainConfig
from strata_jax.training.scoring import response_logprobs, response_states
from strata_jax.training.state import make_optimizer

log = logging.getLogger(__name__)

STRATEGY_MODES = ("both", "strata", "flat")
KINDS = ("action", "strategy", "judge")
# ScienceWorld noise actions: they change nothing in the world, so the gold path still solves it.
SCIWORLD_NOISE_ACTIONS = ("look around", "inventory")
META_FILE = "sft_meta.json"


# ---------------------------------------------------------------------------------- config

@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Behaviour-cloning settings (``c.sft`` of configs/base.py; `from_config`).

    Attributes:
      episodes: expert episodes collected (tasks drawn without repeats from ``split``).
      split: task split the experts play.
      noise: probability that a step is a random action (see the module docstring), in [0, 1).
      strategy_mode: "both" renders every episode with z (StraTA rows: strategy + step prompts
        with z + judge) AND without (flat baseline rows), so one warm start serves StraTA and the
        baselines; "strata" or "flat" renders one form only.
      judge: add judge examples (StraTA form only).
      think: the text inside <think></think> of every action response.
      max_plan_items: the plan (z) keeps at most this many numbered items.
      max_gold_steps: ScienceWorld gold paths longer than this are skipped.
      steps, batch_size, lr, weight_decay, grad_clip, warmup_steps: optimisation (AdamW, linear
        warmup then cosine decay to 0 at ``steps``).
      logprob_chunk: response positions per LM-head chunk.
      seed: data and batch order seed. log_every: steps between loss log lines.
      cache_dir: where `maybe_warm_start` keeps exports, one sub-folder per fingerprint
        ("" = ``<workdir>/warm_start``). Defaults = configs/base.py's ``c.sft``.
    """

    episodes: int = 32
    split: str = "train"
    noise: float = 0.1
    strategy_mode: str = "both"
    judge: bool = True
    think: str = "I follow the plan."
    max_plan_items: int = 12
    max_gold_steps: int = 30
    steps: int = 300
    batch_size: int = 16
    lr: float = 1e-5
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    warmup_steps: int = 20
    logprob_chunk: int = 64
    seed: int = 0
    log_every: int = 50
    cache_dir: str = "runs/warm_start"

    def __post_init__(self) -> None:
        if self.strategy_mode not in STRATEGY_MODES:
            raise ValueError(f"sft.strategy_mode must be one of {STRATEGY_MODES}, "
                             f"got {self.strategy_mode!r}")
        if not 0.0 <= self.noise < 1.0:
            raise ValueError(f"sft.noise must be in [0, 1), got {self.noise}")
        for name in ("episodes", "steps", "batch_size", "max_plan_items"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"sft.{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def config_sources(cls) -> dict[str, str]:
        """{field: dotted config key}: every field is ``sft.<field>``."""
        return section_sources(cls, "sft")

    @classmethod
    def from_config(cls, c: Any, **overrides: Any) -> "SFTConfig":
        """From ``c.sft``, every field read; a missing or unknown key is a ConfigError."""
        v = read_fields(cls, c, cls.config_sources(), owned={"sft": ()})
        v.update(overrides)
        return cls(**v)


# ---------------------------------------------------------------------------------- experts

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
    return [a for a in env.admissible_actions() if "<" not in a and a != expert]


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

    Returns None when the gold path is longer than `max_gold_steps` (docs/method.md §11.1: behaviour
    cloning uses pairs whose gold length fits)."""
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
    from envs_bridge.registry import make_env

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


# ---------------------------------------------------------------------------------- rendering

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


def action_response(action: str, think: str) -> str:
    """Response text of one step (docs/method.md §2.1 format); the stop token is added at encoding."""
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
                   max_plan_items: int = 12) -> list[SFTExample]:
    """Examples of one expert episode, rendered exactly as the rollout renders its prompts.

    StraTA form (`with_strategy`): the strategy example (strategy prompt of the first
    observation -> ``<strategy>{plan}</strategy>``), one action example per step whose prompt
    holds z = the body of that block as `check_strategy` extracts it (what the rollout prepends),
    and (``judge``) the judge example listing the noisy steps. Flat form: action examples only.
    """
    out: list[SFTExample] = []
    z = None
    if with_strategy:
        text = f"<strategy>{plan_text(ep.plan, max_plan_items)}</strategy>"
        check = check_strategy(text, False, builder.count_tokens)
        if check.format_fail:
            raise ValueError(f"expert strategy fails the strategy format: {check.reason}")
        z = check.text
        out.append(_example(builder, builder.strategy_prompt(ep.pieces0, ep.first_observation),
                            text, "strategy", True))
    history: list[HistoryEntry] = []
    for t, s in enumerate(ep.steps):
        prompt = builder.step_prompt(s.pieces, s.observation, history, z)
        out.append(_example(builder, prompt, action_response(s.action, think), "action",
                            with_strategy, t))
        history.append(HistoryEntry(s.observation, s.action))
    if with_strategy and judge and history:
        bad = [t + 1 for t, s in enumerate(ep.steps) if s.noisy]
        out.append(_example(builder, builder.judge_prompt(ep.pieces0, z, history),
                            judge_response(bad), "judge", True))
    return out


def build_examples(builder: PromptBuilder, episodes: Sequence[ExpertEpisode],
                   cfg: SFTConfig) -> list[SFTExample]:
    """Every example of `episodes` in the forms of ``cfg.strategy_mode``."""
    forms = {"both": (True, False), "strata": (True,), "flat": (False,)}[cfg.strategy_mode]
    out = []
    for ep in episodes:
        for strat in forms:
            out += render_episode(builder, ep, with_strategy=strat, think=cfg.think,
                                  judge=cfg.judge, max_plan_items=cfg.max_plan_items)
    return out


# ---------------------------------------------------------------------------------- batches

def make_sft_batch(examples: Sequence[SFTExample], rows: int, pad_id: int = 151643,
                   prompt_floor: int = 64, response_multiple: int = 8) -> dict[str, np.ndarray]:
    """Pad examples into one batch (numpy).

    Returns prompt_ids / prompt_mask [rows, Tp] (LEFT-padded, as the SampleBatch) and
    response_ids / response_mask [rows, Tr] (RIGHT-padded); int32 / bool. Tp is a power-of-two
    bucket (floor 64); Tr is rounded up to a multiple of 8 (the LM head over the response
    columns dominates the step, so padding there costs the most); rows beyond the examples are all-pad with an empty mask (no loss).
    The loss mask is exactly ``response_mask``: target tokens, never prompt tokens.
    Raises ValueError for more examples than rows or an empty list.
    """
    if not examples or len(examples) > rows:
        raise ValueError(f"need 1..{rows} examples for a batch of {rows} rows, got {len(examples)}")
    tp = bucket(max(e.prompt.num_tokens for e in examples), prompt_floor)
    tr = -(-max(len(e.response_ids) for e in examples) // response_multiple) * response_multiple
    p_ids = np.full((rows, tp), pad_id, np.int32)
    p_mask = np.zeros((rows, tp), bool)
    r_ids = np.full((rows, tr), pad_id, np.int32)
    r_mask = np.zeros((rows, tr), bool)
    for b, e in enumerate(examples):
        ids = e.prompt.ids
        p_ids[b, tp - len(ids):] = ids
        p_mask[b, tp - len(ids):] = True
        r_ids[b, : len(e.response_ids)] = e.response_ids
        r_mask[b, : len(e.response_ids)] = True
    # An all-pad row still needs one real prompt token so positions and attention stay finite.
    for b in range(len(examples), rows):
        p_mask[b, -1] = True
    return dict(prompt_ids=p_ids, prompt_mask=p_mask, response_ids=r_ids, response_mask=r_mask)


def sft_loss(params: Any, model_cfg: Qwen2Config, batch: dict[str, jax.Array], *,
             chunk_size: int = 64) -> tuple[jax.Array, jax.Array]:
    """Token-mean cross-entropy of the response tokens (f32 scalar) and their count.

    loss = -sum(logprob * response_mask) / max(sum(response_mask), 1), logprobs at temperature 1
    from the trainer's scoring path (`response_states` + chunked `response_logprobs`)."""
    hidden, _ = response_states(params, model_cfg, batch["prompt_ids"], batch["prompt_mask"],
                                batch["response_ids"], batch["response_mask"])
    lp, _ = response_logprobs(params, model_cfg, hidden, batch["response_ids"],
                              batch["response_mask"], chunk_size=chunk_size)
    n = jnp.sum(batch["response_mask"].astype(jnp.float32))
    return -jnp.sum(lp) / jnp.maximum(n, 1.0), n


class SFTTrainer:
    """Jitted behaviour-cloning steps for one model config.

    Args:
      model_cfg: the model. cfg: `SFTConfig` (optimiser and chunking).
    The optimiser is `training.make_optimizer` (global-norm clip, AdamW) with linear warmup then
    cosine decay to 0 at ``cfg.steps``; params and optimiser state are donated to each step.
    """

    def __init__(self, model_cfg: Qwen2Config, cfg: SFTConfig) -> None:
        self.model_cfg, self.cfg = model_cfg, cfg
        tcfg = TrainConfig(lr=cfg.lr, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip,
                           warmup_steps=min(cfg.warmup_steps, cfg.steps - 1),
                           lr_schedule="cosine", decay_steps=cfg.steps)
        self.tx = make_optimizer(tcfg)
        self._step = jax.jit(self._step_fn, donate_argnums=(0, 1))
        self._eval = jax.jit(functools.partial(sft_loss, model_cfg=model_cfg,
                                               chunk_size=cfg.logprob_chunk))

    def _step_fn(self, params, opt_state, batch):
        grad_fn = jax.value_and_grad(
            lambda p: sft_loss(p, self.model_cfg, batch, chunk_size=self.cfg.logprob_chunk),
            has_aux=True)
        (loss, n), grads = grad_fn(params)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def init(self, params: Any) -> Any:
        """Fresh optimiser state for `params`."""
        return self.tx.init(params)

    def step(self, params: Any, opt_state: Any, batch: dict[str, np.ndarray]
             ) -> tuple[Any, Any, jax.Array]:
        """One optimiser step on a `make_sft_batch` batch: (params, opt_state, loss before)."""
        return self._step(params, opt_state, batch)

    def loss(self, params: Any, batch: dict[str, np.ndarray]) -> float:
        """Token-mean response cross-entropy of a batch (no update)."""
        return float(self._eval(params, batch)[0])


def batch_order(n: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """Example indices of every step: epoch-wise shuffles, each batch min(batch_size, n) rows,
    the examples of a batch sorted by nothing (random) but drawn so every example is seen once
    per epoch."""
    rng = np.random.default_rng(seed)
    order: list[int] = []
    out = []
    k = min(batch_size, n)
    for _ in range(steps):
        if len(order) < k:
            order += [int(i) for i in rng.permutation(n)]
        out.append(order[:k])
        order = order[k:]
    return out


def train_sft(params: Any, model_cfg: Qwen2Config, examples: Sequence[SFTExample],
              cfg: SFTConfig, *, pad_id: int = 151643,
              log_fn: Callable[[str], None] | None = None) -> tuple[Any, list[float]]:
    """Behaviour cloning: ``cfg.steps`` AdamW steps of `SFTTrainer` over `examples`.

    Batches hold ``min(batch_size, len(examples))`` rows; prompt and response lengths are
    bucketed per batch. Returns (new params, loss of every step, measured before its update).
    Raises ValueError on no examples.
    """
    if not examples:
        raise ValueError("train_sft needs at least one example (did the expert play any task?)")
    trainer = SFTTrainer(model_cfg, cfg)
    params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)  # donation-safe copy
    opt_state = trainer.init(params)
    rows = min(cfg.batch_size, len(examples))
    losses: list[float] = []
    t0 = last = time.time()
    t1 = None   # end of step 1 (which includes compilation): the ETA uses the steps after it
    if log_fn:
        log_fn(f"sft: {cfg.steps} steps of {rows} examples; compiling the first step ...")
    for i, idx in enumerate(batch_order(len(examples), cfg.batch_size, cfg.steps, cfg.seed)):
        batch = make_sft_batch([examples[j] for j in idx], rows, pad_id)
        params, opt_state, loss = trainer.step(params, opt_state, batch)
        losses.append(float(loss))
        now = time.time()
        t1 = t1 or now
        if log_fn and (i % max(cfg.log_every, 1) == 0 or i == cfg.steps - 1
                       or now - last >= SFT_PROGRESS_S):
            log_fn(sft_progress(i + 1, cfg.steps, losses[-1], now - t0,
                                (now - t1) / i if i else None))
            last = now
    return params, losses


# Seconds between two progress lines of the warm start at most (besides every log_every steps).
SFT_PROGRESS_S = 20.0


def sft_progress(done: int, total: int, loss: float, elapsed_s: float,
                 step_s: float | None) -> str:
    """One progress line of `train_sft`: ``sft step 40/250 [###.....] loss 3.1 | 52 s, eta
    4.1 min``. `step_s` (seconds per step after the first, which compiles) gives the ETA; None
    (after step 1) prints "eta ?"."""
    width = 20
    bar = "#" * int(width * done / max(total, 1))
    eta = "?" if step_s is None else (f"{step_s * (total - done):.0f} s"
                                      if step_s * (total - done) < 120
                                      else f"{step_s * (total - done) / 60:.1f} min")
    return (f"sft step {done}/{total} [{bar:.<{width}}] loss {loss:.4f} | "
            f"{elapsed_s:.0f} s, eta {eta}")


# ---------------------------------------------------------------------------------- runs

def expert_tasks(c: Any, cfg: SFTConfig) -> list[Task]:
    """``cfg.episodes`` tasks of the run's env (``c.env.tasks`` filter) from ``cfg.split``,
    drawn without repeats (TaskSampler, seed ``cfg.seed``)."""
    from envs_bridge import TaskSampler
    from strata_jax import experiment as ex

    return TaskSampler(ex.task_list(c, cfg.split), seed=cfg.seed).sample(cfg.episodes)


def sft_examples(c: Any, tokenizer: Any, cfg: SFTConfig | None = None
                 ) -> tuple[list[SFTExample], list[ExpertEpisode]]:
    """Expert episodes of run config `c` and their examples, rendered with the run's own
    `make_prompt_builder(tokenizer, c)` (budget, history window, cumulative prompts)."""
    from strata_jax import experiment as ex
    from strata_jax.rollout import make_prompt_builder

    cfg = cfg or SFTConfig.from_config(c)
    kw = ex.env_kwargs(c)
    eps = collect_expert_episodes(c.env.name, expert_tasks(c, cfg), noise=cfg.noise,
                                  seed=cfg.seed, max_gold_steps=cfg.max_gold_steps, env_kwargs=kw)
    if not eps:
        raise ValueError(f"no expert episode for env {c.env.name!r} (tasks {tuple(c.env.tasks)}): "
                         "every gold path exceeded sft.max_gold_steps?")
    return build_examples(make_prompt_builder(tokenizer, c), eps, cfg), eps


# Version of the examples' rendering: bump it when prompts or targets change shape, so that a
# cached warm start trained on the old rendering is not reused (2: targets end at the closing
# tag where the sampler's stop string ends generation, not at <|im_end|>).
EXAMPLE_FORMAT = 2


def fingerprint(c: Any, model_cfg: Qwen2Config, cfg: SFTConfig) -> str:
    """A 12-hex id of everything the warm start depends on (data, prompts, model, init)."""
    from strata_jax import experiment as ex

    d = dict(format=EXAMPLE_FORMAT, sft={k: v for k, v in dataclasses.asdict(cfg).items() if k != "cache_dir"},
             model=dataclasses.asdict(model_cfg), init=[c.model.path, c.model.preset, c.seed,
                                                        c.model.dtype, c.model.tokenizer],
             env=[c.env.name, list(c.env.tasks), c.env.max_prompt_tokens, c.env.history_length,
                  c.env.max_steps, bool(c.rollout.cumulative_prompts)],
             env_kwargs=ex.env_kwargs(c))  # e.g. memory_key's code_digits changes the data
    return hashlib.sha1(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:12]


def run_sft(c: Any, model_cfg: Qwen2Config, params: Any, tokenizer: Any, out_dir: str,
            cfg: SFTConfig | None = None, log_fn: Callable[[str], None] | None = None
            ) -> tuple[Any, dict[str, Any]]:
    """Collect experts, train from `params`, export an HF checkpoint to `out_dir`.

    Writes ``out_dir/config.json`` + ``model.safetensors`` (`export_params`, loadable with
    ``--config.model.path=out_dir --config.model.tokenizer=offline``: no tokenizer files are
    written) and ``out_dir/sft_meta.json`` (settings, example counts, losses, wall time).
    Returns (params, meta).
    """
    cfg = cfg or SFTConfig.from_config(c)
    t0 = time.time()
    examples, eps = sft_examples(c, tokenizer, cfg)
    t_data = time.time() - t0
    counts = {k: sum(e.kind == k for e in examples) for k in KINDS}
    (log_fn or log.info)(f"sft: {len(eps)} expert episodes ({sum(e.success for e in eps)} "
                         f"successful, {sum(s.noisy for e in eps for s in e.steps)} noisy steps), "
                         f"examples {counts}, data {t_data:.1f} s")
    params, losses = train_sft(params, model_cfg, examples, cfg,
                               log_fn=log_fn or log.info)
    os.makedirs(out_dir, exist_ok=True)
    export_params(params, model_cfg, out_dir)
    meta = dict(sft=dataclasses.asdict(cfg), episodes=len(eps),
                expert_success=float(np.mean([e.success for e in eps])), examples=counts,
                first_loss=losses[0], final_loss=float(np.mean(losses[-10:])),
                losses=losses[:: max(1, len(losses) // 100)], data_s=t_data,
                wall_s=time.time() - t0, env=c.env.name, tasks=list(c.env.tasks))
    with open(os.path.join(out_dir, META_FILE), "w") as f:
        json.dump(meta, f, indent=1)
    return params, meta


def export_warm_start(c: Any, out: str = "", force: bool = False,
                      log_fn: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The whole `sft.py` job: the run's tokenizer and UN-warmed initial params
    (`experiment.build_model` with ``model.warm_start`` cleared), `run_sft`, export to `out`
    (default `warm_start_dir`). An export whose meta file exists is reused unless `force`.

    Returns {"out": export dir, "cached": bool, "meta": the sft_meta.json dict}."""
    from strata_jax import experiment as ex

    ex.validate(c)
    ex.resolve(c)
    tokenizer = ex.build_tokenizer(c)
    ws = c.model.get("warm_start", "")
    c.model.warm_start = ""
    try:
        model_cfg, params = ex.build_model(c, tokenizer, None)
    finally:
        c.model.warm_start = ws
    out = out or warm_start_dir(c, model_cfg, c.workdir)
    meta_file = os.path.join(out, META_FILE)
    if os.path.isfile(meta_file) and not force:
        with open(meta_file) as f:
            return {"out": out, "cached": True, "meta": json.load(f)}
    _, meta = run_sft(c, model_cfg, params, tokenizer, out, log_fn=log_fn)
    return {"out": out, "cached": False, "meta": meta}


def warm_start_dir(c: Any, model_cfg: Qwen2Config, workdir: str) -> str:
    """Cache dir of the run's warm start: ``<sft.cache_dir or workdir/warm_start>/<fingerprint>``
    (nothing is created here)."""
    cfg = SFTConfig.from_config(c)
    root = cfg.cache_dir or os.path.join(workdir, "warm_start")
    return os.path.join(root, fingerprint(c, model_cfg, cfg))


def maybe_warm_start(c: Any, model_cfg: Qwen2Config, params: Any, tokenizer: Any, workdir: str,
                     mesh: jax.sharding.Mesh | None = None, train: bool = True) -> Any:
    """The run's initial params after the warm start of ``c.model.warm_start``.

    "" (default): `params` unchanged. "sft": behaviour cloning from `params` (see `run_sft`),
    cached: a finished export in `warm_start_dir` is loaded instead of retrained (the meta file
    is written last, so a killed run retrains). Any other value: a directory with an HF export
    (e.g. from ``sft.py``) whose config.json must equal `model_cfg`.
    Returns params in ``c.model.dtype``, placed on `mesh` when given (as `load_params` places).
    Raises ValueError when a given export has another shape; with ``train=False`` (eval), an
    "sft" warm start that is not cached is an `experiment.ConfigError` instead of being trained.
    """
    ws = str(c.model.get("warm_start", "") or "")
    if not ws:
        return params
    dtype = jnp.dtype(c.model.dtype)
    if ws != "sft":
        found = Qwen2Config.from_pretrained(ws)
        if found != model_cfg:
            raise ValueError(f"model.warm_start={ws!r} holds a {found} model but the run builds "
                             f"{model_cfg}; use the same model.preset / path as the SFT run")
        return load_params(ws, model_cfg, dtype=dtype, mesh=mesh)
    out = warm_start_dir(c, model_cfg, workdir)
    if os.path.isfile(os.path.join(out, META_FILE)):
        log.info("warm start: loading cached behaviour-cloning export %s", out)
        return load_params(out, model_cfg, dtype=dtype, mesh=mesh)
    if not train:
        from strata_jax.experiment import ConfigError
        raise ConfigError(f"the warm start of this config is not cached in {out}; train it "
                          "first (python sft.py with the same --config) or pass "
                          "--config.model.warm_start= to use the initial params")
    log.info("warm start: behaviour cloning into %s (once; every run of this setting reuses "
             "it)", out)
    run_sft(c, model_cfg, params, tokenizer, out)
    return load_params(out, model_cfg, dtype=dtype, mesh=mesh)


__all__ = [
    "SFTConfig", "ExpertStep", "ExpertEpisode", "SFTExample", "SFTTrainer", "play_builtin_expert",
    "play_gold", "collect_expert_episodes", "plan_text", "action_response", "judge_response",
    "render_episode", "build_examples", "make_sft_batch", "sft_loss", "batch_order", "train_sft",
    "expert_tasks", "sft_examples", "fingerprint", "run_sft", "export_warm_start", "warm_start_dir",
    "maybe_warm_start", "SCIWORLD_NOISE_ACTIONS", "STRATEGY_MODES",
]
