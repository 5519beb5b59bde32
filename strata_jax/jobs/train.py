"""The training job: rollout -> update -> log -> checkpoint -> eval, resumable (train.py runs it).

Every run lives in ``config.workdir``: ``ckpt/`` (orbax), ``metrics.jsonl`` + ``tb/``
(tensorboardX), ``trajectories.jsonl``, and for a finished LoRA run its final adapters in
``adapters/step<k>/`` (`strata_jax.jobs.adapters`). Running the same config again resumes from
the newest restorable checkpoint (raise ``iterations`` to continue a finished run); SIGTERM
(preemption), SIGHUP (a closed terminal or ssh session) and Ctrl-C save and stop after the
iteration in flight (`stop_flag`; train.py then exits with status 75, the table:
docs/reliability.md).

The preflight is `strata_jax.jobs.prepare`, the pieces come from `strata_jax.jobs.assemble`;
the iterations are written out here, in one loop (`run`).
"""
from __future__ import annotations

import logging
import os
import time

# the logger of train.py's log lines (the name they have always carried)
log = logging.getLogger("strata_jax.train")
TB_EPISODES = 2   # sample episodes per iteration in TensorBoard's text tab


def run(c) -> dict:
    """Train with config `c` until c.iterations (or preemption). Returns a summary dict:
    {"status": "done" | "preempted", "step": int, "workdir": str, "last_metrics": dict}.
    Raises ConfigError (bad config, a model path that does not resolve, another run on the
    workdir, a resume that would not continue the stored run, an unreachable env server) before
    anything is built (`strata_jax.jobs.prepare`); nothing is written to the workdir before the
    config is known good."""
    from strata_jax.jobs.assemble import assemble
    from strata_jax.jobs.prepare import prepare

    with prepare(c, "train") as p:
        # setup: model, warm start, sampler, trainer, prompts, judge, tasks, envs
        r = assemble(c, train=True, mesh=p.mesh)
        try:
            return _train(c, p.workdir, p.compiles, r)
        finally:
            r.pool.close()


def _train(c, workdir, compiles, r) -> dict:
    """The run of `run` once the workdir is locked and the `Run` `r` assembled: resume, then one
    explicit loop of ``rollout -> update -> log -> checkpoint -> eval`` per iteration."""
    import jax

    from envs_bridge.pool import pool_metrics
    from strata_jax import distributed
    from strata_jax import experiment as ex
    from strata_jax.evaluation import eval_tasks, evaluate
    from strata_jax.metrics import MetricsWriter, Progress, cpu_seconds
    from strata_jax.rollout import RolloutConfig, prefix_metrics
    from strata_jax.training import Checkpointer, LoopCheckpoints

    trainer, policy, pool, task_sampler = r.trainer, r.policy, r.pool, r.task_sampler
    builder, judge, mesh, init_params = r.builder, r.judge, r.mesh, r.init_params
    rollout_cfg = RolloutConfig.from_config(c)
    # The reference model is the initial policy, frozen (docs/method.md §8.2). With LoRA the
    # frozen base is both the reference and the model the adapters ride on (always passed).
    ref_params = init_params if trainer.needs_reference else None

    # --- resume: the newest restorable checkpoint, or a fresh state -------------------------
    # This process holds the workdir lock: it is the one writer, so the tmp folders of saves cut
    # short (a kill, a full disk) are its own leftovers and go now.
    ckpt = Checkpointer(os.path.join(workdir, "ckpt"), keep=c.ckpt.keep, every=c.ckpt.every,
                        clean_tmp=True)
    restored = ckpt.restore(trainer.abstract_state(init_params))
    if restored is None:
        state = trainer.init_state(init_params, ex.seed_key(c, 0))
        log.info("fresh run in %s", workdir)
    else:
        state, meta = restored
        if meta.get("sampler_state"):
            try:
                task_sampler.set_state(meta["sampler_state"])
            except ValueError as e:   # another task list: continuing would draw other tasks
                raise ex.ConfigError(f"cannot resume {workdir}: {e}") from None
        trainer.set_host_state(meta.get("trainer_state"), step=int(meta["step"]))
        log.info("resumed from step %d in %s", meta["step"], workdir)
    start = int(jax.device_get(state.step))

    # the sampler's copy of the policy (LoRA merged, sampler dtype, this host's devices, layout)
    policy.set_params(r.copy.of_state(trainer, state, init_params))
    # Rows logged after the restored step belong to the lost iterations: drop them on resume.
    writer = MetricsWriter(workdir, enabled=jax.process_index() == 0, resume_step=start)
    progress = Progress(c.iterations, start=start)
    tasks_for_eval = eval_tasks(c, c.eval.split) if c.eval.every > 0 else []

    def maybe_eval(step):
        """Every eval.every iterations: the eval protocol on eval.split with the policy's
        current params. Skipped at the resume step when its eval row was logged before the kill
        (same params, same key: it would be the same row twice)."""
        if step == start and "eval/success" in writer.resumed_tags:
            return
        if c.eval.every > 0 and step > 0 and step % c.eval.every == 0 and distributed.is_primary():
            m, _ = evaluate(c, policy, pool, builder, tasks_for_eval, key=ex.seed_key(c, 2, step))
            writer.scalars(step, m)
            log.info("eval at step %d: success %.3f score %.2f", step, m["eval/success"],
                     m["eval/score"])

    if start < c.iterations:
        log.info("compiling the sampler and the update for iteration %d (the first iteration "
                 "of a process takes minutes on CPU; later ones are fast) ...", start + 1)
    else:
        log.info("%s already finished %d of %d iterations; raise --config.iterations to "
                 "continue it", workdir, start, c.iterations)

    # --- the loop ----------------------------------------------------------------------------
    flag = stop_flag().install()
    status, last = "done", {}
    try:
        with LoopCheckpoints(ckpt, config=c) as saves:
            saves.mark(state, task_sampler.get_state(), trainer.host_state())
            maybe_eval(start)   # the resume step's eval, when the kill came before it
            for step in range(start, c.iterations):
                # what an exception saves: the state this iteration starts from
                saves.mark(state, task_sampler.get_state(), trainer.host_state())
                t_iter, cpu_iter, counters = time.time(), cpu_seconds(), pool.stats()
                prefix0 = policy.prefix_stats()
                # rollout
                result = _rollout(c, policy, pool, builder, task_sampler, rollout_cfg, step,
                                  judge)
                t_rollout = time.time() - t_iter
                env_failures = pool_metrics(counters, pool.stats())   # crashes, restarts, ...
                env_failures.update(prefix_metrics(prefix0, policy.prefix_stats()))
                # update (multi-host: the hosts' batches become one global batch first)
                t_update = time.time()
                if step < c.log.get("dump_batches", 0):
                    _dump_batch(c, workdir, step, result.batch)
                batch = distributed.global_batch(result.batch, mesh, trainer.score_chunk)
                state, metrics = trainer.update(state, batch, ref_params)
                done = int(jax.device_get(state.step))
                # log
                t_done = time.time()
                last = _iteration_metrics(
                    c, result, metrics, env_failures, compiles, rollout_s=t_rollout,
                    update_s=t_done - t_update, iteration_s=t_done - t_iter,
                    iteration_cpu_s=cpu_seconds() - cpu_iter)
                _log_iteration(c, writer, progress, done, last, result)
                # checkpoint
                if flag.requested and done < c.iterations:   # SIGTERM / the first Ctrl-C:
                    saves.save(state, task_sampler.get_state(), trainer.host_state())
                    status = "preempted"                       # save and stop cleanly
                    break
                if flag.requested:   # in the last iteration: nothing is left, the run finishes
                    log.info("stop requested in the last iteration: the run is finished")
                if saves.due(done) or done == c.iterations:   # the end: saved before its eval
                    saves.save(state, task_sampler.get_state(), trainer.host_state())
                saves.mark(state, task_sampler.get_state(), trainer.host_state())
                # eval (with the updated policy, which the next rollout samples from too)
                policy.set_params(r.copy.of_state(trainer, state, init_params))
                maybe_eval(done)
            if start >= c.iterations and restored is None:   # nothing to run, nothing on
                # disk (iterations=0): the initial state; a restored step is on disk already
                saves.save(state, task_sampler.get_state(), trainer.host_state())
    finally:
        flag.uninstall()
        writer.close()
        ckpt.close()
    step = int(jax.device_get(state.step))
    if status == "done" and trainer.lora:   # the final adapters as files (PEFT's layout)
        from strata_jax.jobs.adapters import export_run_adapters
        from strata_jax.jobs.warm_start import export_name
        out = export_run_adapters(c, workdir, r.model, trainer.cfg.lora, state.params,
                                  init_params, step, export_name(c, r.model))
        if out:
            log.info("adapters of step %d in %s", step, out)
    # debug: the entry point prints the one summary line ("done: step N, outputs in ...")
    log.debug("%s at step %d; outputs in %s", status, step, workdir)
    return {"status": status, "step": step, "workdir": workdir, "last_metrics": last}


def _rollout(c, policy, pool, builder, task_sampler, rollout_cfg, step, judge=None):
    """Iteration `step`'s rollout: this host's tasks played with the current policy."""
    import jax

    from strata_jax import distributed
    from strata_jax import experiment as ex
    from strata_jax.rollout import collect_rollout, rollout

    key = ex.seed_key(c, 1, step)
    if jax.process_count() > 1:
        # Multi-host: every host draws the same global task list and rolls out its share
        # (task uids stay global, so row keys and group ids match a single-process run).
        mine, uid0 = distributed.host_share(task_sampler.sample(c.rollout.tasks_per_batch))
        return collect_rollout(policy, pool, builder, mine, key=key, config=rollout_cfg,
                               task_uid_start=uid0, judge=judge)
    return rollout(policy, pool, builder, task_sampler.sample, key=key, config=rollout_cfg,
                   judge=judge)


def _dump_batch(c, workdir: str, step: int, batch) -> None:
    """Write iteration `step`'s rollout SampleBatch (this host's rows) for replay
    (`log.dump_batches`; `strata_jax.algos.load_sample_batch` reads it back)."""
    import os

    import jax

    from strata_jax.algos import save_sample_batch

    out = os.path.join(workdir, "batches")
    os.makedirs(out, exist_ok=True)
    host = f"_host{jax.process_index()}" if jax.process_count() > 1 else ""
    save_sample_batch(batch, os.path.join(out, f"iter_{step:04d}{host}.npz"), iteration=step,
                      algo=c.algo, env=c.env.name, model=c.model.path or c.model.preset)


def _iteration_metrics(c, result, metrics, env_failures, compiles, *, rollout_s, update_s,
                       iteration_s, iteration_cpu_s) -> dict:
    """One iteration's metrics row: the rollout's stats, the update's metrics, env failure
    counters, wall / CPU seconds (this process + its JVMs), compile counts, peak host / device
    memory so far (`memory_metrics`) and what holds it now (`host_memory_parts`), throughputs
    (env steps, sampled and trained tokens per second) and the train episodes' summary."""
    import numpy as np

    from strata_jax.evaluation import summarize
    from strata_jax.host_memory import release_free_memory
    from strata_jax.metrics import host_memory_parts, memory_metrics
    from strata_jax.sampling import compiled_program_count

    m = {**result.stats, **metrics, "time/rollout_s": rollout_s, **env_failures,
         "time/iteration_s": iteration_s, "time/iteration_cpu_s": iteration_cpu_s,
         "time/update_s": update_s,
         "compile/sampler_programs": float(compiled_program_count()),
         "compile/count": float(compiles.count), "compile/seconds": compiles.seconds,
         "compile/cache_hits": float(compiles.cache_hits),
         # the arenas' free pages (the last checkpoint save's, the update's) go back first
         **release_free_memory(), **memory_metrics(), **host_memory_parts()}
    steps = max(result.stats.get("rollout/steps", 0.0), 1.0)
    m["perf/env_steps_per_s"] = steps / max(rollout_s, 1e-9)
    generated = float(np.sum(np.asarray(result.batch.response_mask)))
    m["perf/sampler_tokens_per_s"] = generated / max(result.stats.get("time/sampler_s", 0), 1e-9)
    # train/tokens is a mean over the iteration's optimizer steps: x steps = every response
    # token the update trained on (each epoch's pass counted), over the update's wall time
    trained = m.get("train/tokens", 0.0) * m.get("optimizer_steps", 1.0)
    m["perf/train_tokens_per_s"] = trained / max(update_s, 1e-9)
    m.update(summarize(result.trajectories, c.env.name, prefix="train"))
    return m


def _log_iteration(c, writer, progress, step, m, result) -> None:
    """Write the metrics row, the trajectory dumps and TensorBoard's sample episodes of
    iteration `step`, and advance the progress line."""
    from strata_jax.evaluation.protocol import SCORE_SCALE
    from strata_jax.trajectories import format_episode

    writer.scalars(step, m)
    dumps = result.dump()[: c.log.dump_trajectories]
    writer.trajectories(step, dumps)
    for k, rec in enumerate(dumps[:TB_EPISODES]):   # TensorBoard's text tab
        writer.text(step, f"episodes/{k}", "```\n" + format_episode(rec) + "\n```")
    scale = SCORE_SCALE.get(c.env.name)   # eval prints the env's own score; say the relation
    progress.update(step, f"return {m.get('rollout/mean_return', float('nan')):+.3f} "
                          + (f"(0-1: score / {scale:g}) " if scale else "")
                          + f"success {m.get('rollout/success_rate', float('nan')):.2f}")


def stop_flag():
    """The run's stop flag (`PreemptionFlag` on SIGTERM, SIGHUP and SIGINT): SIGTERM, SIGHUP
    (a closed terminal or ssh session) and the first Ctrl-C ask for a clean stop (the
    iteration in flight finishes, a checkpoint is saved, the run exits 75; one log line says
    so). A second Ctrl-C stops at once (KeyboardInterrupt: the training loop's exception path,
    then one line from `strata_jax.jobs.cli.guarded` and status 130)."""
    import signal

    from strata_jax.training import PreemptionFlag

    class StopFlag(PreemptionFlag):
        def _handler(self, signum, frame):
            if signum != signal.SIGINT:
                return super()._handler(signum, frame)
            if self.requested:
                raise KeyboardInterrupt
            log.warning("Ctrl-C: stopping after this iteration, with a checkpoint (Ctrl-C "
                        "again stops at once)")
            self._event.set()

    return StopFlag((signal.SIGTERM, signal.SIGHUP, signal.SIGINT))


__all__ = ["run", "stop_flag", "TB_EPISODES"]
