"""EnvPool on the built-in envs: parallel == sequential, waves, submit/collect cohorts,
crash restart (killed worker process), timeouts, format-invalid steps."""
import os
import signal
import time

import pytest

from envs_bridge import EnvPool, Task, make_env, register_env
from envs_bridge.builtin import GridNavEnv, builtin_task_list
from tests.fixtures.envs import play_episodes


class _SleepyEnv(GridNavEnv):
    """grid_nav whose `sleep` action blocks (to trigger the pool's step timeout)."""

    name = "sleepy_grid"

    def _step(self, action):
        if action == "sleep":
            time.sleep(1.5)
        return super()._step(action)


register_env("sleepy_grid", _SleepyEnv)


def sequential_transcripts(name, tasks):
    out = []
    for task in tasks:
        env = make_env(name)
        obs, _ = env.reset(task)
        trans, done = [obs], False
        while not done:
            a = env.expert_action()
            obs, r, done, _ = env.step(a)
            trans += [a, obs, r]
        out.append(trans)
    return out


def pool_transcripts(pool, recs):
    out = []
    for rec in recs:
        trans = [rec.observations[0]]
        for a, o, r in zip(rec.actions, rec.observations[1:], rec.rewards):
            trans += [a, o, r]
        out.append(trans)
    return out


def expert_policy(pool):
    return lambda live: [pool.env_for(r.episode_id).expert_action() for r in live]


@pytest.mark.parametrize("name", ["memory_key", "guess_number", "grid_nav"])
def test_eight_parallel_envs_match_sequential(name):
    tasks = builtin_task_list(name, "test")[:8]
    with EnvPool(name, max_live_envs=8, num_workers=4) as pool:
        recs = play_episodes(pool, tasks, expert_policy(pool))
        assert pool_transcripts(pool, recs) == sequential_transcripts(name, tasks)
        assert all(r.success and r.episode_return == 1.0 for r in recs)
        st = pool.stats()
        assert st["resets"] == 8 and st["steps"] == sum(len(r.actions) for r in recs) and st["crashes"] == 0


def test_more_episodes_than_live_envs_run_in_waves():
    tasks = builtin_task_list("grid_nav", "dev")[:11]
    with EnvPool("grid_nav", max_live_envs=3) as pool:
        recs = play_episodes(pool, tasks, expert_policy(pool))
        assert [r.task for r in recs] == tasks
        assert all(r.success for r in recs)
        # every episode finished: the pool holds none of the 11 any more (a long run's pool
        # must not keep a record per episode it ever played)
        assert (pool.num_episodes, pool.num_free) == (0, 3)
        assert pool.stats()["live_envs"] == 3 and pool.num_free == 3
        assert pool_transcripts(pool, recs) == sequential_transcripts("grid_nav", tasks)


def test_submit_collect_cohorts_match_blocking_steps():
    tasks = builtin_task_list("guess_number", "train")[:8]
    ref = sequential_transcripts("guess_number", tasks)
    with EnvPool("guess_number", max_live_envs=8) as pool:
        a = [o.episode_id for o in pool.reset(tasks[:4])]
        b_ticket = pool.submit_reset(tasks[4:])  # cohort B resets while cohort A is prepared
        b = [o.episode_id for o in pool.collect(b_ticket)]
        trans = {}
        for eid, task in zip(a + b, tasks):
            trans[eid] = [ref[tasks.index(task)][0]]
        live = {"A": list(a), "B": list(b)}
        while live["A"] or live["B"]:
            tickets = {}
            for c in ("A", "B"):  # submit both cohorts before collecting either
                if live[c]:
                    acts = [pool.env_for(e).expert_action() for e in live[c]]
                    tickets[c] = (pool.submit(live[c], acts), acts)
            for c, (ticket, acts) in tickets.items():
                for eid, act, out in zip(ticket.episode_ids, acts, pool.collect(ticket)):
                    trans[eid] += [act, out.observation, out.reward]
                    if out.done:
                        live[c].remove(eid)
        assert [trans[e] for e in a + b] == ref
        with pytest.raises(ValueError, match="unknown or finished"):
            pool.submit([a[0]], ["guess 1"])


def test_group_synchronised_reset_gives_identical_copies():
    with EnvPool("grid_nav", max_live_envs=4) as pool:
        outs = pool.reset_group(Task("grid_nav", "grid_nav", 5), 4)
        assert len({o.observation for o in outs}) == 1 and len({o.episode_id for o in outs}) == 4
        with pytest.raises(RuntimeError, match="waves"):
            pool.reset([Task("grid_nav", "grid_nav", 6)])
        pool.release([o.episode_id for o in outs])
        assert pool.num_free == 4


def test_invalid_format_step_through_pool():
    with EnvPool("guess_number", {"max_steps": 2}, max_live_envs=1) as pool:
        (o,) = pool.reset([Task("guess_number", "guess_number", 1)])
        (s1,) = pool.step([o.episode_id], [None])
        assert s1.observation == o.observation and s1.info["invalid_format"] and not s1.done
        (s2,) = pool.step([o.episode_id], [None])
        assert s2.done and s2.info["truncated"] and not s2.crashed


def test_step_timeout_crashes_episode_and_restarts_env():
    tasks = [Task("sleepy_grid", "sleepy_grid", s) for s in (1, 2)]
    with EnvPool("sleepy_grid", max_live_envs=2, step_timeout_s=0.4) as pool:
        e1, e2 = [o.episode_id for o in pool.reset(tasks)]
        out1, out2 = pool.step([e1, e2], ["sleep", pool.env_for(e2).expert_action()])
        assert out1.crashed and out1.done and "timeout" in out1.error
        assert not out2.crashed
        st = pool.stats()
        assert (st["timeouts"], st["restarts"]) == (1, 1)
        (again,) = pool.reset([tasks[0]])  # the slot works again with a fresh env
        assert not again.crashed and again.observation.startswith("You are at")


def test_killed_worker_process_restarts_and_others_continue():
    tasks = builtin_task_list("memory_key", "test")[:3]
    with EnvPool("memory_key", max_live_envs=3, backend="process", step_timeout_s=20) as pool:
        ids = [o.episode_id for o in pool.reset(tasks)]
        codes = {}
        for eid, task in zip(ids, tasks):
            env = make_env("memory_key")
            env.reset(task)
            codes[eid] = (env.corridor, env.code)
        os.kill(pool.worker_pid(ids[1]), signal.SIGKILL)
        outs = pool.step(ids, ["go north"] * 3)
        assert [o.crashed for o in outs] == [False, True, False]
        assert outs[1].done and "died" in outs[1].error
        live = [ids[0], ids[2]]
        steps = {e: 1 for e in live}
        while live:
            acts = ["go north" if steps[e] < codes[e][0] else f"enter {codes[e][1]}" for e in live]
            res = pool.step(live, acts)
            for e, o in zip(list(live), res):
                steps[e] += 1
                if o.done:
                    assert o.reward == 1.0 and o.info["success"]
                    live.remove(e)
        assert pool.stats()["restarts"] == 1
        (o,) = pool.reset([tasks[1]])  # restarted worker serves a new episode
        assert not o.crashed and "vault code" in o.observation


class _HangingEnv(GridNavEnv):
    """grid_nav whose `hang` action blocks until the test releases it, even through close()
    (a simulator call that ignores being closed), and whose task_id 'bad' is bad input."""

    name = "hanging_grid"
    release = None  # threading.Event, set by the test

    def _reset(self, task):
        if task.task_id == "bad":
            raise ValueError("corrupt game file")
        return super()._reset(task)

    def _step(self, action):
        if action == "hang":
            _HangingEnv.release.wait(30)
        return super()._step(action)


register_env("hanging_grid", _HangingEnv)


def test_hung_step_slot_is_rebuilt_and_next_episode_on_it_completes():
    """Before the fix the hung call kept the slot's lock and executor thread, so every later
    reset on that slot timed out too (restarts counted, live_envs 0)."""
    import threading

    _HangingEnv.release = threading.Event()
    task = Task("hanging_grid", "hanging_grid", 3)
    try:
        with EnvPool("hanging_grid", max_live_envs=1, step_timeout_s=0.3, reset_timeout_s=1.0) as pool:
            (o,) = pool.reset([task])
            (s,) = pool.step([o.episode_id], ["hang"])
            assert s.crashed and s.done and "timeout" in s.error and pool.num_free == 1
            for _ in range(2):  # two full episodes on the rebuilt slot, the hang still going on
                recs = play_episodes(pool, [task], expert_policy(pool))
                assert not recs[0].crashed and recs[0].success
                assert recs[0].observations[0] == make_env("grid_nav").reset(Task("grid_nav", "grid_nav", 3))[0]
            st = pool.stats()
            assert (st["timeouts"], st["restarts"], st["crashes"], st["live_envs"]) == (1, 1, 1, 1)
            assert pool.num_free == 1
    finally:
        _HangingEnv.release.set()


def test_reset_user_error_frees_the_other_episodes_slots():
    good, bad = Task("hanging_grid", "hanging_grid", 1), Task("hanging_grid", "bad", 1)
    with EnvPool("hanging_grid", max_live_envs=3) as pool:
        with pytest.raises(ValueError, match="corrupt game file"):
            pool.reset([good, bad, good])
        assert pool.num_free == 3  # was 1: the two good episodes' slots leaked
        outs = pool.reset([good] * 3)
        assert [o.crashed for o in outs] == [False] * 3


class _ChildProcessEnv(GridNavEnv):
    """grid_nav that owns a child process (as a ScienceWorld env owns its JVM), takes
    `start_s` to start, and whose `crash` action raises a multi-line error (a dying JVM)."""

    name = "child_grid"
    start_s = 0.0

    def __init__(self, **kw):
        import subprocess
        import sys
        super().__init__(**kw)
        self.child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        time.sleep(_ChildProcessEnv.start_s)

    def close(self):
        self.child.kill()
        self.child.wait()

    def _step(self, action):
        if action == "crash":
            raise RuntimeError("py4j.protocol.Py4JNetworkError: Answer from Java side is empty\n"
                               + "\n".join(f'  File "x.py", line {i}' for i in range(30)))
        return super()._step(action)


register_env("child_grid", _ChildProcessEnv)


def _children():
    import psutil
    return [p for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_close_waits_for_a_background_restart_no_child_outlives_the_pool(caplog):
    # the crash's restart starts a new env (1 s) in the background; close() comes at once
    baseline = len(_children())
    task = Task("child_grid", "child_grid", 1)
    _ChildProcessEnv.start_s = 0.0
    pool = EnvPool("child_grid", max_live_envs=2)
    ids = [o.episode_id for o in pool.reset([task, task])]
    assert len(_children()) == baseline + 2
    _ChildProcessEnv.start_s = 1.0
    with caplog.at_level("WARNING", logger="envs_bridge.pool"):
        out = pool.step(ids, ["crash", "go north"])
    assert [o.crashed for o in out] == [True, False]
    pool.close()
    time.sleep(1.5)   # a restart that outlived close() would have started its child by now
    assert len(_children()) == baseline
    # the crash is one log line with the cause, and a counter
    lines = [r.getMessage() for r in caplog.records if r.name == "envs_bridge.pool"]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "crashed in step of task child_grid" in lines[0] and "Py4JNetworkError" in lines[0]
    st = pool.stats()
    assert (st["crashes"], st["restarts"], st["timeouts"], st["retries"]) == (1, 1, 0, 0)


def test_pool_metrics_are_per_iteration_deltas():
    from envs_bridge.pool import pool_metrics
    before = {"crashes": 2, "timeouts": 1, "restarts": 2, "retries": 0, "steps": 40}
    after = {"crashes": 5, "timeouts": 1, "restarts": 4, "retries": 3, "steps": 90}
    assert pool_metrics(before, after) == {"rollout/env_crashes": 3.0, "rollout/env_timeouts": 0.0,
                                           "rollout/env_restarts": 2.0, "rollout/env_retries": 3.0}


class _FlakyResetEnv(GridNavEnv):
    """grid_nav whose first reset in the process crashes (a JVM killed during the strategy
    stage's first reset)."""

    name = "flaky_reset_grid"
    failures_left = 0

    def _reset(self, task):
        if _FlakyResetEnv.failures_left > 0:
            _FlakyResetEnv.failures_left -= 1
            raise RuntimeError("JVM died")
        return super()._reset(task)


register_env("flaky_reset_grid", _FlakyResetEnv)


def test_retried_first_reset_is_counted_and_logged_once(caplog):
    from envs_bridge.pool import pool_metrics
    from strata_jax.rollout.strategy import first_observations
    _FlakyResetEnv.failures_left = 1
    tasks = [Task("flaky_reset_grid", "flaky_reset_grid", s) for s in (1, 2)]
    with EnvPool("flaky_reset_grid", max_live_envs=2) as pool, \
            caplog.at_level("WARNING", logger="envs_bridge.pool"):
        before = pool.stats()
        firsts = first_observations(pool, tasks)
        m = pool_metrics(before, pool.stats())
    assert all(f is not None and f[0].startswith("You are at") for f in firsts)
    assert m == {"rollout/env_crashes": 1.0, "rollout/env_timeouts": 0.0,
                 "rollout/env_restarts": 1.0, "rollout/env_retries": 1.0}
    lines = [r.getMessage() for r in caplog.records if r.name == "envs_bridge.pool"]
    assert len(lines) == 1 and "crashed in reset of task flaky_reset_grid" in lines[0]
    assert "RuntimeError: JVM died; restarting it" in lines[0]


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_outcomes_carry_the_envs_prompt_pieces(backend):
    """Every reset / step outcome holds the env's `prompt_pieces()` after that call (read in the
    worker for processes), equal to a local env's after the same actions; a crash holds None."""
    task = Task("memory_key", "memory_key", 4)
    ref = make_env("memory_key")
    ref.reset(task)
    want = [ref.prompt_pieces()]
    for a in ("go north", "look"):
        ref.step(a)
        want.append(ref.prompt_pieces())
    assert want[0].action_templates == ("go north", "go south", "enter <digits>", "look")
    assert want[0].environment != "memory_key" and want[0].admissible_actions
    with EnvPool("memory_key", max_live_envs=1, backend=backend, step_timeout_s=20) as pool:
        (o,) = pool.reset([task])
        got = [o.pieces] + [pool.step([o.episode_id], [a])[0].pieces for a in ("go north", "look")]
        assert got == want
        if backend == "process":
            os.kill(pool.worker_pid(o.episode_id), signal.SIGKILL)
            (dead,) = pool.step([o.episode_id], ["look"])
            assert dead.crashed and dead.pieces is None
