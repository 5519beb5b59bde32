"""Config parsing (both config.json forms, refusals), presets, import hygiene, bf16 forward."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.models import PRESETS, Qwen2Config, forward, init_params

BASE = {"model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "use_sliding_window": False,
        "sliding_window": 131072, "max_window_layers": 21}


def test_rope_theta_top_level_and_rope_parameters_forms():
    old = Qwen2Config.from_hf_dict({**BASE, "rope_theta": 1000000.0, "rope_scaling": None})
    new = Qwen2Config.from_hf_dict(
        {**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}})
    assert old == new
    assert old.rope_theta == 1e6 and old.head_dim == 16 and old.num_kv_heads == 2
    assert old.tie_word_embeddings and old.num_layers == 2


def test_transformers_written_config_parses(tmp_path):
    from transformers import Qwen2Config as HFConfig
    HFConfig(vocab_size=320, hidden_size=96, intermediate_size=64, num_hidden_layers=3,
             num_attention_heads=3, num_key_value_heads=1, rope_theta=12345.0,
             tie_word_embeddings=False).save_pretrained(tmp_path)
    cfg = Qwen2Config.from_pretrained(str(tmp_path))
    assert (cfg.rope_theta, cfg.head_dim, cfg.num_kv_heads, cfg.tie_word_embeddings) == \
        (12345.0, 32, 1, False)
    # Round trip through our own export dict.
    assert Qwen2Config.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg


def test_refusals_are_clear():
    with pytest.raises(ValueError, match="use_sliding_window"):
        Qwen2Config.from_hf_dict({**BASE, "use_sliding_window": True})
    with pytest.raises(ValueError, match="yarn"):
        Qwen2Config.from_hf_dict({**BASE, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="model_type"):
        Qwen2Config.from_hf_dict({**BASE, "model_type": "llama"})
    with pytest.raises(ValueError, match="num_hidden_layers"):
        Qwen2Config.from_hf_dict({k: v for k, v in BASE.items() if k != "num_hidden_layers"})


def test_presets_match_published_parameter_counts():
    # Published (non-embedding + embedding) totals of the Qwen2.5 model cards, in billions.
    expected = {"qwen2.5-0.5b": 0.49, "qwen2.5-1.5b": 1.54, "qwen2.5-3b": 3.09,
                "qwen2.5-7b": 7.61, "qwen2.5-14b": 14.7, "qwen2.5-32b": 32.5,
                "qwen2.5-72b": 72.7}
    for name, billions in expected.items():
        assert PRESETS[name].num_params / 1e9 == pytest.approx(billions, rel=0.01), name
    assert PRESETS["qwen2.5-0.5b"].tie_word_embeddings
    assert not PRESETS["qwen2.5-7b"].tie_word_embeddings


def test_models_import_without_training_dependencies():
    code = textwrap.dedent("""
        import sys
        BLOCKED = ("optax", "orbax", "ml_collections", "tensorboardX", "torch")
        class Blocker:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"blocked: {name}")
                return None
        sys.meta_path.insert(0, Blocker())
        import strata_jax.models as m
        from strata_jax.models import tokenizer  # noqa: F401
        import strata_jax.sharding  # noqa: F401
        assert not any(k.split(".")[0] in BLOCKED for k in sys.modules)
        print("ok", len(m.__all__))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def test_bf16_params_forward_close_to_fp32():
    cfg = PRESETS["tiny"]
    p32 = init_params(cfg, jax.random.key(0))
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p32)
    tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    mask = jnp.ones((2, 6), bool)
    h32, _ = forward(p32, cfg, tokens, pos, mask)
    h16, _ = forward(p16, cfg, tokens, pos, mask)
    assert h16.dtype == jnp.bfloat16 and h32.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(h16, np.float32), h32, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("edit, match", [
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false (a JSON bool), got 'false'"),
    ({"tie_word_embeddings": 0}, "tie_word_embeddings must be true or false (a JSON bool), got 0"),
    ({"vocab_size": 64.9}, "vocab_size must be an integer, got 64.9"),
    ({"vocab_size": "abc"}, "vocab_size must be an integer, got 'abc'"),
    ({"vocab_size": True}, "vocab_size must be an integer, got True"),
    ({"vocab_size": 0}, "Qwen2Config.vocab_size must be a positive int, got 0"),
    ({"num_key_value_heads": 2.5}, "num_key_value_heads must be an integer, got 2.5"),
    ({"rms_norm_eps": -1e-6}, "Qwen2Config.rms_norm_eps must be a finite number > 0, got -1e-06"),
    ({"rms_norm_eps": 0}, "Qwen2Config.rms_norm_eps must be a finite number > 0, got 0.0"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a number, got '1e-6'"),
    ({"rope_theta": float("nan")}, "Qwen2Config.rope_theta must be a finite number > 0, got nan"),
])
def test_bad_field_values_are_clear_errors(edit, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        Qwen2Config.from_hf_dict({**BASE, **edit})


def test_integral_float_sizes_and_json_bools_accepted():
    cfg = Qwen2Config.from_hf_dict({**BASE, "vocab_size": 64.0, "tie_word_embeddings": True})
    assert (cfg.vocab_size, type(cfg.vocab_size), cfg.tie_word_embeddings) == (64, int, True)


@pytest.mark.parametrize("text, match", [
    ("[1, 2]", "config.json: config.json must hold a JSON object, got list"),
    ('"qwen2"', "config.json must hold a JSON object, got str"),
    ("{'a': 1}", "config.json is not valid JSON"),
])
def test_config_json_not_an_object_is_clear(tmp_path, text, match):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=re.escape(match)):
        Qwen2Config.from_pretrained(str(tmp_path))
