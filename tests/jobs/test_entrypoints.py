"""Fast checks of the entry-point plumbing: config validation errors, task lists, eval summary."""
import dataclasses
import os

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest

from configs import sciworld
from envs_bridge import Task
from strata_jax import experiment as ex
from strata_jax.evaluation import eval_rollout_config, spread_over_families, summarize
from strata_jax.models import PRESETS
from tests.fixtures.paths import REPO_ROOT


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


def test_sampler_copy_cast_follows_config():
    import jax
    import jax.numpy as jnp
    params = {"a": jnp.ones((2, 3), jnp.float32), "b": [jnp.zeros(4, jnp.float32)]}
    paper = sciworld.get_config()
    # fp32 masters for AdamW at lr 1e-6; bf16 for the sampler and the train forward
    assert paper.model.dtype == "float32" and paper.train.compute_dtype == "bfloat16"
    from strata_jax.sampling import SamplerCopy
    cast = SamplerCopy.from_config(paper, None)(params)
    assert {x.dtype for x in jax.tree.leaves(cast)} == {jnp.dtype(jnp.bfloat16)}
    np.testing.assert_array_equal(np.asarray(cast["a"], np.float32), np.ones((2, 3)))
    tiny = sciworld.get_config("tiny")
    assert SamplerCopy.from_config(tiny, None)(params) is params  # already fp32: no copy


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
    ("sft.py", "configs/builtin.py:tiny", "--config.sft.stepz", " (did you mean 'sft.steps'?)"),
    ("train.py", "configs/sciworld.py:tiny", "--config.model.nope", ""),
])
def test_unknown_config_override_is_one_clear_line(script, config, override, hint):
    import subprocess
    import sys
    root = REPO_ROOT
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
        # one folder per jax / jaxlib version and device set under the configured directory
        sub = (f"jax-{jax.__version__}_jaxlib-{jaxlib.__version__}_{jax.devices()[0].platform}-"
               f"{jax.devices()[0].device_kind.lower()}-x{jax.device_count()}")
        assert ex.use_compilation_cache(c) == str(tmp_path / "a" / "cache" / sub)
        assert os.path.isdir(tmp_path / "a" / "cache" / sub)
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "a" / "cache" / sub)
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


@pytest.fixture
def fresh_jax_cache(tmp_path):
    """jax's persistent cache in a fresh folder for this test, every program stored."""
    from jax._src import compilation_cache as cc

    from strata_jax import compile_cache
    saved = {k: getattr(jax.config, k) for k in (
        "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes")}
    compile_cache.install()
    cc.reset_cache()
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jc"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    yield tmp_path / "jc"
    cc.reset_cache()
    for k, v in saved.items():
        jax.config.update(k, v)


def _entries(folder):
    return sorted(p for p in folder.iterdir() if p.name.endswith("-cache"))


def test_swapped_or_damaged_cache_entries_are_evicted_and_recompiled(fresh_jax_cache):
    """Two entries with swapped contents loaded as hits and returned each other's results
    (jax trusts file names); a damaged entry was never rewritten. Sealed entries fail their
    check instead: deleted, compiled again, stored anew, the right results."""
    import numpy as np

    from jax._src import compilation_cache as cc
    x = jnp.arange(6.0)

    def head(v):
        return v[:2] + 1

    def colsum(v):
        return jnp.outer(v, v).sum(0)

    def run():
        jax.clear_caches()   # forget compiled programs in memory: load from the folder
        return np.asarray(jax.jit(head)(x)), np.asarray(jax.jit(colsum)(x))

    first = run()
    a, = [p for p in _entries(fresh_jax_cache) if p.name.startswith("jit_head-")]
    b, = [p for p in _entries(fresh_jax_cache) if p.name.startswith("jit_colsum-")]
    good = {a.name: a.read_bytes(), b.name: b.read_bytes()}
    assert all(v.startswith(b"strata-sealed-v1") for v in good.values())
    a.write_bytes(good[b.name])                       # swap the two entries' contents
    b.write_bytes(good[a.name])
    cache = cc._cache
    again = run()
    assert [r.shape for r in again] == [(2,), (6,)]
    for r, r0 in zip(again, first):
        np.testing.assert_array_equal(r, r0)
    assert sorted(cache.evicted) == sorted(p.name[:-len("-cache")] for p in (a, b))
    from strata_jax.compile_cache import unseal
    for p in (a, b):                                  # rewritten, each under its own key
        assert unseal(p.name[:-len("-cache")], p.read_bytes()) is not None
    damaged = bytearray(good[a.name])
    damaged[-5] ^= 0x40                               # a bit flip inside one entry
    a.write_bytes(bytes(damaged))
    run()
    assert cache.evicted[-1] == a.name[:-len("-cache")]
    assert unseal(a.name[:-len("-cache")], a.read_bytes()) is not None   # good again



def test_the_trainer_owns_when_a_reference_is_needed_and_the_score_chunk():
    """`Trainer.needs_reference` (KL on, or LoRA: the frozen base) and `Trainer.score_chunk`
    (score_rows, else the micro-batch size), the rules the training loop reads."""
    from strata_jax.training import Trainer, TrainConfig
    c = sciworld.get_config("tiny")

    def trainer(**fields):
        for k, v in fields.items():
            section, name = k.split("__")
            c[section][name] = v
        return Trainer(PRESETS["tiny"], TrainConfig.from_config(c), None)

    t = trainer(loss__kl_coef=0.0, lora__rank=0, train__score_rows=0, optim__micro_batch_rows=4)
    assert (t.needs_reference, t.score_chunk) == (False, 4)
    t = trainer(loss__kl_coef=0.01, train__score_rows=6)
    assert (t.needs_reference, t.score_chunk) == (True, 6)
    t = trainer(loss__kl_coef=0.0, lora__rank=8)   # the adapters ride on the frozen base
    assert t.lora and t.needs_reference
