"""Value heads and critic params (docs/method.md §6.4 PPO critic, §7.1 STAPO trajectory-aware critic).

Critic params (a plain dict pytree, stored in `TrainState.critic_params`):

  kind "separate" (PPO): {"trunk": <a full Qwen2 params tree, initialised as a copy of the
      actor's params>, "head": {"w": [D] f32, "b": [] f32}}. The LM head of the trunk copy is
      unused (it receives zero gradient).
  kind "head" (STAPO): {"head": {"w": [D], "b": []}}; the trunk is the policy's own.
  kind "none": {} (no critic).

V(h_t) = h_t . w + b, h_t = the final hidden state at the last response token. The value
uncertainty is the std over K passes with (inverted) dropout p on h_t (docs/method.md §7.3: K = 4,
p = 0.1); V itself is the dropout-free value.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Params = dict[str, Any]


def init_value_head(key: jax.Array, hidden_size: int, init_std: float = 0.1) -> Params:
    """{"w": [D] f32 ~ N(0, init_std^2 / D), "b": [] f32 = 0}: V starts near 0 with spread
    ~init_std over unit-scale RMS-normed states, and nonzero so dropout passes differ."""
    w = jax.random.normal(key, (hidden_size,), jnp.float32) * (init_std / hidden_size ** 0.5)
    return {"w": w, "b": jnp.zeros((), jnp.float32)}


def init_critic(kind: str, policy_params: Params, key: jax.Array, hidden_size: int,
                init_std: float = 0.1) -> Params:
    """Critic params for `kind` ("separate" | "head" | "none"); see the module docstring.

    "separate" copies the policy params (same checkpoint, docs/method.md §6.4) into its own buffers.
    Raises ValueError on an unknown kind.
    """
    if kind == "none":
        return {}
    head = init_value_head(key, hidden_size, init_std)
    if kind == "head":
        return {"head": head}
    if kind == "separate":
        return {"trunk": jax.tree.map(jnp.copy, policy_params), "head": head}
    raise ValueError(f"critic kind must be 'separate', 'head' or 'none', got {kind!r}")


def value_from_hidden(head: Params, h: jax.Array) -> jax.Array:
    """V = h . w + b in f32; h [..., D] -> [...]."""
    return jnp.einsum("...d,d->...", h.astype(jnp.float32), head["w"]) + head["b"]


def dropout_values(head: Params, h: jax.Array, key: jax.Array, passes: int,
                   rate: float) -> tuple[jax.Array, jax.Array]:
    """(V [B] f32 without dropout, std [B] f32 over `passes` dropout passes on h [B, D]).

    std is the population std (ddof 0) of the K values; exactly 0 when rate == 0.
    """
    v = value_from_hidden(head, h)
    if rate <= 0.0 or passes < 2:
        return v, jnp.zeros_like(v)
    keep = jax.random.bernoulli(key, 1.0 - rate, (passes,) + h.shape)
    hd = jnp.where(keep, h[None].astype(jnp.float32) / (1.0 - rate), 0.0)
    vs = value_from_hidden(head, hd)                   # [K, B]
    return v, jnp.std(vs, axis=0)
