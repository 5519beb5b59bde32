"""Learning on real ScienceWorld: a behaviour-cloned Qwen2.5-Coder-0.5B (LoRA, kept), a
pre-registered family screen on the dev split, then StraTA against GRPO at matched episodes,
held out on the test variations of the chosen families (the write-up and the pre-registration:
studies/sciworld_learning/README.md).

    nohup python -m studies.sciworld_learning.run > runs/sciworld_learning.log 2>&1 &   # run / continue
    python -m studies.sciworld_learning.run --list      # the queue's jobs and their state
    python -m studies.sciworld_learning.run --report    # the tables and tests of what ran

The defaults are the registered setting. The queue, in order: the warm start (`sft.py` with
``sft.lora_rank`` > 0: adapter files written straight under --results, so a fresh clone loads
them instead of training again); the screen (the start on 16 dev variations of each
``SCREEN_FAMILIES`` family, StraTA prompting); the families the registered rule
(`choose_families`) picks from the screen; the start on the test variations of those families
(StraTA and flat prompting); per seed round the two arms' runs, each followed by its test eval
from its kept adapters. Jobs are `studies.memory_key.queue` subprocess jobs (kept, resumed,
their outputs kept under --results with their command line and commit).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from studies.memory_key import queue as mq

REPO = mq.REPO
RESULTS = "studies/sciworld_learning/results"

# The short ScienceWorld families with >= 16 test variations (docs/method.md §11.1: gold
# paths of 5-10 steps); the next shortest with that many (test-conductivity) needs 21 steps.
SCREEN_FAMILIES = ("find-non-living-thing", "lifespan-longest-lived", "lifespan-shortest-lived",
                   "lifespan-longest-lived-then-shortest-lived", "find-animal",
                   "find-living-thing", "find-plant")
SEEDS = dict(strata=(0, 1), grpo=(0, 1))
ARMS = ("grpo", "strata")                          # the order inside a seed round
ARM_TOKENS = dict(strata=("strata",), grpo=("grpo", "matched"))
PROMPTING = dict(strata="strata", grpo="flat")
FAMILIES = "{families}"   # replaced by the screen's chosen families once it ran
# The registered rule: a family qualifies when its start success on the 16 dev variations is
# in [SUCCESS_BAND] or its mean score in [SCORE_BAND]; the qualifying families closest to
# TARGET success are kept, at most MAX_FAMILIES; fewer than MIN_FAMILIES stops the queue.
SUCCESS_BAND, SCORE_BAND, TARGET = (0.10, 0.60), (20.0, 70.0), 0.35
MIN_FAMILIES, MAX_FAMILIES = 2, 3


def registered_args(argv=None) -> argparse.Namespace:
    """The command line; its defaults are the registered setting."""
    return mq.study_args(__doc__, "runs/sciworld_learning", RESULTS, argv,
                         model="qwen2.5-coder-0.5b-instruct", iterations=15,
                         eval_per_family=24, screen_per_family=16)


def common(a, workdir: str, families: str) -> list[str]:
    """The config tokens (configs/sciworld.py) every job shares: the real 0.5B in float32 on
    `families` ("+"-joined) with a 15-step limit, the prompts' sizes, eval settings."""
    return ["tiny", "real", f"model.path={a.model}", f"workdir={workdir}", "seed=0",
            f"env.tasks={families}", "env.max_steps=15", "env.max_prompt_tokens=1536",
            "rollout.format_examples=true", "rollout.max_action_tokens=64",
            "rollout.max_strategy_tokens=128", "rollout.max_judge_tokens=32",
            "env.num_workers=8", "model.dtype=float32", "rollout.sampler_dtype=float32",
            "train.compute_dtype=float32", "eval.temperature=0.4", "eval.max_tasks=0",
            "log.dump_trajectories=1000"]


def warm_start_tokens() -> list[str]:
    """Behaviour cloning (LoRA rank 16) of 28 gold train episodes of the screen families,
    both prompt forms, the kept export named explicitly (no cache lookup)."""
    return ["sft.lora_rank=16", "sft.lora_alpha=64", "sft.episodes=28", "sft.steps=30",
            "sft.batch_size=8", "sft.lr=1e-4", "sft.warmup_steps=5", "sft.noise=0.1",
            "sft.log_every=5", "sft.strategy_mode=both", "sft.max_gold_steps=15"]


def export_dir(a) -> str:
    """Where sft.py writes the warm start's adapter files: under --results (committed)."""
    return os.path.join(os.path.abspath(a.results), "bc_export")


def _cfg(a, algo: str, wd: str, families: str, extra=(), warm_start: str | None = None) -> str:
    """The ``--config=`` argument of a job: `common`, `algo`, the warm start (default: the
    kept export folder) and `extra` tokens."""
    cfg = os.path.join(REPO, "configs", "sciworld.py")
    ws = export_dir(a) if warm_start is None else warm_start
    toks = common(a, wd, families) + [algo, f"model.warm_start={ws}"] + list(extra)
    return f"--config={cfg}:" + ",".join(toks)


def train_tokens(a, arm: str, seed: int) -> tuple[str, ...]:
    """A run's tokens: 1 task x 8 episodes per iteration (StraTA N = 4 strategies of 16
    sampled, M = 2; GRPO matched: 8), LoRA rank 16, lr 2e-5, temperature 0.6, no KL or
    entropy term, 2 optimizer steps per iteration, a checkpoint per iteration."""
    return (f"seed={seed}", f"iterations={a.iterations}", "lora.rank=16", "lora.alpha=64",
            "lora.lr=2e-5", "optim.lr=2e-5", "rollout.tasks_per_batch=1",
            "rollout.num_strategies=4", "rollout.episodes_per_strategy=2",
            "rollout.oversample=4", "rollout.temperature=0.6", "loss.kl_coef=0",
            "loss.entropy_coef=0", "ckpt.every=1", "ckpt.keep=2", "eval.every=0",
            "model.remat=full", "optim.micro_batch_rows=4", "optim.mini_batch_size=60",
            "log.dump_batches=2") + ARM_TOKENS[arm][1:]


def jobs(a) -> list[dict]:
    """The registered queue in order (name, argv, done file; `studies.memory_key.queue`)."""
    py, out = sys.executable, os.path.abspath(a.out)
    screen = "+".join(SCREEN_FAMILIES)
    q = [dict(name="warm_start", done=os.path.join(export_dir(a), "sft_meta.json"),
              argv=[py, os.path.join(REPO, "sft.py"),
                    _cfg(a, "strata", os.path.join(out, "warm_start"), screen,
                         warm_start_tokens(), warm_start="sft"),
                    f"--out={export_dir(a)}"])]

    def evaluate(name, arm, split, families, per_family, extra=(), adapter=None):
        wd = os.path.join(out, name)
        argv = [py, os.path.join(REPO, "eval.py"), _cfg(a, arm, wd, families, extra),
                f"--split={split}", f"--episodes_per_family={per_family}"]
        step = a.iterations if adapter else 0
        return dict(name=name, done=os.path.join(wd, f"eval_{split}_step{step}.json"),
                    argv=argv + ([f"--adapter={adapter}"] if adapter else ["--no_checkpoint"]))

    q.append(evaluate("screen", "strata", "dev", screen, a.screen_per_family))
    q += [evaluate(f"start_{PROMPTING[arm]}", arm, "test", FAMILIES, a.eval_per_family,
                   ARM_TOKENS[arm][1:]) for arm in ("strata", "grpo")]
    for r in range(max(len(s) for s in SEEDS.values())):
        for arm in ARMS:
            seed = SEEDS[arm][r]
            wd = os.path.join(out, f"run_{arm}_s{seed}")
            extra = train_tokens(a, arm, seed)
            q.append(dict(name=f"run_{arm}_s{seed}", done=os.path.join(wd, "DONE"), touch=True,
                          argv=[py, os.path.join(REPO, "train.py"),
                                _cfg(a, arm, wd, FAMILIES, extra)]))
            q.append(evaluate(f"final_{arm}_s{seed}", arm, "test", FAMILIES, a.eval_per_family,
                              extra + ("seed=0",),
                              os.path.join(wd, "adapters", f"step{a.iterations}")))
    return q


def choose_families(screen: dict) -> list[str]:
    """The registered rule on the screen's eval metrics (``eval/family/<f>/success`` in [0, 1],
    ``.../score`` 0-100): the families whose success is in SUCCESS_BAND or whose score is in
    SCORE_BAND, nearest TARGET success first (ties: SCREEN_FAMILIES order), at most
    MAX_FAMILIES. Returns [] when fewer than MIN_FAMILIES qualify."""
    ok = []
    for i, f in enumerate(SCREEN_FAMILIES):
        s = screen.get(f"eval/family/{f}/success")
        sc = screen.get(f"eval/family/{f}/score")
        if s is None or sc is None:
            continue
        if SUCCESS_BAND[0] <= s <= SUCCESS_BAND[1] or SCORE_BAND[0] <= sc <= SCORE_BAND[1]:
            ok.append((round(abs(s - TARGET), 9), i, f))   # a tie is a tie, not float noise
    chosen = [f for _, _, f in sorted(ok)[:MAX_FAMILIES]]
    return chosen if len(chosen) >= MIN_FAMILIES else []


def read_screen(path: str) -> dict:
    """The screen eval's metrics file, checked (`mq.read_eval_numbers`): a JSON object whose
    ``eval/family/<f>/success`` is a finite number in [0, 1] and ``.../score`` a finite number
    in [-100, 100] for every SCREEN_FAMILIES family. Raises ValueError naming the file and the
    entry (a damaged or foreign file chooses no families)."""
    return mq.read_eval_numbers(path, {f"eval/family/{fam}/{key}": rng
                                       for fam in SCREEN_FAMILIES
                                       for key, rng in (("success", (0.0, 1.0)),
                                                        ("score", (-100.0, 100.0)))})


def chosen_families(a) -> list[str] | None:
    """The rule applied to the result of the screen job that finished (here, with its argv
    marker) or is kept under --results, in SCREEN_FAMILIES order; None before it ran. A screen
    file no finished screen job wrote is not read. Raises ValueError for a damaged one."""
    q = jobs(a)
    done = mq.finished_output(a, next(j for j in q if j["name"] == "screen"), q)
    if done is None:
        return None
    chosen = choose_families(read_screen(done))
    return [f for f in SCREEN_FAMILIES if f in chosen]


def resolve(a, job: dict) -> dict | None:
    """`job` with the chosen families in place of `FAMILIES`; None before the screen ran or
    when the rule chose too few (the queue stops: the write-up's step 7 then applies)."""
    fams = chosen_families(a) if any(FAMILIES in x for x in job["argv"]) else None
    return mq.fill_placeholder(job, FAMILIES, "+".join(fams or []))


def _report(a) -> None:
    from studies.sciworld_learning.report import report
    res = report(a)
    print(json.dumps({k: v.get("overall") for k, v in res["policies"].items() if v}, indent=1))


def main(argv=None) -> int:
    return mq.study_main(argv, registered_args, jobs, resolve, _report,
                         listed=lambda a: f"chosen families: {chosen_families(a)}")


if __name__ == "__main__":
    sys.exit(main())
