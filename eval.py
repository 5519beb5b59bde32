"""Evaluate a policy on a split: one strategy per task at temperature 0.4, per-family metrics.

    python eval.py --config=configs/sciworld.py:tiny --split=dev        # newest checkpoint of the run
    python eval.py --config=configs/sciworld.py:tiny,grpo --split=dev   # the grpo variant's run
    python eval.py --config=configs/sciworld.py --config.model.path=/ckpt/Qwen2.5-7B-Instruct --split=test --no_checkpoint
    python eval.py --config=configs/sciworld.py --config.env.eval_list=my_pairs.txt

It loads the run's checkpoint (``<workdir>/ckpt``, the newest or ``--step``), or with
``--no_checkpoint`` the model of the config (``model.path`` / ``model.preset``, plus a warm start
that is already cached), and nothing else: it never trains a warm start. It plays
``eval.episodes_per_family`` episodes per task family (``--episodes_per_family``; the tiny
variant: 16), at most ``eval.max_tasks`` in all. An eval list file holds one ``task variation``
pair per line (or JSON pairs; see envs_bridge/scienceworld_env.py:load_eval_list), e.g.
AgentGym's 200 ScienceWorld test items; it is played as listed.

Prints one line per family, the overall success rate and score, the rollout's invalid-step,
env-rejected and strategy-format-failure fractions, and where it wrote: the metrics to
``<workdir>/eval_<split>_step<k>.json`` and every episode to
``<workdir>/eval_<split>_step<k>_trajectories.jsonl`` (read it with
``python -m strata_jax.trajectories <that file>``).
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from strata_jax.cli import guarded, parse_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=False)
_SPLIT = flags.DEFINE_string("split", None, "Split to evaluate (default: config.eval.split).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest restorable).")
_NO_CKPT = flags.DEFINE_bool("no_checkpoint", False,
                             "Evaluate the initial params of config.model (no run checkpoint).")
_PER_FAMILY = flags.DEFINE_integer("episodes_per_family", None,
                                   "Episodes per task family (default: eval.episodes_per_family).")
flags.mark_flags_as_required(["config"])


def run_eval(c, split: str | None = None, step: int | None = None,
             use_checkpoint: bool = True) -> dict:
    """Evaluate and return the metrics dict (see strata_jax.evaluation.evaluate) plus "step"
    and "files" (the JSON and trajectory paths written, process 0 only).

    Raises ConfigError (bad config; a warm start that is not cached, with --no_checkpoint) and
    SystemExit (no checkpoint in the run folder).
    """
    import jax

    from strata_jax import experiment as ex
    from strata_jax.evaluation import eval_tasks, evaluate
    from strata_jax.rollout import SamplerPolicy, make_prompt_builder
    from strata_jax.sampling import Sampler
    from strata_jax.training import Checkpointer, Trainer, TrainConfig

    ex.validate(c)
    ex.resolve(c)
    split = split or c.eval.split
    ckpt_dir = os.path.join(c.workdir, "ckpt")
    if use_checkpoint and not os.path.isdir(ckpt_dir):
        raise SystemExit(f"eval.py: no checkpoint in {ckpt_dir}; train first (python train.py "
                         "with the same --config) or pass --no_checkpoint to evaluate "
                         "config.model as is")
    mesh = ex.build_mesh(c)
    tokenizer = ex.build_tokenizer(c)
    at = 0
    if use_checkpoint:
        trainer = Trainer(ex.model_config(c, tokenizer), TrainConfig.from_config(c), mesh)
        model_cfg = trainer.model
        # LoRA adapters need their frozen base (the run's initial params); full fine-tuning
        # needs only the shapes: nothing is loaded or trained besides the checkpoint.
        base = (ex.build_model(c, tokenizer, mesh, train_warm_start=False)[1] if trainer.lora
                else ex.abstract_params(c, model_cfg))
        ckpt = Checkpointer(ckpt_dir, keep=c.ckpt.keep)
        restored = ckpt.restore(trainer.abstract_state(base), step=step)
        ckpt.close()
        if restored is None:
            raise SystemExit(f"eval.py: no restorable checkpoint in {ckpt_dir}"
                             + (f" at step {step}" if step is not None else "")
                             + "; train first or pass --no_checkpoint")
        state, meta = restored
        # LoRA: the adapters merged into the base; otherwise the trained params themselves
        params, at = trainer.policy_params(state, base), int(meta["step"])
        print(f"eval.py: checkpoint step {at} of {c.workdir}", flush=True)
    else:
        model_cfg, params = ex.build_model(c, tokenizer, mesh, train_warm_start=False)
        print(f"eval.py: the config's model as is ({c.model.path or 'preset ' + c.model.preset}"
              + (f", warm start {c.model.warm_start}" if c.model.warm_start else "") + ")",
              flush=True)
    tasks = eval_tasks(c, split)
    sampler = Sampler(model_cfg, mesh=mesh, max_cache_len=ex.max_cache_len(c, model_cfg))
    policy = SamplerPolicy(sampler, ex.sampler_params(c, params))
    builder = make_prompt_builder(tokenizer, c)
    pool = ex.build_pool(c)
    print(f"eval.py: {len(tasks)} episodes on split {split!r} "
          f"({int(c.eval.get('episodes_per_family', 0))} per family) ...", flush=True)
    try:
        metrics, episodes = evaluate(c, policy, pool, builder, tasks, key=ex.seed_key(c, 2, at))
    finally:
        pool.close()
    metrics["step"] = at
    metrics["files"] = []
    if jax.process_index() == 0:
        os.makedirs(c.workdir, exist_ok=True)
        stem = os.path.join(c.workdir, f"eval_{split}_step{at}")
        with open(stem + ".json", "w") as f:
            json.dump({k: v for k, v in metrics.items() if k != "files"}, f, indent=1)
        with open(stem + "_trajectories.jsonl", "w") as f:
            for rec in episodes:
                f.write(json.dumps({"step": at, **rec}, default=str) + "\n")
        metrics["files"] = [stem + ".json", stem + "_trajectories.jsonl"]
    return metrics


def format_metrics(metrics: dict) -> str:
    lines = []
    for k, v in sorted(metrics.items()):
        if k.startswith("eval/family/") and k.endswith("/success"):
            fam = k[len("eval/family/"):-len("/success")]
            score = metrics.get(f"eval/family/{fam}/score", float("nan"))
            lines.append(f"  {fam:<50s} success {v:6.3f}  score {score:8.2f}")
    lines.append(f"overall: success {metrics['eval/success']:.3f}  score {metrics['eval/score']:.2f}"
                 f"  episodes {int(metrics['eval/episodes'])}  (step {metrics['step']})")
    lines.append(f"steps: invalid (format) {metrics.get('eval/invalid_step_frac', 0.0):.3f}  "
                 f"rejected by the env {metrics.get('eval/env_rejected_frac', 0.0):.3f}  "
                 f"strategy format failures {metrics.get('eval/strategy_format_fail_frac', 0.0):.3f}")
    for path in metrics.get("files", []):
        lines.append(f"wrote {path}")
    return "\n".join(lines)


@guarded
def main(argv):
    del argv
    from strata_jax.metrics import quiet_logs
    quiet_logs()
    c = _CONFIG.value
    if _PER_FAMILY.value is not None:
        c.eval.episodes_per_family = _PER_FAMILY.value
    print(format_metrics(run_eval(c, _SPLIT.value, _STEP.value,
                                  use_checkpoint=not _NO_CKPT.value)))
    return 0


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
