"""The one preflight of every job (train, evaluate, the warm start): everything that is checked or
set up before a piece of the run is built, so that a config that cannot run is one line and
nothing is written to the workdir before the config is known good.

    with prepare(c, "train") as p:      # p.mesh, p.workdir, p.compiles
        ...build and run...

The steps, in order, and which job takes each (`STEPS`):

    distributed init (jax.distributed, before any other JAX use)       train
    validate (every field)                                             all
    compilation cache, host allocator (process-wide settings)          all
    distributed checks (multi-process constraints on the config)       train
    resolve (the algorithm's derived settings)                         all
    the job's own check (`check`, e.g. eval's test-time settings)      all
    eval.adapter's folder: both files, the checksum, the recorded base  evaluate
    env checks (e.g. the WebShop server answers, Java for ScienceWorld)  all
    the task list (an unknown env.split, an env.tasks filter matching nothing)  train
    model path check (a missing path / unreachable hub id)             train
    resume check (the stored run's config can be continued)            train
    compile counter, workdir, workdir lock (+ the resume check again)  train
    the mesh                                                           train, evaluate
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Callable, Iterator

from strata_jax import distributed
from strata_jax import experiment as ex

# Which job runs which optional step (module docstring); the others run in every job.
STEPS = {
    "train": frozenset({"distributed", "env", "tasks", "model_path", "resume", "lock", "mesh"}),
    "evaluate": frozenset({"adapter", "env", "mesh"}),
    "warm_start": frozenset({"env"}),
}


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What a job needs from its preflight.

    Attributes:
      workdir: the run folder (created, and locked by this process, for "train"; the config's
        ``workdir`` as is otherwise).
      mesh: the device mesh of ``c.mesh`` (`experiment.build_mesh`); None for "warm_start"
        (behaviour cloning builds its params unplaced).
      compiles: the installed `strata_jax.metrics.CompileCounter` ("train"), else None.
    """

    workdir: str
    mesh: Any = None
    compiles: Any = None


@contextlib.contextmanager
def prepare(c: Any, job: str, check: Callable[[Any], None] | None = None) -> Iterator[Prepared]:
    """Run the preflight of `job` ("train", "evaluate" or "warm_start": `STEPS`) on config `c`
    (resolved in place) and yield a `Prepared`; the workdir lock ("train", process 0) is held
    until the block exits. `check(c)` is the job's own check, after resolve.

    Raises ConfigError (bad config, a model path that does not resolve, another run on the
    workdir, a resume that would not continue the stored run, an unreachable env server),
    ValueError (a config that cannot run multi-process) and whatever `check` raises, before
    anything is written to the workdir; KeyError for an unknown `job`.
    """
    steps = STEPS[job]
    if "distributed" in steps:
        # Multi-host: jax.distributed from c.distributed / the environment, before any other
        # JAX use; a no-op for one process. See strata_jax/distributed.py.
        distributed.initialize(c)
    ex.validate(c)             # every field, before anything is built or written
    ex.use_compilation_cache(c)
    ex.use_host_allocator(c)
    if "distributed" in steps:
        distributed.check_config(c)
    ex.resolve(c)
    if check is not None:
        check(c)
    if "adapter" in steps and c.eval.get("adapter"):
        from strata_jax.jobs.adapters import check_adapter_config
        check_adapter_config(c)   # a changed file or another base: one line, nothing built
    if "env" in steps:
        ex.check_env(c)        # e.g. the WebShop server answers
    if "tasks" in steps:
        ex.task_list(c)        # the split's tasks exist: refused before the workdir is made
    if "model_path" in steps and c.model.path:
        ex.checkpoint_dir(c)   # a missing path / unreachable hub id: one line, nothing written
    if "resume" in steps:
        ex.check_resume(c, ex.stored_config(os.path.join(c.workdir, "ckpt")))
    if "lock" not in steps:
        yield Prepared(c.workdir, ex.build_mesh(c) if "mesh" in steps else None)
        return
    from strata_jax.metrics import CompileCounter
    compiles = CompileCounter.install()
    workdir = ex.workdir(c)
    # One run per workdir: a second one refuses to start (the lock dies with its holder).
    lock = ex.WorkdirLock(workdir).acquire() if distributed.is_primary() else None
    try:
        # Again under the lock: another run may have written the workdir meanwhile.
        ex.check_resume(c, ex.stored_config(os.path.join(workdir, "ckpt")))
        yield Prepared(workdir, ex.build_mesh(c), compiles)
    finally:
        if lock is not None:
            lock.release()


__all__ = ["prepare", "Prepared", "STEPS"]
