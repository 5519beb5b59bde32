"""A separate judge model (rollout.judge_model, docs/method.md §5.10): the self-judgment prompts
go to another checkpoint, loaded from disk with its own sampler, and its verdicts (decoded with
its tokenizer) set the judge flags; the default (no path) keeps the policy as its own judge."""
from __future__ import annotations

import numpy as np
import pytest

from envs_bridge import EnvPool, Task
from strata_jax.algos.batch import KIND_ACTION
from strata_jax.models import Qwen2Config, export_params, load_tokenizer
from strata_jax.rollout import (PromptBuilder, RolloutConfig, ScriptedPolicy, build_judge_model,
                                collect_rollout)
from strata_jax.rollout.scripted import FORCED_CONFIG, forced_output_params
from tests.fixtures import rollout as fx

# What the judge checkpoint writes after any prompt (its weights force it): step 2 is bad. The
# closing tag's case differs from the opening one so each token pair has one successor; the
# verdict parser ignores case.
JUDGE_TEXT = "<bad_steps>2</BAD_STEPS>"
POLICY_VERDICT = "<think>step 1 was wasted</think><bad_steps>1, 99</bad_steps>"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory, tok):
    cfg = Qwen2Config(**FORCED_CONFIG)
    params = forced_output_params(cfg, tok, JUDGE_TEXT)
    return export_params(params, cfg, str(tmp_path_factory.mktemp("judge")))


def _config(path):
    from configs.base import get_base_config
    c = get_base_config()
    c.rollout.judge_model.path = path
    c.rollout.judge_model.tokenizer = "offline"
    c.rollout.sampler_dtype = "float32"
    c.rollout.max_judge_tokens = 24
    c.env.max_prompt_tokens = 2048
    return c


class _Recording:
    """Wraps a Policy and keeps the full prompt ids of every row it is asked to generate."""

    def __init__(self, inner):
        self.inner, self.prompts = inner, []

    def generate(self, prefixes, prefix_index, suffixes, sampling, keys):
        self.prompts += [list(prefixes[int(i)]) + list(s) for i, s in zip(prefix_index, suffixes)]
        return self.inner.generate(prefixes, prefix_index, suffixes, sampling, keys)

    def embed(self, token_lists):
        return self.inner.embed(token_lists)


def _rollout(tok, judge):
    cfg = RolloutConfig(mode="strata", num_strategies=2, episodes_per_strategy=2, oversample=2,
                        max_judge_tokens=24)
    policy = ScriptedPolicy(tok, fx.MemoryKeyScript())
    tasks = [Task("memory_key", "memory_key", v) for v in (3, 8)]
    with EnvPool("memory_key", {"max_steps": 10}, max_live_envs=4) as pool:
        res = collect_rollout(policy, pool, PromptBuilder(tok, 2048), tasks, key=0, config=cfg,
                              judge=judge)
    return res, policy


def test_judge_prompts_are_decoded_by_the_judge_checkpoint(tok, judge_dir):
    judge = build_judge_model(_config(judge_dir))
    judge = type(judge)(_Recording(judge.policy), judge.builder)
    res, policy = _rollout(tok, judge)
    b = res.batch
    # the policy never saw a judge prompt: its calls are strategies + steps, none greedy
    assert not any(greedy for *_, greedy in policy.calls)
    # one judge row per finished trajectory, the judge prompt of that trajectory
    assert len(judge.policy.prompts) == len(res.trajectories) == 8
    for p in judge.policy.prompts:
        text = tok.decode(p)
        assert "Here is the trajectory you played" in text and "<bad_steps>" in text
    for tr in res.trajectories:
        assert tr.verdict == JUDGE_TEXT and tr.bad_steps == (2,) and len(tr.steps) >= 2
        rows = [r for r in range(len(res.records)) if b.kind[r] == KIND_ACTION
                and (b.task_id[r], b.trajectory_id[r]) == (tr.spec.task_uid, tr.spec.trajectory_id)]
        np.testing.assert_array_equal(b.judge_flag[rows], [t == 1 for t in range(len(rows))])


def test_default_the_policy_judges_itself(tok):
    assert build_judge_model(_config("")) is None
    res, policy = _rollout(tok, None)
    greedy = [c for c in policy.calls if c[3]]
    assert len(greedy) == 1 and greedy[0][2] == len(res.trajectories)
    assert all(tr.verdict == POLICY_VERDICT and tr.bad_steps == (1,) for tr in res.trajectories)


def test_a_judge_whose_context_is_too_short_is_one_clear_error(judge_dir):
    c = _config(judge_dir)
    c.env.max_prompt_tokens = 4090   # + 24 judge tokens > the judge's 4096-token context
    with pytest.raises(ValueError, match="context of 4096 tokens"):
        build_judge_model(c)


def test_a_judge_with_another_tokenizer_gets_prompts_in_its_own_ids(tok, tmp_path):
    """A GGUF judge with its own tiny byte-level tokenizer (512-row vocab, 261 tokens, control
    ids 509-511): its prompts are encoded with that tokenizer and its verdicts decoded with it."""
    from tests.fixtures.gguf_files import write_qwen2_gguf
    from tests.fixtures.models import PARITY_CONFIGS, make_hf_model
    path = write_qwen2_gguf(make_hf_model(seed=3, max_position_embeddings=4096,
                                          **PARITY_CONFIGS["tied_gqa2"]),
                            str(tmp_path / "judge.gguf"))
    c = _config(path)
    c.rollout.judge_model.tokenizer = ""          # the GGUF file's own tokenizer
    judge = build_judge_model(c)
    jtok = judge.builder.tokenizer
    assert len(jtok) == 261 and jtok.convert_tokens_to_ids("<|im_start|>") == 510
    rec = _Recording(judge.policy)
    outs = []
    inner_generate = rec.generate

    def generate(*args):
        g = inner_generate(*args)
        outs.extend(g[b] for b in range(len(args[2])))
        return g

    rec.generate = generate
    res, policy = _rollout(tok, type(judge)(rec, judge.builder))
    assert not any(greedy for *_, greedy in policy.calls)
    assert len(rec.prompts) == len(outs) == len(res.trajectories)
    for p in rec.prompts:
        assert set(p) <= set(range(258)) | {509, 510, 511}   # judge ids, never Qwen's
        assert p.count(510) == 3                              # system, user, assistant turns
        assert "Here is the trajectory you played" in jtok.decode(p)
    from strata_jax.rollout.episodes import decode_generation
    for tr, gen in zip(res.trajectories, outs):
        assert tr.verdict == decode_generation(jtok, gen)
        assert max(gen.token_ids) < 512
