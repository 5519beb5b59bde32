"""EnvPool on the built-in envs: parallel == sequential, waves, submit/collect cohorts,
crash restart (killed worker process), timeouts, format-invalid steps."""
import os
import signal
import time

import pytest

from envs_bridge import EnvPool, Task, make_env, register_env
from envs_bridge.builtin import GridNavEnv, builtin_task_list


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
        recs = pool.run_episodes(tasks, expert_policy(pool))
        assert pool_transcripts(pool, recs) == sequential_transcripts(name, tasks)
        assert all(r.success and r.episode_return == 1.0 for r in recs)
        st = pool.stats()
        assert st["resets"] == 8 and st["steps"] == sum(len(r.actions) for r in recs) and st["crashes"] == 0


def test_more_episodes_than_live_envs_run_in_waves():
    tasks = builtin_task_list("grid_nav", "dev")[:11]
    with EnvPool("grid_nav", max_live_envs=3) as pool:
        recs = pool.run_episodes(tasks, expert_policy(pool))
        assert [r.task for r in recs] == tasks
        assert all(r.success for r in recs)
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
                recs = pool.run_episodes([task], expert_policy(pool))
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
