"""The memory_key study's job queue: the train / eval / sft subprocesses in order, each on its
own workdir, skipped when its result exists (here or kept under --results), resumed where it
stopped, and its outputs kept under --results for a fresh clone."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from studies.processes import lock_path, running_elsewhere, start_job, wait_until_free

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REMAT = ("none", "full", "dots")   # model.remat's values (configs/base.py)


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (a row count), else a usage error naming the value."""
    import argparse
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return n


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0, else a usage error naming the value."""
    import argparse
    import math
    try:
        x = float(text)
    except ValueError:
        x = float("nan")
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return x


def queue_parser(doc: str, out: str, results: str):
    """The command line every study queue shares: --out (the jobs' workdirs), --results (kept
    outputs, committed), --keep-every (seconds between keeps of a running job's curve), --only
    (job name prefixes to run), --list (each job's state)."""
    import argparse
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=out, help="the jobs' workdirs")
    ap.add_argument("--results", default=results, help="kept outputs (committed)")
    ap.add_argument("--keep-every", type=positive_seconds, default=120.0,
                    help="seconds between copies of a running job's outputs to --results")
    ap.add_argument("--only", nargs="*", default=[], help="job name prefixes to run")
    ap.add_argument("--list", action="store_true")
    return ap


def list_jobs(args, queue: list[dict], resolve=None) -> None:
    """Print one line per job of `queue`: kept (under --results), done (here) or to run;
    `resolve` as `run_queue`'s."""
    for job in queue:
        j = (resolve(args, job) if resolve else job) or job
        state = "kept" if is_kept(args, j, queue) else "done" if finished_here(j) else "to run"
        print(f"{job['name']:<28} {state}")


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
            train=("metrics.jsonl", "trajectories.jsonl", "batches/*.npz", "adapters/*/*"))


def fill_placeholder(job: dict, placeholder: str, value) -> dict | None:
    """`job` with `placeholder` replaced by `value` (a string: an earlier job's output, e.g. a
    warm start's folder) in every argv entry; `job` itself when no entry holds it; None when
    one does and `value` is None or empty (that earlier output is missing: the queue stops)."""
    if not any(placeholder in x for x in job["argv"]):
        return job
    if not value:
        return None
    return {**job, "argv": [x.replace(placeholder, value) for x in job["argv"]]}


def study_main(argv, registered_args, jobs, resolve, report, listed=None) -> int:
    """A study queue's command line (`queue_parser`'s flags plus the study's own):
    ``--list`` prints each job's state (and `listed(args)`'s line when given), ``--report``
    only reports, otherwise the queue runs (`run_queue`) and then `report(args)` prints the
    study's summary. A ValueError (a damaged record or result file the queue refuses:
    `read_record`, a study's own readers) ends it with one line on stderr and status 2."""
    try:
        a = registered_args(argv)
        if a.list:
            list_jobs(a, jobs(a), resolve)
            if listed is not None:
                print(listed(a))
            return 0
        if not a.report:
            run_queue(a, jobs(a), resolve)
        report(a)
        return 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def read_record(path: str) -> dict | list:
    """A queue record (a kept job.json or export.json, a workdir's argv marker) as JSON.
    Raises ValueError naming the file and what to do when it is damaged (the queue trusts no
    half-written or edited record)."""
    try:
        with open(path) as f:
            out = json.load(f)
    except ValueError as e:
        raise ValueError(f"{path} is damaged ({e}); restore it (git checkout -- {path} for a "
                         "kept record) or delete it so that its job runs again") from None
    if not isinstance(out, (dict, list)):
        raise ValueError(f"{path} holds a {type(out).__name__}, not a queue record; restore or "
                         "delete it")
    return out


def sha256_file(path: str) -> str:
    """Hex sha256 of a file's bytes (read in 1 MiB blocks)."""
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def warm_start_export(args, name: str = "warm_start") -> str | None:
    """The warm start's export folder (relative to the checkout, e.g. runs/warm_start/<id>):
    the last ``trained:`` / ``cached:`` line of the job's log under --out, else the one its
    kept ``export.json`` records; None before the job ran."""
    log = os.path.join(args.out, name + ".log")
    found = re.findall(r"^(?:trained|cached): (\S+)", open(log).read(), re.MULTILINE) \
        if os.path.exists(log) else []
    if found:
        return found[-1]
    rec = os.path.join(args.results, name, "export.json")
    return read_record(rec)["dir"] if os.path.exists(rec) else None


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
    return same_setting(read_record(marker(job)), job_key(job))


def finished_output(args, job: dict, queue: list[dict]) -> str | None:
    """The path of `job`'s done file (its result, e.g. an eval's metrics JSON) when the job
    finished here (`finished_here`) or is kept under --results (`is_kept`), else None: a file
    that no finished job of this setting wrote is never read as its result."""
    for done, ok in ((job["done"], finished_here(job)),
                     (os.path.join(kept_dir(args, job), os.path.basename(job["done"])),
                      is_kept(args, job, queue))):
        if ok and os.path.exists(done):
            return done
    return None


def read_eval_numbers(path: str, ranges: dict[str, tuple[float, float]]) -> dict:
    """An eval job's metrics file (eval.py's ``eval_<split>_step<k>.json``) as a dict, checked:
    a JSON object whose every key of `ranges` holds a finite number (not a bool) in its
    [lo, hi]. Raises ValueError naming the file, the entry and what to do (delete the file and
    let the queue run that eval again): a damaged or foreign file decides nothing."""
    import math
    fix = "delete it and let the queue run that eval again"
    try:
        with open(path) as f:
            got = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not an eval file ({type(e).__name__}: {e}); {fix}") \
            from None
    if not isinstance(got, dict):
        raise ValueError(f"{path} holds a {type(got).__name__}, not an eval file's metrics; "
                         f"{fix}")
    for key, (lo, hi) in ranges.items():
        v = got.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or not lo <= v <= hi:
            raise ValueError(f"{path}: {key} is {v!r}, not a number in [{lo:g}, {hi:g}]; {fix}")
    return got


def study_args(doc: str, out: str, results: str, argv, **setting):
    """A study's parsed command line: `queue_parser`'s flags plus --report, with the
    registered `setting` (name -> value, read by the study's job builders) set on it."""
    ap = queue_parser(doc, out, results)
    ap.add_argument("--report", action="store_true")
    a = ap.parse_args(argv)
    for k, v in setting.items():
        setattr(a, k, v)
    return a


def is_kept(args, job: dict, queue: list[dict]) -> bool:
    """Whether --results holds this job's outputs from the same argv (`job_key`), and, for a
    train run, its final eval's too (`jobs`: kept_with); never for a `local` job."""
    meta = os.path.join(kept_dir(args, job), "job.json")
    if job.get("local") or not os.path.exists(meta):
        return False
    rec = read_record(meta)
    if not isinstance(rec, dict) or not same_setting(rec.get("argv"), job_key(job)):
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
    if script == "sft" and finished and os.path.exists(os.path.join(wd, "model.safetensors")):
        # the export is not kept (its bytes are the 0.5B's): its folder and checksum are, so
        # a rebuilt warm start can be checked against the one the study ran from
        os.makedirs(dst, exist_ok=True)
        with open(os.path.join(dst, "export.json"), "w") as f:
            json.dump(dict(dir=os.path.relpath(wd, REPO), model_safetensors_sha256=sha256_file(
                os.path.join(wd, "model.safetensors"))), f, indent=1)
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


def commit() -> str:
    """The checkout's HEAD commit (recorded beside every finished job), or "" outside git."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def run_queue(args, queue: list[dict] | None = None, resolve=None) -> None:
    """Run the jobs of `queue` (default `jobs(args)`) in order: kept ones restored, finished
    ones kept, the rest run one at a time (the module docstring of studies/memory_key/run.py).
    `resolve(args, job)`, when given, returns the job with what only an earlier job can tell
    filled in (a warm start's export folder), or None when it cannot yet: the queue stops."""
    os.makedirs(args.out, exist_ok=True)
    queue = jobs(args) if queue is None else queue
    for i, job in enumerate(queue):
        if resolve is not None:
            job = resolve(args, job)
            if job is None:
                print(f"[{queue[i]['name']}] cannot start yet: an earlier job's output is "
                      "missing; stopping the queue", flush=True)
                return
            queue[i] = job
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
        lock = lock_path(args.out, job["name"])
        pid = running_elsewhere(lock)
        if pid is not None:   # the child of a killed queue: let it finish its clean stop
            print(f"[{job['name']}] still running (pid {pid}, from an earlier queue); waiting "
                  "for it to stop", flush=True)
            wait_until_free(lock)
            if finished_here(job):
                print(f"[{job['name']}] done", flush=True)
                keep(args, job, finished=True)
                continue
        log = os.path.join(args.out, job["name"] + ".log")
        print(f"[{job['name']}] {' '.join(job['argv'][1:])}  (log {log})", flush=True)
        t0, load0 = time.time(), open("/proc/loadavg").read().split()[0]
        with open(log, "a") as f:
            # dies with this queue, and a restarted queue sees it while it lives
            proc = start_job(job["argv"], REPO, f, lock)
            while True:   # keep a train run's curve as it grows (--results is committed)
                try:
                    rc = proc.wait(timeout=args.keep_every)
                    break
                except subprocess.TimeoutExpired:
                    keep(args, job, finished=False)
        wall = time.time() - t0
        load1 = open("/proc/loadavg").read().split()[0]
        row = dict(job=job["name"], rc=rc, wall_s=round(wall, 1), load_start=load0,
                   load_end=load1, finished=time.strftime("%Y-%m-%d %H:%M:%S"),
                   commit=commit())
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
