"""Command line: both override forms parse every field by its declared type, bad values and
typos are one line with exit 2, and a run with an invalid config writes nothing."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import ml_collections
import pytest

from configs import base, sciworld
from strata_jax import config as schema
from strata_jax import experiment as ex
from strata_jax.jobs.cli import split_config_args
from tests.fixtures.paths import REPO_ROOT

ROOT = REPO_ROOT


def leaves(c, prefix=""):
    for k, v in c.items():
        if isinstance(v, ml_collections.ConfigDict):
            yield from leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def other_value(key, kind, default):
    """(command-line text, expected value) of a value of the field's type that is not its default."""
    if kind == "bool":
        return ("false", False) if default else ("true", True)
    if kind == "int":
        return str(default + 3), default + 3
    if kind == "float":
        return repr(default + 0.5), default + 0.5
    if kind == "int|None":
        return "1", 1
    if kind == "remat":
        return "full", "full"
    if kind == "tuple[int]":
        return "0+1", (0, 1)
    if kind == "tuple[int]|None":
        return "8+16", (8, 16)
    if kind == "tuple[str]":
        return "a+b", ("a", "b")
    return "x_" + str(default), "x_" + str(default)


def all_overrides():
    c = base.get_base_config()
    out = []
    for key, default in leaves(c):
        kind = schema.field_type(c, key)
        out.append((key, kind) + other_value(key, kind, default))
    return out


def get(c, key):
    for k in key.split("."):
        c = c[k]
    return c


def test_every_base_field_is_overridable_with_a_value_of_its_type():
    fields = all_overrides()
    assert len(fields) > 120
    kinds = {k: kind for k, kind, _, _ in fields}
    # the declared types of the fields whose default does not tell
    assert (kinds["adv.std_ddof"], kinds["model.remat"], kinds["env.tasks"],
            kinds["distributed.local_device_ids"]) == ("int|None", "remat", "tuple[str]",
                                                       "tuple[int]")
    for key, kind, text, want in fields:
        c = base.get_base_config()                 # --config.<key>=<text>
        schema.set_override(c, key, text)
        colon = base.apply_variant(base.get_base_config(), f"{key}={text}")   # :key=text
        for got in (get(c, key), get(colon, key)):
            assert got == want and type(got) is type(want), (key, kind, text, got)


def test_cli_overrides_reach_the_config_for_every_field():
    """Through the real flag parser (ml_collections + absl), one subprocess with every field."""
    fields = all_overrides()
    args = [f"--config.{k}={text}" for k, _, text, _ in fields if k != "workdir"]
    code = ("import sys, json; from ml_collections import config_flags; "
            "from strata_jax.jobs.cli import parse_flags; "
            "cfg = config_flags.DEFINE_config_file('config', None, lock_config=False); "
            "parse_flags(sys.argv); print(json.dumps(cfg.value.to_dict(), default=list))")
    out = subprocess.run([sys.executable, "-c", code, "--config=configs/sciworld.py:tiny", *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for key, _, _, want in fields:
        if key != "workdir":
            v = get(got, key)
            assert (tuple(v) if isinstance(v, list) else v) == want, key
    assert got["workdir"] == "runs/sciworld_tiny"


@pytest.mark.parametrize("key,text,msg", [
    ("rollout.self_judgment", "flase", "rollout.self_judgment='flase' is not a boolean; use true "
                                       "or false"),
    ("rollout.num_strategies", "2.7", "rollout.num_strategies='2.7' is not an integer"),
    ("model.remat", "fulll", "model.remat='fulll': use true, false or a remat policy ('none', "
                             "'full', 'dots')"),
    ("adv.std_ddof", "one", "adv.std_ddof='one' is not an integer (or none)"),
    ("optim.lr", "fast", "optim.lr='fast' is not a number"),
    ("optim.lrr", "1e-5", "unknown config field 'optim.lrr' (did you mean 'optim.lr'?)"),
])
def test_both_forms_refuse_what_does_not_fit(key, text, msg):
    with pytest.raises(schema.OverrideError) as e1:
        schema.set_override(base.get_base_config(), key, text)
    with pytest.raises(schema.OverrideError) as e2:
        sciworld.get_config(f"tiny,{key}={text}")
    assert str(e1.value) == str(e2.value) == msg


def test_numbers_and_remat_policies_parse_by_declared_type():
    c = sciworld.get_config("tiny,model.remat=dots,rollout.num_strategies=1e1,adv.std_ddof=none")
    assert c.model.remat == "dots" and c.rollout.num_strategies == 10
    assert isinstance(c.rollout.num_strategies, int) and c.adv.std_ddof is None
    from strata_jax.training import TrainConfig
    assert TrainConfig.from_config(c).remat == "dots"
    schema.set_override(c, "model.remat", "FALSE")
    assert c.model.remat is False and TrainConfig.from_config(c).remat == "none"
    schema.set_override(c, "optim.lr", "1")      # an int text for a float field stays a float
    assert c.optim.lr == 1.0 and isinstance(c.optim.lr, float)


def test_split_config_args_forms():
    rest, over, spec = split_config_args(
        ["train.py", "--config=configs/x.py:tiny", "--config.a.b=1", "--config.c", "d",
         "--config.flag", "--split=dev"])
    assert rest == ["train.py", "--config=configs/x.py:tiny", "--split=dev"]
    assert over == [("a.b", "1"), ("c", "d"), ("flag", "true")]
    assert spec == "configs/x.py:tiny"


@pytest.mark.parametrize("field,value,msg", [
    ("rollout.top_k", -2, "rollout.top_k must be an integer >= 0, or -1 / 0 for off, got -2"),
    ("rollout.top_p", 0.0, "rollout.top_p must be in (0, 1] (1 = off), got 0.0"),
    ("rollout.top_p", 1.5, "rollout.top_p must be in (0, 1] (1 = off), got 1.5"),
    ("rollout.temperature", -0.1, "rollout.temperature must be a finite number >= 0 (0 = greedy), "
                                  "got -0.1"),
    ("eval.temperature", math.inf, "eval.temperature must be a finite number >= 0 (0 = greedy), "
                                   "got inf"),
    ("rollout.temperature", 1e-39, "rollout.temperature must be a finite number >= 1e-06 or 0 "
                                   "(greedy), got 1e-39 (smaller temperatures overflow float32 "
                                   "logits / temperature into NaN logprobs)"),
    ("eval.temperature", 1e-46, "eval.temperature must be a finite number >= 1e-06 or 0 (greedy), "
                                "got 1e-46 (smaller temperatures overflow float32 logits / "
                                "temperature into NaN logprobs)"),
    ("rollout.max_action_tokens", 0, "rollout.max_action_tokens must be an integer >= 1, got 0 "
                                     "(--config.rollout.max_action_tokens=...)"),
    ("rollout.cohorts", -1, "rollout.cohorts must be an integer >= 0, got -1"),
    ("optim.micro_batch_rows", 0, "optim.micro_batch_rows must be an integer >= 1, got 0"),
    ("env.history_length", -1, "env.history_length must be an integer >= 0, got -1"),
    ("env.max_prompt_tokens", 0, "env.max_prompt_tokens must be an integer >= 1, got 0"),
    ("eval.episodes_per_family", -1, "eval.episodes_per_family must be an integer >= 0, got -1"),
    ("ckpt.every", 0, "ckpt.every must be an integer >= 1, got 0"),
    ("adv.std_ddof", 2, "adv.std_ddof must be 0, 1 or none (each estimator's pin), got 2"),
    ("model.remat", "some", "remat must be one of ('none', 'full', 'dots'), got 'some'"),
    ("sft.noise", 1.0, "sft.noise must be in [0, 1), got 1.0"),
    ("env.max_prompt_tokens", 32750, "env.max_prompt_tokens (32750) + max new tokens (32) = "
                                     "32782 exceeds the model's context of 32768 tokens"),
])
def test_validate_checks_sampling_and_size_fields(field, value, msg):
    c = sciworld.get_config("tiny")
    ex.validate(c)
    node = c
    *parents, leaf = field.split(".")
    for p in parents:
        node = node[p]
    with node.ignore_type():
        node[leaf] = value
    with pytest.raises(ex.ConfigError) as e:
        ex.validate(c)
    assert msg in str(e.value)


def test_top_k_minus_one_means_off():
    c = sciworld.get_config("tiny,rollout.top_k=-1")
    ex.validate(c)
    ex.resolve(c)
    assert c.rollout.top_k == 0
    from strata_jax.rollout import RolloutConfig
    assert RolloutConfig.from_config(c).top_k == 0


def test_each_variant_has_its_own_run_folder_and_all_share_one_warm_start():
    from strata_jax.models import load_tokenizer
    from strata_jax.jobs.warm_start import warm_start_dir
    names = {v: sciworld.get_config(v).workdir
             for v in ("tiny", "tiny,grpo", "grpo,tiny", "tiny,gigpo,matched", "tiny,vanilla",
                       "tiny,optim.lr=1e-5", "tiny,grpo,workdir=/tmp/mine")}
    assert names == {"tiny": "runs/sciworld_tiny", "tiny,grpo": "runs/sciworld_tiny_grpo",
                     "grpo,tiny": "runs/sciworld_tiny_grpo",
                     "tiny,gigpo,matched": "runs/sciworld_tiny_gigpo_matched",
                     "tiny,vanilla": "runs/sciworld_tiny_vanilla",
                     "tiny,optim.lr=1e-5": "runs/sciworld_tiny_optim.lr-1e-5",
                     "tiny,grpo,workdir=/tmp/mine": "/tmp/mine"}
    tok = load_tokenizer()
    dirs = set()
    for v in ("tiny", "tiny,grpo", "tiny,gigpo,matched"):
        c = sciworld.get_config(v)
        dirs.add(warm_start_dir(c, ex.model_config(c, tok), c.workdir))
        schema.set_override(c, "workdir", "/elsewhere/run")    # another run folder, same cache
        dirs.add(warm_start_dir(c, ex.model_config(c, tok), c.workdir))
    assert len(dirs) == 1 and dirs.pop().startswith("runs/warm_start/")


def _run(script, *args, env=None):
    return subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("script,args,line", [
    ("train.py", ["--config=configs/sciworld.py:tiny,grop"],
     "train.py: --config=configs/sciworld.py:tiny,grop: unknown config variant 'grop' (did you "
     "mean 'grpo'?); use tiny"),
    ("train.py", ["--config=configs/sciworld.py:tiny", "--iterations=6"],
     "train.py: --iterations is not a flag of this script; config fields are set as "
     "--config.<field>=<value>: --config.iterations=6"),
    ("eval.py", ["--config=configs/sciworld.py:tiny", "--seed=3"],
     "eval.py: --seed is not a flag of this script; config fields are set as "
     "--config.<field>=<value>: --config.seed=3"),
    ("eval.py", ["--config=configs/sciworld.py:tiny,optim.lrr=1e-5"],
     "eval.py: --config=configs/sciworld.py:tiny,optim.lrr=1e-5: unknown config field "
     "'optim.lrr' (did you mean 'optim.lr'?)."),
    ("train.py", ["--config=configs/sciworld.py:tiny", "--config.loss.kl_coeff=0.1"],
     "train.py: --config.loss.kl_coeff names no field of the config "
     "(did you mean 'loss.kl_coef'?)."),
    ("train.py", ["--config=configs/sciworld.py:tiny", "--config.rollout.num_strategies=2.7"],
     "train.py: --config.rollout.num_strategies='2.7' is not an integer"),
    ("train.py", ["--config=configs/sciworld.py:tiny", "--config.rollout.top_k=-2"],
     "train.py: error: rollout.top_k must be an integer >= 0, or -1 / 0 for off, got -2"),
    ("sft.py", ["--config=configs/sciworld.py:tiny", "--config.sft.noise=1.5"],
     "sft.py: error: sft.noise must be in [0, 1), got 1.5"),
    # the paper setting names a hub id: offline, the one line says which flag to set
    ("train.py", ["--config=configs/sciworld.py:grpo"],
     "train.py: error: --config.model.path=Qwen/Qwen2.5-1.5B-Instruct: could not download"),
    ("eval.py", ["--config=configs/sciworld.py:tiny", "--split=dev"],
     "eval.py: error: no checkpoint in {workdir}/ckpt; train first (python train.py with the "
     "same --config) or pass --no_checkpoint"),
    ("eval.py", ["--config=configs/builtin.py:tiny", "--split=dev", "--adapter=no/such/step3"],
     "eval.py: error: eval.adapter='no/such/step3' is not a folder; give an adapters/step<k> "
     "folder that a LoRA training run wrote"),
    ("eval.py", ["--config=configs/builtin.py:tiny", "--adapter=runs/x/adapters/step3",
                 "--step=3"],
     "eval.py: error: eval.adapter='runs/x/adapters/step3' plays config.model with those "
     "adapters; a checkpoint load is the other choice: choose one"),
])
def test_user_mistakes_are_one_line_and_write_nothing(tmp_path, script, args, line):
    workdir = tmp_path / "run"
    out = _run(script, *args, f"--config.workdir={workdir}", env={"HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2, out.stderr
    err = [ln for ln in out.stderr.strip().splitlines()
           if " strata_jax" not in ln and " envs_bridge" not in ln]   # log lines aside
    assert len(err) == 1, out.stderr
    assert err[0].startswith(line.format(workdir=workdir)), err[0]
    assert "Traceback" not in out.stderr
    assert not workdir.exists()


@pytest.mark.parametrize("script, extra", [("train.py", []),
                                           ("eval.py", ["--no_checkpoint", "--split=dev"])])
def test_a_hostile_model_file_is_one_line_before_anything_is_written(tmp_path, script, extra):
    """A GGUF declaring a 2**60-item metadata array (it hung the reference reader): one line
    naming the flag, the file and what to do; no traceback, no workdir."""
    import struct

    from tests.fixtures.gguf_files import gguf_key, hostile_gguf
    model = hostile_gguf(str(tmp_path / "m.gguf"), n_kv=1, pad=100,
                         kv=gguf_key("general.x") + struct.pack("<IIQ", 9, 0, 2**60))
    workdir = tmp_path / "run"
    out = _run(script, "--config=configs/sciworld.py:tiny", f"--config.model.path={model}",
               "--config.model.preset=", f"--config.workdir={workdir}", *extra)
    assert out.returncode == 2, out.stderr
    err = [ln for ln in out.stderr.strip().splitlines()
           if " strata_jax" not in ln and " envs_bridge" not in ln]
    assert err == [f"{script}: error: --config.model.path={model}: {model} is not a readable "
                   "GGUF file (malformed or hostile): metadata array 'general.x' declares "
                   "1152921504606846976 items (at most 65536 are accepted); re-download or "
                   "re-convert it"], out.stderr
    assert not workdir.exists()


def test_damaged_runs_and_checkpoints_are_user_errors_of_one_line(capsys):
    """A checkpoint that cannot be restored, a damaged metrics.jsonl and a bad model file end
    train.py / eval.py with one line and status 2 (they were tracebacks)."""
    from strata_jax.jobs.cli import guarded, user_errors
    from strata_jax.metrics import DamagedLogError
    from strata_jax.models.gguf import GGUFError
    from strata_jax.training import NoRestorableCheckpointError
    from strata_jax.models.adapter_files import AdapterError
    assert {NoRestorableCheckpointError, DamagedLogError, GGUFError, AdapterError} <= set(
        user_errors())
    for err in (NoRestorableCheckpointError("no restorable checkpoint in w/ckpt (step 3: ...)"),
                DamagedLogError("w/metrics.jsonl: line 2 is not JSON"), GGUFError("m.gguf: bad"),
                AdapterError("model.warm_start: a/adapter_model.safetensors has sha256 ...")):
        def main(argv, err=err):
            raise err
        with pytest.raises(SystemExit) as e:
            guarded(main)([])
        assert e.value.code == 2
        assert capsys.readouterr().err.endswith(f": error: {err}\n")


def test_existing_run_of_another_config_is_refused_in_one_line(tmp_path):
    """A workdir clash (another algo's checkpoint in --config.workdir) names the fields."""
    ckpt = tmp_path / "run" / "ckpt" / "3" / "meta"
    ckpt.mkdir(parents=True)
    stored = sciworld.get_config("tiny").to_dict()
    (ckpt / "metadata").write_text(json.dumps({"config": stored}, default=list))
    out = _run("train.py", "--config=configs/sciworld.py:tiny,grpo",
               f"--config.workdir={tmp_path / 'run'}")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith(
        f"train.py: error: {tmp_path / 'run'} holds a run with a different config (algo: "
        "'strata' -> 'grpo'): resuming would not continue that run. Set these back, or use a new "
        "--config.workdir")
    assert "Traceback" not in out.stderr
    assert sorted(os.listdir(tmp_path / "run")) == ["ckpt"]


def test_ctrl_c_is_a_clean_stop_and_a_second_one_stops_at_once():
    import signal

    from strata_jax.jobs.train import stop_flag
    flag = stop_flag().install()
    try:
        assert not flag.requested
        os.kill(os.getpid(), signal.SIGINT)          # first Ctrl-C: finish the iteration, save
        assert flag.requested
        with pytest.raises(KeyboardInterrupt):       # second Ctrl-C: stop now
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        flag.uninstall()
    for sig in (signal.SIGTERM, signal.SIGHUP):       # preemption, a closed terminal: the same
        flag = stop_flag().install()                  # clean stop
        try:
            os.kill(os.getpid(), sig)
            assert flag.requested
        finally:
            flag.uninstall()


def test_guarded_main_turns_ctrl_c_and_user_errors_into_one_line(capsys):
    from strata_jax.jobs.cli import guarded

    def interrupted(argv):
        raise KeyboardInterrupt

    def bad_config(argv):
        raise ex.ConfigError("rollout.top_p must be in (0, 1] (1 = off), got 0.0")

    def bug(argv):
        raise ZeroDivisionError("a bug keeps its traceback")

    with pytest.raises(SystemExit) as e:
        guarded(interrupted)([])
    assert e.value.code == 130
    prog = os.path.basename(sys.argv[0])
    assert capsys.readouterr().err == (
        f"{prog}: interrupted (Ctrl-C); the same command resumes a training run from its newest "
        "checkpoint (a warm start in progress starts over)\n")
    with pytest.raises(SystemExit) as e:
        guarded(bad_config)([])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        f"{prog}: error: rollout.top_p must be in (0, 1] (1 = off), got 0.0\n")
    with pytest.raises(ZeroDivisionError):
        guarded(bug)([])


def test_running_a_checkout_config_from_elsewhere_says_where_runs_go(tmp_path):
    """From another directory the relative run folders would land there, beside no earlier run or
    cached warm start: one note says so (from the checkout, nothing: the one-line tests above)."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"),
                          f"--config={os.path.join(ROOT, 'configs', 'sciworld.py')}:tiny",
                          "--config.rollout.top_k=-2"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2
    notes = [ln for ln in out.stderr.splitlines() if ln.startswith("train.py: note: ")]
    assert notes == [f"train.py: note: workdir, sft.cache_dir, compilation_cache_dir "
                     f"(runs/sciworld_tiny, ...) are relative to the current directory {tmp_path}"
                     f", not to the checkout {ROOT}: run from the checkout to find its runs and "
                     "cached warm starts"]
    assert not (tmp_path / "runs").exists()
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"),
                          f"--config={os.path.join(ROOT, 'configs', 'sciworld.py')}:tiny",
                          f"--config.workdir={tmp_path / 'run'}",
                          f"--config.sft.cache_dir={tmp_path / 'ws'}",
                          "--config.compilation_cache_dir=", "--config.rollout.top_k=-2"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "note:" not in out.stderr


def test_a_relative_config_path_from_elsewhere_names_the_checkouts_configs(tmp_path):
    """``configs/sciworld.py`` typed in another directory: the one line says config paths are
    relative to the current directory and names the checkout's configs/ folder."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"),
                          "--config=configs/sciworld.py:tiny"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    configs = os.path.join(ROOT, "configs")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"train.py: --config=configs/sciworld.py:tiny: config file 'configs/sciworld.py' does "
        f"not exist; config paths are relative to the current directory {tmp_path}, and this "
        f"checkout's configs are in {configs} (--config={configs}/sciworld.py:tiny, or run from "
        f"{ROOT}). Fields and their defaults: configs/base.py; variants: the experiment file's "
        "docstring."]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"),
                          "--config=nowhere/mine.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith(
        f"train.py: --config=nowhere/mine.py: config file 'nowhere/mine.py' does not exist; config"
        f" paths are relative to the current directory {tmp_path}, and this checkout's configs "
        f"are in {configs} (e.g. --config={configs}/sciworld.py:tiny)")


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_stop_signal_outside_the_loop_is_one_line_130_and_runs_cleanup(tmp_path, sig):
    """Outside the training loop (setup, a warm start, eval, a fetch) SIGTERM and SIGHUP stop
    at once like Ctrl-C: `finally` blocks run (here: a marker file), one line, status 130.
    Before, SIGHUP killed the process with no line and no cleanup."""
    marker = tmp_path / "cleaned"
    # SIGHUP's default action, as under a terminal: a suite started with nohup hands its
    # children SIGHUP ignored, which install_stop_handlers rightly keeps.
    code = (f"import os, signal, sys, time\nsys.argv = ['prog.py']\n"
            f"signal.signal(signal.{sig}, signal.SIG_DFL)\n"
            f"from strata_jax.jobs.cli import guarded\n"
            f"def main(argv):\n"
            f"    try:\n"
            f"        os.kill(os.getpid(), signal.{sig}); time.sleep(30)\n"
            f"    finally:\n"
            f"        open({str(marker)!r}, 'w').close()\n"
            f"guarded(main)([])\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 130, out.stderr
    assert out.stderr == (f"prog.py: stopped ({sig}); the same command resumes a training run "
                          "from its newest checkpoint (a warm start in progress starts over)\n")
    assert marker.exists()


def test_a_preempted_run_exits_75_a_finished_one_0(monkeypatch, capsys):
    import signal

    import importlib.util
    import types

    from strata_jax import metrics
    from strata_jax.jobs import train as job
    # the train.py script's main (loaded from its file: it is no module of the library)
    spec = importlib.util.spec_from_file_location("_train_script", os.path.join(ROOT, "train.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "_CONFIG", types.SimpleNamespace(value=None))
    monkeypatch.setattr(metrics, "quiet_logs", lambda: None)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        for status, code in (("done", 0), ("preempted", 75)):
            monkeypatch.setattr(job, "run", lambda c, s=status: {"status": s, "step": 3,
                                                                 "workdir": "w"})
            assert script.main([]) == code
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    out = capsys.readouterr().out
    assert "done: step 3, outputs in w" in out
    assert "preempted: step 3 saved, outputs in w; the same command continues the run" in out


@pytest.mark.parametrize("args, line", [
    (["--config=configs/sciworld.py:tiny", "--bogus"],
     "train.py: Unknown command line flag 'bogus'. --helpshort lists the flags"),
    ([], "train.py: flag --config=None: Flag --config must have a value other than None.. "
         "--helpshort lists the flags"),
])
def test_flag_errors_exit_2_in_one_line(args, line):
    out = _run("train.py", *args)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [line]
    assert _run("train.py", "--helpshort").returncode == 0
