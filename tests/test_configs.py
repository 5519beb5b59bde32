"""Config files load, validate and apply variants as documented."""
import importlib
import os

import pytest

from configs import base
from tests.fixtures.paths import REPO_ROOT


@pytest.mark.parametrize("name", ["sciworld", "alfworld", "webshop"])
def test_each_config_loads_with_paper_values(name):
    c = importlib.import_module(f"configs.{name}").get_config()
    assert c.algo == "strata"
    # docs/method.md §5.8 pinned hyperparameters
    assert (c.rollout.num_strategies, c.rollout.episodes_per_strategy, c.rollout.oversample) == (4, 8, 8)
    assert c.adv.top_delta == 0.5 and c.loss.strategy_coef == 0.5 and c.adv.judge_kappa == 0.1
    assert c.optim.lr == 1e-6 and c.optim.weight_decay == 0.01 and c.optim.grad_clip == 1.0
    assert c.loss.kl_coef == 0.01 and c.loss.entropy_coef == 0.001 and c.loss.clip_eps_low == 0.2
    assert c.rollout.tasks_per_batch == 16 and c.iterations == 150
    expected = {"sciworld": (30, 4096, "mean_norm"), "alfworld": (50, 2048, "mean_std_norm"),
                "webshop": (15, 4096, "mean_norm")}[name]
    assert (c.env.max_steps, c.env.max_prompt_tokens, c.adv.gigpo_step_norm) == expected


def test_tiny_variant_matches_issue_8():
    from configs import sciworld
    c = sciworld.get_config("tiny")
    r = c.rollout
    assert (r.oversample, r.num_strategies, r.episodes_per_strategy) == (2, 2, 2)
    assert c.env.max_steps == 4 and len(c.env.tasks) == 2 and c.iterations == 3
    assert r.max_action_tokens == r.max_strategy_tokens == r.max_judge_tokens == 32
    assert c.model.tokenizer == "offline" and c.model.path == ""
    # the tiny job starts from behaviour cloning on its own tasks' gold paths
    assert c.model.warm_start == "sft" and c.sft.steps == 250


def test_variants_compose_in_order():
    from configs import sciworld
    c = sciworld.get_config("tiny,gigpo,matched,optim.lr=3e-4,vanilla,mean")
    assert c.algo == "gigpo"
    assert c.rollout.group_size == 2 * 2  # N*M of the tiny setting
    assert c.optim.lr == pytest.approx(3e-4)
    assert not c.rollout.diverse_sampling and not c.rollout.self_judgment
    assert c.adv.top_delta == 1.0


def test_unknown_variant_and_field_are_clear_errors():
    from configs import sciworld
    with pytest.raises(ValueError, match="unknown config variant 'bogus'"):
        sciworld.get_config("bogus")
    with pytest.raises(ValueError, match="unknown config field 'optim.nope'"):
        sciworld.get_config("optim.nope=1")
    with pytest.raises(ValueError, match="no `tiny` variant"):
        importlib.import_module("configs.alfworld").get_config("tiny")


def test_typed_key_value_parsing():
    c = base.apply_variant(base.get_base_config(),
                           "rollout.self_judgment=false,env.max_steps=7,env.tasks=a+b,adv.std_ddof=1")
    assert c.rollout.self_judgment is False
    assert c.env.max_steps == 7 and isinstance(c.env.max_steps, int)
    assert c.env.tasks == ("a", "b")
    assert c.adv.std_ddof == 1 and isinstance(c.adv.std_ddof, int)


def test_env_kwargs_pass_only_what_the_env_takes():
    from configs import builtin
    from strata_jax.experiment import env_kwargs
    c = builtin.get_config("tiny")
    assert env_kwargs(c) == {"max_steps": 8, "code_digits": 1, "code_attempts": 0}
    c.env.code_attempts = 1
    assert env_kwargs(c) == {"max_steps": 8, "code_digits": 1, "code_attempts": 1}
    # grid_nav's constructor has no code_digits: the memory_key field stays out of its kwargs.
    c.env.name = "grid_nav"
    assert env_kwargs(c) == {"max_steps": 8}


def test_unknown_split_is_a_config_error_naming_the_splits():
    """``eval.py --split=tset`` must be one line, not a KeyError traceback."""
    from configs import sciworld
    from strata_jax import experiment as ex
    c = sciworld.get_config("tiny")
    with pytest.raises(ex.ConfigError, match="unknown split 'tset'; use 'train', 'dev' or 'test'"):
        ex.task_list(c, "tset")


def test_reading_a_config_imports_no_jax():
    """A config typo is reported before the heavy imports: reading an experiment file (variants
    included) loads neither jax nor flax nor optax."""
    import subprocess
    import sys
    root = REPO_ROOT
    code = ("import sys; from configs import sciworld; sciworld.get_config('tiny,grpo,matched'); "
            "print([m for m in ('jax', 'flax', 'optax') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_remat_policy_names_are_written_once():
    """The policies live in one table, strata_jax.config.REMAT_CHECKPOINT_POLICIES (name ->
    jax.checkpoint policy): the override parser, TrainConfig and the model read it there."""
    import jax

    from strata_jax import config
    from strata_jax.models import layers, qwen2
    from strata_jax.training import config as train_config
    assert train_config.REMAT_POLICIES is config.REMAT_POLICIES is qwen2.REMAT_POLICIES
    assert config.REMAT_POLICIES == ("none", "full", "dots")
    assert layers.checkpoint_policy("full") is jax.checkpoint_policies.nothing_saveable
    assert (layers.checkpoint_policy("dots")
            is jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    assert not hasattr(layers, "REMAT_POLICIES") and not hasattr(qwen2, "REMAT_CHECKPOINT_POLICIES")


def test_the_pad_id_is_the_tokenizers_endoftext():
    """The pad id is defined once (models/tokenizer.py); configs/base.py, which must not import
    jax, writes it as a literal that this test holds to that definition."""
    from configs.base import get_base_config
    from strata_jax.models.tokenizer import ENDOFTEXT_ID
    from strata_jax.rollout import RolloutConfig
    from strata_jax.training.sft.cloning import make_sft_batch
    import inspect
    assert get_base_config().rollout.pad_token_id == RolloutConfig().pad_token_id == ENDOFTEXT_ID
    assert inspect.signature(make_sft_batch).parameters["pad_id"].default == ENDOFTEXT_ID
