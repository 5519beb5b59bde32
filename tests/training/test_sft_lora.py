"""Behaviour cloning trained as LoRA (``sft.lora_rank`` > 0), exported as adapter files.

1. `train_sft` with LoRA trains adapters only: the base params stay bit-identical, the first
   AdamW step moves B by lr per entry (sign of the gradient) and A only by the weight decay
   (B = 0 makes A's gradient exactly 0), the first loss is the base's, and the loss falls.
2. The export folder holds the adapter files (PEFT's names, bf16, recorded sha256 and base
   identity) and sft_meta.json, no model.safetensors; the warm start loaded from it equals
   W + (alpha / rank) * B @ A by hand (float32, then cast to model.dtype) and gives the logits
   of `lora_params(base, adapters rounded to bf16)`.
3. A tampered adapter file, or one trained over another base, is refused.
4. ``sft.lora_rank=0`` keeps the fingerprints of the code before the LoRA fields (hex values
   computed at that commit) and the HF-checkpoint export.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from configs import builtin
from envs_bridge.base import Task
from strata_jax.jobs import warm_start
from strata_jax.models import (PRESETS, Qwen2Config, forward, init_params, load_tokenizer,
                               logits_from_hidden)
from strata_jax.models.adapter_files import (ADAPTER_FILE, CONFIG_FILE, AdapterError,
                                             load_adapters, params_sha256, read_adapter_config)
from strata_jax.models.lora import PROJECTIONS, init_lora, lora_params
from strata_jax.rollout import PromptBuilder
from strata_jax.training import sft

MK_TASKS = [Task("memory_key", "memory_key", s, "train") for s in (0, 1)]
# the model of the warm-start tests in test_sft.py: the tokenizer's vocabulary, one small layer
SMALL = Qwen2Config(vocab_size=151936, hidden_size=16, intermediate_size=32, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=8, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def examples(tok):
    """The flat-form rows of two memory_key expert episodes (10 rows, one batch)."""
    builder = PromptBuilder(tok, max_prompt_tokens=512, history_length=2)
    eps = sft.collect_expert_episodes("memory_key", MK_TASKS, noise=0.0,
                                      env_kwargs=dict(max_steps=8))
    return [e for ep in eps for e in sft.render_episode(builder, ep, with_strategy=False)]


def _host(tree):
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def _lora_config(c, rank=4, alpha=8.0):
    """The tiny builtin config with a cheap LoRA warm start in ``<workdir>/warm_start``."""
    c.sft.cache_dir = ""
    c.sft.episodes, c.sft.steps, c.sft.batch_size, c.sft.lr = 1, 3, 4, 1e-2
    c.sft.strategy_mode, c.sft.judge = "flat", False
    c.sft.lora_rank, c.sft.lora_alpha = rank, alpha
    c.model.warm_start = "sft"
    return c


def test_lora_sft_trains_only_adapters_and_lowers_the_loss(examples):
    cfg = dataclasses.replace(PRESETS["tiny"], vocab_size=151936)   # experiment.build_model
    params = init_params(cfg, jax.random.PRNGKey(0))
    before = _host(params)
    scfg = sft.SFTConfig(steps=10, batch_size=16, lr=1e-2, warmup_steps=2, lora_rank=8,
                         lora_alpha=16.0)
    adapters, losses = sft.train_sft(params, cfg, examples, scfg)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(a), b)            # the base: not a bit moved
    assert sorted(adapters["layers"]) == ["0", "1"]
    assert all(sorted(m) == sorted(PROJECTIONS) for m in adapters["layers"].values())
    assert adapters["layers"]["0"]["q_proj"]["a"].shape == (8, 64)
    assert adapters["layers"]["0"]["down_proj"]["b"].shape == (64, 8)
    # B = 0 at init: the first loss is the base model's, ln V for this near-uniform init
    assert losses[0] == pytest.approx(math.log(151936), abs=0.2)
    batch = sft.make_sft_batch(examples, 16)
    base_loss = float(jax.jit(lambda p: sft.sft_loss(p, cfg, batch)[0])(params))
    assert losses[0] == pytest.approx(base_loss, rel=1e-6)
    lora_loss = float(jax.jit(lambda p, a: sft.sft_loss(lora_params(p, a, scfg.lora), cfg,
                                                        batch)[0])(params, adapters))
    assert lora_loss < losses[0] - 0.3 and losses[-1] < losses[0] - 0.3, (lora_loss, losses)


def test_the_first_lora_step_is_adamw_on_the_adapter_gradient(examples):
    """AdamW's first step is lr * g / (|g| + eps) (bias-corrected moments m = g, v = g^2) on
    the clipped gradient g of the adapters: B moves by it; A's gradient is exactly 0 while
    B = 0, so A only decays: A0 * (1 - lr * weight_decay)."""
    scfg = sft.SFTConfig(steps=1, batch_size=16, lr=1e-2, warmup_steps=0, weight_decay=0.01,
                         grad_clip=1.0, lora_rank=4, lora_alpha=8.0)
    params = init_params(SMALL, jax.random.PRNGKey(0))
    adapters, _ = sft.train_sft(params, SMALL, examples, scfg)
    a0 = init_lora(SMALL, scfg.lora, jax.random.PRNGKey(scfg.seed))
    batch = sft.make_sft_batch(examples, 16)
    grads = jax.jit(jax.grad(lambda a: sft.sft_loss(lora_params(params, a, scfg.lora), SMALL,
                                                    batch)[0]))(a0)
    norm = math.sqrt(sum(float(jnp.sum(g.astype(jnp.float32) ** 2))
                         for g in jax.tree.leaves(grads)))
    clip = min(1.0, 1.0 / norm)
    for proj in PROJECTIONS:
        got, init = adapters["layers"]["0"][proj], a0["layers"]["0"][proj]
        g = grads["layers"]["0"][proj]
        assert not np.asarray(g["a"]).any()                       # exactly 0 at B = 0
        np.testing.assert_allclose(np.asarray(got["a"]), np.asarray(init["a"]) * (1 - 1e-4),
                                   rtol=1e-6)
        gb = np.asarray(g["b"], np.float64) * clip
        np.testing.assert_allclose(np.asarray(got["b"]), -1e-2 * gb / (np.abs(gb) + 1e-8),
                                   rtol=1e-4, atol=1e-9)
        assert np.abs(np.asarray(got["b"])).max() > 0.9e-2, proj


def test_lora_export_is_adapter_files_and_loads_as_the_merged_base(tmp_path, tok):
    c = _lora_config(builtin.get_config("tiny"))
    params = init_params(SMALL, jax.random.PRNGKey(0))
    scfg = sft.SFTConfig.from_config(c)
    out = warm_start.warm_start_dir(c, SMALL, str(tmp_path))
    trained, meta = warm_start.run_sft(c, SMALL, params, tok, out, scfg)
    assert sorted(os.listdir(out)) == [CONFIG_FILE, ADAPTER_FILE, warm_start.META_FILE]
    config = read_adapter_config(out)                                  # its checksum verifies
    with open(os.path.join(out, ADAPTER_FILE), "rb") as f:
        assert config["strata_jax"]["sha256"] == hashlib.sha256(f.read()).hexdigest()
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert config["target_modules"] == list(PROJECTIONS)
    recorded = config["strata_jax"]
    assert (recorded["algo"], recorded["step"], recorded["seed"]) == ("sft", 3, 0)
    assert recorded["base"] == {"model_path": str(c.model.path), "model_preset": "tiny",
                                "model_dtype": "float32", "warm_start": "",
                                "params_sha256": params_sha256(params)}
    assert meta["sft"]["lora_rank"] == 4
    # the file holds the trained adapters rounded to bf16
    rounded = jax.tree.map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32),
                           trained)
    loaded, _ = load_adapters(out, SMALL)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(rounded)):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, np.asarray(b))
               for a, b in zip(jax.tree.leaves(rounded), jax.tree.leaves(trained)))
    # the warm start: found in the cache (no retraining), W + (8 / 4) * B @ A by hand
    ws = warm_start.maybe_warm_start(c, SMALL, params, tok, str(tmp_path), train=False)
    layer, base_layer = ws["layers"][0], params["layers"][0]
    for proj in PROJECTIONS:
        ab = rounded["layers"]["0"][proj]
        want = np.asarray(base_layer[proj], np.float64) + 2.0 * (
            ab["b"].astype(np.float64) @ ab["a"].astype(np.float64))
        assert layer[proj].dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(layer[proj]), want, rtol=1e-6, atol=1e-7)
        assert not np.allclose(np.asarray(layer[proj]), np.asarray(base_layer[proj]))
    for name in ("embed", "final_norm"):
        np.testing.assert_array_equal(np.asarray(ws[name]), np.asarray(params[name]))
    np.testing.assert_array_equal(np.asarray(layer["input_norm"]),
                                  np.asarray(base_layer["input_norm"]))
    # the same logits as the unmerged LoRA forward with the bf16-rounded adapters
    ids = jnp.asarray([[151644, 872, 198, 3, 17, 42, 9, 100]], jnp.int32)
    pos, mask = jnp.arange(8)[None], jnp.ones((1, 8), bool)

    def logits(p):
        return np.asarray(logits_from_hidden(p, SMALL, forward(p, SMALL, ids, pos, mask)[0]))
    got, ref = logits(ws), logits(lora_params(params, rounded, scfg.lora))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    assert not np.allclose(got, logits(params), atol=1e-6)
    # the export folder named explicitly: the same warm start
    c.model.warm_start = out
    explicit = warm_start.maybe_warm_start(c, SMALL, params, tok, "unused")
    for a, b in zip(jax.tree.leaves(explicit), jax.tree.leaves(ws)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_bf16_base_merges_in_float32_then_casts(tmp_path):
    """model.dtype=bfloat16: the merge is (W.f32 + scale * B @ A).astype(bf16), one rounding."""
    c = _lora_config(builtin.get_config("tiny"))
    c.model.dtype = "bfloat16"
    scfg = sft.SFTConfig.from_config(c)
    base = init_params(SMALL, jax.random.PRNGKey(0), jnp.bfloat16)
    adapters = init_lora(SMALL, scfg.lora, jax.random.PRNGKey(5))
    adapters = jax.tree.map(lambda x: x + 0.3, adapters)                # B != 0
    warm_start.export_sft_adapters(c, SMALL, scfg, adapters, base, str(tmp_path))
    merged = warm_start.merged_warm_start(c, SMALL, base, str(tmp_path))
    loaded, _ = load_adapters(str(tmp_path), SMALL)
    for proj in PROJECTIONS:
        ab = loaded["layers"]["0"][proj]
        w = np.asarray(base["layers"][0][proj]).astype(np.float32)
        want = (w + 2.0 * (ab["b"] @ ab["a"])).astype(ml_dtypes.bfloat16)
        got = np.asarray(merged["layers"][0][proj])
        assert got.dtype == ml_dtypes.bfloat16
        # f32 products summed in another order may round the last f32 bit differently, which
        # can flip a bf16 rounding: all but a few entries are bit-identical, none off by more
        # than one bf16 step
        same = got == want
        assert same.mean() > 0.99, proj
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32),
                                   rtol=2 ** -7)


def test_a_tampered_or_foreign_adapter_file_is_refused(tmp_path, tok):
    c = _lora_config(builtin.get_config("tiny"))
    params = init_params(SMALL, jax.random.PRNGKey(0))
    scfg = sft.SFTConfig.from_config(c)
    out = str(tmp_path / "export")
    adapters = jax.tree.map(lambda x: x + 0.1, init_lora(SMALL, scfg.lora, jax.random.PRNGKey(0)))
    warm_start.export_sft_adapters(c, SMALL, scfg, adapters, params, out)
    c.model.warm_start = out
    ok = warm_start.maybe_warm_start(c, SMALL, params, tok, "unused")
    assert not np.array_equal(np.asarray(ok["layers"][0]["q_proj"]),
                              np.asarray(params["layers"][0]["q_proj"]))
    # another base (another init seed): its params' bytes differ from the recorded ones
    other = init_params(SMALL, jax.random.PRNGKey(1))
    with pytest.raises(AdapterError, match=r"^model\.warm_start: .*params_sha256="):
        warm_start.maybe_warm_start(c, SMALL, other, tok, "unused")
    # one byte of the tensor data changed after the file was written
    model_file = os.path.join(out, ADAPTER_FILE)
    data = bytearray(open(model_file, "rb").read())
    data[-3] ^= 0x01
    with open(model_file, "wb") as f:
        f.write(bytes(data))
    with pytest.raises(AdapterError, match=r"^model\.warm_start: .* has sha256 .* the file "
                                           r"changed after it was written"):
        warm_start.maybe_warm_start(c, SMALL, params, tok, "unused")
    # a folder holding a full checkpoint beside adapter files: which is the warm start?
    both = str(tmp_path / "both")
    warm_start.export_sft_adapters(c, SMALL, scfg, adapters, params, both)
    from strata_jax.models import export_params
    export_params(other, SMALL, both)
    c.model.warm_start = both
    with pytest.raises(AdapterError, match=r"holds both LoRA adapter files and a full "
                                           r"checkpoint"):
        warm_start.maybe_warm_start(c, SMALL, params, tok, "unused")
    # the adapter tensors without their config (a copy cut short)
    os.remove(os.path.join(both, "config.json"))
    os.remove(os.path.join(both, "model.safetensors"))
    os.remove(os.path.join(both, "adapter_config.json"))
    with pytest.raises(AdapterError, match=r"without its adapter_config.json: an incomplete LoRA "
                                           r"export; delete the folder"):
        warm_start.maybe_warm_start(c, SMALL, params, tok, "unused")


def test_lora_rank_0_keeps_the_old_fingerprints_and_the_hf_export(tmp_path, tok):
    """The hex values are `fingerprint` of these configs at the commit before the LoRA fields
    (47a1ccc), with the batch widths of that time (``sft.max_shapes=0``; the planned widths,
    the default since, train other bytes and are keyed apart): every existing cached warm start
    is still found."""
    c = builtin.get_config("tiny")
    fp = lambda: warm_start.fingerprint(c, SMALL, sft.SFTConfig.from_config(c))  # noqa: E731
    assert c.sft.max_shapes == 4 and fp() != "9f4343203dce"
    c.sft.max_shapes = 0
    assert fp() == "9f4343203dce"
    c.sft.lora_alpha = 8.0                  # unused at rank 0: the same fingerprint
    c.sft.lora_targets = (r"q_proj$",)
    assert fp() == "9f4343203dce"
    c.sft.plan_code = "mask"
    assert fp() == "386336425326"
    c.sft.plan_code = "keep"
    c.sft.lora_rank = 4
    lora = fp()
    c.sft.lora_alpha = 16.0
    alpha = fp()
    c.sft.lora_targets = (r"(q|v)_proj$",)
    assert len({"9f4343203dce", lora, alpha, fp()}) == 4
    # rank 0: the HF checkpoint, no adapter files
    c = _lora_config(builtin.get_config("tiny"), rank=0)
    out = str(tmp_path / "full")
    warm_start.run_sft(c, SMALL, init_params(SMALL, jax.random.PRNGKey(0)), tok, out)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", warm_start.META_FILE]
    assert not warm_start.holds_adapters(out)


def test_lora_fields_are_checked_like_the_lora_section():
    with pytest.raises(ValueError, match=r"^sft\.lora_rank must be >= 0"):
        sft.SFTConfig(lora_rank=-1)
    for bad in (0.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"^sft\.lora_alpha must be a finite number > 0"):
            sft.SFTConfig(lora_rank=4, lora_alpha=bad)
    with pytest.raises(ValueError, match=r"^sft\.lora_targets entry '\(' is not a valid regex"):
        sft.SFTConfig(lora_rank=4, lora_targets=("(",))
    assert sft.SFTConfig(lora_rank=4, lora_targets="q_proj$").lora.targets == ("q_proj$",)
    assert sft.SFTConfig().lora is None


def test_lora_sft_and_its_merge_on_a_mesh(tmp_path, examples):
    """Params on the mesh: the adapters are placed like the RL trainer's (`lora_shardings`), the
    steps after the first reuse its program, and the merged warm start keeps the params'
    placement and equals the merge of the same adapters off the mesh."""
    from strata_jax.metrics import CompileCounter
    from strata_jax.models import shard_params
    from strata_jax.models.lora import lora_shardings
    from strata_jax.sharding import make_mesh
    mesh = make_mesh({"fsdp": -1})
    host = init_params(SMALL, jax.random.PRNGKey(0))
    params = shard_params(host, SMALL, mesh)
    scfg = sft.SFTConfig(steps=3, batch_size=10, lr=1e-2, warmup_steps=1, log_every=1,
                         lora_rank=4, lora_alpha=8.0)
    counter = CompileCounter.install()
    seen = []
    adapters, losses = sft.train_sft(params, SMALL, examples, scfg,
                                     log_fn=lambda _: seen.append(counter.count))
    assert seen[3] == seen[2] == seen[1] > seen[0], seen
    assert losses[2] < losses[0]
    want = lora_shardings(adapters, SMALL, mesh)
    for a, s in zip(jax.tree.leaves(adapters), jax.tree.leaves(want)):
        assert a.sharding == s
    c = _lora_config(builtin.get_config("tiny"))
    warm_start.export_sft_adapters(c, SMALL, scfg, adapters, params, str(tmp_path))
    on_mesh = warm_start.merged_warm_start(c, SMALL, params, str(tmp_path), mesh=mesh)
    off_mesh = warm_start.merged_warm_start(c, SMALL, host, str(tmp_path))
    for a, b, p in zip(jax.tree.leaves(on_mesh), jax.tree.leaves(off_mesh),
                       jax.tree.leaves(params)):
        assert a.sharding == p.sharding
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-8)


def test_lora_targets_that_select_nothing_are_refused_before_any_expert_plays(tmp_path, tok,
                                                                             monkeypatch):
    from strata_jax.config import ConfigError
    c = _lora_config(builtin.get_config("tiny"))
    c.sft.lora_targets = ("nonexistent_proj",)
    monkeypatch.setattr(warm_start, "sft_examples", lambda *a: pytest.fail("experts played"))
    with pytest.raises(ConfigError, match=r"^sft\.lora_targets \('nonexistent_proj',\) match "
                                          r"no projection"):
        warm_start.run_sft(c, SMALL, init_params(SMALL, jax.random.PRNGKey(0)), tok,
                           str(tmp_path / "x"))
