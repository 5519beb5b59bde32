"""Where the update's time goes: decoder-layer forward + backward, strata-jax vs transformers/torch.

    python -m benchmarks.layer_step                  # 0.5B layer shape, 2 layers, 4 x 832, fp32
    python -m benchmarks.layer_step --layers 4 --rows 8 --seq 512

The update benchmark (iteration.py) compares whole LoRA updates; this one isolates the decoder
layers, the part of the update that is neither the LM head nor the optimizer. Both frameworks
run the same random weights (the Qwen2.5-0.5B layer shape, --layers layers, a 1024-token
vocabulary so the embedding is negligible; written once as an HF checkpoint and read by both)
on the same token batch, and take the gradient of sum(hidden * g) with respect to the layer
weights (embedding frozen) in fp32; torch runs --threads threads (default: every core), XLA
every core. Variants, each timed as the median of --repeats runs after one warm-up:

  jax   query_chunk in --chunks (attention in blocks of that many queries, each
        rematerialised, keys cut at the block's causal end); remat none / full (per layer)
  torch attn_implementation sdpa (its fused CPU attention kernel) and eager (materialised
        scores, like XLA), gradient checkpointing off / on

and the attention alone (grouped-query, causal, the same q / k / v; gradient w.r.t. all three):
jax's (the model's attention function, per --chunks) against torch's scaled_dot_product_attention
and an eager torch attention, to separate the attention from the projections and the MLP.

Prints seconds and tokens/s per variant and the jax / torch ratios. Measures, never asserts.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _median_time(fn, repeats: int) -> tuple[float, float, float]:
    fn()   # warm-up (compiles / allocates)
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), min(ts), max(ts)


def jax_variants(args, ckpt: str, ids) -> dict[str, tuple[float, float, float]]:
    import jax
    import jax.numpy as jnp

    from strata_jax.models import forward, load_checkpoint
    config, params = load_checkpoint(ckpt)
    tokens = jnp.asarray(ids)
    b, t = ids.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = jnp.ones((b, t), bool)
    g = jax.random.normal(jax.random.PRNGKey(1), (b, t, config.hidden_size), jnp.float32)
    out = {}
    for chunk in sorted(set(args.chunks)):
        for remat in ("none", "full"):
            def loss(layers, chunk=chunk, remat=remat):
                p = {**params, "layers": layers}
                h, _ = forward(p, config, tokens, positions, mask, query_chunk=chunk, remat=remat)
                return jnp.sum(h * g)
            step = jax.jit(jax.grad(loss))
            out[f"jax query_chunk={chunk} remat={remat}"] = _median_time(
                lambda: jax.block_until_ready(step(params["layers"])), args.repeats)
    return out


def attention_variants(args, config) -> dict[str, tuple[float, float, float]]:
    """Attention alone, forward + backward, both frameworks, the same random q / k / v."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from strata_jax.models.attention import attention   # the model's own attention, not a copy
    b, t, h, kh, dh = args.rows, args.seq, config.num_heads, config.num_kv_heads, config.head_dim
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal(s, np.float32) for s in
               ((b, t, h, dh), (b, t, kh, dh), (b, t, kh, dh)))
    g = rng.standard_normal((b, t, h * dh), np.float32)
    allowed = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    jq, jk, jv, jg = map(jnp.asarray, (q, k, v, g))
    out = {}
    for chunk in sorted(set(args.chunks)):
        grad = jax.jit(jax.grad(lambda q, k, v, c=chunk: jnp.sum(
            attention(q, k, v, allowed, kh, c, first_slot=0) * jg), argnums=(0, 1, 2)))
        out[f"jax attention query_chunk={chunk}"] = _median_time(
            lambda: jax.block_until_ready(grad(jq, jk, jv)), args.repeats)
    tq, tk, tv = (torch.from_numpy(x).transpose(1, 2).requires_grad_() for x in (q, k, v))
    tg = torch.from_numpy(g)
    causal = torch.ones(t, t, dtype=torch.bool).tril()

    def step(eager: bool):
        if eager:
            kk, vv = (x.repeat_interleave(h // kh, 1) for x in (tk, tv))
            s = (tq @ kk.transpose(-1, -2)) * dh ** -0.5
            o = torch.softmax(s.masked_fill(~causal, float("-inf")), -1) @ vv
        else:
            o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True,
                                                                 enable_gqa=True)
        (o.transpose(1, 2).reshape(b, t, h * dh) * tg).sum().backward()
        tq.grad = tk.grad = tv.grad = None
    out["torch attention sdpa"] = _median_time(lambda: step(False), args.repeats)
    out["torch attention eager"] = _median_time(lambda: step(True), args.repeats)
    return out


def torch_variants(args, ckpt: str, ids) -> dict[str, tuple[float, float, float]]:
    import torch
    from transformers import AutoModelForCausalLM
    tokens = torch.from_numpy(ids).long()
    out = {}
    for impl in ("sdpa", "eager"):
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                     attn_implementation=impl)
        model.config.use_cache = False
        model.model.embed_tokens.weight.requires_grad_(False)
        g = torch.randn(*ids.shape, model.config.hidden_size,
                        generator=torch.Generator().manual_seed(1))
        for ckpt_on in (False, True):
            if ckpt_on:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()

            def step():
                h = model.model(input_ids=tokens, attention_mask=torch.ones_like(tokens)
                                ).last_hidden_state
                (h * g).sum().backward()
                model.zero_grad(set_to_none=True)
            out[f"torch {impl} checkpointing={'on' if ckpt_on else 'off'}"] = _median_time(
                step, args.repeats)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=832)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunks", type=int, nargs="+", default=[128, 512],
                    help="jax query_chunk values (queries per attention block)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                    help="torch's intra-op threads (XLA's CPU backend uses every core)")
    args = ap.parse_args()
    import numpy as np
    import torch

    from strata_jax.models import PRESETS, init_params
    from strata_jax.models.loading import export_params
    import jax
    config = dataclasses.replace(PRESETS["qwen2.5-0.5b"], num_layers=args.layers, vocab_size=1024)
    ckpt = tempfile.mkdtemp(prefix="layer_step_")
    export_params(init_params(config, jax.random.PRNGKey(0)), config, ckpt)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (args.rows, args.seq))
    tokens = args.rows * args.seq
    load = open("/proc/loadavg").read().split()[0]
    print(f"{args.layers} x Qwen2.5-0.5B layer, {args.rows} x {args.seq} tokens, fp32, "
          f"d(sum(hidden * g)) / d(layer weights); torch {args.threads} threads, "
          f"{os.cpu_count()} cores; load {load}")
    torch.set_num_threads(args.threads)
    res = {**jax_variants(args, ckpt, ids), **torch_variants(args, ckpt, ids),
           **attention_variants(args, config)}
    for name, (med, lo, hi) in res.items():
        print(f"{name:40s} {med:7.3f} s ({lo:.3f}..{hi:.3f})  {tokens / med:8.0f} tok/s")
    base = res["torch sdpa checkpointing=on"][0]
    for chunk in sorted(set(args.chunks)):
        name = f"jax query_chunk={chunk} remat=full"
        print(f"ratio {name} / torch sdpa checkpointing=on (tokens/s): {base / res[name][0]:.2f}x")
    print(f"ratio torch eager / sdpa, checkpointing on (tokens/s): "
          f"{base / res['torch eager checkpointing=on'][0]:.2f}x")
    for chunk in sorted(set(args.chunks)):
        name = f"jax attention query_chunk={chunk}"
        print(f"ratio {name} / torch attention sdpa (tokens/s): "
              f"{res['torch attention sdpa'][0] / res[name][0]:.2f}x")


if __name__ == "__main__":
    main()
