"""Throughput of one trainer update (scoring passes + advantages + mini-batched PPO steps).

Usage:
    python -m benchmarks.train_step                         # small shape: D 256, 4 layers, V 8192
    python -m benchmarks.train_step --preset tiny --rows 16 --prompt 32 --response 32
    python -m benchmarks.train_step --algo ppo --remat dots --dtype bfloat16

Random weights; a GRPO-style batch of `rows` one-step samples (prompt + response tokens, all
real). The first update is a warm-up (jax compiles there); the median of the timed repeats is
reported as seconds per update and tokens/s, where tokens = rows x (prompt + response) per
forward. One update runs the old-logprob and reference passes (2 forwards, no grad) and
ppo_epochs x ceil(rows / mini_batch) optimizer steps (forward + backward). Timings are printed,
never asserted; on a shared machine they are noisy.
"""
from __future__ import annotations

import argparse
import statistics
import time


import jax  # noqa: E402
import numpy as np  # noqa: E402

import configs.base as base  # noqa: E402
from strata_jax.algos import KIND_ACTION, make_sample_batch  # noqa: E402
from strata_jax.models import PRESETS, Qwen2Config, init_params  # noqa: E402
from strata_jax.sharding import make_mesh  # noqa: E402
from strata_jax.training import TrainConfig, Trainer  # noqa: E402

SMALL = Qwen2Config(vocab_size=8192, hidden_size=256, intermediate_size=704, num_layers=4,
                    num_heads=4, num_kv_heads=2, head_dim=64, tie_word_embeddings=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="", help="a strata_jax.models.PRESETS name (default: small)")
    ap.add_argument("--algo", default="grpo")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--mini", type=int, default=32, help="mini_batch_size")
    ap.add_argument("--micro", type=int, default=8, help="micro_batch_rows")
    ap.add_argument("--remat", default="none", choices=("none", "full", "dots"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="compute dtype (params stay fp32)")
    ap.add_argument("--mesh", action="store_true", help="shard over all devices (fsdp)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    model = PRESETS[args.preset] if args.preset else SMALL
    c = base.get_base_config()
    c.algo = args.algo
    cfg = TrainConfig.from_config(c, mini_batch_size=args.mini, micro_batch_rows=args.micro,
                                  remat=args.remat, compute_dtype=args.dtype, lr=1e-5)
    rng = np.random.default_rng(0)
    recs = [dict(prompt_ids=rng.integers(1, model.vocab_size, args.prompt),
                 response_ids=rng.integers(1, model.vocab_size, args.response),
                 task_id=i // 8, trajectory_id=i % 8, kind=KIND_ACTION,
                 score=float(rng.integers(0, 2)), step_reward=0.0) for i in range(args.rows)]
    batch = make_sample_batch(recs)
    params = init_params(model, jax.random.PRNGKey(0))
    trainer = Trainer(model, cfg, mesh=make_mesh() if args.mesh else None)
    state = trainer.init_state(params, jax.random.PRNGKey(1))

    t0 = time.perf_counter()
    state, m = trainer.update(state, batch, ref_params=params)
    warm = time.perf_counter() - t0
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        state, m = trainer.update(state, batch, ref_params=params)
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    tokens = args.rows * (args.prompt + args.response)
    print(f"model: D={model.hidden_size} L={model.num_layers} V={model.vocab_size} "
          f"({model.num_params / 1e6:.1f} M params); devices: {jax.device_count()} "
          f"{jax.devices()[0].platform}")
    print(f"batch: {args.rows} rows x ({args.prompt} prompt + {args.response} response); "
          f"mini {args.mini}, micro {args.micro}, remat {args.remat}, compute {args.dtype}, "
          f"algo {args.algo}")
    print(f"first update (compile + run): {warm:.2f} s")
    print(f"update: {t:.3f} s median of {args.repeats}  ->  {tokens / t:,.0f} tokens/s "
          f"(sequence tokens), {args.rows * args.response / t:,.0f} response tokens/s; "
          f"{m['optimizer_steps']:.0f} optimizer steps, skipped {m['skipped_steps']:.0f}")


if __name__ == "__main__":
    main()
