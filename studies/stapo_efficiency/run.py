"""STAPO's sample efficiency: PPO, STAPO and STAPO with its replay pool on guess_number, from
one behaviour-cloned Qwen2.5-Coder-0.5B (LoRA, kept), matched env episodes, held-out success
against env episodes and against the update tokens computed (the write-up and the
pre-registration: studies/stapo_efficiency/README.md).

    nohup python -m studies.stapo_efficiency.run > runs/stapo_efficiency.log 2>&1 &   # run / continue
    python -m studies.stapo_efficiency.run --list      # the queue's jobs and their state

The defaults are the registered setting. The queue, in order: the warm start (`sft.py`, LoRA
adapter files written straight under --results); its check on the dev split; when the check
falls outside `DEV_BAND`, the one registered rebuild and its check (`rebuild_tokens`; the queue
stops after the first check and lists them when started again); the start on the test split;
per seed round the arms' runs (`ARMS`), each with its test evals every 4 iterations
(``eval.every``). Jobs are `studies.memory_key.queue` subprocess jobs (kept, resumed, their
outputs kept under --results with their command line and commit).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from studies.memory_key import queue as mq

REPO = mq.REPO
RESULTS = "studies/stapo_efficiency/results"

SEEDS = dict(ppo=(0, 1, 2), stapo=(0, 1, 2), stapo_replay=(0, 1, 2))
ARMS = ("ppo", "stapo", "stapo_replay")            # the order inside a seed round
ARM_TOKENS = dict(ppo=("ppo",), stapo=("stapo",), stapo_replay=("stapo", "replay.enabled=true"))
DEV_BAND = (0.15, 0.70)      # the warm start's dev success that the arms start from
WARM = "{warm_start}"        # replaced by the chosen warm start's folder once it is known


def registered_args(argv=None) -> argparse.Namespace:
    """The command line; its defaults are the registered setting."""
    return mq.study_args(__doc__, "runs/stapo_efficiency", RESULTS, argv,
                         model="qwen2.5-coder-0.5b-instruct", iterations=12, test_episodes=48,
                         dev_episodes=48)


def common(a, workdir: str) -> list[str]:
    """The config tokens (configs/builtin.py) every job shares: the real 0.5B in float32 on
    guess_number (1-64) with a 7-step limit, flat prompts holding the whole trajectory, the
    critic a value head, eval settings."""
    return ["tiny", "real", f"model.path={a.model}", f"workdir={workdir}", "seed=0",
            "env.name=guess_number", "env.max_steps=7", "env.max_prompt_tokens=1024",
            "rollout.cumulative_prompts=true", "rollout.format_examples=true",
            "rollout.max_action_tokens=32", "env.num_workers=48", "train.critic=head",
            "model.dtype=float32", "rollout.sampler_dtype=float32",
            "train.compute_dtype=float32", "eval.temperature=0.4",
            f"eval.max_tasks={a.test_episodes}", "log.dump_trajectories=1000"]


def warm_start_tokens() -> list[str]:
    """Behaviour cloning (LoRA rank 16) of the noisy binary-search expert on 32 train episodes,
    flat rows only, no judge rows."""
    return ["sft.lora_rank=16", "sft.lora_alpha=64", "sft.episodes=32", "sft.steps=30",
            "sft.batch_size=8", "sft.lr=1e-4", "sft.warmup_steps=5", "sft.noise=0.3",
            "sft.log_every=5", "sft.strategy_mode=flat", "sft.judge=false"]


def rebuild_tokens(dev_success: float) -> list[str]:
    """The one registered rebuild for a dev success outside DEV_BAND: noisier (0.6) above it,
    longer (60 steps) below it; later tokens override the first build's."""
    return ["sft.noise=0.6"] if dev_success > DEV_BAND[1] else ["sft.steps=60"]


def export_dir(a, name: str = "bc_export") -> str:
    """Where sft.py writes a warm start's adapter files: under --results (committed)."""
    return os.path.join(os.path.abspath(a.results), name)


def _cfg(a, algo: str, wd: str, extra=(), warm_start: str = WARM) -> str:
    cfg = os.path.join(REPO, "configs", "builtin.py")
    toks = common(a, wd) + [algo, f"model.warm_start={warm_start}"] + list(extra)
    return f"--config={cfg}:" + ",".join(toks)


def train_tokens(a, arm: str, seed: int) -> tuple[str, ...]:
    """A run's tokens: 4 tasks x 4 episodes per iteration, LoRA rank 16, lr 2e-5 (critic
    1e-5), temperature 0.6, no KL or entropy term, 2 optimizer steps per iteration (~60 step
    rows of the 16 episodes' at most 112), held-out evals every 4 iterations."""
    return (f"seed={seed}", f"iterations={a.iterations}", "lora.rank=16", "lora.alpha=64",
            "lora.lr=2e-5", "optim.lr=2e-5", "optim.critic_lr=1e-5",
            "rollout.tasks_per_batch=4", "rollout.group_size=4", "rollout.temperature=0.6",
            "loss.kl_coef=0", "loss.entropy_coef=0", "ckpt.every=1", "ckpt.keep=2",
            "eval.every=4", "model.remat=full", "optim.micro_batch_rows=8",
            "optim.mini_batch_size=56", "log.dump_batches=2") + ARM_TOKENS[arm][1:]


def _sft_job(a, name: str, extra=()) -> dict:
    py, out = sys.executable, os.path.abspath(a.out)
    return dict(name=name, done=os.path.join(export_dir(a, name), "sft_meta.json"),
                argv=[py, os.path.join(REPO, "sft.py"),
                      _cfg(a, "ppo", os.path.join(out, name), list(warm_start_tokens())
                           + list(extra), warm_start="sft"),
                      f"--out={export_dir(a, name)}"])


def _eval_job(a, name: str, split: str, episodes: int, warm_start: str) -> dict:
    py, out = sys.executable, os.path.abspath(a.out)
    wd = os.path.join(out, name)
    return dict(name=name, done=os.path.join(wd, f"eval_{split}_step0.json"),
                argv=[py, os.path.join(REPO, "eval.py"),
                      _cfg(a, "ppo", wd, warm_start=warm_start), f"--split={split}",
                      f"--episodes_per_family={episodes}", "--no_checkpoint"])


def jobs(a) -> list[dict]:
    """The registered queue in order (name, argv, done file; `studies.memory_key.queue`);
    the rebuild and its check only once the first check says they are needed."""
    py, out = sys.executable, os.path.abspath(a.out)
    q = [_sft_job(a, "bc_export"),
         _eval_job(a, "dev_check", "dev", a.dev_episodes, export_dir(a))]
    first = dev_success(a, q, "dev_check")
    if first is not None and not DEV_BAND[0] <= first <= DEV_BAND[1]:
        q += [_sft_job(a, "bc_rebuild", rebuild_tokens(first)),
              _eval_job(a, "dev_check_rebuild", "dev", a.dev_episodes,
                        export_dir(a, "bc_rebuild"))]
    q.append(_eval_job(a, "start", "test", a.test_episodes, WARM))
    for r in range(max(len(s) for s in SEEDS.values())):
        for arm in ARMS:
            seed = SEEDS[arm][r]
            wd = os.path.join(out, f"run_{arm}_s{seed}")
            q.append(dict(name=f"run_{arm}_s{seed}", done=os.path.join(wd, "DONE"), touch=True,
                          argv=[py, os.path.join(REPO, "train.py"),
                                _cfg(a, ARM_TOKENS[arm][0], wd, train_tokens(a, arm, seed))]))
    return q


def read_success(path: str) -> float:
    """``eval/success`` of an eval file, a finite number in [0, 1] (`mq.read_eval_numbers`).
    Raises ValueError naming the file and what to do."""
    return float(mq.read_eval_numbers(path, {"eval/success": (0.0, 1.0)})["eval/success"])


def dev_success(a, q: list[dict], name: str) -> float | None:
    """The dev success of check job `name` of queue `q` when it finished here (its argv
    marker) or is kept under --results; None before. A file no finished job wrote is not read."""
    done = mq.finished_output(a, next(j for j in q if j["name"] == name), q)
    return None if done is None else read_success(done)


def chosen_warm_start(a) -> str | None:
    """The registered choice: the first build when its dev check is inside DEV_BAND, else the
    rebuild (whatever its check says, once it ran); None while that is not known yet."""
    q = jobs(a)
    first = dev_success(a, q, "dev_check")
    if first is None:
        return None
    if DEV_BAND[0] <= first <= DEV_BAND[1]:
        return export_dir(a)
    return export_dir(a, "bc_rebuild") if dev_success(a, q, "dev_check_rebuild") is not None \
        else None


def resolve(a, job: dict) -> dict | None:
    """`job` with the chosen warm start in place of `WARM`; None before it is known (the
    queue stops; started again, it lists the rebuild when the first check asks for one)."""
    ws = chosen_warm_start(a) if any(WARM in x for x in job["argv"]) else None
    return mq.fill_placeholder(job, WARM, ws)


def _report(a) -> None:
    print(json.dumps({"warm_start": chosen_warm_start(a)}, indent=1))


def main(argv=None) -> int:
    return mq.study_main(argv, registered_args, jobs, resolve, _report,
                         listed=lambda a: f"warm start: {chosen_warm_start(a)}")


if __name__ == "__main__":
    sys.exit(main())
