"""Critics: PPO's separate critic and STAPO's value head on the policy trunk learn their value
targets; the K dropout passes give a value uncertainty only with dropout on."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from strata_jax.algos import KIND_ACTION
from strata_jax.models import init_params
from strata_jax.training import (Trainer, dropout_values, init_critic, response_states,
                                 tree_to_numpy)
from tests.fixtures.trainer import TINY, make_batch, train_config


def _two_step_batch(seed: int = 0):
    """4 tasks x 2 episodes x 2 steps; reward only at the last step (1 for episode 0, 0 else)."""
    rng = np.random.default_rng(seed)
    recs = []
    for t in range(2):
        for e in range(2):
            for s in range(2):
                recs.append(dict(prompt_ids=rng.integers(1, 256, rng.integers(3, 7)),
                                 response_ids=rng.integers(1, 256, rng.integers(2, 5)),
                                 task_id=t, trajectory_id=e, step_index=s, kind=KIND_ACTION,
                                 score=float(e == 0), step_reward=float(e == 0 and s == 1)))
    return make_batch(recs)


def _run(algo: str, iters: int = 6, critic_lr: float = 3e-3):
    params = init_params(TINY, jax.random.PRNGKey(0))
    trainer = Trainer(TINY, train_config(algo, lr=1e-5, critic_lr=critic_lr))
    state = trainer.init_state(params, jax.random.PRNGKey(1))
    batch = _two_step_batch()
    losses, metrics = [], []
    s = state
    for _ in range(iters):
        s, m = trainer.update(s, batch, ref_params=params)
        assert m["skipped_steps"] == 0
        losses.append(m["train/vf_loss"])
        metrics.append(m)
    return params, state, s, losses, metrics


def test_ppo_separate_critic_learns_values():
    params, state0, state, losses, _ = _run("ppo")
    assert set(state0.critic_params) == {"trunk", "head"}
    # Initialised from the same params, trained as its own model with its own optimizer.
    for a, b in zip(jax.tree.leaves(tree_to_numpy(state0.critic_params["trunk"])),
                    jax.tree.leaves(tree_to_numpy(params))):
        np.testing.assert_array_equal(a, b)
    q_c = np.asarray(state.critic_params["trunk"]["layers"][0]["q_proj"])
    q_p = np.asarray(state.params["layers"][0]["q_proj"])
    assert np.max(np.abs(q_c - np.asarray(params["layers"][0]["q_proj"]))) > 1e-3  # critic lr
    assert np.max(np.abs(q_p - np.asarray(params["layers"][0]["q_proj"]))) < 1e-3  # policy lr
    assert losses[-1] < 0.5 * losses[0], losses


def test_stapo_value_head_learns_and_reports_uncertainty():
    params, state0, state, losses, metrics = _run("stapo", critic_lr=2e-2)
    assert set(state0.critic_params) == {"head"}
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.5 * losses[0], losses
    # Dropout on (p = 0.1, K = 4): nonzero uncertainty enters the STAPO weights.
    assert metrics[0]["stapo/value_std_mean"] > 0


def test_dropout_passes_std_zero_without_dropout():
    params = init_params(TINY, jax.random.PRNGKey(0))
    head = init_critic("head", params, jax.random.PRNGKey(3), TINY.hidden_size)["head"]
    batch = _two_step_batch()
    states = jax.jit(response_states, static_argnames=("model",))
    _, last = states(params, TINY, jnp.asarray(batch.prompt_ids), jnp.asarray(batch.prompt_mask),
                     jnp.asarray(batch.response_ids), jnp.asarray(batch.response_mask))
    v_on, std_on = dropout_values(head, last, jax.random.PRNGKey(0), passes=4, rate=0.1)
    v_off, std_off = dropout_values(head, last, jax.random.PRNGKey(0), passes=4, rate=0.0)
    np.testing.assert_array_equal(np.asarray(v_on), np.asarray(v_off))  # V has no dropout
    np.testing.assert_allclose(np.asarray(v_on), np.asarray(last) @ np.asarray(head["w"]),
                               rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(std_on) > 0)
    assert np.all(np.asarray(std_off) == 0)
    # K passes with a hand-checked dropout mask.
    keep = jax.random.bernoulli(jax.random.PRNGKey(0), 0.9, (4,) + last.shape)
    vs = (np.where(keep, np.asarray(last) / 0.9, 0.0) @ np.asarray(head["w"]))
    np.testing.assert_allclose(np.asarray(std_on), vs.std(axis=0), rtol=1e-4, atol=1e-6)
