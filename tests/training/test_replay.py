"""STAPO's replay pool (strata_jax/training/replay.py, docs/method.md §7.5): the stratified
draw, eviction and expiry on hand-made pools, the replayed rows' stored advantage / weight /
old logprobs reaching the loss unchanged, the update without replay equal to the flow without
the hooks, kl/whole_batch, and the pool through a checkpoint."""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.algos import loss_mask, make_sample_batch, mean_kl, pad_batch
from strata_jax.models import init_params
from strata_jax.training import Checkpointer, Trainer, tree_to_numpy
from strata_jax.training.replay import (ReplayConfig, ReplayPool, eviction_order,
                                        stratified_draw)
from strata_jax.training.steps import advantages
from tests.fixtures.trainer import TINY, grpo_records, make_batch, train_config

ON = ReplayConfig(enabled=True, capacity=4, max_age=2, fraction=0.5, strata=3)


def _bins(adv, idx, k):
    """Stratum of each drawn index: position of its advantage among the sorted eligible."""
    order = np.argsort(adv, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    bounds = np.cumsum([len(b) for b in np.array_split(np.arange(adv.size), k)])
    return np.searchsorted(bounds, rank[idx], side="right")


def test_stratified_draw_takes_an_even_share_of_every_advantage_stratum():
    adv = np.array([2.0, -3.0, 0.1, 3.0, -1.0, 0.0, 1.0, -2.0, 0.2])
    w = np.array([1.0, 2.0, 1.0, 0.5, 1.0, 3.0, 1.0, 1.0, 1.0])
    for seed in range(20):
        idx = stratified_draw(adv, w, 5, 3, np.random.default_rng(seed))
        assert idx.size == 5 and np.unique(idx).size == 5 and np.all(np.diff(idx) > 0)
        # terciles {-3, -2, -1}, {0, 0.1, 0.2}, {1, 2, 3}: shares 2, 2, 1
        assert np.bincount(_bins(adv, idx, 3), minlength=3).tolist() == [2, 2, 1]
    # more than the pool holds: every eligible row once; weight-0 rows never
    w0 = w.copy()
    w0[[1, 5]] = 0.0
    idx = stratified_draw(adv, w0, 50, 3, np.random.default_rng(0))
    assert idx.tolist() == [0, 2, 3, 4, 6, 7, 8]
    assert stratified_draw(adv, np.zeros(9), 4, 3, np.random.default_rng(0)).size == 0


def test_stratified_draw_is_deterministic_and_proportional_to_weight_within_a_stratum():
    adv = np.array([0.0, 0.1, 5.0, 5.1])
    w = np.array([1.0, 99.0, 1.0, 1.0])
    a = stratified_draw(adv, w, 2, 2, np.random.default_rng(7))
    assert a.tolist() == stratified_draw(adv, w, 2, 2, np.random.default_rng(7)).tolist()
    draws = [stratified_draw(adv, w, 2, 2, np.random.default_rng(s)) for s in range(400)]
    low = np.array([d[0] for d in draws])   # one of rows 0 / 1 (weights 1 : 99) per draw
    assert set(low.tolist()) <= {0, 1} and 0.95 <= np.mean(low == 1) < 1.0
    assert {d[1] for d in draws} == {2, 3}   # the top stratum: one of its two equal rows


def test_eviction_order_is_lowest_weight_then_oldest_then_first_inserted():
    w = np.array([1.0, 0.5, 1.0, 1.0, 0.5])
    it = np.array([3, 4, 1, 1, 2])
    serial = np.array([0, 1, 3, 2, 4])
    assert eviction_order(w, it, serial).tolist() == [4, 1, 3, 2, 0]


def _rows(n, seed=0, iteration_tag=0):
    recs = grpo_records(n_tasks=1, per_task=n, seed=seed)
    for j, r in enumerate(recs):
        r["trajectory_id"], r["step_index"] = 10 * iteration_tag + j, j
        r["sampler_logprobs"] = -0.1 * (1 + np.arange(len(r["response_ids"])))
    return make_batch(recs)


def test_pool_keeps_the_highest_weights_and_expires_rows_past_max_age():
    pool = ReplayPool()
    b0 = _rows(4)
    # rows 4..7 are padding (invalid): never stored; row 2 has weight 0: not stored
    adv = np.array([1.0, -1.0, 0.5, 2.0, 0, 0, 0, 0], np.float32)
    w = np.array([0.5, 1.5, 0.0, 1.0, 1, 1, 1, 1], np.float32)
    pool.absorb(b0, adv, w, adv * 2, 0, ON)
    a = pool.arrays
    assert a["weight"].tolist() == [0.5, 1.5, 1.0] and a["trajectory_id"].tolist() == [0, 1, 3]
    assert a["target"].tolist() == [2.0, -2.0, 4.0] and a["iteration"].tolist() == [0, 0, 0]
    np.testing.assert_array_equal(a["sampler_logprobs"][1], np.asarray(b0.sampler_logprobs)[1])
    np.testing.assert_array_equal(a["prompt_ids"][2][a["prompt_mask"][2]],
                                  np.asarray(b0.prompt_ids)[3][np.asarray(b0.prompt_mask)[3]])
    with pytest.raises(ValueError):
        a["weight"][0] = 3.0   # read-only: a marked snapshot stays what it was
    # iteration 1: two more rows (weights 1.0, 0.25); capacity 4 evicts the 0.25, then the 0.5
    b1 = _rows(2, seed=1, iteration_tag=1)
    pool.absorb(b1, np.array([0.3, 0.4] + [0] * 6, np.float32),
                np.array([1.0, 0.25] + [0] * 6, np.float32), np.zeros(8, np.float32), 1, ON)
    assert pool.rows == 4
    assert pool.arrays["weight"].tolist() == [0.5, 1.5, 1.0, 1.0]
    assert pool.arrays["trajectory_id"].tolist() == [0, 1, 3, 10]
    pool.absorb(b1, np.zeros(8, np.float32), np.array([2.0] + [0] * 7, np.float32),
                np.zeros(8, np.float32), 1, ON)
    assert pool.arrays["weight"].tolist() == [1.5, 1.0, 1.0, 2.0]   # the 0.5 went
    # max_age 2: iteration-0 rows replayable at iterations 1, 2; gone at 3
    pool.expire(2, ON)
    assert pool.rows == 4
    pool.expire(3, ON)
    assert pool.arrays["iteration"].tolist() == [1, 1]


def test_draw_appends_the_stored_rows_with_their_sampler_logprobs_as_pi_old():
    pool = ReplayPool()
    b0 = _rows(4)
    pool.absorb(b0, np.array([1.0, -1.0, 0.5, 2.0] + [0] * 4, np.float32),
                np.ones(8, np.float32), np.zeros(8, np.float32), 0, ON)
    fresh = make_batch(grpo_records(n_tasks=1, per_task=2, seed=5, prompt_len=(8, 9)))
    draw = pool.draw(fresh, 1, seed=3, config=ON)
    # 2 valid fresh rows, fraction 0.5: 2 replayed rows, one per stratum of {-1, 0.5} {1, 2}
    assert (draw.rows, draw.fresh_rows) == (2, 8) and draw.age.tolist() == [1, 1]
    b = draw.batch
    assert b.num_rows == 10 and np.asarray(b.valid).tolist() == [True] * 2 + [False] * 6 + [True] * 2
    for r, a in zip(range(8, 10), draw.advantage):
        src = int(np.flatnonzero(pool.arrays["advantage"] == a)[0])
        np.testing.assert_array_equal(np.asarray(b.old_logprobs)[r],
                                      np.asarray(b0.sampler_logprobs)[src, :b.response_len])
        got = np.asarray(b.response_ids)[r][np.asarray(b.response_mask)[r]]
        np.testing.assert_array_equal(got, np.asarray(b0.response_ids)[src][
            np.asarray(b0.response_mask)[src]])
    assert sorted(draw.advantage.tolist()) in ([-1.0, 1.0], [-1.0, 2.0], [0.5, 1.0], [0.5, 2.0])


@pytest.fixture(scope="module")
def setup():
    params = init_params(TINY, jax.random.PRNGKey(0))
    off = Trainer(TINY, train_config())
    state = off.init_state(params, jax.random.PRNGKey(1))
    return params, off, state


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(tree_to_numpy(a)),
                                                    jax.tree.leaves(tree_to_numpy(b))))


def test_without_replay_the_update_is_the_flow_without_the_hooks(setup):
    """replay off (the default) and replay on with an empty pool: bit-identical to score ->
    estimator -> train_on_batch, the update's flow before the pool existed."""
    params, off, state = setup
    assert not off.cfg.replay.enabled and off.host_state().keys() == {"shape_marks"}
    batch = make_batch(grpo_records(n_tasks=3, per_task=4, seed=2))
    new_off, m_off = off.update(state, batch, params)
    on = Trainer(TINY, train_config(replay=ON))
    new_on, m_on = on.update(state, batch, params)
    _, k_score, k_plan = jax.random.split(jnp.asarray(state.rng, jnp.uint32), 3)
    ref = Trainer(TINY, train_config())
    scored = ref.score(state, batch, params, k_score, use_old=not ref.on_policy(batch))
    adv, w, _ = advantages(scored, state.step, algo=ref.cfg.estimator_name, est=ref.cfg.estimator)
    manual, _ = ref.train_on_batch(state, scored, adv, w, jnp.zeros_like(adv), k_plan, params,
                                   on_policy=ref.on_policy(batch))
    assert _same(new_off.params, manual.params) and _same(new_on.params, manual.params)
    assert _same(new_off.opt_state, new_on.opt_state)
    assert m_on["replay/rows"] == 0 and m_on["replay/pool_rows"] == ON.capacity   # 12 rows in, 4 kept
    assert {k: v for k, v in m_on.items() if not k.startswith("replay/")} == m_off
    # kl/whole_batch: the KL term over every valid row at the starting params
    want = mean_kl(scored.old_logprobs, scored.ref_logprobs, loss_mask(scored), ref.cfg.loss)
    assert m_off["kl/whole_batch"] == pytest.approx(float(want), rel=1e-6)


def test_replayed_rows_reach_the_loss_with_their_stored_advantage_weight_and_pi_old(setup):
    """An update with 4 replayed rows == train_on_batch on a hand-built batch holding the
    same rows as ordinary rows with those advantages, weights and old logprobs."""
    params, _, state = setup
    cfg = train_config(replay=dataclasses.replace(ON, capacity=16, fraction=0.9))
    tr = Trainer(TINY, cfg)
    old_recs = grpo_records(n_tasks=1, per_task=4, seed=9)
    stored_lp = [-1.5 - 0.2 * np.arange(len(r["response_ids"])) for r in old_recs]
    for r, lp in zip(old_recs, stored_lp):
        r["sampler_logprobs"] = lp
    stored_adv = np.array([1.2, -0.7, 0.4, -1.9], np.float32)
    stored_w = np.array([1.5, 0.3, 1.0, 0.3], np.float32)
    pad = lambda x: np.concatenate([x, np.zeros(4, np.float32)])  # noqa: E731
    tr.replay.absorb(make_batch(old_recs), pad(stored_adv), pad(stored_w), pad(stored_adv * 0),
                     int(state.step) - 1, cfg.replay)
    fresh = make_batch(grpo_records(n_tasks=2, per_task=4, seed=2))
    new, m = tr.update(state, fresh, params)
    assert m["replay/rows"] == 4 and m["replay/fraction"] == pytest.approx(4 / 12)
    assert m["replay/mean_age"] == 1.0 and m["replay/pool_rows"] == 4 + 8   # + the fresh rows

    # the reference: the same 12 rows as one ordinary batch (fresh rows first, as the draw)
    olds = make_sample_batch(old_recs, row_multiple=4)
    tp = max(fresh.prompt_ids.shape[1], olds.prompt_ids.shape[1])
    trw = max(fresh.response_len, olds.response_len)
    parts = [pad_batch(fresh, fresh.num_rows, tp, trw), pad_batch(olds, 4, tp, trw)]
    hand = jax.tree.map(lambda a, b: np.concatenate([a, b]), *parts)
    _, k_score, k_plan = jax.random.split(jnp.asarray(state.rng, jnp.uint32), 3)
    ref = Trainer(TINY, train_config())
    scored = ref.score(state, hand, params, k_score)
    rows = np.arange(scored.num_rows)
    is_old = (rows >= fresh.num_rows) & (rows < fresh.num_rows + 4)
    old_lp = np.array(scored.old_logprobs)
    for i, lp in enumerate(stored_lp):
        old_lp[fresh.num_rows + i] = 0.0
        old_lp[fresh.num_rows + i, :lp.size] = lp
    scored_hand = scored.replace(old_logprobs=jnp.asarray(old_lp))
    f_adv, f_w, _ = advantages(ref.score(state, fresh, params, k_score), state.step,
                               algo=ref.cfg.estimator_name, est=ref.cfg.estimator)
    adv = np.zeros(scored.num_rows, np.float32)
    w = np.zeros(scored.num_rows, np.float32)
    adv[: fresh.num_rows], w[: fresh.num_rows] = np.asarray(f_adv), np.asarray(f_w)
    adv[is_old], w[is_old] = stored_adv, stored_w
    manual, _ = ref.train_on_batch(state, scored_hand, jnp.asarray(adv), jnp.asarray(w),
                                   jnp.zeros(scored.num_rows), k_plan, params)
    for a, b in zip(jax.tree.leaves(tree_to_numpy(new.params)),
                    jax.tree.leaves(tree_to_numpy(manual.params))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # control: with the recomputed pi_old the update is another one
    other, _ = ref.train_on_batch(state, scored, jnp.asarray(adv), jnp.asarray(w),
                                  jnp.zeros(scored.num_rows), k_plan, params)
    gap = max(float(np.max(np.abs(a - b))) for a, b in zip(
        jax.tree.leaves(tree_to_numpy(new.params)), jax.tree.leaves(tree_to_numpy(other.params))))
    assert gap > 1e-5


def test_the_pool_is_saved_beside_the_state_and_restored_exactly(setup, tmp_path):
    params, _, state = setup
    cfg = train_config(replay=ON)
    tr = Trainer(TINY, cfg)
    tr.replay.absorb(_rows(4), np.array([1.0, -1.0, 0.5, 2.0] + [0] * 4, np.float32),
                     np.array([0.5, 1.5, 0.2, 1.0] + [0] * 4, np.float32),
                     np.zeros(8, np.float32), 0, cfg.replay)
    ck = Checkpointer(str(tmp_path / "ckpt"))
    ck.save(state, trainer_state=tr.host_state())
    assert (tmp_path / "ckpt" / "0" / "host" / "arrays.npz").exists()
    again = Trainer(TINY, cfg)
    _, meta = ck.restore(tr.abstract_state(params))
    ck.close()
    again.set_host_state(meta["trainer_state"])
    assert again.replay.serial == tr.replay.serial == 4
    for k, v in tr.replay.arrays.items():
        np.testing.assert_array_equal(again.replay.arrays[k], v)
        assert again.replay.arrays[k].dtype == v.dtype, k
    # a draw from the restored pool is the draw from the original
    fresh = make_batch(grpo_records(n_tasks=1, per_task=2, seed=5))
    d1, d2 = (t.replay.draw(fresh, 1, 11, cfg.replay) for t in (tr, again))
    assert d1.advantage.tolist() == d2.advantage.tolist() and d1.rows == 2
    with pytest.raises(ValueError, match="malformed"):
        again.set_host_state({"replay": {"rows": 5, "serial": 0},
                              "host_arrays": meta["trainer_state"]["host_arrays"]})


def test_replay_config_refuses_out_of_range_values():
    for bad in (dict(capacity=0), dict(max_age=0), dict(strata=0), dict(fraction=1.0),
                dict(fraction=-0.1)):
        with pytest.raises(ValueError, match="replay"):
            ReplayConfig.from_config(ReplayConfig(), **bad)


@pytest.mark.parametrize("kl_coef", [0.01, 0.0])
def test_rows_with_a_stored_pi_old_get_no_old_pass(setup, kl_coef):
    """`Trainer.score(stored_old=...)`: the replayed rows' old logprobs are not computed (0;
    the update replaces them with the stored ones) while every other row's scores are the
    unmasked call's; with a KL term their reference logprobs are still computed; with no other
    pass to run they are left out of the forward altogether (their ref logprobs 0 too)."""
    params, _, state = setup
    cfg = train_config()
    tr = Trainer(TINY, dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss,
                                                                         kl_coef=kl_coef)))
    batch = make_batch(grpo_records(n_tasks=2, per_task=4, seed=4))
    key = jax.random.PRNGKey(3)
    stored = np.zeros(batch.num_rows, bool)
    stored[[1, 4, 6]] = True
    full = tr.score(state, batch, params, key)
    part = tr.score(state, batch, params, key, stored_old=stored)
    f_old, p_old = np.asarray(full.old_logprobs), np.asarray(part.old_logprobs)
    rows = np.asarray(batch.valid)[: batch.num_rows]
    mask = np.asarray(batch.response_mask)
    assert np.all(f_old[stored & rows][mask[stored & rows]] < 0)   # they had scores to skip
    assert np.all(p_old[stored] == 0)
    np.testing.assert_allclose(p_old[~stored], f_old[~stored], rtol=1e-6, atol=1e-7)
    f_ref, p_ref = np.asarray(full.ref_logprobs), np.asarray(part.ref_logprobs)
    if kl_coef:
        np.testing.assert_allclose(p_ref, f_ref, rtol=1e-6, atol=1e-7)
        assert np.all(p_ref[stored][mask[stored]] < 0)
    else:
        assert np.all(p_ref == 0) and np.all(f_ref == 0)


def test_a_restored_pool_with_impossible_contents_is_refused(setup):
    cfg = train_config(replay=ON)
    tr = Trainer(TINY, cfg)
    tr.replay.absorb(_rows(4), np.array([1.0, -1.0, 0.5, 2.0] + [0] * 4, np.float32),
                     np.array([0.5, 1.5, 0.2, 1.0] + [0] * 4, np.float32),
                     np.zeros(8, np.float32), 0, cfg.replay)
    host = tr.host_state()
    again = Trainer(TINY, cfg)
    again.set_host_state(host)   # as saved: accepted
    assert again.replay.rows == 4

    def tampered(field, fn, **meta):
        arrays = dict(host["host_arrays"])
        arrays[f"replay/{field}"] = fn(np.array(arrays[f"replay/{field}"]))
        return {**host, "host_arrays": arrays, "replay": {**host["replay"], **meta}}

    cases = [(tampered("advantage", lambda a: np.where(np.arange(a.size) == 1, np.nan, a)),
              "advantage is not finite numbers"),
             (tampered("response_ids", lambda a: a - 10 ** 6), "negative token ids"),
             (tampered("prompt_ids", lambda a: a.astype(np.float32)), "prompt_ids is float32"),
             (tampered("weight", lambda a: -a), "a stored weight <= 0"),
             (tampered("serial", lambda a: a, serial=1.5), "serial 1.5 is not an integer"),
             (tampered("response_ids", lambda a: a + TINY.vocab_size),
              f"beyond the model's {TINY.vocab_size} tokens"),
             (tampered("iteration", lambda a: a + 5), "rows of iterations 5..5 in a checkpoint "
                                                      "of iteration 1"),
             (tampered("iteration", lambda a: a - 1), "rows of iterations -1..-1")]
    for state, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            Trainer(TINY, cfg).set_host_state(state, step=1)
    again.set_host_state(host, step=1)   # absorbed in iteration 0, saved after it: accepted
    small = train_config(replay=dataclasses.replace(ON, capacity=2))
    with pytest.raises(ValueError, match="4 rows for a capacity of 2"):
        Trainer(TINY, small).set_host_state(host)
