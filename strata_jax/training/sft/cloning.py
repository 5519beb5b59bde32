"""Behaviour cloning: batches, the loss and the jitted trainer.

Cross-entropy on response tokens only (the prompt is context, never a target; docs/method.md
§1.3), token-mean over the batch, AdamW with global-norm clipping (`make_optimizer`), one jitted
step per batch; prompts are left-padded and responses right-padded to widths planned over the
whole run (`batch_shapes`), so a run compiles at most ``sft.max_shapes`` step programs
(docs/design.md §6.3). The forward and the chunked LM-head logprobs are the RL trainer's own
(`response_states` / `response_logprobs`), so the model scores exactly the columns the RL
update scores. With ``sft.lora_rank`` > 0 the step trains LoRA adapters instead
(`strata_jax.models.lora`: the forward runs ``lora_params(base, adapters)``, the base is
frozen and never donated), with the same loss, data and optimiser.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from strata_jax.models import Qwen2Config
from strata_jax.models.lora import init_lora, lora_params, lora_shardings
from strata_jax.models.tokenizer import ENDOFTEXT_ID
from strata_jax.buckets import bucket, plan_rungs, rung_for
from strata_jax.training.config import TrainConfig
from strata_jax.training.scoring import response_logprobs, response_states
from strata_jax.training.sft.config import SFTConfig
from strata_jax.training.sft.render import SFTExample
from strata_jax.training.state import make_optimizer


# Width multiples of the warm start's batches: prompt columns (also the smallest prompt width)
# and response columns.
PROMPT_MULTIPLE = 64
RESPONSE_MULTIPLE = 8


def make_sft_batch(examples: Sequence[SFTExample], rows: int, pad_id: int = ENDOFTEXT_ID,
                   prompt_floor: int = PROMPT_MULTIPLE,
                   response_multiple: int = RESPONSE_MULTIPLE,
                   shape: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
    """Pad examples into one batch (numpy).

    Returns prompt_ids / prompt_mask [rows, Tp] (LEFT-padded, as the SampleBatch) and
    response_ids / response_mask [rows, Tr] (RIGHT-padded); int32 / bool. ``shape`` = (Tp, Tr)
    when given (a run's planned widths, `batch_shapes`); else Tp is a power-of-two bucket
    (floor `prompt_floor`) and Tr is rounded up to a multiple of `response_multiple`. Rows
    beyond the examples are all-pad with an empty mask (no loss).
    The loss mask is exactly ``response_mask``: target tokens, never prompt tokens.
    Raises ValueError for more examples than rows, an empty list, or a `shape` too small for
    an example.
    """
    if not examples or len(examples) > rows:
        raise ValueError(f"need 1..{rows} examples for a batch of {rows} rows, got {len(examples)}")
    need_p = max(e.prompt.num_tokens for e in examples)
    need_r = max(len(e.response_ids) for e in examples)
    if shape is None:
        tp = bucket(need_p, prompt_floor)
        tr = -(-need_r // response_multiple) * response_multiple
    else:
        tp, tr = shape
        if need_p > tp or need_r > tr:
            raise ValueError(f"batch shape {shape} cannot hold a {need_p}-token prompt and a "
                             f"{need_r}-token response: plan it over these examples "
                             "(batch_shapes)")
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
             chunk_size: int = 64, remat: str = "none") -> tuple[jax.Array, jax.Array]:
    """Token-mean cross-entropy of the response tokens (f32 scalar) and their count.

    loss = -sum(logprob * response_mask) / max(sum(response_mask), 1), logprobs at temperature 1
    from the trainer's scoring path (`response_states` + chunked `response_logprobs`). remat:
    the per-layer rematerialisation policy of the forward ("none" | "full" | "dots"), the run's
    ``model.remat``: the same values, less activation memory (full fine-tuning of a real model
    keeps params, gradients and AdamW moments besides)."""
    hidden, _ = response_states(params, model_cfg, batch["prompt_ids"], batch["prompt_mask"],
                                batch["response_ids"], batch["response_mask"], remat=remat)
    lp, _ = response_logprobs(params, model_cfg, hidden, batch["response_ids"],
                              batch["response_mask"], chunk_size=chunk_size)
    n = jnp.sum(batch["response_mask"].astype(jnp.float32))
    return -jnp.sum(lp) / jnp.maximum(n, 1.0), n


class SFTTrainer:
    """Jitted behaviour-cloning steps for one model config.

    Args:
      model_cfg: the model. cfg: `SFTConfig` (optimiser, chunking, LoRA). remat: the forward's
        rematerialisation policy (`sft_loss`).
    The trained tree is the params (``cfg.lora_rank`` 0) or the LoRA adapters, whose steps
    take the frozen base as a further argument (``base``, never donated or updated).
    The optimiser is `training.make_optimizer` (global-norm clip, AdamW) with linear warmup then
    cosine decay to 0 at ``cfg.steps``; params and optimiser state are donated to each step.
    Params on a mesh (a checkpoint loaded onto it, or a preset placed there) keep their
    placement through every step (`init` places the optimiser state to match), so the first
    step's program serves them all.
    """

    def __init__(self, model_cfg: Qwen2Config, cfg: SFTConfig, remat: str = "none") -> None:
        self.model_cfg, self.cfg, self.remat = model_cfg, cfg, remat
        self.lora = cfg.lora   # LoraConfig, or None: full fine-tuning
        tcfg = TrainConfig(lr=cfg.lr, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip,
                           warmup_steps=min(cfg.warmup_steps, cfg.steps - 1),
                           lr_schedule="cosine", decay_steps=cfg.steps)
        self.tx = make_optimizer(tcfg)
        self._step = jax.jit(self._step_fn, donate_argnums=(0, 1))
        self._pinned = None   # the step with its outputs placed like its inputs (params on a mesh)
        self._eval = jax.jit(self._loss_fn)

    def _loss_fn(self, trained, batch, base=None):
        """`sft_loss` of the params `trained`, or of ``lora_params(base, trained)`` (LoRA)."""
        params = trained if base is None else lora_params(base, trained, self.lora)
        return sft_loss(params, self.model_cfg, batch, chunk_size=self.cfg.logprob_chunk,
                        remat=self.remat)

    def _step_fn(self, params, opt_state, batch, base=None):
        (loss, n), grads = jax.value_and_grad(self._loss_fn, has_aux=True)(params, batch, base)
        updates, opt_state = self.tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def init(self, params: Any) -> Any:
        """Fresh optimiser state for `params`; for params on a mesh, the moments placed like
        their params and the step counts replicated on that mesh."""
        opt_state = self.tx.init(params)
        sharding = jax.tree.leaves(params)[0].sharding
        if not isinstance(sharding, NamedSharding):
            return opt_state
        rep = NamedSharding(sharding.mesh, PartitionSpec())
        return jax.tree.map(lambda x: x if isinstance(x.sharding, NamedSharding)
                            else jax.device_put(x, rep), opt_state)

    def step(self, params: Any, opt_state: Any, batch: dict[str, np.ndarray],
             base: Any = None) -> tuple[Any, Any, jax.Array]:
        """One optimiser step on a `make_sft_batch` batch: (params, opt_state, loss before);
        `params` is the trained tree (the adapters under LoRA, with `base` the frozen params).
        Params on a mesh come back placed as they went in (the first call's placement)."""
        sharding = jax.tree.leaves(params)[0].sharding
        if not isinstance(sharding, NamedSharding):
            return self._step(params, opt_state, batch, base)
        if self._pinned is None:
            out = jax.tree.map(lambda x: x.sharding, (params, opt_state))
            rep = NamedSharding(sharding.mesh, PartitionSpec())
            self._pinned = jax.jit(self._step_fn, donate_argnums=(0, 1),
                                   out_shardings=(*out, rep))
        return self._pinned(params, opt_state, batch, base)

    def loss(self, params: Any, batch: dict[str, np.ndarray], base: Any = None) -> float:
        """Token-mean response cross-entropy of a batch (no update; `base` as in `step`)."""
        return float(self._eval(params, batch, base)[0])

    def initial(self, params: Any) -> Any:
        """The tree the steps train from initial params `params`: a donation-safe copy of them,
        or (LoRA) fresh adapters (`init_lora`, B = 0, key from ``cfg.seed``), placed on the
        params' mesh like the RL trainer's (`lora_shardings`) when the params are on one."""
        if self.lora is None:
            return jax.tree.map(lambda x: jnp.array(x, copy=True), params)
        adapters = init_lora(self.model_cfg, self.lora, jax.random.PRNGKey(self.cfg.seed))
        sharding = jax.tree.leaves(params)[0].sharding
        if isinstance(sharding, NamedSharding):
            adapters = jax.device_put(adapters, lora_shardings(adapters, self.model_cfg,
                                                               sharding.mesh))
        return adapters


def batch_order(n: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """Example indices of every step: epoch-wise shuffles, each batch min(batch_size, n)
    distinct rows, every example seen once per epoch.

    Epoch e is a permutation of range(n) (numpy default_rng(seed), drawn in turn); the batches
    read the epochs back to back. A batch that crosses an epoch boundary (n not a multiple of
    the batch) tops up the old epoch's last examples with the first examples of the new epoch
    that it does not already hold; the ones it skipped keep their place in the new epoch's
    order after it, so the epoch still holds each example once and no batch holds one twice.
    When n is a multiple of the batch no batch crosses a boundary: the epochs are read as drawn.
    Returns `steps` lists of indices in [0, n).
    """
    rng = np.random.default_rng(seed)
    order: list[int] = []
    out = []
    k = min(batch_size, n)
    for _ in range(steps):
        if len(order) < k:
            held = set(order)
            new = [int(i) for i in rng.permutation(n)]
            fresh = [i for i in new if i not in held]
            top_up = fresh[:k - len(order)]
            chosen = set(top_up)
            order += top_up + [i for i in new if i not in chosen]
        out.append(order[:k])
        order = order[k:]
    return out


def column_costs(model_cfg: Qwen2Config) -> tuple[float, float]:
    """Multiply-adds per batch column (one token position of one row) of a behaviour-cloning
    step's forward, as floats (prompt column, response column): every column runs the decoder
    layers (the q, k, v, o projections and the gated MLP, Qwen2's shapes); a response column
    also runs the LM head (vocabulary x hidden). The backward's work is proportional, so the
    ratio is the step's. Attention's own work (quadratic in the width) is left out: a small
    share at warm-start widths. Only the ratio matters to `batch_shapes`."""
    h, layers = model_cfg.hidden_size, model_cfg.num_layers
    q = model_cfg.num_heads * model_cfg.head_dim
    kv = model_cfg.num_kv_heads * model_cfg.head_dim
    body = layers * (h * (2 * q + 2 * kv) + 3 * h * model_cfg.intermediate_size)
    return float(body), float(body + model_cfg.vocab_size * h)


def batch_shapes(examples: Sequence[SFTExample], order: Sequence[Sequence[int]],
                 max_shapes: int, costs: tuple[float, float] = (1.0, 1.0)
                 ) -> list[tuple[int, int] | None]:
    """The (prompt, response) width of every step's batch, planned over the whole run.

    ``max_shapes`` > 0: kp prompt widths and kr response widths with kp * kr <= max_shapes
    (`buckets.plan_rungs` over the steps' longest prompt and response, multiples of
    `PROMPT_MULTIPLE` / `RESPONSE_MULTIPLE`), the split (kp, kr) that costs least in all,
    ``costs[0] * sum(prompt widths) + costs[1] * sum(response widths)`` over the steps
    (`column_costs`: a model with a large vocabulary and a small body spends its rungs on
    the responses, a deep one on the prompts); so the run compiles at most max_shapes step
    programs, all known before the first step. 0: None per step (`make_sft_batch`'s per-batch
    buckets, one program per distinct bucket pair met).

    Args:
      examples: the run's examples. order: the steps' example indices (`batch_order`).
      max_shapes: >= 0. costs: (prompt, response) work per column, any unit (`column_costs`).
    Returns:
      one (prompt width, response width) int pair per step, or None per step for 0.
    Raises:
      ValueError: an empty `order` or an empty step (`buckets.plan_rungs`)."""
    if not max_shapes:
        return [None] * len(order)
    need_p = [max(examples[j].prompt.num_tokens for j in idx) for idx in order]
    need_r = [max(len(examples[j].response_ids) for j in idx) for idx in order]

    best = None
    for kp in range(1, max_shapes + 1):
        ps = plan_rungs(need_p, kp, PROMPT_MULTIPLE)
        rs = plan_rungs(need_r, max_shapes // kp, RESPONSE_MULTIPLE)
        cost = (costs[0] * sum(rung_for(n, ps) for n in need_p)
                + costs[1] * sum(rung_for(n, rs) for n in need_r))
        if best is None or cost < best[0]:
            best = (cost, ps, rs)
    _, ps, rs = best
    return [(rung_for(p, ps), rung_for(r, rs)) for p, r in zip(need_p, need_r)]


def train_sft(params: Any, model_cfg: Qwen2Config, examples: Sequence[SFTExample],
              cfg: SFTConfig, *, pad_id: int = ENDOFTEXT_ID, remat: str = "none",
              log_fn: Callable[[str], None] | None = None) -> tuple[Any, list[float]]:
    """Behaviour cloning: ``cfg.steps`` AdamW steps of `SFTTrainer` over `examples`.

    Batches hold ``min(batch_size, len(examples))`` rows; their prompt and response widths
    are planned over the run (`batch_shapes`, ``cfg.max_shapes``); remat is the forward's
    rematerialisation policy (`sft_loss`). Returns
    (trained, loss of every step, measured before its update): trained is the new params, or
    with ``cfg.lora_rank`` > 0 the adapters pytree (`strata_jax.models.lora`, float32) trained
    over `params`, which stay as they are (the warm start is ``apply_lora(params, adapters,
    cfg.lora)``).
    Raises ValueError on no examples.
    """
    if not examples:
        raise ValueError("train_sft needs at least one example (did the expert play any task?)")
    trainer = SFTTrainer(model_cfg, cfg, remat)
    base = None if trainer.lora is None else params
    params = trainer.initial(params)
    opt_state = trainer.init(params)
    rows = min(cfg.batch_size, len(examples))
    losses: list[float] = []
    t0 = last = prev = time.time()
    clock = StepClock()   # the ETA's rate, from steps that compiled nothing
    order = batch_order(len(examples), cfg.batch_size, cfg.steps, cfg.seed)
    shapes = batch_shapes(examples, order, cfg.max_shapes, column_costs(model_cfg))
    if log_fn:
        what = "" if trainer.lora is None else f" (rank-{cfg.lora_rank} LoRA adapters)"
        planned = ""
        if cfg.max_shapes:
            ps, rs = sorted({s[0] for s in shapes}), sorted({s[1] for s in shapes})
            planned = (f" in {len(set(shapes))} batch shapes (prompt widths "
                       f"{'/'.join(map(str, ps))}, response widths {'/'.join(map(str, rs))})")
        log_fn(f"sft: {cfg.steps} steps of {rows} examples{what}{planned}; compiling the first "
               "step ...")
    for i, (idx, shape) in enumerate(zip(order, shapes)):
        batch = make_sft_batch([examples[j] for j in idx], rows, pad_id, shape=shape)
        params, opt_state, loss = trainer.step(params, opt_state, batch, base)
        losses.append(float(loss))
        now = time.time()
        clock.observe((batch["prompt_ids"].shape, batch["response_ids"].shape), now - prev)
        prev = now
        if log_fn and (i % max(cfg.log_every, 1) == 0 or i == cfg.steps - 1
                       or now - last >= SFT_PROGRESS_S):
            log_fn(sft_progress(i + 1, cfg.steps, losses[-1], now - t0, clock.step_s()))
            last = now
    return params, losses


class StepClock:
    """Seconds per step for the warm start's ETA, from the steps that ran an already compiled
    program: a step whose batch shape is new to the process compiled that shape's program
    (batches are bucketed by length, so new shapes keep coming for a while), and its time says
    nothing about the steps left. `step_s` is None until `SFT_ETA_SETTLE` such steps ran."""

    def __init__(self) -> None:
        self.shapes: set = set()
        self.seconds, self.steps = 0.0, 0

    def observe(self, shape: tuple, seconds: float) -> None:
        """One step of batch `shape` that took `seconds` (wall)."""
        if shape in self.shapes:
            self.seconds, self.steps = self.seconds + seconds, self.steps + 1
        self.shapes.add(shape)

    def step_s(self) -> float | None:
        """Mean wall seconds per step over the known-shape steps; None before
        `SFT_ETA_SETTLE` of them ran (the line then says "eta after compile")."""
        return self.seconds / self.steps if self.steps >= SFT_ETA_SETTLE else None


# Seconds between two progress lines of the warm start at most (besides every log_every steps).
SFT_PROGRESS_S = 20.0
# Steps of already compiled shapes before the warm start's line gives an ETA (`StepClock`).
SFT_ETA_SETTLE = 5


def sft_progress(done: int, total: int, loss: float, elapsed_s: float,
                 step_s: float | None) -> str:
    """One progress line of `train_sft`: ``sft step 40/250 [###.....] loss 3.1 | 52 s, eta
    4.1 min``. `step_s` (seconds per step after the first, which compiles) gives the ETA; None
    (until `SFT_ETA_SETTLE` steps ran after the first) prints "eta after compile"."""
    width = 20
    bar = "#" * int(width * done / max(total, 1))
    from strata_jax.metrics import format_eta
    eta = format_eta(None if step_s is None else step_s * (total - done))
    return (f"sft step {done}/{total} [{bar:.<{width}}] loss {loss:.4f} | "
            f"{elapsed_s:.0f} s, {eta}")


__all__ = ["make_sft_batch", "sft_loss", "SFTTrainer", "batch_order", "batch_shapes",
           "column_costs", "train_sft", "sft_progress", "SFT_PROGRESS_S", "SFT_ETA_SETTLE",
           "StepClock"]
