"""XLA's own memory analysis of one training step (no weights allocated, nothing run).

Usage:
    python -m benchmarks.train_memory                       # 0.5B shape, 16 x (768 + 64), LoRA + full
    python -m benchmarks.train_memory --model /path/to/hf_dir --rows 16 --prompt 768 --response 64
    python -m benchmarks.train_memory --modes lora --remat none full dots
    python -m benchmarks.train_memory --batches benchmarks/results/prefix_tree/batches/sciworld_strata_iter0.npz \
        --micro 4 --mini 64 --rank 16 --kl 0.01 --algo strata --dtype float32
    python -m benchmarks.train_memory --model <0.5B dir or .gguf> --batches <run>/batches/iter_0000.npz \
        --bounds "configs/builtin.py:<the run's variant>" --rank 16 --algo strata --dtype float32

With --batches (a dumped update batch, `load_sample_batch`) it compiles, on that batch's
shapes (with --bounds: padded to that config's `ShapeBounds`, as the training job pads it), what `Trainer.update` runs for each path: per-row, the scoring pass (`score_batch`)
and the optimizer step (`minibatch_step`); packed, the scoring pass and the gradient
accumulation (`score_rows`, `accumulate_micro`) once per distinct micro-batch shape of the
trainer's own plan of the batch (first mini-batch), and the AdamW step (`apply_step`). The
largest temporary of each path is where its peak RSS comes from.

Lowers and compiles the trainer's `minibatch_step` (one optimizer step: forward + backward
over the mini-batch's micro-batches, then AdamW) on abstract shapes
(``jax.ShapeDtypeStruct``: the params are never materialised) and prints ``compiled.memory_analysis()``: argument, output,
temporary (activations, gradients, merged weights ...) and generated-code bytes (outputs
"aliased" to donated arguments need no memory of their own: train.donate_state), and the
temporaries per sequence token of one micro-batch (MB / token). `--model` is an HF checkpoint
directory (only its config.json is read) or a `strata_jax.models.PRESETS` name. Figures are
the compiler's, so they do not depend on the machine's load; compile time is printed too.
"""
from __future__ import annotations

import argparse
import time


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import configs.base as base  # noqa: E402
from strata_jax.algos import KIND_ACTION, make_sample_batch  # noqa: E402
from strata_jax.models import PRESETS, Qwen2Config, init_params  # noqa: E402
from strata_jax.training import TrainConfig, Trainer  # noqa: E402
from strata_jax.training.per_row import minibatch_step  # noqa: E402


def model_config(spec: str) -> Qwen2Config:
    """A PRESETS name, or a directory with an HF config.json (a .gguf path: its metadata)."""
    if spec in PRESETS:
        return PRESETS[spec]
    if spec.endswith(".gguf"):
        from strata_jax.models.gguf import gguf_config
        return gguf_config(spec)
    return Qwen2Config.from_pretrained(spec)


def analyse(model: Qwen2Config, mode: str, remat: str, args) -> dict:
    c = base.get_base_config()
    c.algo = args.algo
    if mode == "lora":
        c.lora.rank = args.rank
    rows = args.rows
    cfg = TrainConfig.from_config(c, mini_batch_size=rows, micro_batch_rows=args.micro,
                                  remat=remat, compute_dtype=args.dtype)
    rng = np.random.default_rng(0)
    recs = [dict(prompt_ids=rng.integers(1, 1000, args.prompt),
                 response_ids=rng.integers(1, 1000, args.response), task_id=i // 4,
                 trajectory_id=i % 4, kind=KIND_ACTION, score=float(i % 2), step_reward=0.0)
            for i in range(rows)]
    batch = make_sample_batch(recs, row_multiple=args.micro)
    trainer = Trainer(model, cfg)
    params_like = jax.eval_shape(lambda k: init_params(model, k, jnp.float32),
                                 jax.random.PRNGKey(0))
    state = trainer.abstract_state(params_like)
    sd = lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)  # noqa: E731
    mb = jax.tree.map(sd, batch)
    vec = jax.ShapeDtypeStruct((batch.num_rows,), jnp.float32)
    basep = params_like if mode == "lora" else None
    t0 = time.perf_counter()
    # the step train.py runs: the state donated (train.donate_state, on in the configs), so the
    # new state reuses the old one's buffers ("aliased")
    compiled = minibatch_step(cfg).lower(state, mb, vec, vec, vec, basep, model=model,
                                         cfg=cfg).compile()
    secs = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    tokens = args.micro * (args.prompt + args.response)
    out = dict(arg=ma.argument_size_in_bytes, out=ma.output_size_in_bytes,
               temp=ma.temp_size_in_bytes, code=ma.generated_code_size_in_bytes,
               alias=ma.alias_size_in_bytes, compile_s=secs)
    out["mb_per_token"] = out["temp"] / tokens / 2**20
    return out


def _gb(b: float) -> float:
    return b / 2**30


def _sizes(compiled) -> dict:
    ma = compiled.memory_analysis()
    return dict(arg=ma.argument_size_in_bytes, out=ma.output_size_in_bytes,
                temp=ma.temp_size_in_bytes, alias=ma.alias_size_in_bytes)


def analyse_batch(model: Qwen2Config, args) -> list[dict]:
    """Compiled memory of each program `Trainer.update` runs on the dumped batch args.batches,
    per path (rows as the update sees them: `trim_padding`, then `pad_rows`). One dict per
    (path, program, shape): temp / arg / out bytes and the program's shape in words."""
    from strata_jax.algos.batch import load_sample_batch, pad_rows
    from strata_jax.training.batching import fit_to_bounds, minibatch_plan, trim_padding
    from strata_jax.training.per_row import gather_rows, score_batch
    from strata_jax.training.scoring import PackedInputs
    from strata_jax.training.steps import (accumulate_micro, apply_step, empty_carry,
                                           gather_chunk, gather_micro, metric_keys,
                                           minibatch_counts, score_rows)
    from strata_jax.training.batching import host_ids
    c = base.get_base_config()
    c.algo = args.algo
    c.lora.rank = args.rank
    c.loss.kl_coef = args.kl
    bounds = None
    if args.bounds:   # the training job's fixed update shapes (assemble.py builds the same)
        from strata_jax.jobs.cli import load_config
        from strata_jax.training.bounds import ShapeBounds
        run = load_config(args.bounds)
        bounds = ShapeBounds.from_config(run)
        # the bounds' mini-batch rows follow the run's optimizer settings: so must the plan's
        args.mini, args.micro = run.optim.mini_batch_size, run.optim.micro_batch_rows
        print(f"bounds {bounds}; mini {args.mini}, micro {args.micro} (the config's)", flush=True)
    cfg = TrainConfig.from_config(c, mini_batch_size=args.mini, micro_batch_rows=args.micro,
                                  remat=args.remat[0], compute_dtype=args.dtype,
                                  donate_state=True)
    trainer = Trainer(model, cfg, bounds=bounds)
    chunk = cfg.score_rows or cfg.micro_batch_rows
    batch = load_sample_batch(args.batches)[0]
    if bounds is None:
        batch = pad_rows(trim_padding(batch), chunk)
    else:
        batch = pad_rows(fit_to_bounds(batch, bounds, cfg.response_floor, chunk), chunk)
    sd = lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)  # noqa: E731
    params_like = jax.eval_shape(lambda k: init_params(model, k, jnp.float32),
                                 jax.random.PRNGKey(0))
    state = trainer.abstract_state(params_like)
    bsd = jax.tree.map(sd, batch)
    vec = jax.ShapeDtypeStruct((batch.num_rows,), jnp.float32)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    valid, kind = np.asarray(batch.valid, bool), np.asarray(batch.kind)
    on_policy = trainer.on_policy(batch)
    use_ref = bool(cfg.loss.kl_coef)
    static = dict(model=model, cfg=cfg, use_ref=use_ref, use_old=not on_policy)
    basep = params_like
    idx, real = minibatch_plan(valid, kind, cfg.mini_batch_size, cfg.micro_batch_rows,
                               np.random.default_rng(0))[0]
    tp, tr = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    out = []

    def add(path, program, shape, compiled):
        out.append(dict(path=path, program=program, shape=shape, **_sizes(compiled)))
        r = out[-1]
        print(f"{path:7s} {program:16s} {shape:44s} temp {_gb(r['temp']):6.2f} GB  args "
              f"{_gb(r['arg']):5.2f} GB  out {_gb(r['out']):5.2f} GB", flush=True)

    # per-row: the scoring pass over the whole batch, then one mini-batch step
    add("per_row", "score_batch", f"{batch.num_rows} rows x {tp}+{tr}, chunks of {chunk}",
        score_batch.lower(state.params, state.critic_params, basep, bsd, key,
                          chunk_rows=chunk, **static).compile())
    mb = jax.eval_shape(gather_rows, bsd, vec, vec, vec, idx, real)
    add("per_row", "minibatch_step", f"{idx.size} rows x {tp}+{tr}, micro {args.micro}",
        minibatch_step(cfg).lower(state, *mb, basep, model=model, cfg=cfg,
                                  on_policy=on_policy).compile())
    # packed: the trainer's own plans (scoring: every row; training: the first mini-batch)
    ids = host_ids(batch)
    # the accumulator's shapes (`zero_carry` builds it eagerly, on devices)
    carry = jax.eval_shape(lambda p, q: empty_carry(p, q, metric_keys(cfg)),
                           state.params, state.critic_params)
    seen = set()
    for program, rows_idx, rows_real, mark in (
            ("score_rows", np.arange(batch.num_rows), valid, "score"),
            ("accumulate_micro", idx, real, "train")):
        for pmb in trainer._plan(ids, rows_idx, rows_real, chunk if mark == "score"
                                 else cfg.micro_batch_rows, mark):
            shape = (f"P {pmb.tokens.shape[0]} x w {pmb.width}, m {pmb.idx.size}, wr "
                     f"{pmb.response_width}, A {pmb.key_index.shape[2]}, N "
                     f"{pmb.response_slot.size}")
            if (program, shape) in seen:
                continue
            seen.add((program, shape))
            packed = PackedInputs(*(sd(x) for x in (
                pmb.tokens, pmb.positions, pmb.mask, pmb.key_end, pmb.score_index,
                pmb.last_index, pmb.key_index, pmb.response_slot)), block=pmb.block)
            widths = (1, pmb.response_width)
            if program == "score_rows":
                rows = jax.eval_shape(lambda b, i, r: gather_chunk(b, i, r, widths=widths), bsd,
                                      pmb.idx, pmb.real)
                compiled = score_rows.lower(state.params, state.critic_params, basep, rows,
                                            key, packed, **static).compile()
            else:
                b, a, w, t = jax.eval_shape(
                    lambda *x: gather_micro(*x, widths=widths), bsd, vec, vec, vec, pmb.idx,
                    pmb.real)
                norms, n_values = jax.eval_shape(minibatch_counts, bsd, idx, real)
                compiled = accumulate_micro.lower(
                    carry, state.params, state.critic_params, b, a, w, t, norms, n_values,
                    basep, packed, model=model, cfg=cfg, on_policy=on_policy).compile()
            add("packed", program, shape, compiled)
    add("packed", "apply_step", "AdamW on the accumulated gradients",
        apply_step(cfg).lower(state, carry, cfg=cfg).compile())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b", help="HF dir, .gguf or PRESETS name")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--micro", type=int, default=16, help="micro_batch_rows (rows per backward)")
    ap.add_argument("--prompt", type=int, default=768)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--rank", type=int, default=64, help="LoRA rank (all linear layers)")
    ap.add_argument("--algo", default="grpo")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--modes", nargs="+", default=["lora", "full"], choices=("lora", "full"))
    ap.add_argument("--remat", nargs="+", default=["full"], choices=("none", "full", "dots"))
    ap.add_argument("--batches", default="", help="a dumped update batch (.npz): compile "
                    "what the update runs on it, per-row and packed")
    ap.add_argument("--mini", type=int, default=64, help="mini_batch_size (--batches)")
    ap.add_argument("--bounds", default="", metavar="CONFIG", help="an experiment config "
                    "(path[:variant], as train.py takes it): pad to its ShapeBounds as the "
                    "training job does, with its optim.mini_batch_size / micro_batch_rows "
                    "in place of --mini / --micro (--batches)")
    ap.add_argument("--kl", type=float, default=0.0, help="loss.kl_coef (--batches; != 0 adds "
                    "the reference pass)")
    args = ap.parse_args()
    model = model_config(args.model)
    if args.batches:
        print(f"model {args.model} ({model.num_params / 1e6:.0f} M params); batch "
              f"{args.batches}; micro {args.micro}, mini {args.mini}, LoRA rank {args.rank}, "
              f"remat {args.remat[0]}, compute {args.dtype}, kl {args.kl}", flush=True)
        analyse_batch(model, args)
        return
    print(f"model {args.model}: D={model.hidden_size} L={model.num_layers} "
          f"V={model.vocab_size} ({model.num_params / 1e6:.0f} M params); batch {args.rows} rows "
          f"x ({args.prompt} + {args.response}), micro {args.micro}, compute {args.dtype}, "
          f"LoRA rank {args.rank}", flush=True)
    gb = lambda b: b / 2**30  # noqa: E731
    for mode in args.modes:
        for remat in args.remat:
            r = analyse(model, mode, remat, args)
            print(f"{mode:4s} remat {remat:4s}: args {gb(r['arg']):6.2f} GB  out "
                  f"{gb(r['out']):6.2f} GB (aliased {gb(r['alias']):.2f})  temp "
                  f"{gb(r['temp']):6.2f} GB = {r['mb_per_token']:.3f} MB/token  "
                  f"(compile {r['compile_s']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
