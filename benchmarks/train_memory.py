"""XLA's own memory analysis of one training step (no weights allocated, nothing run).

Usage:
    python -m benchmarks.train_memory                       # 0.5B shape, 16 x (768 + 64), LoRA + full
    python -m benchmarks.train_memory --model /path/to/hf_dir --rows 16 --prompt 768 --response 64
    python -m benchmarks.train_memory --modes lora --remat none full dots

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
        from strata_jax.models import loading
        if hasattr(loading, "gguf_config"):
            return loading.gguf_config(spec)
        raise SystemExit(f"{spec}: this checkout cannot read GGUF metadata; pass an HF dir")
    return Qwen2Config.from_pretrained(spec)


def analyse(model: Qwen2Config, mode: str, remat: str, args) -> dict:
    c = base.get_base_config()
    c.algo = args.algo
    if mode == "lora":
        c.lora.rank = args.rank
    rows = args.rows
    cfg = TrainConfig.from_config(c, mini_batch_size=rows, micro_batch_size=args.micro,
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b", help="HF dir, .gguf or PRESETS name")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--micro", type=int, default=16, help="micro_batch_size (rows per backward)")
    ap.add_argument("--prompt", type=int, default=768)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--rank", type=int, default=64, help="LoRA rank (all linear layers)")
    ap.add_argument("--algo", default="grpo")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--modes", nargs="+", default=["lora", "full"], choices=("lora", "full"))
    ap.add_argument("--remat", nargs="+", default=["full"], choices=("none", "full", "dots"))
    args = ap.parse_args()
    model = model_config(args.model)
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
