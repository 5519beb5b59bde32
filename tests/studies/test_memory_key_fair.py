"""The fair memory_key study's queue (studies/memory_key_fair/run.py): the registered jobs in
order, one warm start for every arm (the same fingerprint from every job's config), each arm's
config as the write-up registers it, the final evals on the run's own config and kept adapters
at the start evals' seed, and the seed-level statistics on hand values."""
from __future__ import annotations

import math
import os

import pytest

from strata_jax.jobs import warm_start
from strata_jax.models import Qwen2Config
from strata_jax.training import sft
from studies.memory_key import stats
from studies.memory_key_fair import run as fair
from tests.fixtures.study_jobs import job_config

MODEL = Qwen2Config(vocab_size=151936, hidden_size=16, intermediate_size=32, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=8, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def queue(tmp_path_factory):
    # an empty --results: the committed one records the study's own warm start
    a = fair.registered_args(["--out", str(tmp_path_factory.mktemp("runs")),
                              "--results", str(tmp_path_factory.mktemp("results"))])
    return a, fair.jobs(a)


def test_the_registered_jobs_in_order(queue):
    a, q = queue
    names = [j["name"] for j in q]
    assert names[:3] == ["warm_start", "start_strata", "start_flat"]
    runs = [n for n in names if n.startswith("run_")]
    assert runs == ["run_grpo_full_s0", "run_strata_traj_s0", "run_strata_s2",
                    "run_grpo_full_s1", "run_strata_traj_s1", "run_strata_s3",
                    "run_grpo_full_s2", "run_strata_traj_s2", "run_strata_s4"]
    i = names.index("run_strata_s2")
    assert names[i + 1:i + 4] == ["final_strata_s2_test", "final_strata_s2_d2",
                                  "final_strata_s2_long"]
    assert names[-4:] == ["start_strata_d2", "start_flat_d2", "start_strata_long",
                          "start_flat_long"]
    assert len(names) == 3 + 9 * 4 + 4


def test_every_arm_starts_from_the_one_warm_start(queue):
    a, q = queue
    by = {j["name"]: j for j in q}

    def fp(name):
        c = job_config(by[name])
        return warm_start.fingerprint(c, MODEL, sft.SFTConfig.from_config(c))
    ws = fp("warm_start")
    assert {fp(n) for n in ("start_strata", "start_flat", "run_grpo_full_s0",
                            "run_strata_traj_s1", "run_strata_s4", "final_grpo_full_s2_test",
                            "final_strata_s3_test")} == {ws}
    c = job_config(by["warm_start"])
    assert (c.sft.flat_prompts, c.sft.strata_prompts, c.rollout.cumulative_prompts) == (
        "full", "run", False)


def test_each_arms_config_is_the_registered_one(queue):
    a, q = queue
    by = {j["name"]: j for j in q}
    g, t, s = (job_config(by[n]) for n in ("run_grpo_full_s1", "run_strata_traj_s0",
                                        "run_strata_s3"))
    assert (g.algo, t.algo, s.algo) == ("grpo", "strata_traj", "strata")
    assert (g.rollout.cumulative_prompts, t.rollout.cumulative_prompts,
            s.rollout.cumulative_prompts) == (True, False, False)
    assert g.rollout.group_size == 8 == s.rollout.num_strategies * s.rollout.episodes_per_strategy
    for c in (g, t, s):   # the same episodes and hyper-parameters in every arm
        assert (c.iterations, c.lora.rank, c.optim.lr, c.rollout.temperature,
                c.rollout.num_strategies, c.rollout.episodes_per_strategy, c.rollout.oversample,
                c.env.history_length, c.loss.entropy_coef) == (10, 16, 2e-5, 0.6, 4, 2, 4, 2, 0)
    assert (g.seed, t.seed, s.seed) == (1, 0, 3)


def test_final_evals_run_the_runs_config_from_its_adapters_at_the_start_seed(queue):
    a, q = queue
    by = {j["name"]: j for j in q}
    run, ev = job_config(by["run_strata_traj_s2"]), job_config(by["final_strata_traj_s2_test"])
    assert ev.seed == 0 == job_config(by["start_strata"]).seed
    for key in ("algo", "lora.rank", "rollout.cumulative_prompts", "env.code_digits",
                "model.warm_start"):
        sec, _, field = key.rpartition(".")
        assert (run[sec][field] if sec else run[field]) == (ev[sec][field] if sec else ev[field])
    assert by["final_strata_traj_s2_test"]["argv"][-1] == (
        "--adapter=" + os.path.join(os.path.abspath(a.out), "run_strata_traj_s2", "adapters",
                                    "step10"))
    d2, long = job_config(by["final_strata_traj_s2_d2"]), job_config(by["final_strata_traj_s2_long"])
    assert (d2.env.code_digits, long.env.corridor_rooms, long.env.code_digits) == (2, "6-7", 1)
    assert d2.model.warm_start == fair.WARM
    assert fair.resolve(a, by["final_strata_traj_s2_d2"]) is None   # no warm start yet
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "warm_start.log"), "w") as f:
        f.write("step 10 ...\ntrained: runs/warm_start/0123456789ab  (episodes 32, ...)\n")
    job = fair.resolve(a, by["final_strata_traj_s2_d2"])
    assert job_config(job).model.warm_start == "runs/warm_start/0123456789ab"
    assert fair.resolve(a, by["run_strata_s2"]) is by["run_strata_s2"]


def test_resolve_falls_back_to_the_kept_export_record(queue, tmp_path):
    a, q = queue
    job = [j for j in q if j["name"] == "final_strata_traj_s2_d2"][0]
    b = fair.registered_args(["--out", str(tmp_path / "runs"), "--results", str(tmp_path)])
    assert fair.resolve(b, job) is None
    os.makedirs(tmp_path / "warm_start")
    (tmp_path / "warm_start" / "export.json").write_text(
        '{"dir": "runs/warm_start/feedfacecafe", "model_safetensors_sha256": "00"}')
    assert job_config(fair.resolve(b, job)).model.warm_start == "runs/warm_start/feedfacecafe"


def test_seed_level_statistics_on_hand_values():
    # gains .1, .3, .5: mean .3, sd .2, t(.975, 2) = 4.302653 -> half-width .496828
    m, lo, hi = stats.mean_t_interval([0.1, 0.3, 0.5])
    assert math.isclose(m, 0.3) and math.isclose(hi - m, 0.4968275, rel_tol=1e-6)
    assert math.isclose(m - lo, hi - m)
    one = stats.mean_t_interval([0.2])
    assert one[0] == 0.2 and math.isnan(one[1])
    # Welch: t = .2 / sqrt(.04/3 + .01/3) = 1.549193, df = 2.941176 -> two-sided p = 2 * t.sf(t, df)
    assert math.isclose(stats.welch_p([0.1, 0.3, 0.5], [0.0, 0.1, 0.2]), 0.220881, abs_tol=1e-5)
    assert math.isnan(stats.welch_p([0.1], [0.2, 0.3]))
    with pytest.raises(ValueError):
        stats.mean_t_interval([])


def test_a_damaged_kept_record_is_one_line_with_what_to_do(tmp_path, capsys):
    res = tmp_path / "res"
    (res / "start_strata").mkdir(parents=True)
    (res / "start_strata" / "job.json").write_text("garbage")
    rc = fair.main(["--list", "--out", str(tmp_path / "runs"), "--results", str(res)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err
    assert err.startswith(f"error: {res / 'start_strata' / 'job.json'} is damaged (")
    assert "restore it (git checkout -- " in err
    (res / "start_strata" / "job.json").write_text("[1]")   # valid JSON, not a record
    assert fair.main(["--list", "--out", str(tmp_path / "runs"), "--results", str(res)]) == 0


@pytest.mark.parametrize("flag, value, said", [
    ("--micro", "0", "expected an integer >= 1, got '0'"),
    ("--micro", "four", "expected an integer >= 1, got 'four'"),
    ("--remat", "some", "invalid choice: 'some'"),
    ("--keep-every", "-5", "expected a number of seconds > 0, got '-5'"),
    ("--keep-every", "nan", "expected a number of seconds > 0, got 'nan'"),
])
def test_a_bad_memory_knob_is_a_usage_error_before_any_job(tmp_path, capsys, flag, value, said):
    with pytest.raises(SystemExit) as stop:
        fair.main([flag, value, "--list", "--out", str(tmp_path / "runs")])
    assert stop.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_the_memory_knobs_parse_to_their_values(tmp_path):
    a = fair.registered_args(["--micro", "2", "--remat", "dots", "--keep-every", "30.5",
                              "--out", str(tmp_path)])
    assert (a.micro, a.remat, a.keep_every) == (2, "dots", 30.5)
