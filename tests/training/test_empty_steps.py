"""optim.skip_empty_steps: a mini-batch that carries no gradient takes no optimizer step
(docs/method.md §9.3), so AdamW's first moment and weight decay do not move the weights."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from strata_jax.models import init_params
from strata_jax.training import Trainer, TrainConfig
from strata_jax.training.inert import inert_rows
from tests.fixtures.trainer import TINY, grpo_records, make_batch


def _config(algo="grpo", **loss):
    import configs.base as base
    c = base.get_base_config()
    c.algo = algo
    c.loss.kl_coef, c.loss.entropy_coef = 0.0, 0.0
    for k, v in loss.items():
        c.loss[k] = v
    return TrainConfig.from_config(c, lr=1e-3, mini_batch_size=8, micro_batch_rows=4,
                                   remat="none", compute_dtype="float32", donate_state=False,
                                   response_floor=0)


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves((state.params, state.opt_state))]


def _same_step(a, b, ma, mb):
    """Two updates equal up to float summation order: loss and gradient norm to 1e-5
    relative; params and moments to 1e-5 absolute (at lr 1e-3, 1% of a step: Adam divides by
    the gradient's own scale, so a coordinate whose gradient is near 0 amplifies the order's
    rounding up to that)."""
    for k in ("loss", "grad_norm"):
        np.testing.assert_allclose(float(ma[f"train/{k}"] if f"train/{k}" in ma else ma[k]),
                                   float(mb[f"train/{k}"] if f"train/{k}" in mb else mb[k]),
                                   rtol=1e-5)
    for x, y in zip(_leaves(a), _leaves(b)):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def moved():
    """A state after one real optimizer step (non-zero Adam moments), and its params."""
    params = init_params(TINY, jax.random.PRNGKey(0))
    trainer = Trainer(TINY, _config())
    state = trainer.init_state(params, jax.random.PRNGKey(1))
    state, m = trainer.update(state, make_batch(grpo_records()))   # scores 1, 0, 1, 0: signal
    assert m["optimizer_steps"] == 1 and m["empty_steps"] == 0
    return params, state


def test_an_all_zero_batch_leaves_params_and_optimizer_bit_identical(moved):
    params, state = moved
    constant = make_batch(grpo_records(scores=[1.0] * 4 + [0.0] * 4))   # two constant groups
    trainer = Trainer(TINY, _config())
    new, m = trainer.update(state, constant)
    assert m["empty_steps"] == 1 and m["optimizer_steps"] == 0
    for a, b in zip(_leaves(new), _leaves(state)):
        np.testing.assert_array_equal(a, b)
    assert int(new.step) == int(state.step) + 1   # the iteration still counts
    # Off: AdamW steps on the zero gradient, so the first moment and the decay move the weights.
    off = Trainer(TINY, dataclasses.replace(trainer.cfg, skip_empty_steps=False))
    moved_anyway, m_off = off.update(state, constant)
    assert m_off["empty_steps"] == 0 and m_off["optimizer_steps"] == 1
    assert any(not np.array_equal(a, b) for a, b in zip(_leaves(moved_anyway), _leaves(state)))


def test_another_loss_term_keeps_every_step(moved):
    """With the entropy bonus on, zero advantages still give a gradient: the step is taken."""
    params, state = moved
    constant = make_batch(grpo_records(scores=[1.0] * 4 + [0.0] * 4))
    trainer = Trainer(TINY, _config(entropy_coef=0.01))
    assert inert_rows(np.zeros(8, np.float32), np.ones(8, np.float32), trainer.cfg) is None
    new, m = trainer.update(state, constant)
    assert m["empty_steps"] == 0 and m["optimizer_steps"] == 1
    assert any(not np.array_equal(a, b) for a, b in zip(_leaves(new), _leaves(state)))


def test_a_mini_batch_with_one_informative_row_steps_as_before(moved):
    """Only a mini-batch of inert rows is skipped: one constant group beside an informative one
    in the same mini-batch takes its step with the option on and off (the same update up to
    float summation order: the constant group's rows are not computed)."""
    params, state = moved
    half = make_batch(grpo_records(scores=[1.0] * 4 + [1.0, 0.0, 0.0, 1.0]))
    on = Trainer(TINY, _config())
    off = Trainer(TINY, dataclasses.replace(on.cfg, skip_empty_steps=False))
    a, ma = on.update(state, half)
    b, mb = off.update(state, half)
    assert ma["empty_steps"] == 0 and ma["optimizer_steps"] == mb["optimizer_steps"] == 1
    _same_step(a, b, ma, mb)
    assert ma["perf/inert_tokens"] > 0 and mb["perf/inert_tokens"] == 0


def test_inert_rows_by_hand():
    trainer = Trainer(TINY, _config())
    got = inert_rows(np.array([0.0, 0.5, -0.0, 1.0], np.float32),
                     np.array([1.0, 0.0, 1.0, 1.0], np.float32), trainer.cfg)
    np.testing.assert_array_equal(got, [True, True, True, False])   # A w == 0: rows 0, 1, 2
    off = Trainer(TINY, dataclasses.replace(trainer.cfg, skip_empty_steps=False))
    assert inert_rows(np.zeros(4, np.float32), np.ones(4, np.float32), off.cfg) is None


def test_inert_rows_with_a_critic_are_the_weight_0_rows():
    stapo = Trainer(TINY, _config("stapo"))
    got = inert_rows(np.array([0.0, 0.5, 0.7, 0.0], np.float32),
                     np.array([1.0, 0.0, 1.0, 0.0], np.float32), stapo.cfg)
    np.testing.assert_array_equal(got, [False, True, False, True])   # A = 0 still trains V


@pytest.mark.parametrize("algo", ["grpo", "stapo"])
def test_inert_rows_are_not_computed_and_the_update_is_the_same(algo):
    """Half the rows inert (GRPO: advantage 0, a constant group; STAPO: sample weight 0, its
    value loss weighted too): the packed update without them equals the one with them up to
    float summation order, and perf/inert_tokens counts their tokens."""
    params = init_params(TINY, jax.random.PRNGKey(0))
    on = Trainer(TINY, dataclasses.replace(_config(algo), mini_batch_size=16))
    off = Trainer(TINY, dataclasses.replace(on.cfg, skip_empty_steps=False))
    state = on.init_state(params, jax.random.PRNGKey(1))
    batch = make_batch(grpo_records(n_tasks=4))
    rows = batch.num_rows
    rng = np.random.default_rng(3)
    adv = rng.normal(size=rows).astype(np.float32)
    w = np.ones(rows, np.float32)
    dead = np.asarray(batch.task_id) % 2 == 1          # tasks 1 and 3
    if algo == "grpo":
        adv[dead] = 0.0
    else:
        w[dead] = 0.0
    targets = rng.normal(size=rows).astype(np.float32)
    key = jax.random.PRNGKey(5)
    scored = on.score(state, batch, None, key)
    a, ma = on.train_on_batch(state, scored, adv, w, targets, key)
    b, mb = off.train_on_batch(state, scored, adv, w, targets, key)
    assert len(ma) == len(mb) == 1
    _same_step(a, b, *jax.device_get((ma[0], mb[0])))
    n_tokens = (np.asarray(batch.prompt_mask).sum(1) + np.asarray(batch.response_mask).sum(1))
    want = int(n_tokens[dead & np.asarray(batch.valid)].sum())
    assert sum(m["inert_tokens"] for m in ma) == want > 0
    assert sum(m["inert_tokens"] for m in mb) == 0
    assert sum(m["real_tokens"] for m in ma) + want == sum(m["real_tokens"] for m in mb)


def test_the_old_pass_leaves_out_the_rows_no_loss_term_reads(moved, monkeypatch):
    """Off-policy (two mini-batches), a critic-free estimator: the rows of a constant group are
    inert by the advantages computed before scoring, so the old-logprob pass leaves them out;
    the update equals the one that scores them (up to float summation order). A batch of only
    constant groups runs no scoring forward at all and moves nothing."""
    import strata_jax.training.trainer as trainer_module
    params, state = moved
    on = Trainer(TINY, dataclasses.replace(_config(), mini_batch_size=4))
    half = make_batch(grpo_records(scores=[1.0] * 4 + [1.0, 0.0, 0.0, 1.0]))
    assert not on.on_policy(half)
    a, ma = on.update(state, half)
    with monkeypatch.context() as m:
        m.setattr(trainer_module, "unread_rows", lambda *args: None)
        b, mb = on.update(state, half)
    assert ma["perf/unscored_inert_rows"] == 4 and mb["perf/unscored_inert_rows"] == 0
    assert ma["optimizer_steps"] == mb["optimizer_steps"]
    _same_step(a, b, ma, mb)
    calls = []
    real = trainer_module.score_rows
    monkeypatch.setattr(trainer_module, "score_rows",
                        lambda *args, **kw: calls.append(1) or real(*args, **kw))
    constant = make_batch(grpo_records(scores=[1.0] * 4 + [0.0] * 4))
    new, mc = on.update(state, constant)
    assert calls == [] and mc["perf/unscored_inert_rows"] == 8
    assert mc["optimizer_steps"] == 0 and "mismatch/sampler_abs" not in mc
    for x, y in zip(_leaves(new), _leaves(state)):
        np.testing.assert_array_equal(x, y)
    on.update(state, half)
    assert calls, "a batch with signal is scored"
