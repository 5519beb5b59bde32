"""ScienceWorld adapter on the `scienceworld` package (Java simulator over py4j;
docs/method.md §11.1).

- Tasks: the package's 30 tasks minus AgentGym's exclusions (5-1, 5-2, 9-1, 9-2, 9-3,
  10-1, 10-2); the package's own train / dev / test variation splits (contiguous index
  ranges, read from scienceworld 1.2.3 and stored below so a task list needs no JVM; a
  slow test checks them against the live simulator). `load_eval_list(path)` reads an
  explicit (task, variation) list.
- Rewards: score is the simulator's 0-100 cumulative score (negative on failure);
  reward = delta score / 100; success = score == 100 (not "done and score > 0").
  done = task completed, score < 0, or `max_steps` steps (format-invalid ones included).
- Fast stepping: the package's `step()` also fetches look / inventory / task text and the
  full valid-action list (~60-180 ms) every call. We call the simulator's step / score /
  completed directly (~5-10 ms) and fetch the valid actions only when
  `fetch_valid_actions=True` (or on demand with `valid_actions()`).
- JVM memory cap: the package constructor passes no JVM options, so `_launch()` starts the
  gateway itself with `-Xmx{jvm_max_heap_mb}m -XX:+UseSerialGC`. Measured resident memory
  per JVM after a few tasks: ~660 MB uncapped, ~240 MB with -Xmx256m, ~210-240 MB with the
  default 384 MB heap (bounded by ~450 MB; the python side adds little per env in the
  thread pool, ~80-100 MB per worker process in the process pool).
- Deterministic observations: the JVM runs with a constant identity hash
  (`DETERMINISTIC_JVM_OPTS`); with the default one, a room's objects are listed in an order that
  differs between JVMs, so the episodes of one group saw different text and a resumed run did
  not replay the uninterrupted one (tests/envs_bridge/test_sciworld.py; no measurable step-time cost).
- Ambiguous commands ("Ambiguous request: Please enter the number ...") are answered with
  option 0; the choice is logged at debug level, returned in info["ambiguous_resolved"] and
  counted by the rollout (``rollout/ambiguous_resolved_frac``).
"""
from __future__ import annotations

import json
import logging
import re
import shutil
import socket
import subprocess
import tempfile
from typing import Any

from envs_bridge.base import EnvError, PromptPieces, Task, TextEnv

logger = logging.getLogger(__name__)
# A dying JVM makes py4j log every failed call with a full traceback (30-40 lines per crash).
# The adapter turns those errors into EnvError and the pool logs each crash as one line, so
# py4j's own records stay quiet (set the "py4j" logger's level to see them again).
logging.getLogger("py4j").setLevel(logging.CRITICAL)

# AgentGym's exclusions: the tasks whose gold paths run 51-178 steps.
EXCLUDED_TASK_IDS = ("5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2")

# (start, stop) variation index ranges per split, read from scienceworld 1.2.3
# (env.get_variations_train/dev/test(); every split is a contiguous range).
_SPLIT_RANGES: dict[str, dict[str, tuple[int, int]]] = {
    "boil": {"train": (0, 14), "dev": (14, 21), "test": (21, 30)},
    "change-the-state-of-matter-of": {"train": (0, 14), "dev": (14, 21), "test": (21, 30)},
    "chemistry-mix": {"train": (0, 16), "dev": (16, 24), "test": (24, 32)},
    "chemistry-mix-paint-secondary-color": {"train": (0, 18), "dev": (18, 27), "test": (27, 36)},
    "chemistry-mix-paint-tertiary-color": {"train": (0, 18), "dev": (18, 27), "test": (27, 36)},
    "find-animal": {"train": (0, 150), "dev": (150, 225), "test": (225, 300)},
    "find-living-thing": {"train": (0, 150), "dev": (150, 225), "test": (225, 300)},
    "find-non-living-thing": {"train": (0, 150), "dev": (150, 225), "test": (225, 300)},
    "find-plant": {"train": (0, 150), "dev": (150, 225), "test": (225, 300)},
    "freeze": {"train": (0, 14), "dev": (14, 21), "test": (21, 30)},
    "grow-fruit": {"train": (0, 62), "dev": (62, 93), "test": (93, 126)},
    "grow-plant": {"train": (0, 62), "dev": (62, 93), "test": (93, 126)},
    "identify-life-stages-1": {"train": (0, 6), "dev": (6, 9), "test": (9, 14)},
    "identify-life-stages-2": {"train": (0, 4), "dev": (4, 6), "test": (6, 10)},
    "inclined-plane-determine-angle": {"train": (0, 84), "dev": (84, 126), "test": (126, 168)},
    "inclined-plane-friction-named-surfaces": {"train": (0, 692), "dev": (692, 1038), "test": (1038, 1386)},
    "inclined-plane-friction-unnamed-surfaces": {"train": (0, 80), "dev": (80, 120), "test": (120, 162)},
    "lifespan-longest-lived": {"train": (0, 62), "dev": (62, 93), "test": (93, 125)},
    "lifespan-longest-lived-then-shortest-lived": {"train": (0, 62), "dev": (62, 93), "test": (93, 125)},
    "lifespan-shortest-lived": {"train": (0, 62), "dev": (62, 93), "test": (93, 125)},
    "measure-melting-point-known-substance": {"train": (0, 218), "dev": (218, 327), "test": (327, 436)},
    "measure-melting-point-unknown-substance": {"train": (0, 150), "dev": (150, 225), "test": (225, 300)},
    "melt": {"train": (0, 14), "dev": (14, 21), "test": (21, 30)},
    "mendelian-genetics-known-plant": {"train": (0, 60), "dev": (60, 90), "test": (90, 120)},
    "mendelian-genetics-unknown-plant": {"train": (0, 240), "dev": (240, 360), "test": (360, 480)},
    "power-component": {"train": (0, 10), "dev": (10, 15), "test": (15, 20)},
    "power-component-renewable-vs-nonrenewable-energy": {"train": (0, 10), "dev": (10, 15), "test": (15, 20)},
    "test-conductivity": {"train": (0, 450), "dev": (450, 675), "test": (675, 900)},
    "test-conductivity-of-unknown-substances": {"train": (0, 300), "dev": (300, 450), "test": (450, 600)},
    "use-thermometer": {"train": (0, 270), "dev": (270, 405), "test": (405, 540)},
}

_AMBIGUOUS_PREFIX = "ambiguous request"
_UNKNOWN_ACTION = "no known action matches that input"


def task_id_to_name() -> dict[str, str]:
    """Map of ScienceWorld task ids ("4-1") to task names ("find-living-thing")."""
    from scienceworld.constants import ID2TASK

    return dict(ID2TASK)


def task_names(include_excluded: bool = False) -> list[str]:
    """Task names in id order, without AgentGym's exclusions unless `include_excluded`."""
    ids = task_id_to_name()
    return [name for tid, name in ids.items() if include_excluded or tid not in EXCLUDED_TASK_IDS]


def split_variations(task_name: str, split: str) -> range:
    """Variation indices of `task_name` in `split` ("train", "dev", "test").

    Raises KeyError with the known names on an unknown task or split.
    """
    if task_name not in _SPLIT_RANGES:
        raise KeyError(f"unknown ScienceWorld task {task_name!r}; known: {sorted(_SPLIT_RANGES)}")
    if split not in ("train", "dev", "test"):
        raise KeyError(f"unknown split {split!r}; use 'train', 'dev' or 'test'")
    return range(*_SPLIT_RANGES[task_name][split])


def _resolve_task_name(name_or_id: str) -> str:
    ids = task_id_to_name()
    name = ids.get(name_or_id, name_or_id)
    if name not in _SPLIT_RANGES:
        raise ValueError(f"unknown ScienceWorld task {name_or_id!r}; use a name from task_names() or an id like '4-1'")
    return name


def load_eval_list(path: str, split: str = "test") -> list[Task]:
    """Read an explicit eval list of (task, variation) pairs.

    Formats: `.json` = a list of [task, variation] pairs or {"task": .., "variation": ..}
    objects; anything else = one `task variation` pair per line (comma or whitespace
    separated, `#` comments). `task` may be a name or an id like "4-1".
    Raises FileNotFoundError / ValueError with the offending line.
    """
    with open(path) as f:
        text = f.read()
    pairs: list[tuple[str, int]] = []
    if path.endswith(".json"):
        for item in json.loads(text):
            if isinstance(item, dict):
                pairs.append((str(item["task"]), int(item["variation"])))
            else:
                pairs.append((str(item[0]), int(item[1])))
    else:
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = re.split(r"[,\s]+", line)
            if len(parts) != 2 or not re.fullmatch(r"-?[0-9]{1,9}", parts[1]):  # ASCII: isdigit() takes '²'
                raise ValueError(f"{path}:{n}: expected 'task variation', got {line!r}")
            pairs.append((parts[0], int(parts[1])))
    return [Task("scienceworld", _resolve_task_name(t), v, split) for t, v in pairs]


# HotSpot's identity hash: 2 = a constant. The simulator lists a room's contents in the order
# of hash-based collections keyed by object identity, and the default identity hash comes from a
# per-JVM-thread random state: the same task and actions then render objects in a different
# order from one JVM to the next (fresh JVMs on one task and variation give several distinct
# observation sequences). A constant hash leaves insertion order, which is a function of the
# task, variation and actions only (tests/envs_bridge/test_sciworld.py checks one sequence across JVMs).
DETERMINISTIC_JVM_OPTS = ("-XX:+UnlockExperimentalVMOptions", "-XX:hashCode=2")


# The simulator jar's classes are Java 8 class files; Java 17 is the runtime the project tests.
MIN_JAVA = 8


def java_major_version(text: str) -> int | None:
    """The major version in the first line of ``java -version`` output ("1.8.0_392" -> 8,
    "17.0.15" -> 17, "21" -> 21), or None when the text holds no quoted version."""
    m = re.search(r'version "(\d+)(?:\.(\d+))?', text)
    if m is None:
        return None
    major = int(m.group(1))
    return int(m.group(2) or 0) if major == 1 else major


def check_java_runtime(java: str | None = None, timeout_s: float = 30.0) -> None:
    """Start-up check of what the simulator needs from the host: a Java runtime (``java`` on
    PATH, at least `MIN_JAVA`) and loopback, over which py4j connects Python and the JVM.

    Args:
      java: the java executable (None: ``java`` on PATH).
      timeout_s: limit for ``java -version``.
    Raises:
      EnvError with one line that says what is missing and what to install or fix.
    """
    exe = java or shutil.which("java")
    if exe is None:
        raise EnvError("ScienceWorld needs a Java runtime on PATH and `java` was not found: "
                       "install Java 17 (Debian / Ubuntu: apt install openjdk-17-jre-headless) "
                       "or put its bin/ on PATH")
    try:
        out = subprocess.run([exe, "-version"], capture_output=True, text=True,
                             timeout=timeout_s)
        text = (out.stderr or "") + (out.stdout or "")
    except (OSError, subprocess.SubprocessError) as e:
        raise EnvError(f"ScienceWorld needs a working Java runtime; `{exe} -version` failed "
                       f"({e}): reinstall Java 17 or fix PATH") from None
    major = java_major_version(text)
    if major is None or out.returncode != 0:
        first = text.strip().splitlines()[0] if text.strip() else f"exit {out.returncode}"
        raise EnvError(f"ScienceWorld needs a working Java runtime; `{exe} -version` said "
                       f"{first!r}: reinstall Java 17 or fix PATH")
    if major < MIN_JAVA:
        raise EnvError(f"ScienceWorld needs Java {MIN_JAVA} or newer (17 is tested); `{exe}` is "
                       f"Java {major}: install Java 17 and put it first on PATH")
    try:   # py4j's gateway and callback server both listen on 127.0.0.1
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
            srv.bind(("127.0.0.1", 0))
            srv.listen(1)
            with socket.create_connection(srv.getsockname(), timeout=5):
                pass
    except OSError as e:
        raise EnvError(f"ScienceWorld's Java bridge (py4j) connects over loopback and "
                       f"127.0.0.1 cannot be reached here ({e}): bring the loopback interface "
                       "up (ip link set lo up) or run where it is") from None


def _launch(max_heap_mb: int | None, deterministic: bool = True):
    """Start a ScienceWorld JVM with a heap cap; returns the package's env object.

    Mirrors the package constructor (scienceworld/scienceworld.py, ScienceWorldEnv.__init__)
    but passes JVM options to py4j's launch_gateway, which the constructor does not expose:
    ``-Xmx`` and, when `deterministic`, `DETERMINISTIC_JVM_OPTS`.
    """
    from py4j.java_gateway import CallbackServerParameters, GatewayParameters, JavaGateway, launch_gateway
    from scienceworld import ScienceWorldEnv as _PkgEnv
    from scienceworld.constants import BASEPATH, JAR_PATH

    class _CappedEnv(_PkgEnv):
        def __del__(self) -> None:  # our ScienceWorldEnv.close() owns the shutdown
            pass

    opts = ["-XX:+UseSerialGC"] + ([f"-Xmx{int(max_heap_mb)}m"] if max_heap_mb else [])
    opts += list(DETERMINISTIC_JVM_OPTS) if deterministic else []
    port, proc = launch_gateway(classpath=JAR_PATH, die_on_exit=True, cwd=BASEPATH, return_proc=True, javaopts=opts)
    env = _CappedEnv.__new__(_CappedEnv)
    env._gateway = JavaGateway(
        gateway_parameters=GatewayParameters(auto_field=True, port=port),
        callback_server_parameters=CallbackServerParameters(port=0, daemonize=True),
        java_process=proc,
    )
    python_port = env._gateway.get_callback_server().get_listening_port()
    env._gateway.java_gateway_server.resetCallbackClient(
        env._gateway.java_gateway_server.getCallbackClient().getAddress(), python_port
    )
    env.server = env._gateway.jvm.scienceworld.runtime.pythonapi.PythonInterface()
    env.lastStepScore = 0
    env.taskName = None
    env.envStepLimit = 10**9  # our TextEnv enforces the step limit
    env.runHistories = {}
    env.goldPathGenerated = False
    env._obj_tree_tempdir = tempfile.TemporaryDirectory()
    return env


class ScienceWorldEnv(TextEnv):
    """ScienceWorld env (one JVM per instance).

    Args:
      max_steps: step limit (docs/method.md §11.1: 30).
      fetch_valid_actions: put the full valid-action list in every info (~60-180 ms/step).
      jvm_max_heap_mb: JVM heap cap (None = JVM default, ~660 MB resident).
      simplifications: the package's simplification string ("" = none, "easy", ...).
      generate_gold: ask the simulator for the gold path at reset (`gold_actions()`).
      deterministic: start the JVM with `DETERMINISTIC_JVM_OPTS`, so that observations are a
        function of (task, variation, actions) whichever JVM plays them: the M episodes of a
        group see the same text, and a resumed run replays the uninterrupted one exactly.
        False = the JVM's default identity hash (object order varies between JVMs).
    Raises:
      EnvError when the JVM dies (the pool restarts the env).
    """

    name = "scienceworld"
    environment = "ScienceWorld"

    def __init__(self, max_steps: int = 30, fetch_valid_actions: bool = False, jvm_max_heap_mb: int | None = 384,
                 simplifications: str = "", generate_gold: bool = False,
                 deterministic: bool = True) -> None:
        super().__init__(max_steps)
        self.fetch_valid_actions = fetch_valid_actions
        self.simplifications = simplifications
        self.generate_gold = generate_gold
        self._env = _launch(jvm_max_heap_mb, deterministic)
        self._templates: tuple[str, ...] = ()
        self._desc = ""
        self._score = 0
        self.ambiguous_log: list[tuple[str, str]] = []

    @staticmethod
    def preflight(**_: Any) -> None:
        """Start-up check (called by the entry points before anything is built):
        `check_java_runtime`. Raises EnvError in one line naming what to install or fix."""
        check_java_runtime()

    @staticmethod
    def task_list(split: str, include_excluded: bool = False) -> list[Task]:
        """Every (task, variation) of `split` over the AgentGym task list."""
        return [Task("scienceworld", t, v, split) for t in task_names(include_excluded) for v in split_variations(t, split)]

    @property
    def java_process(self):
        """The JVM's subprocess.Popen (tests kill it to simulate a crash)."""
        return self._env._gateway.java_process

    @property
    def java_pid(self) -> int:
        """Process id of this env's JVM."""
        return self.java_process.pid

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # py4j network / protocol errors: the JVM is gone or broken
            if type(e).__module__.startswith("py4j"):
                raise EnvError(f"ScienceWorld JVM (pid {self.java_pid}) failed: {e}") from e
            raise

    def _reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        name = _resolve_task_name(task.task_id)
        self._call(self._env.load, name, int(task.variation), self.simplifications, self.generate_gold)
        self._call(self._env.server.reset)
        if not self._templates:
            self._templates = tuple(self._call(self._env.server.getPossibleActions))
        self._desc = str(self._call(self._env.server.getTaskDescription))
        self._score = 0
        obs, _, _, info = self._raw_step("look around")
        info["family"] = name
        return obs, info

    def _raw_step(self, action: str) -> tuple[str, int, bool, dict[str, Any]]:
        server = self._env.server
        obs = str(self._call(server.step, action))
        resolved = None
        if obs.strip().lower().startswith(_AMBIGUOUS_PREFIX):
            options = re.findall(r"^\s*0:\s*(.+)$", obs, re.MULTILINE)
            resolved = options[0].strip() if options else "0"
            # normal simulator behaviour, counted in rollout/ambiguous_resolved_frac: debug level
            logger.debug("ScienceWorld ambiguous command %r: choosing option 0 (%s)", action, resolved)
            self.ambiguous_log.append((action, resolved))
            obs = str(self._call(server.step, "0"))
        score = int(round(100 * float(self._call(server.getScore))))
        completed = bool(self._call(server.getCompleted))
        reward = score - self._score
        self._score = score
        info: dict[str, Any] = {
            "task_description": self._desc,
            "score": float(score),
            "success": score == 100,
            "won": score == 100,
            "invalid": obs.strip().lower().startswith(_UNKNOWN_ACTION),
            "admissible_actions": self.valid_actions() if self.fetch_valid_actions else None,
            "ambiguous_resolved": resolved,
        }
        return obs, reward, completed or score < 0, info

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        obs, delta, done, info = self._raw_step(action)
        info["family"] = self._task.task_id if self._task else ""
        return obs, delta / 100.0, done, info

    def valid_actions(self) -> list[str]:
        """The simulator's full valid action-object combinations now (~60-180 ms)."""
        return list(self._call(self._env.server.getValidActionObjectCombinations))

    def gold_actions(self) -> list[str]:
        """Gold action sequence of the current episode (needs generate_gold=True at reset)."""
        if not self.generate_gold:
            raise RuntimeError("construct ScienceWorldEnv(generate_gold=True) to get gold action sequences")
        return list(self._call(self._env.server.getGoldActionSequence))

    def prompt_pieces(self) -> PromptPieces:
        """Task description and action templates (not the full valid-action list; docs/method.md §3.1)."""
        return PromptPieces(self.environment, self._desc, self._templates,
                            tuple(self._last_info["admissible_actions"]) if self._last_info.get("admissible_actions") else None)

    def close(self) -> None:
        """Shut the JVM down (best effort; a dead JVM is fine)."""
        env, self._env = getattr(self, "_env", None), None
        if env is None:
            return
        try:
            env._gateway.shutdown()
        except Exception:
            pass
        proc = env._gateway.java_process
        if proc.poll() is None:
            try:
                proc.kill()
                proc.wait(timeout=5)
            except Exception:
                pass

    def __del__(self) -> None:
        self.close()
