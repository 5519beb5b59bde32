"""Build every piece of a run from one experiment config (configs/*.py).

`strata_jax.jobs` (train, evaluate, the warm start; train.py, eval.py, sft.py and the notebook
run those) builds from these so that a config means the same thing everywhere:

    config -> validate -> mesh -> tokenizer -> model config + params
           [-> warm start: strata_jax/jobs/warm_start.py, a separate step]
           -> task lists / TaskSampler -> EnvPool -> Sampler + SamplerPolicy -> PromptBuilder
           -> Trainer + Checkpointer

`strata_jax.jobs.assemble` puts them together into one `Run` (the preflight before it:
`strata_jax.jobs.prepare`). Nothing here owns a loop. The config checks (key set, values,
resume compatibility) are `strata_jax.validation`, re-exported here. Source: docs/design.md §2
and §3.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp

from envs_bridge import TaskSampler  # noqa: F401  (ex.TaskSampler: the entry points build it)
from envs_bridge.pool import EnvPool
from envs_bridge.registry import get_env_factory
from strata_jax import sharding
from strata_jax.algos.table import get_algorithm
from strata_jax.config import ConfigError
from strata_jax.models import (PRESETS, Qwen2Config, init_params, load_params, load_tokenizer,
                               shard_params)
from strata_jax.models.loading import checkpoint_config, resolve_checkpoint
from strata_jax.validation import ENV_KWARGS
# The checks a run calls through this module (strata_jax.jobs, tests); the rest of
# strata_jax.validation (key tables, check_keys, ...) is imported from there.
from strata_jax.validation import (ASSEMBLY_KEYS, OPTIONAL_KEYS,  # noqa: F401
                                   RESUME_MAY_CHANGE, check_keys, check_resume, config_keys,
                                   max_cache_len, resume_may_change, stored_config, validate)

log = logging.getLogger(__name__)

# Qwen2.5 checkpoints pad the vocabulary to this size (ids above the tokenizer's are unused).
QWEN25_VOCAB = 151936
def resolve(c: Any) -> Any:
    """Derived settings that follow from the algorithm's `ALGORITHMS` entry (done once, logged).

    ``cumulative_prompts`` entries (STAPO, docs/method.md §7.1) turn rollout.cumulative_prompts
    on; a ``clip_eps_high`` entry (DAPO's clip-higher 0.28, §6.5) raises loss.clip_eps_high
    unless the config already made the clip asymmetric; ``rollout.top_k=-1`` (off) becomes the
    sampler's 0.
    """
    alg = get_algorithm(c.algo)
    if c.rollout.top_k == -1:   # vLLM / verl's spelling of "no top-k"; the sampler's is 0
        c.rollout.top_k = 0
    if alg.cumulative_prompts and not c.rollout.cumulative_prompts:
        log.info("algo=%s: turning on rollout.cumulative_prompts (docs/method.md §7.1)", c.algo)
        c.rollout.cumulative_prompts = True
    if alg.clip_eps_high is not None and c.loss.clip_eps_high == c.loss.clip_eps_low:
        c.loss.clip_eps_high = alg.clip_eps_high
    return c


def use_compilation_cache(c: Any) -> str | None:
    """Turn on jax's persistent compilation cache in ``c.compilation_cache_dir`` ("" = off).

    Compiled programs are written to a subfolder per jax / jaxlib version and device set
    (`strata_jax.compile_cache.cache_subdir`; those that took >= 1 s to compile: jax's default
    threshold) and loaded by any later process that compiles the same program there: a resumed
    or repeated run skips its warm-up compilations (``compile/cache_hits`` counts the loads).
    Every entry is sealed with a sha256 of its key and bytes; one that fails the check
    (damaged, or another key's) is deleted and compiled again (`compile_cache.SealedCache`).
    Call before the first compilation of the process and after jax.distributed is set up: jax
    decides at that compilation whether the process uses a cache (a warning says when it was
    too late). Returns the absolute subfolder, or None when off.
    Raises ConfigError when the directory cannot be created.
    """
    from strata_jax import compile_cache
    path = str(c.compilation_cache_dir or "")
    if not path:
        return None
    path = os.path.join(os.path.abspath(os.path.expanduser(path)), compile_cache.cache_subdir())
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"compilation_cache_dir={c.compilation_cache_dir!r} cannot be created "
                          f"({e}); point it at a writable folder or set it to '' (no cache)"
                          ) from e
    compile_cache.install()
    jax.config.update("jax_compilation_cache_dir", path)
    try:   # jax decides once per process, at its first compilation (no public query)
        from jax._src import compilation_cache as _cc
        too_late = getattr(_cc, "_cache_checked", False) and not getattr(_cc, "_cache_used", True)
    except ImportError:
        too_late = False
    if too_late:
        log.warning("compilation_cache_dir=%s: this process compiled programs before it was "
                    "set, so jax keeps the persistent cache off here (later processes use it)",
                    path)
    return path


# glibc's mallopt parameter number of M_MMAP_THRESHOLD (malloc.h).
_M_MMAP_THRESHOLD = -3


def use_host_allocator(c: Any) -> bool:
    """Fix glibc's mmap threshold at ``c.host_mmap_threshold_mb`` MiB (0: leave glibc's policy).

    XLA:CPU mallocs the buffers of every program it runs. glibc maps large requests with mmap
    and unmaps them on free, but after each freed mapped chunk it raises its threshold to that
    chunk's size (up to 32 MiB on 64-bit), so later buffers below it come from the heap arenas,
    whose freed pages stay resident: a run of several programs with buffers of many sizes (the
    packed update's micro-batch shapes) holds more than its largest program needs. A fixed
    threshold (``mallopt(M_MMAP_THRESHOLD)``, what ``MALLOC_MMAP_THRESHOLD_`` sets) turns that
    adjustment off. Process-wide; call once at start-up (`strata_jax.jobs.prepare`).
    Source: glibc malloc(3) / mallopt(3), "M_MMAP_THRESHOLD"; figures: docs/results.md.
    `c` is a validated config (`validate`: 0-32 MiB, glibc's range). Returns True when set,
    False when 0 or when the C library has no mallopt or refuses it (a warning then; the
    run goes on with its allocator's own policy). Raises nothing.
    """
    mb = float(c.host_mmap_threshold_mb)
    if mb <= 0:
        return False
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, int(mb * 2 ** 20)))
    except (OSError, AttributeError):
        ok = False
    if not ok:
        log.warning("host_mmap_threshold_mb=%g: the C library has no glibc mallopt or refused "
                    "it; host memory keeps its allocator's own policy", mb)
    return ok


def build_mesh(c: Any) -> jax.sharding.Mesh:
    """The device mesh of ``c.mesh`` (axes data / fsdp / tensor, -1 = the rest)."""
    return sharding.make_mesh(dict(c.mesh))


def build_tokenizer(c: Any):
    """``model.tokenizer``: "offline" = the shipped Qwen BPE; "" = from model.path (a checkpoint
    dir's tokenizer files or a GGUF file's tokenizer metadata); else a dir."""
    if c.model.tokenizer == "offline" or (not c.model.tokenizer and not c.model.path):
        return load_tokenizer(None)
    path = c.model.tokenizer or checkpoint_dir(c)
    return load_tokenizer(path)


def checkpoint_dir(c: Any) -> str:
    """``model.path`` as a local directory or GGUF file (`resolve_checkpoint`), with its model
    config read and checked (`checkpoint_config`: a GGUF file's header pre-scan and bounds; a
    directory's config.json), so that a training run refuses a bad model before it writes
    anything (`strata_jax.jobs.prepare`).
    A missing path, a file that is not a usable GGUF file, a bad config.json or a hub id /
    model name that cannot be downloaded is a ConfigError that names ``--config.model.path``."""
    try:
        path = resolve_checkpoint(c.model.path)
        checkpoint_config(path)   # cached per file: the later loads do not parse it again
        return path
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        raise ConfigError(f"--config.model.path={c.model.path}: {e}") from None


def model_config(c: Any, tokenizer: Any) -> Qwen2Config:
    """The model shape of the run, without building any params: ``model.preset`` (the
    vocabulary widened to hold every tokenizer id) or the checkpoint's (config.json or GGUF
    metadata: `checkpoint_config`)."""
    if c.model.preset:
        cfg = PRESETS[c.model.preset]
        if len(tokenizer) > cfg.vocab_size:
            cfg = dataclasses.replace(cfg, vocab_size=QWEN25_VOCAB)
        return cfg
    return checkpoint_config(checkpoint_dir(c))


def abstract_params(c: Any, model_cfg: Qwen2Config) -> Any:
    """``jax.ShapeDtypeStruct`` tree of the run's params (``model.dtype``): a restore target
    that loads and computes nothing."""
    dtype = jnp.dtype(c.model.dtype)
    return jax.eval_shape(lambda k: init_params(model_cfg, k, dtype), jax.random.PRNGKey(0))


def build_model(c: Any, tokenizer: Any, mesh: jax.sharding.Mesh | None
                ) -> tuple[Qwen2Config, Any]:
    """Model config and the params as built or loaded, before any warm start (the run's
    initial params are these after `strata_jax.jobs.warm_start.maybe_warm_start`).

    model.preset: random weights of a named shape (seeded by c.seed), the vocabulary widened to
    hold every tokenizer id. model.path: an HF checkpoint dir, a GGUF file, a model name of
    `strata_jax.models.fetch` or a hub id (`load_params`; a ConfigError naming
    --config.model.path when it is missing or cannot be downloaded). Params are in
    ``model.dtype``, placed with the mesh's logical-axis shardings when `mesh` is given.
    """
    dtype = jnp.dtype(c.model.dtype)
    cfg = model_config(c, tokenizer)
    if c.model.preset:
        params = init_params(cfg, jax.random.PRNGKey(c.seed), dtype)
        if mesh is not None:
            params = shard_params(params, cfg, mesh)
        return cfg, params
    return cfg, load_params(checkpoint_dir(c), cfg, dtype=dtype, mesh=mesh)


def env_kwargs(c: Any) -> dict[str, Any]:
    """Constructor arguments for the env of ``c.env.name``: ``max_steps`` plus the optional
    `ENV_KWARGS` fields the config sets and the env's constructor takes (so an experiment file
    can keep e.g. ``env.code_digits`` while ``env.name=grid_nav`` is tried from the command line)."""
    kw: dict[str, Any] = {"max_steps": int(c.env.max_steps)}
    for k in ENV_KWARGS:
        if k in c.env and c.env[k] not in (None, "") and _takes(get_env_factory(c.env.name), k):
            kw[k] = c.env[k]
    return kw


def _takes(factory: Any, name: str) -> bool:
    """Whether `factory` accepts keyword `name` (True when its signature cannot be read)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def task_list(c: Any, split: str | None = None) -> list:
    """The tasks of ``c.env`` for a split, filtered to ``c.env.tasks`` when given.

    An eval list file (``c.env.eval_list``) replaces the split's list for "test". Raises
    ConfigError when the filter matches nothing (names are listed).
    """
    split = split or c.env.split
    factory = get_env_factory(c.env.name)
    if split == "test" and c.env.eval_list:
        from envs_bridge.scienceworld_env import load_eval_list
        return load_eval_list(c.env.eval_list, split)
    try:
        tasks = factory.task_list(split)
    except KeyError as e:   # an unknown split name: the env's message lists the known ones
        raise ConfigError(f"{c.env.name}: {e.args[0] if e.args else e}") from None
    if c.env.tasks:
        wanted = set(c.env.tasks)
        picked = [t for t in tasks if t.task_id in wanted]
        if not picked:
            names = sorted({t.task_id for t in tasks})
            raise ConfigError(f"env.tasks {sorted(wanted)} match no {c.env.name} task of split "
                              f"{split!r}; known: {names[:40]}")
        tasks = picked
    return tasks


def build_pool(c: Any) -> EnvPool:
    """An `EnvPool` with ``env.num_workers`` live envs (episodes beyond that run in waves)."""
    return EnvPool(c.env.name, env_kwargs(c), max_live_envs=int(c.env.num_workers),
                   step_timeout_s=float(c.env.step_timeout_s))


def workdir(c: Any) -> str:
    """Create the run folder ``c.workdir`` (call only after `validate`) and return it."""
    os.makedirs(c.workdir, exist_ok=True)
    return c.workdir


class WorkdirLock:
    """An exclusive lock on a run directory: ``<workdir>/.lock``, held with ``fcntl.flock`` for
    the life of the run, so a second run on the same workdir refuses to start instead of mixing
    its metrics, trajectories and checkpoints with the first one's. The kernel drops the lock
    when the holder exits, however it dies (kill -9 included), so it is never left stuck. The
    file holds the holder's pid and host, for the message. Not for workdirs on NFS without
    lock support.

    Raises ConfigError (from `acquire`) when another process holds the lock.
    """

    def __init__(self, path: str) -> None:
        self.path = os.path.join(path, ".lock")
        self._fd: int | None = None

    def acquire(self) -> "WorkdirLock":
        import fcntl
        import socket
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ConfigError(f"{os.path.dirname(self.path)} is in use by another run ({holder}); "
                              "wait for it to finish or stop it, or use another "
                              "--config.workdir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (the file stays; its content is stale once unlocked)."""
        if self._fd is not None:
            os.close(self._fd)   # closing the descriptor releases the flock
            self._fd = None

    def __enter__(self) -> "WorkdirLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def check_env(c: Any) -> None:
    """Start-up check of the env's external dependencies, before anything is built: calls the
    env class's ``preflight(**env_kwargs)`` when it has one (WebShop: the AgentGym server
    answers). Raises ConfigError with the env's message (the URL and what to run)."""
    from envs_bridge.base import EnvError
    preflight = getattr(get_env_factory(c.env.name), "preflight", None)
    if preflight is None:
        return
    try:
        preflight(**env_kwargs(c))
    except EnvError as e:
        raise ConfigError(str(e)) from None


def seed_key(c: Any, *ids: int) -> jax.Array:
    """A raw uint32 PRNG key from c.seed folded with `ids` (e.g. the iteration)."""
    key = jax.random.PRNGKey(int(c.seed))
    for i in ids:
        key = jax.random.fold_in(key, int(i))
    return key


__all__ = ["ConfigError", "WorkdirLock", "check_env", "check_resume", "RESUME_MAY_CHANGE",
           "ASSEMBLY_KEYS", "OPTIONAL_KEYS", "config_keys", "check_keys", "validate", "resolve",
           "build_mesh", "build_tokenizer", "build_model",
           "model_config", "abstract_params", "checkpoint_dir",
           "env_kwargs", "task_list", "build_pool", "max_cache_len", "workdir", "seed_key",
           "TaskSampler"]
