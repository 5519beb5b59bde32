"""The memory_key learning study's statistics (studies/memory_key/stats.py) on hand-computed
cases, and its episode reading, queue and report."""
from __future__ import annotations

import math

import pytest

from studies.memory_key import stats as st


def test_wilson_interval_matches_the_formula():
    # Wilson (1927): (p + z^2/2n +- z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n), 2 of 8
    z, n, p = 1.959963984540054, 8, 0.25
    d = 1 + z * z / n
    mid, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    lo, hi = st.wilson(2, 8)
    assert lo == pytest.approx(mid - half, abs=1e-9) and hi == pytest.approx(mid + half, abs=1e-9)
    assert (round(lo, 4), round(hi, 4)) == (0.0715, 0.5907)
    assert st.wilson(0, 48)[0] == 0.0
    with pytest.raises(ValueError, match="0 <= k <= n"):
        st.wilson(9, 8)


def test_fisher_one_sided_is_the_hypergeometric_tail():
    # margins: 2 successes among 16 episodes, 8 per arm; P(arm 1 holds both) = C(8,2)/C(16,2)
    assert st.fisher_greater(2, 8, 0, 8) == pytest.approx(28 / 120)
    # the other direction: arm 1 holds none of them is no evidence at all
    assert st.fisher_greater(0, 8, 2, 8) == pytest.approx(1.0)


def test_mcnemar_counts_the_discordant_pairs():
    after = [True, True, True, False, False]
    before = [False, False, True, True, False]
    p, b, c = st.mcnemar_greater(after, before)
    assert (b, c) == (2, 1) and p == pytest.approx(4 / 8)     # P(Binom(3, 1/2) >= 2)
    assert st.mcnemar_greater([True] * 6, [False] * 6)[0] == pytest.approx(1 / 64)
    assert st.mcnemar_greater([True, False], [True, False]) == (1.0, 0, 0)
    with pytest.raises(ValueError, match="equal lengths"):
        st.mcnemar_greater([True], [True, False])


def test_cochran_armitage_by_hand():
    # p = 3/12; T = sum t (s - n p) = 2; Var = p q (sum n t^2 - (sum n t)^2 / N) = 0.1875 * 8
    z, p = st.cochran_armitage([0, 1, 2], [4, 4, 4])
    assert z == pytest.approx(2 / math.sqrt(1.5))
    assert p == pytest.approx(0.5 * math.erfc(z / math.sqrt(2)))
    assert st.cochran_armitage([2, 1, 0], [4, 4, 4])[0] == pytest.approx(-z)
    assert st.cochran_armitage([0, 0, 0], [4, 4, 4]) == (0.0, 1.0)


def test_fisher_power_and_the_detectable_rate():
    # equal rates: the rejection probability is the exact test's size, at most alpha
    assert st.fisher_power(0.1, 0.1, 20) <= 0.05
    # n=4 per arm: the only rejecting table is 4 of 4 against 0 of 4 (p = 1/70)
    assert st.fisher_power(0.5, 0.5, 4) == pytest.approx(0.5 ** 4 * 0.5 ** 4)
    p1 = st.detectable_rate(0.1, 48)
    assert st.fisher_power(p1, 0.1, 48) >= 0.8 > st.fisher_power(p1 - 0.01, 0.1, 48)


# ---------------------------------------------------------------- the study's episode reading

def _traj(strategy, actions, success, code="6-1-6", invalid=()):
    obs0 = (f"You are at the south end of a corridor. A note on the wall reads: 'vault code "
            f"{code}'. The note crumbles to dust as you read it.")
    steps = [dict(observation=obs0 if i == 0 else f"You are in the corridor, room {i} of 4.",
                  action=a, output=f"<think>x</think><action>{a}</action>", invalid=i in invalid)
             for i, a in enumerate(actions)]
    return dict(variation=1100, success=success, strategy=strategy, steps=steps)


def test_names_code_needs_a_code_word_and_the_digits_in_order():
    from studies.memory_key.episodes import names_code
    assert names_code("2. Enter the code 6-1-6 at the vault", "616")
    assert names_code("remember: vault code 616", "616")
    assert names_code("enter 6, 1, 6", "616")
    assert not names_code("enter 6-1-7", "616") and not names_code("enter 16160", "616")
    # one digit: list numbers and counts are not the code
    assert not names_code("1. go north (4 times)\n2. enter the vault code", "4")
    assert names_code("1. go north (3 times)\n2. enter 4", "4")
    assert not names_code(None, "4") and not names_code("enter 4", "")


def test_episode_rows_carrying_and_leaks():
    from studies.memory_key.episodes import episode_rows, summary, task_code
    walk = ["go north"] * 4
    carried = _traj("1. go north (4 times)\n2. enter 616", walk + ["enter 616"], True)
    assert task_code(carried) == "616"
    # a flat success that kept the code in view by re-typing it (refused) two steps before
    leak = _traj(None, ["go north", "go north", "enter 616", "go north", "enter 616"], True)
    # a format-invalid output whose 30-character tail names the code
    tail = _traj(None, walk + ["enter 616"], True, invalid=(3,))
    tail["steps"][3]["output"] = "I must not forget: the code 616"
    # the same words before the last 30 characters: not shown in the prompt, not a leak
    cut = _traj(None, walk + ["enter 616"], True, invalid=(3,))
    cut["steps"][3]["output"] = "the code 616, " + "and then I keep walking north a lot"
    guess = _traj("1. walk north\n2. enter the code", walk + ["enter 616"], True)
    short = _traj(None, ["go north", "enter 616"], True)    # the note is still in the window
    fail = _traj("plan", walk + ["enter 1"], False)
    # typed once, early: out of the 2-step window by the keypad
    early = _traj(None, ["go north", "enter 616", "go north", "go north", "enter 616"], True)
    trajs = [carried, leak, tail, guess, short, fail, early, cut]
    rows = episode_rows(trajs)
    assert [r["carries"] for r in rows] == [True] + [False] * 7
    assert [r["leaked"] for r in rows] == [False, True, True, False, True, False, False, False]
    assert [r["strategy"] for r in rows] == [True, False, False, True, False, True, False, False]
    s = summary(rows)
    assert (s["k"], s["n"], s["leaked_successes"]) == (7, 8, 3)
    assert s["carries"] == pytest.approx(1 / 3)
    assert s["invalid_step_frac"] == pytest.approx(2 / sum(len(t["steps"]) for t in trajs))


def test_queue_keeps_finished_jobs_for_a_fresh_clone(tmp_path):
    """A finished job's outputs are copied to --results with its argv; a fresh clone (another
    --out) skips it only for the same argv, gets the files back, and a train run counts as
    kept only with its final eval (its checkpoint is not kept)."""
    import argparse
    import json
    import os

    from studies.memory_key import queue as ls
    args = argparse.Namespace(out=str(tmp_path / "runs"), results=str(tmp_path / "kept"),
                              keep_every=1.0)
    wd = tmp_path / "runs" / "run_strata_s0"
    wd.mkdir(parents=True)
    py, repo = "/usr/bin/python", ls.REPO
    run = dict(name="run_strata_s0", done=str(wd / "DONE"), kept_with="final_strata_s0",
               argv=[py, os.path.join(repo, "train.py"), f"--config=x:workdir={wd}"])
    final = dict(name="final_strata_s0", done=str(wd / "eval_test_step2.json"),
                 argv=[py, os.path.join(repo, "eval.py"), f"--config=x:workdir={wd}"])
    queue = [run, final]
    (wd / "metrics.jsonl").write_text('{"step": 0}\n')
    (wd / "trajectories.jsonl").write_text('{"step": 0, "success": true}\n')
    (wd / "ckpt").mkdir()
    (wd / "batches").mkdir()
    (wd / "batches" / "iter_0.npz").write_bytes(b"ids")
    ls.keep(args, run, finished=False)             # a running job: its curve, not done
    assert sorted(os.listdir(tmp_path / "kept" / "run_strata_s0")) == ["batches", "metrics.jsonl",
                                                                       "trajectories.jsonl"]
    assert not ls.is_kept(args, run, queue)
    ls.keep(args, run, finished=True)
    assert ls.job_key(run) == ["train.py", f"--config=x:workdir={wd}"]
    assert not ls.is_kept(args, run, queue)        # its final eval is not kept yet
    (wd / "eval_test_step2.json").write_text('{"eval/success": 0.25}')
    (wd / "eval_test_step2_trajectories.jsonl").write_text("{}\n")
    ls.keep(args, final, finished=True)
    assert sorted(os.listdir(tmp_path / "kept" / "final_strata_s0")) == [
        "eval_test_step2.json", "eval_test_step2_trajectories.jsonl", "job.json"]
    assert ls.is_kept(args, run, queue) and ls.is_kept(args, final, queue)
    changed = dict(final, argv=final["argv"] + ["--episodes_per_family=8"])
    assert not ls.is_kept(args, changed, [run, changed])     # another setting: another job
    assert not ls.is_kept(args, run, [run, changed])
    # a fresh clone: the workdir is gone; restoring brings back exactly the kept files
    for f in os.listdir(wd):
        if f == "batches":
            os.remove(wd / f / "iter_0.npz")
        elif f != "ckpt":
            os.remove(wd / f)
    ls.restore(args, final)
    ls.restore(args, run)
    assert json.loads((wd / "eval_test_step2.json").read_text()) == {"eval/success": 0.25}
    assert (wd / "batches" / "iter_0.npz").read_bytes() == b"ids"
    assert sorted(os.listdir(wd)) == [".final_strata_s0.argv.json", ".run_strata_s0.argv.json",
                                      "batches", "ckpt", "eval_test_step2.json",
                                      "eval_test_step2_trajectories.jsonl", "metrics.jsonl",
                                      "trajectories.jsonl"]
    # done here: the done file with this argv's marker; another setting's job is not
    assert ls.finished_here(final) and not ls.finished_here(changed)
    assert not ls.finished_here(run)               # its DONE file is not kept
    assert ls.is_kept(args, dict(run, local=True), queue) is False   # the warm start: never


def test_train_set_reaches_the_runs_only(tmp_path):
    """--train-set overrides go into the RL runs and their final evals; the warm start's and
    the start evals' command lines stay those of a study without it (their kept results count)."""
    from studies.memory_key import queue
    from studies.memory_key.run import build_parser
    base = ["--warm-start", "mask", "--out", str(tmp_path / "runs"), "--seeds", "1"]
    plain = {j["name"]: j["argv"] for j in queue.jobs(build_parser().parse_args(base))}
    args = build_parser().parse_args(base + ["--train-set", "train.pack_prefixes=true"])
    got = {j["name"]: j["argv"] for j in queue.jobs(args)}
    assert list(got) == ["warm_start", "start_strata", "start_flat", "run_strata_s0",
                         "final_strata_s0", "run_grpo_s0", "final_grpo_s0"]
    for name, argv in got.items():
        runs = name.startswith(("run_", "final_"))
        assert any(a.endswith(",train.pack_prefixes=true") for a in argv) == runs, name
        if not runs:
            assert argv == plain[name], name


def test_report_of_the_kept_study_reproduces_its_tests(tmp_path, monkeypatch):
    """The committed study (StraTA and GRPO, seeds 0 and 1, 10 iterations each, and their
    starts), as --results keeps them, gives the report its write-up (studies/memory_key/README.md)
    quotes: StraTA 13 / 48 -> 47 / 48 and 32 / 48 with their Fisher and McNemar p-values and training curves, GRPO's
    10 / 48 -> 8 / 48 and 0 / 48, the mean gains; the figure's eval points sit at iterations 0
    and 10 (seed 1's runs were re-run with --remat full: a memory knob, still the same jobs);
    the json and the figure are written."""
    import json
    import os
    import shutil

    from studies.memory_key import queue, report
    from studies.memory_key.run import build_parser
    monkeypatch.chdir(queue.REPO)   # the kept argv names the checkout's runs/study_k50
    args = build_parser().parse_args([
        "--warm-start", "mask", "--plan-code-keep", "0.5", "--no-guesses", "--sigma", "4",
        "--sft-steps", "20", "--sft-lr", "2e-5", "--sft-episodes", "32", "--seeds", "2",
        "--n", "4", "--m", "2", "--lr", "2e-5", "--iterations", "10", "--micro", "4",
        "--out", "runs/study_k50",
        "--results", "studies/memory_key/results/k50_t06_lr2e5_m4",
        "--train-set", "loss.entropy_coef=0", "rollout.temperature=0.6",
        "train.pack_prefixes=true"])
    jobs = queue.jobs(args)
    kept = [j for j in jobs if queue.is_kept(args, j, jobs)]
    assert {j["name"] for j in kept} == {"start_strata", "start_flat"} | {
        f"{kind}_{algo}_s{seed}" for kind in ("run", "final") for algo in ("strata", "grpo")
        for seed in (0, 1)}
    out = tmp_path / "study"   # the kept files where the report reads them, not in runs/
    for j in kept:
        shutil.copytree(queue.kept_dir(args, j),
                        out / os.path.basename(os.path.dirname(j["done"])), dirs_exist_ok=True)
    args.out = str(out)
    res = report.report(args)
    assert res["policies"]["start_strata"]["k"] == 13 and res["policies"]["strata_s0"]["k"] == 47
    t = res["tests"]["strata_s0"]
    assert (t["only_trained"], t["only_start"]) == (34, 0)
    assert 2e-14 < t["fisher_p"] < 4e-14 and 5e-11 < t["mcnemar_p"] < 7e-11
    cur = res["curves"]["strata_s0"]
    assert cur["successes"] == [1, 3, 3, 8, 6, 8, 8, 7, 8, 8] and cur["episodes"] == [8] * 10
    # GRPO (:matched, flat) from the same start: 10 / 48 -> 8 / 48; the gains' difference
    assert res["policies"]["start_flat"]["k"] == 10 and res["policies"]["grpo_s0"]["k"] == 8
    assert res["curves"]["grpo_s0"]["successes"] == [0, 2, 1, 6, 1, 0, 0, 1, 0, 1]
    # seed 1: StraTA 32 / 48 (23 tasks only trained, 4 only start), GRPO 0 / 48
    assert res["policies"]["strata_s1"]["k"] == 32 and res["policies"]["grpo_s1"]["k"] == 0
    t = res["tests"]["strata_s1"]
    assert (t["only_trained"], t["only_start"]) == (23, 4)
    assert 9e-5 < t["fisher_p"] < 1.1e-4 and 1.4e-4 < t["mcnemar_p"] < 1.7e-4
    assert res["curves"]["strata_s1"]["successes"] == [4, 2, 4, 3, 8, 6, 8, 8, 8, 8]
    assert res["curves"]["grpo_s1"]["successes"] == [0, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    # mean gains over the seeds, and their difference
    assert res["gains"]["strata"] == pytest.approx((47 + 32 - 2 * 13) / 96)
    assert res["gains"]["grpo"] == pytest.approx((8 + 0 - 2 * 10) / 96)
    assert res["gains"]["strata_minus_grpo"] == pytest.approx((47 + 32 - 26 - 8 + 20) / 96)
    assert [(it, p["k"]) for it, p in report.eval_points(res, "strata")] == [(0, 13), (10, 47),
                                                                         (10, 32)]
    assert [(it, p["k"]) for it, p in report.eval_points(res, "grpo")] == [(0, 10), (10, 8), (10, 0)]
    assert json.load(open(out / "learning_study.json"))["tests"]
    assert os.path.getsize(out / "learning_study.png") > 10_000


def test_a_memory_knob_does_not_make_another_setting():
    """A job re-run with a smaller micro-batch or another remat policy (after an OOM) still
    matches its kept result; any other override, or the same knob's name inside another
    token's value, does not."""
    from studies.memory_key import queue as ls
    base = ["eval.py", "--config=configs/builtin.py:tiny,real,strata,optim.lr=2e-05,"
            "optim.micro_batch_rows=8,model.remat=dots", "--split=test"]
    knobs = [base[0], base[1].replace("micro_batch_rows=8", "micro_batch_rows=4")
             .replace("remat=dots", "remat=full"), base[2]]
    assert ls.same_setting(base, knobs)
    # a retired field (the kept study's train.pack_prefixes=true) is ignored by runs and here
    assert ls.same_setting(base, [base[0], base[1] + ",train.pack_prefixes=true", base[2]])
    assert not ls.same_setting(base, [base[0], base[1].replace("lr=2e-05", "lr=1e-04"),
                                      base[2]])
    assert not ls.same_setting(base, [base[0], base[1] + ",seed=1", base[2]])
    assert not ls.same_setting(base, base[:2] + ["--split=dev"])
    assert not ls.same_setting(base, None)
