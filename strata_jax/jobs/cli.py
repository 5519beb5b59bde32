"""Command-line handling shared by the entry points (train.py, eval.py, sft.py: each parses its
flags and calls its job in `strata_jax.jobs`).

* `parse_flags`: absl's flag parsing, except that every ``--config.<field>=<value>`` override is
  parsed here, by the field's declared type, with the same parser as the colon form
  (``--config=configs/x.py:tiny,<field>=<value>``; `strata_jax.config.set_override`).
* `guarded`: wraps an entry point's ``main`` so that a user's mistake (a config that cannot run,
  a missing checkpoint) and Ctrl-C end with one line on stderr instead of a traceback.

Every entry point (train.py, eval.py, sft.py, ``python -m strata_jax.models.fetch``) exits with
one of the statuses of `strata_jax.exits` (finished, a bug, refused, preempted with a checkpoint,
interrupted at once), re-exported here; docs/reliability.md has the table.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys
from typing import Any, Callable, Sequence

from absl import app

from strata_jax.exits import (EXIT_BUG, EXIT_FINISHED, EXIT_INTERRUPTED,  # noqa: F401
                              EXIT_PREEMPTED, EXIT_REFUSED, STOP_SIGNALS, Stopped,
                              install_stop_handlers, stop_at_once)

_HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")

_FIELDS_HINT = ("Fields and their defaults: configs/base.py; variants: the experiment file's "
                "docstring.")


def _fail(prog: str, msg: str, code: int = EXIT_REFUSED) -> None:
    sys.stderr.write(f"{prog}: {msg}\n")
    raise SystemExit(code)


def split_config_args(argv: Sequence[str]) -> tuple[list[str], list[tuple[str, str]], str | None]:
    """Split `argv` into (the other arguments, the ``--config.<field>`` overrides as
    (field, text) pairs in order, the ``--config`` file spec or None).

    ``--config.<field>`` without ``=`` means ``=true`` (absl's spelling of a boolean flag);
    ``--config.<field> value`` (space form) is taken as the value when the next argument does
    not start with ``-``.
    """
    rest: list[str] = [argv[0]] if argv else []
    overrides: list[tuple[str, str]] = []
    spec = None
    args = list(argv[1:])
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--config."):
            body = a[len("--config."):]
            if "=" in body:
                overrides.append(tuple(body.split("=", 1)))  # type: ignore[arg-type]
            elif i + 1 < len(args) and not args[i + 1].startswith("-"):
                overrides.append((body, args[i + 1]))
                i += 1
            else:
                overrides.append((body, "true"))
        else:
            if a.startswith("--config="):
                spec = a.split("=", 1)[1]
            elif a == "--config" and i + 1 < len(args):
                spec = args[i + 1]
            rest.append(a)
        i += 1
    return rest, overrides, spec


def load_config(spec: str) -> Any:
    """The ConfigDict of ``path[:variant]`` (``get_config(variant)`` of that file), as
    ml_collections' config flag loads it. Raises ValueError, one line naming the file (and the
    line, where there is one), for an unknown variant or bad ``key=value``, a syntax error or
    an exception while importing the file or in its get_config, and a get_config that returns
    no ConfigDict; FileNotFoundError for a missing file."""
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise FileNotFoundError(missing_config_message(path, arg))
    root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    if root not in sys.path:
        sys.path.insert(0, root)
    modspec = importlib.util.spec_from_file_location("_strata_config_check", path)
    mod = importlib.util.module_from_spec(modspec)
    try:
        modspec.loader.exec_module(mod)  # type: ignore[union-attr]
    except SyntaxError as e:
        raise ValueError(f"{path}:{e.lineno}: syntax error: {e.msg}; fix the file") from None
    except Exception as e:  # noqa: BLE001 — the file's own code: report where, not a traceback
        raise ValueError(f"{_where(e, path)}: importing it raised {type(e).__name__}: "
                         f"{_first_line(e)}; fix the file") from None
    if not callable(getattr(mod, "get_config", None)):
        raise ValueError(f"{path} defines no get_config(); an experiment file returns its "
                         "ConfigDict from get_config(arg=None)")
    call = f"get_config({arg!r})" if arg else "get_config()"
    try:
        c = mod.get_config(arg) if arg else mod.get_config()
    except ValueError:
        raise   # the file's own refusal (an unknown variant, a bad key=value): already one line
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{_where(e, path)}: {call} raised {type(e).__name__}: "
                         f"{_first_line(e)}; fix the file") from None
    import ml_collections
    if not isinstance(c, ml_collections.ConfigDict):
        raise ValueError(f"{path}: {call} returned a {type(c).__name__}, not an "
                         "ml_collections.ConfigDict (start from configs/base.py's "
                         "get_base_config())")
    return c


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else "(no message)"


def _where(e: BaseException, path: str) -> str:
    """``path:line`` of the innermost traceback frame inside `path` (else `path`)."""
    import traceback
    line = None
    for frame in traceback.extract_tb(e.__traceback__):
        if os.path.abspath(frame.filename) == os.path.abspath(path):
            line = frame.lineno
    return f"{path}:{line}" if line else path


def checkout_configs_dir() -> str:
    """The absolute path of the ``configs/`` folder beside this installed ``strata_jax``
    package (the checkout's, for an editable install)."""
    import strata_jax
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(strata_jax.__file__))),
                        "configs")


def missing_config_message(path: str, variant: str = "") -> str:
    """The message for a config file `path` (with its colon `variant`) that does not exist:
    config paths are relative to the current directory, and the checkout's configs/ folder is
    named (with the same file and variant there, when that file exists)."""
    configs = checkout_configs_dir()
    msg = (f"config file {path!r} does not exist; config paths are relative to the current "
           f"directory {os.getcwd()}, and this checkout's configs are in {configs}")
    there = os.path.join(configs, os.path.basename(path))
    if os.path.isfile(there) and not os.path.isabs(path):
        msg += (f" (--config={there}{':' + variant if variant else ''}, or run from "
                f"{os.path.dirname(configs)})")
    elif not os.path.isfile(there):
        msg += f" (e.g. --config={os.path.join(configs, 'sciworld.py')}:tiny)"
    return msg


def parse_flags(argv: Sequence[str]) -> list[str]:
    """absl's flag parsing (for ``app.run(main, flags_parser=parse_flags)``) with the config
    overrides parsed by `strata_jax.config.set_override`.

    The config file (and its colon variant) is loaded first on its own, so a typo there
    (``:tiny,grop``, ``:tiny,optim.lrr=1e-5``, ``:tiny,rollout.self_judgment=flase``) is one
    line on stderr and exit status 2 (absl's status for bad flags); then absl parses the other
    flags and loads the config, and the ``--config.<field>=`` overrides are applied to it in
    order, each parsed by the field's declared type (a value that does not fit, or a field that
    does not exist, is again one line and exit 2). Returns the positional arguments.
    """
    from strata_jax.config import OverrideError, set_override

    prog = os.path.basename(argv[0]) if argv else "strata_jax"
    rest, overrides, spec = split_config_args(argv)
    loaded = None
    if spec is not None:
        try:
            loaded = load_config(spec)
        except (ValueError, FileNotFoundError) as e:
            _fail(prog, f"--config={spec}: {e}. {_FIELDS_HINT}")
    from absl import flags
    for arg in rest[1:]:
        hint = config_flag_hint(arg, loaded)
        if hint:
            _fail(prog, hint)
    saved = sys.argv
    sys.argv = rest   # ml_collections reads its overrides from sys.argv itself: hide them
    try:
        # absl's own parse_flags_with_usage prints the usage and exits 1 (the status of a bug)
        positional = flags.FLAGS(rest)
    except flags.Error as e:
        _fail(prog, f"{e}. --helpshort lists the flags")
    except SystemExit as e:   # absl's help flags print the help and exit 1: that is not an error
        if any(a.split("=")[0] in _HELP_FLAGS for a in rest[1:]):
            raise SystemExit(EXIT_FINISHED) from None
        raise
    finally:
        sys.argv = saved
    c = flags.FLAGS["config"].value
    for key, text in overrides:
        try:
            set_override(c, key, text)
        except OverrideError as e:
            msg = str(e)
            if msg.startswith("unknown config field"):
                hint = msg[msg.index(" (did you mean"):] if "(did you mean" in msg else ""
                _fail(prog, f"--config.{key} names no field of the config{hint}. {_FIELDS_HINT}")
            _fail(prog, f"--config.{msg}")
    if spec is not None:
        note = outside_checkout_note(spec, c)
        if note:
            sys.stderr.write(f"{prog}: note: {note}\n")
    return positional


def outside_checkout_note(spec: str, config: Any) -> str | None:
    """A note when a checkout's config is run from another directory while the run's folders
    are relative: they land under the current directory, beside no earlier run or cached warm
    start (``python strata-jax/train.py --config=strata-jax/configs/...`` from the parent
    directory would otherwise start from scratch in ``./runs`` without a word). None otherwise."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(spec.partition(":")[0])))
    if not os.path.isfile(os.path.join(root, "train.py")) or os.path.samefile(root, os.getcwd()):
        return None
    rel = [f for f in ("workdir", "sft.cache_dir", "compilation_cache_dir")
           if _field(config, f) and not os.path.isabs(str(_field(config, f)))]
    if not rel:
        return None
    return (f"{', '.join(rel)} ({_field(config, rel[0])}, ...) are relative to the current "
            f"directory {os.getcwd()}, not to the checkout {root}: run from the checkout to "
            "find its runs and cached warm starts")


def _field(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        config = config.get(part) if hasattr(config, "get") else None
    return config


def config_flag_hint(arg: str, config: Any) -> str | None:
    """The one line for a flag the script does not define but the config has as a field
    (``--iterations=6`` for ``--config.iterations=6``), else None: absl's own message ("unknown
    command line flag") does not say that config fields go through ``--config.``."""
    from absl import flags

    if not arg.startswith("--") or arg == "--" or config is None:
        return None
    name, _, value = arg[2:].partition("=")
    if name in flags.FLAGS or (name.startswith("no") and name[2:] in flags.FLAGS):
        return None
    fields = [k for k in _dotted_fields(config) if k == name or k.endswith("." + name)]
    if not fields:
        return None
    example = f"--config.{fields[0]}" + (f"={value}" if value else "=...")
    return (f"--{name} is not a flag of this script; config fields are set as "
            f"--config.<field>=<value>: {example}")


def _dotted_fields(config: Any, prefix: str = "") -> list[str]:
    """Every leaf field of a ConfigDict as a dotted name, shortest paths first."""
    out = []
    for k, v in config.items():
        if hasattr(v, "items"):
            out += _dotted_fields(v, f"{prefix}{k}.")
        else:
            out.append(prefix + k)
    return sorted(out, key=lambda f: (f.count("."), f))


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean the user has something to change, not a bug: a config that cannot
    run (`strata_jax.config.ConfigError`), a missing file or checkpoint (FileNotFoundError, including
    ALFWorld's missing game data), a checkpoint that cannot be written (`CheckpointWriteError`:
    a full disk; its message names the path and the space needed) or restored
    (`NoRestorableCheckpointError`: names each step and file), a model file that cannot be used
    (`GGUFError`: malformed, hostile or inconsistent), LoRA adapter files that fail their
    checks (`AdapterError`: a checksum, an edited config, another base), a damaged run log
    (`DamagedLogError`: names the file and line)."""
    from strata_jax.config import ConfigError
    from strata_jax.metrics import DamagedLogError
    from strata_jax.models.adapter_files import AdapterError
    from strata_jax.models.gguf import GGUFError
    from strata_jax.training.checkpoint import CheckpointWriteError, NoRestorableCheckpointError
    return (ConfigError, FileNotFoundError, CheckpointWriteError, NoRestorableCheckpointError,
            GGUFError, AdapterError, DamagedLogError)


def guarded(main: Callable[[list[str]], int]) -> Callable[[list[str]], int]:
    """Wrap an entry point's ``main(argv)`` to follow the exit-code table (module docstring):
    SIGTERM and SIGHUP are routed to `stop_at_once` first (the training loop replaces that
    with its clean stop while it runs); a `user_errors` exception becomes one line
    ``<script>: error: <message>`` on stderr and status 2; Ctrl-C (KeyboardInterrupt) or a
    stop signal outside the training loop's own handling becomes one line and status 130.
    ``main``'s return value is the status otherwise. Anything else propagates with its
    traceback (a bug: status 1)."""
    @functools.wraps(main)
    def wrapped(argv: list[str]) -> int:
        prog = os.path.basename(sys.argv[0]) if sys.argv else "strata_jax"
        install_stop_handlers()
        try:
            return main(argv)
        except KeyboardInterrupt as e:
            what = f"stopped ({e.name})" if isinstance(e, Stopped) else "interrupted (Ctrl-C)"
            _fail(prog, f"{what}; the same command resumes a training run from its newest "
                        "checkpoint (a warm start in progress starts over)", EXIT_INTERRUPTED)
        except user_errors() as e:
            _fail(prog, f"error: {e}")
        return EXIT_BUG
    return wrapped
