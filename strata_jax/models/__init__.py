"""Qwen2 / Qwen2.5 in JAX: config, decoder forward with KV cache, LM head, checkpoint loading.

Imports only jax, flax, numpy (transformers, safetensors and huggingface_hub lazily), so it runs on
accelerator images without the training dependencies. The pinned interface is documented in
qwen2.py (params layout, `KVCache`, `forward`; the layer in layers.py, attention in
attention.py) and heads.py (`token_logprobs_and_entropy`).
"""
from strata_jax.models.config import PRESETS, Qwen2Config
from strata_jax.models.heads import logits_from_hidden, token_logprobs_and_entropy
from strata_jax.models.loading import export_params, load_checkpoint, load_params
from strata_jax.models.attention import QUERY_CHUNK
from strata_jax.models.qwen2 import (KVCache, forward, init_cache, init_params,
                                     param_logical_axes, param_shardings, shard_params)
from strata_jax.models.tokenizer import (QWEN25_CHAT_TEMPLATE, load_tokenizer,
                                         stop_token_ids)

__all__ = [
    "PRESETS", "Qwen2Config", "QUERY_CHUNK", "KVCache", "forward", "init_cache", "init_params",
    "param_logical_axes", "param_shardings", "shard_params", "logits_from_hidden",
    "token_logprobs_and_entropy", "load_params",
    "load_checkpoint", "export_params", "load_tokenizer", "stop_token_ids",
    "QWEN25_CHAT_TEMPLATE",
]
