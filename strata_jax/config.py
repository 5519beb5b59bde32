"""Reading the experiment ConfigDict: its errors, its command-line parser, strict section reads.

An experiment is described by one ``ml_collections.ConfigDict`` (``configs/base.py`` and the
experiment files built on it; docs/design.md §3). This module is what the library knows about
that dict without importing ``configs/`` (which is not part of the installed package):

* `ConfigError`: a config that cannot run (every user-facing config mistake is one).
* `set_override` / `parse_value` / `field_type`: the one parser of command-line text for a
  dotted field, shared by ``--config.<field>=<text>`` (`strata_jax.jobs.cli`) and the variant form
  ``--config=configs/x.py:<field>=<text>`` (``configs/base.py:apply_variant``).
* `read_fields`: builds a frozen option dataclass (``LossConfig``, ``TrainConfig``, ...) from
  the dict, reading every field from its one source key; a missing key or a key of the
  dataclass's own section that no field reads is a ConfigError naming the closest valid key.

Only the standard library is imported here, so every module may import it.
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
from typing import Any, Callable, Iterable, Mapping


class ConfigError(ValueError):
    """An experiment config that cannot run; the message says which field to change."""


class OverrideError(ConfigError):
    """A ``key=value`` override that names no field or whose value does not fit the field's type."""


# Declared types of the fields whose default does not say it (a None default, a union, the
# element type of an empty tuple). Every other field's type is that of its value in the config
# (configs/base.py, or for a field only an experiment file adds, e.g. env.code_digits, there).
FIELD_TYPES = {
    "adv.std_ddof": "int|None",               # None = each estimator's pin
    "model.remat": "remat",                   # True/False or a policy: none | full | dots
    "distributed.local_device_ids": "tuple[int]",
    "rollout.row_buckets": "tuple[int]|None",  # None = round the rows up to row_multiple
    "rollout.prompt_buckets": "tuple[int]|None",
    "rollout.response_buckets": "tuple[int]|None",
}
# The remat policies (``model.remat``, `TrainConfig.remat`, `qwen2.forward`'s remat): name ->
# the ``jax.checkpoint_policies`` member each decoder layer is rematerialised under (None: no
# checkpoint; `models.layers.checkpoint_policy` looks it up). "full" keeps only each decoder
# layer's input and recomputes the layer in the backward pass; "dots" also keeps the
# weight-matmul outputs (no batch dims: q/k/v/o, gate/up/down, LoRA's x @ A) and recomputes the
# cheap elementwise work (maxtext's usual policy). Names only here: this module imports no jax.
REMAT_CHECKPOINT_POLICIES = {"none": None, "full": "nothing_saveable",
                             "dots": "dots_with_no_batch_dims_saveable"}
REMAT_POLICIES = tuple(REMAT_CHECKPOINT_POLICIES)   # the names, in order
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _is_dict(node: Any) -> bool:
    return hasattr(node, "keys") and hasattr(node, "__getitem__") and not isinstance(node, str)


def nearest(name: str, names: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean 'x'?)`` for the closest of `names` to `name` (difflib), or "";
    `prefix` (e.g. ``"optim."``) is put before the suggested name, so that it can be typed
    as it stands."""
    hint = difflib.get_close_matches(name, list(names), n=1)
    return f" (did you mean {prefix + hint[0]!r}?)" if hint else ""


def _unknown(node: Any, key: str, leaf: str) -> str:
    """The message for dotted `key` whose last part `leaf` is not a key of `node`; the
    suggestion is the full dotted name (``optim.lrr`` -> 'optim.lr')."""
    names = list(node.keys()) if _is_dict(node) else []
    parent = key.rpartition(".")[0]
    return f"unknown config field {key!r}" + nearest(leaf, names, f"{parent}." if parent else "")


def field_type(c: Any, key: str) -> str:
    """The declared type of dotted field `key` of config `c`: "bool", "int", "float", "str",
    "tuple[str]", "tuple[int]", "int|None", "tuple[int]|None" or "remat" (see FIELD_TYPES).
    Raises OverrideError naming the closest field when `key` names none."""
    if key in RENAMED_FIELDS:
        raise OverrideError(renamed_field_error(key))
    *parents, leaf = key.split(".")
    node = c
    for i, p in enumerate(parents):
        if not _is_dict(node) or p not in node:
            raise OverrideError(_unknown(node, ".".join(parents[: i + 1]), p))
        node = node[p]
    if not _is_dict(node) or leaf not in node or _is_dict(node[leaf]):
        raise OverrideError(_unknown(node, key, leaf))
    if key in FIELD_TYPES:
        return FIELD_TYPES[key]
    default = node[leaf]
    if isinstance(default, tuple):
        return "tuple[int]" if default and all(isinstance(v, int) for v in default) \
            else "tuple[str]"
    return {bool: "bool", int: "int", float: "float", str: "str"}.get(type(default), "str")


def parse_value(key: str, kind: str, text: str):
    """Parse the command-line text of field `key` by its declared type `kind` (`field_type`).

    bool: true/false, 1/0, yes/no, on/off (any case); int: an integer (``1e3`` is 1000,
    ``2.7`` is refused); float: any finite or infinite float; tuple: ``a+b`` (the colon form
    cannot hold commas), ``(a, b)`` / ``[a, b]``, or empty for (); int|None: an integer or
    ``none``; tuple[int]|None: a tuple of integers or ``none``; remat: a bool or one of
    REMAT_POLICIES. Raises OverrideError saying what fits.
    """
    t = text.strip()
    low = t.lower()
    if kind == "bool" or (kind == "remat" and low in _TRUE + _FALSE):
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        expect = "true or false" if kind == "bool" else f"true, false or one of {REMAT_POLICIES}"
        raise OverrideError(f"{key}={text!r} is not a boolean; use {expect}")
    if kind == "remat":
        if low in REMAT_POLICIES:
            return low
        raise OverrideError(f"{key}={text!r}: use true, false or a remat policy {REMAT_POLICIES}")
    if kind.endswith("|None") and low in ("none", "null", ""):
        return None
    if kind == "tuple[int]|None":
        kind = "tuple[int]"
    if kind in ("int", "int|None"):
        try:
            return int(t)
        except ValueError:
            pass
        try:
            f = float(t)
        except ValueError:
            f = float("nan")
        if f == f and f not in (float("inf"), float("-inf")) and f.is_integer():
            return int(f)
        raise OverrideError(f"{key}={text!r} is not an integer" +
                            (" (or none)" if kind == "int|None" else ""))
    if kind == "float":
        try:
            return float(t)
        except ValueError:
            raise OverrideError(f"{key}={text!r} is not a number") from None
    if kind.startswith("tuple"):
        if t[:1] in "([" and t[-1:] in ")]":
            items = [v.strip().strip("'\"") for v in t[1:-1].split(",")]
        else:
            items = [v.strip() for v in t.split("+")]
        items = [v for v in items if v]
        if kind == "tuple[int]":
            return tuple(parse_value(key, "int", v) for v in items)
        return tuple(items)
    return text


# Fields that no longer exist, with why: an override of one is ignored with a warning instead of
# refused, so the command lines of earlier runs and studies still run (and resume).
RETIRED = {
    "train.group_by_length": "the update always runs prefix-tree packed rows (no width groups)",
    "train.pack_prefixes": "the update always runs prefix-tree packed rows",
}

# Fields renamed or split: old dotted name -> (what to set instead, one line; the new name a
# stored config's old value is read as). Unlike a RETIRED field, a config or override holding
# an old name is refused with its line (`renamed_field_error`): its value still means
# something. A stored config (a checkpoint's meta) is read with the old name mapped to the new
# (`validation.run_identity`), so a run written before the rename still resumes.
RENAMED_FIELDS = {
    "optim.micro_batch_size": (
        "optim.micro_batch_size was split by unit: set optim.micro_batch_rows (rows per "
        "micro-batch; the old value) and optim.micro_batch_tokens (the packed update's token "
        "budget per micro-batch; 0 = micro_batch_rows rows at the batch's width)",
        "optim.micro_batch_rows"),
}


def renamed_field_error(key: str) -> str | None:
    """The one-line message for a renamed dotted field `key` (`RENAMED_FIELDS`), or None."""
    return RENAMED_FIELDS[key][0] if key in RENAMED_FIELDS else None


def set_override(c: Any, key: str, text: str) -> None:
    """Set dotted field `key` of ConfigDict `c` from command-line `text`, parsed by the field's
    declared type (`field_type`, `parse_value`); the one parser of both ``--config.key=text``
    and the colon form ``:key=text``. A RETIRED field is ignored with a warning. Raises
    OverrideError on an unknown field or a value that does not fit."""
    if key in RETIRED:
        logging.getLogger(__name__).warning("ignoring --config.%s=%s: the field is retired (%s)",
                                            key, text, RETIRED[key])
        return
    value = parse_value(key, field_type(c, key), text)
    *parents, leaf = key.split(".")
    node = c
    for p in parents:
        node = node[p]
    with node.ignore_type():   # a declared union: None -> 1 (std_ddof), True -> "full" (remat)
        node[leaf] = value


def get_dotted(c: Any, dotted: str, prefix: str = "") -> Any:
    """The value of dotted field `dotted` of `c` (`prefix`: the dotted path of `c` itself in the
    experiment config, for the message). Raises ConfigError naming the closest key when a level
    is missing."""
    node = c
    for k in dotted.split("."):
        if not _is_dict(node) or k not in node:
            names = list(node.keys()) if _is_dict(node) else []
            raise ConfigError(f"the config lacks {prefix + dotted!r}{nearest(k, names)}: every "
                              "field is declared in configs/base.py; build configs from its "
                              "get_base_config()")
        node = node[k]
    return node


def read_fields(cls: type, c: Any, sources: Mapping[str, str],
                convert: Mapping[str, Callable[[Any], Any]] | None = None,
                owned: Mapping[str, Iterable[str]] | None = None,
                prefix: str = "") -> dict[str, Any]:
    """Read the constructor arguments of dataclass `cls` from ConfigDict `c`, strictly.

    Args:
      cls: the option dataclass (for the messages).
      c: the experiment ConfigDict, or one of its sections (then `prefix` is its dotted path
        plus ".", e.g. "adv.", for the messages).
      sources: {field: dotted key of `c`}: every field read here comes from exactly one key;
        there is no fallback to the dataclass default (a missing key is a ConfigError).
      convert: optional {field: function} applied to the value read (e.g. model.remat's bool).
      owned: optional {section of `c` ("" = `c` itself): extra key names}: every key of that
        section must be the source of a field here or one of the extra names (read elsewhere);
        any other key is a ConfigError naming the closest valid key (a typo such as
        ``loss.kl_coeff``).
    Returns {field: value}. Raises ConfigError.
    """
    convert = convert or {}
    for section, extra in (owned or {}).items():
        node = get_dotted(c, section, prefix) if section else c
        valid = {k.split(".")[-1] for k in sources.values()
                 if k.rpartition(".")[0] == section} | set(extra)
        for k in node.keys():
            if k not in valid:
                where = prefix + (f"{section}.{k}" if section else k)
                if where in RENAMED_FIELDS:
                    raise ConfigError(renamed_field_error(where))
                raise ConfigError(f"unknown config field {where!r}{nearest(k, valid)}: no "
                                  f"{cls.__name__} field reads it (the fields and their "
                                  "defaults are in configs/base.py)")
    out = {}
    for name, key in sources.items():
        v = get_dotted(c, key, prefix)
        out[name] = convert[name](v) if name in convert else v
    return out


def section_sources(cls: type, section: str, exclude: Iterable[str] = ()) -> dict[str, str]:
    """{field: "<section>.<field>"} for every field of dataclass `cls` not in `exclude` (a
    section whose keys are the dataclass's field names); `section` "" = top level."""
    skip = set(exclude)
    return {f.name: f"{section}.{f.name}" if section else f.name
            for f in dataclasses.fields(cls) if f.name not in skip}


def from_section(cls: type, cfg: Any, **overrides: Any):
    """An option dataclass `cls` (with a ``SECTION`` name and a ``validate`` method) from its
    config section `cfg` (every field read, no other key allowed: `read_fields`) or from an
    instance of `cls`; `overrides` replace fields; then ``validate``. Raises ConfigError on a
    missing or unknown key, ValueError (from ``validate``) on a bad value."""
    if isinstance(cfg, cls):
        values = dataclasses.asdict(cfg)
    else:
        values = read_fields(cls, cfg, section_sources(cls, ""), owned={"": ()},
                             prefix=f"{cls.SECTION}.")
    values.update(overrides)
    obj = cls(**values)
    obj.validate()
    return obj

