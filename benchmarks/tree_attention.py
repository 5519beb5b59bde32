"""One decoder layer's forward + backward on a prefix-tree packed row vs the per-row batch, and
the attention's share of it (the attention rule of docs/design.md §12.1).

    python -m benchmarks.tree_attention                 # 0.5B layer shape, micro 8 x (256 + 32)
    python -m benchmarks.tree_attention --repeats 5
    python -m benchmarks.tree_attention --batches benchmarks/results/prefix_tree/batches/sciworld_strata_iter0.npz --micro 4

The batch is `benchmarks/prefix_tree.py`'s StraTA-shaped one (same flags' defaults), or a
dumped update batch (--batches: a SampleBatch .npz, e.g. a real ScienceWorld one, trimmed as
the update trims it, `batching.trim_padding`), packed with a token budget of --micro x
(Tp + Tr) columns (--width: the packed row width instead, as train.pack_width); the widest
packed row is timed against --micro per-row rows of Tp + Tr columns, and per token (each
variant's seconds over the real tokens it holds). Variants, each the median of --repeats
runs after one warm-up, the runs taken round-robin over the variants (a change in the
machine's load hits all of them alike), one fp32 decoder layer of the Qwen2.5-0.5B shape
(gradient w.r.t. the layer input and weights of sum(out * g)):

  per-row      [micro, Tp + Tr], causal
  tree dense   [1, W], the tree rule over every key up to each query block's end
  tree sparse  [1, W], each query block over its own slots and its open ancestors only
               (the host key index, `prefix_tree.block_key_index`)

and the attention alone (the model's `attention`, gradient w.r.t. q, k, v) under each. Prints
seconds and the ratios within this run, with the load average. Measures, never asserts.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=128, help="query_chunk (queries per block)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="", help="a dumped update batch .npz instead of the "
                    "synthetic one")
    ap.add_argument("--width", type=int, default=0,
                    help="packed row width (default: --micro x (Tp + Tr))")
    ap.add_argument("--parts", default="layer,attention",
                    help="comma list of layer, attention")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.prefix_tree import strata_records
    from strata_jax.algos import make_sample_batch
    from strata_jax.algos.batch import load_sample_batch
    from strata_jax.training.batching import trim_padding
    from strata_jax.models import Qwen2Config, init_params
    from strata_jax.models.attention import TreeMask, attention
    from strata_jax.models.layers import decoder_layer, rope_cos_sin
    from strata_jax import buckets
    from strata_jax.training import prefix_tree

    cfg = Qwen2Config(vocab_size=1024, hidden_size=896, intermediate_size=4864, num_layers=1,
                      num_heads=14, num_kv_heads=2, head_dim=64, tie_word_embeddings=True)
    shape = argparse.Namespace(inst=56, goal=40, strategy=30, step=120, response=30, tasks=2,
                               strategies=2, episodes=2, steps=3)
    if args.batches:   # the update's own trimming: the batch's columns as the trainer sees them
        batch = trim_padding(load_sample_batch(args.batches)[0])
    else:
        batch = make_sample_batch(strata_records(shape, cfg.vocab_size), row_multiple=args.micro)
    pi, pm = np.asarray(batch.prompt_ids), np.asarray(batch.prompt_mask, bool)
    ri, rm = np.asarray(batch.response_ids), np.asarray(batch.response_mask, bool)
    real = np.asarray(batch.valid, bool)
    # the layer never reads the embedding: the vocabulary only has to hold the batch's ids
    top = int(max(pi.max(), ri.max()))
    cfg = dataclasses.replace(cfg, vocab_size=max(cfg.vocab_size, top + 1))
    tp, tr = pi.shape[1], ri.shape[1]
    width = args.width or args.micro * (tp + tr)
    lay = prefix_tree.pack_rows(pi[real], pm[real], ri[real], rm[real], max_width=width)
    p = int(np.argmax(lay.mask.sum(1)))
    w = lay.width
    print(f"packed rows {lay.tokens.shape[0]} x {w} (row {p}: {int(lay.mask[p].sum())} real "
          f"tokens); per-row {args.micro} x {tp + tr}; query_chunk {args.chunk}")
    has_index = hasattr(prefix_tree, "block_key_index")

    layer = init_params(cfg, jax.random.PRNGKey(0))["layers"][0]
    rng = np.random.default_rng(1)
    d, h, kh, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def inputs(b, t, positions, allowed):
        x = jnp.asarray(rng.standard_normal((b, t, d), np.float32))
        g = jnp.asarray(rng.standard_normal((b, t, d), np.float32))
        cos, sin = rope_cos_sin(jnp.asarray(positions), dh, cfg.rope_theta)
        return x, g, cos, sin, allowed

    cases = {}
    pos_row = np.broadcast_to(np.arange(tp + tr, dtype=np.int32), (args.micro, tp + tr))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((tp + tr, tp + tr), bool)),
                              (args.micro, tp + tr, tp + tr))
    cases["per-row"] = inputs(args.micro, tp + tr, pos_row, causal)
    valid, end = jnp.asarray(lay.mask[p:p + 1]), jnp.asarray(lay.key_end[p:p + 1])
    cases["tree dense"] = inputs(1, w, lay.positions[p:p + 1], TreeMask(valid=valid, end=end))
    if has_index:
        index = prefix_tree.block_key_index(lay.mask[p:p + 1], lay.key_end[p:p + 1],
                                            args.chunk)
        a = buckets.key_index_width(index.shape[2], args.chunk)   # as the update pads it
        print(f"key index {index.shape} (ancestor keys per block), padded to A = {a} as the "
              "update's micro-batches")
        index = np.pad(index, ((0, 0), (0, 0), (0, a - index.shape[2])), constant_values=-1)
        cases["tree sparse"] = inputs(1, w, lay.positions[p:p + 1],
                                      TreeMask(valid=valid, end=end, index=jnp.asarray(index),
                                               block=args.chunk))
    parts = args.parts.split(",")
    fns = {}
    for name, (x, g, cos, sin, allowed) in cases.items():
        if "layer" in parts:
            step = jax.jit(jax.grad(lambda x, ly, a, g=g, cos=cos, sin=sin: jnp.sum(
                decoder_layer(x, ly, cos, sin, a, cfg, args.chunk) * g), argnums=(0, 1)))
            fns[f"layer {name}"] = (lambda step=step, x=x, a=allowed:
                                    jax.block_until_ready(step(x, layer, a)))
        if "attention" in parts:
            b, t = x.shape[:2]
            q = jnp.asarray(rng.standard_normal((b, t, h, dh), np.float32))
            k = jnp.asarray(rng.standard_normal((b, t, kh, dh), np.float32))
            v = jnp.asarray(rng.standard_normal((b, t, kh, dh), np.float32))
            ga = jnp.asarray(rng.standard_normal((b, t, h * dh), np.float32))
            grad = jax.jit(jax.grad(lambda q, k, v, a, ga=ga: jnp.sum(
                attention(q, k, v, a, kh, args.chunk, first_slot=0) * ga), argnums=(0, 1, 2)))
            fns[f"attention {name}"] = (lambda grad=grad, q=q, k=k, v=v, a=allowed:
                                        jax.block_until_ready(grad(q, k, v, a)))
    for fn in fns.values():
        fn()   # warm-up: compiles
    # round-robin repeats, so a change in the machine's load hits every variant alike
    times = {key: [] for key in fns}
    for _ in range(args.repeats):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    res = {key: statistics.median(ts) for key, ts in times.items()}
    for key, sec in res.items():
        print(f"{key:24s} {sec:7.3f} s (median of {args.repeats}, min {min(times[key]):.3f})")
    print(f"load {os.getloadavg()[0]:.2f}")
    row_tokens = args.micro * float((pm[real].sum(1) + rm[real].sum(1)).mean())
    held = {"per-row": row_tokens, "tree dense": int(lay.mask[p].sum()),
            "tree sparse": int(lay.mask[p].sum())}
    for key, sec in res.items():
        name = key.split(" ", 1)[1]
        print(f"{key:24s} {1e3 * sec / held[name]:7.3f} ms per real token "
              f"({held[name]:.0f} real tokens: per-row = --micro rows of the batch's mean length)")
    for name in cases:
        if f"layer {name}" in res and f"attention {name}" in res:
            print(f"attention share of the layer, {name:12s}: "
                  f"{res[f'attention {name}'] / res[f'layer {name}']:.2f}")
    for a, b in (("tree dense", "per-row"), ("tree dense", "tree sparse"),
                 ("tree sparse", "per-row")):
        for part in parts:
            if f"{part} {a}" in res and f"{part} {b}" in res:
                print(f"{part}: {a} / {b} = {res[f'{part} {a}'] / res[f'{part} {b}']:.2f}")


if __name__ == "__main__":
    main()
