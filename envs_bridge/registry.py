"""Registry of envs by name (docs/design.md §8.2).

`BUILTIN` is the table of the envs that ship with the package, by module path: an entry is
imported on first use, so importing envs_bridge never starts a JVM, imports textworld or builds
anything. Other envs register a factory at run time (`register_env`); `make_env(name, **kwargs)`
builds one.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

from envs_bridge.base import Env

# name -> "module:attribute" of the factory (an Env class), imported lazily.
BUILTIN: dict[str, str] = {
    "scienceworld": "envs_bridge.scienceworld_env:ScienceWorldEnv",
    "alfworld": "envs_bridge.alfworld_env:ALFWorldEnv",
    "webshop": "envs_bridge.agentgym_http:WebShopEnv",
    "memory_key": "envs_bridge.builtin:MemoryKeyEnv",
    "guess_number": "envs_bridge.builtin:GuessNumberEnv",
    "grid_nav": "envs_bridge.builtin:GridNavEnv",
}
_FACTORIES: dict[str, Callable[..., Env]] = {}


def register_env(name: str, factory: Callable[..., Env] | None = None):
    """Register `factory` (a class or callable returning an Env) under `name`.

    Usable as a decorator (`@register_env("name")`). Raises ValueError on a duplicate name.
    """

    def _register(f: Callable[..., Env]) -> Callable[..., Env]:
        if name in _FACTORIES or name in BUILTIN:
            raise ValueError(f"env {name!r} is already registered")
        _FACTORIES[name] = f
        return f

    return _register(factory) if factory is not None else _register


def get_env_factory(name: str) -> Callable[..., Env]:
    """The factory registered under `name` (a `BUILTIN` entry is imported on first use).
    Raises KeyError listing the known names."""
    if name not in _FACTORIES and name in BUILTIN:
        module, attr = BUILTIN[name].split(":")
        _FACTORIES[name] = getattr(importlib.import_module(module), attr)
    if name not in _FACTORIES:
        raise KeyError(f"unknown env {name!r}; registered envs: {list_envs()}")
    return _FACTORIES[name]


def make_env(name: str, **kwargs: Any) -> Env:
    """Build the env registered under `name` with keyword arguments `kwargs`."""
    return get_env_factory(name)(**kwargs)


def list_envs() -> list[str]:
    """Sorted names of every env: the `BUILTIN` table and those registered at run time."""
    return sorted(set(_FACTORIES) | set(BUILTIN))
