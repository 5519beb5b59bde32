"""The run's config checks, before anything is built or written (docs/design.md §3).

`validate` (every key known and present, every value in range, the option dataclasses' own
checks), `check_resume` (a resumed run continues the run its checkpoint holds: every field equal
but `RESUME_MAY_CHANGE`) and `max_cache_len` (the KV cache a config needs fits the model).
`strata_jax.experiment` re-exports them; train.py, eval.py and sft.py call them through it.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import jax.numpy as jnp

from envs_bridge.registry import list_envs
from strata_jax import sharding
from strata_jax.algos.table import get_algorithm
from strata_jax.config import RENAMED_FIELDS, ConfigError
from strata_jax.models import PRESETS, Qwen2Config
from strata_jax.sampling.params import check_temperature

log = logging.getLogger(__name__)

# Optional c.env fields passed to the env constructor (besides max_steps) when the config sets
# them and the env's constructor takes them (`env_kwargs`).
ENV_KWARGS = ("server_url", "data_dir", "jvm_max_heap_mb", "fetch_valid_actions", "code_digits",
              "code_attempts", "corridor_rooms")

# The config keys the run assembly reads itself (this module, train.py, eval.py, evaluation,
# distributed, metrics, checkpoints, prompts); the option dataclasses declare theirs
# (`config_sources` of TrainConfig, RolloutConfig, SFTConfig). configs/base.py holds each.
ASSEMBLY_KEYS = (
    "seed", "workdir", "iterations", "compilation_cache_dir",   # experiment.use_compilation_cache
    "host_mmap_threshold_mb",                                       # experiment.use_host_allocator
    "model.path", "model.preset", "model.dtype", "model.tokenizer", "model.warm_start",
    "env.name", "env.split", "env.tasks", "env.max_steps", "env.max_prompt_tokens",
    "env.history_length", "env.num_workers", "env.step_timeout_s", "env.eval_list",
    "rollout.sampler_dtype", "rollout.cumulative_prompts",
    "rollout.judge_model.path", "rollout.judge_model.tokenizer",   # rollout.build_judge_model
    "rollout.format_examples",                                      # rollout.make_prompt_builder
    "rollout.sampler_layout",                                       # sampler_layout
    "rollout.prefix_cache_mb",                                      # SamplerPolicy
    "rollout.sampler_fixed_shapes",                                 # training.bounds
    "distributed.coordinator_address", "distributed.num_processes", "distributed.process_id",
    "distributed.local_device_ids", "distributed.initialization_timeout_s",
    "ckpt.every", "ckpt.keep",
    "eval.every", "eval.split", "eval.temperature", "eval.max_tasks", "eval.episodes_per_family",
    "eval.strategy_samples", "eval.strategy_choice", "eval.probe_steps",  # test_time.TestTimeConfig
    "eval.adapter",                                                 # jobs.adapters
    "log.dump_trajectories", "log.dump_batches",                    # train.py
)
# Keys a config may leave out: mesh axes (a missing one has size 1) and the env constructor
# arguments an experiment file adds for its env (`env_kwargs`).
OPTIONAL_KEYS = tuple(f"mesh.{a}" for a in sharding.MESH_AXES) + \
    tuple(f"env.{k}" for k in ENV_KWARGS)


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
    from strata_jax.config import nearest, renamed_field_error
    required, optional = config_keys()
    have = set(dotted_leaves(c.to_dict() if hasattr(c, "to_dict") else c))
    known = required | optional
    for key in sorted(have - known):
        if renamed_field_error(key):
            raise ConfigError(renamed_field_error(key))
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


def _check_strategy_embedding(name: Any) -> None:
    """rollout.strategy_embedding is a known name; "sentence" needs its package installed
    (checked here, before a warm start, not at the first strategy stage)."""
    from strata_jax.rollout.strategy import check_strategy_embedding

    try:
        if check_strategy_embedding(name) == "sentence":
            from strata_jax.models.sentence_encoder import model_dir

            model_dir()
    except (ValueError, ImportError, FileNotFoundError) as e:
        raise ConfigError(f"{e} (--config.rollout.strategy_embedding=...)") from None


def validate(c: Any) -> None:
    """Check a config before anything is built or written (no model, env, folder or file).

    Raises ConfigError, one line naming the field and what to do, for: a key nothing reads (the
    closest valid one named) or a missing one (`check_keys`); an unknown algo or env;
    neither or both of model.path and model.preset; an unknown preset; every size field below
    its minimum (N, M, sigma, group size, tasks per batch, live envs, env steps, token budgets,
    batch sizes, epochs, iterations, checkpoint keep / every, history window, cohorts); the
    sampling fields (rollout.temperature and eval.temperature finite and 0 or >=
    `sampling.params.MIN_TEMPERATURE`, top_p in (0, 1],
    top_k an integer >= -1 where 0 and -1 both mean "off", the vLLM / verl spelling); a
    non-finite or negative learning rate; an unknown dtype or remat policy (TrainConfig's own
    checks); the warm start's settings (SFTConfig's checks); rollout.strategy_embedding (a
    known name; "sentence" with its package installed); and,
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
                 "max_judge_tokens", "dapo_max_tries"):
        at_least(f"rollout.{name}", 1)
    at_least("rollout.cohorts", 0)
    _check_strategy_embedding(r.strategy_embedding)
    at_least("rollout.prefix_cache_mb", 0)     # 0 = off (no prefix KV kept across calls)
    mmap_mb = c.host_mmap_threshold_mb   # MiB, fractions allowed; 0 = glibc's own policy
    if isinstance(mmap_mb, bool) or not isinstance(mmap_mb, (int, float)) or \
            not 0 <= mmap_mb <= 32:
        raise ConfigError(f"host_mmap_threshold_mb must be a number of MiB in 0-32 (glibc's "
                          f"maximum; 0 = glibc's own policy), got {mmap_mb!r}")
    for name in ("max_steps", "max_prompt_tokens", "num_workers"):
        at_least(f"env.{name}", 1)
    at_least("env.history_length", 0)
    for name in ("mini_batch_size", "micro_batch_rows", "ppo_epochs"):
        at_least(f"optim.{name}", 1)
    at_least("optim.micro_batch_tokens", 0)   # 0 = micro_batch_rows rows at the batch's width
    at_least("optim.warmup_steps", 0)
    at_least("train.pack_width", 0)    # 0 = auto (Trainer.pack_shape)
    at_least("train.response_floor", 0)  # 0 = two response widths per octave
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
        try:   # a positive temperature that underflows float32 arithmetic (1e-39, 1e-46)
            check_temperature(v, field)
        except ValueError as e:
            raise ConfigError(str(e)) from None
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
# The update's memory knobs: how the same sums are cut up or recomputed, so a run killed for
# memory resumes with a smaller micro-batch or more remat (float order aside, same results).
MEMORY_KNOBS = (
    "optim.micro_batch_rows",         # rows per accumulation unit (per-row path, plan multiple)
    "optim.micro_batch_tokens",       # the packed update's token budget per accumulation unit
    "model.remat",                    # what the backward recomputes instead of storing
    "train.score_rows",               # rows per chunk of the no-grad scoring passes
    "train.logprob_chunk",            # response positions per LM-head chunk
    "train.trim_padding",             # all-padding columns dropped before the update
)
RESUME_MAY_CHANGE = (
    "workdir", "iterations",          # extending a run is a resume
    "compilation_cache_dir",          # where compiled programs are cached: speed only
    "host_mmap_threshold_mb",         # how freed host memory is returned: memory, same results
    "mesh.*", "distributed.*",        # restore reshards onto any mesh / process count
    "env.num_workers",                # live envs: episodes run in waves, per-row keys are global
                                      # (a decode call's rows change, so float rounding may)
    "env.step_timeout_s",             # only decides when a hung env counts as crashed
    "ckpt.*", "eval.*", "log.*",      # cadence of saves, evals and trajectory dumps
    "sft.cache_dir",                  # where the warm start is cached (its content is fingerprinted)
    "train.donate_state",             # buffer reuse in the optimizer step: memory, same results
    "train.scan_layers",              # layers as a scan or unrolled: compile time, same math
    "train.group_by_length",          # retired fields (older checkpoints hold them): the
    "train.pack_prefixes",            # update's layout, same sums (float order aside)
    "train.pack_width",               # its packed row width: speed, same sums (float order aside)
    "train.response_floor",           # response columns' buckets: padding, same sums
    *MEMORY_KNOBS,
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


def dotted_leaves(d: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted field: value} of a nested config dict."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(dotted_leaves(v, f"{prefix}{k}."))
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


def run_identity(config: dict) -> dict[str, Any]:
    """{dotted field: value} of a config dict (e.g. ``c.to_dict()`` or `stored_config`'s) that
    decides what a run computes: JSON-normalised (tuples as lists), without the fields of
    RESUME_MAY_CHANGE. Two runs with equal identities continue each other (`check_resume`); a
    hash of it names a setting (benchmarks' config fingerprints)."""
    import json
    flat = dotted_leaves(json.loads(json.dumps(config, default=list)))
    for old, (_, new) in RENAMED_FIELDS.items():   # a config written before a rename
        if old in flat and new not in flat:
            flat[new] = flat.pop(old)
    return {k: v for k, v in flat.items() if not resume_may_change(k)}


def check_resume(c: Any, stored: dict | None) -> None:
    """Refuse to resume a run whose checkpoint was written with another config.

    Compares every field of `c` (JSON-normalised: tuples as lists) with the config stored in the
    checkpoint, except those of RESUME_MAY_CHANGE and fields the stored config lacks. Raises
    ConfigError naming each differing field (stored -> now) and saying to use a new workdir.
    `stored` None (fresh run, or a checkpoint without a config) passes.
    """
    if not stored:
        return
    now, old = run_identity(c.to_dict()), run_identity(stored)
    diff = [f"{k}: {old[k]!r} -> {now.get(k)!r}" for k in sorted(old)
            if k in now and old[k] != now[k]]
    if diff:
        raise ConfigError(f"{c.workdir} holds a run with a different config ({'; '.join(diff)}): "
                          "resuming would not continue that run. Set these back, or use a new "
                          "--config.workdir (or delete that folder) to start over. A resume may "
                          f"change only {', '.join(RESUME_MAY_CHANGE)}")


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
