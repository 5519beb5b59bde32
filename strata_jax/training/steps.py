"""The update's pure jitted functions of (state, arrays), model and train configs static
(docs/method.md §9); `Trainer` (trainer.py) holds the static pieces and calls them from the
host, one prefix-tree packed micro-batch at a time (training/prefix_tree/).

* Scoring (no grad): `gather_chunk` cuts a chunk of rows out of the batch (a cheap program per
  batch shape), `score_rows` runs the passes on it (pi_old logprobs = the trainer's own
  recomputation at the train temperature, docs/method.md §9.1; reference logprobs when
  kl_coef != 0; critic values and their dropout std), `scatter_scores` writes the `Scores`
  back. They fill the SampleBatch before the estimator runs.
* `advantages`: the estimator registry (`compute_advantages`); value targets are the
  estimator's ``row/value_targets``.
* One optimizer step per mini-batch: `minibatch_counts` (the whole mini-batch's loss
  normalisers), then per micro-batch `gather_micro` + `accumulate_micro` (loss and gradients
  of `micro_loss` added to a donated `GradCarry`), then `apply_step` (AdamW; a step with a
  non-finite loss, gradient or update is skipped, params and optimizer states kept
  bit-identical, counted in metrics["skipped"]). Every level's token-mean is normalised by the
  WHOLE mini-batch's count, so the summed micro-batch gradients are the mini-batch gradient.
  Only `accumulate_micro` and `score_rows` run the model, and they see one micro-batch's
  shapes only, whatever the batch's.

The per-row reference of the same update (every row at the batch's width, a ``lax.scan`` over
micro-batches) is per_row.py.

LoRA (cfg.lora.rank > 0, strata_jax/models/lora.py): ``state.params`` holds only the adapters;
the frozen base params ride along as ``base`` / ``ref_params``, and every forward runs
``lora_params(base, adapters)`` (W x + scale * B A x, never the merged W + scale * B A;
`effective_params`). A PPO critic trunk is its own adapters over the same base.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from strata_jax.algos import (KIND_ACTION, SampleBatch, compute_advantages, loss_mask,
                              loss_normalizers, ppo_loss, value_loss)
from strata_jax.models import Qwen2Config
from strata_jax.models.lora import lora_params
from strata_jax.training.batching import trim_columns
from strata_jax.training.config import TrainConfig
from strata_jax.training.critic import dropout_values, value_from_hidden
from strata_jax.training.scoring import (PackedInputs, packed_response_states,
                                         response_logprobs, response_states)
from strata_jax.training.state import TrainState, make_optimizer

Params = dict[str, Any]

# Metrics that are already normalised over the whole mini-batch: summed over micro-batches.
_SUM_METRICS = ("loss/action", "loss/strategy", "vf_loss")
_VALUE_METRICS = ("vf_clip_frac", "value_mean", "value_error")


def effective_params(trainable: Params, base: Params | None, cfg: TrainConfig) -> Params:
    """The model params a forward uses: `trainable` itself, or with LoRA on (cfg.lora.rank > 0)
    ``lora_params(base, trainable, cfg.lora)`` (targeted weights as unmerged `LoraWeight`s: the
    forward adds scale * (x @ A.T) @ B.T, no merged copy of the weights).
    Raises ValueError when LoRA is on and base is None."""
    if not cfg.lora.enabled:
        return trainable
    if base is None:
        raise ValueError("LoRA is on (lora.rank > 0): pass the frozen base params as ref_params "
                         "(they are the model the adapters ride on and the KL reference)")
    return lora_params(base, trainable, cfg.lora)


def scoring_params(params, critic_params, ref_params, cfg: TrainConfig):
    """With LoRA on: adapters -> effective params over the base (the reference)."""
    if cfg.lora.enabled:
        params = effective_params(params, ref_params, cfg)
        if cfg.critic_kind == "separate":
            critic_params = {**critic_params,
                             "trunk": effective_params(critic_params["trunk"], ref_params, cfg)}
    return params, critic_params


def _states(params, model: Qwen2Config, pi, pm, ri, rm, packed: PackedInputs | None, **run):
    """`response_states` of the rows, per row or (packed given) over their prefix-tree packed
    layout (`packed_response_states`: the same values, each shared prefix computed once)."""
    if packed is None:
        return response_states(params, model, pi, pm, ri, rm, **run)
    return packed_response_states(params, model, packed, **run)


def _logprobs(params, model: Qwen2Config, h, ri, rm, packed: PackedInputs | None,
              cfg: TrainConfig):
    """`response_logprobs` of `_states`' h [B, Tr, D] (ri / rm [B, Tr] int32 / bool) at cfg's
    temperature, chunk and dtype: per row, or (packed given) with the LM head on the packed
    micro-batch's real response tokens only (`PackedInputs.response_slot`). Returns (logprob,
    entropy) [B, Tr] f32, 0 off the mask."""
    return response_logprobs(params, model, h, ri, rm, temperature=cfg.temperature,
                             chunk_size=cfg.logprob_chunk, compute_dtype=cfg.compute_dtype,
                             slots=None if packed is None else packed.response_slot)


def score_chunk(params, critic_params, ref_params, pi, pm, ri, rm, key, *, model: Qwen2Config,
                cfg: TrainConfig, use_ref: bool, use_old: bool,
                packed: PackedInputs | None = None):
    """(old [B, Tr], ref [B, Tr], values [B], value_std [B]) f32 of one chunk of rows (params
    already effective: `scoring_params`); packed: the rows' packed layout (`_states`).
    use_old: bool scalar, traced (`score_rows`, `score_batch`): whether the old-logprob pass
    runs (``lax.cond``: one program for both; old 0 without it)."""
    kind = cfg.critic_kind
    run = dict(compute_dtype=cfg.compute_dtype)
    zeros = jnp.zeros(ri.shape, jnp.float32)
    # replayed rows' pi_old is stored: their slots are not in old_slot
    own = packed if packed is None or packed.old_slot is None else \
        dataclasses.replace(packed, response_slot=packed.old_slot)
    last = None
    if kind == "head":   # the value head reads the policy trunk's states either way
        h, last = _states(params, model, pi, pm, ri, rm, packed, **run)
        old = jax.lax.cond(use_old, lambda: _logprobs(params, model, h, ri, rm, own, cfg)[0],
                           lambda: zeros)
    else:
        old = jax.lax.cond(use_old, lambda: _logprobs(
            params, model, _states(params, model, pi, pm, ri, rm, packed, **run)[0], ri, rm,
            own, cfg)[0], lambda: zeros)
    ref = jnp.zeros_like(old)
    if use_ref:
        hr, _ = _states(ref_params, model, pi, pm, ri, rm, packed, **run)
        ref, _ = _logprobs(ref_params, model, hr, ri, rm, packed, cfg)
    v = s = jnp.zeros(old.shape[:1], jnp.float32)
    if kind != "none":
        if kind == "separate":
            _, last = _states(critic_params["trunk"], model, pi, pm, ri, rm, packed, **run)
        v, s = dropout_values(critic_params["head"], last, key, cfg.dropout_passes, cfg.dropout)
    return old, ref, v, s


def _take_rows(batch: SampleBatch, idx, real) -> SampleBatch:
    """Rows idx of every field; padding entries (real False) become invalid rows."""
    mb = jax.tree.map(lambda x: jnp.take(x, idx, axis=0), batch)
    return mb.replace(valid=mb.valid & real)


def _gather_chunk(batch: SampleBatch, idx, real, *, widths):
    return trim_columns(_take_rows(batch, idx, real), *widths)


def _score_rows(params, critic_params, ref_params, b: SampleBatch, key, packed=None, *,
                model: Qwen2Config, cfg: TrainConfig, use_ref: bool, use_old: bool = True):
    params, critic_params = scoring_params(params, critic_params, ref_params, cfg)
    old, ref, v, s = score_chunk(params, critic_params, ref_params, b.prompt_ids, b.prompt_mask,
                                  b.response_ids, b.response_mask, key, model=model, cfg=cfg,
                                  use_ref=use_ref, use_old=use_old, packed=packed)
    return Scores(old, ref, jnp.where(b.valid, v, 0.0), jnp.where(b.valid, s, 0.0))


def _scatter_scores(scores, idx, real, new):
    width, rows = scores[0].shape[1], scores[0].shape[0]
    # Padding entries (real False) point at a real row (row 0): they must not write at all. A
    # scatter with duplicate indices keeps an unspecified one of the writes, so rewriting the
    # old value there could overwrite the real row's new score in the same call. They go to an
    # out-of-range index instead, which mode="drop" discards.
    target = jnp.where(real, idx, rows)
    out = []
    for x, y in zip(scores, new):
        if y.ndim == 2:
            y = jnp.pad(y, ((0, 0), (0, width - y.shape[1])))
        out.append(x.at[target].set(y, mode="drop"))
    return Scores(*out)


gather_chunk = jax.jit(_gather_chunk, static_argnames=("widths",))
gather_chunk.__doc__ = """The rows idx [m] int32 of a SampleBatch, trimmed to static widths =
(prompt columns, response columns) (`batching.trim_columns`; every row must fit), with valid
&= real [m] bool (False = padding entry). A cheap program per batch shape; the programs that
run the model (`score_rows`, `accumulate_micro`) then see only [m, widths] shapes."""

# use_old is traced, not static: whether an iteration's update is on-policy (no old pass) is
# up to its rollout, and a static flag compiled the scoring pass again when it first changed
score_rows = jax.jit(_score_rows, static_argnames=("model", "cfg", "use_ref"))
score_rows.__doc__ = """`score_batch`'s passes on one chunk of rows at its own width.

Args: params, critic_params, ref_params as `score_batch`; b: the chunk (`gather_chunk`: [m, wp]
prompt, [m, wr] response); key: the dropout PRNGKey of this chunk; packed: None, or the
chunk's `PackedInputs` (the forward runs over the prefix-tree packed row instead of the rows'
prompts: same scores; b's prompt columns are then not read); use_old: bool (traced: one
program for both; the old pass runs only when True); static model, cfg, use_ref. Returns `Scores` (old [m, wr], ref [m, wr], values [m], value_std [m]) f32: what the
per-row `score_batch` computes for these rows (values / value_std 0 on invalid rows); `scatter_scores` puts them back.
One compiled program per (m, wp, wr) (packed: per (m, w, wr)).
"""

scatter_scores = jax.jit(_scatter_scores, donate_argnames=("scores",))
scatter_scores.__doc__ = """`Scores` of the whole batch (old_logprobs [R, Tr], ref_logprobs
[R, Tr], values [R], value_std [R]; donated) with the rows idx [m] set to new (`score_rows`' output, response
columns zero-padded to Tr); entries with real [m] False are left unchanged."""


def _advantages(batch: SampleBatch, step, *, algo: str, est):
    return compute_advantages(algo, batch, est, step)


advantages = jax.jit(_advantages, static_argnames=("algo", "est"))



def gather_targets(batch, adv, w, targets, idx, real):
    """The rows idx [m] int32 of `batch` (real [m] bool, False = padding entry, whose row comes
    out invalid) and their adv, w, targets [m] f32 (gathered from the batch's [R])."""
    take = lambda x: jnp.take(x, idx, axis=0)  # noqa: E731
    return _take_rows(batch, idx, real), take(adv), take(w), take(targets)


def micro_loss(params, critic_params, mb: SampleBatch, adv, w, targets, normalizers, n_values,
               *, model: Qwen2Config, cfg: TrainConfig, base: Params | None = None,
               on_policy: bool = False, packed: PackedInputs | None = None):
    """Loss of one micro-batch, normalised by whole-mini-batch counts (sums to the mini-batch loss).

    Policy: `ppo_loss` (PPO-clip, dual clip, per-level token means, KL to the reference when
    kl_coef != 0, entropy bonus) with sample weights w. Critic (when present): `value_loss`
    over valid step samples with targets and weights w, divided by n_values (the mini-batch's
    count); for the STAPO head the trunk state h_t enters with gradient scale value_trunk_coef.
    LoRA: params (and a separate critic's trunk) are adapters over `base` (`effective_params`).
    on_policy: bool, may be traced: the update is exactly on-policy (one epoch, one
    mini-batch), so pi_old is the current logprob itself: ``stop_gradient(lp)`` replaces
    mb.old_logprobs (what the skipped old-logprob pass would have computed, same params and
    dtype; ratio 1), and the metric "sampler_abs" (token mean of |sampler - pi_old| logprob)
    is reported (0 when off-policy). A traced value, not a static one, so one compiled program
    serves both: whether an iteration's rows fit one mini-batch is up to its rollout, and a
    static flag compiled the gradient step again the first time that changed, late in a run.
    packed: None, or mb's `PackedInputs`: the policy (and a separate critic's trunk) run over
    the rows' prefix-tree packed layout (`_states`; same values and gradients, each shared
    prefix computed once; mb's prompt columns are then not read).
    Returns (scalar f32, metrics dict of scalars).
    """
    params = effective_params(params, base, cfg)
    run = dict(remat=cfg.remat, compute_dtype=cfg.compute_dtype, scan_layers=cfg.scan_layers)
    h, last = _states(params, model, mb.prompt_ids, mb.prompt_mask, mb.response_ids,
                      mb.response_mask, packed, **run)
    lp, ent = _logprobs(params, model, h, mb.response_ids, mb.response_mask, packed, cfg)
    mask = loss_mask(mb)
    old = jnp.where(on_policy, jax.lax.stop_gradient(lp), mb.old_logprobs)
    loss, metrics = ppo_loss(
        lp, old, adv, mask, mb.kind, config=cfg.loss, sample_weights=w,
        ref_logprobs=mb.ref_logprobs if cfg.loss.kl_coef else None,
        entropy=ent if cfg.loss.entropy_coef else None, normalizers=normalizers)
    kind = cfg.critic_kind
    if kind != "none":
        if kind == "head":
            sg = jax.lax.stop_gradient(last)
            hv = sg if not cfg.value_trunk_coef else sg + cfg.value_trunk_coef * (last - sg)
        else:
            trunk = effective_params(critic_params["trunk"], base, cfg)
            _, hv = _states(trunk, model, mb.prompt_ids, mb.prompt_mask, mb.response_ids,
                            mb.response_mask, packed, **run)
        v = value_from_hidden(critic_params["head"], hv)
        vmask = mb.valid & (mb.kind == KIND_ACTION)
        vl, vm = value_loss(v, mb.values, targets, vmask, config=cfg.loss, sample_weights=w,
                            num_samples=n_values)
        loss = loss + vl
        metrics = {**metrics, **vm}
    gap = jnp.where(mask, jnp.abs(mb.sampler_logprobs - jax.lax.stop_gradient(lp)), 0.0)
    sampler_abs = jnp.sum(gap) / jnp.maximum(jnp.sum(mask), 1)
    metrics = {**metrics, "sampler_abs": jnp.where(on_policy, sampler_abs, 0.0)}
    return loss, metrics


def metric_keys(cfg: TrainConfig) -> tuple[str, ...]:
    """The metric names a mini-batch step reports for cfg (KL, entropy and the value metrics
    only when their terms are on; "sampler_abs" always, 0 off-policy: `micro_loss`)."""
    keys = ["loss/action", "loss/strategy", "pg_loss", "clip_frac", "dual_clip_frac",
            "approx_kl_old", "ratio_mean"]
    if cfg.loss.kl_coef:
        keys.append("kl")
    if cfg.loss.entropy_coef:
        keys.append("entropy")
    if cfg.critic_kind != "none":
        keys += ["vf_loss", *_VALUE_METRICS]
    keys.append("sampler_abs")
    return tuple(keys)


def masked_targets(valid, adv, w, targets):
    """adv, w, targets [m] f32 with 0 on the rows where valid [m] bool is False."""
    # Rows outside the loss must not carry NaN into the gradient (0 * NaN = NaN).
    return jnp.where(valid, adv, 0.0), jnp.where(valid, w, 0.0), jnp.where(valid, targets, 0.0)


def minibatch_loss_counts(mb: SampleBatch):
    """The whole mini-batch's loss normalizers (`loss_normalizers`) and valid step-sample count."""
    norms = loss_normalizers(loss_mask(mb), mb.kind)
    n_values = jnp.sum(mb.valid & (mb.kind == KIND_ACTION)).astype(jnp.float32)
    return norms, n_values


class GradCarry(NamedTuple):
    """The accumulator of a mini-batch's micro-batches (`accumulate_micro`): a pytree, every
    leaf its own buffer (donatable).

    Attributes: grads (like params, f32), critic_grads (like critic_params), loss (f32 sum of
    the micro-batch losses, each already normalised by whole-mini-batch counts), metric_sums
    ({name: f32} sums, each scaled by what it averages over), tokens (f32 loss tokens),
    step_samples (f32 valid step rows)."""

    grads: Any
    critic_grads: Any
    loss: jax.Array
    metric_sums: dict
    tokens: jax.Array
    step_samples: jax.Array


class Scores(NamedTuple):
    """What the scoring passes fill (`score_rows`, `scatter_scores`): old_logprobs,
    ref_logprobs ([rows, Tr] f32), values, value_std ([rows] f32)."""

    old_logprobs: jax.Array
    ref_logprobs: jax.Array
    values: jax.Array
    value_std: jax.Array


def empty_carry(params, critic_params, keys) -> GradCarry:
    """An empty `GradCarry` for the metric names `keys`."""
    z = lambda: jnp.zeros((), jnp.float32)  # noqa: E731
    return GradCarry(jax.tree.map(jnp.zeros_like, params),
                     jax.tree.map(jnp.zeros_like, critic_params), z(), {k: z() for k in keys},
                     z(), z())


def add_micro_batch(carry, params, critic_params, b: SampleBatch, a, ww, tt, norms, n_values,
                    base, *, model: Qwen2Config, cfg: TrainConfig, on_policy: bool, keys,
                    packed: PackedInputs | None = None):
    """carry + one micro-batch's loss, gradients and metric sums (`micro_loss`; metrics scaled
    by what they average over, so `finish_carry` returns whole-mini-batch means). A micro-batch
    of padding rows only (the tail of a short mini-batch) costs nothing (``lax.cond``)."""
    gp, gc, loss_sum, msum, tok, val = carry
    grad_fn = jax.value_and_grad(micro_loss, argnums=(0, 1), has_aux=True)

    def compute(_):
        (loss, met), (g1, g2) = grad_fn(params, critic_params, b, a, ww, tt, norms, n_values,
                                         model=model, cfg=cfg, base=base, on_policy=on_policy,
                                         packed=packed)
        return loss, {k: met[k] for k in keys}, g1, g2

    def skip(_):
        return (jnp.zeros((), jnp.float32), {k: jnp.zeros((), jnp.float32) for k in keys},
                jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, critic_params))

    loss, met, g1, g2 = jax.lax.cond(jnp.any(b.valid), compute, skip, None)
    n_tok = jnp.sum(loss_mask(b)).astype(jnp.float32)
    n_val = jnp.sum(b.valid & (b.kind == KIND_ACTION)).astype(jnp.float32)
    new_m = {}
    for k in keys:
        scale = 1.0 if k in _SUM_METRICS else (n_val if k in _VALUE_METRICS else n_tok)
        new_m[k] = msum[k] + met[k] * scale
    add = lambda x, y: x + y  # noqa: E731
    return GradCarry(jax.tree.map(add, gp, g1), jax.tree.map(add, gc, g2), loss_sum + loss,
                     new_m, tok + n_tok, val + n_val)


def finish_carry(carry, keys):
    """(loss f32, grads of params, grads of critic_params, metrics) from the accumulator."""
    gp, gc, loss, msum, tok, val = carry
    metrics = {}
    for k in keys:
        denom = 1.0 if k in _SUM_METRICS else jnp.maximum(val if k in _VALUE_METRICS else tok, 1.0)
        metrics[k] = msum[k] / denom
    metrics["tokens"] = tok
    return loss, gp, gc, metrics


def apply_grads(state: TrainState, loss, gp, gc, metrics, *, cfg: TrainConfig):
    """The optimizer half of a mini-batch step: AdamW on params (and critic) from summed
    gradients; a non-finite loss, gradient or update leaves the state bit-identical."""
    gnorm = optax.global_norm(gp)
    cnorm = optax.global_norm(gc) if state.critic_params else jnp.zeros((), jnp.float32)
    finite = jnp.isfinite(gnorm) & jnp.isfinite(cnorm) & jnp.isfinite(loss)
    tx, ctx = make_optimizer(cfg), make_optimizer(cfg, critic=True)
    upd, new_opt = tx.update(gp, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, upd)
    new_critic, new_copt = state.critic_params, state.critic_opt_state
    if state.critic_params:
        cupd, new_copt = ctx.update(gc, state.critic_opt_state, state.critic_params)
        new_critic = optax.apply_updates(state.critic_params, cupd)
    # The update itself must be finite too: finite gradients can still give a NaN step (e.g.
    # Adam's 0/0 with eps = 0), and NaN params would be checkpointed and sampled from.
    finite = finite & jnp.isfinite(optax.global_norm(upd))
    if state.critic_params:
        finite = finite & jnp.isfinite(optax.global_norm(cupd))
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa
    state = state.replace(params=keep(new_params, state.params),
                          opt_state=keep(new_opt, state.opt_state),
                          critic_params=keep(new_critic, state.critic_params),
                          critic_opt_state=keep(new_copt, state.critic_opt_state))
    metrics = dict(metrics, loss=loss, grad_norm=gnorm, critic_grad_norm=cnorm,
                   skipped=1.0 - finite.astype(jnp.float32))
    return state, metrics


# ----------------------------------------------------------------------------- micro-batches
# The same mini-batch step as `train_minibatch`, run from the host one micro-batch at a time so
# each micro-batch has its own shapes (`Trainer`: prefix-tree packed rows). The model runs only
# in programs that see one micro-batch (`accumulate_micro`: one compilation per micro-batch
# shape, whatever the batch's row count or width); the gathers that cut micro-batches out of
# the batch are cheap programs.


def _grouped_counts(batch: SampleBatch, idx, real):
    return minibatch_loss_counts(_take_rows(batch, idx, real))


minibatch_counts = jax.jit(_grouped_counts)
minibatch_counts.__doc__ = """(normalizers, n_values) of the mini-batch of rows idx [rows] int32
(real [rows] bool marks the padding entries) of `batch`: the per-level loss token / sequence
counts (`loss_normalizers`) and the valid step-sample count (f32), shared by its micro-batches."""


def _micro_step(carry, params, critic_params, b: SampleBatch, a, ww, tt, norms, n_values,
                base=None, packed=None, *, model: Qwen2Config, cfg: TrainConfig,
                on_policy: bool = False):
    a, ww, tt = masked_targets(b.valid, a, ww, tt)
    return add_micro_batch(carry, params, critic_params, b, a, ww, tt, norms, n_values, base,
                           model=model, cfg=cfg, on_policy=on_policy,
                           keys=metric_keys(cfg), packed=packed)


accumulate_micro = jax.jit(_micro_step, static_argnames=("model", "cfg"),
                           donate_argnames=("carry",))
accumulate_micro.__doc__ = """carry + one micro-batch's loss, gradients and metric sums.

Args: carry (`zero_carry(params, critic_params, cfg=)` or a previous result;
donated); params, critic_params; b: the micro-batch (`gather_micro`: [m, wp] prompt, [m, wr]
response, its own widths); a, ww, tt [m] f32 advantages, sample weights, value targets; norms,
n_values: the WHOLE mini-batch's counts (`minibatch_counts`); base: the frozen LoRA base or
None; packed: None, or b's `PackedInputs` (the prefix-tree packed forward, `micro_loss`);
on_policy: bool (traced, see `micro_loss`); static model, cfg. Summing every micro-batch of a
mini-batch gives the `accumulate_grads` result up to float summation order. One compiled
program per micro-batch shape (m, wp, wr).
"""


def _gather_micro(batch: SampleBatch, adv, w, targets, idx, real, *, widths):
    b, a, ww, tt = gather_targets(batch, adv, w, targets, idx, real)
    return trim_columns(b, *widths), a, ww, tt


gather_micro = jax.jit(_gather_micro, static_argnames=("widths",))
gather_micro.__doc__ = """`gather_rows` of the micro-batch rows idx [m] int32 (real [m] bool,
False = padding entry), trimmed to static widths = (prompt columns, response columns) kept
(`batching.trim_columns`; every row must fit). Returns (micro-batch, adv, w, targets [m])."""


def zero_carry(params, critic_params, *, cfg: TrainConfig):
    """The empty accumulator `accumulate_micro` adds to: zero gradients like params and
    critic_params (created eagerly, so each keeps its param's sharding on a mesh; under jit they
    would come out replicated), zero loss / metric sums / counts (the metrics of cfg),
    committed to the params' devices (replicated).

    Why committed: jit keys its compiled programs on whether each argument is committed to a
    device, and `accumulate_micro`'s own outputs are; eager ``jnp.zeros`` scalars are not. A
    micro-batch shape met first as a mini-batch's first micro-batch (a fresh carry) and later
    as a following one (a previous result) would otherwise compile the gradient step twice:
    minutes on CPU for a real model."""
    gp, gc, *rest = empty_carry(params, critic_params, metric_keys(cfg))
    sharding = jax.tree.leaves(params)[0].sharding
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, PartitionSpec())
    return GradCarry(gp, gc, *jax.device_put(rest, sharding))


def _apply_carry(state: TrainState, carry, *, cfg: TrainConfig):
    loss, gp, gc, metrics = finish_carry(carry, metric_keys(cfg))
    return apply_grads(state, loss, gp, gc, metrics, cfg=cfg)


_apply_static = ("cfg",)
_apply_accumulated = jax.jit(_apply_carry, static_argnames=_apply_static,
                             donate_argnames=("carry",))
# the state's buffers take the new state; the carry's would be left over (a warning), so only
# the copying variant donates the carry (its gradient buffers can hold the new params)
_apply_accumulated_donated = jax.jit(_apply_carry, static_argnames=_apply_static,
                                     donate_argnames=("state",))


def apply_step(cfg: TrainConfig):
    """The jitted optimizer step on accumulated micro-batches (`accumulate_micro`):
    (state, carry, *, cfg) -> (new state, metrics as `train_minibatch` returns them);
    the state is donated when cfg.donate_state, else the carry is."""
    return _apply_accumulated_donated if cfg.donate_state else _apply_accumulated


__all__ = ["GradCarry", "Scores", "effective_params", "micro_loss", "advantages",
           "gather_chunk", "score_rows", "scatter_scores", "minibatch_counts", "gather_micro",
           "zero_carry", "accumulate_micro", "apply_step"]
