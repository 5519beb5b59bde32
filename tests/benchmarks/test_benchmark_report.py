"""The benchmark scripts' summaries: decode figures only when measurable (no timings run)."""
from __future__ import annotations

import pytest

from benchmarks.decode import summarize


def test_sampler_summary_medians_spread_and_unmeasurable():
    runs = [{"total": 3.0, "prefill": 1.0, "decode": 2.0},
            {"total": 2.5, "prefill": 0.9, "decode": 1.6},
            {"total": 4.0, "prefill": 1.2, "decode": 2.5}]
    s = summarize(runs, batch=8, new=65)
    assert s["decode"] == 2.0 and s["prefill"] == 1.0 and s["total"] == 3.0
    assert s["total_tps"] == pytest.approx(8 * 65 / 3.0)
    assert s["decode_tps"] == pytest.approx(8 * 64 / 2.0)          # 256 tok/s
    assert s["spread"] == pytest.approx((8 * 64 / 2.5, 8 * 64 / 1.6))
    # A repeat whose 1-token run took longer than the N-token one: never a figure.
    bad = runs[:2] + [{"total": 1.0, "prefill": 1.1, "decode": -0.1}]
    assert summarize(bad, 8, 65)["decode_tps"] is None
    # Spread wider than the median decode time itself: not measurable either.
    noisy = [{"total": 1, "prefill": 0.5, "decode": d} for d in (0.01, 0.02, 0.5)]
    assert summarize(noisy, 8, 65)["decode_tps"] is None


def test_zero_shot_family_rows_from_trajectories(tmp_path):
    """Per-family figures of the zero-shot table, hand-counted from two written episodes."""
    import json

    from studies.zero_shot.run import family_rows
    step = lambda invalid, rejected: {"invalid": invalid, "env_rejected": rejected}  # noqa: E731
    eps = [dict(task_id="find-plant", success=True, crashed=False, episode_return=1.0,
                strategy_raw="<strategy>x</strategy>", strategy_format_ok=True,
                steps=[step(False, False), step(True, False), step(False, True)]),
           dict(task_id="find-plant", success=False, crashed=False, episode_return=0.25,
                strategy_raw="plan", strategy_format_ok=False,
                steps=[step(True, False)]),
           dict(task_id="power-component", success=True, crashed=True, episode_return=0.5,
                strategy_raw=None, strategy_format_ok=False, steps=[step(False, False)])]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in eps))
    rows = family_rows(str(path), "scienceworld")
    fp = rows["find-plant"]
    assert fp["episodes"] == 2 and fp["success"] == 0.5
    assert fp["score"] == pytest.approx(62.5)                  # 100 x mean(1.0, 0.25)
    assert fp["invalid_frac"] == pytest.approx(2 / 4) and fp["rejected_frac"] == pytest.approx(1 / 4)
    assert fp["strategy_fail_frac"] == 0.5
    pc = rows["power-component"]                               # crashed: no success; flat: no z
    assert pc["success"] == 0.0 and pc["strategy_fail_frac"] is None


@pytest.mark.parametrize("preset", ["cpu", "accelerator"])
def test_learning_real_runs_are_valid_configs(preset, tmp_path):
    """Every run of the real-weights learning benchmark is a config train.py accepts, with the
    matched episode budget: StraTA N*M episodes per task = GRPO's group."""
    import argparse

    from studies.learning_real.run import PRESETS, run_variant
    from configs import builtin, sciworld
    from strata_jax import experiment as ex
    args = argparse.Namespace(out=str(tmp_path), model="qwen2.5-coder-0.5b-instruct", rank=16,
                              lr=2e-5, set=[])
    p = PRESETS[preset]
    for env, mod in (("memory_key", builtin), ("sciworld", sciworld)):
        cs = {}
        for algo in ("strata", "grpo"):
            _, variant = run_variant(args, p, env, algo, 1)
            c = cs[algo] = mod.get_config(variant)
            ex.validate(c)
            assert c.algo == algo and c.seed == 1 and c.lora.rank == 16
            assert c.workdir == str(tmp_path / env / f"{algo}_s1")
        r = cs["strata"].rollout
        assert cs["grpo"].rollout.group_size == r.num_strategies * r.episodes_per_strategy
        assert (r.num_strategies, r.episodes_per_strategy) == (p["n"], p["m"])
    assert cs["grpo"].env.tasks == ("find-non-living-thing", "lifespan-longest-lived",
                                    "lifespan-shortest-lived")


def test_test_time_cells_and_family_rows():
    """S = 1 is one cell (the protocol) whatever the choosers; per-family figures by name."""
    import argparse

    from studies.test_time_scaling.run import cell_name, cells, family_rows
    args = argparse.Namespace(samples=[1, 2, 4], choices=["judge", "critic"], probe_steps=[0, 3])
    got = [cell_name(*c) for c in cells(args)]
    assert got == ["s1", "s2_judge", "s2_critic", "s2_judge_probe3", "s2_critic_probe3",
                   "s4_judge", "s4_critic", "s4_judge_probe3", "s4_critic_probe3"]
    m = {"eval/success": 0.5, "eval/family/boil/success": 1.0, "eval/family/boil/score": 100.0,
         "eval/family/boil/sampled_tokens": 640.0, "eval/family/a/b/env_steps": 7.0,
         "eval/cost/env_steps": 9.0}
    assert family_rows(m) == {"boil": {"success": 1.0, "score": 100.0, "sampled_tokens": 640.0},
                              "a/b": {"env_steps": 7.0}}


def test_cached_cell_runs_once_and_does_not_cache_a_failure(tmp_path):
    """A cell runs its command once; the next call reads the cache; a failed cell is retried."""
    import sys
    from studies.cells import cached_cell
    counter = tmp_path / "runs.txt"
    cmd = [sys.executable, "-c",
           f"open({str(counter)!r}, 'a').write('x'); print('wrote 7')"]
    parse = lambda log: {"value": int(open(log).read().split()[-1])}  # noqa: E731
    first = cached_cell(str(tmp_path), "c", cmd, str(tmp_path), False, parse)
    again = cached_cell(str(tmp_path), "c", cmd, str(tmp_path), False, parse)
    assert first["value"] == again["value"] == 7 and first["cell"] == "c"
    assert counter.read_text() == "x"                       # ran once
    assert again == first                                   # the cached copy, timings included
    assert first["wall_s"] > 0 and {"load_start", "load_end"} <= set(first)
    forced = cached_cell(str(tmp_path), "c", cmd, str(tmp_path), True, parse)
    assert forced["value"] == 7 and counter.read_text() == "xx"
    bad = [sys.executable, "-c", "import sys; sys.exit(3)"]
    assert cached_cell(str(tmp_path), "b", bad, str(tmp_path), False, parse) == {
        "cell": "b", "error": 3}
    assert not (tmp_path / "b.json").exists()               # retried next time
    empty = cached_cell(str(tmp_path), "e", cmd, str(tmp_path), False, lambda log: None)
    assert empty == {"cell": "e", "error": "no result"}


def test_learning_real_fingerprint_ignores_what_a_resume_may_change(tmp_path):
    import json
    from studies.learning_real.run import fingerprint

    def run(name, step, **cfg):
        meta = tmp_path / name / "ckpt" / str(step) / "meta"
        meta.mkdir(parents=True)
        (meta / "metadata").write_text(json.dumps({"config": cfg}))
        return str(tmp_path / name)

    base = dict(seed=0, algo="strata", optim=dict(lr=5e-5), ckpt=dict(every=1))
    a = run("a", 3, workdir="runs/a", iterations=3, **base)
    b = run("b", 5, workdir="runs/b", iterations=5, **dict(base, ckpt=dict(every=2)))
    c = run("c", 3, workdir="runs/a", iterations=3, **dict(base, optim=dict(lr=1e-4)))
    assert len(fingerprint(a)) == 16 and fingerprint(a) == fingerprint(b)
    assert fingerprint(c) != fingerprint(a)                 # a trained setting changed
    assert fingerprint(str(tmp_path / "none")) == ""         # no checkpoint, no fingerprint


@pytest.mark.parametrize("env", ["scienceworld", "memory_key"])
def test_options_cells_differ_from_the_paper_eval_only_in_their_option(env, tmp_path):
    """Every cell of the beyond-the-paper benchmark is an eval.py command whose config (the
    eval.py flags applied) differs from the paper cell's in exactly its option's fields and the
    workdir (the comparison is fair), and that eval accepts."""
    from studies.options.run import CELLS, build_parser, cell_command
    from configs import builtin, sciworld
    from strata_jax import experiment as ex
    from strata_jax.evaluation.scaling import TestTimeConfig
    args = build_parser().parse_args(["--env", env, "--judge", "judge.gguf",
                                      "--out", str(tmp_path)])
    mod = sciworld if env == "scienceworld" else builtin

    def flat(d, pre=""):
        out = {}
        for k, v in d.items():
            out.update(flat(v, pre + k + ".") if isinstance(v, dict) else {pre + k: v})
        return out

    def parse(name):
        cmd = cell_command(args, name)
        c = mod.get_config(cmd[2].partition(":")[2])
        flags = dict(f[2:].split("=", 1) for f in cmd[3:] if "=" in f)
        for k, v in flags.items():   # what eval.py does with its --<eval field> flags
            if k in c.eval:
                c.eval[k] = type(c.eval[k])(v)
        ex.validate(c)
        assert c.workdir == str(tmp_path / name)
        return c, flags

    paper, pflags = parse("paper")
    assert paper.algo == "strata" and paper.rollout.format_examples and paper.env.max_steps == 10
    assert not TestTimeConfig.from_config(paper).enabled
    assert pflags["episodes_per_family"] == ("1" if env == "scienceworld" else "8")
    tts = {"eval.strategy_samples", "eval.probe_steps"}   # strategy_choice "judge" is the default
    expected = {"paper": set(), "revise_every3": {"rollout.revise_every"},
                "revise_stuck": {"rollout.revise_on"}, "tts2_judge": tts,
                "tts2_judge_1.5b": tts | {"rollout.judge_model.path"}, "tts4_judge": tts,
                "tts4_first_action": tts | {"eval.strategy_choice"}}
    assert set(expected) == set(CELLS)
    base = flat(paper.to_dict())
    for name in CELLS:
        c, flags = parse(name)
        now = flat(c.to_dict())
        assert flags["episodes_per_family"] == pflags["episodes_per_family"]
        changed = {k for k in base.keys() | now.keys() if base.get(k) != now.get(k)} - {"workdir"}
        assert changed == expected[name], name
    c, _ = parse("tts4_first_action")
    assert (c.eval.strategy_samples, c.eval.strategy_choice, c.eval.probe_steps) == \
        (4, "first_action", 1)
    c, _ = parse("tts2_judge_1.5b")
    assert c.rollout.judge_model.path == "judge.gguf" and c.eval.probe_steps == 3


def test_run_cells_table_reads_only_the_cache(tmp_path):
    """--table prints the cached cells in cell order and runs nothing; otherwise every cell
    runs (through `run`, which is where cached_cell decides cache or subprocess)."""
    import json

    from studies.cells import run_cells
    (tmp_path / "b.json").write_text(json.dumps({"cell": "b", "x": 2}))
    ran = []
    run = lambda k: ran.append(k) or {"cell": k}  # noqa: E731
    assert run_cells(str(tmp_path), [("a", "A"), ("b", "B")], True, run) == [{"cell": "b", "x": 2}]
    assert ran == []
    assert run_cells(str(tmp_path), [("a", "A"), ("b", "B")], False, run) == \
        [{"cell": "A"}, {"cell": "B"}]
    assert ran == ["A", "B"]


def test_grouping_benchmark_row_lengths_keep_the_mix(tmp_path):
    """iteration.py --part grouping: the step rows of a run's last iteration, spread evenly
    over the sorted lengths when fewer rows are asked for."""
    import json

    from benchmarks.iteration import row_lengths

    def episode(step, lens):
        return {"step": step, "steps": [{"prompt_tokens": p, "output_tokens": o} for p, o in lens]}

    path = tmp_path / "trajectories.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in (
        episode(1, [(900, 5)]),                                    # an earlier iteration
        episode(2, [(400, 7), (620, 0), (1000, 30)]),
        episode(2, [(410, 9), (700, 12), (980, 16)]))) + "\n")
    # output 0 (an empty generation) still trains one token: the row has length >= 1
    assert row_lengths(str(path), 10) == [(400, 7), (410, 9), (620, 1), (700, 12), (980, 16),
                                          (1000, 30)]
    assert row_lengths(str(path), 3) == [(400, 7), (620, 1), (980, 16)]
    path.write_text(json.dumps({"step": 1, "steps": []}) + "\n")
    with pytest.raises(SystemExit, match="no step rows"):
        row_lengths(str(path), 3)


def test_time_updates_warms_up_once_then_times_each_repeat():
    """benchmarks/_timing.py: one warm-up update, the callback, then `repeats` timed updates,
    each fed the previous call's state."""
    import numpy as np

    from benchmarks._timing import time_updates

    events = []

    class Fake:
        def update(self, state, batch, ref_params):
            events.append(("update", state))
            return state + 1, {"n": state + 1}

    state, warm, runs, m = time_updates(Fake(), np.int32(0), None, None, 3,
                                        lambda: events.append(("mark", None)))
    assert [e[0] for e in events] == ["update", "mark", "update", "update", "update"]
    assert [e[1] for e in events if e[0] == "update"] == [0, 1, 2, 3]
    assert state == 4 and m == {"n": 4} and len(runs) == 3 and warm >= 0
    assert all(r >= 0 for r in runs)


def test_summary_lists_every_cached_cell_not_only_this_runs(tmp_path):
    """_cells.write_summary: a run over a subset of the cells (e.g. one more model) adds to the
    summary file instead of replacing the other cells' rows; the summary never lists itself."""
    import argparse
    import json

    from studies.cells import write_summary

    for name in ("b__x", "a__y"):
        (tmp_path / f"{name}.json").write_text(json.dumps({"cell": name, "success": 0.5}))
    (tmp_path / "a__y.log").write_text("log")
    write_summary(str(tmp_path), "summary.json", argparse.Namespace(models=["m1"]))
    (tmp_path / "c__z.json").write_text(json.dumps({"cell": "c__z"}))      # a later run's cell
    path = write_summary(str(tmp_path), "summary.json", argparse.Namespace(models=["m2"]))
    s = json.load(open(path))
    assert [c["cell"] for c in s["cells"]] == ["a__y", "b__x", "c__z"]
    assert s["last_args"] == {"models": ["m2"]}
