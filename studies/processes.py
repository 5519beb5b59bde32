"""Child jobs of a study queue that die with the queue and that a restarted queue can see.

A queue that is killed (kill -9, an OOM kill, a closed session) must not leave its running job
behind as an orphan that a restarted queue then starts a second time (two train.py on one
workdir, two evals writing the same files). Two pieces, Linux only where noted:

- `start_job` starts the child with a parent-death signal (``prctl(PR_SET_PDEATHSIG,
  SIGTERM)``, Linux): when the queue dies, the child gets SIGTERM, which train.py answers by
  stopping after the iteration in flight with a checkpoint.
- The job's lock file: the queue takes an exclusive ``flock`` on ``.<name>.running`` and hands
  the descriptor to the child, so the lock is held while the child lives, whatever happens to
  the queue. A restarted
  queue asks `running_elsewhere` before starting the job, and `wait_until_free` waits for the
  old child to finish its clean stop.

Source: prctl(2) PR_SET_PDEATHSIG; flock(2) (a lock belongs to the open file description, shared
by every process holding a descriptor of it).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
import signal
import subprocess
from typing import IO, Sequence

_PR_SET_PDEATHSIG = 1   # linux/prctl.h


def _die_with_parent() -> None:
    """preexec_fn of the child: SIGTERM when the parent dies (a no-op where prctl is absent)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def lock_path(out: str, name: str) -> str:
    """The lock file of job `name` under the queue's folder `out`."""
    return os.path.join(out, f".{name}.running")


def running_elsewhere(path: str) -> int | None:
    """The pid recorded in lock file `path` when another process holds its lock (a job still
    running, e.g. the child of a killed queue); None when the lock is free (or no file)."""
    if not os.path.exists(path):
        return None
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        return int(text) if text.isdigit() else -1
    finally:
        os.close(fd)   # closing drops the lock this call may have taken
    return None


def wait_until_free(path: str) -> None:
    """Block until no process holds lock file `path`'s lock."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    finally:
        os.close(fd)


def start_job(argv: Sequence[str], cwd: str, log: IO, lock: str) -> subprocess.Popen:
    """Start `argv` in `cwd` with stdout and stderr to `log`, holding lock file `lock` for as
    long as the child lives (it inherits the locked descriptor), and SIGTERM to the child if
    this process dies.

    Raises BlockingIOError when another process holds `lock` (call `running_elsewhere` first).
    The child's pid is written into the lock file, for the message of a restarted queue."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        proc = subprocess.Popen(list(argv), cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                pass_fds=(fd,), preexec_fn=_die_with_parent)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(proc.pid).encode(), 0)
    finally:
        os.close(fd)   # the child's inherited descriptor keeps the lock
    return proc


__all__ = ["start_job", "running_elsewhere", "wait_until_free", "lock_path"]
