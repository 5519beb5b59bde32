"""A LoRA run's adapters as files, between the jobs and `strata_jax.models.adapter_files`:

* training: `export_run_adapters` writes the final adapters of a finished LoRA run to
  ``<workdir>/adapters/step<k>/`` (`strata_jax.jobs.train`, after the last checkpoint save);
* evaluation: ``eval.adapter`` names such a folder; `check_adapter_config` is the preflight's
  cheap check (the files exist, the checksum, the config's base), `adapter_policy_params`
  loads the adapters onto the config's base once it is built (`strata_jax.jobs.evaluate`).

The base's identity (`base_identity`) is what the adapters are only valid on: model.path /
preset, dtype, warm start (with the cached export's fingerprint folder for "sft") and a
sha256 over the base params' bytes as the run holds them (`adapter_files.params_sha256`).
"""
from __future__ import annotations

import os
from typing import Any

from strata_jax.models.adapter_files import (AdapterError, check_base, host_adapters,
                                             load_adapters, params_sha256, read_adapter_config,
                                             save_adapters)

ADAPTERS_DIR = "adapters"


def base_identity(c: Any, warm_start_export: str | None = None,
                  base: Any = None) -> dict[str, Any]:
    """The identity of config `c`'s base model: ``model_path``, ``model_preset``,
    ``model_dtype``, ``warm_start``; with `warm_start_export` given also that field (the
    cached export's fingerprint folder name for "sft", else "":
    `strata_jax.jobs.warm_start.export_name`); with the base params `base` also
    ``params_sha256`` (a collective in a multi-process run)."""
    out: dict[str, Any] = {"model_path": str(c.model.path or ""),
                           "model_preset": str(c.model.preset or ""),
                           "model_dtype": str(c.model.dtype),
                           "warm_start": str(c.model.get("warm_start", "") or "")}
    if warm_start_export is not None:
        out["warm_start_export"] = warm_start_export
    if base is not None:
        out["params_sha256"] = params_sha256(base)
    return out


def adapters_dir(workdir: str, step: int) -> str:
    """``<workdir>/adapters/step<step>``."""
    return os.path.join(workdir, ADAPTERS_DIR, f"step{int(step)}")


def export_run_adapters(c: Any, workdir: str, model_cfg: Any, lora_cfg: Any, adapters: Any,
                        base: Any, step: int, warm_start_export: str) -> str | None:
    """Write a finished LoRA run's `adapters` (the train state's params) at `step` to
    `adapters_dir` with the run's meta (step, algo, seed, `base_identity` of `base` and
    `warm_start_export`). Every process must call it (the adapters and the base digest are
    gathered); process 0 writes. Returns the folder on process 0, else None."""
    from strata_jax import distributed
    host = host_adapters(adapters)
    identity = base_identity(c, warm_start_export, base)
    if not distributed.is_primary():
        return None
    meta = {"step": int(step), "algo": str(c.algo), "seed": int(c.seed), "base": identity}
    return save_adapters(host, lora_cfg, model_cfg, adapters_dir(workdir, step), meta)


def check_adapter_config(c: Any) -> dict[str, Any]:
    """The preflight of ``eval.adapter``: the folder holds both files, adapter_model.safetensors
    has its recorded sha256 and the recorded base agrees with the config's model path, preset
    and dtype, before any model is built (the warm start is checked by the base's bytes once
    built, `adapter_policy_params`: it may be named another way, e.g. by its export folder).
    Returns the adapter config.
    Raises ConfigError (one line, naming the folder and what to do)."""
    from strata_jax.config import ConfigError
    path = str(c.eval.adapter)
    if not os.path.isdir(path):
        raise ConfigError(f"eval.adapter={path!r} is not a folder; give an adapters/step<k> "
                          "folder that a LoRA training run wrote (<workdir>/adapters/)")
    try:
        config = read_adapter_config(path)
        names = {k: v for k, v in base_identity(c).items() if k != "warm_start"}
        check_base(config["strata_jax"].get("base", {}), names, path)
    except (AdapterError, FileNotFoundError) as e:
        raise ConfigError(f"eval.adapter: {e}") from None
    return config


def adapter_policy_params(c: Any, r: Any, warm_start_export: str) -> tuple[Any, int, str]:
    """(merged params, adapter step, folder) of ``eval.adapter`` on the assembled `Run` `r`:
    the adapters loaded (`load_adapters`, checked against `r.model`, the config's LoRA section
    when on, and the base identity of `r.init_params` and `warm_start_export`), placed like training's
    (`lora_shardings`) and merged into the base as a checkpoint's are (jitted `apply_lora`,
    the base's dtype). Raises ConfigError for an adapter that does not fit."""
    import jax

    from strata_jax.config import ConfigError
    from strata_jax.models.lora import LoraConfig, apply_lora, lora_shardings
    path = str(c.eval.adapter)
    lora = LoraConfig.from_config(c)
    try:
        adapters, meta = load_adapters(path, r.model, lora if lora.enabled else None,
                                       base=base_identity(c, warm_start_export,
                                                          r.init_params))
    except (AdapterError, FileNotFoundError) as e:
        raise ConfigError(f"eval.adapter: {e}") from None
    adapters = jax.device_put(adapters, lora_shardings(adapters, r.model, r.mesh))
    merge = jax.jit(apply_lora, static_argnums=(2, 3))
    with jax.set_mesh(r.mesh):
        params = merge(r.init_params, adapters, meta["lora"], r.init_params["embed"].dtype)
    return params, int(meta["step"]), path


__all__ = ["ADAPTERS_DIR", "base_identity", "adapters_dir", "export_run_adapters",
           "check_adapter_config", "adapter_policy_params"]
