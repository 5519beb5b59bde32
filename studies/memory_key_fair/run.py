"""The fair memory_key study: StraTA against a flat baseline that keeps the note in view and
against StraTA's own prompts trained with a trajectory-level advantage, from one warm start,
pre-registered seeds, held-out and unseen worlds, adapters kept (the write-up and the
pre-registration: studies/memory_key_fair/README.md).

    nohup python -m studies.memory_key_fair.run > runs/memory_key_fair.log 2>&1 &   # run / continue
    python -m studies.memory_key_fair.run --report      # tables and tests from what ran
    python -m studies.memory_key_fair.run --list        # the queue's jobs and their state

The defaults are the registered setting; changing one makes other jobs (their command lines
differ), which the queue neither skips nor mixes with the registered ones.

Arms (``ARMS``), each from the same warm start (`WARM_START`: behaviour cloning whose StraTA
rows see the 2-step window and whose flat rows see the whole trajectory, so a flat keypad row
copies the code from the note):
  * ``strata``      StraTA (two-level advantage), prompts with the strategy and the 2-step window;
  * ``grpo_full``   GRPO over the task's N x M episodes (``matched``), flat prompts holding the
                    whole trajectory (``rollout.cumulative_prompts``): the note stays in view;
  * ``strata_traj`` StraTA's prompts and rows, the trajectory-level advantage
                    (docs/method.md §5.11): no strategy-level advantage.

The queue, in order: the warm start; the start policy on the 48 test tasks (StraTA and
full-history flat prompting); per seed round (``SEEDS``) the three arms' runs, each followed
by its evals from the kept adapters (test, 2-digit codes, 6-7-room corridors); then the start
on the two unseen sets. Each job is a ``train.py`` / ``eval.py`` / ``sft.py`` subprocess
(studies/memory_key/queue.py: skipped when kept, resumed from its checkpoint, outputs kept
under --results with their command line and commit).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from studies.memory_key import queue as mq

REPO = mq.REPO
RESULTS = "studies/memory_key_fair/results"

# seeds per arm, pre-registered: StraTA's 0 and 1 ran before (studies/memory_key), so its
# seeds here are new
SEEDS = dict(strata=(2, 3, 4), grpo_full=(0, 1, 2), strata_traj=(0, 1, 2))
ARMS = ("grpo_full", "strata_traj", "strata")      # the order inside a seed round

# the arm's config variant tokens (configs/builtin.py) on top of the shared ones
ARM_TOKENS = dict(
    strata=("strata",),
    grpo_full=("grpo", "matched", "rollout.cumulative_prompts=true", "sft.strata_prompts=window"),
    strata_traj=("strata_traj",),
)
PROMPTING = dict(strata="strata", strata_traj="strata", grpo_full="flat")

# the eval sets: name -> the env overrides (on top of the run's); "test" = training's worlds
EVAL_SETS = dict(test=(), d2=("env.code_digits=2",), long=("env.corridor_rooms=6-7",))
WARM = "{warm_start}"   # replaced by the warm start's export folder once it exists


def registered_args(argv=None) -> argparse.Namespace:
    """The command line; its defaults are the registered setting (the memory_key study's
    reported one: studies/memory_key/README.md, k50_t06_lr2e5_m4)."""
    ap = mq.queue_parser(__doc__, "runs/memory_key_fair", RESULTS)
    ap.add_argument("--remat", default="full", choices=mq.REMAT,
                    help="a memory knob (not part of a job's key)")
    ap.add_argument("--micro", type=mq.positive_int, default=4,
                    help="a memory knob (rows per micro-batch)")
    ap.add_argument("--report", action="store_true")
    a = ap.parse_args(argv)
    # the setting (studies/memory_key/queue.py `variant` / `train_extra` read these names)
    fixed = dict(model="qwen2.5-coder-0.5b-instruct", warm_start="mask", plan_code_keep=0.5,
                 no_guesses=True, digits=1, max_steps=10, eval_episodes=48, iterations=10,
                 tasks=1, n=4, m=2, sigma=4, rank=16, lr=2e-5, updates_per_iteration=2,
                 dtype="float32", sft_episodes=32, sft_steps=20, sft_lr=2e-5, sft_batch=8,
                 seed_base=0, set=["sft.flat_prompts=full"],
                 train_set=["loss.entropy_coef=0", "rollout.temperature=0.6",
                            "train.pack_prefixes=true"])
    for k, v in fixed.items():
        setattr(a, k, v)
    return a


def _eval_argv(a, arm: str, wd: str, tokens: tuple[str, ...], set_name: str,
               adapter: str | None) -> list[str]:
    """eval.py's argv: the arm's config (`tokens`: a run's own for a final eval, so its LoRA
    shape and prompts are the run's) in workdir `wd`, the eval set's env, the 48 test tasks;
    from `adapter` (a run's kept adapters) or the start (--no_checkpoint)."""
    extra = tokens + EVAL_SETS[set_name]
    if set_name != "test":   # other worlds: the warm start named by its folder (its cache key
        extra += (f"model.warm_start={WARM}",)   # holds the env's settings)
    argv = [sys.executable, os.path.join(REPO, "eval.py"),
            f"--config={os.path.join(REPO, 'configs', 'builtin.py')}:"
            f"{mq.variant(a, ARM_TOKENS[arm][0], wd, extra)}",
            "--split=test", f"--episodes_per_family={a.eval_episodes}"]
    return argv + ([f"--adapter={adapter}"] if adapter else ["--no_checkpoint"])


def jobs(a) -> list[dict]:
    """The registered queue in order (name, argv, done file; `studies.memory_key.queue`)."""
    py, out = sys.executable, os.path.abspath(a.out)
    cfg = os.path.join(REPO, "configs", "builtin.py")
    q = []
    wd = os.path.join(out, "warm_start")
    q.append(dict(name="warm_start", done=os.path.join(wd, "DONE"), touch=True, local=True,
                  argv=[py, os.path.join(REPO, "sft.py"),
                        f"--config={cfg}:{mq.variant(a, 'strata', wd)}"]))

    def start(arm: str, set_name: str) -> dict:
        name = f"start_{PROMPTING[arm]}" + ("" if set_name == "test" else f"_{set_name}")
        wd = os.path.join(out, name)
        return dict(name=name, done=os.path.join(wd, "eval_test_step0.json"),
                    argv=_eval_argv(a, arm, wd, ARM_TOKENS[arm][1:], set_name, None))

    q += [start("strata", "test"), start("grpo_full", "test")]
    rounds = max(len(s) for s in SEEDS.values())
    for r in range(rounds):
        for arm in ARMS:
            seed = SEEDS[arm][r]
            wd = os.path.join(out, f"run_{arm}_s{seed}")
            algo = ARM_TOKENS[arm][0]
            # the arm's tokens after the group shape: ``matched`` reads num_strategies x M
            extra = mq.train_extra(a, "strata", seed) + ARM_TOKENS[arm][1:]
            q.append(dict(name=f"run_{arm}_s{seed}", done=os.path.join(wd, "DONE"), touch=True,
                          argv=[py, os.path.join(REPO, "train.py"),
                                f"--config={cfg}:{mq.variant(a, algo, wd, extra)}"]))
            adapter = os.path.join(wd, "adapters", f"step{a.iterations}")
            for set_name in EVAL_SETS:
                name = f"final_{arm}_s{seed}_{set_name}"
                ewd = os.path.join(out, name)
                q.append(dict(name=name, done=os.path.join(ewd, f"eval_test_step{a.iterations}"
                                                                ".json"),
                              # at the start evals' seed: the same sampling keys per task
                              argv=_eval_argv(a, arm, ewd, extra + (f"seed={a.seed_base}",),
                                              set_name, adapter)))
    for set_name in ("d2", "long"):
        q += [start("strata", set_name), start("grpo_full", set_name)]
    return q


def resolve(a, job: dict) -> dict | None:
    """`job` with the warm start's export folder in place of `WARM` (None before it exists)."""
    return mq.fill_placeholder(job, WARM, mq.warm_start_export(a))


def _report(a) -> None:
    from studies.memory_key_fair.report import report
    print(json.dumps(report(a).get("summary", {}), indent=1))


def main(argv=None) -> int:
    return mq.study_main(argv, registered_args, jobs, resolve, _report)


if __name__ == "__main__":
    sys.exit(main())
