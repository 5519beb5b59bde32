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
``python -m strata_jax.trajectories <that file>``). The work is `strata_jax.evaluation.run_eval`
(also what the notebook calls).
"""
from __future__ import annotations

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


@guarded
def main(argv):
    del argv
    from strata_jax.evaluation import format_metrics, run_eval
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
