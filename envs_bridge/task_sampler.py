"""Seeded task sampler per env and split, with exact save / restore
(docs/design.md §8.2, §10).

Sampling is epoch-wise without replacement: epoch e visits the tasks in the order of
`numpy.random.default_rng([seed, e]).permutation(n)`. The whole state is three integers
(seed, epoch, position), so `set_state(get_state())` continues the sequence exactly, in this
process or another. The saved state also carries a fingerprint of the task list (its length and
a SHA-256 over every task's env, task_id, variation and split, in order), and `set_state`
refuses a state saved for another list: the permutation indexes the list, so the same
position in a different list of the same size would continue with other tasks.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence

import numpy as np

from envs_bridge.base import Task


def task_list_fingerprint(tasks: Sequence[Task]) -> str:
    """Hex SHA-256 of a task list: the JSON array of ``[env, task_id, variation, split]`` per
    task, in list order (order matters: the sampler's permutation indexes the list)."""
    rows = [[str(t.env), str(t.task_id), int(t.variation), str(t.split)] for t in tasks]
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode("utf-8")).hexdigest()


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
        self.fingerprint = task_list_fingerprint(self.tasks)
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
        """JSON-serialisable state: {"seed", "epoch", "position", "num_tasks", "tasks_sha256"}."""
        return {"seed": self.seed, "epoch": self._epoch, "position": self._pos,
                "num_tasks": len(self.tasks), "tasks_sha256": self.fingerprint}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore a `get_state()` dict.

        Raises:
          ValueError: the state was saved for another task list: another size, or the same
            size with other tasks or another order (`task_list_fingerprint`). A state without
            a fingerprint (saved before it was recorded) is checked by size only.
        """
        if int(state["num_tasks"]) != len(self.tasks):
            raise ValueError(
                f"sampler state is for {state['num_tasks']} tasks but this sampler has {len(self.tasks)}; "
                "build the sampler from the same env/split task list"
            )
        saved = state.get("tasks_sha256")
        if saved is not None and saved != self.fingerprint:
            raise ValueError(
                f"sampler state is for another list of {len(self.tasks)} tasks (task-list "
                f"fingerprint {str(saved)[:12]} saved, {self.fingerprint[:12]} now): the env's "
                "tasks, their order or the split changed since the checkpoint; resume with the "
                "same task list or start a new workdir"
            )
        self.seed = int(state["seed"])
        self._epoch = int(state["epoch"])
        self._pos = int(state["position"])
        self._order = self._permutation(self._epoch)
