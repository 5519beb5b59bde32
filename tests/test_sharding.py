"""Mesh construction, logical-axis rules, and the forward sharded on 2x2x2 fake CPU devices."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from strata_jax.models import (Qwen2Config, forward, init_cache, init_params, param_shardings,
                               shard_params, token_logprobs_and_entropy)
from strata_jax.sharding import constrain, logical_to_spec, make_mesh
from tests.fixtures.models import padded_batch
from tests.fixtures.paths import REPO_ROOT

CONFIG = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=False)


def test_sharding_utilities_import_no_model():
    """The rule table and the tree utilities know no model: the model module provides its
    params' logical axes (`param_logical_axes`) and builds its shardings from them."""
    import os
    import subprocess
    import sys
    code = ("import sys, strata_jax.sharding; "
            "print(sorted(m for m in sys.modules if m.startswith('strata_jax')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['strata_jax', 'strata_jax.sharding']"


def test_make_mesh_sizes_and_errors():
    assert jax.device_count() == 8
    mesh = make_mesh({"data": 1, "fsdp": -1, "tensor": 2})
    assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2}
    assert dict(make_mesh().shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    with pytest.raises(ValueError, match="needs 6 devices"):
        make_mesh({"data": 3, "fsdp": 2})
    with pytest.raises(ValueError, match="at most one"):
        make_mesh({"data": -1, "fsdp": -1})
    with pytest.raises(ValueError, match="unknown mesh axes"):
        make_mesh({"model": 8})


def test_logical_to_spec_rules():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    # Activations: batch takes data+fsdp, so embed (fsdp) is left whole.
    assert logical_to_spec(("batch", "length", "embed"), (8, 5, 64), mesh) == \
        P(("data", "fsdp"), None, None)
    assert logical_to_spec(("heads", "embed"), (64, 64), mesh) == P("tensor", "fsdp")
    # A mesh axis that does not divide the dimension is dropped.
    assert logical_to_spec(("batch", "embed"), (3, 64), mesh) == P(None, "fsdp")
    assert logical_to_spec(("vocab", "embed"), None, None) == P("tensor", "fsdp")
    with pytest.raises(KeyError, match="no rule"):
        logical_to_spec(("nonsense",))


def test_constrain_is_noop_without_mesh():
    x = jnp.arange(8.0).reshape(2, 4)
    assert constrain(x, ("batch", "embed")) is x


def test_sharded_forward_equals_single_device():
    params = init_params(CONFIG, jax.random.key(0))
    params = jax.tree.map(lambda p: p + 0.05 * jax.random.normal(jax.random.key(p.size), p.shape),
                          params)
    tokens, mask, positions = padded_batch(CONFIG.vocab_size, [9, 4, 7, 2], seed=4)
    fwd = jax.jit(forward, static_argnames=("config",))
    single, _ = fwd(params, CONFIG, jnp.asarray(tokens), jnp.asarray(positions),
                    jnp.asarray(mask))
    cache1 = init_cache(CONFIG, 4, 16)
    single_c, cache_single = fwd(params, CONFIG, jnp.asarray(tokens), jnp.asarray(positions),
                                 jnp.asarray(mask), cache1, 3)

    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    sharded_params = shard_params(params, CONFIG, mesh)
    q = sharded_params["layers"][0]["q_proj"]
    assert q.sharding.spec == P("tensor", "fsdp")
    assert len({s.device for s in q.addressable_shards}) == 8
    batch_sharding = NamedSharding(mesh, P(("data", "fsdp")))
    tok, pos, msk = (jax.device_put(jnp.asarray(a), batch_sharding)
                     for a in (tokens, positions, mask))
    with jax.set_mesh(mesh):
        sharded, _ = fwd(sharded_params, CONFIG, tok, pos, msk)
        sharded_c, cache_sharded = fwd(sharded_params, CONFIG, tok, pos, msk,
                                       init_cache(CONFIG, 4, 16), 3)
        lp, ent = jax.jit(token_logprobs_and_entropy, static_argnames=("config",))(
            sharded_params, CONFIG, sharded, tok)
    assert len(sharded.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(sharded), np.asarray(single), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(sharded_c), np.asarray(single_c), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(cache_sharded.k), np.asarray(cache_single.k),
                               atol=1e-5, rtol=1e-5)
    lp1, ent1 = token_logprobs_and_entropy(params, CONFIG, single, jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(lp), np.asarray(lp1), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), np.asarray(ent1), atol=1e-5, rtol=1e-5)


def test_param_shardings_cover_tied_params():
    cfg = Qwen2Config(**{**CONFIG.__dict__, "tie_word_embeddings": True})
    params = init_params(cfg, jax.random.key(1))
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    shardings = param_shardings(params, cfg, mesh)
    assert "lm_head" not in shardings
    assert shardings["embed"].spec == P("tensor", "fsdp")
    assert shardings["layers"][1]["down_proj"].spec == P("fsdp", "tensor")
    assert shardings["final_norm"].spec == P(None)
