"""Fixtures for the rollout tests: logged / slow built-in envs, scripted replies for
memory_key, and a forced-output tiny Qwen2 whose greedy AND sampled outputs are a chosen text.
"""
from __future__ import annotations

import re
import threading
import time

import numpy as np

from envs_bridge.builtin import GridNavEnv, MemoryKeyEnv
from envs_bridge.registry import _FACTORIES, register_env

SENT_ACTIONS: list[tuple[int, str]] = []  # (variation, action) of every action a simulator got
_LOCK = threading.Lock()


class LoggedMemoryKeyEnv(MemoryKeyEnv):
    """memory_key that records every action that reaches the simulator (`_step`)."""

    name = "memory_key_logged"

    def _step(self, action):
        with _LOCK:
            SENT_ACTIONS.append((self._task.variation, action))
        return super()._step(action)


class SlowGridEnv(GridNavEnv):
    """grid_nav whose steps and resets take `delay_s` seconds (an env slower than decoding)."""

    name = "slow_grid"
    instant_steps = False

    def __init__(self, max_steps: int = 4, size: int = 5, delay_s: float = 0.05) -> None:
        super().__init__(max_steps, size)
        self.delay_s = delay_s

    def _reset(self, task):
        time.sleep(self.delay_s)
        return super()._reset(task)

    def _step(self, action):
        time.sleep(self.delay_s)
        return super()._step(action)


class CrashyGridEnv(GridNavEnv):
    """grid_nav whose simulator dies on `go west` (the pool turns that into a crashed episode)."""

    name = "crashy_grid"

    def _step(self, action):
        if action == "go west":
            raise RuntimeError("simulated simulator crash")
        return super()._step(action)


for _cls in (LoggedMemoryKeyEnv, SlowGridEnv, CrashyGridEnv):
    if _cls.name not in _FACTORIES:
        register_env(_cls.name, _cls)


def memory_key_code(variation: int) -> str:
    """The vault code of memory_key task `variation` (from a reset of the real env)."""
    from envs_bridge.base import Task
    env = MemoryKeyEnv()
    env.reset(Task("memory_key", "memory_key", variation))
    return env.code


class MemoryKeyScript:
    """Scripted replies for memory_key prompts.

    Strategy prompts (in call order per task, candidates 0..3): 0 = valid plan "variant A",
    1 = no tags (format failure), 2 = valid "variant B", 3 = valid "variant A" again. Step
    prompts: under "variant B" step 1 is a format-invalid output; otherwise go north until the
    vault, then enter the code read from the strategy. Judge prompts: "<bad_steps>1, 99</bad_steps>".
    """

    def __init__(self) -> None:
        self.strategy_calls = 0

    def __call__(self, prompt: str, key: np.ndarray) -> str:
        if "<strategy></strategy>" in prompt:
            code = re.search(r"vault code (\d)-(\d)-(\d)", prompt).groups()
            i = self.strategy_calls % 4
            self.strategy_calls += 1
            if i == 1:
                return "I would walk north and type the code."
            variant = "B" if i == 2 else "A"
            return f"<strategy>variant {variant}: code {''.join(code)}; go north, then enter it.</strategy>"
        if "<bad_steps>" in prompt:
            return "<think>step 1 was wasted</think><bad_steps>1, 99</bad_steps>"
        step = int(re.search(r"You are at step (\d+)", prompt).group(1)) if "You are at step" in prompt else 1
        if "variant B" in prompt and step == 1:
            return "I am not sure what to do"
        code = re.search(r"code (\d{3});", prompt).group(1)
        if "keypad waits" in prompt.split("urrent observation:")[-1]:
            return f"<think>at the vault</think><action>enter {code}</action>"
        return "<think>walk on</think><action>go north</action>"


FORCED_TEXT = "<think>ok</think><action>look around</ACTION>"
FORCED_CONFIG = dict(vocab_size=151936, hidden_size=64, intermediate_size=32, num_layers=1,
                     num_heads=1, num_kv_heads=1, head_dim=64, rope_theta=100.0,
                     max_position_embeddings=4096)


def forced_output_params(config, tokenizer, text: str, seed: int = 0):
    """Params for `config` (1 layer) whose next token depends only on (previous, current) token
    and spells `text` + <|im_end|> after any prompt ending in "assistant\\n".

    Construction: one-hot token embeddings in dims [0, K) for the K tokens involved; a
    previous-token attention head (q, k from biases only, so scores depend on relative position
    through RoPE, peaked at offset 1) copies the previous token's one-hot into dims [K, 2K);
    the MLP and the other tokens' embeddings stay out of those dims; the LM head scores each
    (previous, current) pair's successor with a large margin, so both greedy and temperature-1
    sampling emit the text. Everything else is random (non-zero weights elsewhere).
    """
    import jax
    import jax.numpy as jnp
    from strata_jax.models import init_params

    ids = list(tokenizer.encode(text, add_special_tokens=False))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ctx = tokenizer.encode("assistant\n", add_special_tokens=False)  # [..., 'assistant', '\n']
    seq = ctx[-2:] + ids + [im_end]
    succ: dict = {}
    for prev, cur, nxt in zip(seq, seq[1:], seq[2:]):
        if succ.setdefault((prev, cur), nxt) != nxt:
            raise ValueError(f"{text!r}: the token pair {(prev, cur)} has two successors; change "
                             f"the text (e.g. the case of a closing tag)")
    # The head scores are additive (current-token term + previous-token term): each pair's
    # successor must win outright, or the model silently writes another text.
    score: dict = {}
    for (prev, cur), nxt in succ.items():
        score[(nxt, "cur", cur)] = score.get((nxt, "cur", cur), 0) + 1
        score[(nxt, "prev", prev)] = score.get((nxt, "prev", prev), 0) + 1
    for (prev, cur), nxt in succ.items():
        s = {m: score.get((m, "cur", cur), 0) + score.get((m, "prev", prev), 0)
             for m in set(succ.values())}
        if [m for m in s if s[m] == max(s.values())] != [nxt]:
            raise ValueError(f"{text!r}: the successor of the token pair {(prev, cur)} does not "
                             f"win the additive head scores; change the case of a tag")
    vocab = sorted(set(seq))
    slot = {t: i for i, t in enumerate(vocab)}
    k = len(vocab)
    d, dh = config.hidden_size, config.head_dim
    assert 2 * k < d and config.num_layers == 1 and config.num_heads == 1 and config.num_kv_heads == 1
    import dataclasses
    # random layer weights from a small-vocab twin (the embedding and head are replaced below)
    small = dataclasses.replace(config, vocab_size=8, tie_word_embeddings=False)
    p = jax.tree.map(np.array, init_params(small, jax.random.key(seed)))
    rng = np.random.default_rng(seed)
    emb = np.zeros((config.vocab_size, d), np.float32)
    emb[:, 2 * k:] = rng.standard_normal((config.vocab_size, d - 2 * k), np.float32)
    emb[vocab] = 0.0
    for t in vocab:
        emb[t, slot[t]] = 1.0
    p["embed"] = emb
    layer = p["layers"][0]
    # previous-token head: q, k constant vectors; k pre-rotated by one position.
    half = dh // 2
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(half) * 2.0 / dh))
    qv = np.concatenate([np.ones(half), np.zeros(half)])
    kv = np.concatenate([np.cos(inv_freq), np.sin(inv_freq)])  # peak at offset +1
    scale = 60.0 / np.sum(1 - np.cos(inv_freq))  # score margin of offset 1 over 0 and 2
    layer["q_proj"][:] = 0.0
    layer["k_proj"][:] = 0.0
    layer["q_bias"][:] = qv * np.sqrt(scale * np.sqrt(dh))
    layer["k_bias"][:] = kv * np.sqrt(scale * np.sqrt(dh))
    layer["v_proj"][:] = 0.0
    layer["v_bias"][:] = 0.0
    # the attention input is RMS-normalised (a one-hot becomes sqrt(d) * one-hot): undo it.
    layer["v_proj"][np.arange(k), np.arange(k)] = 1.0 / np.sqrt(d)
    layer["o_proj"][:] = 0.0
    layer["o_proj"][k + np.arange(k), np.arange(k)] = 1.0
    layer["down_proj"][:] = 0.0
    layer["input_norm"][:] = 1.0
    p["final_norm"][:] = 1.0
    head = np.zeros((config.vocab_size, d), np.float32)
    for (prev, cur), nxt in succ.items():
        head[nxt, slot[cur]] += 4.0
        head[nxt, k + slot[prev]] += 4.0
    p["lm_head"] = head
    return jax.tree.map(jnp.asarray, p)
