"""Test-wide setup.

Eight fake CPU devices so that mesh sharding is exercised on a laptop or CI box. The flag must
be set before jax is imported anywhere, which is why it lives here and not in a test.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No hub traffic from tests: everything they load is built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs_after_each_module():
    """The whole suite runs in one process: drop JAX's compiled programs and traced functions
    after each test module (module fixtures holding models are gone by then), so memory does not
    accumulate over ~50 modules (one full run grew past 16 GB and was killed for memory)."""
    yield
    import sys
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()


# Peak resident memory per test module, printed at the end of a run with STRATA_TEST_MEMORY=1
# (Linux: the peak is reset through /proc/self/clear_refs before each module). The suite runs in
# one process on boxes of 16-24 GB, so the module that sets the peak is worth knowing.
_MODULE_PEAK_GB: dict[str, float] = {}


def _vm_hwm_gb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


@pytest.fixture(autouse=True, scope="module")
def _record_module_peak_memory(request):
    on = os.environ.get("STRATA_TEST_MEMORY") == "1" and os.path.exists("/proc/self/clear_refs")
    if on:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    yield
    if on:
        _MODULE_PEAK_GB[request.module.__name__] = _vm_hwm_gb()


def pytest_terminal_summary(terminalreporter):
    if _MODULE_PEAK_GB:
        terminalreporter.section("peak RSS per test module (GB, this process)")
        for name, gb in sorted(_MODULE_PEAK_GB.items(), key=lambda kv: -kv[1])[:15]:
            terminalreporter.write_line(f"{gb:6.2f}  {name}")


# The smoke part (`python -m pytest -q tests -m smoke`, README "Tests"): a few quick modules of
# every package folder (config and flags, the algorithms' pure functions, parsing and a built-in
# env, the model's config and tokenizer, prompts and strategies, stop strings, checkpoints,
# metrics and evaluation's summaries, the docs' checks); every test in them carries the mark.
SMOKE_MODULES = (
    "tests/test_config_schema.py", "tests/test_metrics.py",
    "tests/algos/test_advantages.py", "tests/algos/test_losses.py", "tests/algos/test_batch.py",
    "tests/benchmarks/test_benchmark_report.py",
    "tests/docs/test_readme.py", "tests/docs/test_design.py",
    "tests/envs_bridge/test_parsing.py", "tests/envs_bridge/test_env_builtin.py",
    "tests/evaluation/test_evaluation.py",
    "tests/jobs/test_cli.py", "tests/jobs/test_evaluate.py",
    "tests/models/test_model_config.py", "tests/models/test_tokenizer.py",
    "tests/rollout/test_fps.py", "tests/rollout/test_prompts.py",
    "tests/sampling/test_stops.py",
    "tests/studies/test_studies_layout.py",
    "tests/training/test_checkpoint.py",
)


def pytest_collection_modifyitems(config, items):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    smoke = {os.path.join(root, *m.split("/")) for m in SMOKE_MODULES}
    for item in items:
        if str(item.path) in smoke:
            item.add_marker(pytest.mark.smoke)
