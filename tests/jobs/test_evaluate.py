"""What eval.py prints beside the metrics (strata_jax.jobs.evaluate): the scores' scale, the
tiny model's note, and an unknown split refused before any model is loaded."""
import os
import subprocess
import sys

from strata_jax.jobs.evaluate import report, score_scale_line, tiny_model_note
from tests.fixtures.paths import REPO_ROOT


def test_the_score_scale_is_printed_in_the_envs_units():
    assert score_scale_line("scienceworld") == (
        "scores are scienceworld's own, 0-100 (training prints returns on a 0-1 scale: score / "
        "100)")
    assert score_scale_line("memory_key") == (
        "scores are the episode return, 0-1 (as training prints it)")


def test_the_tiny_model_says_its_failures_are_expected():
    from configs import builtin, sciworld
    c = sciworld.get_config("tiny")
    assert tiny_model_note(c) == (
        "note: the model is the tiny preset, behaviour-cloned on a few expert episodes (a "
        "machinery check, not a policy): strategy format failures near 1.000 and scores near 0 "
        "are expected")
    c.model.warm_start = ""
    assert tiny_model_note(c).startswith("note: the model is the tiny preset, randomly "
                                         "initialised (a machinery check")
    assert tiny_model_note(sciworld.get_config("tiny,real")) is None   # a real model
    c = builtin.get_config("tiny")
    metrics = {"eval/success": 0.0, "eval/score": 0.25, "eval/episodes": 4.0, "step": 3,
               "eval/strategy_format_fail_frac": 1.0, "files": ["m.json", "t.jsonl"]}
    assert report(c, metrics).splitlines()[-5:] == [
        "steps: invalid (format) 0.000  rejected by the env 0.000  strategy format failures "
        "1.000", score_scale_line(c.env.name), tiny_model_note(c), "wrote m.json",
        "wrote t.jsonl"]


def test_an_unknown_split_is_one_line_before_the_model_loads(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "eval.py"),
                          "--config=configs/builtin.py:tiny", "--split=tset",
                          f"--config.workdir={tmp_path / 'run'}", "--no_checkpoint"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("eval.py: error: memory_key: "), lines
    assert "tset" in lines[0]
    assert "evaluating" not in out.stdout and "playing" not in out.stdout   # nothing loaded
    assert not (tmp_path / "run").exists()
