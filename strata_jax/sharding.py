"""Device mesh and the single table of logical-axis rules; knows no model.

Model code names the logical axes of every parameter and activation (``embed``, ``heads``,
``kv_heads``, ``head_dim``, ``mlp``, ``vocab``, ``batch``, ``length``, ``layers``, ``norm``);
`LOGICAL_RULES` maps each to mesh axes (``data``, ``fsdp``, ``tensor``). This is the one place
that decides how anything is sharded (maxtext-style logical axis rules; docs/design.md §5.2).
A model provides the logical axes of its params tree (``models.qwen2.param_logical_axes``) and
turns them into shardings with `tree_shardings` (``models.qwen2.param_shardings``); nothing
here imports a model.

The mesh uses Auto axis types (``jax.sharding.Mesh``), i.e. the familiar GSPMD semantics: jit
propagates shardings from the inputs and from `constrain` hints (docs/design.md §5.1).
Only jax and numpy are imported here so that ``strata_jax.models`` stays importable on
accelerator images without the training dependencies.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor")

# logical axis -> mesh axes it is split over (None = replicated). One table for params and
# activations. A mesh axis already used by an earlier dimension of the same array is skipped
# (e.g. activations [batch, length, embed]: batch takes fsdp, so embed stays whole), and so is
# one that does not divide the dimension.
LOGICAL_RULES: dict[str, tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "length": None,
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": None,
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "layers": None,
    "norm": None,
}

LogicalAxes = tuple  # tuple[str | None, ...], one name per array dimension


def make_mesh(axes: Mapping[str, int] | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build a ``Mesh`` with axes ("data", "fsdp", "tensor") (Auto axis types).

    Args:
      axes: sizes per axis name, e.g. ``{"data": 1, "fsdp": -1, "tensor": 1}``; at most one -1
        ("the rest of the devices"); a missing axis has size 1. Default: all devices on fsdp.
      devices: devices to use (default ``jax.devices()``).
    Raises:
      ValueError: unknown axis name, more than one -1, or sizes whose product is not the device
        count.
    """
    devices = list(jax.devices() if devices is None else devices)
    axes = dict(axes or {"fsdp": -1})
    unknown = set(axes) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; use {list(MESH_AXES)}")
    sizes = [int(axes.get(name, 1)) for name in MESH_AXES]
    if sizes.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {axes}")
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        if len(devices) % known:
            raise ValueError(f"mesh {axes}: {len(devices)} devices not divisible by {known}")
        sizes[sizes.index(-1)] = len(devices) // known
    if any(s < 1 for s in sizes) or math.prod(sizes) != len(devices):
        raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
                         f"have {len(devices)}; use -1 on one axis for 'the rest'")
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def logical_to_spec(axes: LogicalAxes, shape: Sequence[int] | None = None,
                    mesh: Any = None,
                    rules: Mapping[str, tuple[str, ...] | None] | None = None) -> PartitionSpec:
    """Map logical axis names to a ``PartitionSpec`` through `LOGICAL_RULES`.

    Args:
      axes: one logical name (or None) per dimension.
      shape: the array shape; with `mesh`, mesh axes that do not divide a dimension are dropped.
      mesh: a Mesh / AbstractMesh (for sizes and for dropping axes of size 1); optional.
      rules: override of `LOGICAL_RULES`.
    Raises:
      KeyError: a logical name missing from the rules.
    """
    rules = LOGICAL_RULES if rules is None else rules
    sizes = dict(mesh.shape) if mesh is not None else {}
    used: set[str] = set()
    out = []
    for dim, name in enumerate(axes):
        if name is None:
            out.append(None)
            continue
        if name not in rules:
            raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(rules)}")
        chosen = []
        size = 1
        for mesh_axis in rules[name] or ():
            if mesh_axis in used:
                continue
            n = sizes.get(mesh_axis, 1) if mesh is not None else 1
            if mesh is not None and n == 1:
                continue
            if shape is not None and mesh is not None and shape[dim] % (size * n):
                continue
            chosen.append(mesh_axis)
            size *= n
        used.update(chosen)
        out.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*out)


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def tree_shardings(axes_tree: Any, shapes_tree: Any, mesh: Mesh,
                   rules: Mapping[str, tuple[str, ...] | None] | None = None) -> Any:
    """NamedSharding per leaf, from a tree of logical-axes tuples and a matching tree of arrays
    (or ShapeDtypeStructs). Leaves of `shapes_tree` absent from `axes_tree` are an error."""
    return jax.tree.map(
        lambda ax, arr: NamedSharding(mesh, logical_to_spec(ax, arr.shape, mesh, rules)),
        axes_tree, shapes_tree, is_leaf=_is_axes)


def constrain(x: jax.Array, axes: LogicalAxes) -> jax.Array:
    """Sharding hint for an activation inside jit: a no-op unless a mesh is set
    (``jax.set_mesh(mesh)``) and that mesh has more than one device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    spec = logical_to_spec(axes, x.shape, mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
