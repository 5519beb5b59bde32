"""One home per default: configs/base.py holds every value the library reads, each option
dataclass field has exactly one source key there, the dataclass defaults equal those values,
and a key nothing reads (or a missing one) is a ConfigError naming the closest valid key."""
from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest

from configs import base
from strata_jax import experiment as ex
from strata_jax.algos import EstimatorConfig, LossConfig
from strata_jax.config import ConfigError, get_dotted, set_override
from strata_jax.models.lora import LoraConfig
from strata_jax.rollout import RolloutConfig
from strata_jax.training import TrainConfig
from strata_jax.training.replay import ReplayConfig
from strata_jax.training.sft import SFTConfig

OPTION_CLASSES = (LossConfig, EstimatorConfig, LoraConfig, SFTConfig, TrainConfig, RolloutConfig,
                  ReplayConfig)


from strata_jax.validation import dotted_leaves  # noqa: E402  (the {dotted field: value} walk)


@pytest.mark.parametrize("cls", OPTION_CLASSES, ids=lambda c: c.__name__)
def test_every_field_has_one_source_and_its_default_is_the_base_value(cls):
    """Field by field: a source key in configs/base.py (or a documented derivation), and the
    dataclass default equal to the value there (after the field's declared conversion)."""
    c = base.get_base_config()
    sources = cls.config_sources()
    derived = set(getattr(cls, "DERIVED", ()))
    fields = [f.name for f in dataclasses.fields(cls)]
    assert not set(sources) & derived
    assert sorted(set(sources) | derived) == sorted(fields)       # every field, exactly once
    default = cls()
    subsections = getattr(cls, "SUBSECTIONS", {})
    convert = getattr(cls, "CONVERT", {})
    for name, key in sources.items():
        if name in subsections:                  # loss / adv / lora: their own class's check
            assert key == subsections[name].SECTION
            assert isinstance(getattr(default, name), subsections[name])
            continue
        value = get_dotted(c, key)
        value = convert[name](value) if name in convert else value
        assert getattr(default, name) == value, (cls.__name__, name, key)
        assert type(getattr(default, name)) is type(value) or value is None, (name, key)


def test_from_config_of_base_is_the_default_instance_but_for_derived_fields():
    c = base.get_base_config()
    assert LossConfig.from_config(c.loss) == LossConfig()
    assert EstimatorConfig.from_config(c.adv) == EstimatorConfig()
    assert LoraConfig.from_config(c) == LoraConfig()
    assert ReplayConfig.from_config(c.replay) == ReplayConfig()
    assert SFTConfig.from_config(c) == SFTConfig()
    assert RolloutConfig.from_config(c) == RolloutConfig()        # algo strata: mode "strata"
    t = TrainConfig.from_config(c)
    # loss.norm_len 0 = unset -> the longest response StraTA can train: max(512, 512) tokens
    assert t.loss.norm_len == 512
    assert t == dataclasses.replace(TrainConfig(), loss=LossConfig(norm_len=512))


def test_previously_disagreeing_defaults_have_one_value():
    c = base.get_base_config()
    assert LoraConfig().alpha == c.lora.alpha == 64.0
    assert LoraConfig().lr == c.lora.lr == 3e-6
    assert TrainConfig().compute_dtype == c.train.compute_dtype == "bfloat16"
    assert TrainConfig().remat == "dots" and c.model.remat is True   # True = the "dots" policy
    assert SFTConfig().cache_dir == c.sft.cache_dir == "runs/warm_start"


def test_base_holds_exactly_the_keys_the_library_reads():
    required, optional = ex.config_keys()
    have = set(dotted_leaves(base.get_base_config().to_dict()))
    assert required <= have, sorted(required - have)
    assert have - required <= optional, sorted(have - required - optional)
    assert have - required == {"mesh.data", "mesh.fsdp", "mesh.tensor"}   # optional, all set
    assert len(required) > 130


def test_every_source_key_is_settable_from_the_command_line():
    """Each dataclass field is reachable from `--config.<key>=<text>` (the parser of both
    override forms), and the dataclass sees the new value."""
    c = base.get_base_config()
    set_override(c, "train.adam_eps", "1e-3")
    set_override(c, "train.value_head_init_std", "0.5")
    set_override(c, "loss.kl_clamp", "5")
    set_override(c, "adv.stapo_w_pos", "advantage")
    set_override(c, "rollout.row_buckets", "16+32")
    set_override(c, "rollout.pad_token_id", "0")
    t, r = TrainConfig.from_config(c), RolloutConfig.from_config(c)
    assert (t.adam_eps, t.value_head_init_std, t.loss.kl_clamp, t.estimator.stapo_w_pos) == \
        (1e-3, 0.5, 5.0, "advantage")
    assert (r.row_buckets, r.pad_token_id) == ((16, 32), 0)
    set_override(c, "rollout.row_buckets", "none")
    assert RolloutConfig.from_config(c).row_buckets is None


@pytest.mark.parametrize("name,variant", [("sciworld", None), ("sciworld", "tiny"),
                                          ("alfworld", None), ("webshop", None),
                                          ("builtin", None), ("builtin", "tiny")])
def test_every_experiment_file_passes_the_key_check(name, variant):
    c = importlib.import_module(f"configs.{name}").get_config(variant)
    ex.check_keys(c)


def test_an_unknown_key_is_refused_naming_the_nearest():
    c = base.get_base_config()
    c.loss.kl_coeff = 0.1          # an experiment file's typo: ConfigDict accepts a new key
    with pytest.raises(ConfigError, match=r"unknown config field 'loss.kl_coeff' \(did you mean "
                                          r"'loss.kl_coef'\?\)"):
        ex.validate(c)
    with pytest.raises(ConfigError, match=r"'loss.kl_coeff' \(did you mean 'kl_coef'\?\)"):
        TrainConfig.from_config(c)   # the dataclass itself refuses it too
    c = base.get_base_config()
    c.train.lr = 1e-5              # right name, wrong section: the message points at its home
    with pytest.raises(ConfigError, match=r"'train.lr' \(did you mean 'lora.lr' or 'optim.lr' "
                                          r"or 'sft.lr'\?\)"):
        ex.validate(c)
    c = base.get_base_config()
    c.rollout.oversampel = 4       # a section shared by RolloutConfig and the assembly
    with pytest.raises(ConfigError, match=r"'rollout.oversampel' \(did you mean "
                                          r"'rollout.oversample'\?\)"):
        ex.validate(c)


def test_a_retired_field_is_ignored_with_a_warning(caplog):
    """The command lines of earlier runs still run: a retired field's override is dropped with
    a warning saying why; an unknown one is still refused."""
    c = base.get_base_config()
    before = c.to_dict()
    with caplog.at_level("WARNING", logger="strata_jax.config"):
        set_override(c, "train.pack_prefixes", "true")
        set_override(c, "train.group_by_length", "false")
    assert c.to_dict() == before
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "ignoring --config.train.pack_prefixes=true", "ignoring --config.train.group_by_length=false"]
    assert all("retired" in r.getMessage() for r in caplog.records)
    ex.validate(c)
    from configs import builtin   # the colon form of an earlier study's command line
    assert "pack_prefixes" not in builtin.get_config("tiny,train.pack_prefixes=true").train
    with pytest.raises(ConfigError, match="unknown config field 'train.pack_prefix'"):
        set_override(c, "train.pack_prefix", "true")


def test_the_split_micro_batch_size_is_refused_naming_the_new_fields():
    """optim.micro_batch_size meant rows on the per-row path and a token budget on the packed
    one; it is split by unit, and every way of setting the old name says which to set."""
    want = r"^optim.micro_batch_size was split by unit: set optim.micro_batch_rows .* and " \
           r"optim.micro_batch_tokens \(the packed update's token budget"
    c = base.get_base_config()
    with pytest.raises(ConfigError, match=want):
        set_override(c, "optim.micro_batch_size", "4")           # --config.optim.<old>=4
    from configs import builtin
    with pytest.raises(ConfigError, match=want):
        builtin.get_config("tiny,optim.micro_batch_size=4")       # the colon form
    c.optim.micro_batch_size = 4                                  # an experiment file's line
    with pytest.raises(ConfigError, match=want):
        ex.validate(c)
    with pytest.raises(ConfigError, match=want):
        TrainConfig.from_config(c)
    c = base.get_base_config()
    assert (c.optim.micro_batch_rows, c.optim.micro_batch_tokens) == (8, 0)
    cfg = TrainConfig.from_config(c)
    assert (cfg.micro_batch_rows, cfg.micro_batch_tokens) == (8, 0)


def test_a_missing_key_is_refused_not_defaulted():
    c = base.get_base_config()
    del c.lora["lr"]
    with pytest.raises(ConfigError, match="the config lacks 'lora.lr'"):
        LoraConfig.from_config(c)
    with pytest.raises(ConfigError, match="the config lacks lora.lr"):
        ex.validate(c)
    c = base.get_base_config()
    del c.train["compute_dtype"]
    with pytest.raises(ConfigError, match="the config lacks 'train.compute_dtype'"):
        TrainConfig.from_config(c)


def test_warm_up_starts_at_learning_rate_zero():
    # docs/method.md §9.3: optax's linear warm-up from 0, so the first optimiser step (RL
    # update and behaviour cloning alike) runs at rate 0 and moves no parameter.
    import jax.numpy as jnp
    import optax
    from strata_jax.training.state import lr_schedule, make_optimizer
    cfg = dataclasses.replace(TrainConfig(), warmup_steps=4, lr_schedule="constant")
    sched = lr_schedule(1e-3, cfg)
    assert [float(sched(i)) for i in range(6)] == pytest.approx(
        [0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    opt = make_optimizer(dataclasses.replace(cfg, lr=1e-3))
    params = {"w": jnp.ones((3,), jnp.float32)}
    updates, _ = opt.update({"w": jnp.full((3,), 0.5)}, opt.init(params), params)
    assert np.asarray(optax.apply_updates(params, updates)["w"]).tolist() == [1.0, 1.0, 1.0]
