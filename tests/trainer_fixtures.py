"""Tiny random policy and hand-built SampleBatches for the trainer / checkpoint / critic tests."""
from __future__ import annotations

import numpy as np

from strata_jax.algos import KIND_ACTION, KIND_STRATEGY, make_sample_batch
from strata_jax.models import Qwen2Config

TINY = Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=False)


def grpo_records(n_tasks: int = 2, per_task: int = 4, seed: int = 0, prompt_len=(3, 7),
                 resp_len=(2, 6), scores=None, strategies: int = 0) -> list[dict]:
    """Records of `n_tasks` GRPO groups of `per_task` one-step episodes with random tokens.

    scores: optional [n_tasks * per_task] episode returns (default alternating 1, 0, ...).
    strategies: number of strategy rows to append (kind STRATEGY, task 0).
    """
    rng = np.random.default_rng(seed)
    recs = []
    for t in range(n_tasks):
        for j in range(per_task):
            i = t * per_task + j
            recs.append(dict(
                prompt_ids=rng.integers(1, TINY.vocab_size, rng.integers(*prompt_len)),
                response_ids=rng.integers(1, TINY.vocab_size, rng.integers(*resp_len)),
                task_id=t, trajectory_id=j, kind=KIND_ACTION,
                score=float(scores[i]) if scores is not None else float(j % 2),
                step_reward=float(scores[i]) if scores is not None else float(j % 2)))
    for s in range(strategies):
        recs.append(dict(prompt_ids=rng.integers(1, TINY.vocab_size, 4),
                         response_ids=rng.integers(1, TINY.vocab_size, 3),
                         task_id=0, trajectory_id=100 + s, strategy_id=s, kind=KIND_STRATEGY))
    return recs


def make_batch(records, **kw):
    """`make_sample_batch` with row_multiple 8 (shards over the 8 fake devices)."""
    return make_sample_batch(records, **kw)


def train_config(algo: str = "grpo", **overrides):
    """The trainer tests' shared TrainConfig (one compilation serves most tests): lr 1e-3,
    mini-batches of 8 step samples, micro-batches of 4 rows, KL and entropy terms on, fp32."""
    import configs.base as base
    from strata_jax.training import TrainConfig
    c = base.get_base_config()
    c.algo = algo
    # fp32 compute pinned: base.py's paper default is bf16, whose rounding swamps exact checks;
    # no donation: the tests update one fixture state many times (donation: test_train.py)
    # response_floor 0: the tests' hand-computed widths are two buckets per octave from 8 (the
    # default floor's own tests: test_train.py)
    kw = dict(lr=1e-3, mini_batch_size=8, micro_batch_rows=4, remat="none", compute_dtype="float32",
              donate_state=False, response_floor=0)
    kw.update(overrides)
    return TrainConfig.from_config(c, **kw)


def iteration_batch(step: int):
    """A deterministic SampleBatch per iteration index (the stub batch source of the loop tests):
    two GRPO groups of 4 one-step episodes with returns that differ per iteration."""
    scores = [(step + j) % 2 for j in range(8)]
    scores[0] = 1.0 if step % 3 else 0.5
    return make_batch(grpo_records(seed=step, scores=scores))


def run_loop(trainer, state, next_batch, *, iterations, checkpointer=None, ref_params=None,
             sampler_state=lambda: None, config=None, flag=None):
    """The loop tests' stub training loop: train.py's iteration loop without rollout, logging
    or eval, built on the same `LoopCheckpoints` (cadence, preemption and exception-path saves).

    next_batch: state -> the iteration's SampleBatch; sampler_state: the task sampler's
    position, saved with each checkpoint; flag: an installed PreemptionFlag (default: one is
    installed here). Returns (state, "done" | "preempted")."""
    from strata_jax.training import LoopCheckpoints, PreemptionFlag

    own = flag is None
    flag = flag or PreemptionFlag().install()
    try:
        with LoopCheckpoints(checkpointer, config) as saves:
            saves.mark(state, sampler_state())
            while int(state.step) < iterations:
                saves.mark(state, sampler_state())
                state, _ = trainer.update(state, next_batch(state), ref_params)
                if flag.requested:
                    saves.save(state, sampler_state())
                    return state, "preempted"
                if saves.due(int(state.step)):
                    saves.save(state, sampler_state())
            saves.save(state, sampler_state())
            return state, "done"
    finally:
        if own:
            flag.uninstall()


def _sigterm_driver(workdir: str) -> None:
    """Run many iterations with periodic checkpoints; iteration 2's batch source announces it
    started (file `started`) and lingers so the test's SIGTERM lands mid-iteration."""
    import os
    import sys
    import time

    import jax

    from strata_jax.models import init_params
    from strata_jax.training import Checkpointer, Trainer

    cfg = train_config()
    params = init_params(TINY, jax.random.PRNGKey(0))
    trainer = Trainer(TINY, cfg)
    state = trainer.init_state(params, jax.random.PRNGKey(1))
    ckpt = Checkpointer(os.path.join(workdir, "ckpt"), keep=2, every=100)
    pos = {"task": 0}

    def next_batch(s):
        step = int(s.step)
        pos["task"] = step + 1
        if step == 2:
            open(os.path.join(workdir, "started"), "w").close()
            time.sleep(3.0)  # the signal arrives here, during the iteration
        return iteration_batch(step)

    state, status = run_loop(trainer, state, next_batch, iterations=1000, checkpointer=ckpt,
                             ref_params=params, sampler_state=lambda: dict(pos),
                             config={"algo": cfg.algo})
    ckpt.close()
    print(f"STATUS {status} STEP {int(state.step)}", flush=True)
    sys.exit(0)


def _restore_driver(workdir: str) -> None:
    """Restore `workdir/ckpt` into this (1-device) process and dump the state as .npz."""
    import os

    import jax
    import numpy as np

    from strata_jax.sharding import make_mesh
    from strata_jax.training import Checkpointer, Trainer, tree_to_numpy

    assert jax.device_count() == 1, jax.devices()
    trainer = Trainer(TINY, train_config(), mesh=make_mesh({"fsdp": -1}))
    with Checkpointer(os.path.join(workdir, "ckpt")) as ckpt:
        state, meta = ckpt.restore(trainer.abstract_state())
    leaves = jax.tree.leaves(state)
    assert all(len(x.sharding.device_set) == 1 for x in leaves)
    flat = {str(i): x for i, x in enumerate(jax.tree.leaves(tree_to_numpy(state)))}
    np.savez(os.path.join(workdir, "restored.npz"), **flat)
    print(f"RESTORED {meta['step']} {meta['sampler_state']}", flush=True)


if __name__ == "__main__":
    import sys
    {"sigterm": _sigterm_driver, "restore": _restore_driver}[sys.argv[1]](sys.argv[2])
