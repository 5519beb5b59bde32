"""Fixtures the job tests share across modules."""
import pytest

from tests.fixtures.small_job import train_warm_start


@pytest.fixture(scope="session")
def small_warm_start(tmp_path_factory):
    """The small job's warm start (tests/fixtures/small_job.py), trained once per session: the
    cache dir that holds it and its export folder. Tests that train must not write into it
    (they pass another sft.cache_dir when their setting differs)."""
    cache = tmp_path_factory.mktemp("small_warm_start")
    return str(cache), train_warm_start(str(cache))
