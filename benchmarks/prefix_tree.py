"""The prefix-tree packed update (train.pack_prefixes) beside the per-row update
(train.group_by_length), on a StraTA-shaped batch with synthetic ids.

The batch: every row's prompt starts with one instruction block (--inst tokens); the rows of a
task share its goal (--goal); the rows of a strategy share its text (--strategy); the first
step of every episode of a strategy has the same observation, later steps their own (--step);
responses of --response tokens. So the tree has the levels instruction -> task -> strategy ->
step, as in a real StraTA batch (stored runs keep text, not ids: replaying real batches needs
a run that dumps its SampleBatch, which this script does not do).

Reported per batch: tokens the forward computes under each layout (per-row at the batch's
width; per-row length-grouped; packing without sharing, i.e. the rows' own tokens; only the
instruction block shared; the full tree), then `Trainer.update` wall time of the per-row and
the packed path in one process (warm-up, i.e. compilation, reported apart), XLA compilations
after warm-up, and peak RSS. Nothing here asserts a timing; on a shared machine the load is
printed with each result. On a tiny model attention and per-call overhead dominate, so fewer
tokens need not mean less time there: a packed row of width W computes ~W^2 / 2 score pairs,
masked ones between unrelated subtrees included; judge the packed path on a real model shape.

    python -m benchmarks.prefix_tree                          # tiny random model, quick
    python -m benchmarks.prefix_tree --shape 0.5b --lora 16   # the 0.5B shape, random weights
    python -m benchmarks.prefix_tree --model /path/qwen05-hf --lora 16 --repeats 2
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics


def strata_records(args, vocab: int) -> list[dict]:
    """SampleBatch records of a StraTA-shaped batch (module docstring), seeded."""
    import numpy as np

    from strata_jax.algos import KIND_ACTION
    rng = np.random.default_rng(0)
    tok = lambda n: rng.integers(3, vocab, n)  # noqa: E731
    inst = tok(args.inst)
    recs = []
    for t in range(args.tasks):
        goal = tok(args.goal)
        for s in range(args.strategies):
            strat = tok(args.strategy)
            first = tok(args.step)
            for e in range(args.episodes):
                for k in range(args.steps):
                    step = first if k == 0 else tok(args.step)
                    recs.append(dict(prompt_ids=np.concatenate([inst, goal, strat, step]),
                                     response_ids=tok(args.response), task_id=t,
                                     trajectory_id=s * args.episodes + e, kind=KIND_ACTION,
                                     score=float(rng.random() < 0.5), step_reward=0.0))
    return recs


def token_counts(batch, micro: int) -> dict:
    """Tokens computed by each layout of the whole batch (one mini-batch)."""
    import numpy as np

    from strata_jax.training.batching import length_grouped_micro_batches, row_widths
    from strata_jax.training.prefix_tree import pack_rows
    pi, pm = np.asarray(batch.prompt_ids), np.asarray(batch.prompt_mask)
    ri, rm = np.asarray(batch.response_ids), np.asarray(batch.response_mask)
    real = np.asarray(batch.valid)
    tp, tr = pi.shape[1], ri.shape[1]
    idx = np.arange(pi.shape[0])
    need_p, need_r = row_widths(pm, rm)
    grouped = length_grouped_micro_batches(idx, real, need_p, need_r, micro, tp, tr)
    width = micro * (tp + tr)
    lay = pack_rows(pi[real], pm[real], ri[real], rm[real], max_width=width)
    # only the instruction block shared: the token after the block made distinct per row,
    # so the tree stops there
    first = np.argmax(pm[real], axis=1)
    cut = pi[real].copy()
    common = _common_prefix(pi[real], pm[real])
    cut[np.arange(cut.shape[0]), np.minimum(first + common, tp - 1)] = \
        -1 - np.arange(cut.shape[0])
    inst = pack_rows(cut, pm[real], ri[real], rm[real], max_width=width)
    real_micro = -(-real.size // micro) * micro
    busy = np.pad(real, (0, real_micro - real.size)).reshape(-1, micro).any(1).sum()
    return {"per_row": int(busy) * micro * (tp + tr),   # the one-width scan's micro-batches
            "grouped": sum(micro * (wp + wr) for _, _, (wp, wr) in grouped),
            "packed_no_sharing": lay.num_row_tokens,
            "instruction_shared": inst.num_packed_tokens,
            "tree": lay.num_packed_tokens}


def _common_prefix(pi, pm) -> int:
    """Length of the prompt prefix every row shares."""
    seqs = [p[m] for p, m in zip(pi, pm)]
    n = min(len(s) for s in seqs)
    for i in range(n):
        if len({int(s[i]) for s in seqs}) > 1:
            return i
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="HF checkpoint dir; empty: random weights of "
                    "--shape")
    ap.add_argument("--shape", default="tiny", choices=["tiny", "0.5b"],
                    help="random-weight model shape without --model (0.5b: Qwen2.5-0.5B's)")
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    ap.add_argument("--inst", type=int, default=56)
    ap.add_argument("--goal", type=int, default=40)
    ap.add_argument("--strategy", type=int, default=30)
    ap.add_argument("--step", type=int, default=120)
    ap.add_argument("--response", type=int, default=30)
    ap.add_argument("--tasks", type=int, default=2)
    ap.add_argument("--strategies", type=int, default=2)
    ap.add_argument("--episodes", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--remat", default="full")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    import jax
    import numpy as np

    import configs.base as base
    from benchmarks._timing import time_updates
    from strata_jax.algos import make_sample_batch
    from strata_jax.metrics import CompileCounter
    from strata_jax.models import Qwen2Config, init_params, load_checkpoint
    from strata_jax.training import TrainConfig, Trainer

    compiles = CompileCounter.install()
    if args.model:
        model, params = load_checkpoint(args.model)
    elif args.shape == "0.5b":
        model = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                            num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                            tie_word_embeddings=True)
        params = init_params(model, jax.random.PRNGKey(0))
    else:
        model = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=16)
        params = init_params(model, jax.random.PRNGKey(0))
    batch = make_sample_batch(strata_records(args, model.vocab_size), row_multiple=args.micro)
    counts = token_counts(batch, args.micro)
    print(f"{int(np.asarray(batch.valid).sum())} rows, batch width "
          f"{batch.prompt_ids.shape[1]} + {batch.response_ids.shape[1]}")
    for k, v in counts.items():
        print(f"  tokens computed, {k:19s}: {v:7d}  ({counts['per_row'] / max(v, 1):.2f}x fewer "
              f"than per-row)")
    c = base.get_base_config()
    c.algo = "grpo"
    c.lora.rank = args.lora
    for packed in (False, True):
        cfg = TrainConfig.from_config(c, mini_batch_size=1024, micro_batch_size=args.micro,
                                      remat=args.remat, compute_dtype=args.dtype,
                                      donate_state=True, pack_prefixes=packed)
        trainer = Trainer(model, cfg)
        state = trainer.init_state(params, jax.random.PRNGKey(1))
        marks = []
        state, warm, runs, m = time_updates(trainer, state, batch, params, args.repeats,
                                            lambda: marks.append(compiles.count))
        name = "packed tree" if packed else "per-row (length-grouped)"
        print(f"{name:25s}: update {statistics.median(runs):7.2f} s (warm-up {warm:.1f} s), "
              f"{compiles.count - marks[0]} compilations after warm-up, token fill "
              f"{m['perf/update_token_fill']:.2f}, load {os.getloadavg()[0]:.1f}")
        del state, trainer
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GB")


if __name__ == "__main__":
    main()
