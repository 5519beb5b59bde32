"""Rows that cannot change the gradient (docs/method.md §9.3): which rows of a batch the
packed update leaves out of its forward and backward passes (`inert_rows`), and which the
old-logprob pass of an off-policy update can leave out too (`unread_rows`).

With no KL, entropy or value term, a row whose advantage x sample weight is exactly 0 adds
exactly 0 to the loss; the loss normalisers still count it, so leaving it out changes the
update only by float summation order.
"""
from __future__ import annotations

import numpy as np

from strata_jax.algos import SampleBatch
from strata_jax.distributed import host_values
from strata_jax.training.steps import advantages


def inert_rows(adv, weights, cfg) -> np.ndarray | None:
    """[R] bool on the host: rows whose every loss term is exactly 0, so they cannot change the
    gradient: advantage x sample weight 0 (the clipped policy term), and with a critic a sample
    weight of 0 (the value loss is weighted by it too). None when ``cfg.skip_empty_steps`` is
    off or a KL or entropy term is on (every row counts then).

    adv, weights: [R] float32 (device or host); cfg: a `TrainConfig`. The packed update
    computes no inert row and takes no optimizer step on a mini-batch of only inert rows; the
    loss normalisers still count them, so the update is the same up to float summation order.
    Source: docs/method.md §9.3.
    """
    if not cfg.skip_empty_steps or cfg.loss.kl_coef or cfg.loss.entropy_coef:
        return None
    if cfg.critic_kind != "none":
        return host_values(weights) == 0
    return host_values(adv) * host_values(weights) == 0


def unread_rows(est: SampleBatch, step, cfg) -> np.ndarray | None:
    """[R] bool on the host, or None: the rows of `est` (the iteration's own rows, before any
    scoring pass) that are inert (`inert_rows`) by advantages computed now, so the
    old-logprob pass can leave them out: nothing reads their pi_old (the packed update computes
    no inert row). Only for a critic-free estimator, whose advantages read rewards and ids and
    never a scored field, so they equal the ones the update computes after scoring; None with a
    critic, or when `inert_rows` gives None (skip_empty_steps off, a KL or entropy term).
    Source: docs/method.md §9.3."""
    if cfg.critic_kind != "none":
        return None
    adv, w, _ = advantages(est, step, algo=cfg.estimator_name, est=cfg.estimator)
    inert = inert_rows(adv, w, cfg)
    return None if inert is None else inert & host_values(est.valid)


__all__ = ["inert_rows", "unread_rows"]
