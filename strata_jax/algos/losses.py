"""PPO-clip policy loss (dual clip, clip-higher), KL to the reference, entropy bonus, the
two-level StraTA objective, and STAPO's weighted value loss, as pure functions of arrays.

The loss never calls the model: the trainer computes per-token logprobs / entropies and passes
them in, so every number here is checkable by hand. Source: docs/method.md §8; verl's
core_algos (compute_policy_loss with dual clip, kl_penalty "low_var_kl", agg_loss).

Normalisation contract (micro-batch accumulation is exact): every level's aggregate divides by a
count passed in `normalizers` (from `loss_normalizers` over the WHOLE mini-batch); summing the
losses of the micro-batches then equals the mini-batch loss. Without `normalizers` the counts of
the arrays given are used. A level with no tokens contributes exactly 0.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from strata_jax.algos.batch import KIND_ACTION, KIND_STRATEGY, SampleBatch
from strata_jax.algos.config import LossConfig

_LOG_RATIO_CLAMP = 20.0  # exp() stays finite; values beyond it are clipped anyway (verl: 20)


def loss_mask(batch: SampleBatch) -> jax.Array:
    """[R, Tr] bool: generated tokens of rows that take part in the loss (response_mask & valid).

    Prompt, observation and judge tokens are never in response_mask, nor tokens after EOS.
    """
    return batch.response_mask & batch.valid[:, None]


def loss_normalizers(mask: jax.Array, kind: jax.Array) -> dict:
    """Token and sequence counts per level, to pass as `normalizers` for every micro-batch.

    Args: mask [R, Tr] bool (`loss_mask` of the whole mini-batch); kind [R] int32.
    Returns: dict of f32 scalars action_tokens, action_seqs, strategy_tokens, strategy_seqs
    (a sequence counts when it has at least one loss token).
    """
    mask = mask.astype(bool)
    out = {}
    for name, lv in (("action", KIND_ACTION), ("strategy", KIND_STRATEGY)):
        m = mask & (kind == lv)[:, None]
        out[f"{name}_tokens"] = jnp.sum(m).astype(jnp.float32)
        out[f"{name}_seqs"] = jnp.sum(jnp.any(m, axis=-1)).astype(jnp.float32)
    return out


def kl_penalty(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: str = "k3",
               clamp: float = 10.0) -> jax.Array:
    """Per-token KL(pi || pi_ref) estimate, [R, Tr] f32 (Schulman's k1 / k2 / k3).

    k1 = log pi - log pi_ref (sign: positive where pi puts more mass than the reference);
    k2 = 0.5 * (log pi - log pi_ref)^2;
    k3 = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1 >= 0, clamped to [-clamp, clamp]
    (verl "low_var_kl"; the log-ratio is pre-clipped to +-20 so exp never overflows, which
    changes nothing: k3 >= 19 there and is clamped anyway).
    Raises ValueError on an unknown estimator.
    """
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        x = jnp.clip(-d, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return jnp.clip(jnp.exp(x) - x - 1.0, -clamp, clamp)
    raise ValueError(f"kl estimator must be k1, k2 or k3, got {estimator!r}")


def mean_kl(logprobs: jax.Array, ref_logprobs: jax.Array, mask: jax.Array,
            config: LossConfig) -> jax.Array:
    """Token mean over `mask` [R, Tr] bool of `kl_penalty` (config's estimator and clamp) of
    logprobs vs ref_logprobs [R, Tr] f32: the loss's KL term as a metric over any rows, e.g.
    every valid row of an iteration whatever its sample weight (`kl/whole_batch`,
    docs/metrics.md). 0 for an empty mask."""
    mask = mask.astype(bool)
    kl = kl_penalty(jnp.where(mask, logprobs, 0.0), jnp.where(mask, ref_logprobs, 0.0),
                    config.kl_estimator, config.kl_clamp)
    return _masked_mean(kl, mask)


def aggregate(x: jax.Array, mask: jax.Array, mode: str, *, num_tokens=None, num_seqs=None,
              norm_len: int = 0) -> jax.Array:
    """Reduce a per-token loss [R, Tr] to a scalar (verl agg_loss modes).

    token-mean:              sum(x * mask) / num_tokens
    seq-mean-token-mean:     sum_seq(sum_tok(x) / len_seq) / num_seqs
    seq-mean-token-sum:      sum_seq(sum_tok(x)) / num_seqs
    seq-mean-token-sum-norm: sum_seq(sum_tok(x) / norm_len) / num_seqs (Dr.GRPO)
    num_tokens / num_seqs default to this mask's counts; a zero count gives 0, not NaN.

    ``norm_len`` is Dr.GRPO's constant (the run's max response length, `LossConfig.norm_len`),
    never the padded width Tr of the batch: that width moves with bucketing and with rows that
    are not even in the loss, which would rescale the loss from batch to batch.
    Raises ValueError on an unknown mode, or seq-mean-token-sum-norm with norm_len <= 0.
    """
    mask = mask.astype(bool)
    xm = jnp.where(mask, x, 0.0)
    if num_tokens is None:
        num_tokens = jnp.sum(mask).astype(jnp.float32)
    if num_seqs is None:
        num_seqs = jnp.sum(jnp.any(mask, axis=-1)).astype(jnp.float32)
    if mode == "token-mean":
        return jnp.sum(xm) / jnp.maximum(num_tokens, 1.0)
    seq_sum = jnp.sum(xm, axis=-1)
    if mode == "seq-mean-token-mean":
        seq = seq_sum / jnp.maximum(jnp.sum(mask, axis=-1).astype(jnp.float32), 1.0)
    elif mode == "seq-mean-token-sum":
        seq = seq_sum
    elif mode == "seq-mean-token-sum-norm":
        if norm_len <= 0:
            raise ValueError(f"agg_mode seq-mean-token-sum-norm needs a constant norm_len > 0 "
                             f"(the run's max response length), got {norm_len}; set "
                             f"loss.norm_len")
        seq = seq_sum / float(norm_len)
    else:
        raise ValueError(f"unknown agg_mode {mode!r}")
    return jnp.sum(seq) / jnp.maximum(num_seqs, 1.0)


def policy_loss_per_token(logprobs, old_logprobs, advantages, mask, config: LossConfig):
    """PPO-clip per-token loss with clip-higher and dual clip; no weights, no aggregation.

    Args: logprobs, old_logprobs [R, Tr] f32; advantages [R] f32 (or [R, Tr]); mask [R, Tr] bool.
    ratio r = exp(log pi - log pi_old) (or, with seq_level_ratio, exp of the sequence's mean
    token log-ratio); L1 = -A r, L2 = -A clip(r, 1 - eps_low, 1 + eps_high), L = max(L1, L2);
    for A < 0 the dual clip caps L at -A * c (c = 3).
    Returns (loss [R, Tr], clipped [R, Tr] bool (L2 > L1), dual_clipped [R, Tr] bool, ratio).
    Masked positions are zeroed before exp, so garbage there gives no NaN value or gradient.
    """
    mask = mask.astype(bool)
    lr = jnp.where(mask, logprobs - old_logprobs, 0.0)
    if config.seq_level_ratio:
        n = jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True).astype(jnp.float32), 1.0)
        lr = jnp.broadcast_to(jnp.sum(lr, axis=-1, keepdims=True) / n, lr.shape)
        lr = jnp.where(mask, lr, 0.0)
    ratio = jnp.exp(jnp.clip(lr, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    a = advantages if advantages.ndim == 2 else advantages[:, None]
    l1 = -a * ratio
    l2 = -a * jnp.clip(ratio, 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high)
    clip1 = jnp.maximum(l1, l2)
    clipped = (l2 > l1) & mask
    if config.dual_clip > 1.0:
        l3 = -a * config.dual_clip
        loss = jnp.where(a < 0, jnp.minimum(l3, clip1), clip1)
        dual = (a < 0) & (clip1 > l3) & mask
    else:
        loss, dual = clip1, jnp.zeros_like(mask)
    return jnp.where(mask, loss, 0.0), clipped, dual, ratio


def _masked_mean(x, m):
    m = m.astype(jnp.float32)
    return jnp.sum(jnp.where(m > 0, x, 0.0)) / jnp.maximum(jnp.sum(m), 1.0)


def ppo_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    kind: jax.Array,
    *,
    config: LossConfig,
    sample_weights: Optional[jax.Array] = None,
    ref_logprobs: Optional[jax.Array] = None,
    entropy: Optional[jax.Array] = None,
    normalizers: Optional[dict] = None,
) -> tuple[jax.Array, dict]:
    """The StraTA objective L = L_act + lambda * L_strat (plain PPO when there are no strategy rows).

    Each level's per-token loss  w * L_clip + kl_coef * KL - entropy_coef * H  is aggregated with
    `config.agg_mode` over that level's tokens only, normalised by that level's count from
    `normalizers` (whole mini-batch); a level with no tokens gives 0.

    Args:
        logprobs, old_logprobs: [R, Tr] f32 per-token log pi_theta / log pi_old of response tokens.
        advantages: [R] f32 per sample (broadcast to its tokens).
        mask: [R, Tr] bool, `loss_mask(batch)`.
        kind: [R] int32 (KIND_ACTION / KIND_STRATEGY; padding rows are masked anyway).
        sample_weights: [R] f32 (STAPO weights; default ones) — multiplies the clip term only.
        ref_logprobs: [R, Tr] f32 reference logprobs (KL term skipped when None or kl_coef == 0).
        entropy: [R, Tr] f32 per-token policy entropy (bonus skipped when None).
        normalizers: `loss_normalizers` of the whole mini-batch (default: of these arrays).
    Returns:
        (scalar loss f32, metrics: loss/action, loss/strategy, pg_loss, clip_frac,
        dual_clip_frac, kl, entropy, approx_kl_old, ratio_mean — token means over `mask`).
    """
    mask = mask.astype(bool)
    if normalizers is None:
        normalizers = loss_normalizers(mask, kind)
    w = jnp.ones(advantages.shape[:1], jnp.float32) if sample_weights is None else sample_weights
    pg, clipped, dual, ratio = policy_loss_per_token(logprobs, old_logprobs, advantages, mask, config)
    tok = pg * w[:, None]
    metrics = {}
    if ref_logprobs is not None and config.kl_coef:
        kl = kl_penalty(jnp.where(mask, logprobs, 0.0), jnp.where(mask, ref_logprobs, 0.0),
                        config.kl_estimator, config.kl_clamp)
        tok = tok + config.kl_coef * kl
        metrics["kl"] = _masked_mean(kl, mask)
    if entropy is not None and config.entropy_coef:
        ent = jnp.where(mask, entropy, 0.0)
        tok = tok - config.entropy_coef * ent
        metrics["entropy"] = _masked_mean(ent, mask)
    levels = {}
    for name, lv in (("action", KIND_ACTION), ("strategy", KIND_STRATEGY)):
        m = mask & (kind == lv)[:, None]
        levels[name] = aggregate(tok, m, config.agg_mode, num_tokens=normalizers[f"{name}_tokens"],
                                 num_seqs=normalizers[f"{name}_seqs"], norm_len=config.norm_len)
    loss = levels["action"] + config.strategy_coef * levels["strategy"]
    lr = jnp.where(mask, logprobs - old_logprobs, 0.0)
    metrics.update({
        "loss/action": levels["action"],
        "loss/strategy": levels["strategy"],
        "pg_loss": _masked_mean(pg * w[:, None], mask),
        "clip_frac": _masked_mean(clipped.astype(jnp.float32), mask),
        "dual_clip_frac": _masked_mean(dual.astype(jnp.float32), mask),
        "approx_kl_old": _masked_mean(-lr, mask),
        "ratio_mean": _masked_mean(ratio, mask),
    })
    return loss, metrics


def value_loss(
    values: jax.Array,
    old_values: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    *,
    config: LossConfig,
    sample_weights: Optional[jax.Array] = None,
    num_samples=None,
) -> tuple[jax.Array, dict]:
    """(STAPO-weighted) clipped value loss, one value per sample.

    L_vf = c1 * sum(w * max((V - T)^2, (V_clip - T)^2)) / num_samples, V_clip = V_old +
    clip(V - V_old, -value_clip, value_clip) (off when value_clip <= 0), c1 = value_coef (0.5).
    Args: values, old_values, targets [R] f32; mask [R] bool (valid samples that have a value);
    sample_weights [R] f32 (default ones; STAPO passes its weights); num_samples: the whole
    mini-batch's count of masked samples (default: this mask's), 0 gives loss 0.
    Returns (scalar loss, metrics: vf_loss, vf_clip_frac, value_mean, value_error = mean (V - T)^2).
    Source: docs/method.md §8.6 (value clip 0.5), §7.4 (L_vf = c1 * mean(w * (V - V_target)^2)).
    """
    mask = mask.astype(bool)
    w = jnp.ones_like(values) if sample_weights is None else sample_weights
    err = jnp.where(mask, values - targets, 0.0) ** 2
    if config.value_clip and config.value_clip > 0:
        vc = old_values + jnp.clip(values - old_values, -config.value_clip, config.value_clip)
        err_c = jnp.where(mask, vc - targets, 0.0) ** 2
        per = jnp.maximum(err, err_c)
        clip_frac = _masked_mean((err_c > err).astype(jnp.float32), mask)
    else:
        per, clip_frac = err, jnp.zeros((), jnp.float32)
    n = jnp.sum(mask).astype(jnp.float32) if num_samples is None else num_samples
    loss = config.value_coef * jnp.sum(jnp.where(mask, w * per, 0.0)) / jnp.maximum(n, 1.0)
    return loss, {"vf_loss": loss, "vf_clip_frac": clip_frac,
                  "value_mean": _masked_mean(values, mask),
                  "value_error": _masked_mean(err, mask)}
