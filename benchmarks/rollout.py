"""Rollout wall time with 1 vs 2 cohorts: how much env stepping overlaps decoding.

Prints, per cohort count: rollout wall seconds, policy (sampler) seconds, seconds blocked on
envs, env_wait_frac, and policy calls. Never asserts timings.

  python -m benchmarks.rollout                         # scripted policy (decode_s per call) on a
                                                       # grid env whose steps take env_s each
  python -m benchmarks.rollout --sciworld              # real sampler (tiny forced-output model)
                                                       # on real ScienceWorld (JVMs)
Options: --episodes 8 --decode_s 0.05 --env_s 0.05 --max_steps 6 --slots 8
"""
from __future__ import annotations

import argparse
import time


import jax  # noqa: E402

from envs_bridge import EnvPool, Task  # noqa: E402
from envs_bridge.builtin import GridNavEnv  # noqa: E402
from envs_bridge.registry import list_envs, register_env  # noqa: E402
from strata_jax.models import load_tokenizer  # noqa: E402
from strata_jax.rollout import (PromptBuilder, RolloutConfig, ScriptedPolicy,  # noqa: E402
                                collect_rollout)


class _SlowGrid(GridNavEnv):
    name = "bench_slow_grid"

    def __init__(self, max_steps: int = 6, env_s: float = 0.05) -> None:
        super().__init__(max_steps)
        self.env_s = env_s

    def _step(self, action):
        time.sleep(self.env_s)
        return super()._step(action)


if _SlowGrid.name not in list_envs():
    register_env(_SlowGrid.name, _SlowGrid)


def _walker(prompt: str, key) -> str:
    return f"<think>k</think><action>{['go north', 'go east', 'go south', 'go west'][int(key[0]) % 4]}</action>"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--decode_s", type=float, default=0.05)
    ap.add_argument("--env_s", type=float, default=0.05)
    ap.add_argument("--max_steps", type=int, default=6)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--sciworld", action="store_true")
    args = ap.parse_args()
    tok = load_tokenizer()
    builder = PromptBuilder(tok, 2048)
    if args.sciworld:
        from strata_jax.models import Qwen2Config
        from strata_jax.rollout import SamplerPolicy
        from strata_jax.sampling import Sampler
        from strata_jax.rollout.scripted import (FORCED_CONFIG, FORCED_TEXT,
                                                 forced_output_params)
        cfg = Qwen2Config(**FORCED_CONFIG)
        policy = SamplerPolicy(Sampler(cfg, max_cache_len=4096),
                               forced_output_params(cfg, tok, FORCED_TEXT))
        env, kwargs = "scienceworld", {"max_steps": args.max_steps}
        tasks = [Task("scienceworld", "boil", 0, "train")]
    else:
        policy = ScriptedPolicy(tok, _walker, delay_s=args.decode_s)
        env, kwargs = "bench_slow_grid", {"max_steps": args.max_steps, "env_s": args.env_s}
        tasks = [Task("bench_slow_grid", "grid_nav", 3)]
    with EnvPool(env, kwargs, max_live_envs=args.slots, reset_timeout_s=300) as pool:
        pool.warm_up()
        if args.sciworld:  # compile the sampler's programs (both batch sizes) outside the measurement
            for cohorts in (1, 2):
                collect_rollout(policy, pool, builder, tasks, key=jax.random.key(0),
                                config=RolloutConfig(mode="flat", group_size=args.episodes,
                                                     cohorts=cohorts, max_action_tokens=32))
        for cohorts in (1, 2):
            cfg = RolloutConfig(mode="flat", group_size=args.episodes, cohorts=cohorts,
                                max_action_tokens=32)
            res = collect_rollout(policy, pool, builder, tasks, key=jax.random.key(0), config=cfg)
            s = res.stats
            print(f"{env} cohorts={cohorts} episodes={args.episodes} steps={int(s['rollout/steps'])}: "
                  f"wall {s['time/rollout_wall_s']:.2f}s  policy {s['time/sampler_s']:.2f}s  "
                  f"env wait {s['time/env_wait_s']:.2f}s  env_wait_frac {s['time/env_wait_frac']:.2f}  "
                  f"policy calls {int(s['time/sampler_calls'])}")


if __name__ == "__main__":
    main()
