"""The algorithm table is the one place an algorithm is described: it agrees with the estimator
registry, and a throwaway entry (plus its estimator) reaches every consumer with no other edit."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base, sciworld
from strata_jax import distributed
from strata_jax import experiment as ex
from strata_jax.algos import ESTIMATORS, compute_advantages
from strata_jax.algos.table import ALGORITHMS, Algorithm, get_algorithm
from strata_jax.config import ConfigError
from strata_jax.rollout import RolloutConfig
from strata_jax.training import TrainConfig
from tests.fixtures.paths import REPO_ROOT


def test_table_and_estimator_registry_agree():
    # every entry runs a registered estimator, and every registered estimator serves an entry
    assert {a.estimator for a in ALGORITHMS.values()} == set(ESTIMATORS)
    assert tuple(ALGORITHMS) == ("strata", "strata_traj", "grpo", "rloo", "gigpo", "ppo", "dapo",
                               "stapo")
    # the facts the code used to spell as name comparisons (docs/method.md §5-§7)
    assert [n for n, a in ALGORITHMS.items() if a.rollout == "strata"] == ["strata", "strata_traj"]
    assert {n: a.critic for n, a in ALGORITHMS.items() if a.critic != "none"} == \
        {"ppo": "separate", "stapo": "head"}
    assert [n for n, a in ALGORITHMS.items() if a.refill] == ["dapo"]
    assert [n for n, a in ALGORITHMS.items() if a.cumulative_prompts] == ["stapo"]
    assert {n: a.clip_eps_high for n, a in ALGORITHMS.items() if a.clip_eps_high} == \
        {"dapo": 0.28}
    assert get_algorithm("strata").levels == ("action", "strategy")
    assert get_algorithm("grpo").levels == ("action",)
    with pytest.raises(ConfigError, match=r"unknown algo 'reinforce'; use one of \('strata', "):
        get_algorithm("reinforce")
    with pytest.raises(ConfigError, match="rollout must be one of"):
        Algorithm(estimator="grpo", rollout="tree")


def _doubled_grpo(batch, config, step=0):
    """A throwaway estimator: GRPO's advantages times two; its metric sums their |A|."""
    adv, w, m = ESTIMATORS["grpo"](batch, config, step)
    return 2.0 * adv, w, {**m, "throwaway/abs_adv_sum": jnp.sum(jnp.abs(2.0 * adv))}


@pytest.fixture
def throwaway(monkeypatch):
    """Register algorithm "throwaway": one table entry plus its estimator, nothing else."""
    monkeypatch.setitem(ESTIMATORS, "doubled_grpo", _doubled_grpo)
    monkeypatch.setitem(ALGORITHMS, "throwaway", Algorithm(
        estimator="doubled_grpo", rollout="strata", refill=True, cumulative_prompts=True,
        clip_eps_high=0.3))
    return "throwaway"


def test_a_new_entry_reaches_every_config_consumer(throwaway, monkeypatch):
    c = sciworld.get_config(f"tiny,{throwaway}")            # configs/ reads the library's names
    assert c.algo == "throwaway" and c.workdir.endswith("_throwaway")
    ex.validate(c)                                           # a known algo now
    ex.resolve(c)                                            # derived settings from the entry
    assert c.rollout.cumulative_prompts is True and c.loss.clip_eps_high == 0.3
    r = RolloutConfig.from_config(c)                         # rollout mode and refill
    assert (r.mode, r.dapo_refill) == ("strata", True)
    t = TrainConfig.from_config(c)                           # estimator, critic, loss levels
    assert (t.estimator_name, t.critic_kind) == ("doubled_grpo", "none")
    assert t.loss.norm_len == max(c.rollout.max_action_tokens, c.rollout.max_strategy_tokens)
    monkeypatch.setattr(jax, "process_count", lambda: 2)     # refill is single-process only
    with pytest.raises(ValueError, match="algo=throwaway .dynamic-sampling refill. is "
                                         "single-process only"):
        distributed.check_config(c)
    monkeypatch.setitem(ALGORITHMS, "throwaway", Algorithm(estimator="doubled_grpo",
                                                           critic="separate"))
    c = base.apply_variant(base.get_base_config(), "throwaway")
    assert TrainConfig.from_config(c).critic_kind == "separate"
    assert RolloutConfig.from_config(c).mode == "flat"
    ex.resolve(c)                                            # no entry flags: nothing derived
    assert c.rollout.cumulative_prompts is False and c.loss.clip_eps_high == 0.2


def test_the_trainer_runs_the_new_entrys_estimator(throwaway):
    from strata_jax.models import init_params
    from strata_jax.training import Trainer
    from tests.fixtures.trainer import TINY, grpo_records, make_batch, train_config

    params = init_params(TINY, jax.random.PRNGKey(0))
    trainer = Trainer(TINY, train_config(throwaway))
    state = trainer.init_state(params, jax.random.PRNGKey(1))
    batch = make_batch(grpo_records(n_tasks=1, per_task=4, scores=[1.0, 0.0, 0.0, 0.0]))
    _, metrics = trainer.update(state, batch, ref_params=params)
    # GRPO over returns (1, 0, 0, 0): mean .25, ddof-1 std .5 -> A = 1.5, -.5, -.5, -.5;
    # doubled: 3, -1, -1, -1 -> sum |A| = 6 (the update ran the entry's estimator)
    ref, _, _ = compute_advantages("grpo", batch, trainer.cfg.estimator)
    np.testing.assert_allclose(np.asarray(ref)[:4], [1.5, -0.5, -0.5, -0.5], rtol=1e-4)
    assert metrics["throwaway/abs_adv_sum"] == pytest.approx(6.0, rel=1e-4)


def test_configs_read_the_names_without_starting_jax():
    """configs/ imports the table (so the algorithm names live in the library), and loading a
    config still initialises no JAX backend: jax.distributed.initialize must come first."""
    import os
    import subprocess
    import sys
    code = ("from configs import sciworld; from jax._src import xla_bridge as xb; "
            "c = sciworld.get_config('tiny,dapo'); print(c.algo, bool(xb._backends))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["dapo", "False"]
