"""GGUF checkpoints (llama.cpp's single-file format) as a Qwen2 model source: the public API
and the mapping of a file's metadata to the model config.

A ``*.gguf`` file carries everything a run needs: the architecture's hyper-parameters, every
weight tensor (often block-quantized: Q4_K, Q5_0, Q6_K, Q8_0, ...), and the tokenizer (BPE
tokens, merges, token types, special ids, chat template). It is read with the ``gguf`` package
(the format's reference Python reader, maintained with llama.cpp) and mapped onto what the rest
of the project already uses for HF checkpoints, one module per step:

  * `gguf_header`: `check_header`, the pre-scan that bounds every count before the reader
    parses anything, and `open_gguf`, the cached parse;
  * here, `gguf_config` -> `Qwen2Config` from the ``qwen2.*`` metadata (every field checked);
  * `gguf_tensors`: `gguf_tensors` -> ``{HF tensor name: GGUFTensorRef}``, the interface of the
    safetensors `TensorRef`, each tensor dequantized to float32 on ``.read()``, so
    `loading.load_params` places them one at a time;
  * `gguf_tokenizer`: `gguf_tokenizer` -> a transformers fast tokenizer built from the file's
    own vocabulary, merges, special tokens and chat template.

Every public name of those modules is importable from here (``strata_jax.models.gguf``).
Quantized weights are dequantized to float32 once at load: the port computes in fp32/bf16, and a
fine-tuned policy is exported as HF safetensors (`loading.export_params`), which transformers and
vLLM serve.

Metadata keys: llama.cpp ``gguf-py/gguf/constants.py`` (MODEL_ARCH.QWEN2, ``Keys``) and
``src/llama-model.cpp`` (defaults for optional keys).
"""
from __future__ import annotations

from typing import Any

import numpy as np

# The bounds are read as `header.MAX_*`: one home, which tests may patch.
from strata_jax.models import gguf_header as header
from strata_jax.models.config import Qwen2Config
from strata_jax.models.gguf_header import (GGUF_MAGIC, MAX_ARRAY_ITEMS, MAX_CONTEXT, MAX_DIMS,
                                           MAX_HEADS, MAX_HIDDEN, MAX_KV, MAX_LAYERS,
                                           MAX_METADATA_ITEMS, MAX_TENSORS, MAX_VOCAB,
                                           SUPPORTED_ARCHITECTURES, GGUFError, architecture,
                                           check_architecture, check_header, is_gguf,
                                           metadata_field, open_gguf)
from strata_jax.models.gguf_tensors import GGUFTensorRef, gguf_tensors
from strata_jax.models.gguf_tokenizer import gguf_tokenizer
from strata_jax.models.weights import gguf_block_index, gguf_name, gguf_name_to_hf

__all__ = [
    "GGUF_MAGIC", "SUPPORTED_ARCHITECTURES", "GGUFError", "MAX_LAYERS", "MAX_HEADS",
    "MAX_HIDDEN", "MAX_VOCAB", "MAX_CONTEXT", "MAX_ARRAY_ITEMS", "MAX_METADATA_ITEMS", "MAX_KV",
    "MAX_TENSORS", "MAX_DIMS", "check_header", "check_architecture", "is_gguf", "open_gguf",
    "metadata_field", "architecture", "gguf_config", "GGUFTensorRef", "gguf_name_to_hf",
    "gguf_name", "gguf_block_index", "gguf_tensors", "gguf_tokenizer",
]


def _positive_int(v: Any, key: str, file: str, limit: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < 1:
        raise GGUFError(f"{file}: GGUF metadata {key!r} must be a positive integer, got {v!r}")
    if limit is not None and int(v) > limit:
        raise GGUFError(f"{file}: GGUF metadata {key!r} is {int(v)}, above the {limit} a Qwen2 "
                        "model can have: a damaged or hostile file; re-download or re-convert it")
    return int(v)


def _agree(file: str, key: str, value: int, tensor: str, found: int) -> None:
    if value != found:
        raise GGUFError(f"{file}: GGUF metadata {key!r} is {value} but tensor {tensor!r} says "
                        f"{found}: an inconsistent file; re-download or re-convert it")


def gguf_config(path: str) -> Qwen2Config:
    """`Qwen2Config` from a GGUF file's ``qwen2.*`` metadata.

    Keys read (llama.cpp ``LLM_KV_*``): block_count, embedding_length, feed_forward_length,
    attention.head_count, attention.head_count_kv (default: head_count, as llama.cpp),
    attention.key_length / value_length (default: embedding_length / head_count; must agree),
    rope.freq_base (default 10000, as llama.cpp), attention.layer_norm_rms_epsilon,
    context_length. vocab_size is the embedding's row count; the LM head is tied when the file
    has no ``output.weight`` (llama.cpp's rule).

    Every size is bounded (layers <= MAX_LAYERS, heads <= MAX_HEADS, hidden width <=
    MAX_HIDDEN, feed-forward width <= 8 * MAX_HIDDEN, vocabulary <= MAX_VOCAB, context <=
    MAX_CONTEXT) and checked against the tensors the file
    holds (block_count = the ``blk.<i>`` layers present, embedding_length = the embedding's
    width, head counts x key_length = layer 0's q / k widths, feed_forward_length = its
    ffn_up width), so a hostile key cannot make the model builder allocate without bound.

    Raises:
      GGUFError (a ValueError): another architecture, a missing, malformed, out-of-bounds or
        inconsistent key, RoPE scaling (YaRN / linear: not ported), or key_length !=
        value_length.
    """
    reader = open_gguf(path)
    arch = architecture(reader)
    file = reader.data.filename

    def get(key: str, default: Any = None) -> Any:
        return metadata_field(reader, f"{arch}.{key}", default)

    scaling = metadata_field(reader, f"{arch}.rope.scaling.type", "none", required=False)
    if scaling not in ("none", ""):
        raise GGUFError(f"{file}: RoPE scaling {scaling!r} is not supported by the Qwen2 port "
                         "(it implements plain RoPE with rope.freq_base)")
    hidden = _positive_int(get("embedding_length"), f"{arch}.embedding_length", file,
                           header.MAX_HIDDEN)
    heads = _positive_int(get("attention.head_count"), f"{arch}.attention.head_count", file,
                          header.MAX_HEADS)
    kv_heads = _positive_int(get("attention.head_count_kv", heads),
                             f"{arch}.attention.head_count_kv", file, header.MAX_HEADS)
    key_len = _positive_int(get("attention.key_length", hidden // heads),
                            f"{arch}.attention.key_length", file, header.MAX_HIDDEN)
    value_len = _positive_int(get("attention.value_length", key_len),
                              f"{arch}.attention.value_length", file, header.MAX_HIDDEN)
    if key_len != value_len:
        raise GGUFError(f"{file}: key_length {key_len} != value_length {value_len}; Qwen2 uses "
                         "one head width")
    layers = _positive_int(get("block_count"), f"{arch}.block_count", file, header.MAX_LAYERS)
    ffn = _positive_int(get("feed_forward_length"), f"{arch}.feed_forward_length", file,
                        8 * header.MAX_HIDDEN)
    context = _positive_int(get("context_length"), f"{arch}.context_length", file,
                            header.MAX_CONTEXT)
    tensors = {t.name: t for t in reader.tensors}
    embed = gguf_name("embed")
    if embed not in tensors:
        raise GGUFError(f"{file}: no {embed} tensor; not a Qwen2 model file")
    # GGUF shapes are [in, out]: the embedding is [D, V], a projection [D_in, D_out].
    width = lambda name: [int(d) for d in tensors[name].shape]  # noqa: E731
    vocab = width(embed)[-1]
    if vocab > header.MAX_VOCAB:
        raise GGUFError(f"{file}: {embed} has {vocab} rows, above the "
                        f"{header.MAX_VOCAB} a Qwen2 vocabulary can have: a damaged or hostile "
                        "file; re-download or re-convert it")
    _agree(file, f"{arch}.embedding_length", hidden, embed, width(embed)[0])
    present = {i for i in map(gguf_block_index, tensors) if i is not None}
    if present != set(range(len(present))) or len(present) != layers:
        raise GGUFError(f"{file}: GGUF metadata '{arch}.block_count' is {layers} but the file "
                        f"holds tensors of {len(present)} layers"
                        f"{'' if present == set(range(len(present))) else ' (not numbered 0..n-1)'}"
                        ": an inconsistent file; re-download or re-convert it")
    for name, key, value in ((gguf_name("q_proj", 0), "attention.head_count", heads * key_len),
                             (gguf_name("k_proj", 0), "attention.head_count_kv",
                              kv_heads * key_len),
                             (gguf_name("up_proj", 0), "feed_forward_length", ffn)):
        if name in tensors:
            _agree(file, f"{arch}.{key}" + (" x key_length" if "head" in key else ""), value,
                   name, width(name)[-1])
    theta = get("rope.freq_base", 10000.0)
    eps = get("attention.layer_norm_rms_epsilon")
    for key, v in (("rope.freq_base", theta), ("attention.layer_norm_rms_epsilon", eps)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating)):
            raise GGUFError(f"{file}: GGUF metadata '{arch}.{key}' must be a number, got {v!r}")
    try:
        return Qwen2Config(
            vocab_size=vocab, hidden_size=hidden,
            intermediate_size=ffn, num_layers=layers,
            num_heads=heads, num_kv_heads=kv_heads, head_dim=key_len,
            # float32 metadata: 1e-6 is stored as 9.99999997e-07; round to float32 precision.
            rope_theta=float(np.float32(theta)), rms_norm_eps=float(f"{np.float32(eps):.7g}"),
            tie_word_embeddings=gguf_name("lm_head") not in tensors,
            max_position_embeddings=context)
    except ValueError as e:
        raise GGUFError(f"{file}: {e}") from e
