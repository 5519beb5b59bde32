"""Qwen2 forward: logit parity with transformers and KV-cache consistency."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.models import (Qwen2Config, forward, init_cache, init_params, load_checkpoint,
                               logits_from_hidden)
from tests.fixtures.models import (PARITY_CONFIGS, hf_logits, make_hf_model, padded_batch,
                                  save_hf_model)

LENGTHS = [11, 5, 8]  # batch of 3 prompts of different lengths, left-padded


@pytest.fixture(scope="module", params=sorted(PARITY_CONFIGS))
def hf_checkpoint(request, tmp_path_factory):
    model = make_hf_model(seed=1, **PARITY_CONFIGS[request.param])
    path = save_hf_model(model, str(tmp_path_factory.mktemp(request.param)))
    return request.param, model, path


_fwd = jax.jit(forward, static_argnames=("config",))
_logits = jax.jit(logits_from_hidden, static_argnames=("config",))


def test_logit_parity_with_transformers(hf_checkpoint):
    name, model, path = hf_checkpoint
    config, params = load_checkpoint(path)
    assert config.tie_word_embeddings == PARITY_CONFIGS[name]["tie_word_embeddings"]
    assert ("lm_head" in params) == (not config.tie_word_embeddings)
    tokens, mask, positions = padded_batch(config.vocab_size, LENGTHS, seed=2)
    hidden, cache = _fwd(params, config, jnp.asarray(tokens), jnp.asarray(positions),
                         jnp.asarray(mask))
    assert cache is None and hidden.dtype == jnp.float32
    ours = np.asarray(_logits(params, config, hidden))
    ref = hf_logits(model, tokens, mask)
    diff = np.abs(ours - ref)[mask]
    print(name, "max |diff|", diff.max())
    assert diff.max() <= 1e-4, (name, diff.max())
    np.testing.assert_array_equal(ours.argmax(-1)[mask], ref.argmax(-1)[mask])
    # Padding rows/positions stay finite (nothing NaN leaks out of fully masked queries).
    assert np.isfinite(ours).all()


def test_kv_cache_prefill_then_decode_equals_full_forward():
    config = Qwen2Config(vocab_size=300, hidden_size=48, intermediate_size=80, num_layers=2,
                         num_heads=6, num_kv_heads=2, head_dim=8, rope_theta=1e4)
    params = init_params(config, jax.random.key(0))
    # Perturb norms / biases so that every term of the layer matters.
    params = jax.tree.map(lambda p: p + 0.05 * jax.random.normal(jax.random.key(p.size), p.shape),
                          params)
    lengths = [9, 4, 7]
    tokens, mask, positions = padded_batch(config.vocab_size, lengths, seed=3)
    full, _ = _fwd(params, config, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask))

    prompt_len = 5  # prefill the first 5 columns (row 1 is all padding there), decode the rest
    cache = init_cache(config, batch=3, max_len=16)
    h0, cache = _fwd(params, config, jnp.asarray(tokens[:, :prompt_len]),
                     jnp.asarray(positions[:, :prompt_len]), jnp.asarray(mask[:, :prompt_len]),
                     cache, 0)
    steps = [h0]
    for j in range(prompt_len, tokens.shape[1]):
        hj, cache = _fwd(params, config, jnp.asarray(tokens[:, j:j + 1]),
                         jnp.asarray(positions[:, j:j + 1]), jnp.asarray(mask[:, j:j + 1]),
                         cache, jnp.int32(j))
        steps.append(hj)
    incremental = np.asarray(jnp.concatenate(steps, axis=1))
    np.testing.assert_allclose(incremental[mask], np.asarray(full)[mask], atol=1e-5, rtol=1e-5)
    assert np.isfinite(incremental).all()
    np.testing.assert_array_equal(np.asarray(cache.valid)[:, :tokens.shape[1]], mask)
    assert not np.asarray(cache.valid)[:, tokens.shape[1]:].any()


def test_query_chunked_attention_equals_unchunked_values_and_gradients():
    config = Qwen2Config(vocab_size=200, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=1, head_dim=8, rope_theta=1e4)
    params = init_params(config, jax.random.key(7))
    tokens, mask, positions = padded_batch(config.vocab_size, [10, 3], seed=8)
    args = (jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask))

    def loss(params, chunk):
        hidden, _ = forward(params, config, *args, query_chunk=chunk)
        return jnp.sum(jnp.where(args[2][..., None], hidden, 0.0) ** 3), hidden

    (l1, h1), g1 = jax.value_and_grad(loss, has_aux=True)(params, 3)  # blocks 3,3,3,1
    (l2, h2), g2 = jax.value_and_grad(loss, has_aux=True)(params, 512)
    # Real tokens only: a padding query has no allowed key, and its (unused, finite) output is
    # uniform over the keys of its block, which the block size changes.
    np.testing.assert_allclose(h1[mask], h2[mask], atol=1e-5, rtol=1e-5)
    assert np.isfinite(h1).all()
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
    assert float(jnp.abs(g1["layers"][0]["q_proj"]).max()) > 0


@pytest.mark.parametrize("first_slot, chunk", [(0, 4), (0, 64), (5, 3), (5, 64)])
def test_causal_key_blocks_equal_attention_over_every_slot(first_slot, chunk):
    # Queries in slots [first_slot, first_slot + T) of an S-slot cache, some keys invalid: with a
    # known first slot each block attends keys up to its causal end only; the values equal
    # attention over all S slots (first_slot=None, what decode does) for every query that has
    # an allowed key. The last row is all padding: finite, but its output is left free.
    from strata_jax.models.attention import attention
    b, t, s, h, k, dh = 3, 10, 20, 4, 2, 8
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((b, t, h, dh), np.float32))
    kv = [jnp.asarray(rng.standard_normal((b, s, k, dh), np.float32)) for _ in range(2)]
    valid = rng.random((b, s)) < 0.8
    valid[:, 0] = True
    valid[2] = False
    q_slot = first_slot + np.arange(t)
    allowed = jnp.asarray(valid[:, None, :] & (np.arange(s)[None, :] <= q_slot[:, None])[None])
    blocked = np.asarray(attention(q, *kv, allowed, k, chunk, first_slot=first_slot))
    every = np.asarray(attention(q, *kv, allowed, k, chunk, first_slot=None))
    np.testing.assert_allclose(blocked[:2], every[:2], atol=1e-6, rtol=1e-6)
    assert np.isfinite(blocked).all()
    # against a direct numpy attention (GQA: head j reads kv head j // (h // k))
    kk, vv = (np.repeat(np.asarray(x)[:2], h // k, axis=2) for x in kv)
    scores = np.einsum("bthd,bshd->bhts", np.asarray(q)[:2], kk) / np.sqrt(dh)
    scores = np.where(np.asarray(allowed)[:2, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref = np.einsum("bhts,bshd->bthd", p, vv).reshape(2, t, h * dh)
    np.testing.assert_allclose(blocked[:2], ref, atol=1e-5, rtol=1e-5)


def _remat_grad_fn(config, remat, lora=False, scan=False):
    """d/d(params) of sum(hidden * g) through `forward` with a remat policy (LoRA: d/d adapters
    of the LoraWeight forward over a frozen base; scan: the layers as a lax.scan)."""
    from strata_jax.models.lora import LoraConfig, init_lora, lora_params

    def loss(p, base, tokens, positions, mask, g):
        params = lora_params(base, p, LoraConfig(rank=4, alpha=8)) if lora else p
        h, _ = forward(params, config, tokens, positions, mask, remat=remat, query_chunk=32,
                       scan_layers=scan)
        return jnp.sum(h * g)

    def args(key):
        base = init_params(config, key)
        p = base
        if lora:   # B != 0 so the adapters change the output and get a real gradient
            p = init_lora(config, LoraConfig(rank=4, alpha=8), key)
            p = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(key, x.shape, x.dtype), p)
        tokens, mask, positions = padded_batch(config.vocab_size, [64, 50, 64, 40], seed=3)
        g = jax.random.normal(key, (4, 64, config.hidden_size))
        return p, base, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask), g

    return jax.jit(jax.grad(loss)), args


@pytest.mark.parametrize("lora", [False, True])
def test_remat_policies_give_the_same_gradients(lora):
    config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=3,
                         num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
    grads = {}
    for remat in ("none", "full", "dots", "full_scan", "dots_scan"):
        fn, args = _remat_grad_fn(config, remat.split("_")[0], lora, scan=remat.endswith("scan"))
        a = args(jax.random.PRNGKey(0))
        # the scan option really runs a scan (one body for every layer), the default does not
        assert ("scan[" in str(jax.make_jaxpr(fn)(*a))) == remat.endswith("scan")
        grads[remat] = fn(*a)
    leaves = jax.tree.leaves(grads["none"])
    assert sum(float(jnp.abs(x).sum()) for x in leaves) > 1.0   # a real gradient
    for remat in ("full", "dots", "full_scan", "dots_scan"):
        for a, b in zip(jax.tree.leaves(grads[remat]), leaves):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_remat_recomputes_one_layer_at_a_time():
    """XLA's memory analysis of the remat "full" gradient: each extra layer adds about its saved
    input [B, T, D] fp32 to the temporaries (the layers' recomputations run one at a time), not
    its activations (an MLP output alone is [B, T, F] = 16x the input here), and no stacked copy
    of the weights (one layer's weights are 6x its input here)."""
    temps = {}
    for layers in (4, 8):
        config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=512,
                             num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=8,
                             tie_word_embeddings=True)
        fn, args = _remat_grad_fn(config, "full", lora=True)
        a = jax.eval_shape(args, jax.random.PRNGKey(0))
        temps[layers] = fn.lower(*a).compile().memory_analysis().temp_size_in_bytes
    layer_input = 4 * 64 * 32 * 4
    per_layer = (temps[8] - temps[4]) / 4
    assert per_layer <= 1.5 * layer_input, (temps, per_layer, layer_input)


@pytest.mark.parametrize("chunk", [4, 64])
def test_tree_mask_attention_equals_the_dense_rule(chunk):
    # A TreeMask (per-key subtree end, built per query block) gives the attention of the dense
    # [B, T, T] mask k <= q < end[k] & valid[k], values and gradients, with blocks of 4 queries
    # cutting through segments and with one block.
    from strata_jax.models.attention import TreeMask, attention
    b, t, h, k, dh = 2, 13, 4, 2, 8
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((b, t, h, dh), np.float32))
    kv = [jnp.asarray(rng.standard_normal((b, t, k, dh), np.float32)) for _ in range(2)]
    # row 0: root [0, 4) with children [4, 7), [7, 11), then 2 padding slots; row 1: two rows
    # packed end to end [0, 6), [6, 12), one padding slot
    end = np.array([[11] * 4 + [7] * 3 + [11] * 4 + [12, 13],
                    [6] * 6 + [12] * 6 + [13]], np.int32)
    valid = np.ones((b, t), bool)
    valid[0, 11:] = valid[1, 12:] = False
    col = np.arange(t)
    dense = (col[None, :] <= col[:, None])[None] & (col[:, None][None] < end[:, None, :])
    dense &= valid[:, None, :]
    tree = TreeMask(valid=jnp.asarray(valid), end=jnp.asarray(end))

    def f(mask, q, kk, vv):
        out = attention(q, kk, vv, mask, k, chunk, first_slot=0)
        return jnp.sum(jnp.where(jnp.asarray(valid)[..., None], out, 0.0) ** 2), out

    (l1, o1), g1 = jax.value_and_grad(f, argnums=(1, 2, 3), has_aux=True)(tree, q, *kv)
    (l2, o2), g2 = jax.value_and_grad(f, argnums=(1, 2, 3), has_aux=True)(jnp.asarray(dense),
                                                                         q, *kv)
    np.testing.assert_allclose(np.asarray(o1)[valid], np.asarray(o2)[valid], atol=1e-6)
    for a, c in zip(g1, g2):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), atol=1e-5)
    # query 5 (second segment of row 0) sees the root and its own segment's slots 4, 5 only
    assert dense[0, 5].tolist() == [True] * 6 + [False] * 7
    with pytest.raises(ValueError, match="needs cache=None"):
        config = Qwen2Config(vocab_size=50, hidden_size=16, intermediate_size=16, num_layers=1,
                             num_heads=2, num_kv_heads=1, head_dim=8)
        forward(init_params(config, jax.random.key(0)), config, jnp.zeros((1, 4), jnp.int32),
                jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), bool), init_cache(config, 1, 8),
                key_end=jnp.ones((1, 4), jnp.int32))
