"""The train state pytree and the optimisers (purejaxrl style: one pytree in, one out).

`TrainState` layout (a registered pytree; every field is a subtree of arrays):

  params            policy params (the Qwen2 params tree of strata_jax.models)
  opt_state         optax state of `make_optimizer(lr ...)` over params
  critic_params     `critic.init_critic` tree: {} | {"head"} | {"trunk", "head"}
  critic_opt_state  optax state of the critic optimiser (critic_lr) over critic_params ({} if none)
  step              int32 []: iterations done (one rollout + its update, docs/method.md §9.2)
  rng               uint32 [2]: raw PRNG key data (old-style key, checkpointable as is)

The optimizer-step count (for the schedule) lives inside opt_state. Reference params (the frozen
initial policy) are NOT in the state: they are re-loaded from the initial checkpoint and passed
to `update` (saving them in every checkpoint would double its size).
Source: docs/method.md §9.3 (AdamW lr 1e-6, wd 0.01, clip 1.0; critic lr 1e-5); optax docs.
"""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from strata_jax.training.config import TrainConfig


@flax.struct.dataclass
class TrainState:
    """Policy, critic and optimiser state; see the module docstring for the layout."""

    params: Any
    opt_state: Any
    critic_params: Any
    critic_opt_state: Any
    step: jax.Array
    rng: jax.Array


def lr_schedule(lr: float, cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup over cfg.warmup_steps optimizer steps, then constant or cosine to 0."""
    if cfg.lr_schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, lr, max(cfg.warmup_steps, 0),
                                                  max(cfg.decay_steps, cfg.warmup_steps + 1))
    if cfg.warmup_steps > 0:
        return optax.join_schedules(
            [optax.linear_schedule(0.0, lr, cfg.warmup_steps), optax.constant_schedule(lr)],
            [cfg.warmup_steps])
    return optax.constant_schedule(lr)


def make_optimizer(cfg: TrainConfig, critic: bool = False) -> optax.GradientTransformation:
    """clip_by_global_norm(grad_clip) then AdamW(schedule(lr or critic_lr), weight_decay).

    Deterministic in `cfg`, so jitted functions can rebuild it from the static config.
    Weight decay applies to every parameter, as torch AdamW over model.parameters() does (verl).
    """
    lr = cfg.critic_lr if critic else cfg.lr
    parts = []
    if cfg.grad_clip and cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(optax.adamw(lr_schedule(lr, cfg), b1=0.9, b2=0.999, eps=cfg.adam_eps,
                             weight_decay=cfg.weight_decay))
    return optax.chain(*parts)


def create_train_state(params: Any, critic_params: Any, rng: jax.Array,
                       cfg: TrainConfig) -> TrainState:
    """A fresh state at step 0: optimiser moments zero, step int32 0, rng the uint32 [2] key.

    The one builder of a `TrainState`: `Trainer.init_state` jits it onto the state's
    shardings and `Trainer.abstract_state` traces it for the restore target, so a fresh and a
    restored state have the same tree. critic_params: `critic.init_critic` tree ({} = none).
    Traceable (no host sync)."""
    tx, ctx = make_optimizer(cfg), make_optimizer(cfg, critic=True)
    return TrainState(params=params, opt_state=tx.init(params), critic_params=critic_params,
                      critic_opt_state=ctx.init(critic_params) if critic_params else {},
                      step=jnp.zeros((), jnp.int32), rng=jnp.asarray(rng, jnp.uint32))
