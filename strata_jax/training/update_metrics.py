"""The host metrics row of one `Trainer.update` from its optimizer steps' device metrics
(docs/metrics.md, the ``train/``, ``perf/`` and ``mismatch/`` rows): one device_get for the
whole iteration, so the update syncs with the host once, after its last step."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.algos import SampleBatch, loss_mask


def update_metrics(steps: list[dict], adv_metrics: dict, est: SampleBatch,
                   on_policy: bool, unscored: np.ndarray | None = None) -> dict[str, float]:
    """The update's metrics: means over optimizer steps of the loss metrics (``train/<k>``),
    `skipped_steps`, `optimizer_steps`, `empty_steps`, ``perf/inert_tokens``,
    ``perf/unscored_inert_rows`` (the rows of `unscored`) and
    ``perf/update_token_fill`` (real / computed token slots), the estimator's metrics
    (``row/`` entries left out) and ``mismatch/sampler_abs`` (mean |sampler - trainer| pi_old
    logprob over loss tokens; on-policy, the one step's own measure; off-policy, over the rows
    the old pass scored; absent when no step or no scored row measured it).

    Args: steps: `Trainer.train_on_batch`'s per-step dicts (device scalars and host ints;
    ``{"empty": True}`` for a mini-batch not run); adv_metrics: the estimator's metrics;
    est: the scored batch the estimator saw; on_policy: the update ran without the old pass;
    unscored: [R] bool or None, rows the old pass left out (their pi_old is not computed)."""
    empty = sum(1 for s in steps if s.get("empty"))
    steps = [dict(s) for s in steps if not s.get("empty")]
    # every step reports it (0 off-policy: one compiled step serves both, `micro_loss`)
    own = [s.pop("sampler_abs", None) for s in steps]
    scored = True   # whether a row the old pass scored is left (off-policy with unscored rows)
    if on_policy and not steps:   # the one mini-batch was empty: no step measured it
        mism = None
    elif on_policy:  # measured inside the one step, against the same pi_old
        mism = own[0]
    else:
        mask = loss_mask(est)
        if unscored is not None:
            mask = mask & ~jnp.asarray(np.pad(unscored, (0, est.num_rows - len(unscored))))[:, None]
        mism = jnp.sum(jnp.where(mask, jnp.abs(est.sampler_logprobs - est.old_logprobs), 0.0)
                       ) / jnp.maximum(jnp.sum(mask), 1)
        if unscored is not None:   # no scored row left: nothing measured it
            scored = jnp.any(mask)
    # one fetch for everything (whether a row was scored too: no sync of its own)
    host_steps, host_adv, mism, scored = jax.device_get(
        (steps, {k: v for k, v in adv_metrics.items() if not k.startswith("row/")}, mism, scored))
    if not bool(scored):
        mism = None
    metrics: dict[str, float] = {k: float(v) for k, v in host_adv.items()}
    computed = sum(s.pop("computed_tokens") for s in host_steps)
    real_tokens = sum(s.pop("real_tokens") for s in host_steps)
    metrics["perf/inert_tokens"] = float(sum(s.pop("inert_tokens") for s in host_steps))
    metrics["perf/unscored_inert_rows"] = 0.0 if unscored is None else float(np.sum(unscored))
    metrics["perf/update_token_fill"] = real_tokens / max(computed, 1)
    for k in (host_steps[0] if host_steps else {}):
        metrics[f"train/{k}"] = float(np.mean([float(s[k]) for s in host_steps]))
    metrics["skipped_steps"] = float(sum(float(s["skipped"]) for s in host_steps))
    metrics["optimizer_steps"] = float(len(host_steps))
    metrics["empty_steps"] = float(empty)
    if mism is not None:
        metrics["mismatch/sampler_abs"] = float(mism)
    return metrics


__all__ = ["update_metrics"]
