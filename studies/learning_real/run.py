"""Does it learn with real weights? StraTA vs GRPO from the pretrained Qwen2.5-Coder-0.5B-Instruct.

    python -m studies.learning_real.run                       # CPU preset, in the background:
    nohup python -m studies.learning_real.run > runs/learning_real.log 2>&1 &
    python -m studies.learning_real.run --preset accelerator  # paper N=4, M=8 on one GPU / TPU
    python -m studies.learning_real.run --replot              # tables + plot from the saved runs

Every run is one ``train.py`` invocation on its own run folder (``--out/<env>/<algo>_s<seed>``)
with checkpoints after every iteration, so a stopped benchmark continues where each run was when
it is started again (train.py resumes from the folder; a finished run is read, not replayed).
Both methods start from the same fetched GGUF (zero-shot, no behaviour cloning), train LoRA
adapters (rank ``--rank`` on every linear layer: the frozen base doubles as the KL reference and
the update's memory stays at the adapters' size, docs/design.md §12) and see the same number of
episodes per iteration: StraTA N strategies x M episodes per task, GRPO a group of N*M episodes
per task (the ``matched`` variant).

(a) memory_key with the 3-digit vault code (chance 1e-3): the code is shown only in the first
    observation and the prompt keeps the last 2 steps, so only a strategy written at step 1 can
    carry it to the vault.
(b) ScienceWorld's shortest families (gold paths of 5-7 steps), dev split for nothing: the
    training rollouts' success and score are the curve (rollout i is played after i updates).

Presets (iterations, seeds, batch): ``cpu`` is what a 2-core box fits in about 90 minutes
(memory_key only, 4 episodes per iteration: a smoke curve, not a learning result);
``accelerator`` is the paper's N=4, M=8, sigma=2 on one H200-class device. The learning rate
(``--lr``, default 5e-5 with alpha/rank = 4) follows LoRA's usual ~10x the full fine-tuning rate
(RL recipes fine-tune 0.5-7B models fully at ~1e-6 to 1e-5). The
plot has success, score, invalid-step fraction and strategy-format failures per iteration,
mean line and min-max band over seeds. Writes ``--out/learning_real.json`` and ``.png``, with
each run's config fingerprint (`fingerprint`). Measures, never asserts.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SW_TASKS = ("find-non-living-thing", "lifespan-longest-lived", "lifespan-shortest-lived")

PRESETS = {
    # What one 2-core CPU box fits in ~90 minutes (measured 2026-12-01): memory_key only, one task
    # of N=2 x M=2 episodes per iteration, 3 iterations x 2 seeds x 2 methods. Why so small: the
    # LoRA update costs ~6 s per step row on the quiet box (XLA's CPU matmuls reach 100-150
    # GFLOP/s in fp32 and bf16 alike, benchmarks/cpu_matmul.py), and a 16-episode iteration of 8
    # steps (128 rows) ran over 30 minutes. ScienceWorld observations are longer still: no CPU curve.
    # remat: "dots" keeps every layer's matmul outputs (2.7 MB per token, train_memory.py), fine
    # for memory_key's short prompts; ScienceWorld's ~1k-token prompts under "dots" took a
    # StraTA run to 17.4 GB (OOM-killed beside another job), so its runs keep only the layer
    # inputs ("full", 0.47 MB per token; the same values, one more forward per layer).
    "cpu": dict(iterations=3, seeds=2, sw_iterations=2, sw_seeds=0, tasks=1, n=2, m=2, sigma=2,
                max_steps=6, action_tokens=48, strategy_tokens=96, judge_tokens=24,
                prompt_tokens=1024, micro=4, dtype="float32", remat="dots", sw_remat="full"),
    # The paper's group sizes (N=4, M=8, sigma=2; GRPO groups of 32), 4 tasks per iteration.
    "accelerator": dict(iterations=10, seeds=2, sw_iterations=10, sw_seeds=1, tasks=4, n=4, m=8,
                        sigma=2, max_steps=8, action_tokens=256, strategy_tokens=256,
                        judge_tokens=64, prompt_tokens=2048, micro=16, dtype="bfloat16",
                        remat="full", sw_remat="full"),
}


def run_variant(args, p: dict, env: str, algo: str, seed: int) -> tuple[str, str]:
    """(config file, variant string) of one run."""
    workdir = os.path.join(args.out, env, f"{algo}_s{seed}")
    toks = ["tiny", "real", algo] + [
        f"workdir={workdir}", f"seed={seed}", f"model.path={args.model}",
        f"lora.rank={args.rank}", f"lora.lr={args.lr}", f"optim.lr={args.lr}",
        f"iterations={p['iterations'] if env == 'memory_key' else p['sw_iterations']}",
        f"rollout.tasks_per_batch={p['tasks']}", f"rollout.num_strategies={p['n']}",
        f"rollout.episodes_per_strategy={p['m']}", f"rollout.oversample={p['sigma']}",
        f"rollout.max_action_tokens={p['action_tokens']}",
        f"rollout.max_strategy_tokens={p['strategy_tokens']}",
        f"rollout.max_judge_tokens={p['judge_tokens']}",
        f"env.max_prompt_tokens={p['prompt_tokens']}", f"optim.micro_batch_rows={p['micro']}",
        f"train.compute_dtype={p['dtype']}", f"rollout.sampler_dtype={p['dtype']}",
        f"model.remat={p['remat'] if env == 'memory_key' else p['sw_remat']}",
        "ckpt.every=1", "eval.every=0"]
    if env == "memory_key":
        # corridor of 3-5 rooms + the code: 4-6 steps when played without a detour
        toks += ["env.code_digits=3", f"env.max_steps={p['max_steps']}"]
        cfg = "builtin.py"
    else:
        toks += ["env.tasks=" + "+".join(SW_TASKS), "env.max_steps=10"]
        cfg = "sciworld.py"
    # matched after N and M are set: the baseline's group = N*M episodes per task
    toks += ["matched"] if algo != "strata" else []
    return os.path.join(REPO, "configs", cfg), ",".join(toks + list(args.set))


def fingerprint(workdir: str) -> str:
    """sha256 (16 hex digits) of the config stored with the run's newest checkpoint, without the
    fields a resume may change (workdir, iterations, ckpt.*, ...): runs of one setting share it
    however long they ran. "" when the run has no checkpoint."""
    from strata_jax.validation import run_identity, stored_config
    stored = stored_config(os.path.join(workdir, "ckpt"))
    if not stored:
        return ""
    kept = run_identity(stored)
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def curves(workdir: str) -> dict:
    """Per-iteration figures from a run's metrics.jsonl (the rollout of iteration i)."""
    from strata_jax.metrics import read_jsonl
    rows = [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))
            if "rollout/success_rate" in r]
    get = lambda k: [float(r.get(k) or 0.0) for r in rows]  # noqa: E731
    fp = fingerprint(workdir)
    return dict(success=get("rollout/success_rate"), mean_return=get("rollout/mean_return"),
                invalid_step_frac=get("rollout/invalid_step_frac"),
                strategy_format_fail=get("rollout/strategy_format_fail_frac"),
                episodes=get("rollout/episodes"), iter_s=get("time/iteration_s"),
                iterations=len(rows), fingerprint=fp)


def rl_run(args, p: dict, env: str, algo: str, seed: int) -> dict:
    cfg, variant = run_variant(args, p, env, algo, seed)
    workdir = os.path.join(args.out, env, f"{algo}_s{seed}")
    os.makedirs(workdir, exist_ok=True)
    t0 = time.time()
    log = open(os.path.join(args.out, f"{env}_{algo}_s{seed}.log"), "a")
    print(f"[{env}] {algo} seed {seed}: train.py --config={os.path.basename(cfg)}:{variant}",
          flush=True)
    rc = subprocess.run([sys.executable, os.path.join(REPO, "train.py"), f"--config={cfg}:{variant}"],
                        cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.time() - t0   # this invocation only (a resumed run played part of it earlier)
    cur = curves(workdir)
    # wall_s: the run's RL time over all its invocations, from its own per-iteration timings
    r = dict(env=env, algo=algo, seed=seed, rc=rc, wall_s=sum(cur["iter_s"]),
             invocation_s=wall, **cur)
    print(f"[{env}] {algo} seed {seed}: rc {rc}, {r['iterations']} iterations, {wall:.0f} s; "
          f"success {['%.2f' % s for s in r['success']]}", flush=True)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="cpu", choices=tuple(PRESETS))
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--iterations", type=int, default=0, help="override the preset's")
    ap.add_argument("--seeds", type=int, default=0, help="override the preset's (memory_key)")
    ap.add_argument("--sw-seeds", type=int, default=-1, help="override the preset's (0 = skip)")
    ap.add_argument("--envs", default="memory_key,sciworld")
    ap.add_argument("--algos", default="strata,grpo")
    ap.add_argument("--set", nargs="*", default=[], help="extra key=value overrides, every run")
    ap.add_argument("--out", default="runs/learning_real")
    ap.add_argument("--replot", action="store_true")
    args = ap.parse_args()
    p = dict(PRESETS[args.preset])
    if args.iterations:
        p["iterations"] = p["sw_iterations"] = args.iterations
    if args.seeds:
        p["seeds"] = args.seeds
    if args.sw_seeds >= 0:
        p["sw_seeds"] = args.sw_seeds
    os.makedirs(args.out, exist_ok=True)
    from studies.learning.run import plot, summarise
    runs = []
    for env in [e for e in args.envs.split(",") if e]:
        seeds = p["seeds"] if env == "memory_key" else p["sw_seeds"]
        for seed in range(seeds):
            for algo in [a for a in args.algos.split(",") if a]:
                if args.replot:
                    workdir = os.path.join(args.out, env, f"{algo}_s{seed}")
                    if os.path.exists(os.path.join(workdir, "metrics.jsonl")):
                        cur = curves(workdir)
                        runs.append(dict(env=env, algo=algo, seed=seed,
                                         wall_s=sum(cur["iter_s"]), **cur))
                    continue
                runs.append(rl_run(args, p, env, algo, seed))
                json.dump(dict(args=vars(args), preset=p, runs=runs),
                          open(os.path.join(args.out, "learning_real.json"), "w"), indent=1)
    done = [r for r in runs if r["iterations"]]
    results = {e: summarise(done, e) for e in ("memory_key", "sciworld")
               if any(r["env"] == e for r in done)}
    if results:
        plot(results, os.path.join(args.out, "learning_real.png"), {"memory_key": 1e-3})
    return 0


if __name__ == "__main__":
    sys.exit(main())
