"""Checkpoint loading and export: tied, sharded-index, mis-shaped, missing/extra, mesh placement,
export -> transformers reload with the same logits."""
from __future__ import annotations

import json
import re
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.models import (Qwen2Config, export_params, forward, load_checkpoint,
                               load_params, logits_from_hidden)
from strata_jax.models.loading import read_safetensors, resolve_checkpoint, write_safetensors
from strata_jax.sharding import make_mesh
from tests.fixtures.models import PARITY_CONFIGS, hf_logits, make_hf_model, padded_batch

_fwd = jax.jit(forward, static_argnames=("config",))
_logits = jax.jit(logits_from_hidden, static_argnames=("config",))


def _our_logits(params, config, tokens, mask, positions):
    hidden, _ = _fwd(params, config, jnp.asarray(tokens), jnp.asarray(positions),
                     jnp.asarray(mask))
    return np.asarray(_logits(params, config, hidden))


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    model = make_hf_model(seed=5, **PARITY_CONFIGS["tied_gqa2"])
    path = str(tmp_path_factory.mktemp("tied"))
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    model = make_hf_model(seed=6, **PARITY_CONFIGS["untied_gqa3"])
    path = str(tmp_path_factory.mktemp("untied"))
    model.save_pretrained(path)
    return model, path


def test_the_weight_table_names_the_params_keys_of_the_model():
    """The one weight table and qwen2's shapes list the same weights, in the same order (a new
    weight added to one and not the other fails here)."""
    from strata_jax.models.qwen2 import layer_shapes, param_shapes
    from strata_jax.models.weights import LAYER_WEIGHTS, TOP_WEIGHTS
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=False)
    assert [w.key for w in LAYER_WEIGHTS] == list(layer_shapes(cfg))
    assert [w.key for w in TOP_WEIGHTS] == ["embed", "final_norm", "lm_head"]
    assert set(param_shapes(cfg)) == {"embed", "layers", "final_norm", "lm_head"}
    assert [w.key for w in TOP_WEIGHTS if w.tied_away] == ["lm_head"]


def test_checkpoint_names_are_in_export_order_and_invert():
    from strata_jax.models.loading import hf_name_to_path
    from strata_jax.models.weights import checkpoint_names, path_to_hf_name
    tied = list(checkpoint_names(2, tie_word_embeddings=True))
    assert len(tied) == 1 + 2 * 12 + 1
    assert tied[:3] == [(("embed",), "model.embed_tokens.weight"),
                        (("layers", 0, "input_norm"), "model.layers.0.input_layernorm.weight"),
                        (("layers", 0, "q_proj"), "model.layers.0.self_attn.q_proj.weight")]
    assert tied[12:14] == [(("layers", 0, "down_proj"), "model.layers.0.mlp.down_proj.weight"),
                           (("layers", 1, "input_norm"),
                            "model.layers.1.input_layernorm.weight")]
    assert tied[-1] == (("final_norm",), "model.norm.weight")
    untied = list(checkpoint_names(2, tie_word_embeddings=False))
    assert untied == tied + [(("lm_head",), "lm_head.weight")]
    for path, name in untied:
        assert hf_name_to_path(name) == path and path_to_hf_name(path) == name
    assert hf_name_to_path("model.layers.0.self_attn.rotary_emb.inv_freq") is None
    assert hf_name_to_path("model.layers.0.self_attn.qkv_proj.weight") is None


def test_tied_checkpoint_has_no_lm_head(tied):
    _, path = tied
    names = read_safetensors(os.path.join(path, "model.safetensors"))
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    config, params = load_checkpoint(path)
    assert config.tie_word_embeddings and "lm_head" not in params
    np.testing.assert_array_equal(np.asarray(params["embed"]),
                                  names["model.embed_tokens.weight"])


def test_sharded_index_checkpoint_equals_single_file(untied, tmp_path):
    model, single = untied
    sharded = str(tmp_path / "sharded")
    model.save_pretrained(sharded, max_shard_size="40KB")
    index = json.load(open(os.path.join(sharded, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1
    a = load_params(single)
    b = load_params(sharded)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert jax.tree.structure(a) == jax.tree.structure(b)


def _rewrite(src: str, dst: str, edit) -> str:
    os.makedirs(dst, exist_ok=True)
    tensors = {k: np.array(v) for k, v in
               read_safetensors(os.path.join(src, "model.safetensors")).items()}
    edit(tensors)
    write_safetensors(os.path.join(dst, "model.safetensors"), tensors)
    with open(os.path.join(src, "config.json")) as f, \
            open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())
    return dst


def test_mis_shaped_missing_and_extra_tensors_are_named(untied, tmp_path):
    _, path = untied
    name = "model.layers.1.self_attn.k_proj.weight"
    bad = _rewrite(path, str(tmp_path / "bad"), lambda t: t.update({name: t[name][:-1]}))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*shape"):
        load_params(bad)
    gone = _rewrite(path, str(tmp_path / "gone"), lambda t: t.pop("model.norm.weight"))
    with pytest.raises(ValueError, match=r"lacks.*model\.norm\.weight"):
        load_params(gone)
    extra = _rewrite(path, str(tmp_path / "extra"),
                     lambda t: t.update({"model.layers.9.mlp.up_proj.weight": t[name]}))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.9\.mlp\.up_proj"):
        load_params(extra)


def test_export_reloads_in_transformers_with_same_logits(untied, tied, tmp_path):
    from transformers import Qwen2ForCausalLM
    for i, (model, path) in enumerate([untied, tied]):
        config, params = load_checkpoint(path)
        out = export_params(params, config, str(tmp_path / f"export{i}"))
        reloaded = Qwen2ForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        tokens, mask, positions = padded_batch(config.vocab_size, [7, 3, 5], seed=i)
        ref = hf_logits(model, tokens, mask)
        again = hf_logits(reloaded, tokens, mask)
        np.testing.assert_allclose(again[mask], ref[mask], atol=1e-6)
        np.testing.assert_allclose(_our_logits(params, config, tokens, mask, positions)[mask],
                                   again[mask], atol=1e-4)
        assert Qwen2Config.from_pretrained(out) == config


def test_export_bf16_and_sharded_index_roundtrip(untied, tmp_path):
    config, params = load_checkpoint(untied[1])
    out = export_params(params, config, str(tmp_path / "bf16"), dtype=jnp.bfloat16,
                        max_shard_bytes=20_000)
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    back = load_params(out, dtype=None)
    assert back["embed"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(back["layers"][2]["q_proj"]),
                                  np.asarray(params["layers"][2]["q_proj"].astype(jnp.bfloat16)))


def test_load_onto_mesh_places_each_array_with_its_sharding(untied):
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    config, ref = load_checkpoint(untied[1])
    params = load_params(untied[1], mesh=mesh)
    q = params["layers"][0]["q_proj"]  # [H*Dh=96, D=96]: heads on tensor, embed on fsdp
    assert q.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    assert q.addressable_shards[0].data.shape == (48, 48)
    assert params["final_norm"].sharding.is_fully_replicated
    for x, y in zip(jax.tree.leaves(ref), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_hub_id_offline_says_to_set_model_path(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="model path"):
        resolve_checkpoint("nonexistent-org-zz/nonexistent-model-zz")
    with pytest.raises(FileNotFoundError, match="model path"):
        resolve_checkpoint("/no/such/checkpoint/dir")


def _st_with_header(path, edit):
    """Write a 2-tensor safetensors file, then rewrite its header with `edit(header)`."""
    import struct

    a = np.arange(6, dtype=np.float32).reshape(2, 3)  # 24 bytes at [0, 24)
    b = np.arange(4, dtype=np.float32)  # 16 bytes at [24, 40)
    write_safetensors(str(path), {"a": a, "b": b})
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    edit(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    open(path, "wb").write(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])
    return a, b


def test_read_safetensors_valid_file_roundtrips(tmp_path):
    a, b = _st_with_header(tmp_path / "m.safetensors", lambda h: None)
    got = read_safetensors(str(tmp_path / "m.safetensors"))
    np.testing.assert_array_equal(got["a"], a)
    np.testing.assert_array_equal(got["b"], b)


@pytest.mark.parametrize("edit, match", [
    # dtype lie: F64 [2, 3] needs 48 bytes, the offsets span 24
    (lambda h: h["a"].update(dtype="F64"), r"tensor 'a' \(F64 \[2, 3\]\) needs 48 bytes but its data_offsets \[0, 24\] span 24"),
    (lambda h: h["a"].update(shape=[3, 3]), r"tensor 'a' \(F32 \[3, 3\]\) needs 36 bytes"),
    (lambda h: h["b"].update(data_offsets=[16, 32]), r"tensors 'a' \[0, 24\) and 'b' \[16, 32\) overlap"),
    (lambda h: h["b"].update(data_offsets=[40, 56]), r"tensor 'b' bytes \[40, 56\) lie past the end of the data section \(40 bytes\)"),
    (lambda h: h["b"].update(data_offsets=[24]), r"tensor 'b' has bad data_offsets \[24\]"),
    (lambda h: h["b"].update(shape=[-4]), r"tensor 'b' has a bad shape \[-4\]"),
    (lambda h: h.update(c=[1, 2]), r"tensor 'c' header entry needs dtype, shape and data_offsets"),
])
def test_read_safetensors_header_lies_are_named(tmp_path, edit, match):
    f = tmp_path / "m.safetensors"
    _st_with_header(f, edit)
    with pytest.raises(ValueError, match=re.escape(str(f)) + ": " + match):
        read_safetensors(str(f))


def test_read_safetensors_truncated_and_bad_lengths(tmp_path):
    import struct

    f = tmp_path / "m.safetensors"
    _st_with_header(f, lambda h: None)
    raw = open(f, "rb").read()
    open(f, "wb").write(raw[:-4])  # last 4 bytes of 'b' missing: data section 36 bytes
    with pytest.raises(ValueError, match=r"tensor 'b' bytes \[24, 40\) lie past the end of the data section \(36 bytes\)"):
        read_safetensors(str(f))
    open(f, "wb").write(raw[:4])
    with pytest.raises(ValueError, match="4 bytes, shorter than the 8-byte header length"):
        read_safetensors(str(f))
    open(f, "wb").write(struct.pack("<Q", 10 ** 15) + b"{}")
    with pytest.raises(ValueError, match="header length 1000000000000000 is impossible for a 10-byte file"):
        read_safetensors(str(f))
    open(f, "wb").write(struct.pack("<Q", 8) + b"[1, 2]  ")
    with pytest.raises(ValueError, match="header must be a JSON object, got list"):
        read_safetensors(str(f))


def test_safetensors_metadata_reads_back_and_shares_the_header_checks(tmp_path):
    import struct
    from strata_jax.models.loading import read_safetensors_metadata, write_safetensors
    f = str(tmp_path / "m.safetensors")
    write_safetensors(f, {"x": np.zeros((2, 3), np.float32)}, metadata={"format": "pt", "k": "v"})
    assert read_safetensors_metadata(f) == {"format": "pt", "k": "v"}
    bad = str(tmp_path / "bad.safetensors")
    with open(bad, "wb") as fh:      # a header length far past the file: refused, not read
        fh.write(struct.pack("<Q", 10 ** 12) + b"{}")
    with pytest.raises(ValueError, match="header length 1000000000000 is impossible"):
        read_safetensors_metadata(bad)
