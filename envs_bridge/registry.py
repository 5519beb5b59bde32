"""Registry of envs by name (docs/design.md §8.2).

Adapters register a factory under a name; `make_env(name, **kwargs)` builds one. Heavy
adapters (ScienceWorld, ALFWorld, WebShop) are registered lazily by module path so that
importing envs_bridge never starts a JVM or imports textworld.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

from envs_bridge.base import Env

_FACTORIES: dict[str, Callable[..., Env]] = {}
_LAZY: dict[str, str] = {
    "scienceworld": "envs_bridge.scienceworld_env:ScienceWorldEnv",
    "alfworld": "envs_bridge.alfworld_env:ALFWorldEnv",
    "webshop": "envs_bridge.agentgym_http:WebShopEnv",
}


def register_env(name: str, factory: Callable[..., Env] | None = None):
    """Register `factory` (a class or callable returning an Env) under `name`.

    Usable as a decorator (`@register_env("name")`). Raises ValueError on a duplicate name.
    """

    def _register(f: Callable[..., Env]) -> Callable[..., Env]:
        if name in _FACTORIES or name in _LAZY:
            raise ValueError(f"env {name!r} is already registered")
        _FACTORIES[name] = f
        return f

    return _register(factory) if factory is not None else _register


def get_env_factory(name: str) -> Callable[..., Env]:
    """The factory registered under `name`. Raises KeyError listing the known names."""
    if name not in _FACTORIES and name in _LAZY:
        module, attr = _LAZY[name].split(":")
        _FACTORIES[name] = getattr(importlib.import_module(module), attr)
    if name not in _FACTORIES:
        import envs_bridge.builtin  # noqa: F401  (registers the built-in envs)
    if name not in _FACTORIES:
        raise KeyError(f"unknown env {name!r}; registered envs: {list_envs()}")
    return _FACTORIES[name]


def make_env(name: str, **kwargs: Any) -> Env:
    """Build the env registered under `name` with keyword arguments `kwargs`."""
    return get_env_factory(name)(**kwargs)


def list_envs() -> list[str]:
    """Sorted names of every registered env (built-ins and lazy adapters)."""
    import envs_bridge.builtin  # noqa: F401

    return sorted(set(_FACTORIES) | set(_LAZY))
