"""The tiny-model learning study's aggregation (studies/learning/run.py): per-iteration mean
and min-max over seeds, ScienceWorld score = 100 x mean return, runs cut to the shortest; the
plot is a real PNG."""
import pytest


@pytest.fixture(scope="module")
def learning():
    from studies.learning import run
    return run


def _run(env, algo, seed, success, ret, wall=10.0):
    n = len(success)
    return dict(env=env, algo=algo, seed=seed, success=success, mean_return=ret,
                episodes=[32.0] * n, invalid_step_frac=[0.5] * n, wall_s=wall, iterations=n)


def test_summarise_means_spreads_and_scores(learning, tmp_path, capsys):
    runs = [_run("memory_key", "strata", 0, [0.0, 0.5, 1.0], [0.0, 0.5, 1.0]),
            _run("memory_key", "strata", 1, [0.25, 0.25], [0.25, 0.25], wall=20.0),
            _run("memory_key", "grpo", 0, [0.125, 0.125, 0.25], [0.1, 0.1, 0.2]),
            _run("sciworld", "strata", 0, [0.0, 0.5], [0.2, 0.45])]
    mk = learning.summarise(runs, "memory_key")
    s = mk["strata"]
    assert s["seeds"] == 2 and s["iterations"] == 2          # cut to the shorter run
    assert s["success_mean"] == [0.125, 0.375]
    assert s["success_min"] == [0.0, 0.25] and s["success_max"] == [0.25, 0.5]
    assert s["wall_s"] == 30.0 and s["episodes_per_iteration"] == 32.0
    assert mk["grpo"]["success_mean"] == [0.125, 0.125, 0.25]
    sw = learning.summarise(runs, "sciworld")
    assert sw["strata"]["score_mean"] == pytest.approx([20.0, 45.0])
    out = capsys.readouterr().out
    assert "it  1  success 0.375 [0.250, 0.500]" in out and "score   45.0" in out
    path = str(tmp_path / "learning.png")
    learning.plot({"memory_key": mk, "sciworld": sw}, path)
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
