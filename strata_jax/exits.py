"""Exit statuses and stop signals shared by every entry point (train.py, eval.py, sft.py,
``python -m strata_jax.models.fetch``); `strata_jax.jobs.cli` re-exports them. A module of its own,
importing nothing of the package, so that any module can use it without an import cycle.

Every entry point exits with one of these statuses, so a script can tell the outcomes apart
(docs/reliability.md):

  ====  ==============================================================================
  0     finished
  1     a bug: an unexpected exception, printed with its traceback
  2     refused or bad input: one line on stderr says what to change; nothing was lost
  75    preempted with a checkpoint (SIGTERM, SIGHUP or a first Ctrl-C during training):
        the same command continues the run (75 is sysexits' EX_TEMPFAIL, "retry later")
  130   interrupted at once (a second Ctrl-C; SIGTERM / SIGHUP / Ctrl-C outside the
        training loop): the work in flight is lost, the newest checkpoint is kept
  ====  ==============================================================================
"""
from __future__ import annotations

import signal

EXIT_FINISHED = 0
EXIT_BUG = 1
EXIT_REFUSED = 2
EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 130
# Signals that mean "stop": the training loop turns them into a clean stop with a checkpoint
# (train.py's stop flag); anywhere else they stop at once, through the same path as Ctrl-C
# so that `finally` blocks run (locks, temp folders, child processes). A closed terminal or
# ssh session sends SIGHUP, a scheduler's preemption SIGTERM.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP outside the training loop: raised by `stop_at_once` so that the code
    that handles Ctrl-C (cleanup, the exception-path checkpoint) handles it too."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        """The signal's name, e.g. ``SIGTERM``."""
        return signal.Signals(self.signum).name


def stop_at_once(signum: int, frame: object) -> None:  # noqa: ARG001
    """Signal handler for `STOP_SIGNALS` outside the training loop: raise `Stopped`."""
    raise Stopped(signum)


def install_stop_handlers() -> None:
    """Route `STOP_SIGNALS` to `stop_at_once` (main thread only; a handler someone else
    installed, other than the default or ignore, is left alone). ``nohup`` sets SIGHUP to
    ignore: that is kept, so a run started with nohup survives its terminal."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        return
    for s in STOP_SIGNALS:
        if signal.getsignal(s) is signal.SIG_DFL:
            signal.signal(s, stop_at_once)


def exception_chain(e: BaseException | None):
    """`e`, then each exception it was raised from or during (``__cause__``, else
    ``__context__``), each once. Libraries wrap what ends a run (py4j wraps a Ctrl-C that lands
    in a simulator call, orbax / tensorstore wrap a full disk's OSError): the entry points
    recognise it anywhere in this chain."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


__all__ = ["exception_chain", "EXIT_FINISHED", "EXIT_BUG", "EXIT_REFUSED", "EXIT_PREEMPTED", "EXIT_INTERRUPTED",
           "STOP_SIGNALS", "Stopped", "stop_at_once", "install_stop_handlers"]
