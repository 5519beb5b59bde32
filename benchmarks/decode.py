"""Decode throughput of the strata-jax sampler against transformers `generate`, with rooflines.

The sampler benchmark. A script that prints numbers; nothing here asserts a timing. Decode time is measured
directly: transformers timestamps every step's logits inside one `generate` call (prefill =
start to the first logits, decode = first to last); the JAX sampler runs its whole decode loop
as one program, so each repeat times a 1-token generate and the N-token one back to back
(decode = their difference). Medians over `--repeats` with the min..max spread are printed,
and "not measurable" where a decode time comes out <= 0 or noisier than itself.

CPU (default): the Qwen2.5-0.5B shape (random weights, fp32, tied), batch 1, 8 and 32, prompt
128, exactly 64 new tokens, greedy. A parent process writes one random HF checkpoint; every
(framework, batch) then runs in its own subprocess so peak RSS is per framework and batch.
Also measured in the same run:
- read bandwidth (a jitted sum over a 1 GiB array) and dense matmul rate (a jitted 2048^3
  matmul), in their own worker so the probe arrays stay out of the RSS numbers -> the
  bandwidth roofline (bytes read per decode step, weights + KV cache, / bandwidth) and the
  compute roofline (FLOPs per step / matmul rate);
- in the JAX worker, the "matmul ceiling": one jitted program doing exactly the decode step's
  matmuls (every layer's q, k, v, o, gate, up, down on [B, D] with the real weights, then the
  output layer), i.e. the step time with attention, norms, sampling and loop overhead free.

    python -m benchmarks.decode                       # CPU, jax + transformers, batch 1 8 32
    python -m benchmarks.decode --batch 8 --frameworks jax
    python -m benchmarks.decode --preset qwen2.5-1.5b --batch 64 --dtype bfloat16   # GPU
    python -m benchmarks.decode --batch 8 --frameworks jax --stop-text   # + stop-string check
    python -m benchmarks.decode --batch 8 32 --frameworks jax \
        --sampler-layout fuse_qkv,fuse_gate_up          # stored vs prepared sampler copy

``--sampler-layout SPEC`` also times the sampler's inference copy made by
``strata_jax.models.sampler_layout.prepare_sampler_params`` in the same worker, its repeats interleaved
with the stored [out, in] layout's (same load), and checks the greedy tokens are identical.
SPEC is a comma list of ``fuse_qkv``, ``fuse_gate_up`` and projection names stored
pre-transposed [in, out] (``SAMPLER_PROJECTIONS``, named after fusion, e.g. ``qkv_proj``,
``down_proj``, ``lm_head``).

``--stop-text`` turns on the rollout's action stop string (``</think>``, ``<action>``, ``</action>``,
the offline tokenizer's [32, V] table, one gather per row and step) so its cost can be read
off against a run without it; random weights never complete it, so every row still decodes
exactly --new-tokens tokens.

Other presets / dtypes (the GPU run) default to ``--frameworks jax``: the weights are drawn
with ``init_params`` in the worker instead of read from an HF checkpoint, and memory is
the device's peak bytes in use.

Imports: jax, flax (via strata_jax), numpy, and transformers + torch in the HF worker only.
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# --------------------------------------------------------------------------- HF checkpoint

def write_checkpoint(preset: str, path: str) -> None:
    """A random HF Qwen2ForCausalLM of the preset's shape, saved with save_pretrained."""
    import torch
    from transformers import Qwen2Config as HFConfig, Qwen2ForCausalLM
    from strata_jax.models import PRESETS
    cfg = PRESETS[preset]
    hf = HFConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                  intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                  rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
                  tie_word_embeddings=cfg.tie_word_embeddings,
                  max_position_embeddings=cfg.max_position_embeddings)
    torch.manual_seed(0)
    Qwen2ForCausalLM(hf).eval().save_pretrained(path)


def _prompts(batch: int, length: int, vocab: int):
    import numpy as np
    return np.random.default_rng(0).integers(1, vocab, (batch, length)).astype(np.int32)


# --------------------------------------------------------------------------- workers

def hf_worker(args) -> dict:
    import torch
    from transformers import GenerationConfig, LogitsProcessor, Qwen2ForCausalLM
    if os.path.isfile(args.ckpt):   # a GGUF file: transformers' own GGUF loading (dequantized)
        model = Qwen2ForCausalLM.from_pretrained(os.path.dirname(args.ckpt),
                                                 gguf_file=os.path.basename(args.ckpt),
                                                 dtype=torch.float32).eval()
    else:
        model = Qwen2ForCausalLM.from_pretrained(args.ckpt, dtype=torch.float32).eval()
    ids = torch.from_numpy(_prompts(args.batch, args.prompt_len, model.config.vocab_size)).long()

    class Stamps(LogitsProcessor):
        """Records the time of every step's logits: the first is the end of the prefill."""

        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    def run(n_new):
        gen = GenerationConfig(do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new,
                               eos_token_id=None, pad_token_id=0, repetition_penalty=1.0)
        stamps = Stamps()
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 generation_config=gen, logits_processor=[stamps])
        end = time.perf_counter()
        assert out.shape[1] == ids.shape[1] + n_new and len(stamps.times) == n_new
        # One call: prefill = start -> first logits; decode = first -> last logits (n_new - 1
        # forward steps), both measured directly, never by subtracting another run.
        return {"total": end - t, "prefill": stamps.times[0] - t,
                "decode": stamps.times[-1] - stamps.times[0]}

    run(2)  # warm-up
    runs = [run(args.new_tokens) for _ in range(args.repeats)]
    return {"runs": runs, "rss_mib": _rss_mib(), "threads": torch.get_num_threads()}


def _timeit(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def hardware_rates(jax, jnp, dtype, big_bytes: int) -> dict:
    """Measured read bandwidth (GB/s) and dense matmul rate (GFLOP/s) of the default device."""
    n = big_bytes // jnp.dtype(dtype).itemsize
    x = jnp.ones((n,), dtype)
    red = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    t = _timeit(lambda: red(x).block_until_ready(), 5)
    bw = n * jnp.dtype(dtype).itemsize / t / 1e9
    del x
    m = 2048 if jax.default_backend() == "cpu" else 8192
    a = jnp.ones((m, m), dtype)
    mm = jax.jit(lambda p, q: p @ q)
    t = _timeit(lambda: mm(a, a).block_until_ready(), 5)
    return {"bandwidth_gbs": bw, "matmul_gflops": 2 * m ** 3 / t / 1e9}


def matmul_ceiling(jax, jnp, params, config, batch: int, repeats: int) -> float:
    """Seconds for one decode step's matmuls alone, with the real weights."""
    from strata_jax.models.heads import logits_from_hidden

    def mm(x, w):  # x [B, in] @ w[out, in].T, the model's own einsum form
        return jnp.einsum("bd,fd->bf", x, w)

    @jax.jit
    def step(params, x):
        for layer in params["layers"]:
            q, k, v = mm(x, layer["q_proj"]), mm(x, layer["k_proj"]), mm(x, layer["v_proj"])
            # keep k and v alive without attention: a cheap reduction folded into the residual
            x = x + mm(q, layer["o_proj"]) + (jnp.sum(k) + jnp.sum(v)) * 1e-9
            x = x + mm(mm(x, layer["gate_proj"]) * mm(x, layer["up_proj"]), layer["down_proj"])
        return logits_from_hidden(params, config, x)

    x = jnp.ones((batch, config.hidden_size), params["embed"].dtype) * 0.01
    return _timeit(lambda: step(params, x).block_until_ready(), repeats)


def step_costs(config, batch: int, cache_len: int, param_bytes: int, itemsize: int) -> dict:
    """Bytes read and FLOPs of one decode step (weights once, plus the KV cache)."""
    d, f, l = config.hidden_size, config.intermediate_size, config.num_layers
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = d * q * 2 + d * kv * 2 + 3 * d * f
    matmul_params = l * per_layer + config.vocab_size * d
    kv_bytes = 2 * l * batch * cache_len * kv * itemsize
    flops = 2 * batch * matmul_params + 4 * batch * l * cache_len * q
    # Embedding lookup reads B rows only; a tied embedding is read once as the output layer.
    return {"bytes": param_bytes + kv_bytes, "flops": flops, "kv_bytes": kv_bytes}


def rates_worker(args) -> dict:
    """Hardware rates in their own process, so the 1 GiB probe array stays out of the RSS."""
    import jax
    import jax.numpy as jnp
    big = 1 << 30 if jax.default_backend() == "cpu" else 4 << 30
    return hardware_rates(jax, jnp, jnp.dtype(args.dtype), big)


def parse_layout(spec: str) -> dict:
    """``fuse_qkv,fuse_gate_up,down_proj,...`` -> prepare_sampler_params keyword arguments."""
    from strata_jax.models.sampler_layout import parse_sampler_layout
    try:
        return parse_sampler_layout(spec)
    except ValueError as e:
        raise SystemExit(f"--sampler-layout: {e}") from None


def jax_worker(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from strata_jax.models import PRESETS, Qwen2Config, init_params, load_params
    from strata_jax.sampling import Sampler, SamplingParams

    stop = None
    if args.stop_text:
        from strata_jax.models import load_tokenizer
        from strata_jax.rollout.episodes import action_stop_text
        stop = action_stop_text(load_tokenizer(None))
    from strata_jax.models.loading import checkpoint_config
    config = checkpoint_config(args.ckpt) if args.ckpt else PRESETS[args.preset]
    dtype = jnp.dtype(args.dtype)
    if args.ckpt:
        params = load_params(args.ckpt, config, dtype=dtype)
    else:
        params = init_params(config, jax.random.key(0), dtype=dtype)
    jax.block_until_ready(params)
    rss_loaded = _rss_mib()
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))

    sampler = Sampler(config, max_cache_len=args.prompt_len + args.new_tokens + 64,
                      length_floor=16, new_tokens_floor=1)
    prompts = _prompts(args.batch, args.prompt_len, config.vocab_size).tolist()
    keys = jax.random.split(jax.random.key(1), args.batch)
    sp_greedy = SamplingParams(greedy=not args.sample, temperature=1.0,
                               max_new_tokens=args.new_tokens)

    copies = {"stored": params}
    if args.sampler_layout:
        from strata_jax.models.sampler_layout import prepare_sampler_params
        copies["prepared"] = prepare_sampler_params(params, config,
                                                    **parse_layout(args.sampler_layout))
        jax.block_until_ready(copies["prepared"])
    tokens = {}

    def run(n_new, which="stored"):
        sp = SamplingParams(greedy=sp_greedy.greedy, max_new_tokens=n_new, stop_text=stop)
        t = time.perf_counter()
        out = sampler.generate(copies[which], prompts, sp, keys)
        assert out.lengths.min() == n_new
        tokens[which] = out.token_ids
        return time.perf_counter() - t

    t_c = time.perf_counter()
    run(1), run(args.new_tokens)  # compile both programs
    compile_s = time.perf_counter() - t_c
    same = None
    if "prepared" in copies:
        run(1, "prepared"), run(args.new_tokens, "prepared")
        same = float((tokens["prepared"] == tokens["stored"]).mean())
    # The decode loop is one jitted program (no host sync per token), so the prefill is timed
    # as a 1-token generate right before each N-token one: decode = t(N) - t(1) of the same
    # repeat (adjacent calls, same load), and it is only reported when that is measurable.
    # With --sampler-layout the two copies' repeats alternate, so both see the same load.
    all_runs: dict = {k: [] for k in copies}
    for _ in range(args.repeats):
        for which in copies:
            t1, tn = run(1, which), run(args.new_tokens, which)
            all_runs[which].append({"total": tn, "prefill": t1, "decode": tn - t1})
    runs = all_runs["stored"]
    extra = {}
    if "prepared" in copies:
        extra = {"runs_prepared": all_runs["prepared"], "layout_tokens_same": same,
                 "layout": args.sampler_layout}
        del copies["prepared"]
    ceiling = matmul_ceiling(jax, jnp, params, config, args.batch, args.repeats)
    mem = {"rss_mib": _rss_mib(), "rss_loaded_mib": rss_loaded}
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        mem["device_peak_mib"] = stats["peak_bytes_in_use"] / 2 ** 20
    # An untied embedding is only gathered (B rows), not streamed, in a decode step.
    read = param_bytes - (0 if config.tie_word_embeddings else
                          params["embed"].size * params["embed"].dtype.itemsize)
    costs = step_costs(config, args.batch, args.prompt_len + args.new_tokens, read,
                       dtype.itemsize)
    return {"runs": runs, **extra, "compile_s": compile_s, "matmul_step_s": ceiling,
            "param_bytes": param_bytes, **costs, **mem,
            "backend": jax.default_backend(), "devices": len(jax.devices())}


# --------------------------------------------------------------------------- parent

def _spawn(kind: str, args, batch: int, ckpt: str | None) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.decode", "--worker", kind, "--batch", str(batch),
           "--preset", args.preset, "--dtype", args.dtype, "--prompt-len", str(args.prompt_len),
           "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
    if ckpt:
        cmd += ["--ckpt", ckpt]
    if args.sample:
        cmd += ["--sample"]
    if args.stop_text:
        cmd += ["--stop-text"]
    if args.sampler_layout and kind == "jax":
        cmd += ["--sampler-layout", args.sampler_layout]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
    raise RuntimeError(f"{kind} worker failed at batch {batch}")


def summarize(runs: list[dict], batch: int, new: int) -> dict:
    """Medians over the repeats of total / prefill / decode seconds, decode tok/s with its
    spread (min..max over repeats) or None where the decode time is not measurable (a
    non-positive decode time in any repeat, or a spread wider than the median itself)."""
    import statistics
    med = {k: statistics.median(r[k] for r in runs) for k in ("total", "prefill", "decode")}
    dec = [r["decode"] for r in runs]
    out = {**med, "decode_tps": None, "spread": None,
           "total_tps": batch * new / med["total"]}
    ok = min(dec) > 0 and (len(dec) < 2 or max(dec) - min(dec) < med["decode"])
    if ok and new > 1:
        rates = sorted(batch * (new - 1) / d for d in dec)
        out["decode_tps"] = statistics.median(rates)
        out["spread"] = (rates[0], rates[-1])
    return out


def _fmt(s: dict, repeats: int) -> str:
    if s["decode_tps"] is None:
        return "decode not measurable (decode time <= 0 or noisier than itself: raise " \
               "--new-tokens / --repeats on a quieter box)"
    lo, hi = s["spread"]
    return f"decode {s['decode_tps']:7.1f} tok/s (median of {repeats}, {lo:.1f}..{hi:.1f})"


def report(batch: int, prompt_len: int, new: int, jx: dict | None, hf: dict | None,
           rates: dict, repeats: int) -> None:
    print(f"\n=== batch {batch}: prompt {prompt_len}, {new} new tokens ===")
    sh = summarize(hf["runs"], batch, new) if hf else None
    sj = summarize(jx["runs"], batch, new) if jx else None
    if hf:
        print(f"transformers: total {sh['total_tps']:7.1f} tok/s | {_fmt(sh, repeats)} | "
              f"prefill {sh['prefill']:.2f} s | peak RSS {hf['rss_mib']:.0f} MiB "
              f"({hf['threads']} torch threads)")
    if jx:
        mem = f"peak RSS {jx['rss_mib']:.0f} MiB ({jx['rss_loaded_mib']:.0f} after loading)"
        if "device_peak_mib" in jx:
            mem += f", device peak {jx['device_peak_mib']:.0f} MiB"
        print(f"strata-jax:   total {sj['total_tps']:7.1f} tok/s | {_fmt(sj, repeats)} | "
              f"prefill {sj['prefill']:.2f} s | {mem} | compile {jx['compile_s']:.1f} s")
        if hf:
            dec = (f"decode {sj['decode_tps'] / sh['decode_tps']:.2f}x"
                   if sj["decode_tps"] and sh["decode_tps"] else "decode not measurable")
            print(f"ratio jax / transformers (medians): {dec}, total "
                  f"{sh['total'] / sj['total']:.2f}x")
        if "runs_prepared" in jx:
            sp = summarize(jx["runs_prepared"], batch, new)
            print(f"strata-jax, sampler copy [{jx['layout']}] (repeats interleaved with the "
                  f"stored layout's): {_fmt(sp, repeats)} | greedy tokens identical to the "
                  f"stored layout's: {jx['layout_tokens_same']:.1%}")
            if sp["decode_tps"] and sj["decode_tps"]:
                p_step = sp["decode"] / (new - 1)
                roof = max(jx["bytes"] / (rates["bandwidth_gbs"] * 1e9),
                           jx["flops"] / (rates["matmul_gflops"] * 1e9))
                vs_hf = (f", {sp['decode_tps'] / sh['decode_tps']:.2f}x transformers"
                         if hf and sh["decode_tps"] else "")
                print(f"  prepared / stored decode: {sp['decode_tps'] / sj['decode_tps']:.2f}x"
                      f"{vs_hf}; step {p_step * 1e3:.1f} ms, roofline reached "
                      f"{roof / p_step:.0%}")
        if sj["decode_tps"] is None:
            return
        step = sj["decode"] / (new - 1)
        bw_step = jx["bytes"] / (rates["bandwidth_gbs"] * 1e9)
        fl_step = jx["flops"] / (rates["matmul_gflops"] * 1e9)
        roof = max(bw_step, fl_step)
        print(f"measured: read bandwidth {rates['bandwidth_gbs']:.1f} GB/s, matmul "
              f"{rates['matmul_gflops']:.0f} GFLOP/s ({jx['backend']}, {jx['devices']} device)")
        print(f"decode step {step * 1e3:.1f} ms; bandwidth roofline {bw_step * 1e3:.1f} ms "
              f"({jx['bytes'] / 1e9:.2f} GB/step incl. {jx['kv_bytes'] / 1e6:.0f} MB KV), "
              f"compute roofline {fl_step * 1e3:.1f} ms ({jx['flops'] / 1e9:.1f} GFLOP/step)")
        print(f"roofline max(bw, compute) -> {batch / roof:.1f} tok/s: reached "
              f"{roof / step:.0%}; matmul ceiling {jx['matmul_step_s'] * 1e3:.1f} ms -> "
              f"{batch / jx['matmul_step_s']:.1f} tok/s: reached "
              f"{jx['matmul_step_s'] / step:.0%}")
        if roof / step > 1.0:
            print("  (above 100% of the roofline: the measured rates were depressed by load "
                  "during the probe; compare same-run ratios only)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen2.5-0.5b")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3,
                   help="timed repeats per (framework, batch); medians and min..max printed")
    p.add_argument("--frameworks", default=None,
                   help="comma list of jax,transformers (default: both when torch is installed)")
    p.add_argument("--sample", action="store_true", help="temperature-1 sampling, not greedy")
    p.add_argument("--stop-text", action="store_true",
                   help="check the rollout's action stop string on device (its cost)")
    p.add_argument("--model", default=None,
                   help="a real HF checkpoint dir (fp32) for both frameworks instead of random "
                        "weights of --preset")
    p.add_argument("--sampler-layout", default=None,
                   help="also time the sampler copy prepare_sampler_params makes with this "
                        "layout (comma list: fuse_qkv, fuse_gate_up, projection names stored "
                        "[in, out]), interleaved with the stored layout in the same worker")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.worker:
        fn = {"jax": jax_worker, "transformers": hf_worker, "rates": rates_worker}[args.worker]
        args.batch = args.batch[0]
        print("RESULT " + json.dumps(fn(args)), flush=True)
        return

    if args.frameworks is None:
        # The transformers column is the CPU comparison (0.5B shape, fp32); other
        # settings (the GPU run) default to jax alone. The parent never imports jax, so a GPU
        # is left entirely to the worker.
        args.frameworks = "jax"
        if args.preset == "qwen2.5-0.5b" and args.dtype == "float32":
            try:
                import torch  # noqa: F401
                import transformers  # noqa: F401
                args.frameworks = "jax,transformers"
            except ImportError:
                pass
    frameworks = args.frameworks.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.model
        if ckpt:   # a fetch name (qwen2.5-coder-0.5b-instruct), a .gguf file or an HF dir
            from strata_jax.models.loading import resolve_checkpoint
            ckpt = resolve_checkpoint(ckpt)
            print(f"model: {ckpt}")
        elif "transformers" in frameworks:
            ckpt = os.path.join(tmp, "ckpt")
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c",
                            f"from benchmarks.decode import write_checkpoint; "
                            f"write_checkpoint({args.preset!r}, {ckpt!r})"], check=True, cwd=REPO)
            print(f"random {args.preset} checkpoint written in {time.perf_counter() - t:.0f} s")
        rates = _spawn("rates", args, args.batch[0], None) if "jax" in frameworks else {}
        for batch in args.batch:
            hf = _spawn("transformers", args, batch, ckpt) if "transformers" in frameworks else None
            jx = _spawn("jax", args, batch, ckpt) if "jax" in frameworks else None
            report(batch, args.prompt_len, args.new_tokens, jx, hf, rates, args.repeats)


if __name__ == "__main__":
    main()
