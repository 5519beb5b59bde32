"""What a resume must match (config fields), and one run per workdir (the lock)."""
import json
import os
import signal
import subprocess
import sys

import pytest

import configs.base as base
from configs import sciworld
from strata_jax import experiment as ex
from tests.fixtures.paths import REPO_ROOT

ROOT = REPO_ROOT

# The decision, field by field: these may differ on resume, every other field must match.
MAY_CHANGE = {"workdir", "iterations", "compilation_cache_dir", "env.num_workers",
              "env.step_timeout_s", "sft.cache_dir",
              "mesh.data", "mesh.fsdp", "mesh.tensor", "ckpt.every", "ckpt.keep", "eval.every",
              "eval.split", "eval.temperature", "eval.max_tasks", "eval.episodes_per_family",
              "eval.strategy_samples", "eval.strategy_choice", "eval.probe_steps", "eval.adapter",
              "log.dump_trajectories", "log.dump_batches", "train.donate_state", "train.scan_layers",
              "train.pack_width",
              "train.response_floor", "optim.micro_batch_rows", "optim.micro_batch_tokens",
              "model.remat",
              "train.score_rows", "train.logprob_chunk", "train.trim_padding",
              "distributed.coordinator_address", "distributed.num_processes",
              "distributed.process_id", "distributed.local_device_ids",
              "distributed.initialization_timeout_s", "host_mmap_threshold_mb"}
MUST_MATCH_EXAMPLES = {"seed", "algo", "model.path", "model.warm_start", "env.split", "env.tasks",
                       "rollout.temperature", "rollout.num_strategies", "adv.std_ddof",
                       "loss.kl_coef", "optim.lr", "optim.mini_batch_size", "lora.rank",
                       "train.compute_dtype", "sft.seed"}


def _changed(v):
    """A different value of the same kind as `v` (as a command-line override would give)."""
    if v is None:
        return 1
    if isinstance(v, bool):
        return not v
    if isinstance(v, (int, float)):
        return v + 1
    if isinstance(v, (tuple, list)):
        return tuple(v) + ("x",)
    return str(v) + "_other"


def _fields(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _fields(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


def _set(c, dotted, value):
    *parents, leaf = dotted.split(".")
    node = c
    for p in parents:
        node = node[p]
    with node.ignore_type():
        node[leaf] = value


def test_every_config_field_is_decided_for_resume():
    c = base.get_base_config()
    stored = json.loads(c.to_json())   # what a checkpoint stores
    fields = list(_fields(c.to_dict()))
    assert MUST_MATCH_EXAMPLES <= set(fields) and MAY_CHANGE <= set(fields)
    refused = set()
    for f in fields:
        c2 = base.get_base_config()
        old = c2
        for k in f.split("."):
            old = old[k]
        _set(c2, f, _changed(old))
        try:
            ex.check_resume(c2, stored)
        except ex.ConfigError as e:
            assert f"{f}: " in str(e) and "new --config.workdir" in str(e), (f, str(e))
            refused.add(f)
    assert set(fields) - refused == MAY_CHANGE
    assert MUST_MATCH_EXAMPLES <= refused
    ex.check_resume(base.get_base_config(), stored)   # the same config resumes


def test_refusal_names_every_differing_field_with_both_values():
    c = sciworld.get_config("tiny")
    stored = json.loads(c.to_json())
    c.optim.lr = 0.5
    c.rollout.temperature = 0.7
    c.iterations = 99          # may change: not named
    with pytest.raises(ex.ConfigError) as err:
        ex.check_resume(c, stored)
    msg = str(err.value)
    assert f"optim.lr: {stored['optim']['lr']!r} -> 0.5" in msg
    assert "rollout.temperature: 1.0 -> 0.7" in msg and "iterations:" not in msg
    # a field the stored config lacks (older code) is not compared
    del stored["rollout"]["temperature"]
    c.optim.lr = stored["optim"]["lr"]
    ex.check_resume(c, stored)


def test_a_checkpoint_stored_with_micro_batch_size_still_resumes():
    """A config stored before optim.micro_batch_size was split (rows / token budget) resumes:
    the old name is read as optim.micro_batch_rows, so its identity is today's."""
    from strata_jax.validation import run_identity
    c = sciworld.get_config("tiny")
    stored = json.loads(c.to_json())
    stored["optim"]["micro_batch_size"] = stored["optim"].pop("micro_batch_rows")
    del stored["optim"]["micro_batch_tokens"]
    assert "optim.micro_batch_size" not in run_identity(stored)
    assert run_identity(stored) == run_identity(c.to_dict())
    ex.check_resume(c, stored)
    c.optim.micro_batch_rows = 4      # a memory knob: may change on resume, under either name
    ex.check_resume(c, stored)


def _hold_lock(workdir):
    code = ("import sys, time; sys.path.insert(0, %r); from strata_jax import experiment as ex; "
            "ex.WorkdirLock(%r).acquire(); print('held', flush=True); time.sleep(120)"
            % (ROOT, str(workdir)))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_run_on_a_workdir_refuses_and_a_killed_holder_leaves_no_stuck_lock(tmp_path):
    proc = _hold_lock(tmp_path)
    try:
        with pytest.raises(ex.ConfigError,
                           match=rf"{tmp_path} is in use by another run \(pid {proc.pid} on "):
            ex.WorkdirLock(str(tmp_path)).acquire()
        # train.run refuses before building anything (no ckpt/, no metrics)
        from strata_jax.jobs import train
        c = sciworld.get_config("tiny")
        c.workdir = str(tmp_path)
        with pytest.raises(ex.ConfigError, match="in use by another run"):
            train.run(c)
        assert sorted(os.listdir(tmp_path)) == [".lock"]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with ex.WorkdirLock(str(tmp_path)) as lock:   # kill -9 released it
        assert open(lock.path).read() == f"pid {os.getpid()} on {os.uname().nodename}"
    ex.WorkdirLock(str(tmp_path)).acquire().release()   # and so does release()
