"""Does a real Qwen2.5 agent learn under StraTA? Held-out success before and after RL, against
GRPO, with significance tests: the study on memory_key with one code attempt (docs/method.md §12).

    nohup python -m studies.memory_key.run > runs/learning_study.log 2>&1 &   # run / continue
    python -m studies.memory_key.run --report         # tables, tests and plot from what ran
    python -m studies.memory_key.run --only start     # just the starting policy's evals

The study is a queue of jobs, each a ``train.py`` / ``eval.py`` / ``sft.py`` subprocess on its
own folder under ``--out``; a job whose result exists is skipped, and train.py resumes a run
from its last checkpoint (``ckpt.every=1``), so the queue started again after a stop continues
where it stopped. Each finished job's outputs (eval JSON and trajectories, a run's metrics and
trajectories; not checkpoints) are copied to ``--results`` with its command line, a running
run's every ``--keep-every`` seconds; committed, they let a fresh clone's queue skip the same
jobs and its report read them (the same job: the same command line but for the update's memory
knobs, ``--micro`` / ``--remat``, which a run killed for memory may change). In order:

1. ``warm_start`` (with ``--warm-start mask`` or ``mask-actions``): behaviour cloning that
   teaches the walk and the keypad with plans that do NOT carry the code
   (``sft.plan_code=mask``; ``mask-actions`` trains the action rows only, so the model keeps its
   own way of writing strategies), cached by fingerprint.
2. ``start_strata`` / ``start_flat``: the starting policy on the fixed eval set (the first
   ``--eval-episodes`` test-split tasks, one strategy per task, temperature 0.4), StraTA and
   flat prompting.
3. per seed and method: ``run_<algo>_s<seed>`` (LoRA, ``--iterations`` iterations, StraTA N x M
   episodes per task against GRPO groups of N*M: ``matched``), then ``final_<algo>_s<seed>``
   (its last checkpoint on the same eval set).

The report (``--out/learning_study.json`` + ``.png``): per policy, success with 95% Wilson
intervals, the fraction of strategies that carry the code, the successes whose code reached the
keypad's prompt some other way (leak channels, §12); each trained policy against its own start
(one-sided Fisher exact and exact McNemar on the paired tasks); each method's gain and StraTA's
gain minus GRPO's; the training rollouts' success per iteration with a Cochran-Armitage trend
test; the success rate the eval size can detect (80% power). Statistics: stats.py;
the queue: queue.py; the episode reading: episodes.py; the report and figure: report.py.
Measures, never asserts.
"""
from __future__ import annotations

import argparse
import sys

from studies.memory_key.queue import REMAT, positive_int, positive_seconds, run_queue
from studies.memory_key.report import report

ALGOS = ("strata", "grpo")


def build_parser() -> argparse.ArgumentParser:
    """The study's command line (`main`)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--warm-start", default="", help="'' = zero-shot; mask = behaviour cloning "
                    "with plans that do not carry the code; mask-actions = the same without "
                    "strategy rows (the model keeps its own strategies); or an HF export dir")
    ap.add_argument("--plan-code-keep", type=float, default=0.0,
                    help="with --warm-start mask*: the share of cloned plans that keep the code "
                    "(sft.plan_code_keep), so that some start strategies carry it")
    ap.add_argument("--no-guesses", action="store_true",
                    help="with --warm-start mask*: clone no StraTA-form keypad row whose code the "
                    "prompt hides (sft.clone_guesses=false), so code rows teach reading z")
    ap.add_argument("--digits", type=int, default=1)
    ap.add_argument("--max-steps", type=int, default=10)
    ap.add_argument("--eval-episodes", type=int, default=48)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--algos", nargs="+", default=["strata", "grpo"], choices=ALGOS)
    ap.add_argument("--tasks", type=int, default=1, help="tasks per iteration")
    ap.add_argument("--n", type=int, default=2, help="strategies per task (GRPO: group N*M)")
    ap.add_argument("--m", type=int, default=4, help="episodes per strategy")
    ap.add_argument("--sigma", type=int, default=2, help="strategy over-sampling")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--updates-per-iteration", type=int, default=2)
    ap.add_argument("--micro", type=positive_int, default=8)
    ap.add_argument("--remat", default="dots", choices=REMAT)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sft-episodes", type=int, default=48)
    ap.add_argument("--sft-steps", type=int, default=40)
    ap.add_argument("--sft-lr", type=float, default=1e-5)
    ap.add_argument("--sft-batch", type=int, default=8, help="full fine-tuning of the 0.5B in "
                    "fp32 holds params, gradients and AdamW moments (~10 GB) plus activations")
    ap.add_argument("--seed-base", type=int, default=0, help="seed of the start evals")
    ap.add_argument("--set", nargs="*", default=[], help="extra key=value overrides, every job")
    ap.add_argument("--train-set", nargs="*", default=[], help="extra key=value overrides of "
                    "the RL runs and their final evals only (the warm start and the start "
                    "evals keep their command lines, so their kept results still count)")
    ap.add_argument("--only", nargs="*", default=[], help="job name prefixes to run")
    ap.add_argument("--out", default="runs/learning_study", help="the jobs' workdirs")
    ap.add_argument("--results", default="studies/memory_key/results/queue",
                    help="each finished job's outputs, committed: a later session's queue "
                    "skips the jobs kept here (same argv) and the report reads them")
    ap.add_argument("--keep-every", type=positive_seconds, default=120.0,
                    help="seconds between copies of a running job's outputs to --results")
    ap.add_argument("--report", action="store_true")
    return ap


def main() -> int:
    args = build_parser().parse_args()
    if not args.report:
        run_queue(args)
    report(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
