"""The prefix-tree packed update (the update's path) beside the per-row reference
(`Trainer(per_row=True)`), on a StraTA-shaped batch with synthetic ids.

The batch: every row's prompt starts with one instruction block (--inst tokens); the rows of a
task share its goal (--goal); the rows of a strategy share its text (--strategy); the first
step of every episode of a strategy has the same observation, later steps their own (--step);
responses of --response tokens. So the tree has the levels instruction -> task -> strategy ->
step, as in a real StraTA batch. Or, with --batches, real update batches a run dumped
(``log.dump_batches``: the sampler's own ids, e.g. the 0.5B's StraTA memory_key batches under
studies/memory_key/results/*/run_*/batches/), replayed with the run's training settings
(--micro, --mini, --lora, --algo). Each path runs in its own child process (one after
another), so the peak RSS printed is that path's own; --in-process runs them in one.

Reported per batch: tokens the forward computes under each layout (per-row at the batch's
width; per-row length-grouped, an earlier path; packing without sharing, i.e. the rows' own
tokens; only the instruction block shared; the full tree: the factors apart), then per path
`Trainer.update` wall time (warm-up, i.e. compilation, reported apart) with its ratio to every
other path, XLA compilations after warm-up, peak RSS (the process's, warm-up and its
compilation included) and the peak of the timed updates alone (Linux: the peak is reset after
the warm-up, `reset_peak_rss`: what a run holds once its programs are compiled or loaded from
the compilation cache); with ``--paths torch`` also
transformers/torch's per-row update of the same rows with the same LoRA (`torch_update`), the
user's alternative. --out keeps the figures as JSON. Nothing here asserts a timing; the load is
printed with each result. On a tiny model attention and per-call overhead dominate, so fewer
tokens need not mean less time there; judge the packed path on a real model shape.

    python -m benchmarks.prefix_tree                          # tiny random model, quick
    python -m benchmarks.prefix_tree --shape 0.5b --lora 16   # the 0.5B shape, random weights
    python -m benchmarks.prefix_tree --model /path/qwen05-hf --lora 16 --repeats 2
    python -m benchmarks.prefix_tree --shape 0.5b --repeats 0   # warm-up only: its peak RSS
    python -m benchmarks.prefix_tree --rss-trace   # where the resident peak falls (compile / run)
    python -m benchmarks.prefix_tree --model qwen2.5-coder-0.5b-instruct --lora 16 --remat dots \
        --algo strata --micro 8 --mini 40 --paths per_row packed torch \
        --batches studies/memory_key/results/keep25/run_strata_s0/batches/iter_0000.npz
    python -m benchmarks.prefix_tree --shape 1.5b --lora 16 --rows 16 --batches ...  # 1.5B shape
"""
from __future__ import annotations

import argparse
import contextlib
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


def token_counts(batch, micro: int, response_floor: int) -> dict:
    """Tokens computed by each layout of the whole batch (one mini-batch), after the update's
    own `trim_padding` with `response_floor` (`train.response_floor`)."""
    import numpy as np

    from strata_jax.training.batching import row_widths, trim_padding
    from strata_jax.training.prefix_tree import pack_rows
    batch = trim_padding(batch, response_floor)
    pi, pm = np.asarray(batch.prompt_ids), np.asarray(batch.prompt_mask)
    ri, rm = np.asarray(batch.response_ids), np.asarray(batch.response_mask)
    real = np.asarray(batch.valid)
    tp, tr = pi.shape[1], ri.shape[1]
    idx = np.arange(pi.shape[0])
    need_p, need_r = row_widths(pm, rm)
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
            "grouped": _length_grouped_tokens(idx[real], need_p, need_r, micro, tp, tr,
                                              response_floor),
            "packed_no_sharing": lay.num_row_tokens,
            "instruction_shared": inst.num_packed_tokens,
            "tree": lay.num_packed_tokens}


def _length_grouped_tokens(rows, need_p, need_r, micro: int, tp: int, tr: int,
                           response_floor: int) -> int:
    """Tokens of the length-grouped layout (an earlier update path, HF's group_by_length per
    micro-batch): the rows sorted longest first, `micro` per micro-batch, each at the prompt
    columns of its longest row (two buckets per octave, multiples of 8) and the response
    columns `response_columns`, capped at the batch's (tp, tr)."""
    import numpy as np

    from strata_jax.buckets import bucket_size, response_columns
    order = rows[np.argsort(-(need_p[rows] + need_r[rows]), kind="stable")]
    total = 0
    for s in range(0, order.size, micro):
        i = order[s:s + micro]
        wp = min(tp, bucket_size(max(int(need_p[i].max()), 1), None, 8))
        wr = min(tr, response_columns(int(need_r[i].max()), response_floor))
        total += micro * (wp + wr)
    return total


def torch_rows(batch) -> tuple[list, list]:
    """The batch's valid rows as (prompt ++ response real ids [n] int64, response length) lists:
    what a torch user feeds the model."""
    import numpy as np
    pi, pm = np.asarray(batch.prompt_ids), np.asarray(batch.prompt_mask, bool)
    ri, rm = np.asarray(batch.response_ids), np.asarray(batch.response_mask, bool)
    rows = np.flatnonzero(np.asarray(batch.valid))
    return ([np.concatenate([pi[r][pm[r]], ri[r][rm[r]]]).astype(np.int64) for r in rows],
            [int(rm[r].sum()) for r in rows])


def reset_peak_rss() -> None:
    """Lower this process's peak resident set (Linux VmHWM) to its current one
    (/proc/self/clear_refs "5"), so `peak_rss_gb` then reads the peak of what runs after,
    e.g. the timed updates without the warm-up's compilation. A no-op elsewhere."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_gb() -> float:
    """This process's peak resident set since it started or since `reset_peak_rss`, GiB
    (`strata_jax.metrics.memory_metrics`' host peak: VmHWM, or ru_maxrss where /proc is
    missing, which never resets)."""
    from strata_jax.metrics import memory_metrics
    return memory_metrics(devices=[])["mem/host_peak_rss_gb"]


def torch_update(model, params, batch, args, after_warmup=None
                 ) -> tuple[float, list[float], int]:
    """The user's alternative: a transformers/torch per-row update of the same rows with the
    same LoRA (rank --lora on every projection, `benchmarks.iteration.add_torch_lora`; full
    fine-tuning with --lora 0), the same weights (exported from `params` as an HF checkpoint).

    Rows sorted by length go --micro at a time, each micro-batch left-padded to its own longest
    row (torch needs no static shapes, so this is its best per-row layout), logits only for the
    response positions (`logits_to_keep`); gradients accumulate over a mini-batch of --mini
    rows, then one AdamW step. Per-layer gradient checkpointing when --remat is not "none"
    (torch has no "dots" policy). Forward and backward of the policy only: no scoring pass
    (the strata-jax update's old / reference logprob passes run where its config needs them),
    except that with --kl > 0 and LoRA each micro-batch also runs the reference forward (the
    adapters scaled to 0, no gradient) and adds the KL penalty (k3 estimator) to its loss, as
    the strata-jax update does; without LoRA the torch step has no reference pass.
    after_warmup: called between the warm-up update and the timed ones.
    Returns (warm-up s, [update s per repeat], tokens computed (micro-batch slots)).
    """
    import tempfile
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.iteration import add_torch_lora
    from strata_jax.models.loading import export_params
    with tempfile.TemporaryDirectory() as d:
        export_params(params, model, d, dtype="float32")
        net = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    net.config.use_cache = False
    if args.remat != "none":
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net.train()
    if args.lora:
        for w in net.parameters():
            w.requires_grad_(False)
        add_torch_lora(torch, net, args.lora, alpha=args.lora_alpha)
    trainable = [w for w in net.parameters() if w.requires_grad]
    adapters = [m for m in net.modules() if hasattr(m, "scale") and hasattr(m, "base")]
    ref_pass = args.kl > 0 and bool(adapters)
    opt = torch.optim.AdamW(trainable, lr=1e-6, weight_decay=0.01)
    seqs, n_resp = torch_rows(batch)
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    adv = [1.0 if i % 2 else -1.0 for i in range(len(seqs))]   # any fixed advantages
    slots = 0
    micro_batches = []
    for start in range(0, len(order), args.mini):
        mini = order[start:start + args.mini]
        group = []
        for m in range(0, len(mini), args.micro):
            rows = mini[m:m + args.micro]
            t = max(len(seqs[i]) for i in rows)
            ids = torch.zeros((len(rows), t), dtype=torch.long)
            mask = torch.zeros((len(rows), t), dtype=torch.long)
            for j, i in enumerate(rows):
                ids[j, t - len(seqs[i]):] = torch.from_numpy(seqs[i])
                mask[j, t - len(seqs[i]):] = 1
            pos = (mask.cumsum(1) - 1).clamp(min=0)
            tr = max(n_resp[i] for i in rows)
            keep = torch.zeros((len(rows), tr), dtype=torch.bool)
            for j, i in enumerate(rows):
                keep[j, tr - n_resp[i]:] = True
            a = torch.tensor([adv[i] for i in rows])[:, None]
            group.append((ids, mask, pos, tr, keep, a))
            slots += len(rows) * t
        micro_batches.append(group)

    def logprobs(ids, mask, pos, tr):
        """[rows, tr] logprobs of the last tr tokens (the response columns)."""
        out = net(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=tr + 1)
        return torch.log_softmax(out.logits[:, :-1].float(), -1).gather(
            -1, ids[:, -tr:, None])[..., 0]

    def update():
        t0 = time.perf_counter()
        for group in micro_batches:
            n_tok = sum(int(k.sum()) for *_, k, _ in group)
            for ids, mask, pos, tr, keep, a in group:
                lp = logprobs(ids, mask, pos, tr)
                # PPO at ratio 1: -A * exp(lp - lp.detach()) has the gradient of -A * lp
                loss = -(a * torch.exp(lp - lp.detach()) * keep).sum() / n_tok
                if ref_pass:   # the reference policy: the base weights, adapters off
                    with torch.no_grad():
                        for m in adapters:
                            m.scale = 0.0
                        ref = logprobs(ids, mask, pos, tr)
                        for m in adapters:
                            m.scale = args.lora_alpha / args.lora
                    d = ref - lp
                    loss = loss + args.kl * ((torch.exp(d) - d - 1) * keep).sum() / n_tok
                loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    warm = update()
    if after_warmup is not None:
        after_warmup()
    return warm, [update() for _ in range(args.repeats)], slots


def _common_prefix(pi, pm) -> int:
    """Length of the prompt prefix every row shares."""
    seqs = [p[m] for p, m in zip(pi, pm)]
    n = min(len(s) for s in seqs)
    for i in range(n):
        if len({int(s[i]) for s in seqs}) > 1:
            return i
    return n


SHAPES = {   # random-weight model shapes (Qwen2.5's published configs; tied embeddings)
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=16),
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                 num_heads=14, num_kv_heads=2, head_dim=64, tie_word_embeddings=True),
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                 num_heads=12, num_kv_heads=2, head_dim=128, tie_word_embeddings=True),
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="HF checkpoint dir, GGUF file or fetched model "
                    "name; empty: random weights of --shape")
    ap.add_argument("--shape", default="tiny", choices=tuple(SHAPES),
                    help="random-weight model shape without --model (Qwen2.5-0.5B's, -1.5B's)")
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
    ap.add_argument("--batches", nargs="*", default=[], help="dumped SampleBatch .npz files "
                    "(log.dump_batches) to replay instead of the synthetic batch")
    ap.add_argument("--rows", type=int, default=0, help="keep the first N rows of each batch "
                    "(the synthetic one too; 0: all), e.g. to time a larger shape on part of a "
                    "real batch")
    ap.add_argument("--mini", type=int, default=1024, help="mini_batch_size (step rows per "
                    "optimizer step; the default: one step over the whole batch)")
    ap.add_argument("--algo", default="grpo", help="the estimator (a dumped batch carries the "
                    "fields of its run's algo: pass it)")
    ap.add_argument("--paths", nargs="+", default=["per_row", "packed"],
                    choices=["per_row", "packed", "torch"], help="which update paths to time "
                    "(torch: transformers' per-row update of the same rows, `torch_update`)")
    ap.add_argument("--kl", type=float, default=0.01, help="loss.kl_coef (the base config's): "
                    "> 0 runs a reference pass (torch: with LoRA only, `torch_update`)")
    ap.add_argument("--lora-alpha", type=float, default=64.0, help="LoRA alpha (both sides; "
                    "the base config's)")
    ap.add_argument("--remat", default="full")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--in-process", action="store_true", help="time every path in this process "
                    "(default: one child process per path, so each path's peak RSS is its own)")
    ap.add_argument("--rss-trace", action="store_true", help="sample the resident set every "
                    "0.1 s with what runs (benchmarks/_rss_trace.py: compilations exactly, "
                    "executions as the Python call that waits, dispatch stays asynchronous so "
                    "the update's time is the usual one): each path's row gets its peak's "
                    "phase and the highest per phase")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    ap.add_argument("--child-json", default="", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def load_batches(args, vocab: int) -> list[tuple[str, object]]:
    """(name, SampleBatch) per --batches file (first --rows rows), or the synthetic batch.
    Raises SystemExit when a batch holds ids beyond the model's vocabulary."""
    import jax
    import numpy as np

    from strata_jax.algos import make_sample_batch
    if not args.batches:
        recs = strata_records(args, vocab)
        return [("synthetic", make_sample_batch(recs[:args.rows] if args.rows else recs,
                                                row_multiple=args.micro))]
    from strata_jax.algos.batch import load_sample_batch
    out = []
    for f in args.batches:
        batch = load_sample_batch(f)[0]
        if args.rows:
            batch = jax.tree.map(lambda x: x[:args.rows], batch)
        top = int(max(np.asarray(batch.prompt_ids).max(), np.asarray(batch.response_ids).max()))
        if top >= vocab:
            raise SystemExit(f"{f} holds token id {top}, beyond the model's vocabulary "
                             f"({vocab}): pass --model of the run that dumped it")
        out.append((os.path.relpath(f), batch))
    return out


def run_paths(args) -> list[dict]:
    """Time args.paths in this process; one result dict per (batch, path) plus one per batch
    with its token counts (path "counts")."""
    import jax
    import numpy as np

    import configs.base as base
    from benchmarks._rss_trace import RssTrace
    from benchmarks._timing import time_updates
    from strata_jax.metrics import CompileCounter
    from strata_jax.models import Qwen2Config, init_params, load_checkpoint
    from strata_jax.training import TrainConfig, Trainer

    compiles = CompileCounter.install()
    if args.model:   # a local dir, a GGUF file or a fetched model's name
        model, params = load_checkpoint(args.model)
    else:
        model = Qwen2Config(**SHAPES[args.shape])
        params = init_params(model, jax.random.PRNGKey(0))
    c = base.get_base_config()
    c.algo = args.algo
    c.lora.rank, c.lora.alpha = args.lora, args.lora_alpha   # torch's adapters: the same
    c.loss.kl_coef = args.kl
    results = []
    for name, batch in load_batches(args, model.vocab_size):
        counts = token_counts(batch, args.micro, TrainConfig().response_floor)
        results.append(dict(batch=name, path="counts", rows=int(np.asarray(batch.valid).sum()),
                            width=[int(batch.prompt_ids.shape[1]),
                                   int(batch.response_ids.shape[1])], **counts))
        for path in args.paths:
            if path == "torch":
                warm, runs, slots = torch_update(model, params, batch, args, reset_peak_rss)
                results.append(_result(runs, batch=name, path=path, warmup_s=warm,
                                       tokens=slots))
                continue
            cfg = TrainConfig.from_config(c, mini_batch_size=args.mini,
                                          micro_batch_rows=args.micro, remat=args.remat,
                                          compute_dtype=args.dtype, donate_state=True)
            trainer = Trainer(model, cfg, per_row=path != "packed")
            state = trainer.init_state(params, jax.random.PRNGKey(1))
            marks = []

            def after_warmup():
                marks.append(compiles.count)
                reset_peak_rss()
            with RssTrace() if args.rss_trace else contextlib.nullcontext() as trace:
                state, warm, runs, m = time_updates(trainer, state, batch, params,
                                                    args.repeats, after_warmup)
            extra = dict(rss_trace=trace.summary()) if trace is not None else {}
            results.append(_result(runs, batch=name, path=path, warmup_s=warm,
                                   compilations=compiles.count - marks[0],
                                   token_fill=float(m["perf/update_token_fill"]),
                                   loss=float(m["train/loss"]), **extra))
            del state, trainer
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    for r in results:   # the process's peak: a path's own only when it ran alone
        r.setdefault("peak_rss_gb", rss)
        r["rss_of"] = "path" if len(args.paths) == 1 else "process"
    return results


def run_children(args, argv: list[str]) -> list[dict]:
    """One child process per path (the same arguments, --paths that path), so each peak RSS
    is the path's own; the children run one after another."""
    import json
    import subprocess
    import sys
    import tempfile
    results = []
    for path in args.paths:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            # argparse keeps the last --paths: the child times this one path
            cmd = [sys.executable, "-m", "benchmarks.prefix_tree", *argv, "--paths", path,
                   "--in-process", "--child-json", f.name]
            rc = subprocess.run(cmd).returncode
            if rc != 0:   # e.g. killed for memory: the other paths' figures still count
                print(f"path {path}: the child process failed (exit {rc}); its row is left out",
                      flush=True)
                continue
            got = json.load(open(f.name))
        have_counts = any(r["path"] == "counts" for r in results)
        results += [r for r in got if r["path"] != "counts" or not have_counts]
    return results


def _result(runs: list[float], **fields) -> dict:
    """One path's result row: `fields`, the median of the timed updates' seconds (None with
    --repeats 0), the load, and the timed updates' peak RSS (GiB; only when some ran: with
    --repeats 0 the peak since the reset after the warm-up belongs to nothing)."""
    r = dict(fields, update_s=statistics.median(runs) if runs else None,
             load=os.getloadavg()[0])
    if runs:
        r["timed_peak_rss_gb"] = peak_rss_gb()
    return r


def report(results: list[dict]) -> None:
    """Token counts per layout, then per path: update s and its speed-up over every other
    path (the other's time / this one's)."""
    label = {"per_row": "per-row (reference)", "packed": "packed tree (the update)",
             "torch": "torch per-row"}
    for r in [r for r in results if r["path"] == "counts"]:
        name = r["batch"]
        print(f"{name}: {r['rows']} rows, batch width {r['width'][0]} + {r['width'][1]}")
        for k in ("per_row", "grouped", "packed_no_sharing", "instruction_shared", "tree"):
            print(f"  tokens computed, {k:19s}: {r[k]:7d}  ({r['per_row'] / max(r[k], 1):.2f}x "
                  f"fewer than per-row)")
        timed = {p["path"]: p for p in results if p["batch"] == name and p["path"] != "counts"}
        for path, p in timed.items():
            vs = [f"vs {o} {timed[o]['update_s'] / p['update_s']:.2f}x" for o in timed
                  if o != path and p["update_s"] and timed[o]["update_s"]]
            extra = (f", {p['compilations']} compilations after warm-up, token fill "
                     f"{p['token_fill']:.2f}, loss {p['loss']:.6f}" if "loss" in p
                     else f", {p['tokens']} tokens computed")
            rss = "peak RSS" if p.get("rss_of", "path") == "path" else "process peak RSS"
            alone = (f" (timed updates alone {p['timed_peak_rss_gb']:.2f} GB)"
                     if "timed_peak_rss_gb" in p else "")
            upd = (f"{p['update_s']:7.2f} s" if p["update_s"] is not None
                   else "not timed (--repeats 0)")
            print(f"  {label[path]:25s}: update {upd}"
                  + (f" (speed-up {', '.join(vs)})" if vs else "") + ", "
                  f"warm-up {p['warmup_s']:.1f} s, {rss} {p['peak_rss_gb']:.2f} GB{alone}"
                  f"{extra}, load {p['load']:.1f}", flush=True)
            if p.get("rss_trace"):
                tr = p["rss_trace"]
                print(f"    resident peak {tr['peak_gb']:.2f} GB at {tr['peak_at_s']:.0f} s in "
                      f"{tr['peak_label']}; compiling {tr['compile_peak_gb']:.2f} GB, executing "
                      f"{tr['exec_peak_gb']:.2f} GB; by phase: "
                      + ", ".join(f"{k} {v:.2f}" for k, v in tr["by_label"].items()), flush=True)


def main(argv=None) -> None:
    import json
    import sys
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.in_process or len(args.paths) == 1:
        results = run_paths(args)
    else:
        results = run_children(args, argv)
    if args.child_json:
        json.dump(results, open(args.child_json, "w"))
        return
    report(results)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        json.dump(dict(args=vars(args), results=results), open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
