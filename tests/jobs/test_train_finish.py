"""How a training run ends (strata_jax.jobs.train): a stop request (Ctrl-C, SIGTERM) that comes
in the last iteration finishes the run instead of preempting it, and a finished run run again
prints one summary line and does not log its checkpoint a second time.

The loop runs in this process on the built-in memory_key env with the tiny random model, no
warm start, 1 iteration of 1 task (it compiles the sampler and the update, hence slow)."""
import logging

import pytest

from tests.fixtures.small_job import smallest_config

pytestmark = pytest.mark.slow


def _config(workdir):
    return smallest_config(workdir)


class _RequestedFlag:
    """A stop flag whose request (a Ctrl-C) is already in: it came during the iteration."""
    requested = True

    def install(self):
        return self

    def uninstall(self):
        pass


def test_a_stop_in_the_last_iteration_finishes_the_run_and_a_rerun_says_done_once(
        tmp_path, monkeypatch, caplog):
    from strata_jax.jobs import train
    monkeypatch.setattr(train, "stop_flag", lambda: _RequestedFlag())
    with caplog.at_level(logging.INFO):
        summary = train.run(_config(tmp_path / "run"))
    assert (summary["status"], summary["step"]) == ("done", 1)   # not "preempted": nothing left
    assert "stop requested in the last iteration: the run is finished" in caplog.messages
    assert sorted(p.name for p in (tmp_path / "run" / "ckpt").iterdir()
                  if p.name.isdigit()) == ["1"]
    caplog.clear()   # run again: nothing is left to run
    with caplog.at_level(logging.INFO):
        summary = train.run(_config(tmp_path / "run"))
    assert (summary["status"], summary["step"]) == ("done", 1)
    info = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO
            and r.name.startswith("strata_jax")]
    assert not [m for m in info if "already on disk" in m or " at step 1; outputs in " in m], info
    assert f"{tmp_path / 'run'} already finished 1 of 1 iterations; raise --config.iterations " \
           "to continue it" in info
