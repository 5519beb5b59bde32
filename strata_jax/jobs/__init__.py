"""The jobs a run is made of, one module each; train.py, eval.py and sft.py parse their flags and
call these (so do the tests and the notebook):

- ``prepare``     the one preflight of every job: `prepare(c, job)` (distributed init, validate,
                  process settings, resolve, env / model path / resume checks, the workdir lock).
- ``assemble``    the one assembly of a run's pieces: `assemble(c, train=..., mesh=...) -> Run`.
- ``train``       the training loop: `run(c)` (rollout -> update -> log -> checkpoint -> eval).
- ``evaluate``    the evaluation job: `run_eval(c, split, step, use_checkpoint)`.
- ``warm_start``  the warm start (`maybe_warm_start`, a step of the assembly) and sft.py's job
                  (`export_warm_start`).
- ``cli``         the entry points' flag parsing (`parse_flags`), `guarded` and the exit codes.

Nothing is imported here: ``cli`` is read before the flags are parsed and stays light; import
the module you need (``from strata_jax.jobs import train``). Source: docs/design.md §2.
"""
