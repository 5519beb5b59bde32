"""LM head: logits from hidden states, and chunked token logprobs + entropy.

The sampler and the trainer both score tokens through `token_logprobs_and_entropy`, so
temperature is applied the same way in both (docs/method.md §9.1).
Logits are fp32 whatever the param dtype,
and are computed in chunks over the sequence so that B x T x V logits never exist at once
(docs/design.md §12).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from strata_jax.models.config import Qwen2Config
from strata_jax.models.layers import InOutWeight

Params = dict[str, Any]


def lm_head_weight(params: Params, config: Qwen2Config) -> Any:
    """The [V, D] output matrix: the embedding when tied, else ``params["lm_head"]``; or the
    pre-transposed [D, V] ``InOutWeight`` of an inference copy (`prepare_sampler_params`),
    which takes precedence over a tied embedding."""
    if isinstance(params.get("lm_head"), InOutWeight):
        return params["lm_head"]
    if config.tie_word_embeddings:
        return params["embed"]
    if "lm_head" not in params:
        raise KeyError("params have no 'lm_head' but config.tie_word_embeddings is False")
    return params["lm_head"]


def _logits(hidden: jax.Array, w: Any) -> jax.Array:
    # bf16 x bf16 products are exact in fp32, so accumulating in fp32 equals the fp32 matmul
    # without materialising an fp32 copy of the [V, D] matrix.
    spec = "...d,vd->...v"
    if isinstance(w, InOutWeight):
        w, spec = w.w, "...d,dv->...v"
    if hidden.dtype != w.dtype:
        hidden, w = hidden.astype(jnp.float32), w.astype(jnp.float32)
    return jnp.einsum(spec, hidden, w, preferred_element_type=jnp.float32)


def logits_from_hidden(params: Params, config: Qwen2Config, hidden: jax.Array) -> jax.Array:
    """Logits [..., V] float32 from hidden [..., D] (x @ embed.T when tied, x @ lm_head.T else).

    Call it only where logits are needed (e.g. the last prompt position when sampling).
    """
    return _logits(hidden, lm_head_weight(params, config))


def token_logprobs_and_entropy(params: Params, config: Qwen2Config, hidden: jax.Array,
                               targets: jax.Array, temperature: float | jax.Array = 1.0,
                               chunk_size: int = 64, live: jax.Array | None = None
                               ) -> tuple[jax.Array, jax.Array]:
    """Logprob of given tokens and per-token entropy at a temperature, in chunks over T.

    Args:
      params, config: the model.
      hidden: [B, T, D] states; hidden[b, t] is the state whose next-token distribution scores
        targets[b, t] (the caller shifts).
      targets: [B, T] int32 token ids.
      temperature: scalar > 0, may be traced; logits are divided by it.
      chunk_size: sequence positions per chunk (peak logits memory B x chunk_size x V fp32).
      live: optional [B, T] bool, the positions whose values are read: a chunk none of whose
        B x chunk_size positions is live skips the LM head (``lax.cond``) and gives 0, so a
        static T padded far beyond the live positions costs their chunks only.
    Returns:
      logprobs [B, T] float32 = log_softmax(logits / temperature)[targets];
      entropy [B, T] float32 of softmax(logits / temperature) (0 in skipped chunks).
    Differentiable w.r.t. params, hidden and temperature; each chunk is rematerialised in the
    backward pass (``jax.checkpoint`` inside ``lax.scan``) so the backward never holds B x T x V.
    """
    if hidden.ndim != 3 or targets.shape != hidden.shape[:2]:
        raise ValueError(f"hidden must be [B, T, D] and targets [B, T]; got {hidden.shape}, "
                         f"{targets.shape}")
    b, t, d = hidden.shape
    c = max(1, min(int(chunk_size), t))
    n = -(-t // c)
    pad = n * c - t
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    h_chunks = hidden.reshape(b, n, c, d).swapaxes(0, 1)
    t_chunks = targets.astype(jnp.int32).reshape(b, n, c).swapaxes(0, 1)
    if live is None:
        any_live = jnp.ones((n,), bool)
    else:
        live = jnp.pad(live.astype(bool), ((0, 0), (0, pad)))
        any_live = jnp.any(live.reshape(b, n, c), axis=(0, 2))
    w = lm_head_weight(params, config)
    temperature = jnp.asarray(temperature, jnp.float32)

    @jax.checkpoint
    def chunk(w, temperature, h, tgt):
        z = _logits(h, w) / temperature
        lse = jax.nn.logsumexp(z, axis=-1)
        z_t = jnp.take_along_axis(z, tgt[..., None], axis=-1)[..., 0]
        p = jnp.exp(z - lse[..., None])
        entropy = lse - jnp.sum(p * z, axis=-1)
        return z_t - lse, entropy

    @jax.checkpoint
    def maybe_chunk(w, temperature, h, tgt, on):
        # the checkpoint wraps the cond, not only its branch: a checkpoint inside a branch
        # does not survive the cond's partial evaluation, whose residuals are then the
        # chunk's B x chunk_size x V logits, kept for every chunk of the scan
        zeros = jnp.zeros(tgt.shape, jnp.float32)
        return jax.lax.cond(on, lambda: chunk(w, temperature, h, tgt), lambda: (zeros, zeros))

    def body(carry, xs):
        h, tgt, on = xs
        if live is None:
            return carry, chunk(w, temperature, h, tgt)
        return carry, maybe_chunk(w, temperature, h, tgt, on)

    _, (lp, ent) = jax.lax.scan(body, None, (h_chunks, t_chunks, any_live))
    lp = lp.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    ent = ent.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    return lp, ent
