"""Fixtures for the rollout tests: logged / slow built-in envs and scripted replies for
memory_key. The forced-output tiny Qwen2 (greedy AND sampled outputs are a chosen text) lives in the
library: strata_jax.rollout.scripted.forced_output_params.
"""
from __future__ import annotations

import re
import threading
import time

import numpy as np

from envs_bridge.builtin import GridNavEnv, MemoryKeyEnv
from envs_bridge.registry import _FACTORIES, register_env

SENT_ACTIONS: list[tuple[int, str]] = []  # (variation, action) of every action a simulator got
_LOCK = threading.Lock()


class LoggedMemoryKeyEnv(MemoryKeyEnv):
    """memory_key that records every action that reaches the simulator (`_step`)."""

    name = "memory_key_logged"

    def _step(self, action):
        with _LOCK:
            SENT_ACTIONS.append((self._task.variation, action))
        return super()._step(action)


class SlowGridEnv(GridNavEnv):
    """grid_nav whose steps and resets take `delay_s` seconds (an env slower than decoding)."""

    name = "slow_grid"
    instant_steps = False

    def __init__(self, max_steps: int = 4, size: int = 5, delay_s: float = 0.05) -> None:
        super().__init__(max_steps, size)
        self.delay_s = delay_s

    def _reset(self, task):
        time.sleep(self.delay_s)
        return super()._reset(task)

    def _step(self, action):
        time.sleep(self.delay_s)
        return super()._step(action)


class CrashyGridEnv(GridNavEnv):
    """grid_nav whose simulator dies on `go west` (the pool turns that into a crashed episode)."""

    name = "crashy_grid"

    def _step(self, action):
        if action == "go west":
            raise RuntimeError("simulated simulator crash")
        return super()._step(action)


for _cls in (LoggedMemoryKeyEnv, SlowGridEnv, CrashyGridEnv):
    if _cls.name not in _FACTORIES:
        register_env(_cls.name, _cls)


def memory_key_code(variation: int) -> str:
    """The vault code of memory_key task `variation` (from a reset of the real env)."""
    from envs_bridge.base import Task
    env = MemoryKeyEnv()
    env.reset(Task("memory_key", "memory_key", variation))
    return env.code


class MemoryKeyScript:
    """Scripted replies for memory_key prompts.

    Strategy prompts (in call order per task, candidates 0..3): 0 = valid plan "variant A",
    1 = no tags (format failure), 2 = valid "variant B", 3 = valid "variant A" again. Step
    prompts: under "variant B" step 1 is a format-invalid output; otherwise go north until the
    vault, then enter the code read from the strategy. Judge prompts: "<bad_steps>1, 99</bad_steps>".
    """

    def __init__(self) -> None:
        self.strategy_calls = 0

    def __call__(self, prompt: str, key: np.ndarray) -> str:
        if "<strategy></strategy>" in prompt:
            code = re.search(r"vault code (\d)-(\d)-(\d)", prompt).groups()
            i = self.strategy_calls % 4
            self.strategy_calls += 1
            if i == 1:
                return "I would walk north and type the code."
            variant = "B" if i == 2 else "A"
            return f"<strategy>variant {variant}: code {''.join(code)}; go north, then enter it.</strategy>"
        if "<bad_steps>" in prompt:
            return "<think>step 1 was wasted</think><bad_steps>1, 99</bad_steps>"
        step = int(re.search(r"You are at step (\d+)", prompt).group(1)) if "You are at step" in prompt else 1
        if "variant B" in prompt and step == 1:
            return "I am not sure what to do"
        code = re.search(r"code (\d{3});", prompt).group(1)
        if "keypad waits" in prompt.split("urrent observation:")[-1]:
            return f"<think>at the vault</think><action>enter {code}</action>"
        return "<think>walk on</think><action>go north</action>"
