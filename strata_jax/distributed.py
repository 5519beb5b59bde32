"""Multi-host training with JAX's multi-controller runtime (no home-made RPC).

Every host runs the same `train.py` command. `initialize(c)` starts ``jax.distributed`` from
``c.distributed`` or the environment (a no-op for one process); after it ``jax.devices()`` lists
every device of every host and the training mesh (``c.mesh``) spans them all. Per iteration:

* **Tasks**: every host draws the SAME global task list from its own `TaskSampler` (same seed,
  same position) and keeps its contiguous share (`host_share`): host p of P rolls out tasks
  [p*k, (p+1)*k), k = tasks_per_batch / P, with task uids starting at p*k. The union over hosts
  is exactly the single-process task list, and row keys come from global ids (rollout/keys.py),
  so which host an episode lands on does not change its tokens.
* **Rollout**: each host has its own env pool and samples on its own devices (`local_mesh`);
  `to_local` gives it a host-local copy of the current policy params (an all-gather inside one
  jitted identity per leaf, then a device-to-device copy: no host round trip).
* **Update**: `global_batch` pads every host's `SampleBatch` to common shapes (sizes exchanged
  with ``multihost_utils.process_allgather``) and assembles the global batch with
  ``jax.make_array_from_process_local_data``, rows sharded over the ("data", "fsdp") mesh axes
  exactly as ``Trainer.put_batch`` would place them; the sharded train step runs on it as is.
* **Checkpoints**: orbax's CheckpointManager is multi-process aware: every host calls save /
  restore with the global arrays, each writes its own shards, process 0 writes the metadata.
* **Metrics**: only process 0 writes metrics and trajectory dumps (`is_primary`).

Single-process runs never touch any of this: every helper is a pass-through when
``jax.process_count() == 1``.
Source: JAX "Multi-host and multi-process environments" guide (jax.distributed.initialize,
make_array_from_process_local_data, process_allgather); orbax multi-host checkpointing docs.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from strata_jax.algos.batch import pad_batch
from strata_jax.config import get_dotted

log = logging.getLogger(__name__)

# Environment variables read when the config leaves a field empty (-1 / "").
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    """Resolved ``jax.distributed.initialize`` arguments (`settings`: the ``c.distributed``
    fields of the same names, empty ones filled from the environment; no defaults of its own).

    coordinator_address: "host:port" of process 0, "auto" (cluster auto-detection: Cloud TPU
      pod slices, SLURM, Open MPI) or "" (single process).
    num_processes, process_id: None = let JAX detect them ("auto").
    local_device_ids: None = every local device.
    initialization_timeout_s: seconds jax.distributed waits for the other processes.
    """

    coordinator_address: str
    num_processes: int | None
    process_id: int | None
    local_device_ids: tuple[int, ...] | None
    initialization_timeout_s: int

    @property
    def multi_process(self) -> bool:
        """True when this config asks for jax.distributed (more than one process or "auto")."""
        if self.coordinator_address == "auto":
            return True
        return bool(self.coordinator_address) and (self.num_processes or 1) > 1


def settings(c: Any, environ: dict[str, str] | None = None) -> DistributedSettings:
    """`DistributedSettings` from ``c.distributed`` (every field read: a missing one is a
    ConfigError), falling back to the environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
    JAX_PROCESS_ID) for empty ones ("" / -1).

    Raises ValueError for an explicit coordinator address without num_processes / process_id,
    or a process_id outside [0, num_processes).
    """
    env = os.environ if environ is None else environ
    d = {k: get_dotted(c, f"distributed.{k}") for k in (
        "coordinator_address", "num_processes", "process_id", "local_device_ids",
        "initialization_timeout_s")}

    def num(key: str, env_key: str) -> int | None:
        v = d[key]
        v = -1 if v is None else int(v)
        if v < 0 and env.get(env_key, "") != "":
            v = int(env[env_key])
        return None if v < 0 else v

    addr = str(d["coordinator_address"] or env.get(ENV_COORDINATOR, ""))
    n, pid = num("num_processes", ENV_NUM_PROCESSES), num("process_id", ENV_PROCESS_ID)
    ids = tuple(int(i) for i in (d["local_device_ids"] or ())) or None
    s = DistributedSettings(addr, n, pid, ids, int(d["initialization_timeout_s"]))
    if addr and addr != "auto":
        if n is None or pid is None:
            raise ValueError(
                f"distributed.coordinator_address={addr!r} needs distributed.num_processes and "
                f"distributed.process_id (or {ENV_NUM_PROCESSES} / {ENV_PROCESS_ID}); use "
                "coordinator_address='auto' on TPU pods / SLURM / Open MPI")
        if not 0 <= pid < n:
            raise ValueError(f"distributed.process_id={pid} must be in [0, {n})")
    return s


def _already_initialized() -> bool:
    from jax._src import distributed as _dist  # the public API has no "is initialized" query
    return getattr(_dist.global_state, "client", None) is not None


def initialize(c: Any) -> bool:
    """Start ``jax.distributed`` for a multi-process run; a no-op for one process.

    Must run before anything touches a JAX device (train.py calls it first). Also selects gloo
    CPU collectives, so a CPU-only multi-process run (the tests, a CPU cluster) has working
    cross-process all-reduces; GPU and TPU collectives are unaffected.
    Args: c: the experiment config (``c.distributed``, see `settings`).
    Returns True when this is a multi-process run (jax.process_count() > 1 afterwards).
    Raises ValueError (bad settings) or RuntimeError when JAX was already used in this process.
    """
    s = settings(c)
    if _already_initialized():
        return jax.process_count() > 1
    if not s.multi_process:
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kw: dict[str, Any] = dict(initialization_timeout=s.initialization_timeout_s)
    if s.coordinator_address != "auto":
        kw.update(coordinator_address=s.coordinator_address, num_processes=s.num_processes,
                  process_id=s.process_id)
    if s.local_device_ids is not None:
        kw["local_device_ids"] = list(s.local_device_ids)
    try:
        jax.distributed.initialize(**kw)
    except RuntimeError as e:
        raise RuntimeError(f"jax.distributed.initialize failed ({e}); call "
                           "strata_jax.distributed.initialize(c) before any other JAX use") from e
    log.info("jax.distributed: process %d of %d, %d local / %d global devices",
             jax.process_index(), jax.process_count(), jax.local_device_count(),
             jax.device_count())
    return jax.process_count() > 1


def is_primary() -> bool:
    """True on process 0: the one that logs metrics and writes trajectory dumps."""
    return jax.process_index() == 0


def check_config(c: Any) -> None:
    """Multi-process constraints on a config (call after `initialize`).

    Raises ValueError when rollout.tasks_per_batch is not a multiple of the process count, or
    for an algorithm with refill (DAPO's dynamic sampling; `algos.table.ALGORITHMS`): per-host
    refill would break the "union = single-process list" rule.
    """
    p = jax.process_count()
    if p == 1:
        return
    if int(c.rollout.tasks_per_batch) % p:
        raise ValueError(f"rollout.tasks_per_batch={c.rollout.tasks_per_batch} must be a multiple "
                         f"of the number of processes ({p}): each host rolls out an equal share")
    from strata_jax.algos.table import get_algorithm   # lazy: nothing before jax.distributed
    if get_algorithm(c.algo).refill:
        raise ValueError(f"algo={c.algo} (dynamic-sampling refill) is single-process only for "
                         "now; run it on one host or use another algo")


def host_share(tasks: Sequence[Any], process_index: int | None = None,
               process_count: int | None = None) -> tuple[list[Any], int]:
    """This host's contiguous share of the iteration's global task list.

    Args: tasks: the global list (identical on every host); process_index / process_count:
      default jax's.
    Returns (tasks[p*k:(p+1)*k], p*k): the share and the task uid of its first task, so uids
      (and with them row keys and SampleBatch task ids) stay global.
    Raises ValueError when len(tasks) is not a multiple of the process count.
    """
    p = jax.process_index() if process_index is None else process_index
    n = jax.process_count() if process_count is None else process_count
    if len(tasks) % n:
        raise ValueError(f"{len(tasks)} tasks cannot be split evenly over {n} processes")
    k = len(tasks) // n
    return list(tasks[p * k:(p + 1) * k]), p * k


def local_mesh(mesh: Mesh) -> Mesh:
    """A mesh over this host's devices for the sampler (the same mesh for one process).

    Keeps the tensor axis when it fits inside the host (tensor-parallel decode), puts the rest
    of the local devices on fsdp. Rollouts differ per host, so the sampler must not span hosts.
    """
    if jax.process_count() == 1:
        return mesh
    from strata_jax.sharding import make_mesh
    devices = jax.local_devices()
    tensor = mesh.shape.get("tensor", 1)
    if len(devices) % tensor:
        tensor = 1
    return make_mesh({"data": 1, "fsdp": -1, "tensor": tensor}, devices=devices)


_replicate_cache: dict[Any, Callable] = {}


def _replicated(x: jax.Array) -> jax.Array:
    key = (x.sharding.mesh, x.shape, x.dtype)
    if key not in _replicate_cache:
        _replicate_cache[key] = jax.jit(
            lambda a: a, out_shardings=NamedSharding(x.sharding.mesh, PartitionSpec()))
    return _replicate_cache[key](x)


def to_local(params: Any, model_config: Any, mesh: Mesh) -> Any:
    """Host-local copy of global Qwen2 params, placed on `mesh` (`local_mesh`) with its
    ``param_shardings``; returns `params` itself for one process.

    One leaf at a time: a jitted identity with replicated output all-gathers the leaf onto every
    device (peak extra memory: one full leaf per device), then this host's copy is moved onto the
    local mesh. Every process must call it (the all-gather is a collective).
    """
    if jax.process_count() == 1:
        return params
    from strata_jax.models.qwen2 import param_shardings
    targets = param_shardings(params, model_config, mesh)
    return jax.tree.map(lambda x, s: jax.device_put(_replicated(x).addressable_data(0), s),
                        params, targets)


def host_values(x: Any) -> np.ndarray:
    """Host numpy copy of an array, gathering across processes when it is not fully addressable
    (e.g. a global batch field); every process must call it then (a collective)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def global_batch(batch: Any, mesh: Mesh, row_multiple: int = 1) -> Any:
    """Assemble the global SampleBatch from every host's local one (pass-through for one process).

    Args:
      batch: this host's SampleBatch (numpy leaves, from its rollout).
      mesh: the training mesh (spans every host).
      row_multiple: the global row count is made a multiple of this (the trainer's scoring
        chunk, ``score_rows or micro_batch_rows``) on top of the batch-sharded device count.
    Returns a SampleBatch of global ``jax.Array`` s: host p's rows are global rows
    [p*R, (p+1)*R), R = the largest local row count rounded up; prompts / responses padded to the
    largest widths over hosts. Padding rows are invalid, so the update ignores them.
    Every process must call it (it exchanges shapes with a collective).
    """
    p = jax.process_count()
    if p == 1:
        return batch
    from jax.experimental import multihost_utils

    from strata_jax.sharding import logical_to_spec
    dims = np.asarray(multihost_utils.process_allgather(
        np.asarray([batch.num_rows, batch.prompt_ids.shape[1], batch.response_ids.shape[1]],
                   np.int64)))
    rows, tp, tr = (int(v) for v in dims.reshape(p, 3).max(axis=0))
    batch_devices = math.prod(mesh.shape[a] for a in ("data", "fsdp") if a in mesh.shape)
    if batch_devices % p:
        raise ValueError(f"mesh {dict(mesh.shape)}: the batch axes (data x fsdp = {batch_devices}) "
                         f"must be a multiple of the {p} processes so each host feeds its own rows")
    per_host = batch_devices // p
    # Global rows p*R must split over the batch devices AND be a multiple of row_multiple.
    need = math.lcm(per_host, max(int(row_multiple), 1) // math.gcd(max(int(row_multiple), 1), p))
    rows = -(-rows // need) * need
    local = pad_batch(batch, rows, tp, tr)

    def put(x):
        shape = (p * rows,) + x.shape[1:]
        spec = logical_to_spec(("batch",) + (None,) * (x.ndim - 1), shape, mesh)
        return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), x, shape)

    return jax.tree.map(put, local)


__all__ = ["DistributedSettings", "settings", "initialize", "is_primary", "check_config",
           "host_share", "local_mesh", "to_local", "host_values", "global_batch"]
