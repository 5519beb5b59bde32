"""Which weight layout XLA runs fastest for each decode-step projection (CPU or accelerator).

    python -m benchmarks.layouts                        # 0.5B shape, fp32, batch 8 and 32
    python -m benchmarks.layouts --preset qwen2.5-1.5b --batch 1 8 32 --dtype bfloat16

For every projection of one decoder layer (q, k, v, o, gate, up, down) and the output layer, at
each batch size, times one jitted ``x @ W`` in the candidate layouts with the same numbers:
  [out, in]  ``einsum("bd,fd->bf")`` (the HF layout strata-jax stores),
  [in, out]  ``einsum("bd,df->bf")`` (pre-transposed),
and the fused forms: q|k|v as one [q + 2 kv, in] matrix, gate|up as one [2F, in] matrix (both
layouts). A projection is repeated --chain times inside the program (weights differing per
copy, like the layers of a decode step) so dispatch overhead does not dominate. Prints the
median microseconds per projection over --repeats, the min..max spread, GB/s of weight bytes
streamed, and the fastest layout per row. Nothing asserts a timing; on a shared machine quote
the load (printed) and compare rows of one run only.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from strata_jax.models import PRESETS  # noqa: E402


def _program(layout: str, chain: int):
    spec = "bd,fd->bf" if layout == "out_in" else "bd,df->bf"

    @jax.jit
    def run(x, ws):
        acc = jnp.zeros((), jnp.float32)
        for w in ws:   # unrolled: independent weights, like the layers of a decode step
            acc = acc + jnp.sum(jnp.einsum(spec, x, w), dtype=jnp.float32)
        return acc
    return run


def measure(batch: int, n_in: int, n_out: int, args) -> dict[str, tuple[float, float, float]]:
    """Median, min, max seconds per projection of each layout; the layouts' repeats are
    interleaved (out_in, in_out, out_in, ...) so a load change hits both alike."""
    rng = np.random.default_rng(0)
    dt = jnp.dtype(args.dtype)
    ws_oi = [jnp.asarray(rng.standard_normal((n_out, n_in), np.float32) * 0.02, dt)
             for _ in range(args.chain)]
    progs = {"out_in": (_program("out_in", args.chain), ws_oi),
             "in_out": (_program("in_out", args.chain), [jnp.asarray(np.asarray(w).T) for w in ws_oi])}
    x = jnp.asarray(rng.standard_normal((batch, n_in), np.float32), dt)
    ts: dict[str, list[float]] = {k: [] for k in progs}
    for fn, ws in progs.values():
        fn(x, ws).block_until_ready()
    for _ in range(args.repeats):
        for k, (fn, ws) in progs.items():
            t = time.perf_counter()
            fn(x, ws).block_until_ready()
            ts[k].append((time.perf_counter() - t) / args.chain)
    return {k: (statistics.median(v), min(v), max(v)) for k, v in ts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--chain", type=int, default=8, help="projections per timed program")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-head", action="store_true", help="skip the [V, D] output layer")
    args = ap.parse_args()
    c = PRESETS[args.preset]
    d, f = c.hidden_size, c.intermediate_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    rows = [("q", d, q), ("k/v", d, kv), ("o", q, d), ("gate/up", d, f), ("down", f, d),
            ("qkv fused", d, q + 2 * kv), ("gate|up fused", d, 2 * f)]
    if not args.skip_head:
        rows.append(("lm_head", d, c.vocab_size))
    load = open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"
    print(f"{args.preset} {args.dtype} on {jax.devices()[0].device_kind} "
          f"({jax.default_backend()}), load {load}; median us per projection over "
          f"{args.repeats} (min..max), weight GB/s", flush=True)
    item = jnp.dtype(args.dtype).itemsize
    for b in args.batch:
        print(f"\n--- batch {b} ---")
        for name, n_in, n_out in rows:
            chain = args.chain
            if name == "lm_head":
                args.chain = 1
            res = measure(b, n_in, n_out, args)
            args.chain = chain
            gb = n_in * n_out * item / 1e9
            best = min(res, key=lambda k: res[k][0])
            cells = "  ".join(f"{k} {m * 1e6:8.1f} ({lo * 1e6:.0f}..{hi * 1e6:.0f}) "
                              f"{gb / m:5.1f} GB/s" for k, (m, lo, hi) in res.items())
            print(f"{name:14s} [{n_in:5d} -> {n_out:6d}]  {cells}  fastest: {best}", flush=True)


if __name__ == "__main__":
    main()
