"""Fetch and load cost of a real checkpoint: GGUF (or HF dir) -> fp32 params on the host.

    python -m benchmarks.load                                   # fetch + load the 0.5B GGUF
    python -m benchmarks.load --model qwen2.5-coder-1.5b-instruct
    python -m benchmarks.load --model /path/to/model.gguf --dtype bfloat16

Prints, for one process: the fetch time (0 when cached), metadata / tokenizer parse time, the
time to read + dequantize + place every tensor, the params' bytes, and the peak RSS of the
process (``ru_maxrss``, which includes the Python / jax baseline printed first). Each step runs
once: these are cold, single-shot figures; report them with the machine's load.
"""
from __future__ import annotations

import argparse
import os
import resource
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct",
                   help="a name known to strata_jax.models.fetch, a .gguf file or an HF dir")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp

    from strata_jax.models import load_checkpoint, load_tokenizer
    from strata_jax.models.fetch import MODELS, fetch
    from strata_jax.models.loading import checkpoint_config
    base = _rss_mib()
    print(f"baseline peak RSS (python + jax): {base:.0f} MiB")
    t = time.perf_counter()
    path = fetch(args.model) if args.model.lower() in MODELS else args.model
    print(f"fetch: {time.perf_counter() - t:.1f} s  ({os.path.getsize(path) / 1e6:.0f} MB file)"
          if os.path.isfile(path) else f"checkpoint dir: {path}")
    t = time.perf_counter()
    cfg = checkpoint_config(path)
    print(f"metadata -> config: {time.perf_counter() - t:.1f} s  {cfg}")
    t = time.perf_counter()
    tok = load_tokenizer(path)
    print(f"tokenizer: {time.perf_counter() - t:.1f} s  ({len(tok)} tokens)")
    t = time.perf_counter()
    _, params = load_checkpoint(path, dtype=jnp.dtype(args.dtype))
    jax.block_until_ready(params)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    print(f"load -> {args.dtype} params: {time.perf_counter() - t:.1f} s  "
          f"({nbytes / 2**20:.0f} MiB of params)")
    print(f"peak RSS: {_rss_mib():.0f} MiB  (params / peak: {nbytes / 2**20 / _rss_mib():.2f})")


if __name__ == "__main__":
    main()
