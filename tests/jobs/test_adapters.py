"""A LoRA run's adapters as files (strata_jax.jobs.adapters): a finished tiny LoRA run writes
``adapters/step<k>/``, and eval with ``eval.adapter`` (config.model + those adapters) gives the
same metrics and episodes as eval of the run's final checkpoint; the preflight refuses an
adapter together with a checkpoint load, a missing folder and a changed file before any model
is built.

The run is test_train_finish.py's smallest setting (built-in memory_key env, tiny random model,
no warm start, 1 iteration of 1 task) with LoRA on, in this process."""
import json
import os

import pytest

from strata_jax.config import ConfigError
from strata_jax.jobs.evaluate import run_eval
from tests.fixtures.small_job import smallest_config


def _config(workdir):
    # a large step: the adapters move the policy after one update
    return smallest_config(workdir, lora__rank="4", lora__alpha="8", lora__lr="0.05",
                           eval__episodes_per_family="2", eval__max_tasks="2")


def _played(metrics, files):
    """The eval's numbers (no wall-clock field) and its episodes as written."""
    episodes = open(files[1]).read().splitlines()
    return {k: v for k, v in metrics.items() if k != "files" and "time" not in k
            and not k.endswith("_s")}, episodes


@pytest.mark.slow
def test_a_lora_run_writes_its_adapters_and_eval_of_them_equals_eval_of_its_checkpoint(tmp_path):
    from strata_jax.jobs import train
    from strata_jax.models.adapter_files import ADAPTER_FILE, CONFIG_FILE, file_sha256
    c = _config(tmp_path / "run")
    summary = train.run(c)
    assert (summary["status"], summary["step"]) == ("done", 1)
    folder = tmp_path / "run" / "adapters" / "step1"
    assert sorted(os.listdir(folder)) == [CONFIG_FILE, ADAPTER_FILE]
    meta = json.loads((folder / CONFIG_FILE).read_text())
    assert (meta["r"], meta["lora_alpha"]) == (4, 8.0)
    sj = meta["strata_jax"]
    assert (sj["step"], sj["algo"], sj["seed"]) == (1, c.algo, c.seed)
    assert sj["sha256"] == file_sha256(str(folder / ADAPTER_FILE))
    assert {k: sj["base"][k] for k in ("model_path", "model_preset", "warm_start",
                                       "warm_start_export", "model_dtype")} == \
        {"model_path": "", "model_preset": "tiny", "warm_start": "", "warm_start_export": "",
         "model_dtype": "float32"}
    assert len(sj["base"]["params_sha256"]) == 64

    # the reference: the checkpoint's adapters as the file holds them, rounded to bf16 (the
    # f32 adapters are another policy whenever a rounding flips a sampled token)
    import jax
    import jax.numpy as jnp

    from strata_jax.models.lora import apply_lora
    from strata_jax.training import trainer as trainer_module

    def rounded_merge(base, adapters, cfg, dtype=None):
        as_file = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype), adapters)
        return apply_lora(base, as_file, cfg, dtype)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer_module, "_merge", jax.jit(rounded_merge, static_argnums=(2, 3)))
        from_ckpt = run_eval(_config(tmp_path / "run"), "dev")
    ckpt_played = _played(from_ckpt, from_ckpt["files"])
    a = _config(tmp_path / "run")
    a.eval.adapter = str(folder)
    from_adapter = run_eval(a, "dev", use_checkpoint=False)
    assert from_adapter["step"] == from_ckpt["step"] == 1
    assert from_adapter["files"] == from_ckpt["files"]   # same names: eval_dev_step1*
    assert _played(from_adapter, from_adapter["files"]) == ckpt_played
    assert from_ckpt["eval/episodes"] == 2.0
    # the adapters matter: the base alone plays other episodes
    bare = run_eval(_config(tmp_path / "run"), "dev", use_checkpoint=False)
    assert bare["step"] == 0 and _played(bare, bare["files"])[1] != ckpt_played[1]


def test_an_adapter_with_a_checkpoint_load_is_refused_before_anything_is_built(tmp_path):
    c = _config(tmp_path / "run")
    c.eval.adapter = str(tmp_path / "adapters" / "step1")
    with pytest.raises(ConfigError) as e:
        run_eval(c, "dev")
    assert str(e.value) == (
        f"eval.adapter={c.eval.adapter!r} plays config.model with those adapters; a checkpoint "
        "load is the other choice: choose one (drop --step, or use_checkpoint=False; eval.py's "
        "--adapter implies it)")
    with pytest.raises(ConfigError, match="is not a folder; give an adapters/step<k> folder"):
        run_eval(c, "dev", use_checkpoint=False)
    assert not (tmp_path / "run").exists()


def test_another_base_and_a_changed_file_are_refused_in_the_preflight(tmp_path):
    import jax

    from strata_jax.models.adapter_files import ADAPTER_FILE, save_adapters
    from strata_jax.models.lora import LoraConfig, init_lora
    from tests.fixtures.trainer import TINY
    lora = LoraConfig(rank=2, alpha=4.0)
    base = {"model_path": "", "model_preset": "tiny", "model_dtype": "bfloat16",
            "warm_start": ""}
    folder = save_adapters(init_lora(TINY, lora, jax.random.PRNGKey(0)), lora, TINY,
                           str(tmp_path / "step3"), {"step": 3, "base": base})
    c = _config(tmp_path / "run")   # a float32 base
    c.eval.adapter = folder
    with pytest.raises(ConfigError) as e:
        run_eval(c, "dev", use_checkpoint=False)
    assert str(e.value) == (
        f"eval.adapter: {folder}/adapter_config.json: the adapters were trained on a base with "
        "model_dtype='bfloat16' but this config's base has model_dtype='float32'; evaluate them "
        "with the training run's config (same model.path / preset, dtype, seed and warm start)")
    with open(os.path.join(folder, ADAPTER_FILE), "r+b") as f:   # one bit of the last byte
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0x80]))
    with pytest.raises(ConfigError) as e:
        run_eval(c, "dev", use_checkpoint=False)
    msg = str(e.value)
    assert msg.startswith(f"eval.adapter: {folder}/{ADAPTER_FILE} has sha256 ") and "\n" not in msg
    assert msg.endswith("the file changed after it was written; restore it from a copy or "
                        "re-run the training job that wrote it")
    assert not (tmp_path / "run").exists()


def test_the_base_identity_names_a_cached_warm_start_by_its_fingerprint_folder(tmp_path):
    from strata_jax import experiment as ex
    from strata_jax.jobs.adapters import base_identity
    from strata_jax.jobs.warm_start import export_name, fingerprint
    from strata_jax.training.sft import SFTConfig
    c = _config(tmp_path / "run")
    c.model.warm_start = "sft"
    model_cfg = ex.model_config(c, ex.build_tokenizer(c))
    name = export_name(c, model_cfg)
    assert name == fingerprint(c, model_cfg, SFTConfig.from_config(c)) and len(name) == 12
    assert base_identity(c, name) == {"model_path": "", "model_preset": "tiny",
                                      "model_dtype": "float32", "warm_start": "sft",
                                      "warm_start_export": name}
    c.model.warm_start = ""
    assert export_name(c, model_cfg) == ""
