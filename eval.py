"""Evaluate a policy on a split: one strategy per task at temperature 0.4, per-family metrics.

    python eval.py --config=configs/sciworld.py:tiny --split=dev        # newest checkpoint of the run
    python eval.py --config=configs/sciworld.py:tiny,grpo --split=dev   # the grpo variant's run
    python eval.py --config=configs/sciworld.py --config.model.path=/ckpt/Qwen2.5-7B-Instruct --split=test --no_checkpoint
    python eval.py --config=configs/sciworld.py --config.env.eval_list=my_pairs.txt

It loads the run's checkpoint (``<workdir>/ckpt``, the newest or ``--step``), or with
``--no_checkpoint`` the model of the config (``model.path`` / ``model.preset``, plus a warm start
that is already cached), or with ``--adapter=<workdir>/adapters/step<k>`` that model with the
LoRA adapters a finished run wrote (checksum and base checked first; not with ``--step``), and
nothing else: it never trains a warm start. It plays
``eval.episodes_per_family`` episodes per task family (``--episodes_per_family``; the tiny
variant: 16), at most ``eval.max_tasks`` in all. An eval list file holds one ``task variation``
pair per line (or JSON pairs; see envs_bridge/scienceworld_env.py:load_eval_list), e.g.
AgentGym's 200 ScienceWorld test items; it is played as listed.

Test-time strategy scaling (docs/method.md §10.1, strata_jax/evaluation/scaling.py):

    python eval.py --config=configs/sciworld.py:tiny --strategy_samples=4 --strategy_choice=judge
    python eval.py --config=configs/sciworld.py:tiny,stapo --strategy_samples=4 --strategy_choice=critic --probe_steps=3

samples S strategies per task (farthest-point selected as in training; a flat baseline: S
episodes), plays a probe per candidate (``--probe_steps``, 0 = full episodes), picks one by the
self-judgment of the probe, the checkpoint's critic (ppo / stapo runs) or the majority first
action, and reports the chosen outcomes with the cost per task (sampled tokens, env steps) in
``..._s<S>_<choice>[_probe<k>].json``. Same as ``--config.eval.strategy_samples=4`` etc.

Prints one line per family, the overall success rate and score, the rollout's invalid-step,
env-rejected and strategy-format-failure fractions, and where it wrote: the metrics to
``<workdir>/eval_<split>_step<k>.json`` and every episode to
``<workdir>/eval_<split>_step<k>_trajectories.jsonl`` (read it with
``python -m strata_jax.trajectories <that file>``). The job is `strata_jax.jobs.evaluate.run_eval`
(also what the notebook calls).
"""
from __future__ import annotations

from absl import app, flags
from ml_collections import config_flags

from strata_jax.jobs.cli import guarded, parse_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=False)
_SPLIT = flags.DEFINE_string("split", None, "Split to evaluate (default: config.eval.split).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest restorable).")
_NO_CKPT = flags.DEFINE_bool("no_checkpoint", False,
                             "Evaluate the initial params of config.model (no run checkpoint).")
_PER_FAMILY = flags.DEFINE_integer("episodes_per_family", None,
                                   "Episodes per task family (default: eval.episodes_per_family).")
_SAMPLES = flags.DEFINE_integer("strategy_samples", None,
                                "Test-time scaling: S candidates per task (eval.strategy_samples).")
_CHOICE = flags.DEFINE_enum("strategy_choice", None, ["judge", "critic", "first_action"],
                            "Test-time scaling: the chooser (eval.strategy_choice).")
_ADAPTER = flags.DEFINE_string("adapter", None,
                                "LoRA adapters folder (<workdir>/adapters/step<k>) played on "
                                "config.model instead of a checkpoint (eval.adapter).")
_PROBE = flags.DEFINE_integer("probe_steps", None,
                              "Test-time scaling: probe length, 0 = full episodes "
                              "(eval.probe_steps).")
flags.mark_flags_as_required(["config"])


@guarded
def main(argv):
    del argv
    from strata_jax.jobs.evaluate import report, run_eval
    from strata_jax.metrics import quiet_logs
    quiet_logs()
    c = _CONFIG.value
    for field, flag in (("episodes_per_family", _PER_FAMILY), ("strategy_samples", _SAMPLES),
                        ("strategy_choice", _CHOICE), ("probe_steps", _PROBE),
                        ("adapter", _ADAPTER)):
        if flag.value is not None:
            c.eval[field] = flag.value
    use_checkpoint = not (_NO_CKPT.value or c.eval.get("adapter"))   # adapters: no checkpoint
    print(report(c, run_eval(c, _SPLIT.value, _STEP.value, use_checkpoint=use_checkpoint)))
    return 0


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
