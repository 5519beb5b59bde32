"""HTTP client for AgentGym env servers, WebShop first (docs/method.md §11.3).

Protocol of the WooooDyy/AgentGym WebShop server (agentenv-webshop/agentenv_webshop/server.py
and model.py; every AgentGym server names its fields differently, these are WebShop's):

  GET  /                                 -> "ok"
  POST /create                           -> env_idx (int)
  POST /reset  {"env_idx", "session_id"} -> [observation, null]   (session_id = goal index)
  POST /step   {"env_idx", "action"}     -> {"state", "reward", "done", "info"}
  GET  /available_actions?env_idx=N      -> {"has_search_bar": bool, "clickables": [str]}
  GET  /instruction_text?env_idx=N       -> str
  GET  /observation?env_idx=N            -> str
  GET  /state?env_idx=N                  -> {"url", "html", "instruction_text"}
  POST /close  {"env_idx"}               -> {"closed": bool}

Retries: connection failures (refused, reset) and HTTP 502/503/504 are retried with
exponential backoff for every request; a read timeout is retried only for idempotent GETs
(a POST /step that timed out may have been applied). After the last try an `EnvError` says
which server and what to check. Stdlib only (urllib).
"""
from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from envs_bridge.base import EnvError, PromptPieces, Task, TextEnv

_RETRY_STATUS = {502, 503, 504}

# WebShop goal-index splits of the original WebShop code (test [0, 500), dev [500, 1500),
# train [1500, 12087) over its 12087 human goals), as verl-agent uses them.
WEBSHOP_SPLITS = {"test": (0, 500), "dev": (500, 1500), "train": (1500, 12087)}


class AgentGymHTTPClient:
    """Minimal JSON-over-HTTP client with retries and timeouts.

    Args:
      base_url: server root, e.g. "http://127.0.0.1:36001".
      timeout_s: per-request socket timeout (seconds).
      retries: total tries per request (>= 1).
      backoff_s: first retry delay; doubles each retry.
    """

    def __init__(self, base_url: str, timeout_s: float = 30.0, retries: int = 4, backoff_s: float = 0.2) -> None:
        if retries < 1:
            raise ValueError(f"retries must be >= 1, got {retries}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s

    def request(self, method: str, path: str, payload: dict[str, Any] | None = None,
                params: dict[str, Any] | None = None) -> Any:
        """Send one request and decode the JSON answer. Raises EnvError after the retries."""
        url = f"{self.base_url}/{path.lstrip('/')}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        data = None if payload is None else json.dumps(payload).encode()
        last: Exception | None = None
        for attempt in range(self.retries):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            req = urllib.request.Request(url, data=data, method=method)
            if data is not None:
                req.add_header("Content-Type", "application/json")
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    return json.loads(resp.read().decode() or "null")
            except urllib.error.HTTPError as e:
                last = e
                if e.code not in _RETRY_STATUS:
                    body = e.read().decode(errors="replace")[:300]
                    raise EnvError(f"{method} {url} -> HTTP {e.code}: {body}") from e
            except (socket.timeout, TimeoutError) as e:
                last = e
                if method != "GET":
                    raise EnvError(f"{method} {url} timed out after {self.timeout_s}s (not retried: "
                                   "the server may have applied it)") from e
            except (urllib.error.URLError, ConnectionError, http.client.HTTPException) as e:
                reason = getattr(e, "reason", None)
                if isinstance(reason, (socket.timeout, TimeoutError)) and method != "GET":
                    raise EnvError(f"{method} {url} timed out after {self.timeout_s}s (not retried)") from e
                last = e
        err = EnvError(
            f"AgentGym server {self.base_url} did not answer {method} /{path.lstrip('/')} after "
            f"{self.retries} tries ({last!r}); is the server running (e.g. `webshop --port ...`) and the URL right?"
        )
        err.last = last
        raise err


def _cause(e: EnvError) -> str:
    """The innermost reason of a client error, e.g. "[Errno 111] Connection refused"."""
    m = str(e)
    last = getattr(e, "last", None)
    reason = getattr(last, "reason", last)
    return str(reason) if reason is not None else m


class WebShopClient(AgentGymHTTPClient):
    """The WebShop endpoints of AgentGym's agentenv-webshop server (see module docstring)."""

    def create(self) -> int:
        """POST /create -> new env index."""
        return int(self.request("POST", "create"))

    def reset(self, env_idx: int, session_id: int | None) -> str:
        """POST /reset; returns the observation element of the [observation, null] answer."""
        out = self.request("POST", "reset", {"env_idx": env_idx, "session_id": session_id})
        return out[0] if isinstance(out, list) else str(out)

    def step(self, env_idx: int, action: str) -> tuple[str, float, bool]:
        """POST /step -> (state, reward, done)."""
        out = self.request("POST", "step", {"env_idx": env_idx, "action": action})
        return str(out["state"]), float(out["reward"]), bool(out["done"])

    def available_actions(self, env_idx: int) -> tuple[bool, list[str]]:
        """GET /available_actions -> (has_search_bar, clickables)."""
        out = self.request("GET", "available_actions", params={"env_idx": env_idx})
        return bool(out["has_search_bar"]), list(out["clickables"])

    def instruction_text(self, env_idx: int) -> str:
        """GET /instruction_text."""
        return str(self.request("GET", "instruction_text", params={"env_idx": env_idx}))

    def observation(self, env_idx: int) -> str:
        """GET /observation."""
        return str(self.request("GET", "observation", params={"env_idx": env_idx}))

    def close(self, env_idx: int) -> bool:
        """POST /close -> closed flag."""
        return bool(self.request("POST", "close", {"env_idx": env_idx})["closed"])


def webshop_actions(has_search_bar: bool, clickables: list[str]) -> list[str]:
    """Prompt action list (docs/method.md §3.1): `search[<keywords>]` when a search box
    exists, then one `click[...]` per clickable (AgentGym lists "search" as a clickable when
    the search button is shown; it is covered by the search action)."""
    out = ["search[<keywords>]"] if has_search_bar else []
    out += [f"click[{c}]" for c in clickables if not (has_search_bar and c == "search")]
    return out


def webshop_action_fits(action: str, has_search_bar: bool, clickables: list[str]) -> bool:
    """Whether `action` is one the page offers: ``search[...]`` with a search box, or
    ``click[x]`` for a clickable x (case-insensitive). The AgentGym server answers any other
    text with the same page and no error, so this is how a WebShop step is marked rejected
    (info["invalid"])."""
    a = action.strip()
    low = a.lower()
    if low.startswith("search[") and low.endswith("]"):
        return has_search_bar
    if low.startswith("click[") and low.endswith("]"):
        return a[len("click["):-1].strip().lower() in clickables
    return False


class WebShopEnv(TextEnv):
    """WebShop through an AgentGym server. reward = score in [0, 1] at purchase;
    success = score == 1; max 15 steps. Task: Task("webshop", "goal", <goal index>, split).

    Args:
      server_url: AgentGym WebShop server root.
      max_steps: step limit (docs/method.md §11.3: 15).
      timeout_s, retries, backoff_s: HTTP client settings.
    Raises:
      EnvError when the server cannot be reached after the retries.
    """

    name = "webshop"
    environment = "WebShop"

    def __init__(self, server_url: str = "http://127.0.0.1:36001", max_steps: int = 15, timeout_s: float = 30.0,
                 retries: int = 4, backoff_s: float = 0.2) -> None:
        super().__init__(max_steps)
        self.client = WebShopClient(server_url, timeout_s, retries, backoff_s)
        self.env_idx: int | None = None
        self._desc = ""
        self._actions: list[str] = []
        self._page: tuple[bool, list[str]] = (True, [])

    @staticmethod
    def preflight(server_url: str = "http://127.0.0.1:36001", timeout_s: float = 5.0,
                  **_: Any) -> None:
        """Start-up check (called by the entry points before anything is built): one GET / to
        the server. Raises EnvError naming the URL, the cause and how to start the server."""
        try:
            WebShopClient(server_url, timeout_s=timeout_s, retries=1).request("GET", "")
        except EnvError as e:
            raise EnvError(
                f"the WebShop server at {server_url} does not answer ({_cause(e)}). Start "
                "AgentGym's WebShop server (agentenv-webshop, with the WebShop product data): "
                "`webshop --host 127.0.0.1 --port 36001`, then pass its address as "
                "--config.env.server_url") from None

    @staticmethod
    def task_list(split: str) -> list[Task]:
        """Goal indices of `split` (see WEBSHOP_SPLITS)."""
        if split not in WEBSHOP_SPLITS:
            raise KeyError(f"unknown WebShop split {split!r}; use one of {sorted(WEBSHOP_SPLITS)}")
        return [Task("webshop", "goal", i, split) for i in range(*WEBSHOP_SPLITS[split])]

    def _info(self, score: float) -> dict[str, Any]:
        has_search, clickables = self.client.available_actions(self.env_idx)
        self._actions = webshop_actions(has_search, clickables)
        self._page = (has_search, [c.lower() for c in clickables])
        return {
            "task_description": self._desc,
            "admissible_actions": list(self._actions),
            "score": score,
            "success": score >= 1.0,
            "won": score >= 1.0,
            "family": "webshop",
            "invalid": False,
        }

    def _reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        if self.env_idx is None:
            self.env_idx = self.client.create()
        self.client.reset(self.env_idx, int(task.variation))
        obs = self.client.observation(self.env_idx)
        self._desc = self.client.instruction_text(self.env_idx)
        return obs, self._info(0.0)

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        rejected = not webshop_action_fits(action, *self._page)   # the page before the step
        state, reward, done = self.client.step(self.env_idx, action)
        info = self._info(reward if done else 0.0)
        info["invalid"] = rejected
        return state, reward, done, info

    def prompt_pieces(self) -> PromptPieces:
        """Instruction text and the search / click actions of the current page."""
        return PromptPieces(self.environment, self._desc, ("search[<keywords>]", "click[<value>]"), tuple(self._actions))

    def close(self) -> None:
        """Close the server-side env (best effort: a dead server is ignored)."""
        if self.env_idx is not None:
            try:
                self.client.close(self.env_idx)
            except EnvError:
                pass
            self.env_idx = None
