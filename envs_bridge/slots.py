"""The slots of `envs_bridge.pool.EnvPool`: one live env each, in this process (`ThreadSlot`,
stepped by the pool's threads) or in a spawned worker process (`ProcessSlot`, over a pipe).

Both run a reset / step and then read the env's prompt pieces in the same call
(`call_with_pieces`), so the pool hands the rollout identical pieces on either backend.
A slot starts its env lazily (or on `ensure_started`), `discard`s it after a crash (a worker
process is killed) and `close`s it with the pool.
"""
from __future__ import annotations

import multiprocessing as mp
import threading
from typing import Any, Callable

from envs_bridge.base import Env, PromptPieces

USER_ERRORS = (ValueError, KeyError, TypeError)
"""Errors of bad input (an unknown task): re-raised by the pool, not turned into crashes."""


class PoolClosedError(RuntimeError):
    """An env call on a slot of a closed pool (a background restart that lost the race)."""


class ThreadSlot:
    """One live env in this process; calls run on the pool's thread executor."""

    def __init__(self, factory: Callable[[], Env]) -> None:
        self._factory = factory
        self.env: Env | None = None
        self.lock = threading.Lock()
        self.closed = False

    def _start(self) -> None:
        if self.closed:
            raise PoolClosedError("the env pool is closed")
        env = self._factory()
        if self.closed:   # the pool was closed while the env started: do not leak it
            _close_quietly(env)
            raise PoolClosedError("the env pool is closed")
        self.env = env

    def call_with_pieces(self, method: str, *args: Any) -> tuple[Any, PromptPieces]:
        """`call`, then the env's prompt pieces, under one hold of the slot's lock."""
        with self.lock:
            if self.env is None:
                self._start()
            return _with_pieces(self.env, method, args)

    def ensure_started(self) -> None:
        with self.lock:
            if self.env is None:
                self._start()

    def discard(self) -> None:
        """Close the env (a hung call on it is unblocked when its simulator dies)."""
        env, self.env = self.env, None
        if env is not None:
            threading.Thread(target=_close_quietly, args=(env,), daemon=True).start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Close the env. A call in flight (a step, an env being started) is waited for up to
        `timeout_s`; an env whose start finishes later closes itself (see `_start`)."""
        self.closed = True
        got = self.lock.acquire(timeout=timeout_s)
        try:
            env, self.env = self.env, None
        finally:
            if got:
                self.lock.release()
        if env is not None:
            _close_quietly(env)


def _close_quietly(env: Env) -> None:
    try:
        env.close()
    except Exception:
        pass


def _with_pieces(env: Env, method: str, args: tuple) -> tuple[Any, PromptPieces]:
    """``env.<method>(*args)`` and then ``env.prompt_pieces()`` (the pieces the next prompt
    needs, read where the env lives: this thread or the worker process)."""
    result = getattr(env, method)(*args)
    return result, env.prompt_pieces()


def _process_worker(conn, env_name: str, env_kwargs: dict[str, Any]) -> None:
    """Worker process loop: build the env, then serve (method, args) requests over `conn`;
    ``("__with_pieces__", (method, args))`` answers ``(result, env.prompt_pieces())``."""
    from envs_bridge.registry import make_env

    env = make_env(env_name, **env_kwargs)
    conn.send(("ok", None))
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            break
        if method == "__close__":
            break
        try:
            if method == "__with_pieces__":
                conn.send(("ok", _with_pieces(env, *args)))
            else:
                conn.send(("ok", getattr(env, method)(*args)))
        except BaseException as e:  # report every env error to the parent
            conn.send(("err", (type(e).__name__, str(e))))
    _close_quietly(env)


class ProcessSlot:
    """One live env in a spawned worker process (registry name + kwargs must be picklable)."""

    def __init__(self, env_name: str, env_kwargs: dict[str, Any], timeout_s: float) -> None:
        self._name, self._kwargs, self._timeout = env_name, env_kwargs, timeout_s
        self.proc: mp.Process | None = None
        self.conn = None
        self.lock = threading.Lock()
        self.closed = False

    def _start(self) -> None:
        if self.closed:
            raise PoolClosedError("the env pool is closed")
        ctx = mp.get_context("spawn")  # never fork a process that may hold JVM / XLA threads
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_process_worker, args=(child, self._name, self._kwargs), daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent
        self._recv(max(self._timeout, 120.0))
        if self.closed:   # the pool was closed while the worker started
            self.discard()
            raise PoolClosedError("the env pool is closed")

    def _recv(self, timeout: float) -> Any:
        from envs_bridge.base import EnvError

        if not self.conn.poll(timeout):
            self.discard()
            raise TimeoutError(f"env worker did not answer within {timeout:.1f}s")
        try:
            status, payload = self.conn.recv()
        except (EOFError, OSError) as e:
            self.discard()
            raise EnvError(f"env worker process died: {e!r}") from e
        if status == "err":
            kind, msg = payload
            if kind in {c.__name__ for c in USER_ERRORS}:
                raise ValueError(msg)
            raise EnvError(f"{kind}: {msg}")
        return payload

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def ensure_started(self) -> None:
        with self.lock:
            if self.proc is None:
                self._start()

    def call(self, method: str, *args: Any) -> Any:
        from envs_bridge.base import EnvError

        with self.lock:
            if self.proc is None:
                self._start()
            try:
                self.conn.send((method, args))
            except (BrokenPipeError, OSError) as e:
                self.discard()
                raise EnvError(f"env worker process died: {e!r}") from e
            return self._recv(self._timeout)

    def call_with_pieces(self, method: str, *args: Any) -> tuple[Any, PromptPieces]:
        """`call`, then the env's prompt pieces, in one round trip to the worker."""
        return self.call("__with_pieces__", method, args)

    def discard(self) -> None:
        proc, conn, self.proc, self.conn = self.proc, self.conn, None, None
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
        if conn is not None:
            conn.close()

    def close(self, timeout_s: float = 10.0) -> None:
        self.closed = True
        got = self.lock.acquire(timeout=timeout_s)   # a worker being started: wait for it
        if got:
            self.lock.release()
        if self.conn is not None and self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(("__close__", ()))
                self.proc.join(timeout=10)
            except Exception:
                pass
        self.discard()
