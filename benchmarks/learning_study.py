"""Does a real Qwen2.5 agent learn under StraTA? Held-out success before and after RL, against
GRPO, with significance tests: the study on memory_key with one code attempt (docs/method.md §12).

    nohup python -m benchmarks.learning_study > runs/learning_study.log 2>&1 &   # run / continue
    python -m benchmarks.learning_study --report         # tables, tests and plot from what ran
    python -m benchmarks.learning_study --only start     # just the starting policy's evals

The study is a queue of jobs, each a ``train.py`` / ``eval.py`` / ``sft.py`` subprocess on its
own folder under ``--out``; a job whose result exists is skipped, and train.py resumes a run
from its last checkpoint (``ckpt.every=1``), so the queue started again after a stop continues
where it stopped. Each finished job's outputs (eval JSON and trajectories, a run's metrics and
trajectories; not checkpoints) are copied to ``--results`` with its command line, a running
run's every ``--keep-every`` seconds; committed, they let a fresh clone's queue skip the same
jobs and its report read them (the same job: the same command line but for the update's memory
knobs, ``--micro`` / ``--remat``, which a run killed for memory may change). In order:

1. ``warm_start`` (with ``--warm-start mask`` or ``mask-actions``): behaviour cloning that
   teaches the walk and the keypad with plans that do NOT carry the code
   (``sft.plan_code=mask``; ``mask-actions`` trains the action rows only, so the model keeps its
   own way of writing strategies), cached by fingerprint.
2. ``start_strata`` / ``start_flat``: the starting policy on the fixed eval set (the first
   ``--eval-episodes`` test-split tasks, one strategy per task, temperature 0.4), StraTA and
   flat prompting.
3. per seed and method: ``run_<algo>_s<seed>`` (LoRA, ``--iterations`` iterations, StraTA N x M
   episodes per task against GRPO groups of N*M: ``matched``), then ``final_<algo>_s<seed>``
   (its last checkpoint on the same eval set).

The report (``--out/learning_study.json`` + ``.png``): per policy, success with 95% Wilson
intervals, the fraction of strategies that carry the code, the successes whose code reached the
keypad's prompt some other way (leak channels, §12); each trained policy against its own start
(one-sided Fisher exact and exact McNemar on the paired tasks); each method's gain and StraTA's
gain minus GRPO's; the training rollouts' success per iteration with a Cochran-Armitage trend
test; the success rate the eval size can detect (80% power). Statistics: benchmarks/_stats.py.
Measures, never asserts.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ALGOS = ("strata", "grpo")
# The code in the first observation: "A note on the wall reads: 'vault code 6-1-6'."
_NOTE = re.compile(r"vault code ([0-9](?:-[0-9])*)'")
# Text names the code when a code word precedes its digits (in order, separators allowed):
# "enter the code 6-1-6", "vault code 7", "enter 7"; list numbers ("1. go north") and counts
# ("go north (4 times)") do not, which matters with a one-digit code.
_CODE_WORD = r"(?:code|enter|vault|key|keypad|digits?|combination|password)"


def task_code(traj: dict) -> str:
    """The vault code of a memory_key trajectory record, from its first observation ("" when
    the record has no step or no note)."""
    steps = traj.get("steps") or []
    m = _NOTE.search(steps[0]["observation"]) if steps else None
    return m.group(1).replace("-", "") if m else ""


def names_code(text: str | None, code: str) -> bool:
    """Whether `text` names `code`: a code word, then within 30 characters the code's digits in
    order with at most two separator characters between them and no digit around them."""
    if not text or not code:
        return False
    digits = r"[\s,\-]{0,2}".join(code)
    pat = _CODE_WORD + r"[^0-9]{0,30}(?<![0-9])" + digits + r"(?![0-9])"
    return re.search(pat, text, flags=re.IGNORECASE) is not None


def leaked(traj: dict, code: str, history: int = 2, tail_chars: int = 30) -> bool:
    """Whether the code was in the prompt of the episode's last step from a source other than
    the strategy: the first observation still in the history window, or an action / the tail of
    a format-invalid output of the last `history` steps naming it (`names_code`)."""
    steps = traj.get("steps") or []
    t = len(steps) - 1
    if t < 0:
        return False
    if t <= history:   # the note itself is still in the window (or is the current observation)
        return True
    from strata_jax.rollout.prompts import invalid_history_action
    for s in steps[t - history:t]:   # the history text exactly as the step prompt showed it
        text = (invalid_history_action(s.get("output") or "", tail_chars) if s.get("invalid")
                else s.get("action"))
        if names_code(text, code):
            return True
    return False


def episode_rows(trajs: list[dict]) -> list[dict]:
    """One row per episode: variation, success, whether its strategy carries the code, whether a
    success leaked (`leaked`), invalid steps, steps."""
    rows = []
    for tr in trajs:
        code = task_code(tr)
        ok = bool(tr.get("success"))
        rows.append(dict(variation=int(tr.get("variation", -1)), success=ok,
                         strategy=tr.get("strategy") is not None,
                         carries=names_code(tr.get("strategy"), code),
                         leaked=ok and leaked(tr, code),
                         steps=len(tr.get("steps") or []),
                         invalid=sum(bool(s.get("invalid")) for s in tr.get("steps") or [])))
    return rows


def summary(rows: list[dict]) -> dict:
    """Success k / n with its Wilson interval, code-carrying strategies, leaked successes."""
    from benchmarks._stats import wilson
    n, k = len(rows), sum(r["success"] for r in rows)
    strat = [r for r in rows if r["strategy"]]
    steps = sum(r["steps"] for r in rows)
    lo, hi = wilson(k, n) if n else (0.0, 0.0)
    return dict(n=n, k=k, success=k / n if n else 0.0, ci95=[lo, hi],
                carries=(sum(r["carries"] for r in strat) / len(strat)) if strat else None,
                leaked_successes=sum(r["leaked"] for r in rows),
                invalid_step_frac=(sum(r["invalid"] for r in rows) / steps) if steps else 0.0)


def read_jsonl(path: str) -> list[dict]:
    from strata_jax.metrics import read_jsonl as _read
    return list(_read(path)) if os.path.exists(path) else []


# ---------------------------------------------------------------------------- the queue


def variant(args, algo: str, workdir: str, extra: tuple[str, ...] = ()) -> str:
    """The config variant string (configs/builtin.py) every job of the study shares, for
    prompting / training with `algo` in `workdir`."""
    toks = ["tiny", "real", algo, f"model.path={args.model}", f"workdir={workdir}",
            f"seed={args.seed_base}",
            f"env.code_digits={args.digits}", "env.code_attempts=1",
            f"env.max_steps={args.max_steps}", "rollout.format_examples=true",
            "rollout.max_action_tokens=96", "rollout.max_strategy_tokens=128",
            "rollout.max_judge_tokens=32", "env.max_prompt_tokens=1536",
            # every eval episode live at once: memory_key steps are instant, and one decode
            # call of 48 rows reads the weights once per token where three waves of 16 read
            # them three times
            f"env.num_workers={max(16, args.eval_episodes)}",
            f"model.dtype={args.dtype}", f"rollout.sampler_dtype={args.dtype}",
            f"train.compute_dtype={args.dtype}", "eval.temperature=0.4",
            "log.dump_trajectories=1000"]
    if args.warm_start in ("mask", "mask-actions"):
        toks += ["model.warm_start=sft", "sft.plan_code=mask", f"sft.episodes={args.sft_episodes}",
                 f"sft.plan_code_keep={args.plan_code_keep}",
                 f"sft.train_strategies={args.warm_start == 'mask'}",
                 f"sft.steps={args.sft_steps}", f"sft.batch_size={args.sft_batch}",
                 f"sft.lr={args.sft_lr}",
                 "sft.warmup_steps=5", "sft.noise=0.1", "sft.log_every=10",
                 "sft.strategy_mode=both"]
        if args.no_guesses:   # only when set: the kept jobs' command lines stay the same
            toks += ["sft.clone_guesses=false"]
    elif args.warm_start:
        toks += [f"model.warm_start={args.warm_start}"]
    toks += list(extra) + list(args.set)
    return ",".join(toks)


def train_extra(args, algo: str, seed: int) -> tuple[str, ...]:
    n, m = args.n, args.m
    rows_hint = args.tasks * n * m * args.max_steps
    out = (f"seed={seed}", f"iterations={args.iterations}", f"lora.rank={args.rank}",
           f"lora.alpha={args.rank * 4}", f"lora.lr={args.lr}", f"optim.lr={args.lr}",
           f"rollout.tasks_per_batch={args.tasks}", f"rollout.num_strategies={n}",
           f"rollout.episodes_per_strategy={m}", f"rollout.oversample={args.sigma}",
           "ckpt.every=1", "ckpt.keep=2", "eval.every=0", f"model.remat={args.remat}",
           # the first iterations' update batches, replayed by benchmarks/prefix_tree.py
           "log.dump_batches=2",
           f"optim.micro_batch_rows={args.micro}",
           # --updates-per-iteration optimizer steps over one iteration's rows (about: the row
           # count is known only after the rollout): more updates, no more rollouts
           f"optim.mini_batch_size={max(args.micro, rows_hint // args.updates_per_iteration)}")
    return out + (("matched",) if algo != "strata" else ()) + tuple(args.train_set)


def jobs(args) -> list[dict]:
    """The queue in order: name, argv, the file whose existence marks the job done."""
    py, out = sys.executable, os.path.abspath(args.out)
    cfg = os.path.join(REPO, "configs", "builtin.py")
    split, e = "test", args.eval_episodes
    q = []
    if args.warm_start in ("mask", "mask-actions"):
        wd = os.path.join(out, "warm_start")
        # its weights (runs/warm_start) are not kept: a fresh clone trains them again (cached
        # by fingerprint, deterministic), so its kept meta never marks it done
        q.append(dict(name="warm_start", done=os.path.join(wd, "DONE"), touch=True, local=True,
                      argv=[py, os.path.join(REPO, "sft.py"),
                            f"--config={cfg}:{variant(args, 'strata', wd)}"]))
    for prompting, algo in (("strata", "strata"), ("flat", "grpo")):
        wd = os.path.join(out, f"start_{prompting}")
        q.append(dict(name=f"start_{prompting}", done=os.path.join(wd, f"eval_{split}_step0.json"),
                      argv=[py, os.path.join(REPO, "eval.py"),
                            f"--config={cfg}:{variant(args, algo, wd)}", "--no_checkpoint",
                            f"--split={split}", f"--episodes_per_family={e}"]))
    for seed in range(args.seeds):
        for algo in args.algos:
            wd = os.path.join(out, f"run_{algo}_s{seed}")
            v = variant(args, algo, wd, train_extra(args, algo, seed))
            # a kept run without its kept final eval is played again: its checkpoint, which
            # the final eval reads, is not kept
            q.append(dict(name=f"run_{algo}_s{seed}", done=os.path.join(wd, "DONE"), touch=True,
                          kept_with=f"final_{algo}_s{seed}",
                          argv=[py, os.path.join(REPO, "train.py"), f"--config={cfg}:{v}"]))
            q.append(dict(name=f"final_{algo}_s{seed}",
                          done=os.path.join(wd, f"eval_{split}_step{args.iterations}.json"),
                          argv=[py, os.path.join(REPO, "eval.py"), f"--config={cfg}:{v}",
                                f"--split={split}", f"--episodes_per_family={e}"]))
    return q


# What each finished job leaves in its workdir that the study reads, kept under --results
# (committed) so that a later session's queue, on a fresh clone without runs/, skips it and the
# report reads it. Checkpoints are not kept: an unfinished run starts again in a new session.
KEEP = dict(sft=("sft_meta.json",), eval=("eval_*.json", "eval_*_trajectories.jsonl"),
            train=("metrics.jsonl", "trajectories.jsonl", "batches/*.npz"))


def job_key(job: dict) -> list[str]:
    """The job's argv with the checkout's paths made relative: what must match for a kept
    result to stand for this job (another setting of the study is another job)."""
    return [a.replace(REPO + os.sep, "").replace(REPO, ".") for a in job["argv"][1:]]


def same_setting(a: list[str], b: list[str]) -> bool:
    """Whether two `job_key`s name the same setting: equal but for `MEMORY_KNOBS` overrides in
    their ``--config=<file>:<tokens>`` argument (`strata_jax.validation.MEMORY_KNOBS`: a
    resume may change them, so a run re-run with less memory after an OOM is the same job)
    and for retired fields (`strata_jax.config.RETIRED`: ignored by the run, so a kept job
    that set one is the job without it); a renamed memory knob's old name
    (`strata_jax.config.RENAMED_FIELDS`) is skipped as the knob. Imported here: the queue
    process stays free of jax, beside the runs it starts."""
    from strata_jax.config import RENAMED_FIELDS, RETIRED
    from strata_jax.validation import MEMORY_KNOBS
    skip = set(MEMORY_KNOBS) | set(RETIRED) | {
        old for old, (_, new) in RENAMED_FIELDS.items() if new in MEMORY_KNOBS}

    def strip(argv):
        out = []
        for x in argv:
            if x.startswith("--config=") and ":" in x:
                head, tokens = x.split(":", 1)
                x = head + ":" + ",".join(t for t in tokens.split(",")
                                          if t.split("=", 1)[0] not in skip)
            out.append(x)
        return out
    return a is not None and b is not None and strip(a) == strip(b)


def kept_dir(args, job: dict) -> str:
    """--results/<job name>: where `keep` copies the job's outputs."""
    return os.path.join(args.results, job["name"])


def marker(job: dict) -> str:
    """The file in the job's workdir that records the argv it finished with (`job_key`)."""
    return os.path.join(os.path.dirname(job["done"]), f".{job['name']}.argv.json")


def finished_here(job: dict) -> bool:
    """Whether the job finished in this checkout's workdir with this argv: its done file and a
    matching `marker` (another setting of the study on the same --out is another job)."""
    if not (os.path.exists(job["done"]) and os.path.exists(marker(job))):
        return False
    return same_setting(json.load(open(marker(job))), job_key(job))


def is_kept(args, job: dict, queue: list[dict]) -> bool:
    """Whether --results holds this job's outputs from the same argv (`job_key`), and, for a
    train run, its final eval's too (`jobs`: kept_with); never for a `local` job."""
    meta = os.path.join(kept_dir(args, job), "job.json")
    if job.get("local") or not os.path.exists(meta):
        return False
    if not same_setting(json.load(open(meta)).get("argv"), job_key(job)):
        return False
    partner = [j for j in queue if j["name"] == job.get("kept_with")]
    return all(is_kept(args, j, queue) for j in partner)


def keep(args, job: dict, finished: bool) -> None:
    """Copy the job's outputs (`KEEP`, by the script it runs; relative paths kept) from its
    workdir to --results/<job>; `finished` marks it done there (a running train job's curve is
    kept as it grows, not marked done)."""
    import glob
    import shutil
    wd, dst = os.path.dirname(job["done"]), kept_dir(args, job)
    script = os.path.basename(job["argv"][1])[:-len(".py")]
    if script == "sft":   # the export folder (and its meta) is the one the log names
        log = os.path.join(args.out, job["name"] + ".log")
        text = open(log).read() if os.path.exists(log) else ""
        found = re.findall(r"^(?:trained|cached): (\S+)", text, re.MULTILINE)
        wd = os.path.join(REPO, found[-1]) if found else wd
    files = [f for pat in KEEP[script] for f in glob.glob(os.path.join(wd, pat))]
    if not files:
        return
    for f in files:   # the same relative path (a run's dumped update batches: batches/)
        rel = os.path.relpath(f, wd)
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        shutil.copy2(f, os.path.join(dst, rel))
    if finished:
        with open(os.path.join(dst, "job.json"), "w") as f:
            json.dump(dict(argv=job_key(job), finished=time.strftime("%Y-%m-%d %H:%M:%S")), f,
                      indent=1)


def restore(args, job: dict) -> None:
    """Copy a kept job's outputs back into its workdir (a fresh clone, or the workdir of
    another setting: kept files overwrite) and write its argv `marker`, so later jobs and the
    report find them where the run left them."""
    import shutil
    src, wd = kept_dir(args, job), os.path.dirname(job["done"])
    os.makedirs(wd, exist_ok=True)
    for root, _, names in os.walk(src):
        for f in names:
            rel = os.path.relpath(os.path.join(root, f), src)
            if rel != "job.json":
                os.makedirs(os.path.dirname(os.path.join(wd, rel)), exist_ok=True)
                shutil.copy2(os.path.join(src, rel), os.path.join(wd, rel))
    with open(marker(job), "w") as f:
        json.dump(job_key(job), f)


def run_queue(args) -> None:
    os.makedirs(args.out, exist_ok=True)
    queue = jobs(args)
    for job in queue:
        if args.only and not job["name"].startswith(tuple(args.only)):
            continue
        if is_kept(args, job, queue):
            print(f"[{job['name']}] done (kept in {kept_dir(args, job)})", flush=True)
            restore(args, job)
            continue
        if finished_here(job):
            print(f"[{job['name']}] done", flush=True)
            keep(args, job, finished=True)
            continue
        log = os.path.join(args.out, job["name"] + ".log")
        print(f"[{job['name']}] {' '.join(job['argv'][1:])}  (log {log})", flush=True)
        t0, load0 = time.time(), open("/proc/loadavg").read().split()[0]
        with open(log, "a") as f:
            proc = subprocess.Popen(job["argv"], cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
            while True:   # keep a train run's curve as it grows (--results is committed)
                try:
                    rc = proc.wait(timeout=args.keep_every)
                    break
                except subprocess.TimeoutExpired:
                    keep(args, job, finished=False)
        wall = time.time() - t0
        load1 = open("/proc/loadavg").read().split()[0]
        row = dict(job=job["name"], rc=rc, wall_s=round(wall, 1), load_start=load0,
                   load_end=load1, finished=time.strftime("%Y-%m-%d %H:%M:%S"))
        for path in (os.path.join(args.out, "jobs.jsonl"), os.path.join(args.results,
                                                                         "jobs.jsonl")):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
        if rc != 0:
            keep(args, job, finished=False)
            print(f"[{job['name']}] exit {rc} after {wall:.0f} s; see {log}; stopping the queue",
                  flush=True)
            return
        if job.get("touch"):
            os.makedirs(os.path.dirname(job["done"]), exist_ok=True)
            open(job["done"], "w").close()
        with open(marker(job), "w") as f:
            json.dump(job_key(job), f)
        keep(args, job, finished=True)
        print(f"[{job['name']}] finished in {wall:.0f} s (load {load0} -> {load1})", flush=True)


# ---------------------------------------------------------------------------- the report


def eval_rows(path: str) -> list[dict]:
    return episode_rows(read_jsonl(path[:-len(".json")] + "_trajectories.jsonl"))


def training_curve(workdir: str) -> dict:
    """Per iteration of a run: successes / episodes of its rollout and the fraction of its
    strategies carrying the code (from the dumped trajectories)."""
    by_step: dict[int, list[dict]] = {}
    for tr in read_jsonl(os.path.join(workdir, "trajectories.jsonl")):
        by_step.setdefault(int(tr["step"]), []).append(tr)
    steps = sorted(by_step)
    rows = [episode_rows(by_step[s]) for s in steps]
    return dict(iterations=steps, successes=[sum(r["success"] for r in rs) for rs in rows],
                episodes=[len(rs) for rs in rows],
                carries=[(sum(r["carries"] for r in rs if r["strategy"]) /
                          max(1, sum(r["strategy"] for r in rs))) for rs in rows])


def report(args) -> dict:
    from benchmarks import _stats as st
    queue = jobs(args)
    for job in queue:   # a fresh clone: the kept outputs back where the report reads them
        if is_kept(args, job, queue):
            restore(args, job)
    out, split, e = args.out, "test", args.eval_episodes
    res: dict = dict(settings={k: v for k, v in vars(args).items() if k not in ("only",)},
                     policies={}, tests={}, curves={})
    start = {}
    for prompting in ("strata", "flat"):
        rows = eval_rows(os.path.join(out, f"start_{prompting}", f"eval_{split}_step0.json"))
        if rows:
            start[prompting] = rows
            res["policies"][f"start_{prompting}"] = summary(rows)
    gains: dict[str, list[float]] = {}
    for seed in range(args.seeds):
        for algo in args.algos:
            wd = os.path.join(out, f"run_{algo}_s{seed}")
            res["curves"][f"{algo}_s{seed}"] = cur = training_curve(wd)
            if cur["iterations"]:
                cur["trend_z"], cur["trend_p"] = st.cochran_armitage(cur["successes"],
                                                                      cur["episodes"])
            rows = eval_rows(os.path.join(wd, f"eval_{split}_step{args.iterations}.json"))
            if not rows:
                continue
            name = f"{algo}_s{seed}"
            res["policies"][name] = s = summary(rows)
            base = start.get("strata" if algo == "strata" else "flat")
            if base:
                b = summary(base)
                by_var = {r["variation"]: r["success"] for r in base}
                paired = [(r["success"], by_var[r["variation"]]) for r in rows
                          if r["variation"] in by_var]
                p_mc, nb, nc = st.mcnemar_greater([a for a, _ in paired], [o for _, o in paired])
                res["tests"][name] = dict(
                    start=f"start_{'strata' if algo == 'strata' else 'flat'}",
                    gain=s["success"] - b["success"],
                    fisher_p=st.fisher_greater(s["k"], s["n"], b["k"], b["n"]),
                    mcnemar_p=p_mc, only_trained=nb, only_start=nc)
                gains.setdefault(algo, []).append(s["success"] - b["success"])
    if gains:
        res["gains"] = {a: sum(g) / len(g) for a, g in gains.items()}
        if "strata" in gains and "grpo" in gains:
            res["gains"]["strata_minus_grpo"] = res["gains"]["strata"] - res["gains"]["grpo"]
    if "start_strata" in res["policies"]:
        p0 = res["policies"]["start_strata"]["success"]
        res["detectable_rate"] = dict(start=p0, n=e, rate=st.detectable_rate(p0, e))
    os.makedirs(out, exist_ok=True)   # --report on an --out that no kept job matches
    json.dump(res, open(os.path.join(out, "learning_study.json"), "w"), indent=1)
    print_report(res)
    if any(c["iterations"] for c in res["curves"].values()):
        plot(res, os.path.join(out, "learning_study.png"))
    return res


def print_report(res: dict) -> None:
    print("| policy | success | 95% CI | strategies carrying the code | leaked successes | "
          "invalid steps |")
    print("|---|---|---|---|---|---|")
    for name, s in res["policies"].items():
        car = "-" if s["carries"] is None else f"{100 * s['carries']:.0f}%"
        print(f"| {name} | {s['k']} / {s['n']} ({100 * s['success']:.1f}%) | "
              f"[{100 * s['ci95'][0]:.1f}, {100 * s['ci95'][1]:.1f}] | {car} | "
              f"{s['leaked_successes']} | {100 * s['invalid_step_frac']:.1f}% |")
    for name, t in res["tests"].items():
        print(f"{name} vs {t['start']}: gain {100 * t['gain']:+.1f} points, Fisher p = "
              f"{t['fisher_p']:.3g}, McNemar p = {t['mcnemar_p']:.3g} "
              f"({t['only_trained']} tasks only trained, {t['only_start']} only start)")
    for name, c in res["curves"].items():
        if c["iterations"]:
            print(f"{name} training: successes {c['successes']} of {c['episodes']}, carrying "
                  f"{[round(x, 2) for x in c['carries']]}, trend p = {c['trend_p']:.3g}")
    if "gains" in res:
        print("mean gains:", {k: round(v, 3) for k, v in res["gains"].items()})
    if "detectable_rate" in res:
        d = res["detectable_rate"]
        print(f"detectable at n={d['n']} (80% power, one-sided 5%): {100 * d['start']:.1f}% -> "
              f"{100 * d['rate']:.0f}%")


def eval_points(res: dict, algo: str) -> list[tuple[int, dict]]:
    """The held-out evals of one method as (iteration, `summary`) points: its start (StraTA's
    or flat prompting's) at 0, each seed's final checkpoint at the study's --iterations (where
    it was evaluated, whatever share of a curve a partial queue has run)."""
    start = res["policies"].get("start_" + ("strata" if algo == "strata" else "flat"))
    points = [(0, start)] if start else []
    return points + [(int(res["settings"]["iterations"]), s)
                     for k, s in res["policies"].items() if k.startswith(algo + "_")]


def plot(res: dict, path: str) -> None:
    """Training success and code-carrying fraction per iteration: per method the mean over
    seeds and the min-max band; beside them the held-out evals (squares with their 95% Wilson
    intervals): each method's start at iteration 0, its final checkpoints at the last."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for algo, color in (("strata", "tab:blue"), ("grpo", "tab:orange")):
        curves = [c for k, c in res["curves"].items()
                  if k.startswith(algo + "_") and c["iterations"]]
        if not curves:
            continue
        n = min(len(c["iterations"]) for c in curves)
        x = np.array(curves[0]["iterations"][:n])
        for ax, key in zip(axes, ("success", "carries")):
            if key == "carries" and algo != "strata":
                continue
            ys = np.array([[s / e for s, e in zip(c["successes"][:n], c["episodes"][:n])]
                           if key == "success" else c["carries"][:n] for c in curves])
            ax.plot(x, ys.mean(0), color=color, label=f"{algo} ({len(curves)} seeds)")
            ax.fill_between(x, ys.min(0), ys.max(0), color=color, alpha=0.2)
        for it, s in eval_points(res, algo):
            lo, hi = s["ci95"]
            axes[0].errorbar([it], [s["success"]], yerr=[[s["success"] - lo], [hi - s["success"]]],
                             fmt="s", color=color, capsize=3)
            if algo == "strata" and s["carries"] is not None:
                axes[1].plot([it], [s["carries"]], "s", color=color)
    axes[0].set_title("success rate (line: training; squares: held-out eval)")
    axes[1].set_title("strategies carrying the code")
    for ax in axes:
        ax.set_xlabel("iteration")
        ax.set_ylim(-0.02, 1.02)
        if ax.get_legend_handles_labels()[0]:   # GRPO alone draws no carrying curve
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    """The study's command line (`main`)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--warm-start", default="", help="'' = zero-shot; mask = behaviour cloning "
                    "with plans that do not carry the code; mask-actions = the same without "
                    "strategy rows (the model keeps its own strategies); or an HF export dir")
    ap.add_argument("--plan-code-keep", type=float, default=0.0,
                    help="with --warm-start mask*: the share of cloned plans that keep the code "
                    "(sft.plan_code_keep), so that some start strategies carry it")
    ap.add_argument("--no-guesses", action="store_true",
                    help="with --warm-start mask*: clone no StraTA-form keypad row whose code the "
                    "prompt hides (sft.clone_guesses=false), so code rows teach reading z")
    ap.add_argument("--digits", type=int, default=1)
    ap.add_argument("--max-steps", type=int, default=10)
    ap.add_argument("--eval-episodes", type=int, default=48)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--algos", nargs="+", default=["strata", "grpo"], choices=ALGOS)
    ap.add_argument("--tasks", type=int, default=1, help="tasks per iteration")
    ap.add_argument("--n", type=int, default=2, help="strategies per task (GRPO: group N*M)")
    ap.add_argument("--m", type=int, default=4, help="episodes per strategy")
    ap.add_argument("--sigma", type=int, default=2, help="strategy over-sampling")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--updates-per-iteration", type=int, default=2)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--remat", default="dots")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sft-episodes", type=int, default=48)
    ap.add_argument("--sft-steps", type=int, default=40)
    ap.add_argument("--sft-lr", type=float, default=1e-5)
    ap.add_argument("--sft-batch", type=int, default=8, help="full fine-tuning of the 0.5B in "
                    "fp32 holds params, gradients and AdamW moments (~10 GB) plus activations")
    ap.add_argument("--seed-base", type=int, default=0, help="seed of the start evals")
    ap.add_argument("--set", nargs="*", default=[], help="extra key=value overrides, every job")
    ap.add_argument("--train-set", nargs="*", default=[], help="extra key=value overrides of "
                    "the RL runs and their final evals only (the warm start and the start "
                    "evals keep their command lines, so their kept results still count)")
    ap.add_argument("--only", nargs="*", default=[], help="job name prefixes to run")
    ap.add_argument("--out", default="runs/learning_study", help="the jobs' workdirs")
    ap.add_argument("--results", default="benchmarks/results/learning_study/queue",
                    help="each finished job's outputs, committed: a later session's queue "
                    "skips the jobs kept here (same argv) and the report reads them")
    ap.add_argument("--keep-every", type=float, default=120.0,
                    help="seconds between copies of a running job's outputs to --results")
    ap.add_argument("--report", action="store_true")
    return ap


def main() -> int:
    args = build_parser().parse_args()
    if not args.report:
        run_queue(args)
    report(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
