"""Accelerator benchmark in one call: decode throughput vs the HBM roofline, and the update step.

    python -m benchmarks.gpu                                  # qwen2.5-0.5b shape, bf16, random
    python -m benchmarks.gpu --preset qwen2.5-1.5b --batch 8 32 128 --update-rows 64
    python -m benchmarks.gpu --model /path/to/hf_dir          # real weights (config.json + safetensors)

Imports jax, flax (through strata_jax), numpy only (transformers is not needed; nothing reads
ml-collections or tensorboardX), so it runs on a bare accelerator image. Budget: a few minutes
on one GPU (compiles included).

Prints, all measured in the same run on the default device:
- HBM read bandwidth (a jitted reduction over a 4 GiB array) and bf16 matmul rate;
- decode: `Sampler.generate` at each --batch (prompt --prompt-len, --new-tokens greedy tokens),
  decode tok/s = batch x (N - 1) / (t(N) - t(1)) of back-to-back runs (medians over --repeats,
  min..max spread, "not measurable" when it is not), the decode step time against the
  bandwidth roofline (weights + KV cache read once per step / bandwidth) as a fraction;
- update: one `Trainer.update` (GRPO, KL on, remat "full", bf16 compute over fp32 masters) on
  --update-rows rows x (--update-prompt + --update-response) tokens, LoRA rank 64 and full
  fine-tuning: seconds, tokens/s, model FLOP utilisation (6 x params x tokens for the
  forward + backward, + 2 x params x tokens for the reference pass, over the matmul rate), and
  the device's peak bytes in use.
"""
from __future__ import annotations

import argparse
import statistics
import time


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from strata_jax.algos import KIND_ACTION, make_sample_batch  # noqa: E402
from strata_jax.algos.config import LossConfig  # noqa: E402
from strata_jax.models import PRESETS, Qwen2Config, init_params, load_params  # noqa: E402
from strata_jax.models.lora import LoraConfig  # noqa: E402
from strata_jax.sampling import Sampler, SamplingParams  # noqa: E402
from strata_jax.training import TrainConfig, Trainer  # noqa: E402

from benchmarks._timing import time_updates  # noqa: E402


def _time(fn, repeats):
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def rates(dtype, gib: float) -> dict:
    n = int(gib * 2**30) // jnp.dtype(dtype).itemsize
    x = jnp.ones((n,), dtype)
    t = _time(lambda: jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))(x), 5)
    bw = n * jnp.dtype(dtype).itemsize / t / 1e9
    del x
    m = 8192 if gib >= 1 else 1024
    a = jnp.ones((m, m), jnp.bfloat16)
    t = _time(lambda: jax.jit(lambda p, q: p @ q)(a, a), 5)
    return {"bw_gbs": bw, "tflops": 2 * m ** 3 / t / 1e12}


def decode(config, params, args, hw) -> None:
    sampler = Sampler(config, max_cache_len=args.prompt_len + args.new_tokens + 64,
                      length_floor=16, new_tokens_floor=1)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    if not config.tie_word_embeddings:   # an untied embedding is gathered, not streamed
        param_bytes -= params["embed"].size * params["embed"].dtype.itemsize
    kv = config.num_kv_heads * config.head_dim
    for b in args.batch:
        prompts = np.random.default_rng(0).integers(1, config.vocab_size,
                                                    (b, args.prompt_len)).tolist()
        keys = jax.random.split(jax.random.key(1), b)

        def run(n):
            t = time.perf_counter()
            out = sampler.generate(params, prompts, SamplingParams(greedy=True,
                                                                   max_new_tokens=n), keys)
            assert out.lengths.min() == n
            return time.perf_counter() - t

        run(1), run(args.new_tokens)     # compile
        dec = []
        for _ in range(args.repeats):
            t1, tn = run(1), run(args.new_tokens)
            dec.append(tn - t1)
        med = statistics.median(dec)
        if min(dec) <= 0 or (len(dec) > 1 and max(dec) - min(dec) >= med):
            print(f"decode batch {b:4d}: not measurable (decode times {dec})")
            continue
        tps = sorted(b * (args.new_tokens - 1) / d for d in dec)
        step = med / (args.new_tokens - 1)
        kv_bytes = 2 * config.num_layers * b * (args.prompt_len + args.new_tokens) * kv * 2
        roof = (param_bytes + kv_bytes) / (hw["bw_gbs"] * 1e9)
        print(f"decode batch {b:4d}: {statistics.median(tps):9.1f} tok/s (median of "
              f"{args.repeats}, {tps[0]:.1f}..{tps[-1]:.1f}); step {step * 1e3:.2f} ms vs HBM "
              f"roofline {roof * 1e3:.2f} ms -> {roof / step:.0%} of roofline", flush=True)


def update(config, params, args, hw) -> None:
    rng = np.random.default_rng(0)
    rows, tp, tr = args.update_rows, args.update_prompt, args.update_response
    recs = [dict(prompt_ids=rng.integers(1, config.vocab_size, tp),
                 response_ids=rng.integers(1, config.vocab_size, tr), task_id=i // 4,
                 trajectory_id=i % 4, kind=KIND_ACTION, score=float(i % 2), step_reward=0.0)
            for i in range(rows)]
    batch = make_sample_batch(recs)
    tokens = rows * (tp + tr)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    for mode in ("lora", "full"):
        cfg = TrainConfig(algo="grpo", lr=1e-6, mini_batch_size=rows, micro_batch_rows=rows,
                          remat="full", compute_dtype="bfloat16", loss=LossConfig(),
                          lora=LoraConfig(rank=64, alpha=64.0) if mode == "lora" else
                          LoraConfig(), donate_state=True)
        trainer = Trainer(config, cfg)
        state = trainer.init_state(params, jax.random.PRNGKey(1))
        state, warm, times, _ = time_updates(trainer, state, batch, params, args.repeats)
        t = statistics.median(times)
        flops = (6 + 2) * n_params * tokens      # fwd + bwd, plus the reference forward
        stats = jax.devices()[0].memory_stats() or {}
        peak = stats.get("peak_bytes_in_use", 0) / 2**30
        print(f"update {mode:4s}: {t:.3f} s (median of {args.repeats}; first {warm:.1f} s) = "
              f"{tokens / t:,.0f} tok/s; MFU {flops / t / (hw['tflops'] * 1e12):.0%} of the "
              f"measured matmul rate; device peak {peak:.1f} GiB", flush=True)
        del state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--model", default="", help="HF checkpoint dir with real weights")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--update-rows", type=int, default=16)
    ap.add_argument("--update-prompt", type=int, default=768)
    ap.add_argument("--update-response", type=int, default=64)
    ap.add_argument("--probe-gib", type=float, default=4.0,
                    help="size of the bandwidth probe array (and 8192^2 matmul when >= 1)")
    ap.add_argument("--skip", nargs="*", default=[], choices=("decode", "update"))
    args = ap.parse_args()
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} x {jax.device_count()} ({jax.default_backend()}), "
          f"jax {jax.__version__}", flush=True)
    if args.model:
        config = Qwen2Config.from_pretrained(args.model)
        master = load_params(args.model, config, dtype=jnp.float32)
    else:
        config = PRESETS[args.preset]
        master = init_params(config, jax.random.PRNGKey(0), jnp.float32)
    hw = rates(jnp.bfloat16, args.probe_gib)
    print(f"measured: HBM read {hw['bw_gbs']:.0f} GB/s, bf16 matmul {hw['tflops']:.0f} TFLOP/s; "
          f"model {args.model or args.preset} ({config.num_params / 1e6:.0f} M params)",
          flush=True)
    if "decode" not in args.skip:
        bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), master)
        decode(config, bf16, args, hw)
        del bf16
    if "update" not in args.skip:
        update(config, master, args, hw)


if __name__ == "__main__":
    main()
