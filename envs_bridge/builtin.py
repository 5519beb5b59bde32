"""Built-in text envs: deterministic, fast (pure Python), each with a known optimal policy
(`expert_action()`), for tests and CPU demos.

- `memory_key`: the vault code is shown ONLY in the first observation; the agent walks a
  corridor of `n` rooms and then types the code. Under non-cumulative prompts with a short
  history window the code scrolls out of the prompt, so a strategy written at step 1
  ("the code is 4-7-1; walk north, then enter 471") is what lets the agent succeed.
  Optimal return 1 in n + 1 steps.
- `guess_number`: guess a hidden integer in [1, 2^k]; the env answers higher / lower.
  Binary search is optimal (at most k + 1 guesses).
- `grid_nav`: reach a goal cell on a w x h grid (goal position shown every step);
  optimal = Manhattan distance moves.

Task: `Task(env=<name>, task_id=<name>, variation=<seed>, split=...)`. Splits own disjoint
seed ranges: train [0, 1000), dev [1000, 1100), test [1100, 1200). The world is a pure
function of the seed (`random.Random(seed)`), so M copies of a task are identical.
Reward 1.0 on success (score 1), else 0; done on success or at the step limit.
The registry's table (`envs_bridge.registry.BUILTIN`) names each class; nothing registers here.
"""
from __future__ import annotations

import abc
import random
import re
from typing import Any

from envs_bridge.base import PromptPieces, Task, TextEnv

# ASCII digits only: str.isdigit() also accepts '²', '①', Arabic-Indic digits, ..., which int()
# either rejects (ValueError, a crashed episode) or silently converts; neither is a guess the
# game understands. The length cap keeps int() below Python's 4300-digit conversion limit.
_INT_RE = re.compile(r"-?[0-9]{1,18}")
_ASCII_DIGITS = frozenset("0123456789")

SPLIT_SEEDS = {"train": range(0, 1000), "dev": range(1000, 1100), "test": range(1100, 1200)}


def builtin_task_list(name: str, split: str) -> list[Task]:
    """All tasks of built-in env `name` in `split` (one per seed). Raises KeyError on a bad split."""
    if split not in SPLIT_SEEDS:
        raise KeyError(f"unknown split {split!r}; use one of {list(SPLIT_SEEDS)}")
    return [Task(name, name, s, split) for s in SPLIT_SEEDS[split]]


class _BuiltinEnv(TextEnv):
    templates: tuple[str, ...] = ()
    instant_steps = True

    def __init__(self, max_steps: int = 20) -> None:
        super().__init__(max_steps)
        self._desc = ""

    @classmethod
    def task_list(cls, split: str) -> list[Task]:
        """Tasks of this env in `split`."""
        return builtin_task_list(cls.name, split)

    @abc.abstractmethod
    def admissible_actions(self) -> list[str]:
        """Current admissible actions."""

    @abc.abstractmethod
    def expert_action(self) -> str:
        """The optimal next action in the current state."""

    def prompt_pieces(self) -> PromptPieces:
        """Role name, task description, templates and admissible actions."""
        return PromptPieces(self.environment, self._desc, self.templates, tuple(self.admissible_actions()))

    def _info(self, score: float, invalid: bool = False) -> dict[str, Any]:
        return {
            "task_description": self._desc,
            "admissible_actions": self.admissible_actions(),
            "score": score,
            "success": score >= 1.0,
            "won": score >= 1.0,
            "invalid": invalid,
            "family": self.name,
        }


def parse_rooms(spec: str | int | None) -> tuple[int, int]:
    """memory_key's ``corridor_rooms`` as (lo, hi) inclusive: "lo-hi", "n" or n; "" / None =
    (3, 5). Raises ValueError naming the accepted forms for anything else (lo < 1, lo > hi)."""
    if spec in (None, ""):
        return 3, 5
    parts = str(spec).split("-")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if not 1 <= lo <= hi:
        raise ValueError(f"memory_key corridor_rooms must be 'lo-hi' with 1 <= lo <= hi or one "
                         f"number of rooms (e.g. '6-8', '7'), got {spec!r}")
    return lo, hi


class MemoryKeyEnv(_BuiltinEnv):
    """Vault code shown only at step 1; walk `corridor` rooms north, then `enter <code>`.

    The world (code, corridor of 3-5 rooms) is a pure function of the task's seed. Under
    non-cumulative prompts with a history window of h steps the note leaves the prompt before
    the vault can be reached (the vault is >= 3 moves north, so with h <= 2 the first
    observation is out of the window when the agent stands at the keypad): only text the agent
    itself carries forward can hold the code. StraTA's strategy, written at step 1 and
    prepended to every step prompt, is the channel the method offers (docs/method.md §12).

    Code attempts (``code_attempts``):
      * 0 (default): unlimited. A wrong code buzzes and the episode goes on, so with one digit a
        memoryless policy can enumerate ``enter 0`` ... ``enter 9`` at the vault.
      * k >= 1: at the keypad, an ``enter`` whose text holds exactly ``code_digits`` ASCII
        digits is a try (separators are ignored: ``enter 6-1-6``); a wrong one uses an
        attempt and the k-th locks the keypad and ends the episode with reward 0. An
        ``enter`` with another number of digits (``enter code``, ``enter 12`` at a 1-digit
        keypad) is refused without using an attempt, and so is any ``enter`` before the vault
        (there is no keypad there: "Nothing happens."), as with unlimited attempts.
        With one attempt, a policy that does not have the code at the keypad succeeds at most
        P(reach the vault) x 10**-code_digits: the flat ceiling by construction.

    Leak channels: text the agent writes stays in the history window verbatim, so a policy
    can keep the code in view without a strategy by re-typing it on the way (an early
    ``enter <code>``, refused, or any other action or format-invalid output holding the
    digits: ``rollout.invalid_tail_chars`` of it are shown). They are left open here, since
    closing them would change what the env means by an action, and measured instead: a
    study counts the episodes in which the code was in the prompt at the keypad from any
    source other than the strategy (docs/method.md §12).

    Admissible actions at the vault name every concrete code when there are at most ten
    (``enter 0`` ... ``enter 9`` for one digit), else the template ``enter <digits>``.

    Args:
      max_steps: step limit.
      code_digits: length of the code (1..9, default 3). A policy that has forgotten the code
        guesses right with probability 10**-code_digits per try.
      code_attempts: tries before the keypad locks (0 = unlimited, see above).
      corridor_rooms: the corridor lengths drawn, "lo-hi" inclusive or one number ("7"); ""
        or None = "3-5", the worlds training meets. Longer corridors are worlds a policy
        trained on 3-5 never saw (and need max_steps >= rooms + 1).
    Raises ValueError for code_digits outside 1..9, a negative code_attempts or a malformed
    corridor_rooms.
    """

    name = "memory_key"
    environment = "a text adventure (memory key)"
    templates = ("go north", "go south", "enter <digits>", "look")

    def __init__(self, max_steps: int = 20, code_digits: int = 3, code_attempts: int = 0,
                 corridor_rooms: str | None = None) -> None:
        super().__init__(max_steps)
        self.rooms = parse_rooms(corridor_rooms)
        if not 1 <= int(code_digits) <= 9:
            raise ValueError(f"memory_key code_digits must be in 1..9, got {code_digits!r}")
        if int(code_attempts) < 0:
            raise ValueError(f"memory_key code_attempts must be >= 0 (0 = unlimited), "
                             f"got {code_attempts!r}")
        self.code_digits = int(code_digits)
        self.code_attempts = int(code_attempts)

    def _reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        rng = random.Random(task.variation)
        self.code = "".join(str(rng.randrange(10)) for _ in range(self.code_digits))
        self.corridor = rng.randint(*self.rooms)
        self.pos = 0
        self.attempts_left = self.code_attempts
        self._desc = "Open the vault at the far north end of the corridor by entering its code."
        obs = (f"You are at the south end of a corridor. A note on the wall reads: 'vault code "
               f"{'-'.join(self.code)}'. The note crumbles to dust as you read it.")
        return obs, self._info(0.0)

    def _enter_actions(self) -> list[str]:
        return [f"enter {d}" for d in range(10)] if self.code_digits == 1 else ["enter <digits>"]

    def _tries_left(self) -> str:
        n = self.attempts_left
        return f"It allows {n} more {'try' if n == 1 else 'tries'}."

    def admissible_actions(self) -> list[str]:
        acts = ["look"]
        if self.pos < self.corridor:
            acts.append("go north")
        if self.pos > 0:
            acts.append("go south")
        if self.pos == self.corridor:
            acts += self._enter_actions()
        return acts

    def _where(self) -> str:
        if self.pos == self.corridor:
            tries = f" {self._tries_left()}" if self.code_attempts else ""
            return (f"You stand before the vault. A keypad waits for a {self.code_digits}-digit "
                    f"code.{tries}")
        return f"You are in the corridor, room {self.pos} of {self.corridor}. The corridor continues north."

    def _enter(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        """``enter <text>`` (the rules in the class docstring)."""
        digits = "".join(ch for ch in action[6:] if ch in _ASCII_DIGITS)
        if self.pos != self.corridor:
            return "Nothing happens.", 0.0, False, self._info(0.0, invalid=True)
        if digits == self.code:
            return "The vault swings open. You win.", 1.0, True, self._info(1.0)
        if not self.code_attempts:   # unlimited: any text is a (wrong) try, as it always was
            return "The keypad buzzes: wrong code.", 0.0, False, self._info(0.0)
        if len(digits) != self.code_digits:
            return (f"The keypad beeps: it takes a {self.code_digits}-digit code.", 0.0, False,
                    self._info(0.0, invalid=True))
        self.attempts_left -= 1
        if self.attempts_left <= 0:
            return ("The keypad buzzes: wrong code. The keypad locks for good.", 0.0, True,
                    self._info(0.0))
        return f"The keypad buzzes: wrong code. {self._tries_left()}", 0.0, False, self._info(0.0)

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if action == "go north" and self.pos < self.corridor:
            self.pos += 1
            return self._where(), 0.0, False, self._info(0.0)
        if action == "go south" and self.pos > 0:
            self.pos -= 1
            return self._where(), 0.0, False, self._info(0.0)
        if action == "look":
            return self._where(), 0.0, False, self._info(0.0)
        if action.startswith("enter "):
            return self._enter(action)
        return "Nothing happens.", 0.0, False, self._info(0.0, invalid=True)

    def expert_action(self) -> str:
        """`go north` until the vault, then `enter <code>`."""
        return "go north" if self.pos < self.corridor else f"enter {self.code}"


class GuessNumberEnv(_BuiltinEnv):
    """Guess a hidden integer in [1, 2^bits]; replies higher / lower; binary search is optimal."""

    name = "guess_number"
    environment = "a number guessing game"
    templates = ("guess <integer>",)

    def __init__(self, max_steps: int = 12, bits: int = 6) -> None:
        super().__init__(max_steps)
        self.high_limit = 2 ** bits

    def _reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        self.secret = random.Random(task.variation).randint(1, self.high_limit)
        self.lo, self.hi = 1, self.high_limit
        self._desc = f"Find the hidden integer between 1 and {self.high_limit}. After each guess you hear higher or lower."
        return f"A hidden integer between 1 and {self.high_limit} is waiting. Make a guess.", self._info(0.0)

    def admissible_actions(self) -> list[str]:
        return ["guess <integer>"]

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        parts = action.split()
        if len(parts) != 2 or parts[0] != "guess" or not _INT_RE.fullmatch(parts[1]):
            return "Nothing happens. Say `guess <integer>`.", 0.0, False, self._info(0.0, invalid=True)
        g = int(parts[1])
        if g == self.secret:
            return f"{g} is correct!", 1.0, True, self._info(1.0)
        if g < self.secret:
            self.lo = max(self.lo, g + 1)
            return f"{g} is too low: the number is higher.", 0.0, False, self._info(0.0)
        self.hi = min(self.hi, g - 1)
        return f"{g} is too high: the number is lower.", 0.0, False, self._info(0.0)

    def expert_action(self) -> str:
        """Binary search: guess the midpoint of the interval still consistent with the replies."""
        return f"guess {(self.lo + self.hi) // 2}"


class GridNavEnv(_BuiltinEnv):
    """Reach the goal cell on a grid; position and goal are shown every step."""

    name = "grid_nav"
    environment = "a grid world"
    templates = ("go north", "go south", "go east", "go west")
    _MOVES = {"go north": (0, 1), "go south": (0, -1), "go east": (1, 0), "go west": (-1, 0)}

    def __init__(self, max_steps: int = 20, size: int = 5) -> None:
        super().__init__(max_steps)
        self.size = size

    def _reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        rng = random.Random(task.variation)
        cells = [(x, y) for x in range(self.size) for y in range(self.size)]
        self.pos, self.goal = rng.sample(cells, 2)
        self._desc = f"Walk to the goal cell on a {self.size}x{self.size} grid (x grows east, y grows north)."
        return self._where(), self._info(0.0)

    def _where(self) -> str:
        return f"You are at ({self.pos[0]}, {self.pos[1]}). The goal is at ({self.goal[0]}, {self.goal[1]})."

    def admissible_actions(self) -> list[str]:
        out = []
        for a, (dx, dy) in self._MOVES.items():
            x, y = self.pos[0] + dx, self.pos[1] + dy
            if 0 <= x < self.size and 0 <= y < self.size:
                out.append(a)
        return out

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if action not in self.admissible_actions():
            return "Nothing happens. " + self._where(), 0.0, False, self._info(0.0, invalid=True)
        dx, dy = self._MOVES[action]
        self.pos = (self.pos[0] + dx, self.pos[1] + dy)
        if self.pos == self.goal:
            return "You reached the goal!", 1.0, True, self._info(1.0)
        return self._where(), 0.0, False, self._info(0.0)

    def expert_action(self) -> str:
        """Close the x gap first, then the y gap (Manhattan-optimal)."""
        dx, dy = self.goal[0] - self.pos[0], self.goal[1] - self.pos[1]
        if dx:
            return "go east" if dx > 0 else "go west"
        return "go north" if dy > 0 else "go south"
