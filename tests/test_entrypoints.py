"""Fast checks of the entry-point plumbing: config validation errors, task lists, eval summary."""
import dataclasses
import os

import jax
import pytest

from configs import sciworld
from envs_bridge import Task
from strata_jax import experiment as ex
from strata_jax.evaluation import eval_rollout_config, spread_over_families, summarize
from strata_jax.models import PRESETS


def test_unknown_algo_is_a_clear_error():
    c = sciworld.get_config("tiny")
    c.algo = "reinforce"
    with pytest.raises(ex.ConfigError, match="unknown algo 'reinforce'"):
        ex.validate(c)


def test_missing_model_is_a_clear_error():
    c = sciworld.get_config()
    c.model.path, c.model.preset = "", ""
    with pytest.raises(ex.ConfigError, match="set --config.model.path"):
        ex.validate(c)


def test_hub_id_offline_says_to_set_the_model_path(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    c = sciworld.get_config()  # the paper setting names a hub id
    # a ConfigError (one line from the entry points) that names the flag to set
    with pytest.raises(ex.ConfigError, match=r"^--config.model.path=Qwen/Qwen2.5-1.5B-Instruct: "
                       r"could not download .* set the model path to its local directory"):
        ex.build_model(c, tokenizer=None, mesh=None)


def test_kv_cache_capacity_error_names_the_fields():
    c = sciworld.get_config("tiny")
    cfg = dataclasses.replace(PRESETS["tiny"], max_position_embeddings=512)
    with pytest.raises(ex.ConfigError, match="env.max_prompt_tokens"):
        ex.max_cache_len(c, cfg)
    c.env.max_prompt_tokens = 256
    assert ex.max_cache_len(c, cfg) == 256 + 32


def test_task_filter_and_unknown_task():
    c = sciworld.get_config("tiny")
    tasks = ex.task_list(c, "train")
    assert {t.task_id for t in tasks} == set(sciworld.TINY_TASKS)
    # the package's train split sizes (docs/method.md §11.1): 150 + 62
    assert len(tasks) == 150 + 62
    c.env.tasks = ("no-such-task",)
    with pytest.raises(ex.ConfigError, match="match no scienceworld task"):
        ex.task_list(c, "train")


def test_stapo_resolves_to_cumulative_prompts_and_dapo_to_clip_higher():
    c = ex.resolve(sciworld.get_config("tiny,stapo"))
    assert c.rollout.cumulative_prompts is True
    c = ex.resolve(sciworld.get_config("tiny,dapo"))
    assert c.loss.clip_eps_high == 0.28 and c.loss.clip_eps_low == 0.2


def test_eval_protocol_is_one_strategy_no_fps_no_judge():
    rc = eval_rollout_config(sciworld.get_config())
    assert (rc.num_strategies, rc.episodes_per_strategy, rc.oversample) == (1, 1, 1)
    assert not rc.diverse_sampling and not rc.self_judgment and rc.temperature == 0.4


def test_spread_over_families_round_robin():
    ts = [Task("x", f, v) for f in ("a", "b") for v in range(3)]
    got = [(t.task_id, t.variation) for t in spread_over_families(ts, 4)]
    assert got == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]


@dataclasses.dataclass
class _Tr:
    spec: object
    success: bool
    episode_return: float
    crashed: bool = False


@dataclasses.dataclass
class _Spec:
    task: Task


def test_summarize_per_family_scores_in_env_units():
    trs = [_Tr(_Spec(Task("scienceworld", "boil", 0)), True, 1.0),
           _Tr(_Spec(Task("scienceworld", "boil", 1)), False, 0.25),
           _Tr(_Spec(Task("scienceworld", "melt", 0)), True, 1.0, crashed=True)]
    m = summarize(trs, "scienceworld")
    assert m["eval/family/boil/success"] == 0.5
    assert m["eval/family/boil/score"] == pytest.approx(62.5)
    # a crashed episode is a failure with score 0, never a success
    assert m["eval/family/melt/success"] == 0.0 and m["eval/family/melt/score"] == 0.0
    assert m["eval/success"] == pytest.approx(1 / 3) and m["eval/crashed"] == 1.0


def test_sampler_params_cast_follows_config():
    import jax
    import jax.numpy as jnp
    params = {"a": jnp.ones((2, 3), jnp.float32), "b": [jnp.zeros(4, jnp.float32)]}
    paper = sciworld.get_config()
    # fp32 masters for AdamW at lr 1e-6; bf16 for the sampler and the train forward
    assert paper.model.dtype == "float32" and paper.train.compute_dtype == "bfloat16"
    cast = ex.sampler_params(paper, params)
    assert {x.dtype for x in jax.tree.leaves(cast)} == {jnp.dtype(jnp.bfloat16)}
    tiny = sciworld.get_config("tiny")
    assert ex.sampler_params(tiny, params) is params  # already fp32: no copy


def test_validate_rejects_settings_that_defeat_resume_or_are_ambiguous():
    c = sciworld.get_config("tiny")
    c.ckpt.keep = 0
    with pytest.raises(ex.ConfigError, match="ckpt.keep must be >= 1"):
        ex.validate(c)
    c = sciworld.get_config("tiny")
    c.model.path = "/some/checkpoint"  # the tiny variant also sets a preset
    with pytest.raises(ex.ConfigError, match="both model.path"):
        ex.validate(c)
    c = sciworld.get_config("tiny")
    c.model.dtype = "float33"
    with pytest.raises(ex.ConfigError, match="not a dtype"):
        ex.validate(c)


def test_resume_with_a_different_config_is_refused():
    c = sciworld.get_config("tiny")
    stored = c.to_dict()
    ex.check_resume(c, stored)  # same config: fine
    ex.check_resume(c, None)    # fresh run: fine
    c2 = sciworld.get_config("tiny,grpo")
    with pytest.raises(ex.ConfigError, match=r"algo: 'strata' -> 'grpo'.*new --config.workdir"):
        ex.check_resume(c2, stored)


def test_nan_or_negative_lr_is_refused():
    from strata_jax.training import TrainConfig
    for bad in (float("nan"), -1.0):
        with pytest.raises(ValueError, match="lr must be a finite number"):
            TrainConfig(lr=bad)


def test_summarize_prefix_for_training_rollouts():
    trs = [_Tr(_Spec(Task("scienceworld", "boil", 0)), False, -0.5)]
    m = summarize(trs, "scienceworld", prefix="train")
    assert m == {"train/episodes": 1.0, "train/crashed": 0.0, "train/success": 0.0,
                 "train/score": -50.0, "train/family/boil/success": 0.0,
                 "train/family/boil/score": -50.0}


@pytest.mark.parametrize("script,config,override,hint", [
    ("sft.py", "configs/builtin.py:tiny", "--config.sft.stepz", " (did you mean 'steps'?)"),
    ("train.py", "configs/sciworld.py:tiny", "--config.model.nope", ""),
])
def test_unknown_config_override_is_one_clear_line(script, config, override, hint):
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, script, f"--config={config}", f"{override}=3",
                          "--config.iterations=2"], cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        f"{script}: {override} names no field of the config{hint}. Fields and their defaults: "
        "configs/base.py; variants: the experiment file's docstring.")
    assert "Traceback" not in out.stderr


def test_compilation_cache_dir_is_created_and_a_bad_one_is_a_clear_error(tmp_path):
    from strata_jax.config import ConfigError
    c = sciworld.get_config("tiny")
    c.compilation_cache_dir = ""
    assert ex.use_compilation_cache(c) is None                  # off
    before = jax.config.jax_compilation_cache_dir
    blocker = tmp_path / "file"
    blocker.write_text("")
    c.compilation_cache_dir = str(blocker / "cache")             # under a file: cannot exist
    with pytest.raises(ConfigError, match="compilation_cache_dir=.*set it to ''"):
        ex.use_compilation_cache(c)
    assert jax.config.jax_compilation_cache_dir == before       # nothing changed
    c.compilation_cache_dir = str(tmp_path / "a" / "cache")
    try:
        assert ex.use_compilation_cache(c) == str(tmp_path / "a" / "cache")
        assert os.path.isdir(tmp_path / "a" / "cache")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "a" / "cache")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
