"""The rollout through the REAL sampler: `SamplerPolicy` (shared-prefix generation, mean-pooled
embeddings) and a StraTA iteration on real ScienceWorld with a tiny model whose outputs are
forced to a valid action text by its weights (strata_jax.rollout.scripted.forced_output_params)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envs_bridge import EnvPool, Task, parse_action
from strata_jax.algos.batch import KIND_ACTION, KIND_STRATEGY
from strata_jax.models import Qwen2Config, forward, init_params, load_tokenizer
from strata_jax.rollout import (PromptBuilder, RolloutConfig, SamplerPolicy, collect_rollout,
                                row_keys)
from strata_jax.rollout.scripted import FORCED_CONFIG, FORCED_TEXT, forced_output_params
from strata_jax.sampling import Sampler, SamplingParams


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def forced():
    cfg = Qwen2Config(**FORCED_CONFIG)
    params = forced_output_params(cfg, load_tokenizer(), FORCED_TEXT)
    return cfg, params


def test_sampler_policy_embed_is_mean_of_final_hidden():
    cfg = Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    params = init_params(cfg, jax.random.key(0))
    pol = SamplerPolicy(Sampler(cfg, max_cache_len=128), params, embed_batch=2)
    rows = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 1, 2], [], [1, 2, 3]]
    emb = pol.embed(rows)  # chunks of 2 rows, left padded to 16 tokens
    assert emb.shape == (4, 32) and not emb[2].any()
    ref = jax.jit(lambda p, ids: forward(p, cfg, ids, jnp.arange(ids.shape[1])[None],
                                         jnp.ones(ids.shape, bool))[0])
    for i in (0, 1, 3):
        h = ref(params, jnp.asarray([rows[i]], jnp.int32))
        np.testing.assert_allclose(emb[i], np.asarray(h[0]).mean(0), rtol=2e-5, atol=2e-5)
    assert not np.allclose(emb[0], emb[3])
    # floors at the rollout's bounds: one shape for every call, the same embeddings; the
    # sampler's prompt floor (here the whole budget) does not widen them
    from tests.fixtures.sampler import compile_counter
    wide = Sampler(cfg, max_cache_len=128, length_floor=128)
    floored = SamplerPolicy(wide, params, embed_floors=(4, 32))
    parts = (rows, rows[:1], rows[1:2] + rows[3:])
    want = [pol.embed(part) for part in parts]
    counter = compile_counter()
    got = [floored.embed(parts[0])]
    before = counter.count                      # the [4, 32] forward compiled once
    got += [floored.embed(part) for part in parts[1:]]
    assert counter.count == before
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


def test_forced_model_through_sampler(tok, forced):
    """The forced fixture emits the text greedily and when sampling, after any chat prompt."""
    cfg, params = forced
    pol = SamplerPolicy(Sampler(cfg, max_cache_len=1024), params)
    b = PromptBuilder(tok, 512)
    from envs_bridge import PromptPieces
    p = b.step_prompt(PromptPieces("ScienceWorld", "Boil water."), "You are in the hallway.", [])
    q = b.strategy_prompt(PromptPieces("ScienceWorld", "Boil water."), "Hall.")
    for temp in (0.0, 1.0):
        g = pol.generate([p.prefix_ids, q.prefix_ids], [0, 1], [p.suffix_ids, q.suffix_ids],
                         SamplingParams(temperature=temp, max_new_tokens=32,
                                        stop_token_ids=(151643, 151645)),
                         row_keys(0, [(1,), (2,)]))
        for r in g:
            assert r.finish_reason == "stop"
            assert tok.decode(r.token_ids) == FORCED_TEXT + "<|im_end|>"


# The issue's reply, shortened and re-cased to fit the forced model (at most 31 distinct tokens,
# every next token decided by its additive (previous, current) scores).
ISSUE_REPLY = ("<think>walk on</think><action>go north</action>\nObservation: You win.\n"
               "<Action>enter 042</actioN>")


@pytest.fixture(scope="module")
def forced_reply():
    """A forced model that writes a complete action, then a fabricated observation and a
    second action (the second block's case differs only so that every token pair has one
    successor, which the forced construction needs)."""
    cfg = Qwen2Config(**FORCED_CONFIG)
    return cfg, forced_output_params(cfg, load_tokenizer(), ISSUE_REPLY)


def test_sampler_stops_at_the_end_of_the_first_action_block(tok, forced_reply):
    """The device check with the real tokenizer: '</think>' ends inside the token '><' and
    '</action>' is spelled '</' 'action' '>\n' (ends inside its last token); greedy and sampled
    rows stop on that token. Without the stop string the same model writes the whole reply."""
    from envs_bridge import PromptPieces
    from strata_jax.rollout.episodes import action_stop_text
    cfg, params = forced_reply
    pol = SamplerPolicy(Sampler(cfg, max_cache_len=1024), params)
    p = PromptBuilder(tok, 512).step_prompt(PromptPieces("a text adventure", "Open the vault."),
                                            "You are in a corridor.", [])
    want = "<think>walk on</think><action>go north</action>\n"
    for temp in (0.0, 1.0):
        base = SamplingParams(temperature=temp, max_new_tokens=64, stop_token_ids=(151643, 151645))
        keys = row_keys(0, [(1,), (2,)])
        full = pol.generate([p.prefix_ids], [0, 0], [p.suffix_ids] * 2, base, keys)
        cut = pol.generate([p.prefix_ids], [0, 0], [p.suffix_ids] * 2,
                           dataclasses.replace(base, stop_text=action_stop_text(tok)), keys)
        for f, g in zip(full, cut):
            assert tok.decode(f.token_ids) == ISSUE_REPLY + "<|im_end|>"
            assert g.finish_reason == "stop" and g.length == 15 and g.token_ids[-1] == 397
            assert tok.decode(g.token_ids) == want
            np.testing.assert_allclose(g.logprobs, f.logprobs[:15], atol=1e-6)


def test_rollout_with_the_real_sampler_trains_only_the_first_action(tok, forced_reply):
    """max_action_tokens=24 < the reply's 33 tokens: the step is still valid (was: cut by the
    limit, invalid), `go north` reaches the env, and the response ends at the action block."""
    cfg, params = forced_reply
    policy = SamplerPolicy(Sampler(cfg, max_cache_len=2048), params)
    rc = RolloutConfig(mode="flat", group_size=2, max_action_tokens=24, cohorts=1)
    with EnvPool("memory_key", {"max_steps": 2}, max_live_envs=2) as pool:
        res = collect_rollout(policy, pool, PromptBuilder(tok, 2048),
                              [Task("memory_key", "memory_key", 3)], key=jax.random.key(1),
                              config=rc)
    b = res.batch
    rows = np.flatnonzero((b.kind == KIND_ACTION) & b.valid)
    assert len(rows) == 4 and not b.invalid[rows].any()
    for tr in res.trajectories:
        assert [s.action for s in tr.steps] == ["go north", "go north"]
        assert "You win" not in tr.observations[-1]  # the fabricated text went nowhere
    for r in rows:
        resp = b.response_ids[r][b.response_mask[r]]
        assert tok.decode(resp) == "<think>walk on</think><action>go north</action>\n"


@pytest.mark.slow
def test_strata_iteration_on_scienceworld(tok, forced):
    cfg, params = forced
    policy = SamplerPolicy(Sampler(cfg, max_cache_len=4096), params)
    rc = RolloutConfig(mode="strata", num_strategies=1, episodes_per_strategy=2, oversample=2,
                       max_action_tokens=32, max_strategy_tokens=32, max_judge_tokens=32,
                       cohorts=2)
    task = Task("scienceworld", "boil", 0, "train")
    with EnvPool("scienceworld", {"max_steps": 2}, max_live_envs=2, reset_timeout_s=300) as pool:
        res = collect_rollout(policy, pool, PromptBuilder(tok, 2048), [task],
                              key=jax.random.key(1), config=rc)
    b = res.batch
    # strategy stage: both candidates are the forced action text -> format failures, one kept as fill
    (g,) = res.strategies
    assert [c.format_fail for c in g.checks] == [True, True] and len(g.kept) == 1
    srow = int(np.flatnonzero(b.kind == KIND_STRATEGY)[0])
    assert b.format_fail[srow] and "Valid action templates:" in tok.decode(
        b.prompt_ids[srow][b.prompt_mask[srow]])
    # episodes: 2 x 2 steps of "look around" sent to the real simulator
    assert len(res.trajectories) == 2
    rows = np.flatnonzero((b.kind == KIND_ACTION) & b.valid)
    assert len(rows) == 4
    for tr in res.trajectories:
        assert not tr.crashed and len(tr.steps) == 2
        for st in tr.steps:
            assert st.action == "look around" and not st.invalid
            assert st.info["invalid"] is False  # the simulator accepted it
        assert "This room is called the" in tr.observations[-1]
        assert tr.verdict == FORCED_TEXT and tr.bad_steps == ()  # unparsable verdict
    for r in rows:
        resp = b.response_ids[r][b.response_mask[r]]
        tr = next(t for t in res.trajectories if t.spec.trajectory_id == b.trajectory_id[r])
        st = tr.steps[int(b.step_index[r])]
        np.testing.assert_array_equal(resp, st.generation.token_ids)
        np.testing.assert_allclose(b.sampler_logprobs[r][b.response_mask[r]], st.generation.logprobs)
        # the stop string ends the response at </ACTION> (no <|im_end|> generated)
        assert resp[-1] != 151645 and tok.decode(resp) == FORCED_TEXT
        # the batch's token ids decode to the text whose action was sent to the env
        assert parse_action(tok.decode(resp)).action == st.action
        prompt = tok.decode(b.prompt_ids[r][b.prompt_mask[r]])
        assert st.observation in prompt and st.observation not in tok.decode(resp)
        assert not b.judge_flag[r] and not b.invalid[r]


def test_rollout_with_kept_prefix_kv_equals_the_rollout_without(tok, forced_reply):
    """A flat rollout of 2 episodes x 3 steps on memory_key, with the policy keeping its
    prompt prefixes' KV across decode calls (`rollout.prefix_cache_mb`) and without: the same
    actions, response ids and (to float rounding) sampler logprobs, while the task's one prefix
    is prefilled once instead of at each of the 3 steps; new params empty the cache."""
    from strata_jax.rollout import prefix_metrics
    cfg, params = forced_reply
    rc = RolloutConfig(mode="flat", group_size=2, max_action_tokens=24, cohorts=1)
    out = {}
    for mb in (0.0, 64.0):
        policy = SamplerPolicy(Sampler(cfg, max_cache_len=2048), params, prefix_cache_mb=mb)
        before = policy.prefix_stats()
        with EnvPool("memory_key", {"max_steps": 3}, max_live_envs=2) as pool:
            out[mb] = collect_rollout(policy, pool, PromptBuilder(tok, 2048),
                                      [Task("memory_key", "memory_key", 3)],
                                      key=jax.random.key(1), config=rc)
        out[mb, "metrics"] = prefix_metrics(before, policy.prefix_stats())
        out[mb, "policy"] = policy
    a, b = out[0.0].batch, out[64.0].batch
    assert [[s.action for s in t.steps] for t in out[0.0].trajectories] == \
        [[s.action for s in t.steps] for t in out[64.0].trajectories]
    np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
    np.testing.assert_array_equal(a.response_ids, b.response_ids)
    np.testing.assert_allclose(a.sampler_logprobs, b.sampler_logprobs, atol=1e-5)
    # one prefix (chat header, role line, task) for every row: prefilled by step 1's call,
    # served to steps 2 and 3; it is a proper prefix of every row's prompt
    m, m0 = out[64.0, "metrics"], out[0.0, "metrics"]
    assert set(m0) == {"rollout/prompt_tokens", "rollout/prefill_tokens"}
    computed = m["rollout/prefix_computed_tokens"]
    assert m["rollout/prefix_reused_tokens"] == 2 * computed
    assert 30 < computed < b.prompt_mask.sum(axis=1)[b.valid].min()
    # the rows' prompt tokens are the batch's; each of the 3 calls (the 2 episodes' step k)
    # prefills the shared prefix once for its 2 rows, the cache once for all 3 calls
    assert m0["rollout/prompt_tokens"] == m["rollout/prompt_tokens"] == b.prompt_mask[b.valid].sum()
    assert m0["rollout/prompt_tokens"] - m0["rollout/prefill_tokens"] == 3 * computed
    assert m0["rollout/prefill_tokens"] - m["rollout/prefill_tokens"] == 2 * computed
    policy = out[64.0, "policy"]
    assert len(policy.prefix_cache) == 1
    policy.set_params(params)
    assert len(policy.prefix_cache) == 0

