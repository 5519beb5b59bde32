"""Seeded task sampler per env and split, with exact save / restore
(docs/design.md §8.2, §10).

Sampling is epoch-wise without replacement: epoch e visits the tasks in the order of
`numpy.random.default_rng([seed, e]).permutation(n)`. The whole state is three integers
(seed, epoch, position), so `set_state(get_state())` continues the sequence exactly, in this
process or another.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from envs_bridge.base import Task


class TaskSampler:
    """Draws tasks for rollouts from a fixed task list.

    Args:
      tasks: the task list (for example `ScienceWorldEnv.task_list("train")`); non-empty.
      seed: int seed.
    Raises:
      ValueError on an empty task list.
    """

    def __init__(self, tasks: Sequence[Task], seed: int) -> None:
        if len(tasks) == 0:
            raise ValueError("TaskSampler needs a non-empty task list")
        self.tasks = list(tasks)
        self.seed = int(seed)
        self._epoch = 0
        self._pos = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.tasks))

    def sample(self, n: int) -> list[Task]:
        """Next `n` tasks (crosses epoch boundaries; within an epoch no task repeats)."""
        out = []
        for _ in range(n):
            if self._pos == len(self.tasks):
                self._epoch += 1
                self._pos = 0
                self._order = self._permutation(self._epoch)
            out.append(self.tasks[int(self._order[self._pos])])
            self._pos += 1
        return out

    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable state: {"seed", "epoch", "position", "num_tasks"}."""
        return {"seed": self.seed, "epoch": self._epoch, "position": self._pos, "num_tasks": len(self.tasks)}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore a `get_state()` dict. Raises ValueError if it was saved for another task list size."""
        if int(state["num_tasks"]) != len(self.tasks):
            raise ValueError(
                f"sampler state is for {state['num_tasks']} tasks but this sampler has {len(self.tasks)}; "
                "build the sampler from the same env/split task list"
            )
        self.seed = int(state["seed"])
        self._epoch = int(state["epoch"])
        self._pos = int(state["position"])
        self._order = self._permutation(self._epoch)
