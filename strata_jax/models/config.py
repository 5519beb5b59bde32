"""Qwen2 / Qwen2.5 architecture hyper-parameters.

`Qwen2Config` is a frozen (hashable) dataclass so it can be a static argument of jitted
functions. It is parsed from a checkpoint's ``config.json`` in both forms transformers writes:
rope_theta at the top level (transformers 4.x) or inside ``rope_parameters`` (transformers 5.x).
Source: transformers ``Qwen2Config`` / ``modeling_qwen2.py``; docs/design.md §11.1.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any


def _int_field(d: dict[str, Any], key: str, default: int | None = None) -> int:
    """config.json integer field: an int, or a float with an integral value (64.0); a
    fractional value, string or bool raises ValueError naming the field."""
    v = d.get(key, default)
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        return int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"config.json: {key} must be an integer, got {v!r}")
    return v


def _float_field(v: Any, key: str) -> float:
    """config.json real field: an int or float (not a string or bool); ValueError otherwise."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"config.json: {key} must be a number, got {v!r}")
    return float(v)


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
    """Shape and numerics of a Qwen2 decoder.

    Attributes:
      vocab_size: rows of the embedding / LM head (V).
      hidden_size: model width (D).
      intermediate_size: SwiGLU width (F).
      num_layers: decoder layers (L).
      num_heads: query heads (H).
      num_kv_heads: key/value heads (K); H must be a multiple of K (grouped-query attention).
      head_dim: per-head width (Dh); hidden_size // num_heads for every released Qwen2.5.
      rope_theta: RoPE base (1e6 for Qwen2.5).
      rms_norm_eps: RMSNorm epsilon (1e-6 for Qwen2.5).
      tie_word_embeddings: True when the LM head reuses the embedding (0.5B/1.5B/3B).
      max_position_embeddings: longest position the checkpoint was trained for (informational).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768

    def __post_init__(self) -> None:
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Qwen2Config.{key} must be a positive int, got {v!r}")
        for key in ("rope_theta", "rms_norm_eps"):
            v = getattr(self, key)
            # eps <= 0 turns RMSNorm of a zero row into 0/0 = NaN; theta <= 0 breaks RoPE.
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"Qwen2Config.{key} must be a finite number > 0, got {v!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError("Qwen2Config.tie_word_embeddings must be a bool, got "
                             f"{self.tie_word_embeddings!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotate-half RoPE")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "Qwen2Config":
        """Build from a transformers Qwen2 ``config.json`` dict.

        Accepts ``rope_theta`` at the top level or inside ``rope_parameters`` (rope_type
        "default"). Raises ValueError for what this port does not implement: sliding-window
        attention (``use_sliding_window: true``), RoPE scaling (yarn, linear, ...), an activation
        other than silu, or a model_type other than qwen2.
        """
        if not isinstance(d, dict):
            raise ValueError(f"config.json must hold a JSON object, got {type(d).__name__}")
        model_type = d.get("model_type", "qwen2")
        if model_type != "qwen2":
            raise ValueError(f"config.json has model_type={model_type!r}; only 'qwen2' "
                             "(Qwen2 / Qwen2.5) checkpoints are supported")
        if d.get("use_sliding_window", False):
            raise ValueError(
                "config.json sets use_sliding_window: true; strata_jax implements full attention "
                "only (as every released Qwen2.5 uses). Set use_sliding_window to false.")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported (Qwen2 uses 'silu')")
        rope_params = d.get("rope_parameters") or {}
        rope_scaling = d.get("rope_scaling") or {}
        rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
        scaling_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if rope_type != "default" or scaling_type != "default":
            raise ValueError(
                f"RoPE type {rope_type if rope_type != 'default' else scaling_type!r} is not "
                "supported; remove rope_scaling / use rope_type 'default'")
        if "rope_theta" in rope_params:
            theta = rope_params["rope_theta"]
        elif "rope_theta" in d:
            theta = d["rope_theta"]
        else:
            theta = 10000.0  # transformers' Qwen2Config default
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key not in d:
                raise ValueError(f"config.json lacks required field {key!r}")
        heads = _int_field(d, "num_attention_heads")
        hidden = _int_field(d, "hidden_size")
        head_dim = _int_field(d, "head_dim") if d.get("head_dim") else hidden // heads
        tie = d.get("tie_word_embeddings", False)
        if not isinstance(tie, bool):  # bool("false") is True: a silent wrong LM head
            raise ValueError(f"config.json: tie_word_embeddings must be true or false (a JSON bool), "
                             f"got {tie!r}")
        return cls(
            vocab_size=_int_field(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int_field(d, "intermediate_size"),
            num_layers=_int_field(d, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=_int_field(d, "num_key_value_heads") if d.get("num_key_value_heads") else heads,
            head_dim=head_dim,
            rope_theta=_float_field(theta, "rope_theta"),
            rms_norm_eps=_float_field(d.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
            tie_word_embeddings=tie,
            max_position_embeddings=_int_field(d, "max_position_embeddings", 32768),
        )

    @classmethod
    def from_pretrained(cls, path: str) -> "Qwen2Config":
        """Read ``<path>/config.json`` (path: a local checkpoint dir). Raises FileNotFoundError."""
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise FileNotFoundError(f"no config.json in {path!r}: point the model path at an HF "
                                    "checkpoint directory")
        with open(cfg_file) as f:
            try:
                d = json.load(f)
            except ValueError as e:
                raise ValueError(f"{cfg_file} is not valid JSON ({e})") from e
        try:
            return cls.from_hf_dict(d)
        except ValueError as e:
            raise ValueError(f"{cfg_file}: {str(e).removeprefix('config.json: ')}") from e

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers-loadable Qwen2 ``config.json`` dict (fp32 ``torch_dtype`` left to caller)."""
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "use_sliding_window": False,
            "sliding_window": None,
            "attention_dropout": 0.0,
            # Qwen2.5's <|endoftext|> / <|im_end|>, only when the vocabulary has them.
            "bos_token_id": 151643 if self.vocab_size > 151643 else None,
            "eos_token_id": 151645 if self.vocab_size > 151645 else None,
        }

    @property
    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, f, h, k, dh = (self.hidden_size, self.intermediate_size, self.num_heads,
                          self.num_kv_heads, self.head_dim)
        attn = d * h * dh + h * dh + 2 * (d * k * dh + k * dh) + h * dh * d
        layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * layer + d + head


def _qwen25(vocab: int, d: int, f: int, layers: int, heads: int, kv: int,
            tied: bool) -> Qwen2Config:
    return Qwen2Config(vocab_size=vocab, hidden_size=d, intermediate_size=f, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv, head_dim=d // heads,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=tied,
                       max_position_embeddings=32768)


# Shapes of the released Qwen2.5 (Instruct) checkpoints' config.json files.
PRESETS: dict[str, Qwen2Config] = {
    "qwen2.5-0.5b": _qwen25(151936, 896, 4864, 24, 14, 2, True),
    "qwen2.5-1.5b": _qwen25(151936, 1536, 8960, 28, 12, 2, True),
    "qwen2.5-3b": _qwen25(151936, 2048, 11008, 36, 16, 2, True),
    "qwen2.5-7b": _qwen25(152064, 3584, 18944, 28, 28, 4, False),
    "qwen2.5-14b": _qwen25(152064, 5120, 13824, 48, 40, 8, False),
    "qwen2.5-32b": _qwen25(152064, 5120, 27648, 64, 40, 8, False),
    "qwen2.5-72b": _qwen25(152064, 8192, 29568, 80, 64, 8, False),
    # Test shape: the Qwen2.5 tokenizer's vocabulary would dominate, so a small one.
    "tiny": Qwen2Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True),
}
