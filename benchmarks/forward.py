"""Forward (prefill) throughput and peak RSS: strata_jax vs transformers on the same weights.

Usage:
    python -m benchmarks.forward                       # Qwen2.5-0.5B shape, fp32, batch 8 x 512
    python -m benchmarks.forward --preset tiny --batch 2 --length 64 --repeats 2   # quick check

Random weights (transformers' initialiser, fixed seed) are saved once as an HF checkpoint in a
temporary dir; then each framework runs in its own subprocess so that its peak RSS (ru_maxrss,
loading included) is its own. Both compute the final hidden states for every position and the
logits of the last position only (what a sampler's prefill needs). The first call is a warm-up
(jax compiles there); the median of the timed repeats is reported. Timings are printed, never
asserted; on a shared machine they are noisy.
Imports: jax, flax, numpy, transformers, torch only (runs on GPU images too).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _peak_rss_mb() -> float:
    # ru_maxrss is KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _batch(vocab: int, batch: int, length: int):
    import numpy as np
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, min(vocab, 150000), (batch, length)).astype(np.int32)
    return tokens


def _run_jax(path: str, batch: int, length: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from strata_jax.models import forward, load_checkpoint, logits_from_hidden

    config, params = load_checkpoint(path, dtype=jnp.float32)
    tokens = jnp.asarray(_batch(config.vocab_size, batch, length))
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    mask = jnp.ones((batch, length), bool)

    @jax.jit
    def step(params, tokens, positions, mask):
        hidden, _ = forward(params, config, tokens, positions, mask)
        return hidden, logits_from_hidden(params, config, hidden[:, -1])

    t0 = time.perf_counter()
    jax.block_until_ready(step(params, tokens, positions, mask))
    first = time.perf_counter() - t0
    times, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = jax.block_until_ready(step(params, tokens, positions, mask))
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"framework": "strata_jax", "device": str(jax.devices()[0].platform),
            "first_call_s": first, "times_s": times, "cpu_s": cpu,
            "last_logits": np.asarray(out[1][0, :5]).tolist()}


def _run_torch(path: str, batch: int, length: int, repeats: int) -> dict:
    import torch
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = torch.from_numpy(_batch(model.config.vocab_size, batch, length).astype("int64"))

    def step():
        with torch.inference_mode():
            return model(input_ids=tokens, logits_to_keep=1, use_cache=False).logits

    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    times, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"framework": "transformers", "device": "cpu", "first_call_s": first, "times_s": times,
            "cpu_s": cpu, "last_logits": out[0, -1, :5].tolist()}


def _child(args: argparse.Namespace) -> None:
    run = {"jax": _run_jax, "torch": _run_torch}[args.child]
    result = run(args.checkpoint, args.batch, args.length, args.repeats)
    result["peak_rss_mb"] = _peak_rss_mb()
    print("RESULT " + json.dumps(result))


def _spawn(kind: str, ckpt: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.forward", "--child", kind, "--checkpoint", ckpt,
           "--batch", str(args.batch), "--length", str(args.length),
           "--repeats", str(args.repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"{kind} run failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen2.5-0.5b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=["jax", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    tokens = args.batch * args.length
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c",
                        f"from benchmarks.decode import write_checkpoint; "
                        f"write_checkpoint({args.preset!r}, {tmp!r})"], check=True, cwd=ROOT)
        print(f"random {args.preset} checkpoint written in {time.perf_counter() - t0:.1f}s "
              f"(fp32, batch {args.batch} x length {args.length} = {tokens} tokens per forward)")
        results = [_spawn("jax", tmp, args), _spawn("torch", tmp, args)]
    rate, cpu_rate = {}, {}
    for r in results:
        med = sorted(r["times_s"])[len(r["times_s"]) // 2]
        cpu_med = sorted(r["cpu_s"])[len(r["cpu_s"]) // 2]
        rate[r["framework"]] = tokens / med
        cpu_rate[r["framework"]] = tokens / cpu_med
        print(f"{r['framework']:>13} [{r['device']}]: {tokens / med:9.1f} tokens/s wall "
              f"(median {med:.2f}s of {['%.2f' % t for t in r['times_s']]}; first call "
              f"{r['first_call_s']:.2f}s), {tokens / cpu_med:8.1f} tokens per CPU-second, "
              f"peak RSS {r['peak_rss_mb']:.0f} MB; "
              f"last-position logits[:5] {['%.4f' % x for x in r['last_logits']]}")
    # Wall time is at the mercy of other processes on a shared box; CPU time less so.
    print(f"ratio strata_jax / transformers: wall tokens/s "
          f"{rate['strata_jax'] / rate['transformers']:.2f}, tokens per CPU-second "
          f"{cpu_rate['strata_jax'] / cpu_rate['transformers']:.2f}")


if __name__ == "__main__":
    main()
