"""One RL iteration on a real model, split by part, side by side with a plain torch update.

Parts (each runs in its own subprocess so peak RSS is per part; results are cached as JSON in
--out, so a long run can be resumed or re-run part by part with --part):

  update      the trainer update on the tiny ScienceWorld batch shape (16 rows x (768 prompt +
              64 response) tokens, every token real, 4 GRPO groups of 4): strata-jax
              `Trainer.update` split into the reference pass (KL on), the forward + backward
              (`accumulate_grads`) and the optimizer (the rest of `train_minibatch`), and in
              the same run a plain transformers/torch step on the same model, the same token
              batch and the same dtype (fp32 master weights, bf16 autocast compute, per-layer
              gradient checkpointing like remat "full", logits only at the response positions,
              AdamW): update tokens/s of both and their ratio, peak RSS, and XLA compilations
              after warm-up. LoRA (all linear layers, rank --rank; torch: the same low-rank
              adapters hand-written, PEFT is not needed) and full fine-tuning (--modes).
  grouping    `Trainer.update` packed (the update's path: prefix tree, each micro-batch at its
              own shapes) and per-row (`Trainer(per_row=True)`, every row at the batch's
              width) in one process, on rows with the prompt / output lengths of a real run's
              trajectories (--lengths-from): update seconds of both, their token fill (real /
              computed tokens), compilations.
  iteration   one real iteration of `train.py` (ScienceWorld :tiny variant, the real model,
              --algos strata grpo): rollout wall time, sampler seconds, env wait, sampled
              tokens, update seconds and compilations read from the run's metrics.jsonl.

    python -m benchmarks.iteration --model /path/qwen05-hf                 # all parts
    python -m benchmarks.iteration --model /path/qwen05-hf --part update --modes lora
    python -m benchmarks.iteration --model /path/qwen05-hf --part iteration --algos grpo
    python -m benchmarks.iteration --model /path/qwen05-hf --part grouping --modes lora \
        --lengths-from runs/bench_iteration/run_strata_lora/trajectories.jsonl

--model is an HF checkpoint directory (or, where the checkout's loader reads GGUF, a .gguf
path). Nothing here asserts a timing; on a shared machine print the load (it is printed).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _load() -> str:
    return open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"


def _batch_arrays(args, vocab: int):
    """Token ids [R, Tp + Tr], advantages [R] of the shared update batch (seeded)."""
    import numpy as np
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, min(vocab, 100000), (args.rows, args.prompt + args.response))
    scores = np.tile([1.0, 0.0, 1.0, 0.0], args.rows // 4 + 1)[: args.rows]
    return ids.astype(np.int32), scores.astype(np.float32)


# --------------------------------------------------------------------------- jax worker

def jax_update_worker(args) -> dict:
    import jax
    import numpy as np

    import configs.base as base
    from strata_jax.algos import KIND_ACTION, make_sample_batch
    from strata_jax.metrics import CompileCounter
    from strata_jax.models import load_checkpoint
    from strata_jax.training import TrainConfig, Trainer
    from strata_jax.training.per_row import accumulate_grads, gather_rows, score_batch

    compiles = CompileCounter.install()
    # LoRA's base is frozen: --base-dtype bfloat16 stores it in the compute dtype (half the
    # bytes, no per-step cast); the adapters and their AdamW moments stay fp32.
    base_dtype = args.base_dtype if args.mode == "lora" else "float32"
    model, params = load_checkpoint(args.model, dtype=jax.numpy.dtype(base_dtype))
    jax.block_until_ready(params)
    rss_loaded = _rss_gb()
    ids, scores = _batch_arrays(args, model.vocab_size)
    recs = [dict(prompt_ids=ids[i, :args.prompt], response_ids=ids[i, args.prompt:],
                 task_id=i // 4, trajectory_id=i % 4, kind=KIND_ACTION, score=float(scores[i]),
                 step_reward=0.0) for i in range(args.rows)]
    batch = make_sample_batch(recs, row_multiple=args.micro)
    c = base.get_base_config()
    c.algo = "grpo"
    if args.mode == "lora":
        c.lora.rank = args.rank
    cfg = TrainConfig.from_config(c, mini_batch_size=64, micro_batch_rows=args.micro,
                                  remat=args.remat, compute_dtype=args.dtype,
                                  donate_state=True)
    trainer = Trainer(model, cfg)
    state = trainer.init_state(params, jax.random.PRNGKey(1))
    ref = params  # LoRA: the base (and the KL reference); full: the frozen initial policy
    tokens = args.rows * (args.prompt + args.response)

    def timed(fn):
        t = time.perf_counter()
        out = jax.block_until_ready(fn())
        return out, time.perf_counter() - t

    state, warm = timed(lambda: trainer.update(state, batch, ref_params=ref)[0])
    n_warm = compiles.count
    totals = []
    for _ in range(args.repeats):
        state, t = timed(lambda: trainer.update(state, batch, ref_params=ref)[0])
        totals.append(t)
    n_after_update = compiles.count
    # The parts, each jitted as the update runs it (compiled here once, then timed).
    placed = trainer.put_batch(batch)
    use_ref = bool(cfg.loss.kl_coef)
    score = lambda: score_batch(state.params, state.critic_params, ref, placed,  # noqa: E731
                                jax.random.PRNGKey(0), model=model, cfg=cfg, use_ref=use_ref,
                                chunk_rows=cfg.micro_batch_rows, use_old=False)
    scored, _ = timed(score)
    _, t_ref = timed(score)
    adv = jax.numpy.asarray(np.where(scores > 0.5, 1.0, -1.0).astype(np.float32))
    w = scored.valid.astype(jax.numpy.float32)
    idx = jax.numpy.arange(batch.num_rows)
    mb, a, ww, tt = gather_rows(scored, adv, w, adv, idx, scored.valid)
    grads = lambda: accumulate_grads(state.params, state.critic_params, mb, a, ww, tt,  # noqa
                                     ref if trainer.lora else None, model=model, cfg=cfg,
                                     on_policy=True)
    timed(grads)
    fb = [timed(grads)[1] for _ in range(args.repeats)]
    t_update, t_fb = statistics.median(totals), statistics.median(fb)
    # the rest of the update is the optimizer; when the separately timed parts add up to more,
    # its share is below the run-to-run noise: not a measurable figure (None)
    rest = t_update - t_fb - (t_ref if use_ref else 0.0)
    return {"tokens": tokens, "update_s": t_update, "update_runs": totals,
            "ref_pass_s": t_ref if use_ref else 0.0, "fwd_bwd_s": t_fb, "fwd_bwd_runs": fb,
            "optimizer_s": rest if rest > 0 else None,
            "warmup_s": warm, "compiles_warmup": n_warm,
            "compiles_after_warmup": n_after_update - n_warm,
            "rss_gb": _rss_gb(), "rss_loaded_gb": rss_loaded, "load": _load(),
            "base_dtype": base_dtype}


def row_lengths(path: str, rows: int) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of `rows` step rows of a run's trajectories.jsonl (the
    last iteration in it; the rows spread evenly over its sorted lengths, so the mix is kept)."""
    recs = [json.loads(x) for x in open(path)]
    last = max(r["step"] for r in recs)
    lens = sorted((s["prompt_tokens"], max(1, s["output_tokens"]))
                  for r in recs if r["step"] == last for s in r["steps"])
    if not lens:
        raise SystemExit(f"{path}: no step rows with prompt_tokens (a run from before they were "
                         f"recorded?)")
    if rows >= len(lens):
        return lens
    return [lens[int(i * len(lens) / rows)] for i in range(rows)]


def jax_grouping_worker(args) -> dict:
    """Trainer.update packed and per-row (the reference), same process, same batch: rows with
    the prompt / output lengths of a real run (`row_lengths`), random token ids (so no shared
    prefix: the packed path's gain here is the padding it does not compute)."""
    import jax
    import numpy as np

    import configs.base as base
    from strata_jax.algos import KIND_ACTION, make_sample_batch
    from strata_jax.metrics import CompileCounter
    from strata_jax.models import load_checkpoint
    from strata_jax.training import TrainConfig, Trainer

    from benchmarks._timing import time_updates

    compiles = CompileCounter.install()
    model, params = load_checkpoint(args.model, dtype=jax.numpy.dtype(args.base_dtype))
    lens = row_lengths(args.lengths_from, args.rows)
    rng = np.random.default_rng(0)
    recs = [dict(prompt_ids=rng.integers(1000, 100000, p), response_ids=rng.integers(1000, 100000, r),
                 task_id=i // 4, trajectory_id=i % 4, kind=KIND_ACTION,
                 score=float(i % 2), step_reward=0.0) for i, (p, r) in enumerate(lens)]
    batch = make_sample_batch(recs, row_multiple=args.micro)
    c = base.get_base_config()
    c.algo = "grpo"
    if args.mode == "lora":
        c.lora.rank = args.rank
    out = {"rows": len(lens), "lengths": lens, "real_tokens": int(sum(p + r for p, r in lens)),
           "width": [int(batch.prompt_ids.shape[1]), int(batch.response_ids.shape[1])],
           "load_start": _load()}
    for packed in (True, False):
        cfg = TrainConfig.from_config(c, mini_batch_size=64, micro_batch_rows=args.micro,
                                      remat=args.remat, compute_dtype=args.dtype,
                                      donate_state=True, scan_layers=args.scan_layers)
        trainer = Trainer(model, cfg, per_row=not packed)
        state = trainer.init_state(params, jax.random.PRNGKey(1))
        n_warm = []
        state, warm, runs, m = time_updates(trainer, state, batch, params, args.repeats,
                                            lambda: n_warm.append(compiles.count))
        n_warm = n_warm[0]
        out["packed" if packed else "per_row"] = {
            "update_s": statistics.median(runs), "runs": runs, "warmup_s": warm,
            "compiles_warmup": n_warm, "compiles_after_warmup": compiles.count - n_warm,
            "token_fill": m["perf/update_token_fill"], "load": _load()}
        del state, trainer
    out["rss_gb"] = _rss_gb()
    return out


def report_grouping(r: dict) -> None:
    print("\n=== update, packed / per-row (same process, same batch) ===")
    if "error" in r:
        print(r["error"])
        return
    print(f"{r['rows']} rows, {r['real_tokens']} real tokens, batch width "
          f"{r['width'][0]} + {r['width'][1]}; lengths {r['lengths']}")
    for name in ("packed", "per_row"):
        g = r[name]
        print(f"{name:9s}: update {g['update_s']:7.1f} s = {r['real_tokens'] / g['update_s']:5.0f} "
              f"real tok/s | token fill {g['token_fill']:.2f} | warm-up {g['warmup_s']:.0f} s "
              f"({g['compiles_warmup']} compiles so far), {g['compiles_after_warmup']} after | "
              f"load {g['load']}")
    print(f"speed-up of packing: {r['per_row']['update_s'] / r['packed']['update_s']:.2f}x; "
          f"peak RSS {r['rss_gb']:.2f} GB")


def _seconds(value: float | None) -> str:
    """A derived time for printing: "below the noise" when it could not be measured (None, or
    a cached result from before that rule stored it as 0.0)."""
    return f"{value:.2f} s" if value else "below the run-to-run noise"


# --------------------------------------------------------------------------- torch worker

def torch_update_worker(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.config.use_cache = False
    rss_loaded = _rss_gb()
    if args.remat != "none":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    if args.mode == "lora":
        for p in model.parameters():
            p.requires_grad_(False)
        add_torch_lora(torch, model, args.rank, alpha=64.0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-6, weight_decay=0.01)
    ids_np, scores = _batch_arrays(args, model.config.vocab_size)
    ids = torch.from_numpy(ids_np).long()
    adv = torch.from_numpy(scores * 2 - 1)
    tr = args.response
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")

    def fwd_bwd():
        with autocast:
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                        logits_to_keep=tr + 1)
        logits = out.logits[:, :-1].float()          # positions Tp-1 .. Tp+Tr-2 score Tr tokens
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, -tr:, None])[..., 0]
        # PPO at ratio 1: -A * exp(lp - lp.detach()) has the gradient of -A * lp.
        loss = -(adv[:, None] * torch.exp(lp - lp.detach())).mean()
        loss.backward()
        return loss

    def step():
        t0 = time.perf_counter()
        fwd_bwd()
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return t1 - t0, time.perf_counter() - t1

    step()  # warm-up (allocates the optimizer state)
    runs = [step() for _ in range(args.repeats)]
    fb = statistics.median(r[0] for r in runs)
    op = statistics.median(r[1] for r in runs)
    return {"tokens": args.rows * (args.prompt + args.response), "update_s": fb + op,
            "fwd_bwd_s": fb, "optimizer_s": op, "runs": runs, "rss_gb": _rss_gb(),
            "rss_loaded_gb": rss_loaded, "threads": torch.get_num_threads(), "load": _load()}


def add_torch_lora(torch, model, rank: int, alpha: float) -> None:
    """Wrap every q/k/v/o/gate/up/down Linear as base(x) + (alpha / rank) * (x A^T) B^T
    (A kaiming-uniform like PEFT, B = 0), the same adapters the strata-jax run trains."""
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    class LoraLinear(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base
            bound = 1.0 / base.in_features ** 0.5
            self.a = torch.nn.Parameter(torch.empty(rank, base.in_features).uniform_(-bound, bound))
            self.b = torch.nn.Parameter(torch.zeros(base.out_features, rank))
            self.scale = alpha / rank

        def forward(self, x):
            return self.base(x) + self.scale * ((x @ self.a.to(x.dtype).T) @ self.b.to(x.dtype).T)

    for module in list(model.modules()):
        for n in names:
            child = getattr(module, n, None)
            if isinstance(child, torch.nn.Linear):
                setattr(module, n, LoraLinear(child))


# --------------------------------------------------------------------------- iteration part

def iteration_worker(args) -> dict:
    """One train.py iteration (ScienceWorld :tiny, the real model); figures from metrics.jsonl."""
    import shutil
    workdir = os.path.join(args.out, f"run_{args.algo}_{args.mode}")
    shutil.rmtree(workdir, ignore_errors=True)
    variant = ",".join(["tiny", args.algo, f"workdir={workdir}", "iterations=1",
                        f"model.path={args.model}", "model.preset=", "model.tokenizer=",
                        "model.warm_start=", f"train.compute_dtype={args.dtype}",
                        f"model.remat={args.remat}",
                        f"rollout.sampler_dtype={args.sampler_dtype or args.dtype}",
                        f"lora.rank={args.rank if args.mode == 'lora' else 0}"])
    cmd = [sys.executable, os.path.join(REPO, "train.py"),
           f"--config={os.path.join(REPO, 'configs', 'sciworld.py')}:{variant}"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - t
    if proc.returncode:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise RuntimeError(f"train.py failed ({proc.returncode})")
    rows = [json.loads(x) for x in open(os.path.join(workdir, "metrics.jsonl"))]
    m = rows[-1]
    return {"wall_s": wall, "load": _load(), **{k: v for k, v in m.items()
            if k.startswith(("time/", "compile/", "perf/", "train/tokens", "rollout/steps"))}}


# --------------------------------------------------------------------------- parent

def _spawn(worker: str, args, **kw) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.iteration", "--worker", worker, "--model", args.model,
           "--out", args.out, "--rows", str(args.rows), "--prompt", str(args.prompt),
           "--response", str(args.response), "--rank", str(args.rank), "--dtype", args.dtype,
           "--remat", args.remat, "--micro", str(args.micro), "--repeats", str(args.repeats),
           "--base-dtype", args.base_dtype, f"--sampler-dtype={args.sampler_dtype}"]
    if args.lengths_from:
        cmd += ["--lengths-from", args.lengths_from]
    if args.scan_layers:
        cmd += ["--scan-layers"]
    for k, v in kw.items():
        cmd += [f"--{k}", str(v)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
    return {"error": f"{worker} worker failed (rc {proc.returncode})"}


def _cached(args, name: str, fn) -> dict:
    path = os.path.join(args.out, name + ".json")
    if os.path.exists(path) and not args.force:
        return json.load(open(path))
    r = fn()
    if "error" not in r:
        json.dump(r, open(path, "w"), indent=1)
    return r


def report_update(mode: str, jx: dict, th: dict) -> None:
    print(f"\n=== update, {mode} ===")
    for name, r in (("strata-jax", jx), ("torch", th)):
        if "error" in r:
            print(f"{name}: {r['error']}")
            continue
        tok = r["tokens"]
        extra = (f"ref pass {r['ref_pass_s']:.1f} s | compiles after warm-up "
                 f"{r['compiles_after_warmup']} (warm-up {r['warmup_s']:.0f} s)"
                 if name == "strata-jax" else f"{r['threads']} threads")
        print(f"{name:10s}: update {r['update_s']:7.1f} s = {tok / r['update_s']:6.0f} tok/s | "
              f"fwd+bwd {r['fwd_bwd_s']:6.1f} s ({tok / r['fwd_bwd_s']:.0f} tok/s) | optimizer "
              f"{_seconds(r['optimizer_s'])} | {extra} | peak RSS {r['rss_gb']:.2f} GB "
              f"({r['rss_loaded_gb']:.2f} after loading) | load {r['load']}")
    if "error" not in jx and "error" not in th:
        print(f"ratio strata-jax / torch tokens/s: update {th['update_s'] / jx['update_s']:.2f}x"
              f", fwd+bwd {th['fwd_bwd_s'] / jx['fwd_bwd_s']:.2f}x (strata-jax's update "
              f"includes its reference pass; torch has none)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF checkpoint dir (or .gguf where supported)")
    p.add_argument("--part", default="all", choices=("all", "update", "iteration", "grouping"))
    p.add_argument("--modes", nargs="+", default=["lora", "full"], choices=("lora", "full"))
    p.add_argument("--algos", nargs="+", default=["strata", "grpo"])
    p.add_argument("--frameworks", nargs="+", default=["jax", "torch"])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt", type=int, default=768)
    p.add_argument("--response", type=int, default=64)
    p.add_argument("--micro", type=int, default=16, help="micro_batch_rows of the jax update")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--remat", default="full", choices=("none", "full", "dots"))
    p.add_argument("--sampler-dtype", default="", choices=("", "float32", "bfloat16"),
                   help="the iteration part's rollout.sampler_dtype (default: --dtype); XLA's CPU "
                        "backend has no fast bf16 matmul (benchmarks/cpu_matmul.py)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--base-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="dtype of the frozen LoRA base in the strata-jax run (torch keeps fp32)")
    p.add_argument("--lengths-from", default="",
                   help="grouping part: a run's trajectories.jsonl whose step rows give the "
                        "prompt / output lengths (e.g. --part iteration's run_strata_lora/)")
    p.add_argument("--scan-layers", action="store_true",
                   help="grouping part: train.scan_layers (faster compiles, same math)")
    p.add_argument("--out", default="runs/bench_iteration")
    p.add_argument("--force", action="store_true", help="re-run parts cached in --out")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mode", default="lora", help=argparse.SUPPRESS)
    p.add_argument("--algo", default="grpo", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        fn = {"jax": jax_update_worker, "torch": torch_update_worker,
              "iteration": iteration_worker, "grouping": jax_grouping_worker}[args.worker]
        print("RESULT " + json.dumps(fn(args)), flush=True)
        return
    os.makedirs(args.out, exist_ok=True)
    print(f"model {args.model}; batch {args.rows} x ({args.prompt} + {args.response}); "
          f"compute {args.dtype}, remat {args.remat}, LoRA rank {args.rank}; "
          f"{os.cpu_count()} CPUs, load {_load()}", flush=True)
    if args.part in ("all", "update"):
        for mode in args.modes:
            res = {}
            for fw in args.frameworks:
                tag = f"_base-{args.base_dtype}" if fw == "jax" and mode == "lora" else ""
                res[fw] = _cached(args, f"update_{mode}_{fw}_{args.dtype}{tag}",
                                  lambda: _spawn(fw, args, mode=mode))
            report_update(mode, res.get("jax", {"error": "not run"}),
                          res.get("torch", {"error": "not run"}))
    if args.part == "grouping":
        if not args.lengths_from:
            raise SystemExit("--part grouping needs --lengths-from <run>/trajectories.jsonl")
        for mode in args.modes:
            # every setting that changes the measurement is in the cache name
            src = os.path.basename(os.path.dirname(os.path.abspath(args.lengths_from)))
            name = (f"grouping_{mode}_{args.dtype}_base-{args.base_dtype}_{src}_rows{args.rows}"
                    f"_micro{args.micro}_remat-{args.remat}{'_scan' if args.scan_layers else ''}")
            r = _cached(args, name, lambda: _spawn("grouping", args, mode=mode))
            report_grouping(r)
    if args.part in ("all", "iteration"):
        for algo in args.algos:
            for mode in args.modes:
                dtypes = f"{args.dtype}_sampler_{args.sampler_dtype or args.dtype}"
                r = _cached(args, f"iteration_{algo}_{mode}_{dtypes}",
                            lambda: _spawn("iteration", args, mode=mode, algo=algo))
                print(f"\n=== iteration {algo} {mode} ===\n" + json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
