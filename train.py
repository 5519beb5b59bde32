"""strata-jax training: rollout -> update -> metrics -> checkpoint, resumable.

    python train.py --config=configs/sciworld.py:tiny            # CPU smoke run, real ScienceWorld
    python train.py --config=configs/sciworld.py --config.model.path=/ckpt/Qwen2.5-1.5B-Instruct
    python train.py --config=configs/sciworld.py:grpo,matched    # a baseline at the StraTA budget

Every run lives in ``config.workdir``: ``ckpt/`` (orbax), ``metrics.jsonl`` + ``tb/``
(tensorboardX), ``trajectories.jsonl``. Re-running the same command resumes from the newest
restorable checkpoint (raise ``--config.iterations`` to continue a finished run); SIGTERM
(preemption) and Ctrl-C save and exit cleanly after the iteration in flight.
"""
from __future__ import annotations

import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from strata_jax.cli import guarded, parse_flags  # noqa: E402

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
    """The run of `run` once the workdir is locked."""
    import jax
    import numpy as np

    from envs_bridge.pool import pool_metrics
    from strata_jax import distributed
    from strata_jax import experiment as ex
    from strata_jax.evaluation import eval_tasks, evaluate, summarize
    from strata_jax.metrics import MetricsWriter, Progress, cpu_seconds
    from strata_jax.rollout import (RolloutConfig, SamplerPolicy, build_judge_model,
                                    collect_rollout, make_prompt_builder, rollout)
    from strata_jax.sampling import Sampler, compiled_program_count
    from strata_jax.training import Checkpointer, Trainer, TrainConfig, run_loop
    from strata_jax.trajectories import format_episode
    tokenizer = ex.build_tokenizer(c)
    model_cfg, init_params = ex.build_model(c, tokenizer, mesh)
    sampler_mesh = distributed.local_mesh(mesh)   # rollouts are per host: the sampler stays local
    sampler = Sampler(model_cfg, mesh=sampler_mesh, max_cache_len=ex.max_cache_len(c, model_cfg))
    trainer = Trainer(model_cfg, TrainConfig.from_config(c), mesh)
    rollout_cfg = RolloutConfig.from_config(c)
    builder = make_prompt_builder(tokenizer, c)
    judge = build_judge_model(c, sampler_mesh)   # None: the policy judges itself
    task_sampler = ex.TaskSampler(ex.task_list(c), seed=c.seed)

    ckpt = Checkpointer(os.path.join(workdir, "ckpt"), keep=c.ckpt.keep, every=c.ckpt.every)
    restored = ckpt.restore(trainer.abstract_state(init_params))
    if restored is None:
        state = trainer.init_state(init_params, ex.seed_key(c, 0))
        log.info("fresh run in %s", workdir)
    else:
        state, meta = restored
        if meta.get("sampler_state"):
            task_sampler.set_state(meta["sampler_state"])
        log.info("resumed from step %d in %s", meta["step"], workdir)
    # The reference model is the initial policy, frozen (docs/method.md §8.2). With LoRA the frozen
    # base is both the reference and the model the adapters ride on (always passed).
    ref_params = init_params if c.loss.kl_coef or trainer.lora else None

    def policy_params(state):
        """The sampler's copy of the policy: LoRA adapters merged into the base, cast to the
        sampler dtype, and (multi-host) gathered onto this host's devices."""
        merged = trainer.policy_params(state, init_params)
        local = distributed.to_local(ex.sampler_params(c, merged), model_cfg, sampler_mesh)
        return ex.sampler_layout(c, model_cfg, local)

    policy = SamplerPolicy(sampler, policy_params(state))

    start = int(jax.device_get(state.step))
    # Rows logged after the restored step belong to the lost iterations: drop them on resume.
    writer = MetricsWriter(workdir, enabled=jax.process_index() == 0, resume_step=start)
    progress = Progress(c.iterations, start=start)
    pool = ex.build_pool(c)
    timing: dict[str, float] = {}
    latest: dict = {}   # the iteration's RolloutResult, from next_batch to on_metrics
    last: dict = {}

    tasks_for_eval = eval_tasks(c, c.eval.split) if c.eval.every > 0 else []

    def maybe_eval(it):
        """Every eval.every iterations: the eval protocol on eval.split with the current params.
        Skipped at the resume step when its eval row was logged before the kill (same params,
        same key: it would be the same row twice)."""
        if it == start and "eval/success" in writer.resumed_tags:
            return
        if c.eval.every > 0 and it > 0 and it % c.eval.every == 0 and distributed.is_primary():
            m, _ = evaluate(c, policy, pool, builder, tasks_for_eval, key=ex.seed_key(c, 2, it))
            writer.scalars(it, m)
            log.info("eval at step %d: success %.3f score %.2f", it, m["eval/success"],
                     m["eval/score"])

    def next_batch(state):
        it = int(jax.device_get(state.step))
        policy.set_params(policy_params(state))
        maybe_eval(it)
        t0 = time.time()
        timing.setdefault("_t_iter", (t0, cpu_seconds()))
        counters = pool.stats()
        if jax.process_count() > 1:
            # Multi-host: every host draws the same global task list and rolls out its share
            # (task uids stay global, so row keys and group ids match a single-process run).
            mine, uid0 = distributed.host_share(task_sampler.sample(c.rollout.tasks_per_batch))
            result = collect_rollout(policy, pool, builder, mine, key=ex.seed_key(c, 1, it),
                                     config=rollout_cfg, task_uid_start=uid0, judge=judge)
        else:
            result = rollout(policy, pool, builder, task_sampler.sample,
                             key=ex.seed_key(c, 1, it), config=rollout_cfg, judge=judge)
        timing["time/rollout_s"] = time.time() - t0
        timing.update(pool_metrics(counters, pool.stats()))   # env crashes, restarts, retries
        timing["_t_update"] = time.time()
        latest["rollout"] = result
        # Multi-host: the hosts' batches become one global batch for the sharded update.
        return distributed.global_batch(result.batch, mesh,
                                        trainer.cfg.score_rows or trainer.cfg.micro_batch_size)

    def on_metrics(step, metrics):
        result = latest["rollout"]
        t_update = time.time() - timing.pop("_t_update")
        t_iter, cpu_iter = timing.pop("_t_iter")
        timing["time/iteration_s"] = time.time() - t_iter
        timing["time/iteration_cpu_s"] = cpu_seconds() - cpu_iter   # this process + its JVMs
        m = {**result.stats, **metrics, **timing, "time/update_s": t_update,
             "compile/sampler_programs": float(compiled_program_count()),
             "compile/count": float(compiles.count), "compile/seconds": compiles.seconds}
        steps = max(result.stats.get("rollout/steps", 0.0), 1.0)
        m["perf/env_steps_per_s"] = steps / max(timing["time/rollout_s"], 1e-9)
        generated = float(np.sum(np.asarray(result.batch.response_mask)))
        m["perf/sampler_tokens_per_s"] = generated / max(result.stats.get("time/sampler_s", 0), 1e-9)
        m["perf/train_tokens_per_s"] = m.get("train/tokens", 0.0) / max(t_update, 1e-9)
        m.update(summarize(result.trajectories, c.env.name, prefix="train"))
        writer.scalars(step, m)
        dumps = result.dump()[: c.log.dump_trajectories]
        writer.trajectories(step, dumps)
        for k, rec in enumerate(dumps[:TB_EPISODES]):   # TensorBoard's text tab
            writer.text(step, f"episodes/{k}", "```\n" + format_episode(rec) + "\n```")
        last.clear()
        last.update(m)
        progress.update(step, f"return {m.get('rollout/mean_return', float('nan')):+.3f} "
                              f"success {m.get('rollout/success_rate', float('nan')):.2f}")

    if start < c.iterations:
        log.info("compiling the sampler and the update for iteration %d (the first iteration "
                 "of a process takes minutes on CPU; later ones are fast) ...", start + 1)
    else:
        log.info("%s already finished %d of %d iterations; raise --config.iterations to "
                 "continue it", workdir, start, c.iterations)
    flag = _stop_flag().install()
    try:
        state, status = run_loop(trainer, state, next_batch, iterations=c.iterations,
                                 checkpointer=ckpt, ref_params=ref_params,
                                 sampler_state=task_sampler.get_state, config=c,
                                 on_metrics=on_metrics, flag=flag)
        if status == "done":
            policy.set_params(policy_params(state))
            maybe_eval(int(jax.device_get(state.step)))
    finally:
        flag.uninstall()
        pool.close()
        writer.close()
        ckpt.close()
    step = int(jax.device_get(state.step))
    log.info("%s at step %d; outputs in %s", status, step, workdir)
    return {"status": status, "step": step, "workdir": workdir, "last_metrics": last}


def _stop_flag():
    """The run's stop flag (`PreemptionFlag` on SIGTERM and SIGINT): SIGTERM and the first
    Ctrl-C ask for a clean stop (the iteration in flight finishes, a checkpoint is saved, the run
    exits 0; one log line says so). A second Ctrl-C stops at once (KeyboardInterrupt: the
    training loop's exception path, then one line from `strata_jax.cli.guarded`)."""
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

    return StopFlag((signal.SIGTERM, signal.SIGINT))


@guarded
def main(argv):
    del argv
    from strata_jax.metrics import quiet_logs
    quiet_logs()
    summary = run(_CONFIG.value)
    print(f"{summary['status']}: step {summary['step']}, outputs in {summary['workdir']}")
    return 0 if summary["status"] in ("done", "preempted") else 1


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
