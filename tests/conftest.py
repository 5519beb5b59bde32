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
