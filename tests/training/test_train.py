"""Trainer update: logprob direction, skipped non-finite steps, exact gradient accumulation,
sharded step == single-device step, mini-batch plan, scoring pass."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from strata_jax.algos import KIND_ACTION, KIND_STRATEGY
from strata_jax.models import forward, init_params, logits_from_hidden
from strata_jax.training import (Trainer, accumulate_grads, minibatch_plan, pad_rows,
                                 tree_to_numpy)
from tests.fixtures.trainer import TINY, grpo_records, make_batch, train_config


@pytest.fixture(scope="module")
def setup():
    params = init_params(TINY, jax.random.PRNGKey(0))
    trainer = Trainer(TINY, train_config())
    state = trainer.init_state(params, jax.random.PRNGKey(1))
    return params, trainer, state


def _reference_logprobs(params, batch):
    """Per-token response logprobs by a direct, unchunked computation: each row's unpadded
    prompt ++ response (right-padded to one length, positions 0..n-1), full logits, log_softmax."""
    n_rows, tr = batch.response_ids.shape
    seqs = []
    for r in range(n_rows):
        p = batch.prompt_ids[r][batch.prompt_mask[r]]
        seqs.append(np.concatenate([p, batch.response_ids[r][batch.response_mask[r]]]))
    length = max(len(x) for x in seqs)
    toks = np.zeros((n_rows, length), np.int32)
    mask = np.zeros((n_rows, length), bool)
    for r, x in enumerate(seqs):
        toks[r, :len(x)], mask[r, :len(x)] = x, True
    pos = np.broadcast_to(np.arange(length), toks.shape)

    @jax.jit
    def logp(params):
        h, _ = forward(params, TINY, jnp.asarray(toks), jnp.asarray(pos), jnp.asarray(mask))
        logits = logits_from_hidden(params, TINY, h)
        return jax.nn.log_softmax(logits, axis=-1)

    lsm = np.asarray(logp(params))
    out = np.zeros((n_rows, tr), np.float32)
    for r in range(n_rows):
        n_p = int(batch.prompt_mask[r].sum())
        for j in range(int(batch.response_mask[r].sum())):
            out[r, j] = lsm[r, n_p - 1 + j, batch.response_ids[r, j]]
    return out


def test_score_pass_matches_direct_logprobs(setup):
    params, trainer, state = setup
    batch = make_batch(grpo_records(n_tasks=1, per_task=3))
    # rows 4-7 are one whole chunk of padding (micro_batch_rows 4): the skipped branch
    assert batch.num_rows == 8 and not np.any(batch.valid[4:])
    scored = trainer.score(state, batch, params, jax.random.PRNGKey(0))
    want = _reference_logprobs(params, batch)
    np.testing.assert_allclose(np.asarray(scored.old_logprobs), want, atol=2e-5)
    # Reference = initial params = current params here.
    np.testing.assert_allclose(np.asarray(scored.ref_logprobs), want, atol=2e-5)
    assert np.all(np.asarray(scored.old_logprobs)[~batch.response_mask] == 0)


def test_update_moves_logprobs_with_advantage_sign(setup):
    params, trainer, state = setup
    # Task 0: returns 1, 0, 1, 0 -> rows 0, 2 positive advantage, rows 1, 3 negative.
    batch = make_batch(grpo_records(n_tasks=1, per_task=4, scores=[1, 0, 1, 0], seed=3,
                                    resp_len=(3, 5)))
    before = np.asarray(trainer.score(state, batch, params, jax.random.PRNGKey(0)).old_logprobs)
    new, metrics = trainer.update(state, batch, ref_params=params)
    after = np.asarray(trainer.score(new, batch, params, jax.random.PRNGKey(0)).old_logprobs)
    assert metrics["skipped_steps"] == 0 and metrics["optimizer_steps"] == 1
    assert int(new.step) == 1
    delta = after - before
    m = batch.response_mask
    for r in (0, 2):   # every generated token of a positive-advantage row went up
        assert np.all(delta[r][m[r]] > 1e-4), delta[r][m[r]]
    for r in (1, 3):   # ... and of a negative-advantage row went down
        assert np.all(delta[r][m[r]] < -1e-4), delta[r][m[r]]


def test_nan_advantage_skips_step(setup):
    params, trainer, state = setup
    batch = make_batch(grpo_records(n_tasks=1, per_task=4))
    scored = trainer.score(state, batch, params, jax.random.PRNGKey(0))
    adv = jnp.asarray([1.0, -1.0, np.nan, 0.5, 0, 0, 0, 0], jnp.float32)
    w = scored.valid.astype(jnp.float32)
    before = tree_to_numpy(state)
    new, steps = trainer.train_on_batch(state, scored, adv, w, jnp.zeros_like(adv),
                                        jax.random.PRNGKey(2))
    assert len(steps) == 1 and float(steps[0]["skipped"]) == 1.0
    assert not np.isfinite(float(steps[0]["grad_norm"]))
    after = tree_to_numpy(new)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a, b)   # params and optimizer state bit-identical
    # The same advantages without the NaN are applied.
    adv_ok = jnp.nan_to_num(adv)
    new2, steps2 = trainer.train_on_batch(state, scored, adv_ok, w, jnp.zeros_like(adv),
                                          jax.random.PRNGKey(2))
    assert float(steps2[0]["skipped"]) == 0.0
    assert not np.array_equal(np.asarray(new2.params["embed"]), before.params["embed"])


def test_nan_score_through_update_is_skipped(setup):
    params, trainer, state = setup
    recs = grpo_records(n_tasks=1, per_task=4)
    recs[1]["score"] = float("nan")     # the estimator's group statistics turn NaN
    new, metrics = trainer.update(state, make_batch(recs), ref_params=params)
    assert metrics["skipped_steps"] == 1
    np.testing.assert_array_equal(np.asarray(new.params["layers"][0]["q_proj"]),
                                  np.asarray(state.params["layers"][0]["q_proj"]))
    assert int(new.step) == 1   # the iteration still counts


def test_grad_accumulation_4_micro_equals_full_batch(setup):
    params, trainer, state = setup
    # 16 rows incl. 2 strategy rows (both levels normalised over the whole mini-batch).
    recs = grpo_records(n_tasks=2, per_task=7, scores=[1, 0, 0, 1, 1, 0, 1] * 2, seed=5,
                        strategies=2)
    batch = make_batch(recs)
    assert batch.num_rows == 16
    scored = trainer.score(state, batch, params, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    adv = jnp.asarray(rng.normal(size=16).astype(np.float32))
    w = scored.valid.astype(jnp.float32)
    # Perturb the policy so ratios, clipping and the KL term are all active.
    p = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.PRNGKey(7), x.shape),
                     params)
    cfg4 = trainer.cfg                       # micro 4 -> 4 micro-batches
    cfg16 = dataclasses.replace(cfg4, micro_batch_rows=16)
    l4, g4, _, m4 = accumulate_grads(p, {}, scored, adv, w, adv, model=TINY, cfg=cfg4)
    l16, g16, _, m16 = accumulate_grads(p, {}, scored, adv, w, adv, model=TINY, cfg=cfg16)
    assert float(m4["clip_frac"]) > 0 and float(m4["kl"]) > 0
    assert abs(float(m16["loss/strategy"])) > 0
    np.testing.assert_allclose(float(l4), float(l16), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(g4), jax.tree.leaves(g16)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    for k in ("clip_frac", "kl", "loss/action", "loss/strategy", "entropy"):
        np.testing.assert_allclose(float(m4[k]), float(m16[k]), rtol=1e-5, atol=1e-6)


def test_minibatch_plan_spreads_strategies():
    valid = np.ones(20, bool)
    valid[18:] = False
    kind = np.full(20, KIND_ACTION)
    kind[[1, 5, 9, 13]] = KIND_STRATEGY    # 4 strategy rows, 14 valid step rows
    plan = minibatch_plan(valid, kind, mini_batch_size=5, row_multiple=4,
                          rng=np.random.default_rng(0))
    assert len(plan) == 3                  # ceil(14 / 5)
    seen = np.concatenate([idx[real] for idx, real in plan])
    assert sorted(seen.tolist()) == list(range(18))   # every valid row exactly once
    n_strat = [int(np.sum(kind[idx[real]] == KIND_STRATEGY)) for idx, real in plan]
    n_act = [int(np.sum(kind[idx[real]] == KIND_ACTION)) for idx, real in plan]
    assert sorted(n_strat) == [1, 1, 2] and sorted(n_act) == [4, 5, 5]
    assert {idx.size for idx, _ in plan} == {8}   # 5 + ceil(4/3) = 7 -> multiple of 4


def test_scatter_scores_padding_entries_never_overwrite_a_real_row():
    """A chunk's padding entries point at row 0; when row 0 is a real row of the same chunk,
    its new scores must land (a scatter of duplicate indices keeps an unspecified write)."""
    from strata_jax.training.steps import scatter_scores
    scores = (jnp.zeros((4, 3)), jnp.zeros((4, 3)), jnp.zeros(4), jnp.zeros(4))
    new = (jnp.ones((3, 2)), jnp.full((3, 2), 2.0), jnp.full(3, 3.0), jnp.full(3, 4.0))
    old, ref, v, s = scatter_scores(scores, jnp.asarray([0, 2, 0]),
                                    jnp.asarray([True, True, False]), new)
    np.testing.assert_array_equal(old, [[1, 1, 0], [0, 0, 0], [1, 1, 0], [0, 0, 0]])
    np.testing.assert_array_equal(ref, 2 * np.asarray(old))
    np.testing.assert_array_equal(v, [3, 0, 3, 0])
    np.testing.assert_array_equal(s, [4, 0, 4, 0])


def test_pad_rows_marks_padding_invalid():
    batch = make_batch(grpo_records(n_tasks=1, per_task=3))
    padded = pad_rows(batch, 12)
    assert padded.num_rows == 12
    assert not padded.valid[8:].any() and (padded.task_id[8:] == -1).all()


def test_sharded_update_equals_single_device(setup):
    from strata_jax.sharding import make_mesh
    params, trainer, state = setup
    batch = make_batch(grpo_records(seed=11))
    single, m1 = trainer.update(state, batch, ref_params=params)
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    sharded_trainer = Trainer(TINY, trainer.cfg, mesh=mesh)
    s_state = sharded_trainer.init_state(params, jax.random.PRNGKey(1))
    q = s_state.params["layers"][0]["q_proj"]
    assert len(q.sharding.device_set) == 8 and q.sharding.spec == PartitionSpec("tensor", "fsdp")
    mu = s_state.opt_state[1][0].mu["layers"][0]["q_proj"]
    assert mu.sharding.spec == q.sharding.spec     # Adam moments sharded like their params
    sharded, m8 = sharded_trainer.update(s_state, batch, ref_params=params)
    assert sharded.params["layers"][0]["q_proj"].sharding.spec == q.sharding.spec
    for a, b in zip(jax.tree.leaves(tree_to_numpy(sharded.params)),
                    jax.tree.leaves(tree_to_numpy(single.params))):
        np.testing.assert_allclose(a, b, atol=2e-5)
    np.testing.assert_allclose(m8["train/loss"], m1["train/loss"], rtol=1e-4, atol=1e-6)


def test_remat_and_bf16_options(setup):
    params, trainer, state = setup
    # Same shapes and config as the accumulation test's full-batch reference (one compile).
    batch = make_batch(grpo_records(n_tasks=2, per_task=7, scores=[1, 0, 0, 1, 1, 0, 1] * 2,
                                    seed=9, strategies=2))
    scored = trainer.score(state, batch, params, jax.random.PRNGKey(0))
    adv = jnp.asarray(np.random.default_rng(1).normal(size=16).astype(np.float32))
    w = scored.valid.astype(jnp.float32)
    p = jax.tree.map(lambda x: x + 0.2 * jax.random.normal(jax.random.PRNGKey(4), x.shape),
                     params)
    cfg = dataclasses.replace(trainer.cfg, micro_batch_rows=16)
    l0, g0, _, _ = accumulate_grads(p, {}, scored, adv, w, adv, model=TINY, cfg=cfg)
    # Rematerialisation changes memory, not math.
    l1, g1, _, _ = accumulate_grads(p, {}, scored, adv, w, adv, model=TINY,
                                    cfg=dataclasses.replace(cfg, remat="full"))
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)
    # train.scan_layers: the remat'd layers as a scan over stacked weights, same math
    l3, g3, _, _ = accumulate_grads(p, {}, scored, adv, w, adv, model=TINY,
                                    cfg=dataclasses.replace(cfg, remat="full", scan_layers=True))
    np.testing.assert_allclose(float(l3), float(l0), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g3), jax.tree.leaves(g0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)
    # bf16 compute: fp32 gradients of the fp32 master params, close to the fp32 ones.
    l2, g2, _, _ = accumulate_grads(p, {}, scored, adv, w, adv, model=TINY,
                                    cfg=dataclasses.replace(cfg, compute_dtype="bfloat16"))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(g2))
    np.testing.assert_allclose(float(l2), float(l0), atol=2e-2)
    e0, e2 = np.asarray(g0["embed"]).ravel(), np.asarray(g2["embed"]).ravel()
    assert np.dot(e0, e2) / (np.linalg.norm(e0) * np.linalg.norm(e2)) > 0.95


def _count_score_calls(monkeypatch):
    """use_old of each `Trainer.score` call that ran a scoring forward (`score_batch`, or the
    packed `score_rows`, called once per chunk: recorded once per score call)."""
    from strata_jax.training import trainer as upd   # where Trainer.score looks them up
    calls, fresh = [], [False]
    orig_score = upd.Trainer.score

    def score(self, *a, **k):
        fresh[0] = True
        return orig_score(self, *a, **k)

    def spy(orig):
        def run(*a, **k):
            if fresh[0]:
                calls.append(k.get("use_old", True))
                fresh[0] = False
            return orig(*a, **k)
        return run
    monkeypatch.setattr(upd.Trainer, "score", score)
    monkeypatch.setattr(upd, "score_batch", spy(upd.score_batch))
    monkeypatch.setattr(upd, "score_rows", spy(upd.score_rows))
    return calls


def test_on_policy_update_skips_old_pass_with_same_result(setup, monkeypatch):
    """One epoch of one mini-batch: pi_old is the step's own logprob (ratio 1), so the update
    without the old-logprob pass equals the one that recomputes it (train.recompute_old)."""
    params, trainer, state = setup
    batch = make_batch(grpo_records(n_tasks=1, per_task=4, scores=[1, 0, 1, 0], seed=3,
                                    resp_len=(3, 5)))
    calls = _count_score_calls(monkeypatch)
    slow_trainer = Trainer(TINY, dataclasses.replace(trainer.cfg, recompute_old=True))
    assert trainer.on_policy(batch) and not slow_trainer.on_policy(batch)
    fast, m_fast = trainer.update(state, batch, ref_params=params)
    slow, m_slow = slow_trainer.update(state, batch, ref_params=params)
    assert calls == [False, True]   # KL is on: the reference pass still runs, pi_old does not
    for a, b in zip(jax.tree.leaves(tree_to_numpy(fast)), jax.tree.leaves(tree_to_numpy(slow))):
        np.testing.assert_allclose(a, b, atol=2e-6)
    for k in ("train/loss", "train/kl", "train/entropy", "mismatch/sampler_abs"):
        np.testing.assert_allclose(m_fast[k], m_slow[k], rtol=1e-5, atol=1e-7)
    assert m_fast["train/ratio_mean"] == 1.0 and m_fast["train/clip_frac"] == 0.0
    # sampler_logprobs are 0 in this batch: the mismatch is the mean -logprob of the tokens
    want = -_reference_logprobs(params, batch)[batch.response_mask].mean()
    np.testing.assert_allclose(m_fast["mismatch/sampler_abs"], want, rtol=1e-5)


def test_no_scoring_pass_without_kl_critic_or_second_minibatch(setup, monkeypatch):
    """kl_coef 0, no critic, on-policy: no forward before the step at all, and no reference
    params needed; two mini-batches bring the old-logprob pass back."""
    params, trainer, state = setup
    calls = _count_score_calls(monkeypatch)
    cfg = dataclasses.replace(trainer.cfg, loss=dataclasses.replace(trainer.cfg.loss,
                                                                    kl_coef=0.0))
    batch = make_batch(grpo_records(n_tasks=1, per_task=4, seed=3))
    new, m = Trainer(TINY, cfg).update(state, batch, ref_params=None)
    assert calls == [] and m["optimizer_steps"] == 1 and m["skipped_steps"] == 0
    two = Trainer(TINY, dataclasses.replace(cfg, mini_batch_size=2))
    assert not two.on_policy(batch)
    _, m2 = two.update(state, batch, ref_params=None)
    assert calls == [True] and m2["optimizer_steps"] == 2


def test_trim_padding_drops_only_padding_columns(setup):
    from strata_jax.training.batching import trim_padding
    params, trainer, state = setup
    recs = grpo_records(n_tasks=1, per_task=4, seed=3, prompt_len=(3, 7), resp_len=(2, 6))
    tight = make_batch(recs)                      # widths 8 and 8 (longest 6 and 5)
    wide = make_batch(recs, prompt_buckets=(40,), response_buckets=(24,))
    assert tight.prompt_ids.shape[1] == 8 and tight.response_ids.shape[1] == 8
    trimmed = trim_padding(wide)
    for f in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "sampler_logprobs"):
        np.testing.assert_array_equal(getattr(trimmed, f), getattr(tight, f))
    assert trim_padding(tight) is tight
    # The update over the padded width (trim off) equals the trimmed one.
    off = Trainer(TINY, dataclasses.replace(trainer.cfg, trim_padding=False))
    a, ma = trainer.update(state, wide, ref_params=params)
    b, mb = off.update(state, wide, ref_params=params)
    for x, y in zip(jax.tree.leaves(tree_to_numpy(a)), jax.tree.leaves(tree_to_numpy(b))):
        np.testing.assert_allclose(x, y, atol=2e-6)
    np.testing.assert_allclose(ma["train/loss"], mb["train/loss"], rtol=1e-5, atol=1e-7)


def test_per_layer_remat_bounds_backward_memory():
    """XLA's memory analysis of the gradient step: per-layer rematerialisation ("full") holds
    far fewer temporaries than none, "dots" sits in between (the compiler's figures, not a
    timing)."""
    from strata_jax.models import Qwen2Config
    from strata_jax.training import TrainConfig
    model = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=256, num_layers=8,
                        num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True)
    params = init_params(model, jax.random.PRNGKey(0))
    recs = grpo_records(n_tasks=2, per_task=4, prompt_len=(100, 120), resp_len=(20, 30))
    batch = make_batch(recs)
    vec = jnp.ones((batch.num_rows,), jnp.float32)
    temps = {}
    for remat in ("none", "dots", "full"):
        cfg = TrainConfig(mini_batch_size=8, micro_batch_rows=8, remat=remat,
                          compute_dtype="float32")
        low = accumulate_grads.lower(params, {}, batch, vec, vec, vec, model=model, cfg=cfg)
        temps[remat] = low.compile().memory_analysis().temp_size_in_bytes
    assert temps["full"] < 0.5 * temps["none"], temps
    assert temps["full"] <= temps["dots"] <= temps["none"], temps


def test_donated_update_equals_the_copying_one_and_reuses_the_input_state(setup):
    """train.donate_state (on in the experiment configs): the optimizer step reuses the input
    state's buffers (they are deleted after the call) and computes the same new state."""
    params, trainer, state = setup
    batch = make_batch(grpo_records(n_tasks=2, per_task=4, scores=[1, 0, 0, 1, 1, 0, 1, 1],
                                    seed=5))
    ref_state, ref_m = trainer.update(state, batch, params)
    donating = Trainer(trainer.model, dataclasses.replace(trainer.cfg, donate_state=True))
    # the same padded shapes as the fixture's trainer, whose shape marks earlier tests raised
    # (padding changes no number exactly, but another shape sums in another order: bit
    # equality needs the same programs but for the donation)
    donating.set_host_state(trainer.host_state())
    own = jax.tree.map(jnp.copy, state)     # the fixture's state stays usable for other tests
    new, m = donating.update(own, batch, params)
    assert all(x.is_deleted() for x in jax.tree.leaves((own.params, own.opt_state)))
    assert not any(x.is_deleted() for x in jax.tree.leaves(params))   # the reference survives
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert m["train/loss"] == ref_m["train/loss"] and int(new.step) == int(state.step) + 1


def test_response_columns_buckets():
    from strata_jax.buckets import response_columns
    # floor 0: two sizes per octave, multiples of 8
    assert [response_columns(n) for n in (0, 1, 8, 9, 13, 17, 25, 33, 97)] == \
        [8, 8, 8, 16, 16, 24, 32, 48, 128]
    # floor 32: powers of two from 32
    assert [response_columns(n, 32) for n in (0, 1, 9, 32, 33, 65, 96, 128, 129)] == \
        [32, 32, 32, 32, 64, 128, 128, 128, 256]


def test_response_floor_pads_responses_and_keeps_the_update(setup):
    """train.response_floor: the trimmed batch's response columns are padded up to the floor
    (columns off every mask), and the update equals the floor-0 one."""
    from strata_jax.training.batching import trim_padding
    params, trainer, state = setup
    recs = grpo_records(n_tasks=1, per_task=4, seed=3, prompt_len=(3, 7), resp_len=(2, 6))
    tight = make_batch(recs)                      # widths 8 and 8 (longest 6 and 5)
    wide = trim_padding(tight, 32)
    assert wide.prompt_ids.shape[1] == 8 and wide.response_ids.shape[1] == 32
    for f in ("response_ids", "response_mask", "sampler_logprobs"):
        np.testing.assert_array_equal(np.asarray(getattr(wide, f))[:, :8], getattr(tight, f))
        assert not np.asarray(getattr(wide, f))[:, 8:].any()
    floor = Trainer(TINY, dataclasses.replace(trainer.cfg, response_floor=32))
    a, ma = trainer.update(state, tight, ref_params=params)
    b, mb = floor.update(state, tight, ref_params=params)
    for x, y in zip(jax.tree.leaves(tree_to_numpy(a)), jax.tree.leaves(tree_to_numpy(b))):
        np.testing.assert_allclose(x, y, atol=2e-6)
    np.testing.assert_allclose(ma["train/loss"], mb["train/loss"], rtol=1e-5, atol=1e-7)
    # real tokens / computed slots: the packed micro-batch is one packed row of the token budget
    # of 4 rows (`Trainer.pack_shape`): W = 4 x (8 + 8) = 64 slots without the floor; with it
    # 4 x (8 + 32) = 160, rounded down to a power of two, 128; the 36 real tokens fit 3W / 4
    # (`buckets.micro_widths`), so the micro-batch runs at 48 and 96 slots
    real = int(np.asarray(tight.prompt_mask).sum() + np.asarray(tight.response_mask).sum())
    assert real == 36
    assert trainer.pack_shape(4, 8, 8) == (64, 1, 1) and floor.pack_shape(4, 8, 32) == (128, 1, 1)
    # optim.micro_batch_tokens sets the budget in slots: 64 is the default's; 256 is one packed
    # row of 256; 40 rounds down to one row of 32 (never below the 16 of a whole row)
    assert trainer.pack_shape(4, 8, 8, tokens=64) == (64, 1, 1)
    assert trainer.pack_shape(4, 8, 8, tokens=256) == (256, 1, 1)
    assert trainer.pack_shape(4, 8, 8, tokens=40) == (32, 1, 1)
    assert trainer.pack_shape(4, 8, 8, tokens=8) == (16, 1, 1)
    assert ma["perf/update_token_fill"] == pytest.approx(real / 48)
    assert mb["perf/update_token_fill"] == pytest.approx(real / 96)


def test_response_floor_stops_new_compilations_as_responses_drift(setup):
    """Iterations whose longest responses drift (3 -> 9 -> 20 -> 27 tokens) compile no new
    program after the first with response_floor 32 (every width pair is (8, 32)); with floor 0
    each new bucket (8, 16, 24, 32) compiles the update again."""
    from tests.fixtures.sampler import compile_counter
    counter = compile_counter()
    params, trainer, state = setup
    batches = []
    for i, n in enumerate((3, 9, 20, 27)):
        recs = grpo_records(n_tasks=1, per_task=4, seed=20 + i, prompt_len=(3, 7),
                            resp_len=(2, 3))
        recs[0]["response_ids"] = np.arange(1, n + 1)
        batches.append(make_batch(recs, response_buckets=(32,)))
    new = {}
    for floor in (32, 0):
        # a config of this test only (lr): no program compiled by another test is reused
        tr = Trainer(TINY, dataclasses.replace(trainer.cfg, response_floor=floor, lr=7e-4))
        counts = []
        for b in batches:
            before = counter.count
            tr.update(state, b, ref_params=params)
            counts.append(counter.count - before)
        new[floor] = counts
    assert new[32][0] > 0 and new[32][1:] == [0, 0, 0]
    assert all(c > 0 for c in new[0][1:])


@pytest.mark.parametrize("algo", ["strata", "ppo"])
def test_packed_update_with_lora_donation_and_several_minibatches(setup, algo):
    """Mixed prompt (3-40) and response (1-20) lengths, 10 step rows + 2 strategy rows in 3
    mini-batches of 8 rows (padding entries included), LoRA adapters, the donated optimizer step,
    2 epochs (the old-logprob pass), PPO's separate critic: the packed update == the per-row
    reference (`Trainer(per_row=True)`)."""
    from strata_jax.models.lora import LoraConfig
    params = setup[0]
    recs = grpo_records(n_tasks=2, per_task=5, seed=21, prompt_len=(3, 41), resp_len=(1, 21),
                        scores=[1, 0, 0, 1, 1, 0, 1, 1, 0, 1], strategies=2)
    batch = make_batch(recs)
    assert len({int(x) for x in np.asarray(batch.response_mask).sum(1)}) > 5
    cfg = train_config(algo, mini_batch_size=4, micro_batch_rows=4, ppo_epochs=2, dropout=0.0,
                       lora=LoraConfig(rank=4, alpha=8.0), donate_state=True)
    packed, rows = Trainer(TINY, cfg), Trainer(TINY, cfg, per_row=True)
    state = packed.init_state(params, jax.random.PRNGKey(5))
    # adapters with B != 0: the LoRA path changes the forward
    state = state.replace(params=jax.tree.map(
        lambda x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(6), x.shape), state.params))
    a, ma = packed.update(jax.tree.map(jnp.copy, state), batch, params)
    b, mb = rows.update(jax.tree.map(jnp.copy, state), batch, params)
    assert ma["optimizer_steps"] == mb["optimizer_steps"] == 6      # 2 epochs x 3 mini-batches
    # k_bias: its exact gradient is 0, so AdamW turns both paths' round-off into steps up to
    # ~lr (test_train_packed.py explains); compared to a tenth of lr per step
    flat = jax.tree_util.tree_flatten_with_path(tree_to_numpy(a))[0]
    for (path, x), y in zip(flat, jax.tree.leaves(tree_to_numpy(b))):
        noise = "k_bias" in jax.tree_util.keystr(path)
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=0.6 * cfg.lr if noise else 1e-5,
                                   err_msg=jax.tree_util.keystr(path))
    for k in ma:
        if k != "perf/update_token_fill":
            np.testing.assert_allclose(ma[k], mb[k], rtol=1e-4, atol=1e-6, err_msg=k)
    assert mb["train/approx_kl_old"] != 0      # epoch 2 moved off pi_old: the ratios are live
    assert ma["perf/update_token_fill"] > mb["perf/update_token_fill"]
