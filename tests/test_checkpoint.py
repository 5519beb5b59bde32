"""Checkpoints: exact resume, SIGTERM mid-iteration, fallback past a truncated latest step,
restore of an 8-device checkpoint into a 1-device process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from strata_jax.models import init_params
from strata_jax.sharding import make_mesh
from strata_jax.training import Checkpointer, Trainer, tree_to_numpy
from tests.trainer_fixtures import TINY, iteration_batch, train_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def setup():
    params = init_params(TINY, jax.random.PRNGKey(0))
    trainer = Trainer(TINY, train_config())
    return params, trainer, trainer.init_state(params, jax.random.PRNGKey(1))


def _leaves(tree):
    return jax.tree.leaves(tree_to_numpy(tree))


def _subprocess_env(devices: int) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_resume_equals_uninterrupted(setup, tmp_path):
    params, trainer, state0 = setup
    s = state0
    for _ in range(3):
        s2 = s
        s, _ = trainer.update(s, iteration_batch(int(s.step)), ref_params=params)
    uninterrupted, before_third = s, s2
    # The third iteration moves the params by far more than the resume tolerance.
    moved = max(np.max(np.abs(a - b)) for a, b in zip(_leaves(uninterrupted.params),
                                                       _leaves(before_third.params)))
    assert moved > 1e-4

    s = state0
    for _ in range(2):
        s, _ = trainer.update(s, iteration_batch(int(s.step)), ref_params=params)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2)
    ckpt.save(s, sampler_state={"task_index": 17, "order": [3, 1, 2]}, config={"algo": "grpo"})
    ckpt.close()
    del s
    # A fresh trainer / checkpointer, as a new process would build them.
    trainer2 = Trainer(TINY, train_config())
    with Checkpointer(str(tmp_path / "ckpt")) as fresh:
        restored, meta = fresh.restore(trainer2.abstract_state())
    assert meta["step"] == 2 and int(restored.step) == 2
    assert meta["sampler_state"] == {"task_index": 17, "order": [3, 1, 2]}
    assert meta["config"] == {"algo": "grpo"}
    resumed, _ = trainer2.update(restored, iteration_batch(2), ref_params=params)
    assert int(resumed.step) == 3
    for a, b in zip(_leaves(resumed), _leaves(uninterrupted)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_truncated_latest_falls_back_to_previous(setup, tmp_path):
    params, trainer, state0 = setup
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=3)
    s1 = state0.replace(step=state0.step + 1)
    s2 = state0.replace(step=state0.step + 2,
                        params=jax.tree.map(lambda x: x + 1.0, state0.params))
    ckpt.save(s1, sampler_state={"pos": 1})
    ckpt.save(s2, sampler_state={"pos": 2})
    assert ckpt.all_steps() == [1, 2]
    # Truncate every data file of the latest step (a write cut short by preemption).
    state_dir = tmp_path / "ckpt" / "2" / "state"
    n = 0
    for root, _, files in os.walk(state_dir):
        for f in files:
            if "ocdbt" in root or f.startswith("manifest") or root.endswith("/d"):
                open(os.path.join(root, f), "w").close()
                n += 1
    assert n > 0
    ckpt.close()
    with pytest.warns(RuntimeWarning, match="step 2 .* could not be restored"), \
            Checkpointer(str(tmp_path / "ckpt")) as fresh:
        restored, meta = fresh.restore(trainer.abstract_state())
    assert meta["step"] == 1 and meta["sampler_state"] == {"pos": 1}
    for a, b in zip(_leaves(restored.params), _leaves(s1.params)):
        np.testing.assert_array_equal(a, b)
    # An empty directory restores nothing.
    with Checkpointer(str(tmp_path / "empty")) as empty:
        assert empty.restore(trainer.abstract_state()) is None


def test_sigterm_mid_iteration_checkpoints_and_exits(setup, tmp_path):
    params, trainer, _ = setup
    proc = subprocess.Popen([sys.executable, "-m", "tests.trainer_fixtures", "sigterm",
                             str(tmp_path)], cwd=REPO, env=_subprocess_env(8),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 150
        while not (tmp_path / "started").exists():
            assert proc.poll() is None, proc.communicate()
            assert time.time() < deadline, "driver never reached iteration 2"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)      # during iteration 2 (its batch source sleeps)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "STATUS preempted STEP 3" in out, (out, err[-2000:])
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        assert ckpt.latest_step() == 3
        restored, meta = ckpt.restore(trainer.abstract_state())
    assert int(restored.step) == 3 and meta["sampler_state"] == {"task": 3}
    # The checkpoint holds the state after iteration 2 completed: replay it here.
    s = trainer.init_state(params, jax.random.PRNGKey(1))
    for _ in range(3):
        s, _ = trainer.update(s, iteration_batch(int(s.step)), ref_params=params)
    for a, b in zip(_leaves(restored), _leaves(s)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_restore_8_device_checkpoint_into_1_device_process(setup, tmp_path):
    params, _, _ = setup
    trainer8 = Trainer(TINY, train_config(), mesh=make_mesh({"data": 2, "fsdp": 2, "tensor": 2}))
    state = trainer8.init_state(params, jax.random.PRNGKey(1))
    state = state.replace(step=state.step + 5,
                          params=jax.tree.map(lambda x: 1.5 * x + 0.01, state.params))
    emb = state.params["embed"]
    assert len(emb.sharding.device_set) == 8 and not emb.sharding.is_fully_replicated
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        ckpt.save(state, sampler_state={"pos": 5})
    res = subprocess.run([sys.executable, "-m", "tests.trainer_fixtures", "restore",
                          str(tmp_path)], cwd=REPO, env=_subprocess_env(1),
                         capture_output=True, text=True, timeout=150)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "RESTORED 5 {'pos': 5}" in res.stdout
    got = np.load(tmp_path / "restored.npz")
    want = _leaves(state)
    assert len(got.files) == len(want)
    for i, w in enumerate(want):
        np.testing.assert_array_equal(got[str(i)], w)
