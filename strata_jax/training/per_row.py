"""The per-row update: every row at the batch's width, no prefix sharing. Not a production
path: the reference the packed update (steps.py, `Trainer`) is tested against, and the update
`Trainer(per_row=True)` runs.

* `score_batch` (no grad, chunks of rows via ``lax.map``): pi_old logprobs = the trainer's own
  recomputation at the train temperature (docs/method.md §9.1), reference logprobs (when
  kl_coef != 0), critic values and their dropout std.
* `train_minibatch`: micro-batches of `micro_batch_rows` rows in a ``lax.scan``
  (`accumulate_grads`), each level's token-mean normalised by the WHOLE mini-batch's count
  (`loss_normalizers`); then the optimizer step of steps.py (non-finite steps skipped).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.algos import SampleBatch
from strata_jax.models import Qwen2Config
from strata_jax.training.config import TrainConfig
from strata_jax.training.state import TrainState
from strata_jax.training.steps import (add_micro_batch, apply_grads, empty_carry, finish_carry,
                                       gather_targets, masked_targets, metric_keys,
                                       minibatch_loss_counts, score_chunk, scoring_params)


def _score_batch(params, critic_params, ref_params, batch: SampleBatch, key, *,
                 model: Qwen2Config, cfg: TrainConfig, use_ref: bool, chunk_rows: int,
                 use_old: bool = True):
    r = batch.num_rows
    n = r // chunk_rows
    params, critic_params = scoring_params(params, critic_params, ref_params, cfg)

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
        return score_chunk(params, critic_params, ref_params, pi, pm, ri, rm,
                            jax.random.fold_in(key, i), model=model, cfg=cfg, use_ref=use_ref,
                            use_old=use_old)

    old, ref, v, s = jax.lax.map(one, xs)
    merge = lambda x: x.reshape((r,) + x.shape[2:])  # noqa: E731
    valid = batch.valid
    return batch.replace(old_logprobs=merge(old), ref_logprobs=merge(ref),
                         values=jnp.where(valid, merge(v), 0.0),
                         value_std=jnp.where(valid, merge(s), 0.0))


score_batch = jax.jit(_score_batch, static_argnames=("model", "cfg", "use_ref", "chunk_rows"))
score_batch.__doc__ = """Fill old_logprobs, ref_logprobs, values, value_std of a SampleBatch.

Args: params (policy; LoRA: the adapters), critic_params (`init_critic` tree), ref_params
(frozen initial policy; ignored unless use_ref or LoRA, where it is the base), batch (R rows,
R a multiple of chunk_rows), key (dropout PRNGKey);
static: model, cfg, use_ref, chunk_rows (rows per lax.map step: peak activation memory);
use_old: bool, traced (False: no old-logprob pass, old_logprobs left 0; the on-policy update
does not read them; one program for both, as `score_rows`). Returns the batch with old/ref logprobs [R, Tr] f32 (0 off response_mask; ref 0 without
use_ref), values [R] f32 = V(h_t) without dropout, value_std [R] f32 = std over
cfg.dropout_passes dropout passes (0 with no critic / dropout 0; 0 on invalid rows).
"""


gather_rows = jax.jit(gather_targets)
gather_rows.__doc__ = """(mini-batch, adv, w, targets) of the rows idx [rows] int32 of `batch`
and of the [R] f32 arrays adv, w, targets; entries with real [rows] False become invalid rows."""


def _accumulate_grads(params, critic_params, mb: SampleBatch, adv, w, targets, base=None, *,
                      model: Qwen2Config, cfg: TrainConfig, on_policy: bool = False):
    rows = mb.num_rows
    m = cfg.micro_batch_rows
    if rows % m:
        raise ValueError(f"mini-batch rows {rows} must be a multiple of micro_batch_rows {m}")
    adv, w, targets = masked_targets(mb.valid, adv, w, targets)
    norms, n_values = minibatch_loss_counts(mb)
    split = lambda x: x.reshape((rows // m, m) + x.shape[1:])  # noqa: E731
    micro = jax.tree.map(split, (mb, adv, w, targets))
    keys = metric_keys(cfg)

    def body(carry, xs):
        b, a, ww, tt = xs
        return add_micro_batch(carry, params, critic_params, b, a, ww, tt, norms, n_values,
                               base, model=model, cfg=cfg, on_policy=on_policy,
                               keys=keys), None

    carry, _ = jax.lax.scan(body, empty_carry(params, critic_params, keys), micro)
    return finish_carry(carry, keys)


accumulate_grads = jax.jit(_accumulate_grads, static_argnames=("model", "cfg"))
accumulate_grads.__doc__ = """Mini-batch loss and gradients summed over micro-batches.

Args: params, critic_params; mb: SampleBatch (rows a multiple of cfg.micro_batch_rows); adv,
w, targets [rows] f32; base: the frozen base params when LoRA is on (params = adapters;
gradients are the adapters'), else None; on_policy: bool (traced, see `micro_loss`); static
model, cfg.
Every micro-batch loss is normalised by the WHOLE mini-batch's per-level counts
(`loss_normalizers`), so the result does not depend on micro_batch_rows. Returns (loss f32,
grads of params, grads of critic_params, metrics). Raises ValueError when the rows are not a
multiple of cfg.micro_batch_rows.
"""


def _train_minibatch(state: TrainState, mb: SampleBatch, adv, w, targets, base=None, *,
                     model: Qwen2Config, cfg: TrainConfig, on_policy: bool = False):
    loss, gp, gc, metrics = _accumulate_grads(state.params, state.critic_params, mb, adv, w,
                                              targets, base, model=model, cfg=cfg,
                                              on_policy=on_policy)
    return apply_grads(state, loss, gp, gc, metrics, cfg=cfg)


train_minibatch = jax.jit(_train_minibatch, static_argnames=("model", "cfg"))
_train_minibatch_donated = jax.jit(_train_minibatch, static_argnames=("model", "cfg"),
                                   donate_argnames=("state",))
train_minibatch.__doc__ = """One optimizer step on one mini-batch (see the module docstring).

Args: state; mb: SampleBatch of the mini-batch rows (old/ref logprobs and values filled;
rows a multiple of cfg.micro_batch_rows); adv, w, targets: [rows] f32 advantages, sample
weights, value targets; base: frozen base params when LoRA is on (state.params = adapters, the
only leaves that change), else None; on_policy: bool, traced (the only step of an exactly
on-policy update: pi_old = stop_gradient of the current logprobs, see `micro_loss`); static:
model, cfg.
Returns (new state, metrics: loss, grad_norm, critic_grad_norm, skipped (1.0 when the
non-finite step was skipped), tokens, and the token-mean loss metrics of `ppo_loss` /
`value_loss`). The step counter `state.step` is NOT advanced here (it counts iterations).
"""


def minibatch_step(cfg: TrainConfig):
    """The jitted optimizer step `Trainer.train_on_batch` runs for `cfg`: `train_minibatch`,
    with the state's buffers donated when cfg.donate_state (same arguments and results; the
    input state is deleted by the call)."""
    return _train_minibatch_donated if cfg.donate_state else train_minibatch


__all__ = ["score_batch", "gather_rows", "accumulate_grads", "train_minibatch", "minibatch_step"]
