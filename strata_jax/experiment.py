"""Build every piece of a run from one experiment config (configs/*.py).

`train.py`, `eval.py`, `sft.py` and the notebook share this assembly so that a config means the
same thing everywhere:

    config -> validate -> mesh -> tokenizer -> model config + params
           [-> warm start: strata_jax/warm_start.py, a separate step]
           -> task lists / TaskSampler -> EnvPool -> Sampler + SamplerPolicy -> PromptBuilder
           -> Trainer + Checkpointer

Nothing here owns a loop; `train.py` runs the iterations. Source: docs/design.md §2 and
§3.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp

from envs_bridge import TaskSampler
from envs_bridge.pool import EnvPool
from envs_bridge.registry import get_env_factory, list_envs
from strata_jax import sharding
from strata_jax.algos.table import get_algorithm
from strata_jax.config import ConfigError
from strata_jax.models import (PRESETS, Qwen2Config, init_params, load_params, load_tokenizer,
                               shard_params)
from strata_jax.models.loading import checkpoint_config, resolve_checkpoint

log = logging.getLogger(__name__)

# Qwen2.5 checkpoints pad the vocabulary to this size (ids above the tokenizer's are unused).
QWEN25_VOCAB = 151936
# Optional c.env fields passed to the env constructor (besides max_steps) when the config sets
# them and the env's constructor takes them (`env_kwargs`).
_ENV_KWARGS = ("server_url", "data_dir", "jvm_max_heap_mb", "fetch_valid_actions", "code_digits")

# The config keys the run assembly reads itself (this module, train.py, eval.py, evaluation,
# distributed, metrics, checkpoints, prompts); the option dataclasses declare theirs
# (`config_sources` of TrainConfig, RolloutConfig, SFTConfig). configs/base.py holds each.
ASSEMBLY_KEYS = (
    "seed", "workdir", "iterations",
    "model.path", "model.preset", "model.dtype", "model.tokenizer", "model.warm_start",
    "env.name", "env.split", "env.tasks", "env.max_steps", "env.max_prompt_tokens",
    "env.history_length", "env.num_workers", "env.step_timeout_s", "env.eval_list",
    "rollout.sampler_dtype", "rollout.cumulative_prompts",
    "rollout.judge_model.path", "rollout.judge_model.tokenizer",   # rollout.build_judge_model
    "rollout.format_examples",                                      # rollout.make_prompt_builder
    "rollout.sampler_layout",                                       # sampler_layout
    "distributed.coordinator_address", "distributed.num_processes", "distributed.process_id",
    "distributed.local_device_ids", "distributed.initialization_timeout_s",
    "ckpt.every", "ckpt.keep",
    "eval.every", "eval.split", "eval.temperature", "eval.max_tasks", "eval.episodes_per_family",
    "eval.strategy_samples", "eval.strategy_choice", "eval.probe_steps",  # test_time.TestTimeConfig
    "log.dump_trajectories",
)
# Keys a config may leave out: mesh axes (a missing one has size 1) and the env constructor
# arguments an experiment file adds for its env (`env_kwargs`).
OPTIONAL_KEYS = tuple(f"mesh.{a}" for a in sharding.MESH_AXES) + \
    tuple(f"env.{k}" for k in _ENV_KWARGS)


def config_keys() -> tuple[set[str], set[str]]:
    """(required, optional) dotted keys of an experiment config: `ASSEMBLY_KEYS` plus every
    source key of TrainConfig, RolloutConfig and SFTConfig (`config_sources`, the sections
    loss / adv / lora expanded to their fields) are required; `OPTIONAL_KEYS` may be absent.
    A config holding any other key is refused (`check_keys`)."""
    from strata_jax.rollout import RolloutConfig
    from strata_jax.training import TrainConfig
    from strata_jax.training.sft import SFTConfig   # sft.py runs it whatever model.warm_start says

    keys = set(ASSEMBLY_KEYS)
    for cls in (TrainConfig, RolloutConfig, SFTConfig):
        for name, key in cls.config_sources().items():
            sub = getattr(cls, "SUBSECTIONS", {}).get(name)
            keys.update(sub.config_sources().values() if sub else (key,))
    return keys, set(OPTIONAL_KEYS)


def check_keys(c: Any) -> None:
    """Refuse a config with a key nothing reads (a typo such as ``loss.kl_coeff``: the message
    names the closest valid key) or without a required one (`config_keys`). Raises ConfigError."""
    from strata_jax.config import nearest
    required, optional = config_keys()
    have = set(_leaves(c.to_dict() if hasattr(c, "to_dict") else c))
    known = required | optional
    for key in sorted(have - known):
        section, _, leaf = key.rpartition(".")
        elsewhere = sorted(k for k in known if k.rpartition(".")[2] == leaf)  # train.lr: optim.lr
        same = [k for k in known if k.rpartition(".")[0] == section]
        hint = (f" (did you mean {' or '.join(repr(k) for k in elsewhere)}?)" if elsewhere
                else nearest(key, same or known))
        raise ConfigError(f"unknown config field {key!r}{hint}; the fields and their defaults "
                          "are in configs/base.py")
    missing = sorted(required - have)
    if missing:
        raise ConfigError(f"the config lacks {', '.join(missing)}: build experiment configs "
                          "from configs/base.py:get_base_config(), which holds every field")


def validate(c: Any) -> None:
    """Check a config before anything is built or written (no model, env, folder or file).

    Raises ConfigError, one line naming the field and what to do, for: a key nothing reads (the
    closest valid one named) or a missing one (`check_keys`); an unknown algo or env;
    neither or both of model.path and model.preset; an unknown preset; every size field below
    its minimum (N, M, sigma, group size, tasks per batch, live envs, env steps, token budgets,
    batch sizes, epochs, iterations, checkpoint keep / every, history window, cohorts); the
    sampling fields (rollout.temperature and eval.temperature finite and >= 0, top_p in (0, 1],
    top_k an integer >= -1 where 0 and -1 both mean "off", the vLLM / verl spelling); a
    non-finite or negative learning rate; an unknown dtype or remat policy (TrainConfig's own
    checks); the warm start's settings (SFTConfig's checks); and,
    for a preset, a KV cache that cannot hold a prompt plus its response (`max_cache_len`; a
    checkpoint's context is checked once its config.json is read).
    """
    import math

    check_keys(c)
    get_algorithm(c.algo)   # an unknown name is a ConfigError listing ALGORITHMS
    if c.env.name not in list_envs():
        raise ConfigError(f"unknown env {c.env.name!r}; registered envs: {list_envs()}")

    def at_least(field: str, lo: float) -> None:
        v = _get(c, field)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= lo or \
                (isinstance(v, float) and not v.is_integer()):
            raise ConfigError(f"{field} must be an integer >= {lo:g}, got {v!r} "
                              f"(--config.{field}=...)")

    r = c.rollout
    for name in ("num_strategies", "episodes_per_strategy", "oversample", "group_size",
                 "tasks_per_batch", "max_action_tokens", "max_strategy_tokens",
                 "max_judge_tokens", "cohorts", "dapo_max_tries"):
        at_least(f"rollout.{name}", 1)
    for name in ("max_steps", "max_prompt_tokens", "num_workers"):
        at_least(f"env.{name}", 1)
    at_least("env.history_length", 0)
    for name in ("mini_batch_size", "micro_batch_size", "ppo_epochs"):
        at_least(f"optim.{name}", 1)
    at_least("optim.warmup_steps", 0)
    at_least("iterations", 0)
    at_least("ckpt.every", 1)
    at_least("eval.every", 0)
    at_least("eval.max_tasks", 0)
    at_least("eval.episodes_per_family", 0)
    at_least("log.dump_trajectories", 0)
    at_least("lora.rank", 0)
    for axis, n in dict(c.mesh).items():
        if isinstance(n, bool) or not isinstance(n, int) or (n < 1 and n != -1):
            raise ConfigError(f"mesh.{axis} must be a device count >= 1 or -1 (the rest), got {n!r}")
    if int(c.ckpt.keep) < 1:
        raise ConfigError(f"ckpt.keep must be >= 1 (orbax would delete every checkpoint and a "
                          f"killed run could not resume), got {c.ckpt.keep}")
    for field in ("rollout.temperature", "eval.temperature"):
        v = _get(c, field)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) \
                or v < 0:
            raise ConfigError(f"{field} must be a finite number >= 0 (0 = greedy), got {v!r}")
    if not isinstance(r.top_p, (int, float)) or not 0.0 < float(r.top_p) <= 1.0:
        raise ConfigError(f"rollout.top_p must be in (0, 1] (1 = off), got {r.top_p!r}")
    if isinstance(r.top_k, bool) or not isinstance(r.top_k, int) or r.top_k < -1:
        raise ConfigError(f"rollout.top_k must be an integer >= 0, or -1 / 0 for off, "
                          f"got {r.top_k!r}")
    if c.adv.std_ddof is not None and (isinstance(c.adv.std_ddof, bool) or
                                       c.adv.std_ddof not in (0, 1)):
        raise ConfigError(f"adv.std_ddof must be 0, 1 or none (each estimator's pin), "
                          f"got {c.adv.std_ddof!r}")
    if c.model.path and c.model.preset:
        raise ConfigError(f"both model.path ({c.model.path!r}) and model.preset "
                          f"({c.model.preset!r}) are set; pick one (e.g. --config.model.preset= "
                          "to train the checkpoint at model.path)")
    if not c.model.path and not c.model.preset:
        raise ConfigError("set --config.model.path (a local Qwen2.5 checkpoint dir or hub id) "
                          "or --config.model.preset (random weights of a named shape)")
    if c.model.preset and c.model.preset not in PRESETS:
        raise ConfigError(f"unknown model.preset {c.model.preset!r}; use one of {sorted(PRESETS)}")
    for field in ("model.dtype", "train.compute_dtype", "rollout.sampler_dtype"):
        v = _get(c, field)
        if field != "model.dtype" and not v:
            continue
        try:
            jnp.dtype(v)
        except TypeError:
            raise ConfigError(f"{field} {v!r} is not a dtype; use float32 or bfloat16") from None
    from strata_jax.training import TrainConfig
    try:
        TrainConfig.from_config(c)
    except ValueError as e:   # remat policy, lr, clip, schedule, ... (TrainConfig's checks)
        raise ConfigError(str(e)) from None
    from strata_jax.training.sft import SFTConfig   # sft.py runs it whatever model.warm_start says
    try:
        SFTConfig.from_config(c)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    at_least("sft.log_every", 1)
    if c.model.preset:
        max_cache_len(c, PRESETS[c.model.preset])


# What a resume must match. A resumed run must continue the run its checkpoint holds, so EVERY
# config field must be equal to the stored one, except these, which do not enter what the run
# computes (where it writes, how long it goes on, how it is laid out on devices and hosts, env
# parallelism and time-outs, checkpoint cadence, evaluation and logging). A field added later is
# compared too (no entry needed); a field the stored config lacks (written by older code) is not.
# The state itself is checked by the restore: a TrainState of another shape (e.g. another LoRA
# rank) fails orbax's restore, and a task-sampler state of another task list fails
# TaskSampler.set_state.
RESUME_MAY_CHANGE = (
    "workdir", "iterations",          # extending a run is a resume
    "mesh.*", "distributed.*",        # restore reshards onto any mesh / process count
    "env.num_workers",                # live envs: episodes run in waves, per-row keys are global
    "env.step_timeout_s",             # only decides when a hung env counts as crashed
    "ckpt.*", "eval.*", "log.*",      # cadence of saves, evals and trajectory dumps
    "sft.cache_dir",                  # where the warm start is cached (its content is fingerprinted)
)


def resume_may_change(field: str) -> bool:
    """Whether a resume may change the dotted config `field` (see RESUME_MAY_CHANGE)."""
    return any(field == k or (k.endswith(".*") and field.startswith(k[:-1]))
               for k in RESUME_MAY_CHANGE)


def _get(d: Any, dotted: str) -> Any:
    """The value of a dotted config field (None when a level is missing)."""
    for k in dotted.split("."):
        if d is None or k not in d:
            return None
        d = d[k]
    return d


def _leaves(d: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted field: value} of a nested config dict."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def stored_config(ckpt_dir: str) -> dict | None:
    """The config saved with the newest checkpoint in `ckpt_dir` (None when there is none or
    its meta file is unreadable; the restore then decides)."""
    import json
    if not os.path.isdir(ckpt_dir):
        return None
    steps = sorted((int(d) for d in os.listdir(ckpt_dir) if d.isdigit()), reverse=True)
    for step in steps:
        try:
            with open(os.path.join(ckpt_dir, str(step), "meta", "metadata")) as f:
                return json.load(f).get("config")
        except (OSError, ValueError):
            continue
    return None


def check_resume(c: Any, stored: dict | None) -> None:
    """Refuse to resume a run whose checkpoint was written with another config.

    Compares every field of `c` (JSON-normalised: tuples as lists) with the config stored in the
    checkpoint, except those of RESUME_MAY_CHANGE and fields the stored config lacks. Raises
    ConfigError naming each differing field (stored -> now) and saying to use a new workdir.
    `stored` None (fresh run, or a checkpoint without a config) passes.
    """
    import json
    if not stored:
        return
    norm = lambda x: json.loads(json.dumps(x, default=list))  # noqa: E731
    now = _leaves(norm(c.to_dict()))
    old = _leaves(norm(stored))
    diff = [f"{k}: {old[k]!r} -> {now.get(k)!r}" for k in sorted(old)
            if k in now and not resume_may_change(k) and old[k] != now[k]]
    if diff:
        raise ConfigError(f"{c.workdir} holds a run with a different config ({'; '.join(diff)}): "
                          "resuming would not continue that run. Set these back, or use a new "
                          "--config.workdir (or delete that folder) to start over. A resume may "
                          f"change only {', '.join(RESUME_MAY_CHANGE)}")


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
    """``model.path`` as a local directory or GGUF file (`resolve_checkpoint`); a missing path,
    a file that is not GGUF or a hub id / model name that cannot be downloaded is a ConfigError
    that names ``--config.model.path``."""
    try:
        return resolve_checkpoint(c.model.path)
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
    initial params are these after `strata_jax.warm_start.maybe_warm_start`).

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


def sampler_params(c: Any, params: Any) -> Any:
    """The policy params as the sampler reads them: cast to ``rollout.sampler_dtype`` (bf16
    halves the bytes a decode step streams; the trainer keeps fp32 masters and recomputes pi_old
    itself, so the cast only shows up in the logged sampler-trainer mismatch)."""
    dtype = jnp.dtype(c.rollout.sampler_dtype or c.model.dtype)
    return _cast(params, dtype)


def sampler_layout(c: Any, config: Qwen2Config, params: Any) -> Any:
    """The sampler's copy in the layout of ``rollout.sampler_layout`` (call it after
    `sampler_params` and after any host-local gathering, on the copy the sampler reads).

    "" keeps the stored HF [out, in] layout; otherwise a comma list for
    `strata_jax.models.qwen2.prepare_sampler_params`: ``fuse_qkv``, ``fuse_gate_up`` and
    projection names stored pre-transposed [in, out] (``SAMPLER_PROJECTIONS``), or "in_out" for
    every decoder projection [in, out] (docs/design.md §12). The trainer's params are not
    touched. When the sampler dtype equals the model dtype (no cast copy), the prepared copy
    costs one more copy of the transformed weights. Raises ConfigError for an unknown name.
    """
    spec = str(c.rollout.sampler_layout or "")
    if not spec:
        return params
    from strata_jax.models.qwen2 import SAMPLER_PROJECTIONS, prepare_sampler_params
    kw: dict[str, Any] = {"fuse_qkv": False, "fuse_gate_up": False}
    in_out: list[str] = []
    for tok in filter(None, (t.strip() for t in spec.split(","))):
        if tok in ("fuse_qkv", "fuse_gate_up"):
            kw[tok] = True
        elif tok == "in_out":
            in_out += ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj"]
        elif tok in SAMPLER_PROJECTIONS:
            in_out.append(tok)
        else:
            raise ConfigError(f"rollout.sampler_layout: unknown item {tok!r}; use in_out, "
                              f"fuse_qkv, fuse_gate_up or one of {', '.join(SAMPLER_PROJECTIONS)}")
    if kw["fuse_qkv"] and "q_proj" in in_out:
        in_out = [n for n in in_out if n not in ("q_proj", "k_proj", "v_proj")] + ["qkv_proj"]
    if kw["fuse_gate_up"] and "gate_proj" in in_out:
        in_out = [n for n in in_out if n not in ("gate_proj", "up_proj")] + ["gate_up_proj"]
    try:
        return prepare_sampler_params(params, config, in_out=tuple(dict.fromkeys(in_out)), **kw)
    except ValueError as e:
        raise ConfigError(f"rollout.sampler_layout={spec!r}: {e}") from None


@jax.jit
def _cast_bf16(params):
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)


def _cast(params: Any, dtype: Any) -> Any:
    leaves = jax.tree.leaves(params)
    if all(x.dtype == dtype for x in leaves):
        return params
    if dtype == jnp.bfloat16:
        return _cast_bf16(params)
    return jax.tree.map(lambda x: x.astype(dtype), params)


def env_kwargs(c: Any) -> dict[str, Any]:
    """Constructor arguments for the env of ``c.env.name``: ``max_steps`` plus the optional
    `_ENV_KWARGS` fields the config sets and the env's constructor takes (so an experiment file
    can keep e.g. ``env.code_digits`` while ``env.name=grid_nav`` is tried from the command line)."""
    kw: dict[str, Any] = {"max_steps": int(c.env.max_steps)}
    for k in _ENV_KWARGS:
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


def max_cache_len(c: Any, model_cfg: Qwen2Config) -> int:
    """KV-cache length the sampler needs: the prompt budget plus the longest generation.

    Raises ConfigError when that exceeds the model's context window.
    """
    new = max(c.rollout.max_action_tokens, c.rollout.max_strategy_tokens,
              c.rollout.max_judge_tokens)
    need = int(c.env.max_prompt_tokens) + int(new)
    if need > model_cfg.max_position_embeddings:
        raise ConfigError(
            f"env.max_prompt_tokens ({c.env.max_prompt_tokens}) + max new tokens ({new}) = {need} "
            f"exceeds the model's context of {model_cfg.max_position_embeddings} tokens: lower "
            "env.max_prompt_tokens or rollout.max_*_tokens")
    return need


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
