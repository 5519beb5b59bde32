"""STAPO's selective sample weights (docs/method.md §7.3; the STAPO write-up sec. 2.1, 3 step 4).

Given per-sample advantages A (GAE over the trajectory-aware critic for `algo = stapo`, or any
estimator's advantages for the `stapo_weighting` modifier):

    A >  eta  -> w = 1           (or w = A with stapo_w_pos = "advantage")
    A < -eta  -> w = w_neg (0.3)
    |A| <= eta -> w = floor (0)
    w += c_u * std(V)           dropout uncertainty bonus, every sample incl. the mediocre band
                                (c_u = 0 without a critic)
    w *= n / sum(w)             mean 1 over the valid samples of each level (our pin; the source
                                says "sum to 1"); all-zero weights stay 0 (loss 0, logged empty).

eta is fixed (0.5) or the q-quantile of |A| over the batch's valid samples, q annealed linearly
from `stapo_eta_quantile` to `stapo_eta_quantile_end` over `stapo_anneal_steps` steps.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from strata_jax.algos.config import EstimatorConfig


def stapo_eta(adv: jax.Array, mask: jax.Array, config: EstimatorConfig, step) -> jax.Array:
    """The selection threshold eta (scalar f32) for this training step.

    Args: adv [R] f32; mask [R] bool (valid samples); step: int scalar (traced is fine).
    Returns: config.stapo_eta when stapo_eta_quantile < 0, else the annealed quantile of |A|
    (linear interpolation, numpy's default) over the masked samples; NaN if none is valid.
    """
    if config.stapo_eta_quantile < 0:
        return jnp.asarray(config.stapo_eta, jnp.float32)
    q0 = config.stapo_eta_quantile
    q1 = config.stapo_eta_quantile_end if config.stapo_eta_quantile_end >= 0 else q0
    frac = jnp.clip(jnp.asarray(step, jnp.float32) / max(config.stapo_anneal_steps, 1), 0.0, 1.0)
    q = q0 + (q1 - q0) * frac
    vals = jnp.where(mask, jnp.abs(adv), jnp.nan)
    return jnp.nanquantile(vals, q).astype(jnp.float32)


def stapo_weights(
    adv: jax.Array,
    mask: jax.Array,
    level: jax.Array,
    value_std: jax.Array,
    config: EstimatorConfig,
    step,
    *,
    uncertainty_coef: float,
) -> tuple[jax.Array, dict]:
    """Selective, uncertainty-boosted, mean-1 sample weights.

    Args:
        adv: [R] f32 advantages; mask: [R] bool valid samples; level: [R] int32 (kind: weights
        are normalised to mean 1 within each level separately); value_std: [R] f32 std of V over
        dropout passes; step: training step (quantile annealing); uncertainty_coef: c_u.
    Returns:
        (weights [R] f32, 0 off-mask; metrics: stapo/eta, stapo/selected_frac (|A| > eta),
        stapo/selected_adv_mean, stapo/empty (1.0 when every weight is 0),
        stapo/weight_max, stapo/value_std_mean).
    """
    maskf = mask.astype(jnp.float32)
    eta = stapo_eta(adv, mask, config, step)
    pos = adv > eta
    neg = adv < -eta
    w_pos = jnp.ones_like(adv) if config.stapo_w_pos == "one" else adv
    w = jnp.where(pos, w_pos, jnp.where(neg, config.stapo_w_neg, config.stapo_floor))
    if uncertainty_coef:
        w = w + uncertainty_coef * value_std
    w = jnp.where(mask, w, 0.0).astype(jnp.float32)
    out = jnp.zeros_like(w)
    for lv in (0, 1):  # ACTION, STRATEGY levels: mean 1 within each
        in_lv = mask & (level == lv)
        n = jnp.sum(in_lv.astype(jnp.float32))
        s = jnp.sum(jnp.where(in_lv, w, 0.0))
        scale = jnp.where(s > 0, n / jnp.where(s > 0, s, 1.0), 0.0)
        out = jnp.where(in_lv, w * scale, out)
    selected = (pos | neg) & mask
    n_valid = jnp.maximum(jnp.sum(maskf), 1.0)
    n_sel = jnp.sum(selected.astype(jnp.float32))
    metrics = {
        "stapo/eta": eta,
        "stapo/selected_frac": n_sel / n_valid,
        "stapo/selected_adv_mean": jnp.sum(jnp.where(selected, adv, 0.0)) / jnp.maximum(n_sel, 1.0),
        "stapo/empty": (jnp.sum(out) == 0).astype(jnp.float32),
        "stapo/weight_max": jnp.max(out),
        "stapo/value_std_mean": jnp.sum(value_std * maskf) / n_valid,
    }
    return out, metrics
