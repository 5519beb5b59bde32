"""Tiny random transformers Qwen2 checkpoints for the model tests (torch is the parity reference).

Every weight, bias and norm scale is drawn at random (HF initialises biases to 0 and norms to 1,
which would hide a missing bias or a wrong norm).
"""
from __future__ import annotations

import numpy as np

# name -> transformers Qwen2Config kwargs. Covers tied / untied, GQA group 1 and > 1, head_dim
# 16 / 24 / 32 (never 64).
PARITY_CONFIGS: dict[str, dict] = {
    "tied_gqa2": dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      rope_theta=1e6),
    "untied_mha": dict(vocab_size=384, hidden_size=96, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                       tie_word_embeddings=False, rope_theta=10000.0),
    "untied_gqa3": dict(vocab_size=448, hidden_size=96, intermediate_size=160,
                        num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                        tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-5),
}


def make_hf_model(seed: int = 0, **kwargs):
    """A randomly initialised fp32 transformers Qwen2ForCausalLM (eval mode, eager attention)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    kwargs.setdefault("max_position_embeddings", 512)
    cfg = Qwen2Config(**kwargs)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def save_hf_model(model, path: str, **kwargs) -> str:
    """save_pretrained into `path` (safetensors); returns path."""
    model.save_pretrained(path, **kwargs)
    return path


def padded_batch(vocab: int, lengths: list[int], seed: int = 0, pad_id: int = 0):
    """Left-padded batch: tokens [B, T] int32, mask [B, T] bool, positions [B, T] int32."""
    rng = np.random.default_rng(seed)
    t = max(lengths)
    tokens = np.full((len(lengths), t), pad_id, np.int32)
    mask = np.zeros((len(lengths), t), bool)
    for b, n in enumerate(lengths):
        tokens[b, t - n:] = rng.integers(1, vocab, n)
        mask[b, t - n:] = True
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return tokens, mask, positions


def hf_logits(model, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """transformers logits [B, T, V] fp32 for a left-padded batch (positions from the mask)."""
    import torch
    tok = torch.from_numpy(tokens.astype(np.int64))
    am = torch.from_numpy(mask.astype(np.int64))
    pos = torch.clamp(am.cumsum(-1) - 1, min=0)
    with torch.no_grad():
        out = model(input_ids=tok, attention_mask=am, position_ids=pos)
    return out.logits.float().numpy()
