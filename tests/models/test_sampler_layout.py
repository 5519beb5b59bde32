"""The sampler's inference copy of the params (`prepare_sampler_params`): pre-transposed
[in, out] weights and fused q|k|v, gate|up give the same model as the trainer's [out, in]
params, leave those params untouched and compile once."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.models import forward, load_checkpoint, logits_from_hidden
from strata_jax.models.lora import LoraConfig, init_lora, lora_params
from strata_jax.models.layers import InOutWeight, LoraWeight
from strata_jax.models.sampler_layout import SAMPLER_PROJECTIONS, prepare_sampler_params
from strata_jax.sampling import Sampler, SamplingParams
from tests.fixtures.sampler import build_checkpoint, compile_counter, prompts

N_NEW = 24
LENGTHS = [5, 12, 3, 9, 16]

FULL = dict(fuse_qkv=True, fuse_gate_up=True,
            in_out=("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"))
LAYOUTS = [dict(fuse_qkv=True), dict(fuse_gate_up=True),
           dict(in_out=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj", "lm_head")),
           FULL]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    compile_counter()  # register the listener before anything compiles
    _, path = build_checkpoint(str(tmp_path_factory.mktemp("layout_ckpt")))
    config, params = load_checkpoint(path)
    return config, params, Sampler(config, max_cache_len=64)


def _keys(n, seed=0):
    return jax.random.split(jax.random.key(seed), n)


def test_prepared_layout_structure(setup):
    config, params, _ = setup
    p = prepare_sampler_params(params, config, **FULL)
    layer, src = p["layers"][0], params["layers"][0]
    assert set(layer) == {"input_norm", "qkv_proj", "qkv_bias", "o_proj", "post_norm",
                          "gate_up_proj", "down_proj"}
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    assert isinstance(layer["qkv_proj"], InOutWeight) and layer["qkv_proj"].w.shape == (d, q + 2 * kv)
    assert layer["gate_up_proj"].w.shape == (d, 2 * f)
    assert layer["down_proj"].w.shape == (f, d) and layer["qkv_bias"].shape == (q + 2 * kv,)
    # The same numbers, moved: column j of the fused [in, out] matrix is row j of q|k|v.
    np.testing.assert_array_equal(np.asarray(layer["qkv_proj"].w[:, q + 3]),
                                  np.asarray(src["k_proj"][3]))
    np.testing.assert_array_equal(np.asarray(layer["gate_up_proj"].w[:, f + 5]),
                                  np.asarray(src["up_proj"][5]))
    np.testing.assert_array_equal(np.asarray(layer["qkv_bias"][q + kv:]), np.asarray(src["v_bias"]))
    assert p["lm_head"].w.shape == (d, config.vocab_size)  # tied: a transposed copy of embed
    np.testing.assert_array_equal(np.asarray(p["lm_head"].w[:, 7]), np.asarray(params["embed"][7]))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda kw: "+".join(
    [k for k in ("fuse_qkv", "fuse_gate_up") if kw.get(k)] + (["in_out"] if kw.get("in_out") else [])))
def test_prepared_logits_match(setup, layout):
    config, params, _ = setup
    ps = prompts([11, 11], config.vocab_size, seed=3)
    tokens = jnp.asarray(ps, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(11), (2, 11))
    mask = jnp.ones((2, 11), bool)
    h0, _ = forward(params, config, tokens, positions, mask)
    ref = np.asarray(logits_from_hidden(params, config, h0))
    p = prepare_sampler_params(params, config, **layout)
    h1, _ = forward(p, config, tokens, positions, mask)
    got = np.asarray(logits_from_hidden(p, config, h1))
    assert np.abs(ref).max() > 1.0   # std-0.3 weights: logits far from zero, the check bites
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)


def test_prepared_greedy_identical_and_params_untouched(setup):
    config, params, sampler = setup
    before = jax.tree.map(np.array, params)
    p = prepare_sampler_params(params, config, **FULL)
    ps = prompts(LENGTHS, config.vocab_size, seed=0)
    sp = SamplingParams(greedy=True, max_new_tokens=N_NEW)
    ref = sampler.generate(params, ps, sp, _keys(len(ps)))
    got = sampler.generate(p, ps, sp, _keys(len(ps)))
    assert len({tuple(r.token_ids.tolist()) for r in ref}) == len(ps)  # rows really differ
    np.testing.assert_array_equal(got.token_ids, ref.token_ids)
    np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=1e-4)
    # The sampler's scoring pass runs the prepared copy too.
    sc = sampler.score(p, ps, [r.token_ids for r in ref])
    for s, r in zip(sc, ref):
        np.testing.assert_allclose(s, r.logprobs, atol=1e-4)
    # The trainer's params: same structure, plain [out, in] arrays, same values.
    assert jax.tree.structure(params) == jax.tree.structure(before)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(params))
    assert params["layers"][0]["q_proj"].shape == (config.num_heads * config.head_dim,
                                                   config.hidden_size)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_no_recompilation_after_warmup(setup):
    config, params, sampler = setup
    counter = compile_counter()
    ps = prompts(LENGTHS, config.vocab_size, seed=1)
    sp = SamplingParams(greedy=True, max_new_tokens=N_NEW)
    # New policy weights each iteration, as in training (made up front: eager ops compile).
    policies = [jax.tree.map(lambda x, i=i: x * (1.0 + 0.01 * i), params) for i in range(4)]
    jax.block_until_ready(policies)
    sampler.generate(prepare_sampler_params(policies[0], config, **FULL), ps, sp, _keys(len(ps)))
    before = counter.count
    outs = []
    for i, new in enumerate(policies[1:]):
        p = prepare_sampler_params(new, config, **FULL)
        outs.append(sampler.generate(p, ps, sp, _keys(len(ps), seed=i)).token_ids)
    assert counter.count == before
    assert all(o.shape == (len(ps), N_NEW) for o in outs)


def test_bad_input(setup):
    config, params, _ = setup
    with pytest.raises(ValueError, match="do not apply"):
        prepare_sampler_params(params, config, fuse_qkv=True, in_out=("q_proj",))
    with pytest.raises(ValueError, match="do not apply"):
        prepare_sampler_params(params, config, in_out=("gate_up_proj",))
    with pytest.raises(ValueError, match="do not apply"):
        prepare_sampler_params(params, config, in_out=("nope",))
    cfg = LoraConfig(rank=2, targets=("q_proj",))
    lora = lora_params(params, init_lora(config, cfg, jax.random.key(0)), cfg)
    assert any(isinstance(x, LoraWeight) for x in jax.tree.leaves(
        lora, is_leaf=lambda x: isinstance(x, LoraWeight)))
    with pytest.raises(ValueError, match="merge LoRA"):
        prepare_sampler_params(lora, config)
    assert "lm_head" in SAMPLER_PROJECTIONS


def test_rollout_sampler_layout_config(setup):
    from configs.base import get_base_config
    from strata_jax.config import ConfigError
    from strata_jax.sampling import SamplerCopy
    config, params, _ = setup
    c = get_base_config()
    c.rollout.sampler_dtype = ""   # the params' own dtype: only the layout changes them
    c.model.dtype = str(params["embed"].dtype)
    assert SamplerCopy.from_config(c, config)(params) is params   # "" = the stored layout, no copy
    c.rollout.sampler_layout = "in_out,fuse_qkv"
    p = SamplerCopy.from_config(c, config)(params)
    layer = p["layers"][1]
    assert isinstance(layer["qkv_proj"], InOutWeight) and isinstance(layer["gate_proj"], InOutWeight)
    assert "q_proj" not in layer and isinstance(params["layers"][1]["q_proj"], jax.Array)
    np.testing.assert_array_equal(np.asarray(layer["down_proj"].w),
                                  np.asarray(params["layers"][1]["down_proj"]).T)
    c.rollout.sampler_layout = "in_out,bogus"
    with pytest.raises(ConfigError, match="unknown item 'bogus'"):
        SamplerCopy.from_config(c, config)
