"""Token selection, buckets, packing and sampling params, on hand-made distributions (no model)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

import numpy as np
import pytest

from strata_jax.sampling import (SamplingParams, bucket, greedy_argmax, sample_categorical,
                                 select_next_tokens, top_k_mask, top_p_mask)
from strata_jax.sampling.packing import as_id_lists, pack_left

_select = jax.jit(select_next_tokens, static_argnames=("greedy", "use_top_k", "use_top_p"))


def _nucleus_by_sort(p: np.ndarray, top_p: float) -> set[int]:
    """Reference: sort descending, keep ids whose exclusive cumulative mass is < top_p."""
    order = np.argsort(-p, kind="stable")
    excl = np.cumsum(p[order]) - p[order]
    return set(order[excl < top_p].tolist())


def test_top_k_mask_hand_made():
    logits = jnp.array([[1.0, 5.0, 3.0, 4.0, 2.0],
                        [0.0, -1.0, -jnp.inf, 7.0, 7.0]])
    k2 = np.asarray(top_k_mask(logits, 2))
    assert k2[0].tolist() == [False, True, False, True, False]
    # Ties at the k-th value are all kept: k=1 on a row whose max appears twice keeps both.
    assert np.asarray(top_k_mask(logits, 1))[1].tolist() == [False, False, False, True, True]
    assert np.asarray(top_k_mask(logits, 3))[1].tolist() == [True, False, False, True, True]
    # k >= V keeps everything, -inf included.
    assert np.asarray(top_k_mask(logits, 9)).all()


def test_top_p_mask_hand_made():
    # Shuffled probabilities 0.5, 0.2, 0.15, 0.1, 0.05.
    p = jnp.array([[0.1, 0.5, 0.05, 0.2, 0.15]])
    expect = {0.3: {1}, 0.5: {1}, 0.6: {1, 3}, 0.7: {1, 3}, 0.8: {1, 3, 4}, 0.9: {0, 1, 3, 4},
              0.96: {0, 1, 2, 3, 4}, 1.0: {0, 1, 2, 3, 4}}
    for top_p, kept in expect.items():
        got = set(np.flatnonzero(np.asarray(top_p_mask(p, top_p))[0]).tolist())
        assert got == kept, (top_p, got)
    # Unnormalised weights give the same set (mass is relative).
    got = set(np.flatnonzero(np.asarray(top_p_mask(p * 7.0, 0.6))[0]).tolist())
    assert got == {1, 3}


def test_top_p_mask_matches_sort_reference_on_random_rows():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 1000)) * 3
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    for top_p in (0.1, 0.5, 0.9, 0.99):
        mask = np.asarray(top_p_mask(jnp.asarray(p, jnp.float32), top_p))
        for r in range(p.shape[0]):
            assert set(np.flatnonzero(mask[r]).tolist()) == _nucleus_by_sort(p[r], top_p)


def test_greedy_argmax_first_index_across_blocks():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(5, 1000)).astype(np.float32)  # 1000 = 7 blocks of 128 + 104
    x[1, 300] = x[1, 900] = 50.0  # tie across blocks -> first
    x[2, 999] = 50.0  # last (padded) block
    x[3, 5] = x[3, 6] = 50.0  # tie inside a block
    x[4, :] = -jnp.inf
    x[4, 777] = 0.0
    got = np.asarray(greedy_argmax(jnp.asarray(x)))
    assert got.tolist() == np.argmax(x, axis=-1).tolist() == [got[0], 300, 999, 5, 777]


def test_greedy_argmax_nan_rows_stay_inside_vocab():
    """Before the fix a NaN row returned nb * 128 (512 for V = 300): out of the vocabulary."""
    x = np.zeros((5, 300), np.float32)
    x[0, :] = np.nan  # all NaN (NaN params) -> first NaN
    x[1, 7] = 3.0
    x[1, 250] = np.nan  # NaN counts as +inf: beats the 3.0
    x[2, 200] = np.nan
    x[2, 130] = np.nan  # first NaN, second block
    x[3, 299] = np.nan  # last id, padded block
    x[4, :] = -np.inf
    x[4, 140] = np.nan
    got = np.asarray(greedy_argmax(jnp.asarray(x)))
    assert got.tolist() == [0, 250, 130, 299, 140]
    assert got.tolist() == np.argmax(x, axis=-1).tolist()  # no +inf present: same as numpy
    both = np.zeros((1, 300), np.float32)
    both[0, 3], both[0, 9] = np.inf, np.nan
    assert int(greedy_argmax(jnp.asarray(both))[0]) == 3  # first of {+inf, NaN}


def test_sample_categorical_frequencies_and_zero_weights():
    v = 300  # not a multiple of the 128-id block
    w = np.zeros((v,), np.float32)
    w[[3, 130, 131, 299]] = [0.1, 0.2, 0.3, 0.4]
    n = 4000
    keys = jax.random.split(jax.random.key(0), n)
    draws = np.asarray(sample_categorical(keys, jnp.broadcast_to(jnp.asarray(w), (n, v))))
    assert set(np.unique(draws).tolist()) <= {3, 130, 131, 299}
    freq = np.array([np.mean(draws == i) for i in (3, 130, 131, 299)])
    # Binomial std <= 0.008 at n=4000: 5 sigma.
    np.testing.assert_allclose(freq, [0.1, 0.2, 0.3, 0.4], atol=0.04)


def test_select_next_tokens_logprobs_are_before_filtering():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(8, 500)) * 2, jnp.float32)
    keys = jax.random.split(jax.random.key(3), 8)
    t = 0.7
    tok, lp = _select(logits, keys, jnp.float32(t), jnp.float32(0.8), jnp.int32(20),
                      greedy=False, use_top_k=True, use_top_p=True)
    ref = jax.nn.log_softmax(logits / t, axis=-1)
    np.testing.assert_allclose(np.asarray(lp),
                               np.asarray(ref)[np.arange(8), np.asarray(tok)], atol=1e-5)
    # Every token lies in the top-20 and in the nucleus of the top-20-renormalised distribution.
    for r in range(8):
        row = np.asarray(logits[r]) / t
        top20 = np.argsort(-row)[:20]
        assert int(tok[r]) in set(top20.tolist())
        p = np.zeros_like(row)
        p[top20] = np.exp(row[top20] - row[top20].max())
        p /= p.sum()
        assert int(tok[r]) in _nucleus_by_sort(p, 0.8)


def test_greedy_reports_temperature_one_and_top_k_one_equals_greedy():
    rng = np.random.default_rng(4)
    logits = jnp.asarray(rng.normal(size=(6, 700)) * 2, jnp.float32)
    keys = jax.random.split(jax.random.key(5), 6)
    g_tok, g_lp = _select(logits, keys, jnp.float32(1.0), jnp.float32(1.0), jnp.int32(1),
                          greedy=True, use_top_k=False, use_top_p=False)
    np.testing.assert_array_equal(np.asarray(g_tok), np.argmax(np.asarray(logits), -1))
    ref = np.asarray(jax.nn.log_softmax(logits, -1))[np.arange(6), np.asarray(g_tok)]
    np.testing.assert_allclose(np.asarray(g_lp), ref, atol=1e-6)
    k_tok, _ = _select(logits, keys, jnp.float32(1.3), jnp.float32(1.0), jnp.int32(1),
                       greedy=False, use_top_k=True, use_top_p=False)
    np.testing.assert_array_equal(np.asarray(k_tok), np.asarray(g_tok))


def test_fixed_keys_reproduce_and_rows_differ():
    logits = jnp.zeros((16, 1000), jnp.float32)  # uniform: rows should scatter
    keys = jax.random.split(jax.random.key(6), 16)
    args = (jnp.float32(1.0), jnp.float32(1.0), jnp.int32(1))
    a, _ = _select(logits, keys, *args, greedy=False, use_top_k=False, use_top_p=False)
    b, _ = _select(logits, keys, *args, greedy=False, use_top_k=False, use_top_p=False)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(set(np.asarray(a).tolist())) > 10
    # A row's draw depends on its key only, not on its place in the batch.
    perm = np.arange(16)[::-1]
    c, _ = _select(logits, keys[perm], *args, greedy=False, use_top_k=False, use_top_p=False)
    np.testing.assert_array_equal(np.asarray(c), np.asarray(a)[perm])


def test_bucket_values():
    assert [bucket(n, 16) for n in (1, 16, 17, 100, 128, 129)] == [16, 16, 32, 128, 128, 256]
    assert bucket(3, 1, multiple=4) == 4 and bucket(5, 1, multiple=4) == 8
    assert bucket(0) == 1
    with pytest.raises(ValueError):
        bucket(-1)


def test_pack_left_positions_and_filler_rows():
    rows = as_id_lists([[5, 6, 7], [9]], "prompt", vocab_size=10)
    p = pack_left(rows, length=4, batch=3, start=np.array([10, 0]))
    assert p.tokens.tolist() == [[0, 5, 6, 7], [0, 0, 0, 9], [0, 0, 0, 0]]
    assert p.mask.tolist() == [[False, True, True, True], [False, False, False, True],
                               [False, False, False, True]]
    assert p.positions[0, 1:].tolist() == [10, 11, 12] and p.positions[1, 3] == 0
    assert p.lengths.tolist() == [3, 1, 1]
    with pytest.raises(ValueError, match="empty"):
        as_id_lists([[1], []], "prompt", vocab_size=10)
    with pytest.raises(ValueError, match="outside"):
        as_id_lists([[1, 10]], "prompt", vocab_size=10)
    with pytest.raises(ValueError, match="more than the padded length"):
        pack_left(rows, length=2, batch=2)


def test_sampling_params_validation():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0.0).logprob_temperature == 1.0
    assert SamplingParams(temperature=0.5).logprob_temperature == 0.5
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                dict(max_new_tokens=-1), dict(stop_token_ids=[-2])):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_temperatures_that_underflow_float32_are_refused():
    from strata_jax.sampling.params import MIN_TEMPERATURE
    # 1e-39 is a float32 subnormal, 1e-46 rounds to 0: logits / T overflows to inf -> NaN
    logits = jnp.asarray([30.0, -20.0, 5.0], jnp.float32)
    for t in (1e-39, 1e-46):
        assert np.isnan(np.asarray(jax.nn.log_softmax(logits / jnp.float32(t)))).any()
        with pytest.raises(ValueError, match="overflow float32"):
            SamplingParams(temperature=t)
    with pytest.raises(ValueError, match=r">= 1e-06 or 0 \(greedy\), got 1e-07"):
        SamplingParams(temperature=1e-7)
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError):
            SamplingParams(temperature=bad)
    # the floor itself is fine even for logits of +-1e3: finite logprobs, argmax gets ~0
    big = jnp.asarray([1e3, -1e3, 999.0])
    lp = np.asarray(jax.nn.log_softmax(big / jnp.float32(MIN_TEMPERATURE)))
    assert np.isfinite(lp).all() and lp[0] == 0.0
    assert SamplingParams(temperature=MIN_TEMPERATURE).logprob_temperature == MIN_TEMPERATURE
    assert SamplingParams(temperature=0.0).is_greedy
