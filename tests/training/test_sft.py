"""Behaviour-cloning warm start (strata_jax/training/sft/, strata_jax/jobs/warm_start.py).

1. The SFT examples are the rollout's own prompts: a real `collect_rollout` (StraTA and flat) on
   memory_key, played by a scripted policy that answers ONLY prompts found among the SFT examples
   (a KeyError on any other prompt), replays the expert episodes, and the rollout's records hold
   the same prompt ids (prefix + suffix) and response ids as the examples.
2. The loss mask is exactly the response tokens, and `sft_loss` equals a hand computation from
   full logits.
3. SFT of the tiny Qwen2 shape (vocabulary widened to the tokenizer's, as experiment.build_model
   does) on two expert trajectories drives the loss down by > 10x, and greedy decoding through the
   real Sampler then reproduces the expert's response on a training prompt.
4. The warm-start step: "" is a no-op, "sft" trains once and then loads the cached export.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import re
import dataclasses
import math
import random
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import builtin
from envs_bridge.base import Task
from envs_bridge.builtin import MemoryKeyEnv
from envs_bridge.parsing import parse_action
from envs_bridge.pool import EnvPool
from strata_jax.models import (PRESETS, Qwen2Config, forward, init_params, load_tokenizer,
                               logits_from_hidden, stop_token_ids)
from strata_jax.models.tokenizer import IM_END_ID
from strata_jax.rollout import PromptBuilder, RolloutConfig, ScriptedPolicy, collect_rollout
from strata_jax.rollout.episodes import action_stop_text
from strata_jax.rollout.prompts import PromptIds
from strata_jax.sampling import Sampler, SamplingParams
from strata_jax.jobs import warm_start
from strata_jax.training import sft

MK_TASKS = [Task("memory_key", "memory_key", s, "train") for s in (0, 1)]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def builder(tok):
    return PromptBuilder(tok, max_prompt_tokens=512, history_length=2)


@pytest.fixture(scope="module")
def episodes():
    return sft.collect_expert_episodes("memory_key", MK_TASKS, noise=0.0,
                                       env_kwargs=dict(max_steps=8))


def test_expert_episodes_and_plan(episodes):
    # seed 0: code 660, corridor 4 (envs_bridge/builtin.py draws them from random.Random(0)).
    ep = episodes[0]
    assert ep.success and ep.episode_return == 1.0
    assert [s.action for s in ep.steps] == ["go north"] * 4 + ["enter 660"]
    assert sft.plan_text(ep.plan) == "1. go north (4 times)\n2. enter 660"
    assert "vault code 6-6-0" in ep.first_observation
    # noise: random admissible actions, flagged, and the expert still recovers (corridor walk).
    noisy = sft.play_builtin_expert(MemoryKeyEnv(max_steps=40), MK_TASKS[0], 0.3,
                                    random.Random(3))
    assert any(s.noisy for s in noisy.steps) and noisy.success
    assert len(noisy.steps) > 5 and noisy.steps[-1].action == "enter 660"
    assert noisy.plan == ep.plan


def test_masked_plan_names_the_keypad_not_the_code(builder, episodes):
    """sft.plan_code="mask": the cloned strategy says where to type, never what; the action
    targets keep the expert's real code (the keypad step is taught, the code is a guess)."""
    assert sft.mask_codes(["go north", "enter 660", "enter", "look"]) == \
        ["go north", sft.MASKED_CODE, sft.MASKED_CODE, "look"]
    ex = sft.render_episode(builder, episodes[0], with_strategy=True, plan_code="mask")
    assert ex[0].kind == "strategy" and ex[0].response_text == (
        "<strategy>1. go north (4 times)\n2. enter the vault code</strategy>")
    assert not any("660" in e.prompt.prefix_text for e in ex)
    assert [e.response_text for e in ex if e.kind == "action"][-1].endswith(
        "<action>enter 660</action>")
    keep = sft.render_episode(builder, episodes[0], with_strategy=True)
    assert "2. enter 660" in keep[0].response_text
    # actions only: the same action rows (z in their prompts), no strategy row
    acts = sft.render_episode(builder, episodes[0], with_strategy=True, plan_code="mask",
                              train_strategies=False)
    assert [e.kind for e in acts] == [e.kind for e in ex[1:]]
    assert [e.prompt.ids for e in acts] == [e.prompt.ids for e in ex[1:]]
    with pytest.raises(ValueError, match="sft.plan_code must be one of"):
        sft.SFTConfig(plan_code="hide")


def test_plan_code_keep_keeps_the_code_in_a_seeded_share_of_plans(builder, episodes):
    """sft.plan_code_keep: under "mask", the episodes `keeps_code` draws keep their code in the
    cloned plan, the others are masked; the draw depends on the seed alone."""
    import numpy as np
    cfg = sft.SFTConfig(plan_code="mask", plan_code_keep=0.5, strategy_mode="strata", seed=3)
    keep = sft.keeps_code(cfg, len(episodes))
    np.testing.assert_array_equal(keep, np.random.default_rng([3, 0x9C0DE]).random(
        len(episodes)) < 0.5)
    assert 0 < keep.sum() < len(episodes)          # both kinds among these episodes
    ex = sft.build_examples(builder, episodes, cfg)
    plans = [e.response_text for e in ex if e.kind == "strategy"]
    assert len(plans) == len(episodes)
    for ep, k, plan in zip(episodes, keep, plans):
        code = [a for a in ep.plan if a.startswith("enter ")][-1]
        assert (code in plan) == bool(k) and (sft.MASKED_CODE in plan) == (not k)
    assert sft.keeps_code(dataclasses.replace(cfg, plan_code="keep"), 4).all()
    assert not sft.keeps_code(dataclasses.replace(cfg, plan_code_keep=0.0), 4).any()
    with pytest.raises(ValueError, match="plan_code_keep must be in"):
        sft.SFTConfig(plan_code_keep=1.5)


def test_clone_guesses_false_drops_the_keypad_guess_under_a_masked_plan(builder, episodes):
    """sft.clone_guesses=False: under a masked z the keypad row (step 4 of 5: the note left the
    2-step window) is a guess and is left out; under a plan that keeps the code, and in the flat
    form, it stays."""
    ep = episodes[0]                          # code 660, 4 moves then `enter 660`
    kw = dict(with_strategy=True, plan_code="mask")
    full = sft.render_episode(builder, ep, **kw)
    cut = sft.render_episode(builder, ep, clone_guesses=False, **kw)
    acts = [e for e in full if e.kind == "action"]
    assert acts[-1].response_text.endswith("<action>enter 660</action>")
    assert acts[-1].prompt.history_used == 2 and acts[-1].step_index == 4
    assert [e.response_text for e in cut] == [e.response_text for e in full if e is not acts[-1]]
    keep = sft.render_episode(builder, ep, with_strategy=True, plan_code="keep",
                              clone_guesses=False)
    assert keep[-2].response_text.endswith("<action>enter 660</action>")   # z shows the code
    flat = sft.render_episode(builder, ep, with_strategy=False, plan_code="mask",
                              clone_guesses=False)
    assert flat[-1].response_text.endswith("<action>enter 660</action>")


def test_noisy_expert_never_types_a_code(episodes):
    """At memory_key's 1-digit vault the admissible actions list `enter 0` ... `enter 9`: noise
    picks moves / look only, so no wrong code is cloned and no attempt is spent."""
    env = MemoryKeyEnv(max_steps=100, code_digits=1, code_attempts=1)
    rng = random.Random(0)
    for t in MK_TASKS:
        ep = sft.play_builtin_expert(env, t, 0.5, rng)
        enters = [s.action for s in ep.steps if s.action.startswith("enter")]
        assert ep.success and len(enters) == 1 and not any(s.noisy for s in ep.steps
                                                            if s.action.startswith("enter"))
        assert sum(s.noisy for s in ep.steps) >= 3


def test_fingerprint_keeps_old_caches_for_the_default_plan(tok):
    cfg = Qwen2Config(vocab_size=151936, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, tie_word_embeddings=True)
    c = builtin.get_config("tiny")
    keep = warm_start.fingerprint(c, cfg, sft.SFTConfig.from_config(c))
    fields = dataclasses.asdict(sft.SFTConfig.from_config(c))
    assert fields["plan_code"] == "keep"
    c.sft.plan_code = "mask"
    masked = warm_start.fingerprint(c, cfg, sft.SFTConfig.from_config(c))
    c.sft.train_strategies = False
    actions = warm_start.fingerprint(c, cfg, sft.SFTConfig.from_config(c))
    c.sft.plan_code_keep = 0.25
    some = warm_start.fingerprint(c, cfg, sft.SFTConfig.from_config(c))
    c.sft.clone_guesses = False
    assert len({keep, masked, actions, some,
                warm_start.fingerprint(c, cfg, sft.SFTConfig.from_config(c))}) == 5
    # the run's seed: a preset's random init depends on it, a pretrained model's does not (its
    # runs of every seed start from one warm start; seed 0 keeps the existing fingerprint)
    fp = lambda: warm_start.fingerprint(c, cfg, sft.SFTConfig.from_config(c))  # noqa: E731
    assert c.model.preset
    seed0 = fp()
    c.seed = 1
    assert fp() != seed0
    c.model.preset, c.model.path = "", "/ckpt/qwen"
    c.seed = 0
    pretrained = fp()
    c.seed = 7
    assert fp() == pretrained
    # per-batch buckets (max_shapes 0, the rule before the planned widths) leave the field out
    # of the key, so exports trained that way keep their folder; the planned default is keyed
    planned = fp()
    asdict = dataclasses.asdict
    with mock.patch.object(warm_start.dataclasses, "asdict",   # a config without the field
                           lambda x: {k: v for k, v in asdict(x).items() if k != "max_shapes"}):
        before = fp()
    c.sft.max_shapes = 0
    assert fp() == before != planned


@pytest.mark.parametrize("algo", ["strata", "flat"])
def test_examples_are_the_rollouts_prompts(tok, builder, episodes, algo):
    strat = algo == "strata"
    examples = [e for ep in episodes
                for e in sft.render_episode(builder, ep, with_strategy=strat)]
    # Without z, the last steps of both seeds have the SAME prompt (the code has scrolled out
    # of the history window): answer identical prompts first-come first-served (task 0 first).
    table: dict[str, collections.deque] = collections.defaultdict(collections.deque)
    for e in examples:
        table[e.prompt.text].append(e)
    assert (len(table) < len(examples)) == (not strat)

    def respond(prompt_text, key):
        return table[prompt_text].popleft().response_text   # IndexError: never rendered by SFT

    policy = ScriptedPolicy(tok, respond)
    cfg = RolloutConfig(mode="strata" if strat else "flat", num_strategies=1,
                        episodes_per_strategy=1, oversample=1, diverse_sampling=False,
                        self_judgment=True, group_size=1, max_action_tokens=64,
                        max_strategy_tokens=64, max_judge_tokens=64, cohorts=1)
    with EnvPool("memory_key", {"max_steps": 8}, max_live_envs=2) as pool:
        res = collect_rollout(policy, pool, builder, MK_TASKS, key=0, config=cfg)
    assert all(tr.success for tr in res.trajectories)
    assert not any(table.values())   # every SFT example was asked for exactly once
    # The rollout's rows (judge calls are not trained rows) = the SFT examples, token for token.
    rows = collections.Counter((tuple(int(i) for i in r["prompt_ids"]),
                                tuple(int(i) for i in r["response_ids"])) for r in res.records)
    want = collections.Counter((tuple(e.prompt.ids), e.response_ids) for e in examples
                               if e.kind != "judge")
    assert rows == want
    # Each target ends where the sampler stops: on the token that closes the stage's block.
    for e in examples:
        assert IM_END_ID not in e.response_ids and tok.decode(e.response_ids) == e.response_text
        assert e.response_text.endswith(("</action>", "</strategy>", "</bad_steps>"))
    # The judge prompts the rollout built were answered from the table too (exact text match).
    if strat:
        assert [tr.verdict for tr in res.trajectories] == ["<bad_steps>none</bad_steps>"] * 2
        z = res.trajectories[0].spec.strategy
        assert z == "1. go north (4 times)\n2. enter 660"
        first = [e for e in examples if e.kind == "action" and e.step_index == 0][0]
        assert first.prompt.prefix_text.endswith("Your strategy for this task:\n" + z + "\n")


def test_full_history_flat_rows_are_a_cumulative_flat_rollouts_rows(tok, builder, episodes):
    """sft.flat_prompts="full": the flat-form rows are the prompts of a flat rollout with
    rollout.cumulative_prompts (the note stays in view, so the keypad row copies the code),
    while the StraTA-form rows keep the window; a scripted replay of the rows reproduces the
    rollout's records token for token."""
    full = PromptBuilder(tok, max_prompt_tokens=512, history_length=None)
    cfg = sft.SFTConfig(strategy_mode="both", flat_prompts="full")
    both = sft.build_examples(builder, episodes, cfg, flat_builder=full)
    windowed = sft.build_examples(builder, episodes, sft.SFTConfig(strategy_mode="both"))
    strat = [e for e in both if e.kind != "action" or "Your strategy" in e.prompt.text]
    assert [e.prompt.ids for e in strat] == [e.prompt.ids for e in windowed
                                              if e.kind != "action"
                                              or "Your strategy" in e.prompt.text]
    flat = [e for e in both if e.kind == "action" and "Your strategy" not in e.prompt.text]
    assert len(flat) == 10 and len(set(e.prompt.text for e in flat)) == 10   # no two alike
    keypad = [e for e in flat if e.response_text.count("enter")]
    assert len(keypad) == 2
    for e, code in zip(keypad, ("660", None)):
        digits = e.response_text.split("enter ")[1].split("<")[0]
        assert "vault code " + "-".join(digits) in e.prompt.text   # the note is in view
        if code:
            assert digits == code
    table: dict[str, collections.deque] = collections.defaultdict(collections.deque)
    for e in flat:
        table[e.prompt.text].append(e)
    policy = ScriptedPolicy(tok, lambda text, key: table[text].popleft().response_text)
    rcfg = RolloutConfig(mode="flat", num_strategies=1, episodes_per_strategy=1, oversample=1,
                         diverse_sampling=False, self_judgment=False, group_size=1,
                         max_action_tokens=64, max_strategy_tokens=64, max_judge_tokens=64,
                         cohorts=1)
    with EnvPool("memory_key", {"max_steps": 8}, max_live_envs=2) as pool:
        res = collect_rollout(policy, pool, full, MK_TASKS, key=0, config=rcfg)
    assert all(tr.success for tr in res.trajectories) and not any(table.values())
    assert sorted((tuple(int(i) for i in r["prompt_ids"]), tuple(int(i) for i in r["response_ids"]))
                  for r in res.records) == sorted((tuple(e.prompt.ids), e.response_ids)
                                                  for e in flat)


def test_a_windowed_strata_arm_and_a_cumulative_flat_arm_share_one_warm_start(tok):
    """Both arms name the renderings (StraTA rows windowed, flat rows full): one fingerprint,
    the one a run with no cumulative prompts and flat_prompts="full" has; the default
    rendering keeps its old fingerprint (cumulative_prompts as one bool)."""
    cfg = Qwen2Config(vocab_size=151936, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, tie_word_embeddings=True)

    def fp(**kw):
        c = builtin.get_config("tiny")
        for k, v in kw.items():
            section, field = k.split("__")
            c[section][field] = v
        return warm_start.fingerprint(c, cfg, sft.SFTConfig.from_config(c))
    strata_arm = fp(sft__flat_prompts="full")
    flat_arm = fp(sft__flat_prompts="full", sft__strata_prompts="window",
                  rollout__cumulative_prompts=True)
    assert strata_arm == flat_arm
    assert fp() == fp(sft__flat_prompts="window", sft__strata_prompts="window")
    assert len({strata_arm, fp(), fp(rollout__cumulative_prompts=True),
                fp(sft__flat_prompts="full", rollout__cumulative_prompts=True)}) == 3
    assert fp(rollout__cumulative_prompts=True) == fp(sft__flat_prompts="full",
                                                      rollout__cumulative_prompts=True)
    with pytest.raises(ValueError, match="sft.flat_prompts must be one of"):
        sft.SFTConfig(flat_prompts="all")


def test_batch_mask_covers_only_response_tokens(builder, episodes):
    examples = sft.build_examples(builder, episodes, sft.SFTConfig(strategy_mode="both"))
    kinds = {k: sum(e.kind == k for e in examples) for k in sft.KINDS}
    assert kinds == {"action": 20, "strategy": 2, "judge": 2}
    batch = sft.make_sft_batch(examples[:6], rows=8)
    tp, tr = batch["prompt_ids"].shape[1], batch["response_ids"].shape[1]
    longest = max(e.prompt.num_tokens for e in examples[:6])
    assert tp >= longest and tp // 2 < max(longest, 64) and tp & (tp - 1) == 0   # power of two
    assert tr % 8 == 0 and tr >= max(len(e.response_ids) for e in examples[:6])
    for b, e in enumerate(examples[:6]):
        n = len(e.response_ids)
        assert batch["response_mask"][b].sum() == n and batch["response_mask"][b, :n].all()
        assert list(batch["response_ids"][b, :n]) == list(e.response_ids)
        assert list(batch["prompt_ids"][b, tp - e.prompt.num_tokens:]) == e.prompt.ids
        assert batch["prompt_mask"][b].sum() == e.prompt.num_tokens
    assert not batch["response_mask"][6:].any()
    assert int(batch["response_mask"].sum()) == sum(len(e.response_ids) for e in examples[:6])
    # a planned shape: the same rows, padded further (prompts on the left, responses on the
    # right); one too small for an example is refused, not cut
    wide = sft.make_sft_batch(examples[:6], rows=8, shape=(tp + 64, tr + 8))
    np.testing.assert_array_equal(wide["prompt_ids"][:, 64:], batch["prompt_ids"])
    np.testing.assert_array_equal(wide["prompt_mask"][:, 64:], batch["prompt_mask"])
    assert not wide["prompt_mask"][:, :64].any()
    np.testing.assert_array_equal(wide["response_mask"][:, :tr], batch["response_mask"])
    assert not wide["response_mask"][:, tr:].any()
    with pytest.raises(ValueError, match="cannot hold a"):
        sft.make_sft_batch(examples[:6], rows=8, shape=(longest - 1, tr))


def test_loss_matches_full_logits():
    cfg = Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
    params = init_params(cfg, jax.random.PRNGKey(1))
    rng = np.random.default_rng(0)
    exs = []
    for n_p, n_r in ((7, 3), (12, 5)):
        p = tuple(int(x) for x in rng.integers(0, 300, n_p))
        r = tuple(int(x) for x in rng.integers(0, 300, n_r))
        exs.append(sft.SFTExample(PromptIds((), p, "", ""), r, "", "action", False))
    batch = sft.make_sft_batch(exs, rows=3, pad_id=0)
    loss, n = jax.jit(lambda p, b: sft.sft_loss(p, cfg, b))(params, batch)
    assert float(n) == 8.0
    total = 0.0
    for e in exs:   # unpadded sequence, full logits, shift by one
        ids = jnp.asarray([list(e.prompt.ids) + list(e.response_ids)], jnp.int32)
        t = ids.shape[1]
        h, _ = forward(params, cfg, ids, jnp.arange(t)[None], jnp.ones((1, t), bool))
        lp = jax.nn.log_softmax(logits_from_hidden(params, cfg, h)[0], axis=-1)
        n_p = len(e.prompt.ids)
        total += sum(float(lp[n_p - 1 + j, tok]) for j, tok in enumerate(e.response_ids))
    np.testing.assert_allclose(float(loss), -total / 8.0, rtol=1e-5)
    # The run's remat policy: the same loss and the same AdamW steps, activations recomputed.
    scfg = sft.SFTConfig(steps=2, batch_size=2, lr=1e-2, warmup_steps=0)
    ref, ref_losses = sft.train_sft(params, cfg, exs, scfg, pad_id=0)
    for remat in ("full", "dots"):
        assert float(jax.jit(lambda p, b: sft.sft_loss(p, cfg, b, remat=remat))(params, batch)[0]) \
            == pytest.approx(float(loss), rel=1e-6)
        got, losses = sft.train_sft(params, cfg, exs, scfg, pad_id=0, remat=remat)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        # AdamW normalises each gradient, so round-off in a near-zero gradient moves a param by
        # a fraction of the step: judge params to 0.1% of the 2 steps of lr 1e-2 they took.
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-5)


def test_sft_learns_and_sampler_reproduces_expert(tok, builder, episodes):
    # Flat form of the two expert episodes: 10 step examples, one batch.
    examples = [e for ep in episodes for e in sft.render_episode(builder, ep, with_strategy=False)]
    assert len(examples) == 10
    cfg = dataclasses.replace(PRESETS["tiny"], vocab_size=151936)   # experiment.build_model
    params = init_params(cfg, jax.random.PRNGKey(0))
    scfg = sft.SFTConfig(steps=60, batch_size=16, lr=5e-3, warmup_steps=5)
    trained, losses = sft.train_sft(params, cfg, examples, scfg)
    assert losses[0] == pytest.approx(math.log(151936), abs=0.2)  # uniform start: ln V = 11.93
    assert min(losses[-3:]) < losses[0] / 10, losses
    sampler = Sampler(cfg, max_cache_len=512 + 64)
    target = examples[0]
    gen = sampler.generate(trained, [target.prompt.ids],
                           SamplingParams(temperature=0.0, max_new_tokens=32,
                                          stop_token_ids=stop_token_ids(tok),
                                          stop_text=action_stop_text(tok)),
                           np.zeros((1, 2), np.uint32))[0]
    text = tok.decode([int(i) for i in gen.token_ids])
    assert list(gen.token_ids) == list(target.response_ids), text
    assert parse_action(text.replace("<|im_end|>", "")).action == episodes[0].steps[0].action


def test_sft_from_mesh_sharded_params_compiles_its_step_once(builder, episodes):
    # A warm start from params placed on the mesh (a checkpoint, or a preset once built): every
    # step returns params and optimiser state placed as they went in, so steps 2 and 3 reuse
    # step 1's program (XLA's own choice of output placement compiled a second program).
    from strata_jax.metrics import CompileCounter
    from strata_jax.models import shard_params
    from strata_jax.sharding import make_mesh
    examples = [e for ep in episodes for e in sft.render_episode(builder, ep, with_strategy=False)]
    cfg = Qwen2Config(vocab_size=151936, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, tie_word_embeddings=True)
    mesh = make_mesh({"fsdp": -1})
    params = shard_params(init_params(cfg, jax.random.PRNGKey(0)), cfg, mesh)
    assert len(params["embed"].sharding.device_set) == 8
    counter = CompileCounter.install()
    seen = []
    scfg = sft.SFTConfig(steps=3, batch_size=10, lr=1e-2, warmup_steps=1, log_every=1)
    trained, losses = sft.train_sft(params, cfg, examples, scfg,
                                    log_fn=lambda _: seen.append(counter.count))
    assert len(seen) == 4                     # the "compiling" line, then one line per step
    assert seen[1] > seen[0] and seen[3] == seen[2] == seen[1], seen
    assert losses[0] == pytest.approx(math.log(151936), abs=0.2) and losses[2] < losses[0]
    for name in ("embed", "final_norm"):   # the params keep their placement on the mesh
        assert trained[name].sharding == params[name].sharding, name


def test_maybe_warm_start_caches(tmp_path, tok, monkeypatch, caplog):
    c = builtin.get_config("tiny")
    c.sft.cache_dir = ""   # "" = per run, in <workdir>/warm_start (the default is runs/warm_start)
    c.sft.episodes, c.sft.steps, c.sft.batch_size = 1, 2, 4
    c.sft.strategy_mode, c.sft.judge = "flat", False
    cfg = Qwen2Config(vocab_size=151936, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, tie_word_embeddings=True)
    params = init_params(cfg, jax.random.PRNGKey(0))
    c.model.warm_start = ""
    assert warm_start.maybe_warm_start(c, cfg, params, tok, str(tmp_path)) is params
    c.model.warm_start = "sft"
    calls = []
    real = warm_start.run_sft
    monkeypatch.setattr(warm_start, "run_sft", lambda *a, **k: calls.append(1) or real(*a, **k))
    p1 = warm_start.maybe_warm_start(c, cfg, params, tok, str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="strata_jax.warm_start"):
        p2 = warm_start.maybe_warm_start(c, cfg, params, tok, str(tmp_path))
    assert calls == [1]   # second call loaded the cache
    # trained by this checkout's code: loaded without a word; by other code: one warning
    d = warm_start.warm_start_dir(c, cfg, str(tmp_path))
    meta_path = os.path.join(d, warm_start.META_FILE)
    meta = json.loads(open(meta_path).read())
    assert meta["code"] == warm_start.source_fingerprint() and len(meta["code"]) == 12
    assert not caplog.records and warm_start.stale_export_warning(d) is None
    meta["code"] = "0123456789ab"
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    with caplog.at_level(logging.WARNING, logger="strata_jax.warm_start"):
        warm_start.maybe_warm_start(c, cfg, params, tok, str(tmp_path))
    assert [r.getMessage() for r in caplog.records] == [
        f"the cached warm start {d} was trained by code 0123456789ab, this checkout is "
        f"{warm_start.source_fingerprint()}: this run starts from it, so its numbers are not "
        "those of a clean clone of this code; delete the folder (or pass "
        "--config.sft.cache_dir=<new dir>) to retrain it"]
    assert calls == [1]
    # a record that is not this config's is refused, saying what to do; nothing retrains
    good = json.dumps(meta)
    for text, said in (("{not json", "cannot be read"), ("[1, 2]", "not a warm-start record"),
                       (json.dumps({**meta, "sft": {**meta["sft"], "steps": 7}}),
                        "steps=7 (this config: 2)"),
                       (json.dumps({**meta, "sft": {**meta["sft"], "gone": 1}}),
                        "gone (no such setting)")):
        with open(meta_path, "w") as f:
            f.write(text)
        with pytest.raises(ValueError, match=re.escape(said)) as err:
            warm_start.maybe_warm_start(c, cfg, params, tok, str(tmp_path))
        assert f"delete {d} to train the warm start again" in str(err.value)
    assert calls == [1]
    # where the cache lives is not part of what it holds: a moved cache still loads
    with open(meta_path, "w") as f:
        f.write(json.dumps({**meta, "sft": {**meta["sft"], "cache_dir": "elsewhere"}}))
    warm_start.maybe_warm_start(c, cfg, params, tok, str(tmp_path))
    with open(meta_path, "w") as f:
        f.write(good)
    # A change to the env's data (memory_key code length) is another cache entry.
    d = warm_start.warm_start_dir(c, cfg, str(tmp_path))
    c.env.code_digits = 2
    assert warm_start.warm_start_dir(c, cfg, str(tmp_path)) != d
    c.env.code_digits = 1
    np.testing.assert_array_equal(np.asarray(p1["embed"]), np.asarray(p2["embed"]))
    assert not np.array_equal(np.asarray(p1["embed"]), np.asarray(params["embed"]))
    c.model.warm_start = warm_start.warm_start_dir(c, cfg, str(tmp_path))   # an explicit export dir
    np.testing.assert_array_equal(
        np.asarray(warm_start.maybe_warm_start(c, cfg, params, tok, "unused")["embed"]),
        np.asarray(p1["embed"]))
    with pytest.raises(ValueError, match="holds a"):
        warm_start.maybe_warm_start(c, dataclasses.replace(cfg, num_layers=2), params, tok,
                                    "unused")


@pytest.mark.parametrize("n,batch_size", [(10, 4), (7, 3), (5, 5), (3, 8), (13, 12)])
def test_batches_hold_distinct_examples_and_each_epoch_sees_every_example_once(n, batch_size):
    """A batch crossing an epoch boundary (n not a multiple of the batch) tops up the old
    epoch's leftover with new-epoch examples it does not already hold (those come in the next
    batch): every batch holds min(batch_size, n) distinct examples, and the concatenated
    batches are whole permutations of range(n), one per epoch, in order."""
    from strata_jax.training.sft import batch_order
    steps = 200
    order = batch_order(n, batch_size, steps, seed=3)
    k = min(batch_size, n)
    assert len(order) == steps
    assert all(len(b) == k and len(set(b)) == k for b in order)
    flat = [i for b in order for i in b]
    whole = len(flat) // n
    for e in range(whole):
        assert sorted(flat[e * n:(e + 1) * n]) == list(range(n)), e
    assert len(set(flat[whole * n:])) == len(flat) - whole * n
    assert batch_order(n, batch_size, steps, seed=3) == order
    assert batch_order(n, batch_size, steps, seed=4) != order


def test_the_warm_start_eta_rate_ignores_steps_that_compiled_a_new_shape():
    """A step whose batch shape is new compiled its program: its seconds are left out of the
    rate, and there is no rate until SFT_ETA_SETTLE steps of known shapes ran."""
    from strata_jax.training.sft.cloning import SFT_ETA_SETTLE, StepClock
    clock = StepClock()
    a, b = ((8, 64), (8, 16)), ((8, 128), (8, 16))
    clock.observe(a, 30.0)                  # compiles a
    for _ in range(SFT_ETA_SETTLE - 1):
        clock.observe(a, 1.0)
    clock.observe(b, 25.0)                  # compiles b: left out
    assert clock.step_s() is None           # SFT_ETA_SETTLE - 1 known-shape steps so far
    clock.observe(b, 2.0)
    assert clock.step_s() == (SFT_ETA_SETTLE - 1 + 2.0) / SFT_ETA_SETTLE


def test_planned_batch_shapes_bound_the_compiles_and_change_no_loss(builder, episodes):
    """``sft.max_shapes`` plans at most that many (prompt, response) batch shapes over the run,
    splitting them between the axes by the model's work per column; 1 shape for every step
    compiles one step program, where per-batch buckets (``max_shapes`` = 0) compile one per
    distinct bucket pair met; the padding is masked, so both give the same losses up to float
    summation order."""
    from strata_jax.metrics import CompileCounter
    examples = sft.build_examples(builder, episodes, sft.SFTConfig(strategy_mode="both"))
    order = sft.batch_order(len(examples), 3, 10, 0)
    widths = lambda shapes, axis: {s[axis] for s in shapes}  # noqa: E731
    # the steps' longest prompts round to 4 widths (192 to 384), their responses to 2 (16, 24):
    # with prompts costly, 4 shapes go 4 x 1, every batch at its own prompt width
    need_p = [-(-max(examples[j].prompt.num_tokens for j in idx) // 64) * 64 for idx in order]
    assert sorted(set(need_p)) == [192, 256, 320, 384]
    assert sft.batch_shapes(examples, order, 4, (1e6, 1.0)) == [(p, 24) for p in need_p]
    for costs in ((1.0, 1e6), (1e6, 1.0)):   # 2 shapes: the costly axis gets both
        planned = sft.batch_shapes(examples, order, 2, costs)
        for idx, (tp, tr) in zip(order, planned):   # every batch fits its planned shape
            assert tp % 64 == 0 and tr % 8 == 0
            assert max(examples[j].prompt.num_tokens for j in idx) <= tp
            assert max(len(examples[j].response_ids) for j in idx) <= tr
        # the costly axis gets both widths, the other one width (its widest)
        cheap, costly = (0, 1) if costs[1] > costs[0] else (1, 0)
        assert widths(planned, cheap) == {(384, 24)[cheap]}
        assert widths(planned, costly) == ({256, 384}, {16, 24})[costly]
    # a real shape's split: the 0.5B's body outweighs its head per column; the tiny's does not
    body, head = sft.column_costs(PRESETS["tiny"])
    assert body == 2 * (64 * (2 * 64 + 2 * 32) + 3 * 64 * 128) and head == body + 1024 * 64
    assert sft.batch_shapes(examples, order, 0) == [None] * 10
    per_batch = [tuple(a.shape[1] for a in (b["prompt_ids"], b["response_ids"])) for b in
                 (sft.make_sft_batch([examples[j] for j in idx], 3) for idx in order)]
    one = sft.batch_shapes(examples, order, 1)
    assert len(set(one)) == 1 and len(set(per_batch)) == 4
    # the planned width pads less than a power of two: 384 prompt columns where buckets take 512
    assert one[0][0] < max(s[0] for s in per_batch)

    cfg = Qwen2Config(vocab_size=151936, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, tie_word_embeddings=True)
    params = init_params(cfg, jax.random.PRNGKey(0))
    counter = CompileCounter.install()
    losses = {}
    for n, shapes in ((0, per_batch), (1, one)):
        scfg = sft.SFTConfig(steps=10, batch_size=3, lr=1e-3, warmup_steps=1, log_every=1,
                             max_shapes=n)
        seen = []
        _, losses[n] = sft.train_sft(params, cfg, examples, scfg,
                                     log_fn=lambda _: seen.append(counter.count))
        compiled = [i for i in range(10) if seen[i + 1] > seen[i]]
        # a step compiles exactly when its shape is new to the run
        assert compiled == [i for i, s in enumerate(shapes) if s not in shapes[:i]], n
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
