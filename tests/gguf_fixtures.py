"""Small GGUF files written with ``gguf.GGUFWriter`` from random transformers Qwen2 models.

`write_qwen2_gguf` lays a model out as llama.cpp's converter does (tensor names, ``qwen2.*``
metadata, a byte-level BPE tokenizer) with a chosen storage type per tensor: F32, F16, Q8_0
(quantized with ``gguf.quants``) or a K-quant (Q4_K / Q6_K: the gguf package only dequantizes
those, so their blocks are random bytes with sane fp16 scales). The reference for every test is
transformers loading the SAME file, so quantization error does not enter the comparison.
"""
from __future__ import annotations

import numpy as np

# A tiny tokenizer: the 256 byte-level symbols, two merges ("a b" -> "ab", "ab c" -> "abc"),
# unused filler rows, and three control tokens at the end of the vocabulary.
_MERGES = ["a b", "ab c"]
_CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# K-quant-friendly shape: every matrix's input width is a multiple of 256 (the super-block).
KQUANT_CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                     rope_theta=1e6, rms_norm_eps=1e-6)

# llama.cpp's per-layer names, written out here rather than taken from
# strata_jax.models.weights: the writer is the independent side of the parity tests.
_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def byte_symbols() -> list[str]:
    """GPT-2's byte -> printable-unicode table (the byte-level BPE alphabet), in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def tiny_vocab(vocab_size: int) -> tuple[list[str], list[int]]:
    """(tokens, gguf token types) of the tiny tokenizer, `vocab_size` rows."""
    tokens = byte_symbols() + ["ab", "abc"]
    types = [1] * len(tokens)
    n_fill = vocab_size - len(tokens) - len(_CONTROL)
    assert n_fill >= 0, "vocab_size too small for the tiny tokenizer"
    tokens += [f"[PAD{i}]" for i in range(n_fill)] + _CONTROL
    types += [5] * n_fill + [3] * len(_CONTROL)
    return tokens, types


def _random_kquant(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of a K-quant type with finite fp16 scales (d, dmin) in a sane range."""
    import gguf
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    assert cols % block == 0
    blocks = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q6_K:       # ql[128] qh[64] scales[16] d
        blocks[..., 208:210] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    elif qtype == gguf.GGMLQuantizationType.Q4_K:     # d dmin scales[12] qs[128]
        blocks[..., 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        blocks[..., 2:4] = np.frombuffer(np.float16(0.005).tobytes(), np.uint8)
    else:
        raise ValueError(f"no random-block recipe for {qtype.name}")
    return blocks.reshape(rows, -1)


def write_qwen2_gguf(model, path: str, types: dict[str, str] | None = None,
                     default: str = "F32", arch: str = "qwen2", seed: int = 0,
                     extra_kv: dict | None = None, skip_keys: tuple[str, ...] = ()) -> str:
    """Write a transformers Qwen2ForCausalLM as a GGUF file the way llama.cpp lays it out.

    Args:
      model: the torch model (its config gives the metadata).
      types: llama.cpp tensor-name suffix (e.g. "ffn_down", "token_embd", "output") -> storage
        type "F32" | "F16" | "Q8_0" | "Q4_K" | "Q6_K" for its matrices; norms and biases are F32.
      default: storage type of the matrices not in `types`.
      arch: ``general.architecture`` to write (another value tests the refusal).
      extra_kv: extra ``{key: value}`` metadata (e.g. RoPE scaling): a str, a float, or an int
        (uint32, uint64 above 2**32-1); a key written by default is replaced.
      skip_keys: metadata keys to leave out (tests the missing-key errors).
    Returns: path.
    """
    import gguf
    types = types or {}
    cfg = model.config
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    kv = {
        f"{arch}.block_count": ("uint32", cfg.num_hidden_layers),
        f"{arch}.context_length": ("uint32", cfg.max_position_embeddings),
        f"{arch}.embedding_length": ("uint32", cfg.hidden_size),
        f"{arch}.feed_forward_length": ("uint32", cfg.intermediate_size),
        f"{arch}.attention.head_count": ("uint32", cfg.num_attention_heads),
        f"{arch}.attention.head_count_kv": ("uint32", cfg.num_key_value_heads),
        f"{arch}.rope.freq_base": ("float32", float(cfg.rope_parameters["rope_theta"])
                                   if getattr(cfg, "rope_parameters", None)
                                   else float(cfg.rope_theta)),
        f"{arch}.attention.layer_norm_rms_epsilon": ("float32", float(cfg.rms_norm_eps)),
    }
    for key, (kind, value) in kv.items():
        if key not in skip_keys and key not in (extra_kv or {}):
            getattr(w, f"add_{kind}")(key, value)
    for key, value in (extra_kv or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, int):
            (w.add_uint32 if value < 2**32 else w.add_uint64)(key, value)
        else:
            w.add_float32(key, value)
    tokens, token_types = tiny_vocab(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    if "tokenizer.ggml.token_type" not in skip_keys:
        w.add_token_types(token_types)
    w.add_token_merges(_MERGES)
    w.add_eos_token_id(cfg.vocab_size - 1)
    w.add_pad_token_id(cfg.vocab_size - 3)
    w.add_add_bos_token(False)

    def put(name: str, tensor, kind: str) -> None:
        arr = tensor.detach().float().numpy()
        if arr.ndim == 1 or kind == "F32":
            w.add_tensor(name, arr.astype(np.float32))
        elif kind == "F16":
            w.add_tensor(name, arr.astype(np.float16))
        elif kind == "Q8_0":
            q = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(arr, q), raw_dtype=q)
        else:
            q = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name, _random_kquant(arr.shape[0], arr.shape[1], q, rng), raw_dtype=q)

    sd = model.state_dict()
    put("token_embd.weight", sd["model.embed_tokens.weight"], types.get("token_embd", default))
    for i in range(cfg.num_hidden_layers):
        for hf, ours in _LAYER.items():
            for kind in ("weight", "bias"):
                key = f"model.layers.{i}.{hf}.{kind}"
                if key in sd:
                    put(f"blk.{i}.{ours}.{kind}", sd[key], types.get(ours, default))
    put("output_norm.weight", sd["model.norm.weight"], "F32")
    if not cfg.tie_word_embeddings:
        put("output.weight", sd["lm_head.weight"], types.get("output", default))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_from_gguf(path: str):
    """transformers' own GGUF loading of `path` (fp32, eager attention, eval mode)."""
    import os

    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                 gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    model.config._attn_implementation = "eager"
    return model.eval()


def hostile_gguf(path: str, kv: bytes = b"", n_kv: int = 0, n_tensors: int = 0,
                 pad: int = 0) -> str:
    """A hand-made GGUF v3 file: the header with the given counts, the raw metadata bytes `kv`
    and `pad` zero bytes (the counts need not agree with what follows: that is the point)."""
    import struct
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kv + b"\0" * pad)
    return path


def gguf_key(key: str) -> bytes:
    """A GGUF string (u64 length + utf-8 bytes), e.g. a metadata key."""
    import struct
    raw = key.encode()
    return struct.pack("<Q", len(raw)) + raw


def gguf_string_kv(key: str, value: str) -> bytes:
    """One metadata entry of type STRING (8), raw bytes for `hostile_gguf`'s `kv`."""
    import struct
    return gguf_key(key) + struct.pack("<I", 8) + gguf_key(value)


def gguf_uint8_array_kv(key: str, n: int) -> bytes:
    """One metadata entry: an ARRAY (9) of `n` uint8 (0) zeros, raw bytes for `kv`."""
    import struct
    return gguf_key(key) + struct.pack("<IIQ", 9, 0, n) + b"\0" * n


def gguf_array_kv(key: str, item_type: int, items: list) -> bytes:
    """One metadata entry: an ARRAY (9) of `items` of GGUF value type `item_type` (8: str,
    5: int32), raw bytes for `hostile_gguf`'s `kv`."""
    import struct
    head = gguf_key(key) + struct.pack("<IIQ", 9, item_type, len(items))
    if item_type == 8:
        return head + b"".join(gguf_key(t) for t in items)
    if item_type == 5:
        return head + struct.pack(f"<{len(items)}i", *items)
    raise ValueError(f"no recipe for GGUF value type {item_type}")
