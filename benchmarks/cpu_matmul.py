"""What the CPU's matmul units give XLA and torch, fp32 and bf16, side by side in one run.

    python -m benchmarks.cpu_matmul                     # the 0.5B's MLP up-projection shape
    python -m benchmarks.cpu_matmul --m 4096 --k 896 --n 4864 --repeats 5

The update's cost on CPU is its matmuls. On a CPU with AMX / AVX512-BF16 units, torch (oneDNN)
runs bf16 matmuls several times faster than fp32, while XLA's CPU backend may not use those
units at all; then a bf16 update cannot beat torch per token however the program is laid out.
Each XLA flag setting runs in its own subprocess (XLA_FLAGS are read once per process), torch in
this one with ``torch.set_num_threads(os.cpu_count())``. Prints ms and GFLOP/s per dtype and the
CPU's bf16 features from /proc/cpuinfo. Measures, never asserts.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

XLA_SETTINGS = ("", "--xla_cpu_use_onednn=true",
                "--xla_cpu_use_xnnpack=true --xla_cpu_experimental_xnn_fusion_type=dot",
                "--xla_cpu_experimental_ynn_fusion_type=dot")

_JAX_WORKER = r"""
import sys, time, jax, jax.numpy as jnp
m, k, n, reps = map(int, sys.argv[1:5])
for name in ("float32", "bfloat16"):
    dt = jnp.dtype(name)
    a = jnp.ones((m, k), dt); b = jnp.ones((k, n), dt)
    f = jax.jit(lambda a, b: a @ b)
    f(a, b).block_until_ready()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); f(a, b).block_until_ready(); ts.append(time.perf_counter() - t)
    ts.sort()
    print(name, ts[len(ts) // 2])
"""


def gflops(m: int, k: int, n: int, seconds: float) -> float:
    return 2 * m * k * n / seconds / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=4096, help="rows (tokens)")
    ap.add_argument("--k", type=int, default=896, help="contraction (hidden size)")
    ap.add_argument("--n", type=int, default=4864, help="columns (intermediate size)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    m, k, n = args.m, args.k, args.n
    flags = set(open("/proc/cpuinfo").read().split()) if os.path.exists("/proc/cpuinfo") else set()
    print(f"[{m}, {k}] x [{k}, {n}]; {os.cpu_count()} CPUs, load "
          f"{open('/proc/loadavg').read().split()[0]}; bf16 units: "
          f"{sorted(flags & {'amx_bf16', 'avx512_bf16', 'amx_tile'}) or 'none'}")
    print("| backend | setting | fp32 ms | fp32 GFLOP/s | bf16 ms | bf16 GFLOP/s |")
    print("|---|---|---|---|---|---|")
    for setting in XLA_SETTINGS:
        env = dict(os.environ, XLA_FLAGS=setting, JAX_PLATFORMS="cpu")
        out = subprocess.run([sys.executable, "-c", _JAX_WORKER, str(m), str(k), str(n),
                              str(args.repeats)], env=env, capture_output=True, text=True)
        t = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        if out.returncode or len(t) != 2:
            print(f"| jax | {setting or 'default'} | failed: {out.stderr.strip()[-200:]} | | | |")
            continue
        f32, b16 = float(t["float32"]), float(t["bfloat16"])
        print(f"| jax | {setting or 'default'} | {f32 * 1e3:.0f} | {gflops(m, k, n, f32):.0f} | "
              f"{b16 * 1e3:.0f} | {gflops(m, k, n, b16):.0f} |")
    try:
        import torch
    except ImportError:
        print("| torch | not installed | | | | |")
        return
    torch.set_num_threads(os.cpu_count() or 1)
    res = {}
    for dt in (torch.float32, torch.bfloat16):
        a, b = torch.ones((m, k), dtype=dt), torch.ones((k, n), dtype=dt)
        a @ b
        ts = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            a @ b
            ts.append(time.perf_counter() - t)
        res[dt] = sorted(ts)[len(ts) // 2]
    f32, b16 = res[torch.float32], res[torch.bfloat16]
    print(f"| torch {torch.__version__} | {torch.get_num_threads()} threads | {f32 * 1e3:.0f} | "
          f"{gflops(m, k, n, f32):.0f} | {b16 * 1e3:.0f} | {gflops(m, k, n, b16):.0f} |")


if __name__ == "__main__":
    main()
