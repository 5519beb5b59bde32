"""The same numbers unjitted, jitted, and sharded over 8 fake CPU devices (batch axis on `data`).

Guards: Python-side control flow on traced values, position-dependent grouping that breaks when
rows are split across devices, and recompilation-prone static arguments.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from strata_jax.algos import (
    EstimatorConfig,
    LossConfig,
    compute_advantages,
    loss_mask,
    loss_normalizers,
    make_sample_batch,
    ppo_loss,
)
from strata_jax.algos.batch import KIND_ACTION, KIND_STRATEGY


def _records():
    """16 rows: 2 tasks x 2 strategies, multi-step episodes, anchors, judge / invalid flags."""
    rng = np.random.default_rng(1)
    recs = []
    traj = 0
    for task in range(2):
        for sid in range(2):
            recs.append(dict(prompt_ids=[1, 2], response_ids=[5, 6, 7], task_id=task, strategy_id=sid,
                             trajectory_id=-1, kind=KIND_STRATEGY, strategy_len=300 * sid))
            for ep in range(2):
                ret = float(rng.choice([0.0, 0.5, 1.0]))
                for step in range(2 if (task + ep) % 2 else 1):
                    recs.append(dict(
                        prompt_ids=[1, 2, 3], response_ids=list(range(1, 3 + step + ep)),
                        task_id=task, strategy_id=sid, trajectory_id=traj, step_index=step,
                        kind=KIND_ACTION, score=ret, step_reward=ret if step else 0.0,
                        anchor_id=step, judge_flag=bool(step), invalid=bool(ep and not step),
                        values=float(rng.uniform()), value_std=float(rng.uniform(0, 0.2))))
                traj += 1
    rng.shuffle(recs)
    return recs


@pytest.fixture(scope="module")
def batch():
    b = make_sample_batch(_records())
    assert b.num_rows == 16
    return b


@pytest.fixture(scope="module")
def mesh():
    assert len(jax.devices()) == 8, "tests/conftest.py should give 8 fake CPU devices"
    return Mesh(np.array(jax.devices()), ("data",))


CASES = [("grpo", {}), ("rloo", {}), ("gigpo", {}), ("gae", {}), ("strata", {}),
         ("strata", dict(judge_mode="reward")), ("stapo", dict(stapo_eta_quantile=0.3)),
         ("grpo", dict(stapo_weighting=True))]


@pytest.mark.parametrize("name,cfg", CASES, ids=[f"{n}-{'-'.join(c) or 'default'}" for n, c in CASES])
def test_estimator_same_numbers_unjitted_jitted_and_sharded(batch, mesh, name, cfg):
    config = EstimatorConfig(**cfg)
    step = np.int32(3)
    ref = compute_advantages(name, batch, config, step)
    fn = lambda b, s: compute_advantages(name, b, config, s)
    jitted = jax.jit(fn)(batch, step)
    row = NamedSharding(mesh, P("data"))
    rep = NamedSharding(mesh, P())
    in_sh = (jax.tree.map(lambda x: NamedSharding(mesh, P("data", *([None] * (x.ndim - 1)))), batch), rep)
    sharded_batch = jax.device_put(batch, in_sh[0])
    sharded = jax.jit(fn, in_shardings=in_sh, out_shardings=(row, row, rep))(sharded_batch, step)
    assert sharded[0].sharding.spec == P("data")
    for got in (jitted, sharded):
        np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[1], ref[1], rtol=1e-5, atol=1e-6)
        for k in ref[2]:
            np.testing.assert_allclose(got[2][k], ref[2][k], rtol=1e-5, atol=1e-6, err_msg=k)
    # not vacuous: some advantages are non-zero on valid rows
    assert np.abs(np.asarray(ref[0])).sum() > 0.1


def test_loss_and_grad_same_numbers_unjitted_jitted_and_sharded(batch, mesh):
    adv, w, _ = compute_advantages("strata", batch, EstimatorConfig(), 0)
    mask = loss_mask(batch)
    rng = np.random.default_rng(2)
    shape = mask.shape
    lp = jnp.asarray(rng.normal(size=shape).astype(np.float32) * 0.3 - 1.0)
    old = lp + rng.normal(size=shape).astype(np.float32) * 0.3
    ref_lp = lp + rng.normal(size=shape).astype(np.float32) * 0.3
    ent = jnp.asarray(rng.uniform(size=shape).astype(np.float32))
    norm = loss_normalizers(mask, batch.kind)
    cfg = LossConfig(clip_eps_high=0.28)

    def f(lp, old, adv, w, mask, kind, ref_lp, ent, norm):
        return jax.value_and_grad(
            lambda x: ppo_loss(x, old, adv, mask, kind, config=cfg, sample_weights=w,
                               ref_logprobs=ref_lp, entropy=ent, normalizers=norm)[0])(lp)

    args = (lp, old, adv, w, mask, batch.kind, ref_lp, ent, norm)
    ref_v, ref_g = f(*args)
    assert np.isfinite(float(ref_v)) and abs(float(ref_v)) > 1e-4
    row2 = NamedSharding(mesh, P("data", None))
    row = NamedSharding(mesh, P("data"))
    rep = NamedSharding(mesh, P())
    in_sh = (row2, row2, row, row, row2, row, row2, row2, rep)
    for got_v, got_g in (jax.jit(f)(*args),
                         jax.jit(f, in_shardings=in_sh, out_shardings=(rep, row2))(*args)):
        assert float(got_v) == pytest.approx(float(ref_v), rel=1e-5)
        np.testing.assert_allclose(got_g, ref_g, rtol=1e-5, atol=1e-7)
