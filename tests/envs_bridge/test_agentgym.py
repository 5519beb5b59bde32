"""AgentGym HTTP client (WebShop protocol) against a local server started by the test."""
import socket
import time

import pytest

from envs_bridge import EnvError, EnvPool, Task, make_env
from envs_bridge.agentgym_http import WebShopClient, WebShopEnv, webshop_actions
from tests.fixtures.envs import FakeWebShop, play_episodes, start_webshop_server


@pytest.fixture(scope="module")
def server():
    shop = FakeWebShop()
    srv, url = start_webshop_server(shop)
    yield shop, url
    srv.shutdown()
    srv.server_close()


def test_protocol_fields_on_the_wire(server):
    shop, url = server
    c = WebShopClient(url)
    n = len(shop.log)
    idx = c.create()
    assert c.reset(idx, 4).startswith("WebShop [SEP] Instruction")
    assert c.available_actions(idx) == (True, ["search"])
    assert c.step(idx, "search[p1]") == ("Back to Search[SEP] p0[SEP] p1[SEP] p2", 0.0, False)
    assert c.instruction_text(idx) == "i need product p1"
    assert c.close(idx) is True
    assert shop.log[n:] == [
        ("POST", "/create", {}),
        ("POST", "/reset", {"env_idx": idx, "session_id": 4}),
        ("GET", "/available_actions", {"env_idx": [str(idx)]}),
        ("POST", "/step", {"env_idx": idx, "action": "search[p1]"}),
        ("GET", "/instruction_text", {"env_idx": [str(idx)]}),
        ("POST", "/close", {"env_idx": idx}),
    ]


def test_webshop_episode_reward_and_prompt_actions(server):
    _, url = server
    env = make_env("webshop", server_url=url)
    obs, info = env.reset(Task("webshop", "goal", 5, "test"))
    assert info["task_description"] == "i need product p2"
    assert info["admissible_actions"] == ["search[<keywords>]"]
    obs, r, done, info = env.step("search[product p2]")
    assert info["admissible_actions"] == ["click[back to search]", "click[p0]", "click[p1]", "click[p2]"]
    env.step("click[p2]")
    obs, r, done, info = env.step("click[buy now]")
    assert (r, done, info["success"], info["score"]) == (1.0, True, True, 1.0)
    env.reset(Task("webshop", "goal", 5, "test"))
    env.step("search[x]")
    env.step("click[p0]")
    obs, r, done, info = env.step("click[buy now]")
    assert (r, done, info["success"]) == (0.25, True, False)
    assert env.prompt_pieces().environment == "WebShop"
    env.close()


def test_retries_on_503(server):
    shop, url = server
    c = WebShopClient(url, retries=3, backoff_s=0.01)
    shop.fail_next = 2
    assert isinstance(c.create(), int) and shop.fail_next == 0
    shop.fail_next = 3
    with pytest.raises(EnvError, match="after 3 tries"):
        c.create()
    shop.fail_next = 0


def test_server_down_clear_error_after_retries():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = WebShopEnv(server_url=f"http://127.0.0.1:{port}", retries=3, backoff_s=0.01, timeout_s=1)
    t = time.perf_counter()
    with pytest.raises(EnvError, match=r"did not answer POST /create after 3 tries.*server running"):
        env.reset(Task("webshop", "goal", 0, "test"))
    assert time.perf_counter() - t < 10


def test_webshop_through_pool_and_splits(server):
    _, url = server
    with EnvPool("webshop", {"server_url": url}, max_live_envs=2) as pool:
        recs = play_episodes(
            pool,
            [Task("webshop", "goal", g, "test") for g in (0, 1, 2)],
            lambda live: [["search[x]", f"click[p{r.task.variation % 3}]", "click[buy now]"][len(r.actions)] for r in live],
        )
        assert [r.episode_return for r in recs] == [1.0, 1.0, 1.0]
    tr, dv, te = (set(t.variation for t in WebShopEnv.task_list(s)) for s in ("train", "dev", "test"))
    assert not (tr & dv or tr & te or dv & te) and len(te) == 500
    assert webshop_actions(True, ["search"]) == ["search[<keywords>]"]


def test_unreachable_server_is_one_start_up_error_naming_url_and_command():
    # nothing listens on port 9 (discard): the run must stop before anything is built
    from configs import webshop
    from strata_jax import experiment as ex
    c = webshop.get_config()
    c.env.server_url = "http://127.0.0.1:9"
    with pytest.raises(ex.ConfigError) as err:
        ex.check_env(c)
    msg = str(err.value)
    assert msg.startswith("the WebShop server at http://127.0.0.1:9 does not answer "
                          "([Errno 111] Connection refused)")
    assert "`webshop --host 127.0.0.1 --port 36001`" in msg and "--config.env.server_url" in msg


def test_reachable_server_passes_the_start_up_check(server):
    from configs import webshop
    from strata_jax import experiment as ex
    _, url = server
    c = webshop.get_config()
    c.env.server_url = url
    ex.check_env(c)   # no error
    c.env.name = "scienceworld"   # envs without external services have no check
    ex.check_env(c)
