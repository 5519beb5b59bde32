"""End to end on real ScienceWorld: the tiny main job with its behaviour-cloning warm start,
preemption + exact resume, an HF checkpoint through --config.model.path, and eval.py on the
result.

One uninterrupted reference run (3 iterations, a `python train.py` subprocess on one CPU
device) serves several tests: it trains
the tiny variant's warm start into a module-wide cache dir (``sft.cache_dir``), which the
preempted run (a real `python train.py` subprocess that receives SIGHUP during iteration 2)
then loads instead of retraining.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from configs import sciworld
from strata_jax import experiment as ex
from strata_jax.metrics import read_jsonl, read_tensorboard
from tests.fixtures.paths import REPO_ROOT
from tests.fixtures.small_job import ONE_DEVICE, restore_run_state

pytestmark = pytest.mark.slow
ROOT = REPO_ROOT
ITERS = 3
# ONE_DEVICE (tests/fixtures/small_job.py): the `python train.py` subprocesses whose test is not
# about sharding run on the one CPU device a user's CPU box has.




def tiny_config(workdir, warm_start_cache, extra=""):
    c = sciworld.get_config("tiny" + extra)
    c.workdir = str(workdir)
    c.iterations = ITERS
    c.sft.cache_dir = str(warm_start_cache)
    c.compilation_cache_dir = ""   # in-process runs: no process-wide jax cache setting
    return c


def restore_state(c, step):
    """The TrainState of checkpoint `step` of run `c` (host numpy leaves) and its meta."""
    return restore_run_state(c, step)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The uninterrupted reference: `python train.py` on one CPU device, as a user's CPU box
    runs it (this process's 8 fake devices would shard the tiny run and make it several times
    slower on 2 cores; sharded runs are test_distributed.py's). It trains the tiny variant's
    warm start into a module-wide cache dir, which the preempted run then loads."""
    c = tiny_config(tmp_path_factory.mktemp("ref"), tmp_path_factory.mktemp("warm_start"))
    # The later runs of this module load the programs this one compiled (the same model
    # shapes): a compilation cache changes no number (test_determinism.py), only start-up time.
    c.compilation_cache_dir = str(tmp_path_factory.mktemp("jax_cache"))
    # log.* may differ from the preempted run's (a resume may change it)
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config=configs/sciworld.py:tiny",
           f"--config.workdir={c.workdir}", f"--config.iterations={ITERS}",
           f"--config.sft.cache_dir={c.sft.cache_dir}", "--config.log.dump_batches=1",
           f"--config.compilation_cache_dir={c.compilation_cache_dir}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                         env=ONE_DEVICE)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return c, out


def _documented_metrics() -> list[str]:
    """Regexes of the metric names docs/metrics.md's tables list in backticks (first column):
    `<name>` placeholders match one path component, a trailing `...` any rest."""
    pats = []
    with open(os.path.join(ROOT, "docs", "metrics.md")) as f:
        for line in f:
            if not line.startswith("| `"):
                continue
            for name in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
                pat = re.escape(name).replace(r"\.\.\.", ".*")   # re.escape keeps < >
                pats.append(re.sub(r"<[^>]+>", "[^/]+", pat))
    return pats


def test_tiny_run_writes_metrics_checkpoints_and_real_observations(reference_run):
    c, out = reference_run
    assert f"done: step {ITERS}" in out.stdout and "fresh run in" in out.stderr
    rows = read_jsonl(os.path.join(c.workdir, "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, ITERS + 1))
    for tag in ("rollout/success_rate", "rollout/mean_return", "rollout/mean_episode_steps",
                "rollout/invalid_step_frac", "rollout/strategy_format_fail_frac",
                "rollout/judge_bad_step_frac", "train/kl", "train/entropy", "train/clip_frac",
                "mismatch/sampler_abs", "time/rollout_s", "time/update_s", "time/env_wait_s",
                "perf/env_steps_per_s", "perf/sampler_tokens_per_s", "compile/count",
                "adv/action_mean", "mem/host_peak_rss_gb"):
        assert tag in rows[-1], tag
    # every logged key is documented in docs/metrics.md's tables (`<task>`: any one name)
    documented = _documented_metrics()
    missing = sorted(k for k in rows[-1] if k not in ("step", "time") and not any(
        re.fullmatch(pat, k) for pat in documented))
    assert not missing, f"metrics not in docs/metrics.md: {missing}"
    # the update's throughput counts every optimizer step's tokens over the update's time
    last = rows[-1]
    assert last["optimizer_steps"] >= 1 and last["train/tokens"] > 0
    np.testing.assert_allclose(last["perf/train_tokens_per_s"], last["train/tokens"]
                               * last["optimizer_steps"] / last["time/update_s"], rtol=1e-6)
    # a high-water mark: never falls, and jax + the tiny model hold more than 200 MiB
    peaks = [r["mem/host_peak_rss_gb"] for r in rows]
    assert peaks == sorted(peaks) and peaks[0] > 0.2, peaks
    for r in rows:
        for k, v in r.items():
            if "loss" in k:
                assert v is not None and np.isfinite(v), (k, v)
    # N x M episodes per task, with the StraTA ids (tiny: 2 tasks, N = M = 2, 4 env steps)
    trajs = read_jsonl(os.path.join(c.workdir, "trajectories.jsonl"))
    first = [t for t in trajs if t["step"] == 1]
    n, m = c.rollout.num_strategies, c.rollout.episodes_per_strategy
    per_task = {}
    for t in first:
        per_task.setdefault(t["task_uid"], []).append((t["strategy_id"], t["trajectory_id"]))
    assert len(per_task) == c.rollout.tasks_per_batch
    for pairs in per_task.values():
        assert sorted(pairs) == [(s, s * m + j) for s in range(n) for j in range(m)]
    # real ScienceWorld observations as the simulator wrote them
    obs = first[0]["steps"][0]["observation"]
    assert obs.startswith("This room is called the ") and "You also see:" in obs
    assert os.path.isdir(os.path.join(c.workdir, "ckpt", str(ITERS)))


def test_dumped_update_batch_holds_the_ids_of_the_episodes_it_trained(reference_run):
    from strata_jax.algos import KIND_ACTION, load_sample_batch
    c, _ = reference_run
    out = os.path.join(c.workdir, "batches")
    assert sorted(os.listdir(out)) == ["iter_0000.npz"]   # log.dump_batches=1: iteration 0 only
    b, meta = load_sample_batch(os.path.join(out, "iter_0000.npz"))
    assert meta["iteration"] == 0 and meta["algo"] == c.algo and meta["env"] == "scienceworld"
    first = {(t["task_uid"], t["trajectory_id"]): t
             for t in read_jsonl(os.path.join(c.workdir, "trajectories.jsonl")) if t["step"] == 1}
    rows = np.flatnonzero(b.valid & (b.kind == KIND_ACTION))
    assert len(rows) == sum(len(t["steps"]) for t in first.values())
    tok = ex.build_tokenizer(c)
    for r in rows:
        step = first[(int(b.task_id[r]), int(b.trajectory_id[r]))]["steps"][int(b.step_index[r])]
        prompt = tok.decode(b.prompt_ids[r][b.prompt_mask[r]].tolist())
        assert step["observation"][:80] in prompt, (r, step["observation"][:80])


def test_tiny_run_starts_from_a_warm_start_whose_actions_reach_scienceworld(reference_run):
    c, _ = reference_run
    exports = os.listdir(c.sft.cache_dir)
    assert len(exports) == 1   # one fingerprint: trained once
    with open(os.path.join(c.sft.cache_dir, exports[0], "sft_meta.json")) as f:
        meta = json.load(f)
    assert meta["episodes"] == c.sft.episodes and meta["expert_success"] == 1.0
    assert meta["first_loss"] > 11.0 and meta["final_loss"] < 1.0   # ln V = 11.93 at the start
    # Iteration 1 is played by the warm start: most of its steps parse into actions that reach
    # the simulator (measured 18.8% invalid with seed 0; the random init's outputs are ~all invalid).
    first = read_jsonl(os.path.join(c.workdir, "metrics.jsonl"))[0]
    assert first["rollout/invalid_step_frac"] < 0.5, first["rollout/invalid_step_frac"]
    trajs = [t for t in read_jsonl(os.path.join(c.workdir, "trajectories.jsonl")) if t["step"] == 1]
    verbs = {s["action"].split()[0] for t in trajs for s in t["steps"] if s["action"]}
    assert verbs & {"look", "open", "go", "focus", "move", "inventory", "pick"}, verbs


def test_sigterm_then_restart_matches_uninterrupted_run(reference_run, tmp_path):
    c_ref, _ = reference_run
    workdir = tmp_path / "preempted"
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config=configs/sciworld.py:tiny",
           f"--config.workdir={workdir}", f"--config.iterations={ITERS}",
           f"--config.sft.cache_dir={c_ref.sft.cache_dir}",   # the reference run's warm start
           f"--config.compilation_cache_dir={c_ref.compilation_cache_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=ONE_DEVICE)
    metrics = workdir / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= 1:
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
    # SIGHUP (a closed terminal) stops as cleanly as SIGTERM (preemption): the iteration in
    # flight finishes, is saved, and the run exits. Step 1's metrics line is written just
    # before its end-of-iteration stop check, so on a loaded box the signal can still land in
    # iteration 1 (then it stops at step 1, correctly); usually it stops at step 2.
    proc.send_signal(signal.SIGHUP)
    out = proc.communicate(timeout=600)[0].decode()
    assert proc.returncode == 75, out[-3000:]   # preempted with a checkpoint, not finished
    saved = re.search(r"preempted: step (\d+) saved", out)
    assert "SIGHUP received: will checkpoint" in out and saved, out[-3000:]
    stopped = int(saved.group(1))
    assert stopped in (1, 2), out[-3000:]
    assert read_jsonl(str(metrics))[-1]["step"] == stopped    # no iteration past the save
    # restart: resumes from the saved step and runs the rest to step 3
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env=ONE_DEVICE)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "done: step 3" in out.stdout
    assert f"resumed from step {stopped}" in out.stderr
    c = tiny_config(workdir, c_ref.sft.cache_dir)
    resumed, meta = restore_state(c, ITERS)
    ref, ref_meta = restore_state(c_ref, ITERS)
    ref_prev, _ = restore_state(c_ref, ITERS - 1)
    # the whole checkpointed state: params, optimizer moments, PRNG key, step
    diff = max(float(np.max(np.abs(a.astype(np.float64) - b))) for a, b in
               zip(jax.tree.leaves(resumed), jax.tree.leaves(ref)))
    moved = max(float(np.max(np.abs(a - b))) for a, b in
                zip(jax.tree.leaves(ref.params), jax.tree.leaves(ref_prev.params)))
    assert moved > 1e-4, "iteration 3 must move the params far more than the tolerance"
    assert diff <= 1e-6, diff
    assert meta["sampler_state"] == ref_meta["sampler_state"] is not None
    # both processes loaded compiled programs from the module's persistent compilation cache
    # (the reference run wrote them; the restart's last row counts its own process's loads)
    first, *_, last = read_jsonl(os.path.join(str(workdir), "metrics.jsonl"))
    assert first["compile/cache_hits"] >= 5 and last["compile/cache_hits"] >= 5, last
    # the logs: metrics.jsonl and the TensorBoard events read back (with TensorBoard's purge on
    # restart) hold one point per step, equal to the uninterrupted run's
    want = _deterministic_rows(os.path.join(c_ref.workdir, "metrics.jsonl"))
    got = _deterministic_rows(os.path.join(str(workdir), "metrics.jsonl"))
    assert [s for s, _ in got] == [s for s, _ in want] == list(range(1, ITERS + 1))
    for (_, g), (_, w) in zip(got, want):
        assert g.keys() == w.keys()
        for k in w:
            assert g[k] == pytest.approx(w[k], rel=1e-4, abs=1e-6, nan_ok=True), k
    tb_ref = read_tensorboard(os.path.join(c_ref.workdir, "tb"))
    tb = read_tensorboard(os.path.join(str(workdir), "tb"))
    assert tb.keys() == tb_ref.keys()
    rows = read_jsonl(os.path.join(str(workdir), "metrics.jsonl"))
    for tag, series in tb_ref.items():
        # one point per step that logged the tag (a family's tags only when it was drawn)
        in_jsonl = [r["step"] for r in rows if tag in r]
        assert [s for s, _ in tb[tag]] == [s for s, _ in series] == in_jsonl, tag
        if _deterministic(tag):
            np.testing.assert_allclose([v for _, v in tb[tag]], [v for _, v in series],
                                       rtol=1e-4, atol=1e-6, err_msg=tag)


def _deterministic(tag):
    """Tags that replay exactly (not wall times, throughputs, compile counts or peak memory)."""
    return not tag.startswith(("time/", "perf/", "compile/", "mem/"))


def _deterministic_rows(path):
    return [(r["step"], {k: (np.nan if v is None else v) for k, v in r.items()
                         if k not in ("step", "time") and _deterministic(k)})
            for r in read_jsonl(path)]


def test_kill_9_after_an_eval_row_resumes_without_logging_it_twice(reference_run, tmp_path):
    # the warm start off, 3 iterations, a checkpoint every iteration, eval every 2: kill -9 as
    # soon as the step-2 eval row is in metrics.jsonl, rerun the same command (the reference
    # run's compiled programs: same model shapes)
    workdir = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config=configs/sciworld.py:tiny",
           f"--config.workdir={workdir}", "--config.iterations=3", "--config.model.warm_start=",
           "--config.ckpt.every=1", "--config.eval.every=2",
           f"--config.compilation_cache_dir={reference_run[0].compilation_cache_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=ONE_DEVICE)
    metrics = workdir / "metrics.jsonl"
    deadline = time.time() + 600
    try:
        while time.time() < deadline and proc.poll() is None:
            if metrics.exists() and any(r.get("step") == 2 and "eval/success" in r
                                        for r in _rows(metrics)):
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before its step-2 eval row could be seen"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env=ONE_DEVICE)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resumed from step 2" in out.stderr and "done: step 3" in out.stdout
    kinds = [(r["step"], "eval" if "eval/success" in r else "train") for r in _rows(metrics)]
    assert kinds == [(1, "train"), (2, "train"), (2, "eval"), (3, "train")]
    tb = read_tensorboard(str(workdir / "tb"))
    assert [s for s, _ in tb["eval/success"]] == [2]
    assert [s for s, _ in tb["rollout/success_rate"]] == [1, 2, 3]
    for tag in ("rollout/env_crashes", "rollout/env_restarts", "rollout/env_retries"):
        assert [r[tag] for r in _rows(metrics) if tag in r] == [0.0, 0.0, 0.0], tag


def _rows(path):
    """metrics.jsonl rows; a line being written (torn) is skipped without a warning here."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def test_hf_checkpoint_trains_and_eval_prints_families(tmp_path):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hf_cfg = Qwen2Config(vocab_size=151936, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True)
    hf_dir = tmp_path / "hf"
    Qwen2ForCausalLM(hf_cfg).save_pretrained(hf_dir)
    workdir = tmp_path / "run"
    common = [f"--config.workdir={workdir}", f"--config.model.path={hf_dir}",
              "--config.model.preset=", "--config.model.tokenizer=offline",
              "--config.model.warm_start="]   # this checkpoint as is, no behaviour cloning
    out = subprocess.run([sys.executable, "train.py", "--config=configs/sciworld.py:tiny",
                          "--config.iterations=1", *common],
                         cwd=ROOT, capture_output=True, text=True, timeout=900, env=ONE_DEVICE)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "done: step 1" in out.stdout
    out = subprocess.run([sys.executable, "eval.py", "--config=configs/sciworld.py:tiny",
                          "--split=dev", "--episodes_per_family=2", *common], cwd=ROOT,
                         capture_output=True, text=True, timeout=900, env=ONE_DEVICE)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0] == f"evaluating checkpoint step 1 of {workdir}"   # nothing else is loaded
    fams = [l.split()[0] for l in lines if "success" in l and not l.startswith("overall")]
    assert sorted(fams) == sorted(sciworld.TINY_TASKS)
    overall = [l for l in lines if l.startswith("overall: success")]
    assert len(overall) == 1 and "episodes 4  (step 1)" in overall[0]
    stem = workdir / "eval_dev_step1"
    assert lines[-2:] == [f"wrote {stem}.json", f"wrote {stem}_trajectories.jsonl"]
    assert lines[-3] == ("scores are scienceworld's own, 0-100 (training prints returns on a "
                         "0-1 scale: score / 100)")   # an HF checkpoint: no tiny-model note
    saved = json.loads((workdir / "eval_dev_step1.json").read_text())
    assert saved["eval/episodes"] == 4.0 and saved["step"] == 1
    episodes = read_jsonl(f"{stem}_trajectories.jsonl")
    assert len(episodes) == 4 and {e["task_id"] for e in episodes} == set(sciworld.TINY_TASKS)
    # what the rollout measured is kept: the fractions match the episodes written
    steps = [s for e in episodes for s in e["steps"]]
    assert saved["eval/invalid_step_frac"] == pytest.approx(
        sum(s["invalid"] for s in steps) / len(steps))
    assert saved["eval/env_rejected_frac"] == pytest.approx(
        sum(s["env_rejected"] for s in steps) / len(steps))
