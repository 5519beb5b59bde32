"""Evaluate a policy on a split: one strategy per task at temperature 0.4, per-family metrics.

    python eval.py --config=configs/sciworld.py:tiny                    # newest checkpoint of the run
    python eval.py --config=configs/sciworld.py --config.model.path=/ckpt/Qwen2.5-7B-Instruct --split=test --no_checkpoint
    python eval.py --config=configs/sciworld.py --config.env.eval_list=my_pairs.txt

An eval list file holds one ``task variation`` pair per line (or JSON pairs; see
envs_bridge/scienceworld_env.py:load_eval_list), e.g. AgentGym's 200 ScienceWorld test items.

Prints one line per family and the overall success rate and score, and writes them to
``<workdir>/eval_<split>_step<k>.json``.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=False)
_SPLIT = flags.DEFINE_string("split", None, "Split to evaluate (default: config.eval.split).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest restorable).")
_NO_CKPT = flags.DEFINE_bool("no_checkpoint", False,
                             "Evaluate the initial params of config.model (no run checkpoint).")
flags.mark_flags_as_required(["config"])


def run_eval(c, split: str | None = None, step: int | None = None,
             use_checkpoint: bool = True) -> dict:
    """Evaluate and return the metrics dict (see strata_jax.evaluation.summarize) plus "step"."""
    import jax

    from strata_jax import experiment as ex
    from strata_jax.evaluation import evaluate, spread_over_families
    from strata_jax.rollout import SamplerPolicy, make_prompt_builder
    from strata_jax.sampling import Sampler
    from strata_jax.training import Checkpointer, Trainer, TrainConfig

    ex.validate(c)
    ex.resolve(c)
    ex.check_env(c)   # e.g. the WebShop server answers
    split = split or c.eval.split
    mesh = ex.build_mesh(c)
    tokenizer = ex.build_tokenizer(c)
    model_cfg, params = ex.build_model(c, tokenizer, mesh)
    at = 0
    if use_checkpoint:
        trainer = Trainer(model_cfg, TrainConfig.from_config(c), mesh)
        ckpt = Checkpointer(os.path.join(c.workdir, "ckpt"), keep=c.ckpt.keep)
        restored = ckpt.restore(trainer.abstract_state(params), step=step)
        ckpt.close()
        if restored is None:
            raise SystemExit(f"no checkpoint in {c.workdir}/ckpt; train first or pass "
                             "--no_checkpoint to evaluate config.model as is")
        state, meta = restored
        # LoRA: the adapters merged into the base; otherwise the trained params themselves
        params, at = trainer.policy_params(state, params), int(meta["step"])
    tasks = spread_over_families(ex.task_list(c, split), c.eval.max_tasks)
    sampler = Sampler(model_cfg, mesh=mesh, max_cache_len=ex.max_cache_len(c, model_cfg))
    policy = SamplerPolicy(sampler, ex.sampler_params(c, params))
    builder = make_prompt_builder(tokenizer, c)
    pool = ex.build_pool(c)
    try:
        metrics, _ = evaluate(c, policy, pool, builder, tasks, key=ex.seed_key(c, 2, at))
    finally:
        pool.close()
    metrics["step"] = at
    if jax.process_index() == 0:
        os.makedirs(c.workdir, exist_ok=True)
        with open(os.path.join(c.workdir, f"eval_{split}_step{at}.json"), "w") as f:
            json.dump(metrics, f, indent=1)
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
    return "\n".join(lines)


def main(argv):
    del argv
    from strata_jax.metrics import quiet_logs
    quiet_logs()
    print(format_metrics(run_eval(_CONFIG.value, _SPLIT.value, _STEP.value,
                                  use_checkpoint=not _NO_CKPT.value)))
    return 0


if __name__ == "__main__":
    from strata_jax.cli import parse_flags
    app.run(main, flags_parser=parse_flags)
