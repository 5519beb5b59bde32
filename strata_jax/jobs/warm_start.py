"""The warm start of a run: a step after `experiment.build_model`, and sft.py's job.

    model_cfg, params = experiment.build_model(c, tokenizer, mesh)    # builds / loads only
    params = warm_start.maybe_warm_start(c, model_cfg, params, tokenizer, c.workdir, mesh=mesh)

``model.warm_start``: "" leaves the params as built; "sft" = behaviour cloning
(`strata_jax.training.sft`) on the run's env, trained on the fly once or loaded from the cached
HF export in ``<sft.cache_dir>/<fingerprint>/`` (default ``runs/warm_start/<fingerprint>``: one
folder beside the runs, shared by every variant, run folder and eval of the same setting,
since the fingerprint covers all the warm start depends on; ``sft.cache_dir=""`` keeps it per
run in ``<workdir>/warm_start``); any other value is an export directory. The assembly of
training and evaluation (`strata_jax.jobs.assemble`; evaluation never trains one) calls
`maybe_warm_start`; ``sft.py`` runs `export_warm_start`, the warm start alone.

An export holds one of two forms: an HF checkpoint (config.json + model.safetensors:
``sft.lora_rank=0``, every param fine-tuned) or LoRA adapter files (``sft.lora_rank`` > 0:
adapter_model.safetensors + adapter_config.json, `strata_jax.models.adapter_files`, small
enough to keep in git), whose warm start is the run's initial params with the adapters merged
(`merged_warm_start`), refused unless the file's checksum and its recorded base (the bytes of
the initial params) match.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from envs_bridge import TaskSampler
from envs_bridge.base import Task
from strata_jax import experiment as ex
from strata_jax.jobs.adapters import base_identity
from strata_jax.models import Qwen2Config, export_params, load_params
from strata_jax.models.adapter_files import (ADAPTER_FILE, CONFIG_FILE, AdapterError,
                                             load_adapters, save_adapters)
from strata_jax.models.lora import LoraConfig, apply_lora, lora_shardings, target_names
from strata_jax.rollout import make_prompt_builder
from strata_jax.exits import exception_chain
from strata_jax.training.config import remat_policy
from strata_jax.training.sft import (KINDS, ExpertEpisode, SFTConfig, SFTExample, build_examples,
                                     collect_expert_episodes, renders_full, train_sft)

# the logger of the warm start's log lines (the name they have always carried)
log = logging.getLogger("strata_jax.warm_start")

META_FILE = "sft_meta.json"


def expert_tasks(c: Any, cfg: SFTConfig) -> list[Task]:
    """``cfg.episodes`` tasks of the run's env (``c.env.tasks`` filter) from ``cfg.split``,
    drawn without repeats (TaskSampler, seed ``cfg.seed``)."""
    return TaskSampler(ex.task_list(c, cfg.split), seed=cfg.seed).sample(cfg.episodes)


def interrupted(e: BaseException) -> bool:
    """Whether `e` is the wrapper of a Ctrl-C: the expert episodes step ScienceWorld from this
    thread, and a KeyboardInterrupt that lands inside a py4j call comes back as py4j's own
    error (a page of chained tracebacks) with the KeyboardInterrupt as its cause or context."""
    return any(isinstance(x, KeyboardInterrupt) for x in exception_chain(e))


def sft_examples(c: Any, tokenizer: Any, cfg: SFTConfig | None = None
                 ) -> tuple[list[SFTExample], list[ExpertEpisode]]:
    """Expert episodes of run config `c` and their examples, rendered with the run's own
    `make_prompt_builder(tokenizer, c)` (budget, history window, cumulative prompts)."""
    cfg = cfg or SFTConfig.from_config(c)
    kw = ex.env_kwargs(c)
    try:
        eps = collect_expert_episodes(c.env.name, expert_tasks(c, cfg), noise=cfg.noise,
                                      seed=cfg.seed, max_gold_steps=cfg.max_gold_steps,
                                      env_kwargs=kw)
    except Exception as e:
        if interrupted(e):   # Ctrl-C inside a simulator call: the entry point's one line
            raise KeyboardInterrupt from None
        raise
    if not eps:
        raise ValueError(f"no expert episode for env {c.env.name!r} (tasks {tuple(c.env.tasks)}): "
                         "every gold path exceeded sft.max_gold_steps?")
    run_cum = bool(c.rollout.cumulative_prompts)
    builder = make_prompt_builder(tokenizer, c, renders_full(cfg, "strata", run_cum))
    flat = make_prompt_builder(tokenizer, c, renders_full(cfg, "flat", run_cum))
    return build_examples(builder, eps, cfg, flat_builder=flat), eps


# Version of the examples' rendering: bump it when prompts or targets change shape, so that a
# cached warm start trained on the old rendering is not reused (2: targets end at the closing
# tag where the sampler's stop string ends generation, not at <|im_end|>; 3: memory_key's
# one-digit vault lists its codes among the admissible actions).
EXAMPLE_FORMAT = 3


_SOURCE_ROOTS = ("strata_jax", "envs_bridge")


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """A 12-hex SHA-256 of this checkout's library code: every ``*.py`` file under
    ``strata_jax/`` and ``envs_bridge/`` (relative path and bytes, in path order).

    Recorded in ``sft_meta.json`` (key ``code``): the cache key (`fingerprint`) covers the
    warm start's settings, not the code, so an export trained by other code (an earlier
    commit, a local edit) is still found; `maybe_warm_start` says so when it loads one, since
    a run from it is not the run a clean clone of this code makes (docs/reliability.md).
    """
    base = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    files = []
    for root in _SOURCE_ROOTS:
        for d, _, names in os.walk(os.path.join(base, root)):
            files += [os.path.join(d, n) for n in names if n.endswith(".py")]
    h = hashlib.sha256()
    for path in sorted(files, key=lambda f: os.path.relpath(f, base)):
        h.update(os.path.relpath(path, base).replace(os.sep, "/").encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read() + b"\0")
    return h.hexdigest()[:12]


def stale_export_warning(out_dir: str, meta: dict | None = None) -> str | None:
    """The warning for a cached export in `out_dir` trained by other code than this checkout
    (its ``sft_meta.json`` ``code`` differs from `source_fingerprint`, or was not recorded),
    else None. `meta`: that file's contents when the caller has read them (`read_export_meta`),
    else the file is read here (an unreadable one: None)."""
    if meta is None:
        try:
            with open(os.path.join(out_dir, META_FILE)) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            return None
    if not isinstance(meta, dict):
        return None
    code = meta.get("code")
    if code == source_fingerprint():
        return None
    trained = f"code {code}" if code else "code that did not record its version"
    return (f"the cached warm start {out_dir} was trained by {trained}, this checkout is "
            f"{source_fingerprint()}: this run starts from it, so its numbers are not those of a "
            "clean clone of this code; delete the folder (or pass --config.sft.cache_dir=<new "
            "dir>) to retrain it")


# settings a cached export may hold other values of and still be this config's: where the
# cache lives, and the prompt renderings (the fingerprint keys them by what they resolve to)
_META_FREE = ("cache_dir", "strata_prompts", "flat_prompts")


def read_export_meta(out_dir: str, cfg: SFTConfig) -> dict[str, Any]:
    """The ``sft_meta.json`` of the cached export in `out_dir`, checked against the settings
    `cfg` that looked it up: a JSON object whose ``sft`` object records, for every setting it
    names (older exports lack the fields added since, at their defaults), the value of `cfg`
    (but cache_dir and the prompt renderings, `_META_FREE`).

    Why: the cache is found by folder name alone (`warm_start_dir`), and a finished export is
    marked by this file, written last; a copied, truncated or hand-edited one would otherwise
    make a run start from weights trained for other settings without a word.
    Raises ValueError, saying which file and what to do (delete the folder to retrain)."""
    path = os.path.join(out_dir, META_FILE)
    fix = f"delete {out_dir} to train the warm start again"
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"the cached warm start's {path} cannot be read ({e}); {fix}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("sft"), dict):
        raise ValueError(f"{path} is not a warm-start record (a JSON object with an 'sft' "
                         f"object of settings); {fix}")
    want = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    differ = sorted(k for k, v in meta["sft"].items()
                    if k in want and k not in _META_FREE and v != want[k])
    unknown = sorted(k for k in meta["sft"] if k not in want)
    if differ or unknown:
        said = ", ".join([f"{k}={meta['sft'][k]!r} (this config: {want[k]!r})" for k in differ]
                         + [f"{k} (no such setting)" for k in unknown])
        raise ValueError(f"{path} records other warm-start settings than this config's: "
                         f"{said}; the folder does not hold this config's warm start: {fix}")
    return meta


def fingerprint(c: Any, model_cfg: Qwen2Config, cfg: SFTConfig) -> str:
    """A 12-hex id of everything the warm start depends on (data, prompts, model, init)."""
    # the two forms' renderings stand in the env entry below, as what they resolve to, so a
    # StraTA arm and a cumulative flat arm that name the same renderings share one warm start
    drop = ("cache_dir", "strata_prompts", "flat_prompts")
    sft = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in drop}
    run_cum = bool(c.rollout.cumulative_prompts)
    full = (renders_full(cfg, "strata", run_cum), renders_full(cfg, "flat", run_cum))
    # one bool when both forms see the same history: the fingerprints from before the option
    for k, default in (("plan_code", "keep"), ("train_strategies", True),
                       ("plan_code_keep", 0.0), ("clone_guesses", True)):
        if sft[k] == default:   # the rendering before the option existed: existing
            del sft[k]          # fingerprints stay valid
    if not cfg.max_shapes:      # per-batch buckets, as before the planned widths existed
        del sft["max_shapes"]
    if not cfg.lora_rank:       # full fine-tuning, as before the LoRA fields existed
        for k in ("lora_rank", "lora_alpha", "lora_targets"):
            del sft[k]
    # The run's seed reaches the warm start only through a preset's random init (the data and
    # the cloning follow sft.seed), so a pretrained model's runs of every seed share one warm
    # start, the one their evals compare against (0 keeps existing fingerprints).
    init_seed = c.seed if c.model.preset else 0
    d = dict(format=EXAMPLE_FORMAT, sft=sft,
             model=dataclasses.asdict(model_cfg), init=[c.model.path, c.model.preset, init_seed,
                                                        c.model.dtype, c.model.tokenizer],
             env=[c.env.name, list(c.env.tasks), c.env.max_prompt_tokens, c.env.history_length,
                  c.env.max_steps, full[0] if full[0] == full[1] else list(full)],
             env_kwargs=ex.env_kwargs(c))  # e.g. memory_key's code_digits changes the data
    if c.rollout.format_examples:   # other instructions in every rendered prompt (absent when
        d["format_examples"] = True  # off, so existing fingerprints stay valid)
    return hashlib.sha1(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:12]


def run_sft(c: Any, model_cfg: Qwen2Config, params: Any, tokenizer: Any, out_dir: str,
            cfg: SFTConfig | None = None, log_fn: Callable[[str], None] | None = None
            ) -> tuple[Any, dict[str, Any]]:
    """Collect experts, train from `params`, export to `out_dir`.

    Writes ``out_dir/config.json`` + ``model.safetensors`` (`export_params`, loadable with
    ``--config.model.path=out_dir --config.model.tokenizer=offline``: no tokenizer files are
    written), or with ``sft.lora_rank`` > 0 the adapters alone (`export_sft_adapters`), then
    ``out_dir/sft_meta.json`` (settings, example counts, losses, wall time), last.
    Returns (trained, meta): trained is the new params, or the adapters pytree under LoRA.
    Raises ex.ConfigError before any expert plays when sft.lora_targets selects no projection
    of `model_cfg`.
    """
    cfg = cfg or SFTConfig.from_config(c)
    if cfg.lora is not None:
        try:
            target_names(model_cfg, cfg.lora)
        except ValueError as e:
            raise ex.ConfigError(str(e).replace("lora.targets", "sft.lora_targets", 1)) from None
    t0 = time.time()
    examples, eps = sft_examples(c, tokenizer, cfg)
    t_data = time.time() - t0
    counts = {k: sum(e.kind == k for e in examples) for k in KINDS}
    (log_fn or log.info)(f"sft: {len(eps)} expert episodes ({sum(e.success for e in eps)} "
                         f"successful, {sum(s.noisy for e in eps for s in e.steps)} noisy steps), "
                         f"examples {counts}, data {t_data:.1f} s")
    trained, losses = train_sft(params, model_cfg, examples, cfg,
                                remat=remat_policy(c.model.remat), log_fn=log_fn or log.info)
    os.makedirs(out_dir, exist_ok=True)
    if cfg.lora is None:
        export_params(trained, model_cfg, out_dir)
    else:
        export_sft_adapters(c, model_cfg, cfg, trained, params, out_dir)
    meta = dict(sft=dataclasses.asdict(cfg), episodes=len(eps),
                expert_success=float(np.mean([e.success for e in eps])), examples=counts,
                first_loss=losses[0], final_loss=float(np.mean(losses[-10:])),
                losses=losses[:: max(1, len(losses) // 100)], data_s=t_data,
                wall_s=time.time() - t0, env=c.env.name, tasks=list(c.env.tasks),
                code=source_fingerprint())
    with open(os.path.join(out_dir, META_FILE), "w") as f:
        json.dump(meta, f, indent=1)
    return trained, meta


def sft_base_identity(c: Any, params: Any) -> dict[str, Any]:
    """The base identity behaviour-cloning adapters record and are checked against:
    `base_identity` of the run's initial params as built (model path / preset, dtype and the
    sha256 of `params`' bytes, which alone decides when both sides hold it), with
    ``warm_start`` "": the adapters ride on the base before any warm start, however the run
    names its warm start ("sft" or the export folder)."""
    return {**base_identity(c, base=params), "warm_start": ""}


def export_sft_adapters(c: Any, model_cfg: Qwen2Config, cfg: SFTConfig, adapters: Any,
                        params: Any, out_dir: str) -> str:
    """Write behaviour-cloning `adapters` (trained over the initial `params`) to `out_dir` with
    `save_adapters`: bf16 under PEFT's names, their sha256, ``step`` = ``cfg.steps``, ``algo``
    "sft", ``seed`` = ``cfg.seed`` and `sft_base_identity`. Returns out_dir."""
    meta = {"step": cfg.steps, "algo": "sft", "seed": cfg.seed,
            "base": sft_base_identity(c, params)}
    return save_adapters(adapters, cfg.lora, model_cfg, out_dir, meta)


def holds_adapters(path: str) -> bool:
    """Whether export folder `path` holds LoRA adapter files (its adapter_config.json) rather
    than an HF checkpoint. Raises AdapterError for a folder of neither form or both: adapter
    tensors without their config (a copy cut short), or adapters beside a model.safetensors
    (which one is the warm start would be a guess)."""
    config = os.path.isfile(os.path.join(path, CONFIG_FILE))
    if not config and os.path.isfile(os.path.join(path, ADAPTER_FILE)):
        raise AdapterError(f"model.warm_start: {path} holds {ADAPTER_FILE} without its "
                           f"{CONFIG_FILE}: an incomplete LoRA export; delete the folder so that "
                           "the warm start is trained again (python sft.py with the same config)")
    if config and os.path.isfile(os.path.join(path, "model.safetensors")):
        raise AdapterError(f"model.warm_start: {path} holds both LoRA adapter files and a full "
                           "checkpoint (model.safetensors); which one is the warm start is "
                           "ambiguous: keep one form per folder")
    return config


def merged_warm_start(c: Any, model_cfg: Qwen2Config, params: Any, path: str,
                      lora_cfg: LoraConfig | None = None,
                      mesh: jax.sharding.Mesh | None = None) -> Any:
    """The warm start of adapter folder `path`: every adapted W of the initial `params`
    replaced by W + (alpha / rank) * B @ A, computed in float32 and cast to ``c.model.dtype``
    (`apply_lora`; the other leaves as they are), placed like `params`.

    The adapters are read by `load_adapters`: the file's sha256 must be the recorded one, the
    tensors must fit `model_cfg`, with `lora_cfg` given its rank / alpha / targets must be the
    file's, and the recorded base must be `sft_base_identity` of `params`.
    Raises AdapterError (one line naming the folder and what to do) and FileNotFoundError.
    """
    try:
        adapters, meta = load_adapters(path, model_cfg, lora_cfg, base=sft_base_identity(c, params))
    except AdapterError as e:
        raise AdapterError(f"model.warm_start: {e}") from None
    merge = jax.jit(apply_lora, static_argnums=(2, 3),
                    out_shardings=jax.tree.map(lambda x: x.sharding, params))
    if mesh is None:
        return merge(params, adapters, meta["lora"], jnp.dtype(c.model.dtype))
    adapters = jax.device_put(adapters, lora_shardings(adapters, model_cfg, mesh))
    with jax.set_mesh(mesh):
        return merge(params, adapters, meta["lora"], jnp.dtype(c.model.dtype))


def load_export(c: Any, model_cfg: Qwen2Config, params: Any, path: str,
                lora_cfg: LoraConfig | None = None,
                mesh: jax.sharding.Mesh | None = None) -> Any:
    """The params of export folder `path` in ``c.model.dtype``: its adapters merged into the
    initial `params` (`merged_warm_start`, when it holds adapter files) or its HF checkpoint
    (`load_params`, placed on `mesh` when given)."""
    if holds_adapters(path):
        return merged_warm_start(c, model_cfg, params, path, lora_cfg, mesh)
    return load_params(path, model_cfg, dtype=jnp.dtype(c.model.dtype), mesh=mesh)


def export_warm_start(c: Any, out: str = "", force: bool = False,
                      log_fn: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The whole `sft.py` job: the preflight (`strata_jax.jobs.prepare`), the run's tokenizer
    and initial params as built (`experiment.build_model`, before any warm start), `run_sft`,
    export to `out` (default `warm_start_dir`). An export whose meta file exists is reused unless `force`.

    Returns {"out": export dir, "cached": bool, "meta": the sft_meta.json dict}.
    Raises experiment.ConfigError for a config that cannot run (`experiment.validate`)."""
    from strata_jax.jobs.prepare import prepare
    with prepare(c, "warm_start"):   # validate, resolve, process settings; no mesh
        tokenizer = ex.build_tokenizer(c)
        model_cfg, params = ex.build_model(c, tokenizer, None)
        out = out or warm_start_dir(c, model_cfg, c.workdir)
        meta_file = os.path.join(out, META_FILE)
        if os.path.isfile(meta_file) and not force:
            return {"out": out, "cached": True,
                    "meta": read_export_meta(out, SFTConfig.from_config(c))}
        _, meta = run_sft(c, model_cfg, params, tokenizer, out, log_fn=log_fn)
        return {"out": out, "cached": False, "meta": meta}


def warm_start_dir(c: Any, model_cfg: Qwen2Config, workdir: str) -> str:
    """Cache dir of the run's warm start: ``<sft.cache_dir or workdir/warm_start>/<fingerprint>``
    (nothing is created here)."""
    cfg = SFTConfig.from_config(c)
    root = cfg.cache_dir or os.path.join(workdir, "warm_start")
    return os.path.join(root, fingerprint(c, model_cfg, cfg))


def export_name(c: Any, model_cfg: Qwen2Config) -> str:
    """The name of the cached export folder of an "sft" warm start (its fingerprint, the last
    part of `warm_start_dir`), else "": part of a LoRA adapter's base identity
    (`strata_jax.jobs.adapters.base_identity`)."""
    if str(c.model.get("warm_start", "") or "") != "sft":
        return ""
    return os.path.basename(warm_start_dir(c, model_cfg, c.workdir))


def maybe_warm_start(c: Any, model_cfg: Qwen2Config, params: Any, tokenizer: Any, workdir: str,
                     mesh: jax.sharding.Mesh | None = None, train: bool = True) -> Any:
    """The run's initial params after the warm start of ``c.model.warm_start`` (the step
    after `experiment.build_model`; `workdir` is the run folder, for ``sft.cache_dir=""``).

    "" (default): `params` unchanged. "sft": behaviour cloning from `params` (see `run_sft`),
    cached: a finished export in `warm_start_dir` is loaded instead of retrained (the meta file
    is written last, so a killed run retrains). Any other value: an export directory (e.g. from
    ``sft.py``): an HF checkpoint whose config.json must equal `model_cfg`, or adapter files
    trained over these very `params` (`merged_warm_start`). Either form loads by `load_export`.
    Returns params in ``c.model.dtype``, placed on `mesh` when given (as `load_params` places).
    Raises ValueError when a given export has another shape, AdapterError (a ValueError) for
    adapter files that fail their checks; with ``train=False`` (eval), an "sft" warm start that
    is not cached is an `experiment.ConfigError` instead of being trained.
    """
    ws = str(c.model.get("warm_start", "") or "")
    if not ws:
        return params
    if ws != "sft":
        if not holds_adapters(ws):
            found = Qwen2Config.from_pretrained(ws)
            if found != model_cfg:
                raise ValueError(f"model.warm_start={ws!r} holds a {found} model but the run "
                                 f"builds {model_cfg}; use the same model.preset / path as the "
                                 "SFT run")
        return load_export(c, model_cfg, params, ws, mesh=mesh)
    cfg = SFTConfig.from_config(c)
    out = warm_start_dir(c, model_cfg, workdir)
    if os.path.isfile(os.path.join(out, META_FILE)):
        meta = read_export_meta(out, cfg)
        log.info("warm start: loading cached behaviour-cloning export %s", out)
        stale = stale_export_warning(out, meta)
        if stale:
            log.warning("%s", stale)
        return load_export(c, model_cfg, params, out, cfg.lora, mesh)
    if not train:
        raise ex.ConfigError(f"the warm start of this config is not cached in {out}; train it "
                             "first (python sft.py with the same --config) or pass "
                             "--config.model.warm_start= to use the initial params")
    log.info("warm start: behaviour cloning into %s (once; every run of this setting reuses "
             "it)", out)
    run_sft(c, model_cfg, params, tokenizer, out, cfg)
    return load_export(c, model_cfg, params, out, cfg.lora, mesh)


__all__ = ["maybe_warm_start", "export_warm_start", "run_sft", "warm_start_dir", "export_name",
           "read_export_meta",
           "fingerprint", "sft_base_identity", "export_sft_adapters", "holds_adapters",
           "merged_warm_start", "load_export",
           "source_fingerprint", "stale_export_warning",
           "sft_examples", "expert_tasks", "EXAMPLE_FORMAT", "META_FILE"]
