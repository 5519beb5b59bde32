"""LoRA adapter files (strata_jax.models.adapter_files): save then load gives the adapters rounded
to bf16 exactly, the loaded adapters give the logits of the bf16-rounded originals (not the
base's), the safetensors package reads the file under PEFT's names, and a changed byte, another
rank / targets / base or model shape is refused with its one-line message."""
from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from strata_jax.models import forward, init_params, logits_from_hidden
from strata_jax.models.adapter_files import (ADAPTER_FILE, CONFIG_FILE, AdapterError,
                                             load_adapters, params_sha256, peft_name,
                                             peft_target_modules, save_adapters)
from strata_jax.models.lora import LoraConfig, apply_lora, init_lora, target_names
from tests.fixtures.trainer import TINY

LORA = LoraConfig(rank=4, alpha=8.0)
BASE_ID = {"model_path": "", "model_preset": "tiny", "model_dtype": "float32",
           "warm_start": "", "warm_start_export": ""}


def _random_b(adapters, key, std=0.05):
    """B drawn at random (B = 0 would make the adapted model the base)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(adapters)
    keys = jax.random.split(key, len(leaves))
    out = [x if jax.tree_util.keystr(p).endswith("['a']") else std * jax.random.normal(k, x.shape)
           for (p, x), k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, out)


def _bf16_round(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)
                        .astype(np.float32), tree)


@pytest.fixture(scope="module")
def base():
    return init_params(TINY, jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def adapters():
    return _random_b(init_lora(TINY, LORA, jax.random.PRNGKey(1)), jax.random.PRNGKey(2))


@pytest.fixture()
def saved(tmp_path, adapters, base):
    meta = {"step": 7, "algo": "strata", "seed": 3,
            "base": {**BASE_ID, "params_sha256": params_sha256(base)}}
    return save_adapters(adapters, LORA, TINY, str(tmp_path / "step7"), meta)


@jax.jit
def _logits(params, tokens):
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    h, _ = forward(params, TINY, tokens, pos, jnp.ones_like(tokens, bool))
    return logits_from_hidden(params, TINY, h)


def test_save_then_load_gives_the_adapters_rounded_to_bf16(saved, adapters):
    loaded, meta = load_adapters(saved, TINY, LORA)
    want = _bf16_round(adapters)
    assert jax.tree.structure(loaded) == jax.tree.structure(want)
    for got, ref in zip(jax.tree.leaves(loaded), jax.tree.leaves(want)):
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, ref)
    assert (meta["step"], meta["algo"], meta["seed"]) == (7, "strata", 3)
    assert meta["lora"] == LoraConfig(rank=4, alpha=8.0, targets=LORA.targets)
    assert meta["adapted"] == target_names(TINY, LORA)
    # the rounding is real: the f32 originals are not all bf16 numbers
    assert any(not np.array_equal(np.asarray(a), r)
               for a, r in zip(jax.tree.leaves(adapters), jax.tree.leaves(want)))


def test_the_file_is_peft_shaped_and_the_safetensors_package_reads_it(saved, adapters):
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(saved, ADAPTER_FILE))
    assert len(tensors) == 2 * len(target_names(TINY, LORA)) == 28
    a = tensors["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"]
    assert str(a.dtype) == "torch.bfloat16" and tuple(a.shape) == (4, 64)   # [rank, in]
    assert tuple(b.shape) == (16, 4)                                         # [out, rank]
    np.testing.assert_array_equal(
        a.float().numpy(), _bf16_round(adapters["layers"]["1"]["down_proj"]["a"]))
    cfg = json.load(open(os.path.join(saved, CONFIG_FILE)))
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"], cfg["base_model_name_or_path"]) == \
        ("LORA", 4, 8.0, "")
    assert cfg["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj", "down_proj"]
    assert cfg["strata_jax"]["base"]["model_preset"] == "tiny"
    assert cfg["strata_jax"]["targets"] == list(LORA.targets)
    assert peft_name(3, "up_proj", "B") == "base_model.model.model.layers.3.mlp.up_proj.lora_B.weight"


def test_irregular_targets_become_a_fullmatch_regex_over_module_names():
    names = target_names(TINY, LoraConfig(rank=2, targets=(r"layers\.1\.q_proj$",)))
    assert peft_target_modules(TINY, names) == r"(model\.layers\.1\.self_attn\.q_proj)"
    names = target_names(TINY, LoraConfig(rank=2, targets=(r"(q|v)_proj$",)))
    assert peft_target_modules(TINY, names) == ["q_proj", "v_proj"]


def test_loaded_adapters_give_the_logits_of_the_bf16_rounded_originals(saved, adapters, base):
    loaded, meta = load_adapters(saved, TINY, None)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, TINY.vocab_size, (2, 9)), jnp.int32)
    got = _logits(apply_lora(base, loaded, meta["lora"]), tokens)
    want = _logits(apply_lora(base, _bf16_round(adapters), LORA), tokens)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert float(jnp.max(jnp.abs(got - _logits(base, tokens)))) > 1e-2   # not the base


def test_a_changed_byte_is_refused(saved):
    path = os.path.join(saved, ADAPTER_FILE)
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0x01                      # one bit of the last tensor's data
    open(path, "wb").write(bytes(data))
    with pytest.raises(AdapterError) as e:
        load_adapters(saved, TINY, LORA)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path} has sha256 ")
    assert "the file changed after it was written; restore it from a copy or re-run" in msg


def test_another_rank_targets_shape_or_base_is_refused(saved, base):
    with pytest.raises(AdapterError, match=r"holds rank 4 \(alpha 8\) adapters but the config "
                                           r"has lora.rank=8, lora.alpha=8; set them"):
        load_adapters(saved, TINY, LoraConfig(rank=8, alpha=8.0))
    with pytest.raises(AdapterError, match=r"adapts 14 projections .* selects 4 "):
        load_adapters(saved, TINY, LoraConfig(rank=4, alpha=8.0, targets=(r"(q|v)_proj$",)))
    import dataclasses
    wider = dataclasses.replace(TINY, intermediate_size=96)
    with pytest.raises(AdapterError, match=r"layers.0.gate_proj has A/B shapes .* needs "):
        load_adapters(saved, wider, None)
    other = {**BASE_ID, "model_preset": "small"}
    with pytest.raises(AdapterError) as e:
        load_adapters(saved, TINY, None, base=other)
    assert "trained on a base with model_preset='tiny' but this config's base has " \
           "model_preset='small'" in str(e.value)
    reseeded = init_params(TINY, jax.random.PRNGKey(5))   # same shape, other weights
    with pytest.raises(AdapterError, match="params_sha256="):
        load_adapters(saved, TINY, None, base={**BASE_ID, "params_sha256": params_sha256(reseeded)})
    load_adapters(saved, TINY, None, base={**BASE_ID, "params_sha256": params_sha256(base)})
    # the same bytes under another name (the warm start named by its export folder): the same
    # base; without the bytes to compare, the names decide
    renamed = {**BASE_ID, "warm_start": "runs/warm_start/0123456789ab", "warm_start_export": ""}
    load_adapters(saved, TINY, None, base={**renamed, "params_sha256": params_sha256(base)})
    if BASE_ID.get("warm_start") != renamed["warm_start"]:
        with pytest.raises(AdapterError, match="warm_start="):
            load_adapters(saved, TINY, None, base=renamed)


def test_params_sha256_sees_one_changed_bit_and_the_dtype(base):
    d = params_sha256(base)
    assert d == params_sha256(jax.tree.map(np.asarray, base))   # jax or numpy leaves alike
    bumped = jax.tree.map(lambda x: x, base)
    w = np.asarray(base["embed"]).copy()
    w.view(np.uint32)[0, 0] ^= 1
    bumped["embed"] = w
    assert params_sha256(bumped) != d
    assert params_sha256(jax.tree.map(lambda x: x.astype(jnp.bfloat16), base)) != d


def test_a_missing_folder_names_what_to_give(tmp_path):
    with pytest.raises(FileNotFoundError, match="adapter_config.json does not exist; eval.adapter "
                                                "names a folder"):
        load_adapters(str(tmp_path / "nothing"), TINY)


def test_peft_loads_the_folder_onto_the_hf_base_with_our_logits(tmp_path):
    """PEFT's own loader (``PeftModel.from_pretrained``) on the saved folder gives the logits of
    our forward with the loaded adapters (irregular targets: the regex target_modules form)."""
    pytest.importorskip("peft")
    from peft import PeftModel

    from strata_jax.models import load_checkpoint
    from tests.fixtures.models import PARITY_CONFIGS, hf_logits, make_hf_model, padded_batch
    model = make_hf_model(seed=7, **PARITY_CONFIGS["untied_gqa3"])
    model.save_pretrained(str(tmp_path / "base"))
    config, params = load_checkpoint(str(tmp_path / "base"))
    cfg = LoraConfig(rank=3, alpha=6.0, targets=(r"(q|v|o|down)_proj$", r"layers\.2\.gate"))
    adapters = _random_b(init_lora(config, cfg, jax.random.PRNGKey(1)), jax.random.PRNGKey(2))
    folder = save_adapters(adapters, cfg, config, str(tmp_path / "step1"),
                           {"step": 1, "base": {"model_path": str(tmp_path / "base")}})
    loaded, meta = load_adapters(folder, config, cfg)
    tokens, mask, positions = padded_batch(config.vocab_size, [7, 3, 5], seed=1)
    p = apply_lora(params, loaded, meta["lora"])
    h, _ = forward(p, config, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask))
    ours = np.asarray(logits_from_hidden(p, config, h))
    bare = hf_logits(model, tokens, mask)   # before PEFT wraps (and changes) the model
    theirs = hf_logits(PeftModel.from_pretrained(model, folder).eval(), tokens, mask)
    np.testing.assert_allclose(ours[mask], theirs[mask], atol=1e-5)
    assert np.abs(theirs[mask] - bare[mask]).max() > 1e-3


def _edit_config(folder, **changes):
    path = os.path.join(folder, CONFIG_FILE)
    config = json.load(open(path))
    for key, value in changes.items():
        if key.startswith("sj_"):
            config["strata_jax"][key[3:]] = value
        else:
            config[key] = value
    with open(path, "w") as f:
        f.write(json.dumps(config))   # NaN / Infinity written as JSON's extensions


def test_an_edited_config_is_refused_though_the_tensor_file_is_intact(saved, base):
    import shutil
    good = load_adapters(saved, TINY, None)[1]["lora"]
    assert (good.rank, good.alpha) == (4, 8.0)
    cases = [(dict(lora_alpha=16.0), "lora_alpha=16.0 but adapter_model.safetensors was written "
                                     "with lora_alpha=8.0"),
             (dict(lora_alpha=float("nan")), "a finite lora_alpha > 0"),
             (dict(lora_alpha=float("inf")), "a finite lora_alpha > 0"),
             (dict(r=4.7), "an integer r >= 1"),
             (dict(peft_type="IA3"), "peft_type='IA3'"),
             (dict(sj_targets=["q_proj$"]), "targets=['q_proj$'] but"),
             (dict(sj_base={**BASE_ID, "params_sha256": "0" * 64}), "base=")]
    for i, (change, message) in enumerate(cases):
        copy = shutil.copytree(saved, f"{saved}_edit{i}")
        _edit_config(copy, **change)
        with pytest.raises(AdapterError, match=re.escape(message)):
            load_adapters(copy, TINY, None)
    # the base check cannot be switched off by deleting the recorded bytes' checksum: the
    # file's own copy sees the edit, and a record without it is refused where the caller has
    # the bytes to compare
    copy = shutil.copytree(saved, f"{saved}_nobase")
    _edit_config(copy, sj_base=BASE_ID)
    with pytest.raises(AdapterError, match="but adapter_model.safetensors was written with base="):
        load_adapters(copy, TINY, None, base={**BASE_ID, "params_sha256": params_sha256(base)})
    from strata_jax.models.adapter_files import check_base
    with pytest.raises(AdapterError, match="records no params_sha256"):
        check_base(BASE_ID, {**BASE_ID, "params_sha256": params_sha256(base)}, copy)
