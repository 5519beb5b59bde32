"""Fixtures for the env tests: a blocking wave player for `EnvPool` (`play_episodes`), small
ALFWorld games built offline from the PDDL domain and grammar the alfworld package ships, and
a local AgentGym-WebShop-protocol HTTP server."""
from __future__ import annotations

import dataclasses
import json
import os
import threading
from typing import Any, Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

# ---------------------------------------------------------------- pool episodes


@dataclasses.dataclass
class EpisodeRecord:
    """Transcript of one episode played by `play_episodes`: observations[0] is the reset
    observation; observations[t+1], rewards[t] and infos[t+1] follow actions[t]."""

    episode_id: int
    task: Any
    observations: list[str] = dataclasses.field(default_factory=list)
    actions: list[str | None] = dataclasses.field(default_factory=list)
    rewards: list[float] = dataclasses.field(default_factory=list)
    infos: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    done: bool = False
    crashed: bool = False
    error: str = ""

    @property
    def episode_return(self) -> float:
        """Sum of step rewards."""
        return float(sum(self.rewards))

    @property
    def success(self) -> bool:
        """The last info's success flag (False when crashed or never stepped)."""
        return bool(self.infos and self.infos[-1].get("success", False)) and not self.crashed


def play_episodes(pool, tasks: Sequence[Any],
                  policy: Callable[[list[EpisodeRecord]], list[str | None]]) -> list[EpisodeRecord]:
    """Play every task to the end on `pool` (an `EnvPool`) with the blocking reset / step
    calls, in waves of at most ``pool.max_live_envs`` episodes.

    policy maps the transcripts of the still-running episodes of a wave to one action each
    (None = format-invalid output). Returns one `EpisodeRecord` per task, in task order.
    """
    records: list[EpisodeRecord] = []
    for start in range(0, len(tasks), pool.max_live_envs):
        wave = list(tasks[start:start + pool.max_live_envs])
        recs = []
        for task, out in zip(wave, pool.reset(wave)):
            rec = EpisodeRecord(out.episode_id, task, [out.observation], infos=[out.info])
            rec.done, rec.crashed, rec.error = out.done, out.crashed, out.error
            recs.append(rec)
        while True:
            live = [r for r in recs if not r.done]
            if not live:
                break
            actions = policy(live)
            for rec, act, out in zip(live, actions, pool.step([r.episode_id for r in live], actions)):
                rec.actions.append(act)
                rec.observations.append(out.observation)
                rec.rewards.append(out.reward)
                rec.infos.append(out.info)
                rec.done, rec.crashed, rec.error = out.done, out.crashed, out.error
        records.extend(recs)
    return records


# ---------------------------------------------------------------- ALFWorld games

_OBJECTS = """  agent1 - agent
  AppleType - otype
  FridgeType - rtype
  CounterTopType - rtype
  SinkBasinType - rtype
  Apple_bar__plus_00_dot_10 - object
  Fridge_bar__minus_01_dot_00 - receptacle
  CounterTop_bar__plus_01_dot_00 - receptacle
  Sink_bar__plus_02_dot_00_bar_SinkBasin - receptacle
  loc_start - location
  loc_fridge - location
  loc_counter - location
  loc_sink - location"""

_INIT = """  (atLocation agent1 loc_start)
  (receptacleAtLocation Fridge_bar__minus_01_dot_00 loc_fridge)
  (receptacleAtLocation CounterTop_bar__plus_01_dot_00 loc_counter)
  (receptacleAtLocation Sink_bar__plus_02_dot_00_bar_SinkBasin loc_sink)
  (receptacleType Fridge_bar__minus_01_dot_00 FridgeType)
  (receptacleType CounterTop_bar__plus_01_dot_00 CounterTopType)
  (receptacleType Sink_bar__plus_02_dot_00_bar_SinkBasin SinkBasinType)
  (openable Fridge_bar__minus_01_dot_00)
  (objectType Apple_bar__plus_00_dot_10 AppleType)
  (pickupable Apple_bar__plus_00_dot_10)
  (cleanable Apple_bar__plus_00_dot_10)
  (inReceptacle Apple_bar__plus_00_dot_10 {start})
  (objectAtLocation Apple_bar__plus_00_dot_10 {start_loc})
  (canContain FridgeType AppleType)
  (canContain CounterTopType AppleType)
  (canContain SinkBasinType AppleType)"""

# (family, start receptacle, start location, goal, parent target)
GAMES = {
    "pick_and_place_simple-Apple-None-Fridge-1": (
        "CounterTop_bar__plus_01_dot_00", "loc_counter",
        "(exists (?r - receptacle) (exists (?o - object) (and (inReceptacle ?o ?r) (objectType ?o AppleType) "
        "(receptacleType ?r FridgeType))))", "Fridge", "pick_and_place_simple"),
    "pick_clean_then_place_in_recep-Apple-None-CounterTop-2": (
        "Fridge_bar__minus_01_dot_00", "loc_fridge",
        "(exists (?r - receptacle) (exists (?o - object) (and (inReceptacle ?o ?r) (objectType ?o AppleType) "
        "(receptacleType ?r CounterTopType) (isClean ?o))))", "CounterTop", "pick_clean_then_place_in_recep"),
}


def build_alfworld_games(root: str) -> dict[str, str]:
    """Write the GAMES as `$root/json_2.1.1/train/<dir>/trial_1/game.tw-pddl` plus one
    unsolvable game (must be skipped). Returns {dir name: game path}."""
    import alfworld
    from alfworld.agents.utils.misc import add_task_to_grammar

    data = os.path.join(os.path.dirname(alfworld.__file__), "data")
    with open(os.path.join(data, "alfred.pddl")) as f:
        domain = f.read()
    with open(os.path.join(data, "alfred.twl2")) as f:
        grammar = f.read()
    out = {}
    for name, (start, start_loc, goal, parent, family) in GAMES.items():
        problem = (f"(define (problem plan_{family})\n(:domain alfred)\n(:objects\n{_OBJECTS}\n)\n"
                   f"(:init\n{_INIT.format(start=start, start_loc=start_loc)}\n)\n(:goal (and {goal}))\n)")
        traj = {"task_type": family, "pddl_params": {"object_target": "Apple", "parent_target": parent,
                                                     "toggle_target": "", "mrecep_target": "", "object_sliced": False}}
        game = {"pddl_domain": domain, "grammar": add_task_to_grammar(grammar, traj), "pddl_problem": problem,
                "solvable": True}
        path = os.path.join(root, "json_2.1.1", "train", name, "trial_1", "game.tw-pddl")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(game, f)
        out[name] = path
    bad = os.path.join(root, "json_2.1.1", "train", "pick_two_obj_and_place-Apple-None-Fridge-3", "trial_1", "game.tw-pddl")
    os.makedirs(os.path.dirname(bad), exist_ok=True)
    with open(bad, "w") as f:
        json.dump({"solvable": False}, f)
    return out


# ---------------------------------------------------------------- WebShop server


class FakeWebShop:
    """A tiny shop speaking AgentGym's WebShop protocol (agentenv_webshop/server.py fields).

    Goal g asks for product "p{g}"; searching shows every product; clicking p{g} then
    "buy now" gives reward 1.0, any other product 0.25. Records every request in `log`.
    """

    PRODUCTS = ["p0", "p1", "p2"]

    def __init__(self) -> None:
        self.envs: dict[int, dict] = {}
        self.next_id = 0
        self.log: list[tuple[str, str, dict]] = []
        self.fail_next = 0  # answer this many requests with HTTP 503 first

    def _obs(self, e: dict) -> str:
        page = e["page"]
        if page == "search":
            return f"WebShop [SEP] Instruction: [SEP] {e['instr']} [SEP] Search"
        if page == "results":
            return "[SEP] ".join(["Back to Search"] + self.PRODUCTS)
        return f"Item {e['item']} [SEP] Buy Now"

    def _actions(self, e: dict) -> dict:
        if e["page"] == "search":
            return {"has_search_bar": True, "clickables": ["search"]}
        if e["page"] == "results":
            return {"has_search_bar": False, "clickables": ["back to search"] + self.PRODUCTS}
        return {"has_search_bar": False, "clickables": ["back to search", "buy now"]}

    def handle(self, method: str, path: str, query: dict, body: dict):
        self.log.append((method, path, body or query))
        if path == "/" and method == "GET":
            return "ok"
        if path == "/create" and method == "POST":
            idx = self.next_id
            self.next_id += 1
            self.envs[idx] = {"page": "search", "instr": "", "goal": 0, "item": None}
            return idx
        if path == "/reset" and method == "POST":
            e = self.envs[body["env_idx"]]
            g = body["session_id"] or 0
            e.update(page="search", goal=g, item=None, instr=f"i need product p{g % 3}")
            return [self._obs(e), None]
        if path == "/step" and method == "POST":
            e = self.envs[body["env_idx"]]
            a = body["action"]
            reward, done = 0.0, False
            if a.startswith("search[") and e["page"] == "search":
                e["page"] = "results"
            elif a == "click[back to search]":
                e["page"] = "search"
            elif e["page"] == "results" and a[6:-1] in self.PRODUCTS:
                e.update(page="item", item=a[6:-1])
            elif e["page"] == "item" and a == "click[buy now]":
                reward = 1.0 if e["item"] == f"p{e['goal'] % 3}" else 0.25
                done = True
                return {"state": f"Thank you for shopping [SEP] Your score: {reward}", "reward": reward, "done": done, "info": None}
            return {"state": self._obs(e), "reward": reward, "done": done, "info": None}
        idx = int(query.get("env_idx", ["-1"])[0])
        if path == "/available_actions":
            return self._actions(self.envs[idx])
        if path == "/instruction_text":
            return self.envs[idx]["instr"]
        if path == "/observation":
            return self._obs(self.envs[idx])
        if path == "/close" and method == "POST":
            return {"closed": self.envs.pop(body["env_idx"], None) is not None}
        raise KeyError(path)


def start_webshop_server(shop: FakeWebShop):
    """Serve `shop` on 127.0.0.1 (free port) in a daemon thread; returns (server, base_url)."""

    class Handler(BaseHTTPRequestHandler):
        def _go(self, method: str) -> None:
            url = urlparse(self.path)
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n)) if n else {}
            if shop.fail_next > 0:
                shop.fail_next -= 1
                self.send_response(503)
                self.end_headers()
                return
            try:
                payload, code = shop.handle(method, url.path, parse_qs(url.query), body), 200
            except KeyError as e:
                payload, code = {"detail": f"not found: {e}"}, 404
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            self._go("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._go("POST")

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
