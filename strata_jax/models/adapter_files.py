"""Trained LoRA adapters as files anyone can keep, check and load again (PEFT's layout).

A folder ``<workdir>/adapters/step<k>/`` (written by the training job when a LoRA run ends)
holds:

    adapter_model.safetensors   every A and B in bfloat16, under PEFT's names:
        base_model.model.model.layers.<i>.self_attn.<q|k|v|o>_proj.lora_A.weight  [rank, in]
        base_model.model.model.layers.<i>.self_attn.<q|k|v|o>_proj.lora_B.weight  [out, rank]
        base_model.model.model.layers.<i>.mlp.<gate|up|down>_proj.lora_{A,B}.weight
    adapter_config.json         PEFT's fields (peft_type, r, lora_alpha, target_modules,
        base_model_name_or_path, ...) and a ``strata_jax`` block: step, algo, seed, the lora
        targets' regexes, the base's identity (`base_identity`'s fields) and the sha256 of
        adapter_model.safetensors.

The tensors are the adapters pytree of `strata_jax.models.lora` (its A / B layout is already
PEFT's ``lora_A.weight`` / ``lora_B.weight``), so ``PeftModel.from_pretrained`` reads the folder
on top of the HF base. bf16 halves the file; `load_adapters` casts back to float32, the
adapters' dtype (values equal the f32 adapters rounded to bf16). The files go through the
repo's own safetensors reader / writer (`strata_jax.models.loading`, bf16 via ml_dtypes).

`load_adapters` refuses, each with one `AdapterError` line that names the file and what to do:
a file whose sha256 is not the recorded one (changed after it was written), a tensor of the
wrong name or shape for the model config, a rank / alpha / target set other than the config's
LoRA section, and an adapter trained on another base (the recorded identity differs from the
one the caller builds: model path, preset, dtype, warm start and a sha256 over the base
params' bytes, `params_sha256`).
Sources: PEFT ``LoraConfig`` / ``save_pretrained`` (adapter_config.json fields, the
``base_model.model.`` key prefix, ``lora_A`` / ``lora_B`` names; a string target_modules is a
``re.fullmatch`` over module names); safetensors format spec.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from typing import Any

import numpy as np

from strata_jax.models.config import Qwen2Config
from strata_jax.models.lora import PROJECTIONS, Adapters, LoraConfig, target_names
from strata_jax.models.qwen2 import layer_shapes
from strata_jax.models.weights import path_to_hf_name

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
# The base identity fields compared before the params digest (a clearer message than a hash).
IDENTITY_FIELDS = ("model_path", "model_preset", "model_dtype", "warm_start",
                   "warm_start_export", "params_sha256")

_PEFT_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                        r"([a-z_]+_proj)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter folder that cannot be used as asked (changed on disk, another shape, rank or
    base); the message is one line naming the file and what to do."""


def peft_name(layer: int, proj: str, which: str) -> str:
    """PEFT's tensor name of A (``which="A"``) or B of projection `proj` in layer `layer`, e.g.
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    hf = path_to_hf_name(("layers", layer, proj))          # model.layers.0.self_attn.q_proj.weight
    return f"{PEFT_PREFIX}{hf[:-len('.weight')]}.lora_{which}.weight"


def file_sha256(path: str) -> str:
    """Hex sha256 of a file's bytes (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def params_sha256(params: Any) -> str:
    """Hex sha256 over a params tree: each leaf's path, dtype, shape and bytes, in the tree's
    flattening order (exact: any changed bit, dtype or shape changes it).

    Cost: one host pass over the bytes, one leaf at a time (a leaf is fetched from its devices
    first; in a multi-process run a leaf no process holds whole is gathered, a collective:
    every process must call it). Works on jax arrays and numpy arrays alike."""
    import jax
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        arr = _host(leaf)
        h.update(f"{jax.tree_util.keystr(path)}|{arr.dtype.name}|{arr.shape}|".encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def _host(x: Any) -> np.ndarray:
    """`x` as a host numpy array (gathered across processes when no process holds it whole)."""
    import jax
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def host_adapters(adapters: Adapters) -> Adapters:
    """The adapters pytree with host numpy leaves (every process must call it in a
    multi-process run: sharded leaves are gathered)."""
    return {"layers": {i: {p: {k: _host(v) for k, v in ab.items()} for p, ab in mods.items()}
                       for i, mods in adapters["layers"].items()}}


def peft_target_modules(model_cfg: Qwen2Config, names: list[str]) -> list[str] | str:
    """PEFT's ``target_modules`` for the adapted ``layers.<i>.<proj>`` names: the projection
    names when every layer adapts the same ones (``["q_proj", "v_proj"]``), else a regex that
    ``re.fullmatch``-es exactly the adapted module names (PEFT's string form)."""
    projs = sorted({n.split(".")[2] for n in names}, key=PROJECTIONS.index)
    if len(names) == len(projs) * model_cfg.num_layers:
        return projs
    mods = [path_to_hf_name(("layers", int(n.split(".")[1]), n.split(".")[2]))[:-len(".weight")]
            for n in names]
    return "(" + "|".join(re.escape(m) for m in mods) + ")"


def save_adapters(adapters: Adapters, lora_cfg: LoraConfig, model_cfg: Qwen2Config,
                  out_dir: str, meta: dict[str, Any]) -> str:
    """Write `adapters` as ``out_dir/adapter_model.safetensors`` (bf16, PEFT names) and
    ``out_dir/adapter_config.json`` (module docstring); returns out_dir (created).

    Args:
      adapters: the `strata_jax.models.lora` pytree (A [rank, in], B [out, rank]; any float
        dtype, jax or numpy leaves; `host_adapters` first in a multi-process run).
      lora_cfg: the run's LoRA config (rank, alpha, targets recorded).
      model_cfg: the model shape (every tensor is checked against it before anything is written).
      meta: the ``strata_jax`` block's run fields: ``step``, ``algo``, ``seed`` and ``base``
        (`base_identity`'s dict); ``base_model_name_or_path`` is ``base["model_path"]``.
    Each file is written beside its final name and renamed into place, the config last (a
    folder cut short holds no config naming a file that is not there).
    Raises AdapterError when the adapters do not fit `model_cfg` / `lora_cfg`.
    """
    import ml_dtypes

    from strata_jax.models.loading import write_safetensors

    host = host_adapters(adapters)
    names = _check_tree(host, model_cfg, lora_cfg.rank, out_dir)
    tensors = {}
    for n in names:
        _, i, proj = n.split(".")
        ab = host["layers"][i][proj]
        for which in "AB":
            tensors[peft_name(int(i), proj, which)] = \
                ab[which.lower()].astype(np.float32).astype(ml_dtypes.bfloat16)
    os.makedirs(out_dir, exist_ok=True)
    model_file = os.path.join(out_dir, ADAPTER_FILE)
    base = dict(meta.get("base", {}))
    # the settings that decide what the tensors mean, also inside the checksummed file: an
    # edit of adapter_config.json alone is then seen (`check_config`)
    inside = dict(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, targets=list(lora_cfg.targets),
                  base=base)
    write_safetensors(model_file + ".tmp", tensors, metadata={
        "format": "pt", "strata_jax": json.dumps(inside, sort_keys=True)})
    os.replace(model_file + ".tmp", model_file)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora_cfg.rank,
        "lora_alpha": lora_cfg.alpha, "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "modules_to_save": None,
        "target_modules": peft_target_modules(model_cfg, names),
        "base_model_name_or_path": base.get("model_path", ""),
        "strata_jax": {"step": int(meta["step"]), "algo": meta.get("algo", ""),
                       "seed": meta.get("seed"), "targets": list(lora_cfg.targets),
                       "adapted": names, "base": base, "sha256": file_sha256(model_file)},
    }
    config_file = os.path.join(out_dir, CONFIG_FILE)
    with open(config_file + ".tmp", "w") as f:
        json.dump(config, f, indent=1)
    os.replace(config_file + ".tmp", config_file)
    return out_dir


def read_adapter_config(path: str) -> dict[str, Any]:
    """The ``adapter_config.json`` of adapter folder `path`, after checking that the folder
    holds both files and that adapter_model.safetensors has the recorded sha256 (cheap: no
    tensor is parsed). Raises FileNotFoundError (no such folder / file) and AdapterError (not a
    strata_jax adapter config, or a checksum mismatch)."""
    config_file, model_file = os.path.join(path, CONFIG_FILE), os.path.join(path, ADAPTER_FILE)
    for f in (config_file, model_file):
        if not os.path.isfile(f):
            raise FileNotFoundError(f"{f} does not exist; eval.adapter names a folder "
                                    "<workdir>/adapters/step<k> that a LoRA training run wrote")
    try:
        with open(config_file) as f:
            config = json.load(f)
        recorded = config["strata_jax"]["sha256"]
    except (ValueError, KeyError, TypeError) as e:
        raise AdapterError(f"{config_file} is not a strata_jax adapter config ({type(e).__name__}: "
                           f"{e}); use a folder written by a LoRA training run") from None
    found = file_sha256(model_file)
    if found != recorded:
        raise AdapterError(f"{model_file} has sha256 {found[:16]}... but {CONFIG_FILE} records "
                           f"{recorded[:16]}...: the file changed after it was written; restore "
                           "it from a copy or re-run the training job that wrote it")
    return config


def check_config(config: dict[str, Any], model_file: str) -> None:
    """Refuse an adapter config whose settings are not a LoRA's (peft_type LORA, an integer
    r >= 1, a finite lora_alpha > 0) or differ from the copy the checksummed
    adapter_model.safetensors holds (r, lora_alpha, targets, base; files written before that
    copy existed carry none and are checked on their values only). Raises AdapterError."""
    r, alpha = config.get("r"), config.get("lora_alpha")
    ok = (config.get("peft_type") == "LORA" and isinstance(r, int) and not isinstance(r, bool)
          and r >= 1 and isinstance(alpha, (int, float)) and not isinstance(alpha, bool)
          and math.isfinite(alpha) and alpha > 0)
    if not ok:
        raise AdapterError(f"{model_file}: {CONFIG_FILE} holds peft_type={config.get('peft_type')!r}"
                           f", r={r!r}, lora_alpha={alpha!r}; a LoRA adapter has an integer r >= 1 "
                           "and a finite lora_alpha > 0: restore the folder from a copy")
    from strata_jax.models.loading import read_safetensors_metadata
    try:
        raw = read_safetensors_metadata(model_file).get("strata_jax")
        inside = None if raw is None else json.loads(raw)
    except ValueError as e:
        raise AdapterError(f"{e}; re-run the training job that wrote it") from None
    if not isinstance(inside, dict):   # written before the copy existed (None), or damaged
        if raw is None:
            return
        raise AdapterError(f"{model_file}: its strata_jax header entry is not a JSON object; "
                           "re-run the training job that wrote it")
    sj = config.get("strata_jax", {})
    given = dict(r=r, lora_alpha=alpha, targets=list(sj.get("targets", [])),
                 base=sj.get("base", {}))
    for k, v in inside.items():
        if given.get(k) != v:
            raise AdapterError(f"{os.path.join(os.path.dirname(model_file), CONFIG_FILE)}: {k}="
                               f"{given.get(k)!r} but {ADAPTER_FILE} was written with {k}={v!r}: "
                               "the config was edited after the adapters were saved; restore it "
                               "from a copy")


def lora_config_of(config: dict[str, Any]) -> LoraConfig:
    """The `LoraConfig` an adapter config records (rank, alpha, targets; lr is not part of the
    adapters and is left at its default)."""
    return LoraConfig(rank=int(config["r"]), alpha=float(config["lora_alpha"]),
                      targets=tuple(config["strata_jax"]["targets"]))


def check_base(recorded: dict[str, Any], expected: dict[str, Any], path: str) -> None:
    """Refuse an adapter whose recorded base identity differs from `expected` (the base the
    caller builds, `base_identity`'s fields; a field either side lacks is not compared).
    When both sides hold ``params_sha256``, the base's bytes alone decide: the same base
    reached under another name (a warm start named by its export folder instead of "sft", a
    copied model folder) is the same base, and any other base differs in its bytes.
    Raises AdapterError naming the field, both values and the folder."""
    if "params_sha256" in expected and "params_sha256" not in recorded:
        raise AdapterError(f"{os.path.join(path, CONFIG_FILE)} records no params_sha256 of the "
                           "base its adapters were trained on, so they cannot be checked against "
                           "this base; use the folder as its training run wrote it")
    fields = IDENTITY_FIELDS
    if "params_sha256" in recorded and "params_sha256" in expected:
        fields = ("params_sha256",)
    for k in fields:
        if k in recorded and k in expected and recorded[k] != expected[k]:
            raise AdapterError(
                f"{os.path.join(path, CONFIG_FILE)}: the adapters were trained on a base with "
                f"{k}={recorded[k]!r} but this config's base has {k}={expected[k]!r}; evaluate "
                "them with the training run's config (same model.path / preset, dtype, seed and "
                "warm start)")


def load_adapters(path: str, model_cfg: Qwen2Config, lora_cfg: LoraConfig | None = None,
                  base: dict[str, Any] | None = None) -> tuple[Adapters, dict[str, Any]]:
    """Read adapter folder `path` back: (adapters pytree in float32 host numpy, meta).

    Args:
      path: a folder `save_adapters` wrote (``<workdir>/adapters/step<k>``).
      model_cfg: the model the adapters are applied to: every A must be [rank, in] and every B
        [out, rank] of its projection, layers within num_layers.
      lora_cfg: the config's LoRA section, or None to take the file's. Given, the file's rank,
        alpha and adapted projections must equal it.
      base: the base identity the caller builds (`base_identity`'s fields), or None to skip.
    Returns meta = the config's ``strata_jax`` block (step, algo, seed, targets, adapted, base,
    sha256) plus ``"lora"``: the recorded `LoraConfig` (what `apply_lora` needs).
    Raises FileNotFoundError / AdapterError (`read_adapter_config`'s checks, a tensor of
    another name, shape or count, another rank / alpha / target set, another base).
    """
    from strata_jax.models.loading import read_safetensors
    config = read_adapter_config(path)
    check_config(config, os.path.join(path, ADAPTER_FILE))
    meta = dict(config["strata_jax"])
    recorded = lora_config_of(config)
    model_file = os.path.join(path, ADAPTER_FILE)
    if lora_cfg is not None and lora_cfg.enabled:
        theirs = (recorded.rank, recorded.alpha)
        if theirs != (lora_cfg.rank, lora_cfg.alpha):
            raise AdapterError(f"{model_file} holds rank {recorded.rank} (alpha "
                               f"{recorded.alpha:g}) adapters but the config has "
                               f"lora.rank={lora_cfg.rank}, lora.alpha={lora_cfg.alpha:g}; "
                               "set them to the file's (or lora.rank=0 to take them from "
                               "the file)")
    if base is not None:
        check_base(meta.get("base", {}), base, path)
    adapters: Adapters = {"layers": {}}
    try:
        tensors = read_safetensors(model_file)
    except ValueError as e:
        raise AdapterError(f"{e}; re-run the training job that wrote it") from None
    for name, arr in tensors.items():
        m = _PEFT_NAME.match(name)
        if not m or m.group(2) not in PROJECTIONS:
            raise AdapterError(f"{model_file}: tensor {name!r} is not a LoRA A / B of a Qwen2 "
                               "projection; use a folder written by a LoRA training run")
        i, proj, which = m.groups()
        adapters["layers"].setdefault(i, {}).setdefault(proj, {})[which.lower()] = \
            np.asarray(arr, np.float32)
    names = _check_tree(adapters, model_cfg, recorded.rank, model_file)
    if lora_cfg is not None and lora_cfg.enabled:
        want = target_names(model_cfg, lora_cfg)
        if sorted(names) != sorted(want):
            raise AdapterError(f"{model_file} adapts {len(names)} projections ({names[:2]} "
                               f"...) but lora.targets={lora_cfg.targets} selects {len(want)} "
                               f"({want[:2]} ...); set lora.targets to the file's "
                               f"{list(recorded.targets)} (or lora.rank=0)")
    meta["lora"] = recorded
    return adapters, meta


def _check_tree(adapters: Adapters, model_cfg: Qwen2Config, rank: int, where: str) -> list[str]:
    """The adapted ``layers.<i>.<proj>`` names in layer order, after checking every A / B
    against the model's shapes and `rank`. Raises AdapterError."""
    shapes = layer_shapes(model_cfg)
    names = []
    for i in sorted(adapters["layers"], key=int):
        if int(i) >= model_cfg.num_layers:
            raise AdapterError(f"{where}: adapters for layer {i} but the model has "
                               f"{model_cfg.num_layers} layers; use the run's model config")
        for proj in sorted(adapters["layers"][i], key=PROJECTIONS.index):
            ab = adapters["layers"][i][proj]
            n_out, n_in = shapes[proj]
            want = {"a": (rank, n_in), "b": (n_out, rank)}
            got = {k: tuple(np.shape(v)) for k, v in ab.items()}
            if got != want:
                raise AdapterError(f"{where}: layers.{i}.{proj} has A/B shapes {got} but a rank "
                                   f"{rank} adapter of this model needs {want}; use the run's "
                                   "model config")
            names.append(f"layers.{i}.{proj}")
    if not names:
        raise AdapterError(f"{where}: no adapter tensors; use a folder written by a LoRA "
                           "training run")
    return names


__all__ = ["ADAPTER_FILE", "CONFIG_FILE", "PEFT_PREFIX", "IDENTITY_FIELDS", "AdapterError",
           "peft_name", "file_sha256", "params_sha256", "host_adapters", "peft_target_modules",
           "save_adapters", "read_adapter_config", "lora_config_of", "check_base",
           "load_adapters"]
