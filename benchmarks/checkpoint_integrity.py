"""Cost of the checkpoint checksum manifest on a Qwen2.5-0.5B-shape train state.

The state is what the trainer checkpoints for full fine-tuning: fp32 params plus AdamW's two
fp32 moments (3 x 494M values, ~5.9 GB) and a step / PRNG key. Times: one Checkpointer.save
(orbax write + the sha256 manifest), the manifest alone (`write_manifest`, re-hashing the written
files), verification alone (`verify_step`), and one Checkpointer.restore (verification + orbax
read). Prints numbers, asserts nothing; the page cache makes the hashing passes read from memory
when the files were just written (a restore after a reboot also pays the disk read, which orbax
pays anyway).

Usage: python -m benchmarks.checkpoint_integrity [--preset qwen2.5-0.5b] [--dir /tmp/ckpt_bench]
       [--no-opt]   (params only, 1/3 of the bytes)
"""
from __future__ import annotations

import argparse
import os
import shutil
import time


import jax  # noqa: E402
import numpy as np  # noqa: E402

from strata_jax.models import PRESETS, init_params  # noqa: E402
from strata_jax.training import Checkpointer  # noqa: E402
from strata_jax.training.checkpoint import verify_step, write_manifest  # noqa: E402
from strata_jax.training.state import TrainState  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--dir", default="/tmp/ckpt_integrity_bench")
    ap.add_argument("--no-opt", action="store_true")
    args = ap.parse_args()
    cfg = PRESETS[args.preset]
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0), np.float32))
    rng = np.random.default_rng(0)
    # Random bytes (not zeros) so no layer of the store can shortcut them.
    fill = lambda s: rng.standard_normal(s.shape, np.float32)  # noqa: E731
    params = jax.tree.map(fill, shapes)
    # The moments reuse the params' arrays (same bytes to write and hash, 1/3 of the memory:
    # a 2-core CI box has no 12 GB to spare for the state and orbax's copies).
    opt = {} if args.no_opt else {"mu": params, "nu": jax.tree.map(lambda x: x, params)}
    state = TrainState(params=params, opt_state=opt, critic_params={}, critic_opt_state={},
                       step=np.asarray(1, np.int32), rng=np.zeros(2, np.uint32))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    shutil.rmtree(args.dir, ignore_errors=True)
    ckpt = Checkpointer(args.dir, keep=1)
    t = time.perf_counter()
    ckpt.save(state)
    t_save = time.perf_counter() - t
    step_dir = os.path.join(args.dir, "1")
    t = time.perf_counter()
    write_manifest(step_dir)
    t_manifest = time.perf_counter() - t
    t = time.perf_counter()
    verify_step(step_dir)
    t_verify = time.perf_counter() - t
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    t = time.perf_counter()
    ckpt.restore(abstract)
    t_restore = time.perf_counter() - t
    ckpt.close()
    on_disk = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(step_dir) for f in fs)
    gb = on_disk / 1e9
    print(f"{args.preset} state{' (params only)' if args.no_opt else ' (params + AdamW mu, nu)'}: "
          f"{nbytes / 1e9:.2f} GB in memory, {gb:.2f} GB on disk, {os.cpu_count()} CPUs")
    print(f"save (orbax + manifest) {t_save:6.2f} s | manifest alone {t_manifest:6.2f} s "
          f"({gb / t_manifest:.2f} GB/s, {100 * t_manifest / t_save:.0f}% of the save)")
    print(f"restore (verify + orbax) {t_restore:6.2f} s | verify alone {t_verify:6.2f} s "
          f"({gb / t_verify:.2f} GB/s, {100 * t_verify / t_restore:.0f}% of the restore)")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
