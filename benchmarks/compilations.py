"""Do the update's compilations plateau? Dumped real update batches, replayed as drifting
iterations, through `Trainer.update`: new XLA compilations per iteration, by program.

A real run's iterations differ in row count and in their longest prompts and responses, and
every new static shape compiles the update again (minutes per program for the 0.5B on CPU).
This replays the batches a run dumped (``log.dump_batches``: the sampler's own ids, e.g.
studies/memory_key/results/*/run_*/batches/*.npz) as --iterations iterations, each a
seeded random 50-100% of one batch's valid rows (so the row count and the widths drift as in a
run), on a small model with the batches' vocabulary (compilations depend on shapes, not on the
model's size; their seconds do), for each update path and response floor asked. Printed per
iteration: the new compilations, the expensive ones (the gradient step ``_micro_step`` and the
scoring pass ``_score_rows``, a forward and backward of the whole model each) apart. --marks
off clears the trainer's shape marks before every iteration (what the update did before it
kept them).

    python -m benchmarks.compilations --algo strata --micro 8 --mini 40 \\
        --batches studies/memory_key/results/keep25/run_strata_s0/batches/*.npz

Measures, never asserts (the plateau itself is a test: tests/training/test_train_packed.py).
"""
from __future__ import annotations

import argparse
import collections
import logging
import re

EXPENSIVE = ("jit(_micro_step)", "jit(_score_rows)", "jit(_train_minibatch)", "jit(_score_batch)")


class ProgramNames(logging.Handler):
    """Counts jax's "Compiling <program> ..." log records by program name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: collections.Counter = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        m = re.match(r"Compiling (\S+) with global shapes", record.getMessage())
        if m:
            self.names[m.group(1)] += 1


def drifting(batches, iterations: int, seed: int):
    """`iterations` sub-batches: a seeded 50-100% of the valid rows of the batches in turn,
    padded to a row bucket as the rollout pads them."""
    import jax
    import numpy as np

    from strata_jax.algos.batch import pad_batch
    from strata_jax.buckets import bucket_size
    rng = np.random.default_rng(seed)
    for it in range(iterations):
        b = batches[it % len(batches)]
        valid = np.flatnonzero(np.asarray(b.valid))
        keep = np.sort(rng.choice(valid, size=max(1, int(len(valid) * rng.uniform(0.5, 1.0))),
                                  replace=False))
        sub = jax.tree.map(lambda x: np.asarray(x)[keep], b)   # every field is [R, ...]
        yield pad_batch(sub, bucket_size(sub.num_rows, None, 8))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", nargs="+", required=True, help="dumped SampleBatch .npz files")
    ap.add_argument("--algo", default="strata", help="the run's algo (its estimator's fields)")
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--mini", type=int, default=40)
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--paths", nargs="+", default=["packed"], choices=["per_row", "packed"],
                    help="packed: the update; per_row: the tests' reference layout")
    ap.add_argument("--marks", nargs="+", default=["on"], choices=["on", "off"],
                    help="packed: keep the trainer's shape marks across iterations (on, as "
                    "train.py does) or start each iteration without them (off)")
    ap.add_argument("--floors", nargs="+", type=int, default=[32, 0],
                    help="train.response_floor values to compare")
    args = ap.parse_args()

    import jax
    import numpy as np

    import configs.base as base
    from strata_jax.algos.batch import load_sample_batch
    from strata_jax.models import Qwen2Config, init_params
    from strata_jax.training import TrainConfig, Trainer

    jax.config.update("jax_log_compiles", True)
    names = ProgramNames()
    lg = logging.getLogger("jax")
    lg.addHandler(names)
    lg.setLevel(logging.WARNING)
    lg.propagate = False          # the per-program records are counted, not printed
    batches = [load_sample_batch(f)[0] for f in args.batches]
    vocab = 1 + max(int(max(np.asarray(b.prompt_ids).max(), np.asarray(b.response_ids).max()))
                    for b in batches)
    model = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=1,
                        num_heads=2, num_kv_heads=1, head_dim=16)
    params = init_params(model, jax.random.PRNGKey(0))
    c = base.get_base_config()
    c.algo = args.algo
    c.lora.rank = 4
    settings = [(p, f, m) for p in args.paths for f in args.floors
                for m in (args.marks if p == "packed" else ["off"])]
    for path, floor, marks in settings:
        jax.clear_caches()   # each setting compiles from scratch (the counts are its own)
        # the config is a static argument of the model programs, so no setting reuses
        # another's gradient step or scoring pass (the batch gathers it may reuse are cheap)
        cfg = TrainConfig.from_config(c, mini_batch_size=args.mini,
                                      micro_batch_rows=args.micro, remat="none",
                                      compute_dtype="float32", donate_state=False,
                                      response_floor=floor)
        trainer = Trainer(model, cfg, per_row=path != "packed")
        state = trainer.init_state(params, jax.random.PRNGKey(1))
        print(f"{path}, response_floor {floor}, shape marks {marks}:")
        total = 0
        for it, batch in enumerate(drifting(batches, args.iterations, args.seed)):
            before = collections.Counter(names.names)
            if marks == "off":
                trainer.shape_marks.clear()
            state, _ = trainer.update(state, batch, params)
            new = names.names - before
            heavy = sum(v for k, v in new.items() if k in EXPENSIVE)
            if it:
                total += heavy
            print(f"  iteration {it:2d}: {int(np.asarray(batch.valid).sum()):3d} rows, "
                  f"{sum(new.values()):3d} new compilations ({heavy} of the gradient step "
                  f"or scoring pass)", flush=True)
        print(f"  after iteration 0: {total} gradient-step / scoring compilations")


if __name__ == "__main__":
    main()
