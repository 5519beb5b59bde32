"""PPO-clip / KL / entropy / aggregation / two-level objective / value loss against hand numbers.

Each test is named after the pitfall it guards (docs/method.md §8).
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strata_jax.algos import (
    LossConfig,
    aggregate,
    kl_penalty,
    loss_mask,
    loss_normalizers,
    make_sample_batch,
    policy_loss_per_token,
    ppo_loss,
    value_loss,
)
from strata_jax.algos.batch import KIND_ACTION, KIND_STRATEGY

NO_REG = dict(kl_coef=0.0, entropy_coef=0.0)


def _one_token(ratio, adv, **cfg):
    lp = np.array([[math.log(ratio)]], np.float32)
    loss, clipped, dual, _ = policy_loss_per_token(lp, np.zeros_like(lp), np.array([adv], np.float32),
                                                   np.ones((1, 1), bool), LossConfig(**cfg))
    return float(loss[0, 0]), bool(clipped[0, 0]), bool(dual[0, 0])


def test_dual_clip_on_a_negative_advantage():
    # A = -1, r = 5: max(5, 1.2) = 5 is capped by the dual clip at c * |A| = 3.
    loss, _, dual = _one_token(5.0, -1.0)
    assert loss == pytest.approx(3.0) and dual
    # A = -1, r = 2: 2 < 3, no dual clip.  Off (c <= 1): 5.
    assert _one_token(2.0, -1.0)[0] == pytest.approx(2.0)
    assert _one_token(5.0, -1.0, dual_clip=0.0)[0] == pytest.approx(5.0)
    # A = +1, r = 5: the ordinary clip, -1.2; the dual clip never touches positive advantages.
    loss, clipped, dual = _one_token(5.0, 1.0)
    assert loss == pytest.approx(-1.2) and clipped and not dual


def test_clip_higher_asymmetric_bounds():
    assert _one_token(1.5, 1.0, clip_eps_high=0.28)[0] == pytest.approx(-1.28)
    loss, clipped, _ = _one_token(0.5, -1.0, clip_eps_high=0.28)   # low side stays .8
    assert loss == pytest.approx(0.8) and clipped
    assert _one_token(1.1, 1.0, clip_eps_high=0.28)[0] == pytest.approx(-1.1)


def test_kl_sign_and_clamp():
    lp = np.log(np.array([[0.5]], np.float32))
    ref = np.log(np.array([[0.25]], np.float32))
    assert float(kl_penalty(lp, ref, "k1")[0, 0]) == pytest.approx(math.log(2), rel=1e-6)   # pi > ref: +
    assert float(kl_penalty(lp, ref, "k2")[0, 0]) == pytest.approx(0.5 * math.log(2) ** 2, rel=1e-6)
    assert float(kl_penalty(lp, ref, "k3")[0, 0]) == pytest.approx(0.5 + math.log(2) - 1, rel=1e-5)
    # clamp: log-ratio +-30 -> both far above 10 -> 10, with finite gradients
    lp2 = np.array([[0.0, 0.0]], np.float32)
    ref2 = np.array([[30.0, -30.0]], np.float32)
    np.testing.assert_allclose(kl_penalty(lp2, ref2, "k3"), [[10.0, 10.0]])
    g = jax.grad(lambda x: jnp.sum(kl_penalty(x, ref2, "k3")))(jnp.asarray(lp2))
    assert np.all(np.isfinite(g))
    with pytest.raises(ValueError, match="k1, k2 or k3"):
        kl_penalty(lp, ref, "k4")


def _two_rows():
    # row 0: 2 tokens, A = +1; row 1: 8 tokens, A = -1; ratio 1 -> per-token pg = -A.
    mask = np.zeros((2, 8), bool)
    mask[0, :2] = True
    mask[1, :] = True
    lp = np.zeros((2, 8), np.float32)
    return lp, np.array([1.0, -1.0], np.float32), mask, np.zeros(2, np.int32)


@pytest.mark.parametrize("mode,want", [
    ("token-mean", (-2 + 8) / 10),                 # .6
    ("seq-mean-token-mean", (-1 + 1) / 2),         # 0
    ("seq-mean-token-sum", (-2 + 8) / 2),          # 3
    ("seq-mean-token-sum-norm", (-2 / 8 + 8 / 8) / 2),  # .375 (norm_len = 8)
])
def test_every_loss_mode_on_a_group_with_lengths_2_and_8(mode, want):
    lp, adv, mask, kind = _two_rows()
    loss, m = ppo_loss(lp, lp, adv, mask, kind,
                       config=LossConfig(agg_mode=mode, norm_len=8, **NO_REG))
    assert float(loss) == pytest.approx(want, abs=1e-6)
    assert float(m["loss/strategy"]) == 0.0


def test_seq_mean_token_sum_norm_with_explicit_norm_len():
    lp, adv, mask, kind = _two_rows()
    loss, _ = ppo_loss(lp, lp, adv, mask, kind,
                       config=LossConfig(agg_mode="seq-mean-token-sum-norm", norm_len=4, **NO_REG))
    assert float(loss) == pytest.approx((-2 / 4 + 8 / 4) / 2)


def test_dr_grpo_divisor_is_a_constant_not_the_padded_width():
    # Rows of lengths 2 and 8, A = +1 / -1, old = new logprobs: Dr.GRPO with norm_len 8 gives
    # (-2/8 + 8/8) / 2 = 0.375 whether the batch is padded to 8, to 16, or widened to 20 by a
    # crashed row (valid = False, so not in the loss). Dividing by the width gave .375 / .1875 /
    # .125.
    # The run's config as train.py builds it: Dr.GRPO, max_action_tokens 8, norm_len unset.
    from configs.base import apply_variant, get_base_config
    from strata_jax.training.config import TrainConfig
    c = apply_variant(get_base_config(), "grpo,loss.agg_mode=seq-mean-token-sum-norm,"
                      "rollout.max_action_tokens=8,loss.kl_coef=0,loss.entropy_coef=0")
    cfg = TrainConfig.from_config(c).loss
    assert cfg.norm_len == 8
    recs = [dict(prompt_ids=[5], response_ids=[1, 2], task_id=0, trajectory_id=0, kind=0),
            dict(prompt_ids=[5], response_ids=list(range(1, 9)), task_id=0, trajectory_id=1,
                 kind=0)]
    crashed = dict(prompt_ids=[5], response_ids=list(range(1, 21)), task_id=1, trajectory_id=0,
                   kind=0, valid=False)
    losses = []
    for rows, buckets in ((recs, (8,)), (recs, (16,)), (recs + [crashed], (20,))):
        b = make_sample_batch(rows, response_buckets=buckets)
        mask = loss_mask(b)
        adv = np.zeros(mask.shape[0], np.float32)
        adv[:2] = [1.0, -1.0]
        lp = np.zeros(mask.shape, np.float32)
        loss, _ = ppo_loss(lp, lp, adv, mask, np.asarray(b.kind), config=cfg)
        losses.append((mask.shape[1], float(loss)))
    assert [w for w, _ in losses] == [8, 16, 20]
    assert [v for _, v in losses] == pytest.approx([0.375] * 3, abs=1e-6)


def test_dr_grpo_needs_a_norm_len_and_the_train_config_fills_it():
    with pytest.raises(ValueError, match="norm_len"):
        LossConfig(agg_mode="seq-mean-token-sum-norm").validate()
    with pytest.raises(ValueError, match="norm_len"):
        LossConfig(norm_len=-1).validate()
    with pytest.raises(ValueError, match="norm_len > 0"):
        aggregate(np.ones((1, 2)), np.ones((1, 2), bool), "seq-mean-token-sum-norm")
    from configs.base import apply_variant, get_base_config
    from strata_jax.training.config import TrainConfig
    c = get_base_config()
    c.loss.agg_mode = "seq-mean-token-sum-norm"
    c.rollout.max_action_tokens, c.rollout.max_strategy_tokens = 300, 200
    assert TrainConfig.from_config(c).loss.norm_len == 300          # unset: the max response length
    c.rollout.max_strategy_tokens = 400
    assert TrainConfig.from_config(c).loss.norm_len == 400          # StraTA trains strategies too
    c.algo = "grpo"
    assert TrainConfig.from_config(c).loss.norm_len == 300
    apply_variant(c, "loss.norm_len=1024")                          # the command-line spelling
    assert TrainConfig.from_config(c).loss.norm_len == 1024
    c.loss.norm_len = -1
    with pytest.raises(ValueError, match="norm_len must be an integer >= 0"):
        TrainConfig.from_config(c)


def test_observation_tokens_and_tokens_after_eos_carry_no_loss():
    # The rollout marks 3 generated tokens (EOS at index 2); garbage after it must not matter.
    b = make_sample_batch([dict(prompt_ids=[7, 8, 9], response_ids=[1, 2, 3, 0, 0],
                                response_mask=[1, 1, 1, 0, 0], task_id=0, trajectory_id=0, kind=0)])
    mask = loss_mask(b)
    assert int(mask.sum()) == 3 and mask.shape == b.response_ids.shape
    lp = np.zeros(mask.shape, np.float32)
    lp[0, :3] = [-0.1, -0.2, -0.3]
    garbage = lp.copy()
    garbage[0, 3:] = [50.0, np.nan, -np.inf, 1e9, 3.0]
    adv = np.ones(mask.shape[0], np.float32)
    cfg = LossConfig()
    f = lambda x: ppo_loss(x, lp * 0 - 0.2, adv, mask, b.kind, config=cfg, ref_logprobs=lp * 0 - 0.5,
                           entropy=jnp.ones_like(x))[0]
    assert float(f(lp)) == pytest.approx(float(f(garbage)))
    g = jax.grad(f)(jnp.asarray(garbage))
    assert np.all(np.asarray(g)[0, 3:] == 0.0) and np.all(np.isfinite(g))
    # padding rows (valid = False) are out of the mask too
    assert not np.asarray(mask)[1:].any()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
def test_gradients_finite_when_one_row_is_fully_masked(mode):
    lp, adv, mask, kind = _two_rows()
    mask[0] = False
    lp = lp.copy()
    lp[0] = np.nan
    cfg = LossConfig(agg_mode=mode, seq_level_ratio=(mode == "seq-mean-token-mean"), norm_len=8)
    f = lambda x: ppo_loss(x, jnp.zeros_like(x), adv, mask, kind, config=cfg,
                           ref_logprobs=jnp.zeros_like(x), entropy=jnp.zeros_like(x))[0]
    assert np.isfinite(float(f(lp)))
    g = np.asarray(jax.grad(f)(jnp.asarray(lp)))
    assert np.all(np.isfinite(g)) and np.all(g[0] == 0.0)


def test_a_minibatch_with_no_strategy_tokens_gives_strategy_loss_0_not_nan():
    lp, adv, mask, kind = _two_rows()
    norm = loss_normalizers(mask, kind)
    assert float(norm["strategy_tokens"]) == 0.0
    loss, m = ppo_loss(lp, lp, adv, mask, kind, config=LossConfig(**NO_REG), normalizers=norm)
    assert float(m["loss/strategy"]) == 0.0 and float(loss) == pytest.approx(0.6)
    g = jax.grad(lambda x: ppo_loss(x, lp, adv, mask, kind, config=LossConfig(), normalizers=norm)[0])(lp)
    assert np.all(np.isfinite(g))


def test_two_level_objective_separate_token_means():
    # action rows: 2 tokens A=+1 and 8 tokens A=-1 -> L_act = .6 (token mean over 10).
    # strategy row: 4 tokens, A = +2 -> L_strat = -2 (its own token mean). L = .6 + .5 * -2 = -.4.
    # One mixed token mean would give (-2 + 8 - 8) / 14 instead.
    lp, adv, mask, kind = _two_rows()
    mask = np.concatenate([mask, np.zeros((1, 8), bool)])
    mask[2, :4] = True
    lp = np.zeros((3, 8), np.float32)
    adv = np.array([1.0, -1.0, 2.0], np.float32)
    kind = np.array([KIND_ACTION, KIND_ACTION, KIND_STRATEGY], np.int32)
    loss, m = ppo_loss(lp, lp, adv, mask, kind, config=LossConfig(**NO_REG))
    assert float(m["loss/action"]) == pytest.approx(0.6)
    assert float(m["loss/strategy"]) == pytest.approx(-2.0)
    assert float(loss) == pytest.approx(-0.4)


def test_micro_batches_accumulate_exactly_with_whole_minibatch_counts():
    rng = np.random.default_rng(0)
    R, T = 8, 6
    lp = rng.normal(size=(R, T)).astype(np.float32) * 0.1 - 1
    old = lp + rng.normal(size=(R, T)).astype(np.float32) * 0.2
    ref = lp + rng.normal(size=(R, T)).astype(np.float32) * 0.2
    ent = rng.uniform(size=(R, T)).astype(np.float32)
    adv = rng.normal(size=R).astype(np.float32)
    lens = np.array([1, 6, 3, 0, 2, 5, 6, 4])
    mask = np.arange(T)[None] < lens[:, None]
    kind = np.array([1, 0, 0, 0, 1, 0, 0, 0], np.int32)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        cfg = LossConfig(agg_mode=mode, norm_len=T)
        norm = loss_normalizers(mask, kind)
        full, _ = ppo_loss(lp, old, adv, mask, kind, config=cfg, ref_logprobs=ref, entropy=ent)
        parts = sum(float(ppo_loss(lp[s], old[s], adv[s], mask[s], kind[s], config=cfg,
                                   ref_logprobs=ref[s], entropy=ent[s], normalizers=norm)[0])
                    for s in (slice(0, 3), slice(3, 5), slice(5, 8)))
        assert parts == pytest.approx(float(full), rel=1e-5), mode


def test_sequence_level_ratio_is_exp_of_mean_log_ratio():
    # token log-ratios log(1.5), log(1/1.5)... mean 0 -> ratio 1 for every token -> pg = -A
    lp = np.array([[math.log(1.5), -math.log(1.5), 0.0]], np.float32)
    mask = np.array([[1, 1, 0]], bool)
    loss, _, _, ratio = policy_loss_per_token(lp, np.zeros_like(lp), np.array([2.0], np.float32), mask,
                                              LossConfig(seq_level_ratio=True))
    np.testing.assert_allclose(np.asarray(ratio)[0, :2], [1.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(loss)[0], [-2.0, -2.0, 0.0], rtol=1e-6)


def test_stapo_sample_weights_scale_only_the_clip_term_and_zero_weights_give_zero():
    lp, adv, mask, kind = _two_rows()
    w = np.array([3.0, 0.0], np.float32)
    loss, _ = ppo_loss(lp, lp, adv, mask, kind, config=LossConfig(**NO_REG), sample_weights=w)
    assert float(loss) == pytest.approx(3 * -2 / 10)   # denominator stays the token count
    loss, _ = ppo_loss(lp, lp, adv, mask, kind, config=LossConfig(**NO_REG),
                       sample_weights=np.zeros(2, np.float32))
    assert float(loss) == 0.0


def test_kl_and_entropy_terms_enter_with_their_signs():
    # one token, ratio 1, A = 0: loss = .01 * k3 - .001 * H; k3(log .5 vs log .25) = log 2 - .5
    lp = np.log(np.array([[0.5]], np.float32))
    ref = np.log(np.array([[0.25]], np.float32))
    loss, m = ppo_loss(lp, lp, np.zeros(1, np.float32), np.ones((1, 1), bool), np.zeros(1, np.int32),
                       config=LossConfig(), ref_logprobs=ref, entropy=np.full((1, 1), 2.0, np.float32))
    assert float(loss) == pytest.approx(0.01 * (math.log(2) - 0.5) - 0.001 * 2.0, rel=1e-5)
    assert float(m["entropy"]) == pytest.approx(2.0)


def test_clip_fraction_metric():
    lp = np.log(np.array([[1.5, 1.0, 0.5, 1.1]], np.float32))
    _, m = ppo_loss(lp, np.zeros_like(lp), np.ones(1, np.float32), np.ones((1, 4), bool),
                    np.zeros(1, np.int32), config=LossConfig(**NO_REG))
    assert float(m["clip_frac"]) == pytest.approx(1 / 4)   # only r = 1.5 for A > 0


def test_stapo_weighted_value_loss():
    # V = .5, 1.0; targets 1, 1; old V = .5, .0; clip .5: row 1 clipped to .5 -> error .25
    # per-sample max: .25, .25; weights 2, 0 -> .5 * (2 * .25 + 0) / 2 = .125
    v = np.array([0.5, 1.0, 9.0], np.float32)
    loss, m = value_loss(v, np.array([0.5, 0.0, 0.0], np.float32), np.ones(3, np.float32),
                         np.array([1, 1, 0], bool), config=LossConfig(),
                         sample_weights=np.array([2.0, 0.0, 5.0], np.float32))
    assert float(loss) == pytest.approx(0.125)
    assert float(m["vf_clip_frac"]) == pytest.approx(0.5)
    loss, _ = value_loss(v, v, np.ones(3, np.float32), np.array([1, 1, 0], bool),
                         config=LossConfig(value_clip=0.0))
    assert float(loss) == pytest.approx(0.5 * 0.25 / 2)
    loss, _ = value_loss(v, v, v, np.zeros(3, bool), config=LossConfig())
    assert float(loss) == 0.0


def test_aggregate_rejects_unknown_mode():
    with pytest.raises(ValueError, match="agg_mode"):
        aggregate(np.zeros((1, 1)), np.ones((1, 1), bool), "sum")
    with pytest.raises(ValueError, match="agg_mode"):
        LossConfig(agg_mode="mean").validate()
