"""ScienceWorld stepping throughput: one instance, and EnvPool with 1, 2, 4 workers (thread
and process backends), with and without the valid-action list. Prints numbers, asserts nothing.

Usage: python -m benchmarks.envs [--steps 20] [--backends thread,process]  (~2 min per backend on 2 cores)
Each episode replays a fixed short action loop on find-living-thing (variation 3) with a
large step limit; env start-up is excluded (warm_up before timing).
"""
from __future__ import annotations

import argparse
import subprocess
import time


from envs_bridge import EnvPool, Task
from envs_bridge.scienceworld_env import ScienceWorldEnv

TASK = Task("scienceworld", "find-living-thing", 3)
LOOP = ["look around", "open door to kitchen", "go to kitchen", "look around", "go to outside", "look around"]


def rss_mb(pid: int) -> float:
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return int(out) / 1024 if out else float("nan")


def single(steps: int, valid: bool) -> tuple[float, float]:
    env = ScienceWorldEnv(max_steps=10**6, fetch_valid_actions=valid)
    env.reset(TASK)
    t = time.perf_counter()
    for i in range(steps):
        env.step(LOOP[i % len(LOOP)])
    sps = steps / (time.perf_counter() - t)
    mem = rss_mb(env.java_pid)
    env.close()
    return sps, mem


def pooled(workers: int, steps: int, valid: bool, backend: str) -> float:
    kw = {"max_steps": 10**6, "fetch_valid_actions": valid}
    with EnvPool("scienceworld", kw, max_live_envs=workers, num_workers=workers, backend=backend) as pool:
        pool.warm_up()
        ids = [o.episode_id for o in pool.reset([TASK] * workers)]
        t = time.perf_counter()
        for i in range(steps):
            pool.step(ids, [LOOP[i % len(LOOP)]] * workers)
        return steps * workers / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20, help="steps per env per measurement")
    ap.add_argument("--backends", default="thread", help="comma list of thread,process")
    args = ap.parse_args()
    for valid in (False, True):
        sps, mem = single(args.steps, valid)
        print(f"single env, valid_actions={valid}: {sps:7.1f} steps/s   (JVM RSS {mem:.0f} MB)")
    for backend in args.backends.split(","):
        for valid in (False, True):
            for w in (1, 2, 4):
                print(f"pool[{backend}] workers={w}, valid_actions={valid}: "
                      f"{pooled(w, args.steps, valid, backend):7.1f} steps/s total", flush=True)


if __name__ == "__main__":
    main()
