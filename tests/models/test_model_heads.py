"""Chunked logprob / entropy equals full log_softmax / entropy, values and gradients."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.models import (Qwen2Config, init_params, logits_from_hidden,
                               token_logprobs_and_entropy)

CONFIG = Qwen2Config(vocab_size=257, hidden_size=32, intermediate_size=48, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=16, tie_word_embeddings=False)


def _reference(params, hidden, targets, temperature):
    z = logits_from_hidden(params, CONFIG, hidden) / temperature
    logp = jax.nn.log_softmax(z, axis=-1)
    lp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return lp, ent


def _inputs():
    params = init_params(CONFIG, jax.random.key(0))
    params["lm_head"] = 3.0 * params["lm_head"] * 10  # peakier distributions
    hidden = jax.random.normal(jax.random.key(1), (3, 13, CONFIG.hidden_size))
    targets = jax.random.randint(jax.random.key(2), (3, 13), 0, CONFIG.vocab_size)
    return params, hidden, targets


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_values_and_gradients_equal_full(temperature):
    params, hidden, targets = _inputs()
    # chunk 5 does not divide T=13: exercises the padded last chunk.
    lp, ent = jax.jit(token_logprobs_and_entropy, static_argnames=("config", "chunk_size"))(
        params, CONFIG, hidden, targets, jnp.float32(temperature), chunk_size=5)
    rlp, rent = _reference(params, hidden, targets, temperature)
    assert lp.dtype == jnp.float32 and lp.shape == (3, 13)
    np.testing.assert_allclose(lp, rlp, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ent, rent, atol=1e-5, rtol=1e-5)
    assert float(jnp.max(ent)) > 0.1 and float(jnp.min(lp)) < -1.0  # non-trivial values

    weights = jax.random.normal(jax.random.key(3), (2, 3, 13))

    def loss(fn):
        def f(params, hidden, temp):
            a, b = fn(params, hidden, temp)
            return jnp.sum(weights[0] * a) + jnp.sum(weights[1] * b)
        return f

    chunked = loss(lambda p, h, t: token_logprobs_and_entropy(p, CONFIG, h, targets, t,
                                                              chunk_size=5))
    full = loss(lambda p, h, t: _reference(p, h, targets, t))
    g1 = jax.grad(chunked, argnums=(0, 1, 2))(params, hidden, jnp.float32(temperature))
    g2 = jax.grad(full, argnums=(0, 1, 2))(params, hidden, jnp.float32(temperature))
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
    assert float(jnp.abs(g1[0]["lm_head"]).max()) > 1e-3


def test_hand_computed_two_token_vocab():
    # V=2, D=1, lm_head rows [1], [-1]: logits (h, -h). With h = ln(3)/2: p = (3/4, 1/4).
    cfg = Qwen2Config(vocab_size=2, hidden_size=1, intermediate_size=1, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=2)
    params = {"embed": jnp.zeros((2, 1)), "layers": [], "final_norm": jnp.ones(1),
              "lm_head": jnp.array([[1.0], [-1.0]])}
    hidden = jnp.full((1, 2, 1), np.log(3.0) / 2)
    lp, ent = token_logprobs_and_entropy(params, cfg, hidden, jnp.array([[0, 1]]))
    np.testing.assert_allclose(lp, [[np.log(0.75), np.log(0.25)]], rtol=1e-6)
    h = -(0.75 * np.log(0.75) + 0.25 * np.log(0.25))
    np.testing.assert_allclose(ent, [[h, h]], rtol=1e-6)


def test_bf16_params_give_fp32_logits():
    params = init_params(CONFIG, jax.random.key(0), dtype=jnp.bfloat16)
    hidden = jax.random.normal(jax.random.key(1), (2, 4, CONFIG.hidden_size)).astype(jnp.bfloat16)
    logits = logits_from_hidden(params, CONFIG, hidden)
    assert logits.dtype == jnp.float32
    ref = hidden.astype(jnp.float32) @ params["lm_head"].astype(jnp.float32).T
    np.testing.assert_allclose(logits, ref, rtol=1e-6, atol=1e-6)


def test_live_chunks_same_values_and_gradients_zero_elsewhere():
    """`live` skips the head on chunks with no live position: live positions get the full
    values and gradients, skipped chunks 0 (and no gradient)."""
    params, hidden, targets = _inputs()
    live = jnp.zeros((3, 13), bool).at[:, :4].set(True)    # chunks of 5: only chunk 0 live
    lp, ent = token_logprobs_and_entropy(params, CONFIG, hidden, targets, chunk_size=5,
                                         live=live)
    rlp, rent = _reference(params, hidden, targets, 1.0)
    np.testing.assert_allclose(lp[:, :5], rlp[:, :5], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ent[:, :5], rent[:, :5], atol=1e-5, rtol=1e-5)
    assert float(jnp.abs(lp[:, 5:]).max()) == 0.0 and float(jnp.abs(ent[:, 5:]).max()) == 0.0

    def f(fn):
        return lambda p, h: jnp.sum(jnp.where(live, sum(fn(p, h)), 0.0))

    g1 = jax.grad(f(lambda p, h: token_logprobs_and_entropy(p, CONFIG, h, targets,
                                                            chunk_size=5, live=live)),
                  argnums=(0, 1))(params, hidden)
    g2 = jax.grad(f(lambda p, h: _reference(p, h, targets, 1.0)), argnums=(0, 1))(params,
                                                                                   hidden)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
    assert float(jnp.abs(g1[1][:, 5:]).max()) == 0.0


def test_live_chunks_backward_keeps_no_logits_per_position():
    """The backward with `live` rematerialises each chunk as the one without does: its
    temporaries stay about one chunk's logits, not one [T, V] f32 row per position (a
    checkpoint inside the ``lax.cond`` branch alone kept every chunk's logits: ~V x 4 bytes
    per position, tens of GB on a 152k vocabulary)."""
    vocab, d, t = 8192, 16, 4096
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=d, intermediate_size=16, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=16, tie_word_embeddings=True)
    live = jnp.arange(t)[None] < t // 2

    def temp(with_live):
        def f(w, h):
            lp, ent = token_logprobs_and_entropy({"embed": w}, cfg, h,
                                                 jnp.zeros((1, t), jnp.int32), chunk_size=64,
                                                 live=live if with_live else None)
            return lp.sum() + ent.sum()
        c = jax.jit(jax.grad(f, argnums=(0, 1))).lower(
            jax.ShapeDtypeStruct((vocab, d), jnp.float32),
            jax.ShapeDtypeStruct((1, t, d), jnp.float32)).compile()
        return c.memory_analysis().temp_size_in_bytes

    all_logits = t * vocab * 4
    plain, skipping = temp(False), temp(True)
    assert plain < all_logits / 8
    assert skipping < 2 * plain, (skipping, plain)
