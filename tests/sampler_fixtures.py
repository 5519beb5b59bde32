"""Fixtures for the sampler tests: a tiny random transformers checkpoint, HF greedy reference,
and a real compilation counter (jax.monitoring backend-compile events)."""
from __future__ import annotations

import jax
import numpy as np

from tests.model_fixtures import make_hf_model, save_hf_model

# vocab 300 is not a multiple of the sampler's 128-id block; GQA group 2; tied head.
SAMPLER_HF_CONFIG = dict(vocab_size=300, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True, rope_theta=1e6)


def build_checkpoint(path: str, seed: int = 3, std: float = 0.3):
    """(hf_model, path) for a random fp32 Qwen2ForCausalLM saved with save_pretrained.

    Matrices and biases are redrawn with std 0.3: at the usual 0.02-0.05 a 64-wide random model
    greedily repeats one token forever, which would make greedy parity nearly vacuous; at 0.3
    its generations wander over the vocabulary.
    """
    import torch
    model = make_hf_model(seed=seed, **SAMPLER_HF_CONFIG)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(std * torch.randn(p.shape, generator=gen))
    return model, save_hf_model(model, path)


def prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    """Random prompts (ids in [1, vocab)) of the given lengths."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, n).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int,
              stop_id: int | None = None) -> list[int]:
    """transformers greedy `generate` for ONE prompt (no padding); generated ids only.

    An explicit GenerationConfig switches off every default processor (repetition penalty,
    min length, ...) so only argmax and the stop id act.
    """
    import torch
    from transformers import GenerationConfig
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
                           repetition_penalty=1.0, num_beams=1, eos_token_id=stop_id,
                           pad_token_id=0, bos_token_id=None)
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             generation_config=gen)
    return out[0, len(prompt):].tolist()


class CompileCounter:
    """Counts XLA backend compilations in this process (one event per compiled program)."""

    def __init__(self) -> None:
        self.count = 0
        from jax._src import dispatch
        self._event = dispatch.BACKEND_COMPILE_EVENT
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event == self._event:
            self.count += 1


_COUNTER: CompileCounter | None = None


def compile_counter() -> CompileCounter:
    """The process-wide counter (listeners cannot be removed, so register one only)."""
    global _COUNTER
    if _COUNTER is None:
        _COUNTER = CompileCounter()
    return _COUNTER
