"""strata-jax training: rollout -> update -> metrics -> checkpoint, resumable.

    python train.py --config=configs/sciworld.py:tiny            # CPU smoke run, real ScienceWorld
    python train.py --config=configs/sciworld.py --config.model.path=/ckpt/Qwen2.5-1.5B-Instruct
    python train.py --config=configs/sciworld.py:grpo,matched    # a baseline at the StraTA budget

Every run lives in ``config.workdir``: ``ckpt/`` (orbax), ``metrics.jsonl`` + ``tb/``
(tensorboardX), ``trajectories.jsonl``. Re-running the same command resumes from the newest
restorable checkpoint (raise ``--config.iterations`` to continue a finished run); SIGTERM
(preemption), SIGHUP (a closed terminal or ssh session) and Ctrl-C save and exit after the
iteration in flight, with status 75 (a finished run exits 0; the table: docs/reliability.md).
The job is `strata_jax.jobs.train.run` (also what the notebook and the tests call).
"""
from __future__ import annotations

from absl import app, flags
from ml_collections import config_flags

from strata_jax.jobs.cli import EXIT_FINISHED, EXIT_PREEMPTED, guarded, parse_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file, e.g. configs/sciworld.py:tiny", lock_config=False)
flags.mark_flags_as_required(["config"])


@guarded
def main(argv):
    del argv
    from strata_jax.jobs import train
    from strata_jax.metrics import quiet_logs
    quiet_logs()
    summary = train.run(_CONFIG.value)
    if summary["status"] == "preempted":
        print(f"preempted: step {summary['step']} saved, outputs in {summary['workdir']}; the "
              "same command continues the run")
        return EXIT_PREEMPTED
    print(f"{summary['status']}: step {summary['step']}, outputs in {summary['workdir']}")
    return EXIT_FINISHED


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
