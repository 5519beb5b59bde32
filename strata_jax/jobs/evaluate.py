"""The evaluation job (eval.py runs it): load a run's checkpoint (or the config's model, bare or
with the LoRA adapters of ``eval.adapter``: `strata_jax.jobs.adapters`), play
the eval protocol (`strata_jax.evaluation.protocol`) or, with ``eval.strategy_samples`` > 1,
its test-time strategy scaling (`strata_jax.evaluation.scaling`), and write the metrics JSON
and every episode (docs/method.md §10). The preflight is `strata_jax.jobs.prepare`, the pieces
come from `strata_jax.jobs.assemble` (``train=False``).
"""
from __future__ import annotations

from typing import Any

import jax

from strata_jax.evaluation.protocol import eval_tasks, evaluate


def run_eval(c, split: str | None = None, step: int | None = None,
             use_checkpoint: bool = True) -> dict:
    """Evaluate and return the metrics dict (see strata_jax.evaluation.protocol.evaluate) plus "step"
    and "files" (the JSON and trajectory paths written, process 0 only).

    Loads the run's checkpoint (``<workdir>/ckpt``, the newest restorable or `step`), or with
    ``use_checkpoint=False`` the config's model (``model.path`` / ``model.preset`` plus a warm
    start that is already cached), with ``eval.adapter`` set the adapters of that
    ``adapters/step<k>`` folder merged into it (the files' step is the step), and nothing else:
    no warm start is ever trained here. Plays
    `eval_tasks` with `evaluate` and writes ``<workdir>/eval_<split>_step<k>.json`` (metrics)
    and ``..._trajectories.jsonl`` (every episode, `dump_trajectories` records).
    With ``eval.strategy_samples`` S > 1 it runs `test_time.evaluate_scaled` instead (the
    chooser ``eval.strategy_choice``: "critic" takes the checkpoint's critic, "judge" the
    ``rollout.judge_model`` if set) and the files get the suffix ``_s<S>_<choice>`` (plus
    ``_probe<k>`` with ``eval.probe_steps`` = k).

    The metrics add the prefill's work (`strata_jax.rollout.prefix_metrics` as ``eval/...``:
    prompt_tokens, prefill_tokens, and with ``rollout.prefix_cache_mb`` > 0 the prefix cache's
    computed / reused tokens).

    Raises ConfigError (bad config; with use_checkpoint=False a warm start that is not cached;
    strategy_choice="critic" for a run or model without a critic; ``eval.adapter`` together
    with a checkpoint load (use_checkpoint or `step`), a missing or changed adapter folder, one
    of another shape, rank or base) and FileNotFoundError (no restorable checkpoint in the run
    folder).
    """
    import os

    from strata_jax.evaluation.scaling import TestTimeConfig
    from strata_jax.jobs.assemble import assemble
    from strata_jax.jobs.prepare import prepare
    from strata_jax.training import TrainConfig

    split = split or c.eval.split
    with prepare(c, "evaluate", check=lambda c: _check(c, use_checkpoint, split, step)) as p:
        tt = TestTimeConfig.from_config(c)
        ckpt_dir = os.path.join(c.workdir, "ckpt")
        if use_checkpoint and not os.path.isdir(ckpt_dir):
            raise FileNotFoundError(f"no checkpoint in {ckpt_dir}; train first (python train.py "
                                    "with the same --config) or pass --no_checkpoint to "
                                    "evaluate config.model as is")
        # LoRA adapters need their frozen base (the run's initial params); full fine-tuning
        # needs only the shapes: nothing is loaded or trained besides the checkpoint.
        r = assemble(c, train=False, mesh=p.mesh,
                     initial=not use_checkpoint or TrainConfig.from_config(c).lora.enabled)
        try:
            return _evaluate(c, r, split, step, use_checkpoint, tt, ckpt_dir)
        finally:
            r.pool.close()


def _check(c: Any, use_checkpoint: bool, split: str, step: int | None = None) -> None:
    """eval's own preflight check (after resolve, before any model is loaded): the split names
    tasks of the env (`eval_tasks`: an unknown split is one line listing the known ones), the
    test-time scaling settings, that a critic chooser has a critic to read, and that an
    ``eval.adapter`` comes without a checkpoint load (its folder is the preflight's next step).
    Raises ConfigError."""
    from strata_jax import experiment as ex
    from strata_jax.evaluation.scaling import TestTimeConfig
    from strata_jax.training import TrainConfig
    eval_tasks(c, split)
    adapter = str(c.eval.get("adapter", "") or "")
    if adapter and (use_checkpoint or step is not None):
        raise ex.ConfigError(f"eval.adapter={adapter!r} plays config.model with those adapters; "
                             "a checkpoint load is the other choice: choose one (drop --step, "
                             "or use_checkpoint=False; eval.py's --adapter implies it)")
    try:
        tt = TestTimeConfig.from_config(c)
    except ValueError as e:
        raise ex.ConfigError(str(e)) from None
    wants_critic = tt.enabled and tt.strategy_choice == "critic"
    if wants_critic and not use_checkpoint:
        raise ex.ConfigError("eval.strategy_choice=critic needs a trained critic: evaluate a "
                             "ppo / stapo checkpoint (not --no_checkpoint), or use "
                             "strategy_choice=judge or first_action")
    if wants_critic and TrainConfig.from_config(c).critic_kind == "none":
        raise ex.ConfigError(f"eval.strategy_choice=critic needs a critic and a {c.algo} run "
                             f"has none (train.critic={c.train.critic!r}); evaluate a ppo / "
                             "stapo run or use strategy_choice=judge or first_action")


def _evaluate(c, r, split, step, use_checkpoint, tt, ckpt_dir) -> dict:
    """`run_eval` once the `Run` `r` is assembled (its pool closed by the caller): restore,
    play, write."""
    import json
    import os

    from strata_jax import experiment as ex
    from strata_jax.evaluation.scaling import critic_scorer, evaluate_scaled
    from strata_jax.rollout import prefix_metrics
    from strata_jax.training import Checkpointer, Trainer, TrainConfig

    wants_critic = tt.enabled and tt.strategy_choice == "critic"
    at, critic, base, params = 0, None, r.init_params, r.init_params
    if use_checkpoint:
        trainer = Trainer(r.model, TrainConfig.from_config(c), r.mesh)
        ckpt = Checkpointer(ckpt_dir, keep=c.ckpt.keep)
        restored = ckpt.restore(trainer.abstract_state(base), step=step)
        ckpt.close()
        if restored is None:
            raise FileNotFoundError(f"no restorable checkpoint in {ckpt_dir}"
                                    + (f" at step {step}" if step is not None else "")
                                    + "; train first or pass --no_checkpoint")
        state, meta = restored
        # LoRA: the adapters merged into the base; otherwise the trained params themselves
        params, at = trainer.policy_params(state, base), int(meta["step"])
        if wants_critic:
            try:
                critic = critic_scorer(trainer, state, base if trainer.lora else None)
            except ValueError as e:
                raise ex.ConfigError(str(e)) from None
        print(f"evaluating checkpoint step {at} of {c.workdir}", flush=True)
    elif str(c.eval.get("adapter", "") or ""):
        from strata_jax.jobs.adapters import adapter_policy_params
        from strata_jax.jobs.warm_start import export_name
        params, at, folder = adapter_policy_params(c, r, export_name(c, r.model))
        print(f"evaluating the adapters of step {at} ({folder}) on the config's model "
              f"({c.model.path or 'preset ' + c.model.preset}"
              + (f", warm start {c.model.warm_start}" if c.model.warm_start else "") + ")",
              flush=True)
    else:
        print(f"evaluating the config's model as is ({c.model.path or 'preset ' + c.model.preset}"
              + (f", warm start {c.model.warm_start}" if c.model.warm_start else "") + ")",
              flush=True)
    tasks = eval_tasks(c, split)
    policy, pool, builder = r.policy, r.pool, r.builder
    policy.set_params(r.copy(params))
    print(f"playing {len(tasks)} tasks on split {split!r} "
          f"({int(c.eval.episodes_per_family)} per family)"
          + (f", {tt.strategy_samples} candidates each ({tt.strategy_choice} chooses, "
             + (f"{tt.probe_steps}-step probes)" if tt.probe_steps else "full episodes)")
             if tt.enabled else ""), flush=True)
    import inspect   # the wave: `evaluate`'s chunk of tasks per rollout call
    wave = min(len(tasks), inspect.signature(evaluate).parameters["batch_tasks"].default)
    print(f"compiling the sampler with the first wave of {wave} episodes "
          "(minutes on a CPU for a real model; a line follows each wave) ...", flush=True)
    prefill0 = policy.prefix_stats()
    if tt.enabled:
        metrics, episodes = evaluate_scaled(c, policy, pool, builder, tasks,
                                            key=ex.seed_key(c, 2, at), critic=critic,
                                            judge=r.judge)
    else:
        metrics, episodes = evaluate(c, policy, pool, builder, tasks,
                                     key=ex.seed_key(c, 2, at), progress=_progress_line())
    # the prefill's work over the whole eval (eval/prompt_tokens, eval/prefill_tokens, ...)
    metrics.update(prefix_metrics(prefill0, policy.prefix_stats(), prefix="eval"))
    metrics["step"] = at
    metrics["files"] = []
    if jax.process_index() == 0:   # multi-host: process 0 writes
        os.makedirs(c.workdir, exist_ok=True)
        stem = os.path.join(c.workdir, f"eval_{split}_step{at}")
        if tt.enabled:   # test-time scaling never overwrites the one-strategy protocol's files
            stem += f"_s{tt.strategy_samples}_{tt.strategy_choice}" + (
                f"_probe{tt.probe_steps}" if tt.probe_steps else "")
        with open(stem + ".json", "w") as f:
            json.dump({k: v for k, v in metrics.items() if k != "files"}, f, indent=1)
        with open(stem + "_trajectories.jsonl", "w") as f:
            for rec in episodes:
                f.write(json.dumps({"step": at, **rec}, default=str) + "\n")
        metrics["files"] = [stem + ".json", stem + "_trajectories.jsonl"]
    return metrics


def score_scale_line(env_name: str) -> str:
    """The line that says the printed scores' scale for env `env_name`: the env's own score
    (ScienceWorld / WebShop 0-100, `SCORE_SCALE`) and training's returns, the same / 100;
    else the 0-1 return that training prints."""
    from strata_jax.evaluation.protocol import SCORE_SCALE
    scale = SCORE_SCALE.get(env_name)
    if scale:
        return (f"scores are {env_name}'s own, 0-{scale:g} (training prints returns on a 0-1 "
                f"scale: score / {scale:g})")
    return "scores are the episode return, 0-1 (as training prints it)"


def tiny_model_note(c: Any) -> str | None:
    """A note when the evaluated model is the tiny preset (no ``model.path``), randomly
    initialised or behaviour-cloned on a few gold paths (``model.warm_start``): its strategies
    fail the format and its scores are near 0 by design. None otherwise."""
    if c.model.path or c.model.preset != "tiny":
        return None
    start = ("behaviour-cloned on a few expert episodes" if c.model.get("warm_start")
             else "randomly initialised")
    return (f"note: the model is the tiny preset, {start} (a machinery check, not a policy): "
            "strategy format failures near 1.000 and scores near 0 are expected")


def report(c: Any, metrics: dict) -> str:
    """eval.py's printed report: `format_metrics` with the scores' scale (`score_scale_line`)
    and, for the tiny random model, `tiny_model_note` before its "wrote <file>" lines."""
    from strata_jax.evaluation import format_metrics
    lines = format_metrics(metrics).splitlines()
    wrote = len(metrics.get("files", []))
    note = tiny_model_note(c)
    extra = [score_scale_line(c.env.name)] + ([note] if note else [])
    at = len(lines) - wrote
    return "\n".join(lines[:at] + extra + lines[at:])


def _progress_line():
    """`evaluate`'s progress callback: one line per batch of episodes, with the success so far
    and the elapsed time."""
    import time
    t0 = time.time()

    def show(done: int, total: int, trajectories: Any) -> None:
        wins = sum(bool(t.success) for t in trajectories)
        print(f"  {done}/{total} episodes played, {wins} succeeded, {time.time() - t0:.0f} s",
              flush=True)
    return show


__all__ = ["run_eval", "report", "score_scale_line", "tiny_model_note"]
