"""optim.skip_empty_steps: a mini-batch that carries no gradient takes no optimizer step
(docs/method.md §9.3), so AdamW's first moment and weight decay do not move the weights."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from strata_jax.models import init_params
from strata_jax.training import Trainer, TrainConfig
from tests.fixtures.trainer import TINY, grpo_records, make_batch


def _config(**loss):
    import configs.base as base
    c = base.get_base_config()
    c.algo = "grpo"
    c.loss.kl_coef, c.loss.entropy_coef = 0.0, 0.0
    for k, v in loss.items():
        c.loss[k] = v
    return TrainConfig.from_config(c, lr=1e-3, mini_batch_size=8, micro_batch_rows=4,
                                   remat="none", compute_dtype="float32", donate_state=False,
                                   response_floor=0)


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves((state.params, state.opt_state))]


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
    assert trainer.inert_rows(np.zeros(8, np.float32), np.ones(8, np.float32)) is None
    new, m = trainer.update(state, constant)
    assert m["empty_steps"] == 0 and m["optimizer_steps"] == 1
    assert any(not np.array_equal(a, b) for a, b in zip(_leaves(new), _leaves(state)))


def test_a_mini_batch_with_one_informative_row_steps_as_before(moved):
    """Only a mini-batch of inert rows is skipped: one constant group beside an informative one
    in the same mini-batch gives the same update with the option on and off."""
    params, state = moved
    half = make_batch(grpo_records(scores=[1.0] * 4 + [1.0, 0.0, 0.0, 1.0]))
    on = Trainer(TINY, _config())
    off = Trainer(TINY, dataclasses.replace(on.cfg, skip_empty_steps=False))
    a, ma = on.update(state, half)
    b, mb = off.update(state, half)
    assert ma["empty_steps"] == 0 and ma["optimizer_steps"] == mb["optimizer_steps"] == 1
    for x, y in zip(_leaves(a), _leaves(b)):
        np.testing.assert_array_equal(x, y)


def test_inert_rows_by_hand():
    trainer = Trainer(TINY, _config())
    got = trainer.inert_rows(np.array([0.0, 0.5, -0.0, 1.0], np.float32),
                             np.array([1.0, 0.0, 1.0, 1.0], np.float32))
    np.testing.assert_array_equal(got, [True, True, True, False])   # A w == 0: rows 0, 1, 2
    off = Trainer(TINY, dataclasses.replace(trainer.cfg, skip_empty_steps=False))
    assert off.inert_rows(np.zeros(4, np.float32), np.ones(4, np.float32)) is None
