"""LoRA: adapter count by the formula, zero-B identity, merged export == adapted forward in
transformers, LoRA gradients == the full model's gradient projected on the adapters, an update
that changes only adapters with the base as the free KL reference, adapter-only checkpoints,
sharded LoRA step == single device."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.models import (PRESETS, forward, init_params, load_checkpoint,
                               logits_from_hidden)
from strata_jax.models.lora import (LoraConfig, apply_lora, export_merged, init_lora,
                                    num_adapter_params, target_names)
from strata_jax.training import Checkpointer, Trainer, accumulate_grads, tree_to_numpy
from tests.fixtures.models import PARITY_CONFIGS, hf_logits, make_hf_model, padded_batch
from tests.fixtures.trainer import TINY, grpo_records, make_batch
from tests.fixtures.trainer import train_config as _train_config

LORA = LoraConfig(rank=4, alpha=8.0)   # scale 2: a wrong scale cannot pass the parity tests


def train_config(**kw):
    """The trainer tests' config with fp32 compute pinned (base.py's default is bf16 compute,
    whose rounding would swamp these exact comparisons)."""
    return _train_config(**{"compute_dtype": "float32", **kw})


@jax.jit
def _tiny_logits(params, tokens, positions, mask):
    h, _ = forward(params, TINY, tokens, positions, mask)
    return logits_from_hidden(params, TINY, h)


def _random_b(adapters, key, std=0.05):
    """Adapters with B drawn at random (a trained-looking adapter; B = 0 would hide bugs)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(adapters)
    keys = jax.random.split(key, len(leaves))
    out = [x if jax.tree_util.keystr(p).endswith("['a']") else std * jax.random.normal(k, x.shape)
           for (p, x), k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, out)


@pytest.fixture(scope="module")
def base():
    return init_params(TINY, jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def lora_trainer():
    return Trainer(TINY, train_config(lora=LORA))


def test_adapter_count_matches_formula():
    # Qwen2.5-7B (D 3584, F 18944, 28 heads x 128, 4 kv heads x 128 = 512), rank 64 on every
    # projection: per layer 64 * [(3584+3584) q + (3584+512) k + (3584+512) v + (3584+3584) o
    # + 3 * (3584+18944) gate/up/down] = 5,767,168; x 28 layers.
    seven = LoraConfig(rank=64, alpha=64.0)
    assert num_adapter_params(PRESETS["qwen2.5-7b"], seven) == 28 * 5_767_168 == 161_480_704
    # q and v only (the LoRA paper): 28 * 64 * (7168 + 4096).
    qv = LoraConfig(rank=64, alpha=64.0, targets=(r"(q|v)_proj$",))
    assert num_adapter_params(PRESETS["qwen2.5-7b"], qv) == 20_185_088
    # The tree init_lora builds has exactly that many numbers (TINY: D 32, F 64, 4x8 q, 2x8 kv):
    # per layer 4 * [(32+32) + 2 * (32+16) + (32+32) + 3 * (32+64)] = 4 * 512 = 2048.
    adapters = init_lora(TINY, LORA, jax.random.PRNGKey(0))
    assert sum(x.size for x in jax.tree.leaves(adapters)) == num_adapter_params(TINY, LORA) == 4096
    one = LoraConfig(rank=2, alpha=2.0, targets=(r"layers\.1\.down_proj",))
    assert target_names(TINY, one) == ["layers.1.down_proj"]
    a = init_lora(TINY, one, jax.random.PRNGKey(0))["layers"]["1"]["down_proj"]
    assert a["a"].shape == (2, 64) and a["b"].shape == (32, 2)
    assert np.all(np.asarray(a["b"]) == 0) and np.abs(np.asarray(a["a"])).max() <= 64 ** -0.5


def test_bad_configs_raise_clear_errors():
    with pytest.raises(ValueError, match="match no projection"):
        target_names(TINY, LoraConfig(rank=4, targets=("attn_qkv",)))
    with pytest.raises(ValueError, match="rank"):
        LoraConfig(rank=-1)
    with pytest.raises(ValueError, match="not a valid regex"):
        LoraConfig(rank=4, targets=("q_proj(",))


def test_zero_b_equals_base_bitwise(base):
    tokens, mask, positions = (jnp.asarray(x) for x in padded_batch(TINY.vocab_size, [6, 3, 5]))
    adapters = init_lora(TINY, LORA, jax.random.PRNGKey(3))
    merged = jax.jit(apply_lora, static_argnums=2)(base, adapters, LORA)
    np.testing.assert_array_equal(np.asarray(_tiny_logits(merged, tokens, positions, mask)),
                                  np.asarray(_tiny_logits(base, tokens, positions, mask)))
    # ... and a nonzero B does change them (the test above could not pass vacuously).
    moved = jax.jit(apply_lora, static_argnums=2)(base, _random_b(adapters, jax.random.PRNGKey(4)),
                                                  LORA)
    diff = np.abs(np.asarray(_tiny_logits(moved, tokens, positions, mask))
                  - np.asarray(_tiny_logits(base, tokens, positions, mask)))
    assert diff.max() > 1e-3


def test_merged_export_reloads_in_transformers_equal_to_adapted_forward(tmp_path):
    from transformers import Qwen2ForCausalLM

    model = make_hf_model(seed=7, **PARITY_CONFIGS["untied_gqa3"])
    model.save_pretrained(str(tmp_path / "base"))
    config, params = load_checkpoint(str(tmp_path / "base"))
    cfg = LoraConfig(rank=3, alpha=6.0, targets=(r"(q|v|o|down)_proj$", r"layers\.2\.gate"))
    adapters = _random_b(init_lora(config, cfg, jax.random.PRNGKey(1)), jax.random.PRNGKey(2))
    out = export_merged(params, adapters, cfg, config, str(tmp_path / "merged"))
    reloaded = Qwen2ForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    # The exported tensor is W + (alpha / r) B A, computed here by hand in numpy.
    ab = tree_to_numpy(adapters)["layers"]["2"]["gate_proj"]
    w = model.model.layers[2].mlp.gate_proj.weight.detach().numpy()
    np.testing.assert_allclose(reloaded.model.layers[2].mlp.gate_proj.weight.detach().numpy(),
                               w + 2.0 * ab["b"] @ ab["a"], atol=1e-6)
    np.testing.assert_array_equal(reloaded.model.layers[2].mlp.up_proj.weight.detach().numpy(),
                                  model.model.layers[2].mlp.up_proj.weight.detach().numpy())

    tokens, mask, positions = padded_batch(config.vocab_size, [7, 3, 5], seed=1)

    @jax.jit
    def adapted_logits(params, adapters, tokens, positions, mask):
        p = apply_lora(params, adapters, cfg)
        h, _ = forward(p, config, tokens, positions, mask)
        return logits_from_hidden(p, config, h)

    ours = np.asarray(adapted_logits(params, adapters, jnp.asarray(tokens), jnp.asarray(positions),
                                     jnp.asarray(mask)))
    theirs = hf_logits(reloaded, tokens, mask)
    np.testing.assert_allclose(ours[mask], theirs[mask], atol=1e-5)
    assert np.abs(theirs[mask] - hf_logits(model, tokens, mask)[mask]).max() > 1e-3


def test_lora_grads_are_the_full_grad_projected(base, lora_trainer):
    """At B = 0: dL/dB = s * dL/dW @ A^T and dL/dA = s * B^T dL/dW = 0 (chain rule through
    W' = W + s B A), with dL/dW from the full-fine-tuning trainer on the same batch."""
    full = Trainer(TINY, train_config())
    batch = make_batch(grpo_records(seed=2))
    scored = full.score(full.init_state(base, jax.random.PRNGKey(1)), batch, base,
                        jax.random.PRNGKey(0))
    adv = jnp.asarray(np.random.default_rng(0).normal(size=scored.num_rows).astype(np.float32))
    w = scored.valid.astype(jnp.float32)
    _, g_full, _, _ = accumulate_grads(base, {}, scored, adv, w, adv, model=TINY, cfg=full.cfg)
    adapters = init_lora(TINY, LORA, jax.random.PRNGKey(9))
    _, g_lora, _, _ = accumulate_grads(adapters, {}, scored, adv, w, adv, base, model=TINY,
                                       cfg=lora_trainer.cfg)
    assert jax.tree.structure(g_lora) == jax.tree.structure(adapters)
    for i, mods in g_lora["layers"].items():
        for proj, g in mods.items():
            gw = np.asarray(g_full["layers"][int(i)][proj])
            a = np.asarray(adapters["layers"][i][proj]["a"])
            np.testing.assert_allclose(np.asarray(g["b"]), LORA.scale * gw @ a.T, atol=1e-6,
                                       rtol=1e-4)
            assert np.all(np.asarray(g["a"]) == 0)
    assert np.abs(np.asarray(g_lora["layers"]["0"]["q_proj"]["b"])).max() > 1e-5


def test_update_changes_only_adapters_with_base_as_reference(base, lora_trainer, tmp_path):
    trainer = lora_trainer
    state = trainer.init_state(base, jax.random.PRNGKey(1))
    shapes = {x.shape for x in jax.tree.leaves(state.params)}
    assert (TINY.vocab_size, TINY.hidden_size) not in shapes   # no base weight in the state
    assert sum(x.size for x in jax.tree.leaves(state.params)) == num_adapter_params(TINY, LORA)
    with pytest.raises(ValueError, match="base params"):
        trainer.update(state, make_batch(grpo_records(seed=2)), ref_params=None)

    batch = make_batch(grpo_records(seed=2))
    # At init the policy IS the base (B = 0 adds exact zeros): policy and reference logprobs
    # agree to fp32 round-off (the two forwards are fused differently inside one program, so a
    # last-bit difference of a logprob ~ -5.5, 4.8e-7, is possible).
    scored = trainer.score(state, batch, base, jax.random.PRNGKey(0))
    np.testing.assert_allclose(np.asarray(scored.old_logprobs), np.asarray(scored.ref_logprobs),
                               rtol=0, atol=2e-6)

    base_before = tree_to_numpy(base)
    new, metrics = trainer.update(state, batch, ref_params=base)
    assert metrics["optimizer_steps"] >= 1 and metrics["skipped_steps"] == 0
    b_moved = max(np.abs(np.asarray(x)).max() for p, x in
                  jax.tree_util.tree_flatten_with_path(new.params)[0]
                  if jax.tree_util.keystr(p).endswith("['b']"))
    assert b_moved > 1e-4                                   # B left zero: the adapters trained
    for a, b in zip(jax.tree.leaves(tree_to_numpy(base)), jax.tree.leaves(base_before)):
        np.testing.assert_array_equal(a, b)
    # After the step the policy moved while the reference is still the base (no second copy).
    scored2 = trainer.score(new, batch, base, jax.random.PRNGKey(0))
    full = Trainer(TINY, train_config())
    base_scored = full.score(full.init_state(base, jax.random.PRNGKey(1)), batch, base,
                             jax.random.PRNGKey(0))
    np.testing.assert_allclose(np.asarray(scored2.ref_logprobs),
                               np.asarray(base_scored.old_logprobs), atol=1e-6)
    assert np.abs(np.asarray(scored2.old_logprobs - scored2.ref_logprobs)).max() > 1e-4
    # The sampler's params = the base with the adapters merged.
    merged = trainer.policy_params(new, base)
    np.testing.assert_allclose(
        np.asarray(merged["layers"][1]["up_proj"]),
        np.asarray(base["layers"][1]["up_proj"]) + LORA.scale
        * np.asarray(new.params["layers"]["1"]["up_proj"]["b"])
        @ np.asarray(new.params["layers"]["1"]["up_proj"]["a"]), atol=1e-6)

    # Checkpoints hold the adapters (+ their optimizer state) and restore exactly.
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        ckpt.save(new)
        restored, _ = ckpt.restore(trainer.abstract_state(base))
    assert jax.tree.structure(restored) == jax.tree.structure(new)
    for a, b in zip(jax.tree.leaves(tree_to_numpy(restored)), jax.tree.leaves(tree_to_numpy(new))):
        np.testing.assert_array_equal(a, b)
    n_saved = sum(x.size for x in jax.tree.leaves(restored))
    assert n_saved < 4 * num_adapter_params(TINY, LORA)     # adapters + 2 Adam moments + scalars


def test_sharded_lora_update_equals_single_device(base, lora_trainer):
    from jax.sharding import PartitionSpec

    from strata_jax.models import shard_params
    from strata_jax.sharding import make_mesh
    batch = make_batch(grpo_records(seed=2))    # the batch of the tests above: compiles reused
    single, m1 = lora_trainer.update(lora_trainer.init_state(base, jax.random.PRNGKey(1)), batch,
                                     ref_params=base)
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    sharded = Trainer(TINY, lora_trainer.cfg, mesh=mesh)
    sbase = shard_params(base, TINY, mesh)
    s0 = sharded.init_state(sbase, jax.random.PRNGKey(1))
    q = s0.params["layers"]["0"]["q_proj"]
    assert q["a"].sharding.spec == PartitionSpec(None, "fsdp")      # A [r, in]: in like W's in
    assert q["b"].sharding.spec == PartitionSpec("tensor", None)    # B [out, r]: out like W's out
    s1, m8 = sharded.update(s0, batch, ref_params=sbase)
    for a, b in zip(jax.tree.leaves(tree_to_numpy(s1.params)),
                    jax.tree.leaves(tree_to_numpy(single.params))):
        np.testing.assert_allclose(a, b, atol=2e-5)
    np.testing.assert_allclose(m8["train/loss"], m1["train/loss"], rtol=1e-4, atol=1e-6)


def test_train_config_reads_c_lora():
    import configs.base as base_cfg
    from strata_jax.training import TrainConfig
    c = base_cfg.get_base_config()
    assert not TrainConfig.from_config(c).lora.enabled                  # rank 0 = off
    c = base_cfg.apply_variant(c, "lora.rank=64,lora.targets=q_proj+v_proj")
    t = TrainConfig.from_config(c)
    assert t.lora == LoraConfig(rank=64, alpha=64.0, targets=("q_proj", "v_proj"), lr=3e-6)
    assert t.lr == 3e-6 and dataclasses.replace(t.lora, rank=0).enabled is False


def test_unmerged_lora_forward_equals_merged_and_shares_the_base(base):
    """lora_params (x W^T + s (x A^T) B^T, what training runs) == the merged W + s B A forward,
    its gradients w.r.t. the adapters agree, and it holds the base arrays themselves (no copy)."""
    from strata_jax.models.lora import LoraWeight, lora_params
    cfg = LoraConfig(rank=4, alpha=8.0, targets=(r"(q|v|down)_proj$",))
    adapters = _random_b(init_lora(TINY, cfg, jax.random.PRNGKey(3)), jax.random.PRNGKey(4))
    tree = lora_params(base, adapters, cfg)
    layer0 = tree["layers"][0]
    assert isinstance(layer0["q_proj"], LoraWeight)
    assert layer0["q_proj"].w is base["layers"][0]["q_proj"]
    assert layer0["k_proj"] is base["layers"][0]["k_proj"] and tree["embed"] is base["embed"]
    assert layer0["q_proj"].scale == 2.0
    tokens, mask, positions = (jnp.asarray(x) for x in padded_batch(TINY.vocab_size, [5, 9, 7],
                                                                    seed=1))

    def loss(adapters, merge):
        p = (apply_lora if merge else lora_params)(base, adapters, cfg)
        h, _ = forward(p, TINY, tokens, positions, mask, remat="none" if merge else "full")
        return jnp.sum(jnp.where(mask[..., None], logits_from_hidden(p, TINY, h), 0.0) ** 2)

    np.testing.assert_allclose(float(jax.jit(loss, static_argnums=1)(adapters, False)),
                               float(jax.jit(loss, static_argnums=1)(adapters, True)), rtol=1e-5)
    g0 = jax.jit(jax.grad(loss), static_argnums=1)(adapters, False)
    g1 = jax.jit(jax.grad(loss), static_argnums=1)(adapters, True)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-4)
