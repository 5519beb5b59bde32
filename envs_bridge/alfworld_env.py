"""ALFWorld adapter on the `alfworld` package (TextWorld PDDL games; docs/method.md §11.2).

- Games: `game.tw-pddl` files under `$ALFWORLD_DATA/json_2.1.1/{train,valid_seen,valid_unseen}`
  (the user downloads them with `alfworld-download`); a clear `ALFWorldDataError` when
  ALFWORLD_DATA is unset or holds no games. Like alfworld's AlfredTWEnv we skip `movable`
  / `Sliced` trajectories and games not marked solvable. Splits: train -> train,
  dev / eval_in_distribution -> valid_seen, test / eval_out_of_distribution -> valid_unseen.
- A task is a game file: `Task("alfworld", <game path>, 0, split)`; the task family is the
  trajectory directory's prefix (`family_from_game_path`), one of the 6 ALFRED task types.
- Rewards: reward = won (1.0 on the winning step, else 0); success = won; admissible
  commands every step (with `help` removed in the prompt pieces); max 50 steps.
- alfworld 0.4 says `move X to Y` where older data and prompts say `put X in/on Y`:
  `map_legacy_put` rewrites the old form onto the admissible command when exactly one
  admissible command matches.
The alfworld package (and textworld[pddl]) is imported only when a game is played.
"""
from __future__ import annotations

import glob
import json
import os
import re
from typing import Any

from envs_bridge.base import PromptPieces, Task, TextEnv

TASK_FAMILIES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
_SPLIT_DIRS = {
    "train": "train",
    "dev": "valid_seen",
    "eval_in_distribution": "valid_seen",
    "test": "valid_unseen",
    "eval_out_of_distribution": "valid_unseen",
}
_PUT_RE = re.compile(r"^put (.+) (?:in/on|into|onto|in|on) (.+)$")


class ALFWorldDataError(FileNotFoundError):
    """ALFWorld game data is missing (ALFWORLD_DATA unset, wrong, or empty)."""


def family_from_game_path(path: str) -> str:
    """ALFRED task family of a game file, from its trajectory directory name.

    E.g. ".../pick_cool_then_place_in_recep-Apple-None-Fridge-7/trial_T2019.../game.tw-pddl"
    -> "pick_cool_then_place_in_recep". Raises ValueError when no family name is in the path.
    """
    for part in reversed(os.path.normpath(path).split(os.sep)):
        for fam in sorted(TASK_FAMILIES, key=len, reverse=True):
            if part == fam or part.startswith(fam + "-"):
                return fam
    raise ValueError(f"no ALFRED task family ({', '.join(TASK_FAMILIES)}) in game path {path!r}")


def map_legacy_put(action: str, admissible: list[str]) -> str:
    """Rewrite `put X in/on Y` (older ALFWorld wording) onto the admissible `move X to Y`.

    The action is returned unchanged when it is admissible already, is not a `put` command,
    or when zero or several admissible commands match (ambiguous: object names may contain
    " in " / " on ", so every split point is tried).
    """
    if action in admissible:
        return action
    if not _PUT_RE.match(action):
        return action
    words = action.split(" ")
    adm = set(admissible)
    candidates = set()
    for i in range(2, len(words) - 1):
        if words[i] in ("in", "on", "in/on", "into", "onto"):
            obj, rec = " ".join(words[1:i]), " ".join(words[i + 1:])
            if obj and rec and f"move {obj} to {rec}" in adm:
                candidates.add(f"move {obj} to {rec}")
    return candidates.pop() if len(candidates) == 1 else action


def data_dir(path: str | None = None) -> str:
    """The ALFWorld data root: `path` or $ALFWORLD_DATA. Raises ALFWorldDataError when unset/missing."""
    root = path or os.environ.get("ALFWORLD_DATA")
    if not root:
        raise ALFWorldDataError(
            "ALFWORLD_DATA is not set. Download the ALFWorld games with `pip install alfworld && "
            "alfworld-download` and `export ALFWORLD_DATA=<that directory>` (or pass data_dir=...)."
        )
    if not os.path.isdir(root):
        raise ALFWorldDataError(f"ALFWORLD_DATA={root!r} is not a directory; run `alfworld-download` into it.")
    return root


def game_files(split: str, root: str | None = None) -> list[str]:
    """Sorted solvable game files of `split` under the data root (see module docstring)."""
    if split not in _SPLIT_DIRS:
        raise KeyError(f"unknown ALFWorld split {split!r}; use one of {sorted(_SPLIT_DIRS)}")
    base = os.path.join(data_dir(root), "json_2.1.1", _SPLIT_DIRS[split])
    out = []
    for path in sorted(glob.glob(os.path.join(base, "**", "game.tw-pddl"), recursive=True)):
        if "movable" in path or "Sliced" in path:
            continue
        with open(path) as f:
            if not json.load(f).get("solvable", False):
                continue
        out.append(path)
    if not out:
        raise ALFWorldDataError(f"no solvable game.tw-pddl files under {base!r}; is ALFWORLD_DATA complete?")
    return out


class ALFWorldEnv(TextEnv):
    """ALFWorld text game (TextWorld PDDL engine, one game at a time).

    Args:
      max_steps: step limit (docs/method.md §11.2: 50).
      data_dir: data root (default $ALFWORLD_DATA), used to resolve relative task ids.
      expert_plan: put the planner's remaining plan in info["expert_plan"] (slow; tests, BC).
    """

    name = "alfworld"
    environment = "ALFWorld"

    def __init__(self, max_steps: int = 50, data_dir: str | None = None, expert_plan: bool = False) -> None:
        super().__init__(max_steps)
        self.data_dir = data_dir
        self.expert_plan = expert_plan
        self._game = None
        self._desc = ""
        self._admissible: list[str] = []

    @staticmethod
    def task_list(split: str, data_dir: str | None = None) -> list[Task]:
        """One task per solvable game of `split`. Raises ALFWorldDataError without data."""
        return [Task("alfworld", p, 0, split) for p in game_files(split, data_dir)]

    def _resolve(self, task_id: str) -> str:
        path = task_id if os.path.isabs(task_id) else os.path.join(data_dir(self.data_dir), task_id)
        if not os.path.exists(path):
            raise ValueError(f"ALFWorld game file {path!r} does not exist")
        return path

    def _reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

        path = self._resolve(task.task_id)
        if self._game is not None:
            self._game.close()
        infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"],
                                   policy_commands=self.expert_plan)
        self._game = textworld.start(path, request_infos=infos, wrappers=[AlfredDemangler(shuffle=False), AlfredInfos])
        state = self._game.reset()
        obs = state.feedback
        m = re.search(r"Your task is to: (.*)", obs)
        self._desc = m.group(1).strip() if m else ""
        self._family = family_from_game_path(path)
        return obs, self._info(state)

    def _info(self, state: Any) -> dict[str, Any]:
        self._admissible = list(state["admissible_commands"])
        won = bool(state["won"])
        info = {
            "task_description": self._desc,
            "admissible_actions": self._admissible,
            "score": float(won),
            "success": won,
            "won": won,
            "family": self._family,
            "invalid": False,
        }
        if self.expert_plan:
            info["expert_plan"] = list(state["policy_commands"])
        return info

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        mapped = map_legacy_put(action, self._admissible)
        state, _, done = self._game.step(mapped)
        info = self._info(state)
        info["invalid"] = state.feedback.strip() == "Nothing happens."
        info["mapped_action"] = mapped if mapped != action else None
        return state.feedback, float(info["won"]), bool(done or info["won"]), info

    def admissible_actions(self) -> list[str]:
        """Current admissible commands without `help` (docs/method.md §3.1)."""
        return [a for a in self._admissible if a != "help"]

    def prompt_pieces(self) -> PromptPieces:
        """Task description and the admissible command list (`help` removed)."""
        return PromptPieces(self.environment, self._desc, (), tuple(self.admissible_actions()))

    def close(self) -> None:
        """Close the current game."""
        if self._game is not None:
            self._game.close()
            self._game = None
