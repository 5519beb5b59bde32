"""Multi-host: settings from config / environment, the per-host task split, global batch padding,
and the end-to-end check: two processes on localhost (4 fake CPU devices each, gloo collectives)
run one iteration and end with the same params as one process with 8 devices.

Run as a module from the repo root, this is the per-process driver:
    python -m tests.test_distributed <process_id> <num_processes> <port> <workdir>
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from tests.fixtures.paths import REPO_ROOT

ROOT = REPO_ROOT


def small_config(workdir: str):
    """configs/builtin.py:tiny shrunk to one fast iteration on memory_key: 2 tasks x N=2 x M=2,
    3 env steps, short generations, fp32 everywhere, a pure data-parallel mesh, one optimizer
    step (mini-batch larger than the batch).

    AdamW's first step is lr * g / (|g| + eps): with torch's eps 1e-8 an element whose gradient
    is ~1e-9 turns float-summation noise (different row placement, different all-reduce order)
    into an lr-sized difference. eps 1e-3 with lr 1 keeps the step smooth in g (an SGD-like
    step of lr / eps) while still moving the params by far more than the 1e-6 tolerance."""
    import ml_collections

    from configs import builtin
    c = builtin.get_config("tiny")
    c.workdir = workdir
    c.iterations = 1
    c.model.warm_start = ""
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
    c.env.name = "memory_key"
    c.env.max_steps = 3
    c.env.num_workers = 4
    c.rollout.tasks_per_batch = 2
    c.rollout.num_strategies = 2
    c.rollout.episodes_per_strategy = 2
    c.rollout.oversample = 2
    c.rollout.group_size = 4
    c.rollout.max_action_tokens = 12
    c.rollout.max_strategy_tokens = 12
    c.rollout.max_judge_tokens = 8
    if "sampler_dtype" in c.rollout:
        c.rollout.sampler_dtype = "float32"
    c.train.compute_dtype = "float32"
    c.optim.mini_batch_size = 4096
    c.optim.micro_batch_rows = 8
    c.optim.lr = 1.0
    c.train.adam_eps = 1e-3
    c.rollout.self_judgment = False    # one sampler program less to compile
    c.ckpt.every = 1
    c.eval.every = 0
    c.log.dump_trajectories = 64
    return c


def _driver(pid: int, n: int, port: int, workdir: str) -> None:
    from strata_jax.jobs import train
    c = small_config(workdir)
    c.distributed.coordinator_address = f"localhost:{port}"
    c.distributed.num_processes = n
    c.distributed.process_id = pid
    summary = train.run(c)
    print(f"DRIVER {pid} {summary['status']} {summary['step']}", flush=True)


# ----------------------------------------------------------------------------- fast unit tests


def test_settings_from_config_and_environment():
    import ml_collections

    from strata_jax.distributed import settings
    c = ml_collections.ConfigDict({"distributed": dict(coordinator_address="", num_processes=-1,
                                                       process_id=-1, local_device_ids=(),
                                                       initialization_timeout_s=300)})
    assert not settings(c, environ={}).multi_process          # one process: a no-op
    s = settings(c, environ={"JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234",
                             "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"})
    assert (s.coordinator_address, s.num_processes, s.process_id) == ("10.0.0.2:1234", 4, 3)
    assert s.multi_process
    c.distributed.process_id = 1                               # config wins over environment
    assert settings(c, environ={"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2",
                                "JAX_PROCESS_ID": "0"}).process_id == 1
    c.distributed.coordinator_address = "auto"                 # TPU pods / SLURM detection
    assert settings(c, environ={}).multi_process
    c.distributed.coordinator_address = "h:1"
    c.distributed.process_id = -1
    with pytest.raises(ValueError, match="num_processes"):
        settings(c, environ={})
    c.distributed.num_processes, c.distributed.process_id = 2, 2
    with pytest.raises(ValueError, match=r"process_id=2 must be in \[0, 2\)"):
        settings(c, environ={})


def test_host_share_union_is_the_global_list():
    from envs_bridge import TaskSampler
    from envs_bridge.registry import get_env_factory
    from strata_jax.distributed import host_share
    tasks = get_env_factory("memory_key").task_list("train")
    drawn = TaskSampler(tasks, seed=3).sample(6)
    shares = [host_share(drawn, p, 3) for p in range(3)]
    assert [uid for _, uid in shares] == [0, 2, 4]
    assert [t for share, _ in shares for t in share] == drawn
    with pytest.raises(ValueError, match="evenly"):
        host_share(drawn, 0, 4)


# ----------------------------------------------------------------------------- two processes vs one


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _restore(c, step):
    import jax

    from strata_jax import experiment as ex
    from strata_jax.training import Checkpointer, Trainer, TrainConfig, tree_to_numpy
    model_cfg, params = ex.build_model(c, ex.build_tokenizer(c), None)
    trainer = Trainer(model_cfg, TrainConfig.from_config(c), None)
    with Checkpointer(os.path.join(c.workdir, "ckpt")) as ckpt:
        state, meta = ckpt.restore(trainer.abstract_state(params), step=step)
    return (jax.tree.leaves(tree_to_numpy(state.params)), jax.tree.leaves(tree_to_numpy(params)),
            meta)


@pytest.mark.slow
def test_two_processes_equal_one_process_with_8_devices(tmp_path):
    import jax

    from strata_jax.jobs import train
    from strata_jax.metrics import read_jsonl
    assert jax.device_count() == 8
    port = _free_port()
    multi = str(tmp_path / "multi")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # as a module from the repo root: run as a script, tests/ would come first on sys.path and
    # its envs_bridge/ test folder would shadow the envs_bridge package
    procs = [subprocess.Popen([sys.executable, "-m", "tests.test_distributed", str(pid), "2",
                               str(port), multi], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for pid in range(2)]
    try:
        single = small_config(str(tmp_path / "single"))      # this process: 8 devices
        summary = train.run(single)
        assert summary["status"] == "done" and summary["step"] == 1
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for pid, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"DRIVER {pid} done 1" in out, out[-4000:]

    got, init, meta_multi = _restore(small_config(multi), 1)
    want, _, meta_single = _restore(single, 1)
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(want, init))
    assert moved > 1e-2                          # 10^4 x the tolerance below
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    assert meta_multi["sampler_state"] == meta_single["sampler_state"]

    # Metrics logged once (process 0), from the global update.
    rows_m = read_jsonl(os.path.join(multi, "metrics.jsonl"))
    rows_s = read_jsonl(os.path.join(single.workdir, "metrics.jsonl"))
    assert [r["step"] for r in rows_m] == [1]
    for k in ("train/loss", "train/tokens", "optimizer_steps"):
        np.testing.assert_allclose(rows_m[0][k], rows_s[0][k], rtol=1e-5)
    # Process 0 rolled out its share (task uid 0) exactly as the single process did.
    dumped = read_jsonl(os.path.join(multi, "trajectories.jsonl"))
    ref = read_jsonl(os.path.join(single.workdir, "trajectories.jsonl"))
    assert {t["task_uid"] for t in dumped} == {0} and {t["task_uid"] for t in ref} == {0, 1}
    key = lambda t: (t["task_uid"], t["trajectory_id"])  # noqa: E731
    mine = sorted(dumped, key=key)
    theirs = sorted([t for t in ref if t["task_uid"] == 0], key=key)
    assert [(t["strategy"], [s["action"] for s in t["steps"]]) for t in mine] == \
        [(t["strategy"], [s["action"] for s in t["steps"]]) for t in theirs]


if __name__ == "__main__":
    _driver(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
