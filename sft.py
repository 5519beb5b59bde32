"""Behaviour-cloning (SFT) warm start: clone expert trajectories rendered with the rollout's prompts.

    python sft.py --config=configs/builtin.py:tiny        # memory_key experts, tiny model, ~1-3 min
    python sft.py --config=configs/sciworld.py:tiny       # ScienceWorld gold paths of the tiny tasks
    python sft.py --config=configs/sciworld.py --config.model.path=/ckpt/Qwen2.5-1.5B-Instruct \
        --config.sft.lr=1e-5 --out=/ckpt/qwen-bc

The initial params are the run's own before its warm start (`experiment.build_model`: a random
``model.preset`` with the vocabulary widened to the tokenizer, or ``model.path``). The result is an HF checkpoint
(config.json + model.safetensors, no tokenizer files; with ``--config.sft.lora_rank=R`` > 0 the
LoRA adapters alone, PEFT's adapter_model.safetensors + adapter_config.json, merged into the
initial params when loaded) in ``--out`` or, by default, the cache dir
that ``model.warm_start=sft`` reads (``<sft.cache_dir>/<fingerprint>``, default
``runs/warm_start/<fingerprint>``), so every later ``train.py`` / ``eval.py`` of the same setting,
whatever its variant or workdir, reuses it. To start any run from an export explicitly:

    python train.py --config=... --config.model.warm_start=<export dir>
    # or, without the warm-start hook: --config.model.path=<export dir> --config.model.preset=
    #   --config.model.tokenizer=offline   (the export has no tokenizer files)

Data and loss: strata_jax/training/sft/; the job and the cache rules: strata_jax/jobs/warm_start.py.
"""
from __future__ import annotations

from absl import app, flags
from ml_collections import config_flags

from strata_jax.jobs.cli import guarded, parse_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file, e.g. configs/builtin.py:tiny", lock_config=False)
_OUT = flags.DEFINE_string("out", "", "Export directory (default: the warm-start cache dir).")
_FORCE = flags.DEFINE_bool("force", False, "Retrain even when the cache dir holds an export.")
flags.mark_flags_as_required(["config"])


@guarded
def main(argv):
    del argv
    from strata_jax.jobs.warm_start import export_warm_start
    from strata_jax.metrics import quiet_logs
    quiet_logs()
    res = export_warm_start(_CONFIG.value, _OUT.value, _FORCE.value, log_fn=print)
    m = res["meta"]
    print(f"{'cached' if res['cached'] else 'trained'}: {res['out']}  (episodes {m['episodes']}, "
          f"examples {m['examples']}, loss {m['first_loss']:.3f} -> {m['final_loss']:.3f}, "
          f"{m['wall_s']:.0f} s)")
    if _OUT.value:
        print(f"use it: python train.py --config=<same config> "
              f"--config.model.warm_start={res['out']}")
    else:
        print("train.py and eval.py with the same config find it there (sft.cache_dir); any other "
              f"run can start from it with --config.model.warm_start={res['out']}")
    return 0


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
