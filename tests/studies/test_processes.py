"""A study queue's child dies with the queue, and a restarted queue sees a child that still runs
(`studies.processes`)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from studies.processes import running_elsewhere, start_job, wait_until_free
from tests.fixtures.paths import REPO_ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="parent-death signal and flock: Linux")

# A queue process: starts one job (the given child code) and prints the child's pid, then waits.
QUEUE = """
import sys, time
from studies.processes import start_job
with open(sys.argv[2], "a") as log:
    proc = start_job([sys.executable, "-c", sys.argv[1]], ".", log, sys.argv[3])
print(proc.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:   # a zombie is dead too
        return f.read().split(") ", 1)[1].split()[0] != "Z"


def _wait(cond, timeout=20.0):
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def _queue(tmp_path, child_code):
    lock = str(tmp_path / ".job.running")
    q = subprocess.Popen([sys.executable, "-c", QUEUE, child_code, str(tmp_path / "log"), lock],
                         cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": REPO_ROOT})
    return q, int(q.stdout.readline()), lock


def test_the_child_dies_when_the_queue_is_killed(tmp_path):
    q, child, lock = _queue(tmp_path, "import time; time.sleep(120)")
    assert _alive(child) and running_elsewhere(lock) == child
    q.send_signal(signal.SIGKILL)
    q.wait()
    assert _wait(lambda: not _alive(child)), "the job outlived its queue"
    assert running_elsewhere(lock) is None


def test_a_restarted_queue_sees_a_job_finishing_its_clean_stop(tmp_path):
    """A child that takes a while to stop on SIGTERM (train.py finishing its iteration): its
    lock stays held after the queue died, until it exits; then it is free."""
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1.5), sys.exit(75)))\n"
            "time.sleep(120)\n")
    q, child, lock = _queue(tmp_path, code)
    time.sleep(0.5)   # the child's handler is installed
    q.send_signal(signal.SIGKILL)
    q.wait()
    assert running_elsewhere(lock) == child   # still stopping: a new queue must not start it
    wait_until_free(lock)
    assert _wait(lambda: not _alive(child))
    assert running_elsewhere(lock) is None
    with open(tmp_path / "log", "a") as log:   # a free lock: the job can be started again
        again = start_job([sys.executable, "-c", "pass"], REPO_ROOT, log, lock)
    assert again.wait(timeout=30) == 0
