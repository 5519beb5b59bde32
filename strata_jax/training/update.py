"""The update half of an iteration: scoring passes, advantages, mini-batched PPO steps.

Flow of `Trainer.update(state, batch, ref_params)` (docs/method.md §9):

1. `score_batch` (jitted, no grad, chunks of rows via ``lax.map``): pi_old logprobs = the
   trainer's own recomputation at the train temperature (docs/method.md §9.1), reference logprobs from the
   frozen initial params (when kl_coef != 0), critic values V(h_t) and their dropout std (PPO:
   separate critic; STAPO: value head on the policy trunk). They fill the SampleBatch slots
   old_logprobs / ref_logprobs / values / value_std BEFORE the estimator runs.
2. Advantages from the registry (`compute_advantages(cfg.estimator_name, ...)`, the algo's
   estimator); value targets from the estimator's ``row/value_targets``.
3. `ppo_epochs` passes; each shuffles the valid rows into mini-batches of `mini_batch_size`
   step samples (evenly split), with the strategy samples spread evenly over the mini-batches.
4. `train_minibatch` (jitted): micro-batches of `micro_batch_size` rows in a ``lax.scan``;
   every level's token-mean is normalised by that level's count over the WHOLE mini-batch
   (`loss_normalizers`), so the summed micro-batch gradients equal the mini-batch gradient.
   Micro-batches holding only padding rows are skipped at run time (``lax.cond``). A step with a
   non-finite loss or gradient is skipped: params, critic and both optimizer states are kept
   bit-identical and the step is counted in metrics["skipped_steps"].

Everything jitted is a pure function of (state, arrays) with the model / train configs static;
`Trainer` only holds the static pieces and the mesh.

LoRA (cfg.lora.rank > 0, strata_jax/models/lora.py): `state.params` holds only the adapters
(and opt_state their AdamW moments, so checkpoints hold only those); the frozen base params are
passed where the reference params go (`update(state, batch, ref_params=base)`), serve as the
KL reference for free, and every forward runs ``lora_params(base, adapters)`` (W x + scale * B A x,
never the merged W + scale * B A; the sampler gets the merged copy via `policy_params`). A PPO
critic trunk is its own adapters over the same base.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from strata_jax.algos import (KIND_ACTION, KIND_STRATEGY, PAD_ID, SampleBatch,
                              compute_advantages, loss_mask, loss_normalizers, ppo_loss,
                              value_loss)
from strata_jax.distributed import host_values
from strata_jax.models import Qwen2Config, param_shardings
from strata_jax.models.lora import apply_lora, init_lora, lora_params, lora_shardings
from strata_jax.sharding import logical_to_spec
from strata_jax.training.config import TrainConfig
from strata_jax.training.critic import dropout_values, init_critic, value_from_hidden
from strata_jax.training.scoring import response_logprobs, response_states
from strata_jax.training.state import TrainState, make_optimizer

Params = dict[str, Any]
log = logging.getLogger(__name__)

# Metrics that are already normalised over the whole mini-batch: summed over micro-batches.
_SUM_METRICS = ("loss/action", "loss/strategy", "vf_loss")
_VALUE_METRICS = ("vf_clip_frac", "value_mean", "value_error")
_ID_FIELDS = ("task_id", "strategy_id", "trajectory_id", "step_index", "kind", "anchor_id")


# ----------------------------------------------------------------------------- host helpers


def pad_rows(batch: SampleBatch, multiple: int) -> SampleBatch:
    """Append padding rows (valid False, masks False, ids PAD_ID) so R is a multiple of `multiple`.

    Works on numpy or jax leaves (returns numpy for the padded fields when padding is needed).
    """
    r = batch.num_rows
    extra = (-r) % max(int(multiple), 1)
    if not extra:
        return batch
    out = {}
    for f in dataclasses.fields(batch):
        x = np.asarray(getattr(batch, f.name))
        fill = PAD_ID if f.name in _ID_FIELDS else 0
        pad = np.full((extra,) + x.shape[1:], fill, x.dtype)
        out[f.name] = np.concatenate([x, pad], axis=0)
    return SampleBatch(**out)


_TOKEN_FIELDS = ("response_ids", "response_mask", "sampler_logprobs", "old_logprobs",
                 "ref_logprobs")
_PROMPT_FIELDS = ("prompt_ids", "prompt_mask")


def trim_padding(batch: SampleBatch) -> SampleBatch:
    """Drop the columns that are padding in every row: prompt columns left of the longest
    prompt and response columns right of the longest response, each kept width rounded up to a
    `bucket_size` size (..., 48, 64, 96, 128, ...: at most two compiled shapes per octave).

    Scores and losses are unchanged: a causal forward's output at a column depends only on the
    columns before it, padded keys are masked, RoPE positions count real tokens only, and the
    dropped response columns are off every mask. Returns the batch unchanged when nothing can
    be dropped or a field is a multi-process array (not host-addressable). Numpy or jax leaves.
    """
    from strata_jax.algos.batch import bucket_size
    leaves = [getattr(batch, f) for f in _TOKEN_FIELDS + _PROMPT_FIELDS]
    if any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves):
        return batch
    pm = np.asarray(batch.prompt_mask, bool)
    rm = np.asarray(batch.response_mask, bool)
    tp, tr = pm.shape[1], rm.shape[1]
    cols_p = np.flatnonzero(pm.any(axis=0))
    cols_r = np.flatnonzero(rm.any(axis=0))
    need_p = tp - int(cols_p[0]) if cols_p.size else 1
    need_r = int(cols_r[-1]) + 1 if cols_r.size else 1
    new_p = min(tp, bucket_size(need_p, None, 8))
    new_r = min(tr, bucket_size(need_r, None, 8))
    if (new_p, new_r) == (tp, tr):
        return batch
    out = {f: getattr(batch, f)[:, tp - new_p:] for f in _PROMPT_FIELDS}
    out.update({f: getattr(batch, f)[:, :new_r] for f in _TOKEN_FIELDS})
    return batch.replace(**out)


def num_minibatches(valid: np.ndarray, kind: np.ndarray, mini_batch_size: int) -> int:
    """Mini-batches per epoch that `minibatch_plan` makes: ceil(#valid step samples /
    mini_batch_size) (of the strategy samples when there are no step samples), at least 1."""
    n_act = int(np.sum(valid & (kind == KIND_ACTION)))
    n = n_act or int(np.sum(valid & (kind == KIND_STRATEGY)))
    return max(1, math.ceil(n / mini_batch_size))


def minibatch_plan(valid: np.ndarray, kind: np.ndarray, mini_batch_size: int, row_multiple: int,
                   rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """Row indices of each mini-batch of one epoch.

    The valid step samples are shuffled and split evenly into n = ceil(#step / mini_batch_size)
    mini-batches (at least 1); the valid strategy samples are shuffled and split evenly over the
    same n mini-batches (docs/method.md §9.2). Every mini-batch is padded to the same static row count
    rows = round_up(mini_batch_size + ceil(#strategy / n), row_multiple) so one compilation
    serves every mini-batch and iteration with the same n.
    Returns a list of (idx [rows] int32, real [rows] bool); padding entries point at row 0 with
    real False (the gather marks them invalid).
    """
    act = np.flatnonzero(valid & (kind == KIND_ACTION))
    strat = np.flatnonzero(valid & (kind == KIND_STRATEGY))
    n = num_minibatches(valid, kind, mini_batch_size)
    act, strat = rng.permutation(act), rng.permutation(strat)
    a_chunks, s_chunks = np.array_split(act, n), np.array_split(strat, n)
    share = math.ceil(len(strat) / n)
    rows = max(mini_batch_size + share, max(len(a) + len(s) for a, s in zip(a_chunks, s_chunks)))
    rows = int(math.ceil(rows / row_multiple) * row_multiple)
    plan = []
    for a, s in zip(a_chunks, s_chunks):
        real_idx = np.concatenate([a, s]).astype(np.int32)
        idx = np.zeros(rows, np.int32)
        idx[: real_idx.size] = real_idx
        real = np.zeros(rows, bool)
        real[: real_idx.size] = True
        plan.append((idx, real))
    return plan


# ----------------------------------------------------------------------------- jitted pieces


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


def _score_batch(params, critic_params, ref_params, batch: SampleBatch, key, *,
                 model: Qwen2Config, cfg: TrainConfig, use_ref: bool, chunk_rows: int,
                 use_old: bool = True):
    r = batch.num_rows
    n = r // chunk_rows
    kind = cfg.critic_kind
    if cfg.lora.enabled:  # adapters -> effective params; the base is the reference
        params = effective_params(params, ref_params, cfg)
        if kind == "separate":
            critic_params = {**critic_params,
                             "trunk": effective_params(critic_params["trunk"], ref_params, cfg)}

    def split(x):
        return x.reshape((n, chunk_rows) + x.shape[1:])

    xs = (split(batch.prompt_ids), split(batch.prompt_mask), split(batch.response_ids),
          split(batch.response_mask), jnp.arange(n), split(batch.valid))

    def one(x):
        # A chunk of padding rows only (bucketing pads up to 1.5x) costs nothing: same rule as
        # the training micro-batches.
        *x, ok = x
        return jax.lax.cond(jnp.any(ok), compute, skip, tuple(x))

    def skip(x):
        b, t = x[2].shape
        z = jnp.zeros((b, t), jnp.float32)
        return z, z, jnp.zeros((b,), jnp.float32), jnp.zeros((b,), jnp.float32)

    def compute(x):
        pi, pm, ri, rm, i = x
        run = dict(compute_dtype=cfg.compute_dtype)
        lp_kw = dict(temperature=cfg.temperature, chunk_size=cfg.logprob_chunk,
                     compute_dtype=cfg.compute_dtype)
        old = jnp.zeros(ri.shape, jnp.float32)
        last = None
        if use_old or kind == "head":
            h, last = response_states(params, model, pi, pm, ri, rm, **run)
            if use_old:
                old, _ = response_logprobs(params, model, h, ri, rm, **lp_kw)
        ref = jnp.zeros_like(old)
        if use_ref:
            hr, _ = response_states(ref_params, model, pi, pm, ri, rm, **run)
            ref, _ = response_logprobs(ref_params, model, hr, ri, rm, **lp_kw)
        v = s = jnp.zeros(old.shape[:1], jnp.float32)
        if kind != "none":
            if kind == "separate":
                _, last = response_states(critic_params["trunk"], model, pi, pm, ri, rm, **run)
            v, s = dropout_values(critic_params["head"], last, jax.random.fold_in(key, i),
                                  cfg.dropout_passes, cfg.dropout)
        return old, ref, v, s

    old, ref, v, s = jax.lax.map(one, xs)
    merge = lambda x: x.reshape((r,) + x.shape[2:])  # noqa: E731
    valid = batch.valid
    return batch.replace(old_logprobs=merge(old), ref_logprobs=merge(ref),
                         values=jnp.where(valid, merge(v), 0.0),
                         value_std=jnp.where(valid, merge(s), 0.0))


score_batch = jax.jit(_score_batch, static_argnames=("model", "cfg", "use_ref", "chunk_rows",
                                                     "use_old"))
score_batch.__doc__ = """Fill old_logprobs, ref_logprobs, values, value_std of a SampleBatch.

Args: params (policy; LoRA: the adapters), critic_params (`init_critic` tree), ref_params
(frozen initial policy; ignored unless use_ref or LoRA, where it is the base), batch (R rows, R a multiple of chunk_rows), key (dropout PRNGKey);
static: model, cfg, use_ref, chunk_rows (rows per lax.map step: peak activation memory),
use_old (False: no old-logprob pass, old_logprobs left 0; the on-policy update does not read
them). Returns the batch with old/ref logprobs [R, Tr] f32 (0 off response_mask; ref 0 without
use_ref), values [R] f32 = V(h_t) without dropout, value_std [R] f32 = std over
cfg.dropout_passes dropout passes (0 with no critic / dropout 0; 0 on invalid rows).
"""


def _advantages(batch: SampleBatch, step, *, algo: str, est):
    return compute_advantages(algo, batch, est, step)


advantages = jax.jit(_advantages, static_argnames=("algo", "est"))


def _gather(batch, adv, w, targets, idx, real):
    take = lambda x: jnp.take(x, idx, axis=0)  # noqa: E731
    mb = jax.tree.map(take, batch)
    mb = mb.replace(valid=mb.valid & real)
    return mb, take(adv), take(w), take(targets)


gather_rows = jax.jit(_gather)


def micro_loss(params, critic_params, mb: SampleBatch, adv, w, targets, normalizers, n_values,
               *, model: Qwen2Config, cfg: TrainConfig, base: Params | None = None,
               on_policy: bool = False):
    """Loss of one micro-batch, normalised by whole-mini-batch counts (sums to the mini-batch loss).

    Policy: `ppo_loss` (PPO-clip, dual clip, per-level token means, KL to the reference when
    kl_coef != 0, entropy bonus) with sample weights w. Critic (when present): `value_loss`
    over valid step samples with targets and weights w, divided by n_values (the mini-batch's
    count); for the STAPO head the trunk state h_t enters with gradient scale value_trunk_coef.
    LoRA: params (and a separate critic's trunk) are adapters over `base` (`effective_params`).
    on_policy (static): the update is exactly on-policy (one epoch, one mini-batch), so pi_old is
    the current logprob itself: ``stop_gradient(lp)`` replaces mb.old_logprobs (what the
    skipped old-logprob pass would have computed, same params and dtype; ratio 1), and the
    metric "sampler_abs" (token mean of |sampler - pi_old| logprob) is added.
    Returns (scalar f32, metrics dict of scalars).
    """
    params = effective_params(params, base, cfg)
    h, last = response_states(params, model, mb.prompt_ids, mb.prompt_mask, mb.response_ids,
                              mb.response_mask, remat=cfg.remat, compute_dtype=cfg.compute_dtype)
    lp, ent = response_logprobs(params, model, h, mb.response_ids, mb.response_mask,
                                temperature=cfg.temperature, chunk_size=cfg.logprob_chunk,
                                compute_dtype=cfg.compute_dtype)
    mask = loss_mask(mb)
    old = jax.lax.stop_gradient(lp) if on_policy else mb.old_logprobs
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
            _, hv = response_states(trunk, model, mb.prompt_ids, mb.prompt_mask,
                                    mb.response_ids, mb.response_mask,
                                    remat=cfg.remat, compute_dtype=cfg.compute_dtype)
        v = value_from_hidden(critic_params["head"], hv)
        vmask = mb.valid & (mb.kind == KIND_ACTION)
        vl, vm = value_loss(v, mb.values, targets, vmask, config=cfg.loss, sample_weights=w,
                            num_samples=n_values)
        loss = loss + vl
        metrics = {**metrics, **vm}
    if on_policy:
        gap = jnp.where(mask, jnp.abs(mb.sampler_logprobs - jax.lax.stop_gradient(lp)), 0.0)
        metrics = {**metrics, "sampler_abs": jnp.sum(gap) / jnp.maximum(jnp.sum(mask), 1)}
    return loss, metrics


def _metric_keys(cfg: TrainConfig, on_policy: bool = False) -> tuple[str, ...]:
    keys = ["loss/action", "loss/strategy", "pg_loss", "clip_frac", "dual_clip_frac",
            "approx_kl_old", "ratio_mean"]
    if cfg.loss.kl_coef:
        keys.append("kl")
    if cfg.loss.entropy_coef:
        keys.append("entropy")
    if cfg.critic_kind != "none":
        keys += ["vf_loss", *_VALUE_METRICS]
    if on_policy:
        keys.append("sampler_abs")
    return tuple(keys)


def _accumulate_grads(params, critic_params, mb: SampleBatch, adv, w, targets, base=None, *,
                      model: Qwen2Config, cfg: TrainConfig, on_policy: bool = False):
    rows = mb.num_rows
    m = cfg.micro_batch_size
    if rows % m:
        raise ValueError(f"mini-batch rows {rows} must be a multiple of micro_batch_size {m}")
    valid = mb.valid
    # Rows outside the loss must not carry NaN into the gradient (0 * NaN = NaN).
    adv = jnp.where(valid, adv, 0.0)
    w = jnp.where(valid, w, 0.0)
    targets = jnp.where(valid, targets, 0.0)
    mask = loss_mask(mb)
    norms = loss_normalizers(mask, mb.kind)
    n_values = jnp.sum(valid & (mb.kind == KIND_ACTION)).astype(jnp.float32)
    split = lambda x: x.reshape((rows // m, m) + x.shape[1:])  # noqa: E731
    micro = jax.tree.map(split, (mb, adv, w, targets))
    keys = _metric_keys(cfg, on_policy)
    grad_fn = jax.value_and_grad(micro_loss, argnums=(0, 1), has_aux=True)
    zeros_p = jax.tree.map(jnp.zeros_like, params)
    zeros_c = jax.tree.map(jnp.zeros_like, critic_params)

    def body(carry, xs):
        gp, gc, loss_sum, msum, tok, val = carry
        b, a, ww, tt = xs

        def compute(_):
            (loss, met), (g1, g2) = grad_fn(params, critic_params, b, a, ww, tt, norms,
                                             n_values, model=model, cfg=cfg, base=base,
                                             on_policy=on_policy)
            return loss, {k: met[k] for k in keys}, g1, g2

        def skip(_):
            return (jnp.zeros((), jnp.float32), {k: jnp.zeros((), jnp.float32) for k in keys},
                    zeros_p, zeros_c)

        # Micro-batches of padding rows only (the tail of a short mini-batch) cost nothing.
        loss, met, g1, g2 = jax.lax.cond(jnp.any(b.valid), compute, skip, None)
        n_tok = jnp.sum(loss_mask(b)).astype(jnp.float32)
        n_val = jnp.sum(b.valid & (b.kind == KIND_ACTION)).astype(jnp.float32)
        new_m = {}
        for k in keys:
            scale = 1.0 if k in _SUM_METRICS else (n_val if k in _VALUE_METRICS else n_tok)
            new_m[k] = msum[k] + met[k] * scale
        add = lambda x, y: x + y  # noqa: E731
        return (jax.tree.map(add, gp, g1), jax.tree.map(add, gc, g2), loss_sum + loss, new_m,
                tok + n_tok, val + n_val), None

    init = (zeros_p, zeros_c, jnp.zeros((), jnp.float32),
            {k: jnp.zeros((), jnp.float32) for k in keys}, jnp.zeros((), jnp.float32),
            jnp.zeros((), jnp.float32))
    (gp, gc, loss, msum, tok, val), _ = jax.lax.scan(body, init, micro)
    metrics = {}
    for k in keys:
        denom = 1.0 if k in _SUM_METRICS else jnp.maximum(val if k in _VALUE_METRICS else tok, 1.0)
        metrics[k] = msum[k] / denom
    metrics["tokens"] = tok
    return loss, gp, gc, metrics


accumulate_grads = jax.jit(_accumulate_grads, static_argnames=("model", "cfg", "on_policy"))
accumulate_grads.__doc__ = """Mini-batch loss and gradients summed over micro-batches.

Args: params, critic_params; mb: SampleBatch (rows a multiple of cfg.micro_batch_size); adv,
w, targets [rows] f32; base: the frozen base params when LoRA is on (params = adapters;
gradients are the adapters'), else None; static model, cfg, on_policy (see `micro_loss`). Every micro-batch loss is normalised by the
WHOLE mini-batch's per-level counts (`loss_normalizers`), so the result does not depend on
micro_batch_size. Returns (loss f32, grads of params, grads of critic_params, metrics).
"""


def _train_minibatch(state: TrainState, mb: SampleBatch, adv, w, targets, base=None, *,
                     model: Qwen2Config, cfg: TrainConfig, on_policy: bool = False):
    loss, gp, gc, metrics = _accumulate_grads(state.params, state.critic_params, mb, adv, w,
                                              targets, base, model=model, cfg=cfg,
                                              on_policy=on_policy)
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
    metrics.update(loss=loss, grad_norm=gnorm, critic_grad_norm=cnorm,
                   skipped=1.0 - finite.astype(jnp.float32))
    return state, metrics


train_minibatch = jax.jit(_train_minibatch, static_argnames=("model", "cfg", "on_policy"))
_train_minibatch_donated = jax.jit(_train_minibatch, static_argnames=("model", "cfg", "on_policy"),
                                   donate_argnames=("state",))
train_minibatch.__doc__ = """One optimizer step on one mini-batch (see the module docstring).

Args: state; mb: SampleBatch of the mini-batch rows (old/ref logprobs and values filled;
rows a multiple of cfg.micro_batch_size); adv, w, targets: [rows] f32 advantages, sample
weights, value targets; base: frozen base params when LoRA is on (state.params = adapters, the
only leaves that change), else None; static: model, cfg, on_policy (the only step of an
exactly on-policy update: pi_old = stop_gradient of the current logprobs, see `micro_loss`).
Returns (new state, metrics: loss, grad_norm, critic_grad_norm, skipped (1.0 when the
non-finite step was skipped), tokens, and the token-mean loss metrics of `ppo_loss` /
`value_loss`). The step counter `state.step` is NOT advanced here (it counts iterations).
"""


_merge = jax.jit(apply_lora, static_argnums=(2, 3))


# ----------------------------------------------------------------------------- the trainer


@dataclasses.dataclass
class Trainer:
    """Static pieces of the update (model and train configs, mesh) around the pure jitted steps.

    Args:
      model: Qwen2Config of the policy (and of the PPO critic).
      cfg: TrainConfig (``TrainConfig.from_config(c)``).
      mesh: device mesh (`strata_jax.sharding.make_mesh`); None = default device, no sharding.
    """

    model: Qwen2Config
    cfg: TrainConfig
    mesh: Mesh | None = None

    # -- state -------------------------------------------------------------------------

    @property
    def lora(self) -> bool:
        """True when the trainable params are LoRA adapters (cfg.lora.rank > 0)."""
        return self.cfg.lora.enabled

    def init_state(self, params: Params, key: jax.Array) -> TrainState:
        """A fresh `TrainState` from policy params (step 0): critic per cfg.critic_kind (PPO: a
        copy of params + head), zero optimizer moments, rng = a uint32 [2] key derived from key.
        Everything is placed with `state_shardings` when a mesh is set.
        LoRA: `params` is the frozen base; the state's params are fresh adapters (B = 0)."""
        key = jnp.asarray(key, jnp.uint32)
        if self.lora:
            params = init_lora(self.model, self.cfg.lora, jax.random.fold_in(key, 0x10A))
        k_head, k_state = jax.random.split(key)
        critic = init_critic(self.cfg.critic_kind, params, k_head, self.model.hidden_size,
                             self.cfg.value_head_init_std)

        def build(params, critic, rng):
            tx, ctx = make_optimizer(self.cfg), make_optimizer(self.cfg, critic=True)
            return TrainState(params=params, opt_state=tx.init(params), critic_params=critic,
                              critic_opt_state=ctx.init(critic) if critic else {},
                              step=jnp.zeros((), jnp.int32), rng=rng)

        # Always committed to explicit shardings (SingleDeviceSharding without a mesh), so a
        # fresh and a restored state hit the same compiled update.
        abstract = jax.eval_shape(build, params, critic, k_state)
        shardings = self.state_shardings(abstract)
        return jax.jit(build, out_shardings=shardings)(params, critic, k_state)

    def abstract_state(self, params_like: Params | None = None) -> TrainState:
        """``jax.ShapeDtypeStruct`` tree of the state with this trainer's target shardings
        (the restore target for orbax; works for any device count / mesh). params_like: the
        params tree or its ShapeDtypeStructs (default: float32 random-init shapes); with LoRA
        the base (ignored: the state's params are the adapters)."""
        from strata_jax.models import init_params
        if params_like is None:
            params_like = jax.eval_shape(lambda k: init_params(self.model, k),
                                         jax.random.PRNGKey(0))
        params_like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params_like)
        cfg = self.cfg
        if self.lora:  # params_like is the base; the state holds adapters
            params_like = jax.eval_shape(lambda k: init_lora(self.model, cfg.lora, k),
                                         jax.random.PRNGKey(0))

        def build(params):
            critic = init_critic(cfg.critic_kind, params, jax.random.PRNGKey(0),
                                 self.model.hidden_size, cfg.value_head_init_std)
            tx, ctx = make_optimizer(cfg), make_optimizer(cfg, critic=True)
            return TrainState(params=params, opt_state=tx.init(params), critic_params=critic,
                              critic_opt_state=ctx.init(critic) if critic else {},
                              step=jnp.zeros((), jnp.int32), rng=jax.random.PRNGKey(0))

        abstract = jax.eval_shape(build, params_like)
        shardings = self.state_shardings(abstract)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            abstract, shardings)

    def state_shardings(self, state_like: TrainState) -> TrainState:
        """NamedSharding per leaf of a state: params (and the PPO critic trunk) by the logical
        rules, optimizer moments like their params, everything else replicated."""
        if self.mesh is None:
            # What jit gives unsharded arrays: restored states then hit the same compile cache.
            single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            return jax.tree.map(lambda _: single, state_like)
        mesh = self.mesh
        rep = NamedSharding(mesh, PartitionSpec())
        trainable = lora_shardings if self.lora else param_shardings
        ps = trainable(state_like.params, self.model, mesh)
        cs = {}
        if state_like.critic_params:
            cs = {"head": jax.tree.map(lambda _: rep, state_like.critic_params["head"])}
            if "trunk" in state_like.critic_params:
                cs["trunk"] = trainable(state_like.critic_params["trunk"], self.model, mesh)
        tx, ctx = make_optimizer(self.cfg), make_optimizer(self.cfg, critic=True)
        os_ = optax.tree_map_params(tx, lambda _, s: s, state_like.opt_state, ps,
                                    transform_non_params=lambda _: rep)
        cos = {}
        if state_like.critic_params:
            cos = optax.tree_map_params(ctx, lambda _, s: s, state_like.critic_opt_state, cs,
                                        transform_non_params=lambda _: rep)
        return TrainState(params=ps, opt_state=os_, critic_params=cs, critic_opt_state=cos,
                          step=rep, rng=rep)

    # -- batch placement -----------------------------------------------------------------

    def put_batch(self, batch: SampleBatch) -> SampleBatch:
        """device_put every field with rows over the ("data", "fsdp") mesh axes (replicated when
        the row count does not divide)."""
        if self.mesh is None:
            dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
            return jax.tree.map(lambda x: jax.device_put(x, dev), batch)

        def put(x):
            x = np.asarray(x) if not isinstance(x, jax.Array) else x
            spec = logical_to_spec(("batch",) + (None,) * (x.ndim - 1), x.shape, self.mesh)
            return jax.device_put(x, NamedSharding(self.mesh, spec))

        return jax.tree.map(put, batch)

    def policy_params(self, state: TrainState, base: Params | None = None) -> Params:
        """Params of the current policy for the sampler / export: state.params, or with LoRA
        the base with the adapters merged (jitted ``apply_lora``, merged weights in the base's
        dtype, sharded like the base). Raises ValueError when LoRA is on and base is None."""
        if not self.lora:
            return state.params
        if base is None:
            raise ValueError("LoRA is on: policy_params needs the frozen base params")
        dtype = base["embed"].dtype
        with self._ctx():
            return _merge(base, state.params, self.cfg.lora, dtype)

    def _ctx(self):
        if self.mesh is None:
            import contextlib
            return contextlib.nullcontext()
        return jax.set_mesh(self.mesh)

    # -- the update ----------------------------------------------------------------------

    def on_policy(self, batch: SampleBatch) -> bool:
        """True when the update is exactly on-policy: one epoch of one mini-batch (so pi_old is
        the trainer's current logprob and the PPO ratio is 1 by construction), unless
        cfg.recompute_old asks for the old-logprob pass anyway. A collective on multi-host."""
        cfg = self.cfg
        if cfg.recompute_old or cfg.ppo_epochs != 1:
            return False
        valid, kind = host_values(batch.valid), host_values(batch.kind)
        return num_minibatches(valid, kind, cfg.mini_batch_size) == 1

    def score(self, state: TrainState, batch: SampleBatch, ref_params: Params | None,
              key: jax.Array, use_old: bool = True) -> SampleBatch:
        """Pad rows, place the batch, and fill old/ref logprobs and values (`score_batch`).

        Only the passes something reads run: the old-logprob pass when use_old, the reference
        pass when loss.kl_coef != 0, the critic when there is one; with none of them the batch
        is only padded and placed (no forward)."""
        cfg = self.cfg
        chunk = cfg.score_rows or cfg.micro_batch_size
        use_ref = bool(cfg.loss.kl_coef)
        if self.lora and ref_params is None:
            raise ValueError("LoRA is on (lora.rank > 0): pass the frozen base params as "
                             "ref_params (the model the adapters ride on and the KL reference)")
        if use_ref and ref_params is None:
            raise ValueError("loss.kl_coef != 0 needs ref_params (the frozen initial policy "
                             "params); pass them to update() or set loss.kl_coef = 0")
        batch = self.put_batch(pad_rows(batch, chunk))
        if not (use_old or use_ref or cfg.critic_kind != "none"):
            return batch
        with self._ctx():
            return score_batch(state.params, state.critic_params,
                               ref_params if use_ref or self.lora else None, batch, key,
                               model=self.model,
                               cfg=cfg, use_ref=use_ref, chunk_rows=chunk, use_old=use_old)

    def train_on_batch(self, state: TrainState, batch: SampleBatch, adv: jax.Array,
                       weights: jax.Array, targets: jax.Array, key: jax.Array,
                       base: Params | None = None, on_policy: bool = False
                       ) -> tuple[TrainState, list[dict]]:
        """Epochs x mini-batches of `train_minibatch` on a scored batch with given advantages.

        Args: batch scored (`score`); adv, weights, targets [R] f32; key: shuffling PRNGKey;
        base: the frozen base params when LoRA is on (else ignored); on_policy: the batch was
        scored without the old-logprob pass (`Trainer.on_policy`; must plan one mini-batch).
        Returns (state, per-step metric dicts of device scalars). Does not advance state.step.
        """
        cfg = self.cfg
        # host_values: a multi-host global batch is gathered (every process plans the same steps).
        valid, kind = host_values(batch.valid), host_values(batch.kind)
        seed = int(jax.device_get(jax.random.randint(key, (), 0, 2 ** 31 - 1)))
        rng = np.random.default_rng(seed)
        out = []
        with self._ctx():
            for _ in range(cfg.ppo_epochs):
                for idx, real in minibatch_plan(valid, kind, cfg.mini_batch_size,
                                                cfg.micro_batch_size, rng):
                    mb, a, w, t = gather_rows(batch, adv, weights, targets, jnp.asarray(idx),
                                              jnp.asarray(real))
                    step = _train_minibatch_donated if cfg.donate_state else train_minibatch
                    state, m = step(state, mb, a, w, t, base if self.lora else None,
                                    model=self.model, cfg=cfg, on_policy=on_policy)
                    out.append(m)
        return state, out

    def update(self, state: TrainState, batch: SampleBatch, ref_params: Params | None = None
               ) -> tuple[TrainState, dict[str, float]]:
        """One iteration's update: score, advantages, epochs of mini-batch steps; step += 1.

        Redundant work is skipped (same result): all-padding columns are dropped
        (`trim_padding`, cfg.trim_padding), the old-logprob pass is not run when the update is
        exactly on-policy (`on_policy`; pi_old = the step's own logprobs under stop_gradient),
        the reference pass only runs when loss.kl_coef != 0.

        Args: state; batch: the iteration's SampleBatch (numpy or jax; any row count);
        ref_params: frozen initial policy params (needed when loss.kl_coef != 0, and always with
        LoRA, where they are the base the adapters ride on).
        Returns (new state, metrics: host floats — means over optimizer steps of the loss
        metrics, `skipped_steps` (non-finite steps not applied), `optimizer_steps`, advantage
        metrics of the estimator, `mismatch/sampler_abs` = mean |sampler - trainer| logprob
        over loss tokens). Raises ValueError when kl_coef != 0 and ref_params is None.
        """
        rng, k_score, k_plan = jax.random.split(jnp.asarray(state.rng, jnp.uint32), 3)
        if self.cfg.trim_padding:
            batch = trim_padding(batch)
        on_policy = self.on_policy(batch)
        scored = self.score(state, batch, ref_params, k_score, use_old=not on_policy)
        with self._ctx():
            adv, w, adv_m = advantages(scored, state.step, algo=self.cfg.estimator_name,
                                       est=self.cfg.estimator)
        targets = adv_m.get("row/value_targets", jnp.zeros_like(adv))
        state, steps = self.train_on_batch(state, scored, adv, w, targets, k_plan, ref_params,
                                           on_policy=on_policy)
        state = state.replace(step=state.step + 1, rng=rng)
        if on_policy:  # measured inside the one step, against the same pi_old
            mism = steps[0].pop("sampler_abs")
        else:
            mask = loss_mask(scored)
            mism = jnp.sum(jnp.where(mask, jnp.abs(scored.sampler_logprobs
                                                   - scored.old_logprobs), 0.0)
                           ) / jnp.maximum(jnp.sum(mask), 1)
        host_steps, host_adv, mism = jax.device_get(
            (steps, {k: v for k, v in adv_m.items() if not k.startswith("row/")}, mism))
        metrics: dict[str, float] = {k: float(v) for k, v in host_adv.items()}
        for k in (host_steps[0] if host_steps else {}):
            vals = [float(s[k]) for s in host_steps]
            metrics[f"train/{k}"] = float(np.mean(vals))
        metrics["skipped_steps"] = float(sum(float(s["skipped"]) for s in host_steps))
        metrics["optimizer_steps"] = float(len(host_steps))
        metrics["mismatch/sampler_abs"] = float(mism)
        if metrics["skipped_steps"]:
            log.warning("iteration %d: skipped %d of %d optimizer steps with a non-finite loss or "
                        "gradient (params and optimizer state left unchanged)",
                        int(state.step), int(metrics["skipped_steps"]), len(host_steps))
        return state, metrics
