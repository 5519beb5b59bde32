"""Checkpoints: exact resume, SIGTERM mid-iteration, fallback past a truncated latest step,
restore of an 8-device checkpoint into a 1-device process."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings

import jax
import numpy as np
import pytest

from strata_jax.models import init_params
from strata_jax.sharding import make_mesh
from strata_jax.training import (Checkpointer, NoRestorableCheckpointError, Trainer,
                                 tree_to_numpy)
from tests.fixtures.trainer import TINY, iteration_batch, run_loop, train_config
from tests.fixtures.paths import REPO_ROOT

REPO = REPO_ROOT


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
    ckpt.save(s, sampler_state={"task_index": 17, "order": [3, 1, 2]}, config={"algo": "grpo"},
              trainer_state={"shape_marks": [["train", 2, 64, 8, 16, 0, 24]]})
    ckpt.close()
    del s
    # A fresh trainer / checkpointer, as a new process would build them.
    trainer2 = Trainer(TINY, train_config())
    with Checkpointer(str(tmp_path / "ckpt")) as fresh:
        restored, meta = fresh.restore(trainer2.abstract_state())
    assert meta["step"] == 2 and int(restored.step) == 2
    assert meta["sampler_state"] == {"task_index": 17, "order": [3, 1, 2]}
    assert meta["config"] == {"algo": "grpo"}
    trainer2.set_host_state(meta["trainer_state"])
    assert trainer2.shape_marks == {("train", 2, 64): (8, 16, 0, 24)}
    resumed, _ = trainer2.update(restored, iteration_batch(2), ref_params=params)
    assert int(resumed.step) == 3
    for a, b in zip(_leaves(resumed), _leaves(uninterrupted)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def _two_steps(state0, tmp_path):
    """A keep-3 Checkpointer under tmp_path/ckpt holding step 1 (state0) and step 2 (params + 1),
    with sampler positions 1 and 2. Returns (checkpointer, state 1, state 2)."""
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=3)
    s1 = state0.replace(step=state0.step + 1)
    s2 = state0.replace(step=state0.step + 2,
                        params=jax.tree.map(lambda x: x + 1.0, state0.params))
    ckpt.save(s1, sampler_state={"pos": 1})
    ckpt.save(s2, sampler_state={"pos": 2})
    return ckpt, s1, s2


def test_truncated_latest_falls_back_to_previous(setup, tmp_path):
    params, trainer, state0 = setup
    ckpt, s1, s2 = _two_steps(state0, tmp_path)
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
    proc = subprocess.Popen([sys.executable, "-m", "tests.fixtures.trainer", "sigterm",
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
    res = subprocess.run([sys.executable, "-m", "tests.fixtures.trainer", "restore",
                          str(tmp_path)], cwd=REPO, env=_subprocess_env(1),
                         capture_output=True, text=True, timeout=150)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "RESTORED 5 {'pos': 5}" in res.stdout
    got = np.load(tmp_path / "restored.npz")
    want = _leaves(state)
    assert len(got.files) == len(want)
    for i, w in enumerate(want):
        np.testing.assert_array_equal(got[str(i)], w)


# ------------------------------------------- exception-path saves (LoopCheckpoints via run_loop)


class _InterruptAt:
    """A Trainer whose update raises KeyboardInterrupt when called at iteration `at`."""

    def __init__(self, trainer, at):
        self.trainer, self.at, self.calls = trainer, at, 0

    def update(self, state, batch, ref_params=None):
        self.calls += 1
        if int(state.step) == self.at:
            raise KeyboardInterrupt
        return self.trainer.update(state, batch, ref_params)


def test_exception_path_saves_nothing_when_the_marked_state_was_donated(caplog):
    """train.donate_state: the pre-update state the exception path would save is gone; nothing
    is saved and the log says why (a live marked state is saved as before)."""
    import jax.numpy as jnp

    from strata_jax.training import LoopCheckpoints

    class Recorder:
        every = 0

        def __init__(self):
            self.saved = []

        def save(self, state, sampler_state=None, config=None, trainer_state=None):
            self.saved.append(jax.tree.map(np.asarray, state))

    for donated in (False, True):
        rec = Recorder()
        with pytest.raises(RuntimeError, match="update failed"):
            with LoopCheckpoints(rec) as saves:
                marked = {"w": jnp.arange(3.0)}
                saves.mark(marked, {"position": 4})
                if donated:
                    marked["w"].delete()     # what a donated optimizer step does to its input
                raise RuntimeError("update failed")
        if donated:
            assert rec.saved == [] and "donated to the update" in caplog.text
        else:
            np.testing.assert_array_equal(rec.saved[0]["w"], [0.0, 1.0, 2.0])


def _ten_tasks():
    from envs_bridge import Task
    return [Task("memory_key", f"t{i}", i) for i in range(10)]


def test_exception_path_saves_the_state_before_the_interrupted_iteration(setup, tmp_path):
    # TaskSampler over 10 tasks (seed 0), 2 per iteration, checkpoint every 100 iterations;
    # Ctrl-C in iteration 2: the checkpoint must hold sampler position 4 (iterations 0 and 1)
    # and the state after iteration 1, so the resumed iteration 2 draws the same two tasks.
    from envs_bridge import TaskSampler
    params, trainer, state0 = setup
    drawn = []

    def next_batch(s, sampler):
        drawn.append([t.task_id for t in sampler.sample(2)])
        return iteration_batch(int(s.step))

    sampler = TaskSampler(_ten_tasks(), seed=0)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2, every=100)
    with pytest.raises(KeyboardInterrupt):
        run_loop(_InterruptAt(trainer, 2), state0, lambda s: next_batch(s, sampler),
                 iterations=5, checkpointer=ckpt, ref_params=params,
                 sampler_state=sampler.get_state)
    assert ckpt.all_steps() == [2]
    restored, meta = ckpt.restore(trainer.abstract_state())
    ckpt.close()
    assert meta["sampler_state"]["position"] == 4 and int(restored.step) == 2
    s = state0
    for _ in range(2):
        s, _ = trainer.update(s, iteration_batch(int(s.step)), ref_params=params)
    for a, b in zip(_leaves(restored), _leaves(s)):   # params, optimizer, PRNG, step
        np.testing.assert_array_equal(a, b)
    # The resumed iteration 2 draws what the uninterrupted run's iteration 2 draws.
    uninterrupted = TaskSampler(_ten_tasks(), seed=0)
    want = [[t.task_id for t in uninterrupted.sample(2)] for _ in range(4)]
    assert drawn == want[:3]     # iteration 2 had drawn its tasks when Ctrl-C came
    resumed = TaskSampler(_ten_tasks(), seed=0)
    resumed.set_state(meta["sampler_state"])
    assert [t.task_id for t in resumed.sample(2)] == want[2] != want[3]


def _step_snapshot(step_dir):
    return {os.path.relpath(os.path.join(r, f), step_dir):
            (os.stat(os.path.join(r, f)).st_ino, os.stat(os.path.join(r, f)).st_mtime_ns)
            for r, _, fs in os.walk(step_dir) for f in fs}


def test_a_committed_step_is_never_deleted_and_rewritten(setup, tmp_path, monkeypatch):
    # A finished run's forced final save and the first Ctrl-C after a periodic save hit a step
    # already on disk: it must stay as it is (no delete-then-rewrite window, keep=1).
    params, trainer, state0 = setup
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=1, every=1)
    state, status = run_loop(trainer, state0, lambda s: iteration_batch(int(s.step)),
                             iterations=1, checkpointer=ckpt, ref_params=params)
    assert status == "done" and ckpt.all_steps() == [1]
    before = _step_snapshot(str(tmp_path / "ckpt" / "1"))
    deleted = []
    monkeypatch.setattr(ckpt._mngr, "delete", lambda s: deleted.append(s))
    assert ckpt.save(state) == 1                      # the forced final save of a rerun
    with pytest.raises(KeyboardInterrupt):            # Ctrl-C in the iteration after a save
        run_loop(_InterruptAt(trainer, 1), state, lambda s: iteration_batch(int(s.step)),
                 iterations=3, checkpointer=ckpt, ref_params=params)
    assert deleted == [] and _step_snapshot(str(tmp_path / "ckpt" / "1")) == before
    ckpt.close()


def _largest_data_file(step_dir):
    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(step_dir, "state"))
             for f in fs]
    return max(files, key=os.path.getsize)


def test_same_size_bit_flip_falls_back_with_a_warning_naming_the_file(setup, tmp_path):
    params, trainer, state0 = setup
    ckpt, s1, s2 = _two_steps(state0, tmp_path)
    ckpt.close()
    victim = _largest_data_file(str(tmp_path / "ckpt" / "2"))
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)[0]
        f.seek(size // 2)
        f.write(bytes([byte ^ 0x10]))
    assert os.path.getsize(victim) == size
    with pytest.warns(RuntimeWarning, match=f"step 2 .*{os.path.basename(victim)}"), \
            Checkpointer(str(tmp_path / "ckpt")) as fresh:
        restored, meta = fresh.restore(trainer.abstract_state())
    assert meta["step"] == 1 and meta["sampler_state"] == {"pos": 1}
    for a, b in zip(_leaves(restored.params), _leaves(s1.params)):
        np.testing.assert_array_equal(a, b)


def test_a_step_without_its_manifest_was_never_committed(setup, tmp_path):
    # kill -9 between orbax's commit and the manifest: the step is skipped, and the next save
    # of that step replaces it
    params, trainer, state0 = setup
    with Checkpointer(str(tmp_path / "ckpt"), keep=1) as ckpt:
        ckpt.save(state0.replace(step=state0.step + 1))
        ckpt.save(state0.replace(step=state0.step + 2))
    os.remove(tmp_path / "ckpt" / "2" / "checksums.json")
    # keep=1, yet step 1 was deleted only after step 2 was committed; now nothing verifies:
    # one error naming the file and what to do, no "falling back" warning (nothing is older)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(NoRestorableCheckpointError,
                           match=r"no restorable checkpoint in .*ckpt \(step 2: "
                                 r"CorruptCheckpointError: .*checksums.json is missing.*\)\. "
                                 r"Restore the named file from a copy, or move .* aside"), \
                Checkpointer(str(tmp_path / "ckpt")) as ckpt:
            ckpt.restore(trainer.abstract_state())
    with Checkpointer(str(tmp_path / "ckpt"), keep=1) as ckpt:
        ckpt.save(state0.replace(step=state0.step + 2, params=jax.tree.map(lambda x: x * 2,
                                                                            state0.params)))
        restored, meta = ckpt.restore(trainer.abstract_state())
    assert meta["step"] == 2
    np.testing.assert_array_equal(np.asarray(restored.params["embed"]),
                                  2 * np.asarray(state0.params["embed"]))


def test_full_disk_is_one_clear_error_without_a_second_save(setup, tmp_path, monkeypatch):
    import errno

    from strata_jax.training import CheckpointWriteError
    params, trainer, state0 = setup
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=3, every=1)
    run_loop(trainer, state0, lambda s: iteration_batch(int(s.step)), iterations=1,
             checkpointer=ckpt, ref_params=params)
    good = _step_snapshot(str(tmp_path / "ckpt" / "1"))
    calls = []
    real_save = ckpt._mngr.save

    def full_disk(step, *a, **kw):
        calls.append(step)
        # orbax has created its tmp dir and begun writing when the disk fills
        os.makedirs(tmp_path / "ckpt" / f"{step}.orbax-checkpoint-tmp-123" / "state")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt._mngr, "save", full_disk)
    with pytest.raises(CheckpointWriteError) as err:
        run_loop(trainer, ckpt.restore(trainer.abstract_state())[0],
                 lambda s: iteration_batch(int(s.step)), iterations=3, checkpointer=ckpt,
                 ref_params=params)
    msg = str(err.value)
    assert calls == [2]                                   # no second attempt
    assert str(tmp_path / "ckpt") in msg and "no space left on device" in msg
    need = sum(x.nbytes for x in _leaves(state0)) / 2**20
    assert f"needs ~{need:.1f} MiB" in msg and "\n" not in msg
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["1"]  # no tmp dir, step 1 intact
    assert _step_snapshot(str(tmp_path / "ckpt" / "1")) == good
    monkeypatch.setattr(ckpt._mngr, "save", real_save)
    ckpt.close()


def test_a_step_restore_skipped_as_corrupt_is_replaced_by_the_next_save(setup, tmp_path):
    # resume falls back past a bit-flipped step 2 to step 1; redoing iteration 2 must save step 2
    # again (a "step already on disk" skip would lose it on every rerun)
    params, trainer, state0 = setup
    with Checkpointer(str(tmp_path / "ckpt"), keep=3) as ckpt:
        ckpt.save(state0.replace(step=state0.step + 1))
        ckpt.save(state0.replace(step=state0.step + 2))
    victim = _largest_data_file(str(tmp_path / "ckpt" / "2"))
    with open(victim, "r+b") as f:
        f.seek(7)
        b = f.read(1)[0]
        f.seek(7)
        f.write(bytes([b ^ 1]))
    redone = state0.replace(step=state0.step + 2,
                            params=jax.tree.map(lambda x: x - 3.0, state0.params))
    with Checkpointer(str(tmp_path / "ckpt"), keep=3) as ckpt:
        with pytest.warns(RuntimeWarning, match="step 2"):
            assert ckpt.restore(trainer.abstract_state())[1]["step"] == 1
        ckpt.save(redone)
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        restored, meta = ckpt.restore(trainer.abstract_state())
    assert meta["step"] == 2
    np.testing.assert_array_equal(np.asarray(restored.params["embed"]),
                                  np.asarray(state0.params["embed"]) - 3.0)


def test_tmp_folders_of_cut_short_saves_are_removed_by_the_writer_only(setup, tmp_path):
    """A kill or a full disk mid-save leaves ``<step>.orbax-checkpoint-tmp*``: the run's next
    start (the directory's one writer) removes it; a reader (eval.py) leaves it alone."""
    params, trainer, state0 = setup
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        ckpt.save(state0.replace(step=state0.step + 1))
    left = [tmp_path / "ckpt" / "2.orbax-checkpoint-tmp" / "state",
            tmp_path / "ckpt" / "3.orbax-checkpoint-tmp-1733112000" / "meta"]
    for d in left:
        d.mkdir(parents=True)
        (d / "data").write_bytes(b"x" * 100)
    with Checkpointer(str(tmp_path / "ckpt")) as reader:
        assert reader.restore(trainer.abstract_state())[1]["step"] == 1
    assert all(d.exists() for d in left)
    with Checkpointer(str(tmp_path / "ckpt"), clean_tmp=True) as writer:
        assert writer.restore(trainer.abstract_state())[1]["step"] == 1
        assert sorted(os.listdir(tmp_path / "ckpt")) == ["1"]
        real_save = writer._mngr.save

        def interrupted(step, *a, **kw):   # Ctrl-C while orbax writes step 2
            os.makedirs(tmp_path / "ckpt" / f"{step}.orbax-checkpoint-tmp" / "state")
            raise KeyboardInterrupt
        writer._mngr.save = interrupted
        with pytest.raises(KeyboardInterrupt):
            writer.save(state0.replace(step=state0.step + 2))
        writer._mngr.save = real_save
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["1"]   # removed on the way out too


def test_an_explicit_step_that_cannot_be_restored_is_one_error(setup, tmp_path):
    params, trainer, state0 = setup
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        ckpt.save(state0.replace(step=state0.step + 1))
        with pytest.raises(NoRestorableCheckpointError,
                           match=r"checkpoint step 7 in .* cannot be restored \(step 7: "
                                 r"FileNotFoundError: there is no step 7 \(steps on disk: \[1\]\)"):
            ckpt.restore(trainer.abstract_state(), step=7)
    victim = _largest_data_file(str(tmp_path / "ckpt" / "1"))
    os.remove(victim)
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        with pytest.raises(NoRestorableCheckpointError,
                           match=rf"step 1: CorruptCheckpointError: .*{os.path.basename(victim)} "
                                 r"is missing"):
            ckpt.restore(trainer.abstract_state(), step=1)


def test_orbax_disk_full_records_are_dropped_and_others_kept(caplog):
    """On a full disk orbax logs one error with a traceback per writer thread; the one
    CheckpointWriteError line replaces them. Other orbax errors still reach the log."""
    import logging

    from strata_jax.training import checkpoint as ck
    absl = logging.getLogger("absl")
    absl.addFilter(ck._DISK_FULL_NOISE)
    here = os.path.join(os.path.dirname(ck.ocp.__file__), "future.py")

    def emit(msg, exc=None):
        rec = absl.makeRecord("absl", logging.ERROR, here, 1, msg, (),
                              (type(exc), exc, None) if exc else None)
        absl.handle(rec)

    with caplog.at_level(logging.ERROR, logger="absl"):
        emit("_SignalingThread.run() raised an exception: RESOURCE_EXHAUSTED: Error writing "
             "params.w/0", ValueError("RESOURCE_EXHAUSTED: Failed writing"))
        emit("thread failed", OSError(28, "No space left on device"))
        emit("another orbax failure", ValueError("permission denied"))
    assert [r.getMessage() for r in caplog.records] == ["another orbax failure"]


def _saved_steps(state0, tmp_path, steps):
    """Save `steps` under tmp_path/ckpt (keep them all), params + step at each; returns the
    directory."""
    with Checkpointer(str(tmp_path / "ckpt"), keep=len(steps) + 1) as ckpt:
        for s in steps:
            ckpt.save(state0.replace(step=state0.step + s,
                                     params=jax.tree.map(lambda x: x + s, state0.params)),
                      sampler_state={"pos": s})
    return tmp_path / "ckpt"


def test_swapped_step_folders_are_refused_and_the_next_save_is_written(setup, tmp_path):
    """Folders 5 and 10 swapped (each keeps its manifest, so its checksums match): neither
    folder's name agrees with the step it holds; both are refused with a warning naming both
    numbers, the restore falls back to step 3, and redoing iteration 10 saves it again."""
    params, trainer, state0 = setup
    d = _saved_steps(state0, tmp_path, [3, 5, 10])
    os.rename(d / "5", d / "tmp")
    os.rename(d / "10", d / "5")
    os.rename(d / "tmp", d / "10")
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        with Checkpointer(str(d), keep=5) as ckpt:
            restored, meta = ckpt.restore(trainer.abstract_state())
            assert meta["step"] == 3 and int(restored.step) == 3
            ckpt.save(state0.replace(step=state0.step + 10,
                                     params=jax.tree.map(lambda x: x - 7.0, state0.params)))
    msgs = [str(w.message) for w in got if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 2 and all("\n" not in m for m in msgs)
    assert "step 10" in msgs[0] and "holds step 5" in msgs[0]
    assert "step 5" in msgs[1] and "holds step 10" in msgs[1]
    with Checkpointer(str(d)) as ckpt:
        restored, meta = ckpt.restore(trainer.abstract_state(), step=10)
    assert meta["step"] == 10
    np.testing.assert_array_equal(np.asarray(restored.params["embed"]),
                                  np.asarray(state0.params["embed"]) - 7.0)


def test_a_renamed_step_folder_is_refused(setup, tmp_path):
    params, trainer, state0 = setup
    d = _saved_steps(state0, tmp_path, [5, 10])
    os.rename(d / "10", d / "12")
    with pytest.warns(RuntimeWarning, match=r"step 12 .*holds step 10 .*falling back to step 5"):
        with Checkpointer(str(d)) as ckpt:
            restored, meta = ckpt.restore(trainer.abstract_state())
    assert meta["step"] == 5 and int(restored.step) == 5
    # the meta's step and the state's step are checked apart: a meta rewritten to agree with
    # the folder (its manifest refreshed) still holds a state of step 10
    from strata_jax.training.checkpoint import write_manifest
    meta_file = d / "12" / "meta" / "metadata"
    m = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**m, "step": 12}))
    write_manifest(str(d / "12"))
    with pytest.warns(RuntimeWarning, match=r"step 12 .*state holds step 10"):
        with Checkpointer(str(d)) as ckpt:
            assert ckpt.restore(trainer.abstract_state())[1]["step"] == 5


def test_malformed_shape_marks_are_ignored_with_one_warning(setup, tmp_path):
    """The marks only pre-size padded shapes (the next batches raise them again): a consistent
    checkpoint with malformed marks restores, its marks dropped with one line."""
    params, trainer, state0 = setup
    with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        ckpt.save(state0.replace(step=state0.step + 4), sampler_state={"pos": 4},
                  trainer_state={"shape_marks": [["train", 1, 64]], "other": 1})
    with pytest.warns(RuntimeWarning, match=r"step 4 .*shape marks .*ignored") as got:
        with Checkpointer(str(tmp_path / "ckpt")) as ckpt:
            restored, meta = ckpt.restore(trainer.abstract_state())
    assert len(got) == 1 and "\n" not in str(got[0].message)
    assert meta["step"] == 4 and meta["sampler_state"] == {"pos": 4}
    assert meta["trainer_state"] == {"shape_marks": None, "other": 1}
    fresh = Trainer(TINY, train_config())
    fresh.set_host_state(meta["trainer_state"])
    assert fresh.shape_marks == {}


def _as_format_1(step_dir):
    """What a pre-manifest checkpoint looks like: no checksums.json, meta "format": 1."""
    os.remove(step_dir / "checksums.json")
    meta_file = step_dir / "meta" / "metadata"
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "format": 1}))


def test_format_1_among_format_2_steps_is_refused(setup, tmp_path):
    """Deleting a step's manifest and calling it format 1 must not switch its verification
    off: in a workdir whose other steps are format 2 it is refused (a flipped bit in it would
    otherwise come back), and the restore falls back to the previous good step."""
    params, trainer, state0 = setup
    d = _saved_steps(state0, tmp_path, [1, 2])
    victim = _largest_data_file(str(d / "2"))
    with open(victim, "r+b") as f:
        f.seek(3)
        b = f.read(1)[0]
        f.seek(3)
        f.write(bytes([b ^ 4]))
    _as_format_1(d / "2")
    with pytest.warns(RuntimeWarning, match=r"step 2 .*format 1.*step 1 .*format 2.*falling "
                                            r"back to step 1"):
        with Checkpointer(str(d)) as ckpt:
            restored, meta = ckpt.restore(trainer.abstract_state())
    assert meta["step"] == 1


def test_an_unverified_restore_is_always_warned(setup, tmp_path):
    params, trainer, state0 = setup
    d = _saved_steps(state0, tmp_path, [1, 2])
    _as_format_1(d / "1")
    _as_format_1(d / "2")
    for _ in range(2):   # every restore, not once per process
        with pytest.warns(RuntimeWarning, match=r"step 2 .*no checksum manifest.*unverified"):
            with Checkpointer(str(d)) as ckpt:
                restored, meta = ckpt.restore(trainer.abstract_state())
        assert meta["step"] == 2
    np.testing.assert_array_equal(np.asarray(restored.params["embed"]),
                                  np.asarray(state0.params["embed"]) + 2)


def test_full_disk_late_writers_and_closed_loop_noise_leave_one_line_and_no_tmp(
        setup, tmp_path, monkeypatch, capfd):
    """A full disk seen by orbax's writer threads: some are still writing into the step's tmp
    folder when the save fails (they recreate it after a first removal), and each reports to
    an event loop orbax has closed (an unraisable 'Event loop is closed' per thread). The save
    still ends in one CheckpointWriteError line, nothing else on stderr, and no tmp folder."""
    import errno
    import threading

    from strata_jax.training import CheckpointWriteError
    params, trainer, state0 = setup
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    tmp = tmp_path / "ckpt" / "4.orbax-checkpoint-tmp"
    writers = []

    class _Callback:   # a tensorstore callback into orbax's closed event loop
        def __del__(self):
            raise RuntimeError("Event loop is closed")

    def late_writer():
        time.sleep(0.3)
        (tmp / "state" / "d").mkdir(parents=True, exist_ok=True)
        (tmp / "state" / "d" / "late").write_bytes(b"x" * 10)
        _Callback()

    def full_disk(step, *a, **kw):
        (tmp / "state").mkdir(parents=True)
        for _ in range(5):
            _Callback()
        writers.append(threading.Thread(target=late_writer))
        writers[-1].start()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt._mngr, "save", full_disk)
    with pytest.raises(CheckpointWriteError, match="no space left on device for checkpoint "
                                                   "step 4"):
        ckpt.save(state0.replace(step=state0.step + 4))
    writers[0].join()
    _Callback()   # after the failed save too: its orphaned writers keep reporting
    assert os.listdir(tmp_path / "ckpt") == []
    assert "Event loop is closed" not in capfd.readouterr().err
    ckpt._mngr.save = None   # close() must not write
    ckpt.close()


_TMPFS_SAVE = r"""
import sys, jax, jax.numpy as jnp
from strata_jax.exits import EXIT_REFUSED
from strata_jax.training import Checkpointer, CheckpointWriteError
from strata_jax.training.state import TrainState
params = {f"w{i}": jax.random.normal(jax.random.PRNGKey(i), (256, 1024)) for i in range(96)}
state = TrainState(params=params, opt_state={}, critic_params={}, critic_opt_state={},
                   step=jnp.asarray(3, jnp.int32), rng=jnp.zeros((2,), jnp.uint32))
ckpt = Checkpointer(sys.argv[1], clean_tmp=True)
try:
    ckpt.save(state)
except CheckpointWriteError as e:
    print(e, file=sys.stderr)
    sys.exit(EXIT_REFUSED)
"""


def test_full_tmpfs_is_one_line_exit_2_and_no_tmp_folder(tmp_path):
    """The real thing where a small tmpfs can be mounted (root): 96 MiB of params onto 24 MiB."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        for _ in range(2):   # a writer left behind is a race: two tries
            r = subprocess.run([sys.executable, "-c", _TMPFS_SAVE, str(mnt / "ckpt")],
                               capture_output=True, text=True, env=_subprocess_env(1),
                               timeout=300)
            lines = [x for x in r.stderr.splitlines() if x.strip()]
            assert r.returncode == 2, r.stderr[-2000:]
            assert len(lines) == 1 and "no space left on device for checkpoint step 3" in lines[0]
            assert os.listdir(mnt / "ckpt") == []
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
