"""strata-jax training: rollout -> update -> metrics -> checkpoint, resumable.

    python train.py --config=configs/sciworld.py:tiny            # CPU smoke run, real ScienceWorld
    python train.py --config=configs/sciworld.py --config.model.path=/ckpt/Qwen2.5-1.5B-Instruct
    python train.py --config=configs/sciworld.py:grpo,matched    # a baseline at the StraTA budget

Every run lives in ``config.workdir``: ``ckpt/`` (orbax), ``metrics.jsonl`` + ``tb/``
(tensorboardX), ``trajectories.jsonl``. Re-running the same command resumes from the newest
restorable checkpoint (raise ``--config.iterations`` to continue a finished run); SIGTERM
(preemption), SIGHUP (a closed terminal or ssh session) and Ctrl-C save and exit after the
iteration in flight, with status 75 (a finished run exits 0; the table: docs/reliability.md).
"""
from __future__ import annotations

import logging
import os
import time

from absl import app, flags
from ml_collections import config_flags

from strata_jax.cli import EXIT_FINISHED, EXIT_PREEMPTED, guarded, parse_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file, e.g. configs/sciworld.py:tiny", lock_config=False)
flags.mark_flags_as_required(["config"])

log = logging.getLogger("strata_jax.train")
TB_EPISODES = 2   # sample episodes per iteration in TensorBoard's text tab


def run(c) -> dict:
    """Train with config `c` until c.iterations (or preemption). Returns a summary dict:
    {"status": "done" | "preempted", "step": int, "workdir": str, "last_metrics": dict}.
    Raises ConfigError (bad config, a model path that does not resolve, another run on the
    workdir, a resume that would not continue the stored run, an unreachable env server) before
    anything is built; nothing is written to the workdir before the config is known good."""
    from strata_jax import experiment as ex
    from strata_jax.metrics import CompileCounter

    # Multi-host: jax.distributed from c.distributed / the environment, before any other JAX
    # use; a no-op for one process. See strata_jax/distributed.py.
    from strata_jax import distributed
    distributed.initialize(c)
    ex.validate(c)             # every field, before anything is built or written
    ex.use_compilation_cache(c)
    ex.use_host_allocator(c)
    distributed.check_config(c)
    ex.resolve(c)
    ex.check_env(c)            # e.g. the WebShop server answers
    if c.model.path:
        ex.checkpoint_dir(c)   # a missing path / unreachable hub id: one line, nothing written
    ex.check_resume(c, ex.stored_config(os.path.join(c.workdir, "ckpt")))
    compiles = CompileCounter.install()
    workdir = ex.workdir(c)
    # One run per workdir: a second one refuses to start (the lock dies with its holder).
    lock = ex.WorkdirLock(workdir).acquire() if distributed.is_primary() else None
    try:
        # Again under the lock: another run may have written the workdir meanwhile.
        ex.check_resume(c, ex.stored_config(os.path.join(workdir, "ckpt")))
        return _train(c, workdir, compiles, mesh=ex.build_mesh(c))
    finally:
        if lock is not None:
            lock.release()


def _train(c, workdir, compiles, mesh) -> dict:
    """The run of `run` once the workdir is locked: setup, resume, then one explicit loop of
    ``rollout -> update -> log -> checkpoint -> eval`` per iteration."""
    import jax

    from envs_bridge.pool import pool_metrics
    from strata_jax import distributed
    from strata_jax import experiment as ex
    from strata_jax.evaluation import eval_tasks, evaluate
    from strata_jax.metrics import MetricsWriter, Progress, cpu_seconds
    from strata_jax.rollout import (RolloutConfig, SamplerPolicy, build_judge_model,
                                    make_prompt_builder, prefix_metrics)
    from strata_jax.sampling import Sampler
    from strata_jax.training import Checkpointer, LoopCheckpoints, Trainer, TrainConfig
    from strata_jax.warm_start import maybe_warm_start

    # --- setup: model, warm start, sampler, trainer, prompts, tasks ------------------------
    tokenizer = ex.build_tokenizer(c)
    model_cfg, init_params = ex.build_model(c, tokenizer, mesh)
    init_params = maybe_warm_start(c, model_cfg, init_params, tokenizer, c.workdir, mesh=mesh)
    sampler_mesh = distributed.local_mesh(mesh)   # rollouts are per host: the sampler stays local
    sampler = Sampler(model_cfg, mesh=sampler_mesh, max_cache_len=ex.max_cache_len(c, model_cfg))
    trainer = Trainer(model_cfg, TrainConfig.from_config(c), mesh)
    rollout_cfg = RolloutConfig.from_config(c)
    builder = make_prompt_builder(tokenizer, c)
    judge = build_judge_model(c, sampler_mesh)   # None: the policy judges itself
    task_sampler = ex.TaskSampler(ex.task_list(c), seed=c.seed)
    # The reference model is the initial policy, frozen (docs/method.md §8.2). With LoRA the
    # frozen base is both the reference and the model the adapters ride on (always passed).
    ref_params = init_params if c.loss.kl_coef or trainer.lora else None

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
        trainer.set_host_state(meta.get("trainer_state"))
        log.info("resumed from step %d in %s", meta["step"], workdir)
    start = int(jax.device_get(state.step))

    def policy_params(state):
        """The sampler's copy of the policy: LoRA adapters merged into the base, cast to the
        sampler dtype, and (multi-host) gathered onto this host's devices."""
        merged = trainer.policy_params(state, init_params)
        local = distributed.to_local(ex.sampler_params(c, merged), model_cfg, sampler_mesh)
        return ex.sampler_layout(c, model_cfg, local)

    policy = SamplerPolicy(sampler, policy_params(state),
                           prefix_cache_mb=c.rollout.prefix_cache_mb)
    # Rows logged after the restored step belong to the lost iterations: drop them on resume.
    writer = MetricsWriter(workdir, enabled=jax.process_index() == 0, resume_step=start)
    progress = Progress(c.iterations, start=start)
    pool = ex.build_pool(c)
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
    flag = _stop_flag().install()
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
                batch = distributed.global_batch(
                    result.batch, mesh, trainer.cfg.score_rows or trainer.cfg.micro_batch_size)
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
                if flag.requested:   # SIGTERM / the first Ctrl-C: save and stop cleanly
                    saves.save(state, task_sampler.get_state(), trainer.host_state())
                    status = "preempted"
                    break
                if saves.due(done) or done == c.iterations:   # the end: saved before its eval
                    saves.save(state, task_sampler.get_state(), trainer.host_state())
                saves.mark(state, task_sampler.get_state(), trainer.host_state())
                # eval (with the updated policy, which the next rollout samples from too)
                policy.set_params(policy_params(state))
                maybe_eval(done)
            if start >= c.iterations:   # nothing to run: the state as it is (a restored step
                # on disk is not saved again)
                saves.save(state, task_sampler.get_state(), trainer.host_state())
    finally:
        flag.uninstall()
        pool.close()
        writer.close()
        ckpt.close()
    step = int(jax.device_get(state.step))
    log.info("%s at step %d; outputs in %s", status, step, workdir)
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
    memory so far (`memory_metrics`), throughputs
    (env steps, sampled and trained tokens per second) and the train episodes' summary."""
    import numpy as np

    from strata_jax.evaluation import summarize
    from strata_jax.metrics import memory_metrics
    from strata_jax.sampling import compiled_program_count

    m = {**result.stats, **metrics, "time/rollout_s": rollout_s, **env_failures,
         "time/iteration_s": iteration_s, "time/iteration_cpu_s": iteration_cpu_s,
         "time/update_s": update_s,
         "compile/sampler_programs": float(compiled_program_count()),
         "compile/count": float(compiles.count), "compile/seconds": compiles.seconds,
         "compile/cache_hits": float(compiles.cache_hits),
         **memory_metrics()}
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
    from strata_jax.trajectories import format_episode

    writer.scalars(step, m)
    dumps = result.dump()[: c.log.dump_trajectories]
    writer.trajectories(step, dumps)
    for k, rec in enumerate(dumps[:TB_EPISODES]):   # TensorBoard's text tab
        writer.text(step, f"episodes/{k}", "```\n" + format_episode(rec) + "\n```")
    progress.update(step, f"return {m.get('rollout/mean_return', float('nan')):+.3f} "
                          f"success {m.get('rollout/success_rate', float('nan')):.2f}")


def _stop_flag():
    """The run's stop flag (`PreemptionFlag` on SIGTERM, SIGHUP and SIGINT): SIGTERM, SIGHUP
    (a closed terminal or ssh session) and the first Ctrl-C ask for a clean stop (the
    iteration in flight finishes, a checkpoint is saved, the run exits 75; one log line says
    so). A second Ctrl-C stops at once (KeyboardInterrupt: the training loop's exception path,
    then one line from `strata_jax.cli.guarded` and status 130)."""
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


@guarded
def main(argv):
    del argv
    from strata_jax.metrics import quiet_logs
    quiet_logs()
    summary = run(_CONFIG.value)
    if summary["status"] == "preempted":
        print(f"preempted: step {summary['step']} saved, outputs in {summary['workdir']}; the "
              "same command continues the run")
        return EXIT_PREEMPTED
    print(f"{summary['status']}: step {summary['step']}, outputs in {summary['workdir']}")
    return EXIT_FINISHED


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
