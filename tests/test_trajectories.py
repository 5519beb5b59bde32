"""Trajectory records (goal, raw vs parsed strategy, env_rejected, feedback), the viewer
`python -m strata_jax.trajectories`, eval task selection per family, WebShop's rejection rule,
the warm start's progress line, and per-iteration CPU seconds."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from envs_bridge import EnvPool, Task
from envs_bridge.agentgym_http import webshop_action_fits
from strata_jax.models import load_tokenizer
from strata_jax.rollout import PromptBuilder, RolloutConfig, ScriptedPolicy, collect_rollout
from strata_jax.trajectories import format_episode, load
from tests.fixtures.paths import REPO_ROOT

ROOT = REPO_ROOT
RAW = "I would walk north and type the code."


def respond(prompt: str, key) -> str:
    """Strategy: no tags (format failure). Steps: a verb memory_key does not know (rejected by
    the env), then an untagged reply (format-invalid), then a move."""
    if "<strategy></strategy>" in prompt:
        return RAW
    if "<bad_steps>" in prompt:
        return "<bad_steps>none</bad_steps>"
    if "dance" not in prompt:
        return "<think>try</think><action>dance wildly</action>"
    if "not sure" not in prompt:
        return "not sure"
    return "<think>walk</think><action>go north</action>"


@pytest.fixture(scope="module")
def records():
    tok = load_tokenizer()
    cfg = RolloutConfig(mode="strata", num_strategies=1, episodes_per_strategy=1, oversample=1,
                        cohorts=1, self_judgment=False)
    with EnvPool("memory_key", {"max_steps": 3}, max_live_envs=1) as pool:
        res = collect_rollout(ScriptedPolicy(tok, respond), pool, PromptBuilder(tok, 2048),
                              [Task("memory_key", "memory_key", 4)], key=jax.random.key(0),
                              config=cfg)
    return res


def test_dump_separates_raw_and_parsed_strategy_and_marks_env_rejections(records):
    (rec,) = records.dump()
    assert rec["goal"] and rec["goal"] == records.trajectories[0].pieces.task_description
    assert rec["strategy_raw"] == RAW
    assert rec["strategy"] is None and rec["strategy_format_ok"] is False
    assert rec["strategy_fail_reason"] == "no closed <strategy> block"
    assert rec["strategy_in_prompt"] == RAW           # a failed candidate is the fill text
    s1, s2, s3 = rec["steps"]
    assert (s1["action"], s1["invalid"], s1["env_rejected"]) == ("dance wildly", False, True)
    assert s1["feedback"] == "Nothing happens."
    assert (s2["action"], s2["invalid"], s2["env_rejected"]) == (None, True, False)
    assert (s3["action"], s3["invalid"], s3["env_rejected"]) == ("go north", False, False)
    assert s3["feedback"] == rec["final_observation"]
    assert rec["env_rejected_steps"] == 1
    # token counts: the prompts the policy saw, the sampled ids (stop token included)
    for s, st in zip((s1, s2, s3), records.trajectories[0].steps):
        assert s["prompt_tokens"] == len(st.prompt.ids) > 0
        assert s["output_tokens"] == len(st.generation.token_ids) > 0
    assert s2["prompt_tokens"] > s1["prompt_tokens"]   # step 2 shows step 1 as history
    assert records.stats["rollout/env_rejected_frac"] == pytest.approx(1 / 3)
    assert records.stats["rollout/invalid_step_frac"] == pytest.approx(1 / 3)
    assert records.stats["rollout/ambiguous_resolved_frac"] == 0.0
    json.dumps(rec)   # JSON-able


def test_viewer_prints_episodes_readably(records, tmp_path):
    (rec,) = records.dump()
    text = format_episode({"step": 3, **rec}, index="1/1")
    lines = text.splitlines()
    assert lines[0] == "=== episode 1/1 (iteration 3) memory_key variation 4  [task_uid 0, " \
                       "strategy 0, trajectory 0]"
    assert lines[1] == f"goal:          {rec['goal']}"
    assert lines[2] == (f"strategy:      FORMAT FAILED (no closed <strategy> block); raw output: "
                        f"{RAW}")
    assert "--- step 1  reward +0.000  [REJECTED by the env]" in lines
    assert "--- step 2  reward +0.000  [FORMAT-INVALID: nothing sent]" in lines
    assert "  action:      dance wildly" in lines and "  env answer:  Nothing happens." in lines
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "trajectories.jsonl", "w") as f:
        for step in (1, 2):
            f.write(json.dumps({"step": step, **rec}) + "\n")
        f.write('{"step": 3, "env": "mem')   # a torn last line is skipped
    assert [len(load(str(run), i)[0]) for i in (1, 2, 3)] == [1, 1, 0]
    assert load(str(run))[1] == [1, 2]
    out = subprocess.run([sys.executable, "-m", "strata_jax.trajectories", str(run),
                          "--iteration", "1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].startswith("=== episode 1/1 (iteration 1) memory_key")
    # several episodes: one line each by default, in full with --all
    two = tmp_path / "two"
    two.mkdir()
    with open(two / "trajectories.jsonl", "w") as f:
        for success in (False, True):
            f.write(json.dumps({"step": 2, **rec, "success": success}) + "\n")
    out = subprocess.run([sys.executable, "-m", "strata_jax.trajectories", str(two)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"2 episodes (iteration 2, {two}):" and len(lines) == 4
    assert lines[1] == ("    1/2  memory_key v4  return +0.000  success 0  strategy FAILED  "
                        "3 steps (1 invalid, 1 rejected)")
    assert "success 1" in lines[2]
    assert lines[3].startswith("one in full: --episode K")
    out = subprocess.run([sys.executable, "-m", "strata_jax.trajectories", str(two), "--all"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert [ln[:17] for ln in out.stdout.splitlines() if ln.startswith("=== episode")] == [
        "=== episode 1/2 (", "=== episode 2/2 ("]
    out = subprocess.run([sys.executable, "-m", "strata_jax.trajectories", str(run),
                          "--iteration", "7"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == (f"python -m strata_jax.trajectories: no episodes of iteration "
                                  f"7 in {run}; logged iterations: [1, 2]")


def test_eval_plays_episodes_per_family_round_robin():
    from configs import sciworld
    from strata_jax.evaluation import eval_tasks, per_family
    ts = [Task("e", "a", 0), Task("e", "a", 1), Task("e", "b", 0)]
    assert [(t.task_id, t.variation) for t in per_family(ts, 3)] == [
        ("a", 0), ("b", 0), ("a", 1), ("b", 0), ("a", 0), ("b", 0)]
    c = sciworld.get_config("tiny")
    got = eval_tasks(c, "dev")
    assert len(got) == 32 and c.eval.episodes_per_family == 16
    assert sorted({t.task_id for t in got}) == sorted(sciworld.TINY_TASKS)
    c.eval.max_tasks = 5
    assert [t.task_id for t in eval_tasks(c, "dev")] == [got[i].task_id for i in range(5)]


@pytest.mark.parametrize("action,fits", [
    ("search[red shoes]", True), ("click[Buy Now]", True), ("click[buy now]", True),
    ("click[B07XYZ]", False), ("buy it", False), ("search red shoes", False)])
def test_webshop_marks_actions_the_page_does_not_offer(action, fits):
    assert webshop_action_fits(action, True, ["buy now", "< prev"]) is fits
    assert webshop_action_fits("search[x]", False, ["buy now"]) is False


def test_sft_progress_line_has_an_eta():
    from strata_jax.training.sft import sft_progress
    assert sft_progress(40, 250, 3.14159, 52.3, 1.1) == (
        "sft step 40/250 [###.................] loss 3.1416 | 52 s, eta 3.9 min")
    assert sft_progress(245, 250, 0.5, 300, 2.0) == (
        "sft step 245/250 [###################.] loss 0.5000 | 300 s, eta 10 s")
    assert sft_progress(1, 250, 11.9, 13, None).endswith("| 13 s, eta after compile")


def test_cpu_seconds_counts_child_processes():
    from strata_jax.metrics import cpu_seconds
    before = cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", "x = 0\nfor i in range(3 * 10**7): x += i\n"
                              "import time; time.sleep(30)"])
    try:
        import time
        deadline = time.time() + 60
        while time.time() < deadline and cpu_seconds() - before < 1.0:
            time.sleep(0.2)
        assert cpu_seconds() - before >= 1.0   # the busy child's CPU time is counted
    finally:
        child.kill()
        child.wait()


def test_rollout_stats_count_env_rejections_and_ambiguous_commands():
    from strata_jax.rollout import EpisodeSpec, LoopStats, StepRecord, Trajectory, rollout_stats

    def step(action, invalid, info):
        return StepRecord(None, None, "", action, invalid, "", 0.0, info)

    tr = Trajectory(EpisodeSpec(Task("scienceworld", "boil", 0), 0, 0, 0), steps=[
        step("open door", False, {"invalid": False, "ambiguous_resolved": "open door to hallway"}),
        step("fly", False, {"invalid": True, "ambiguous_resolved": None}),
        step(None, True, {"invalid": False, "invalid_format": True}),
        step("look around", False, {"invalid": False})])
    s = rollout_stats([tr], [], LoopStats())
    assert (s["rollout/env_rejected_frac"], s["rollout/ambiguous_resolved_frac"],
            s["rollout/invalid_step_frac"]) == (0.25, 0.25, 0.25)


def _tb_events(tb_dir):
    """Every Event in the tensorboardX files of `tb_dir` (TFRecord framing, read by hand)."""
    import struct

    from tensorboardX.proto import event_pb2
    out = []
    for name in sorted(os.listdir(tb_dir)):
        data = open(os.path.join(tb_dir, name), "rb").read()
        i = 0
        while i + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            ev = event_pb2.Event()
            ev.ParseFromString(data[i + 12:i + 12 + n])
            out.append(ev)
            i += 12 + n + 4
    return out


def test_sample_episodes_reach_tensorboards_text_tab(records, tmp_path):
    from strata_jax.metrics import MetricsWriter
    (rec,) = records.dump()
    text = "```\n" + format_episode(rec) + "\n```"
    w = MetricsWriter(str(tmp_path))
    w.text(3, "episodes/0", text)
    w.close()
    found = [(ev.step, v.tag, v.tensor.string_val[0].decode()) for ev in _tb_events(tmp_path / "tb")
             for v in ev.summary.value if v.tensor.string_val]
    assert found == [(3, "episodes/0/text_summary", text)]
