"""benchmarks/long_run.py's report logic on hand rows (the run itself is the benchmark)."""
import math

from benchmarks.long_run import growth, summary, table


def _rows():
    return [{"step": 1, "mem/host_rss_gb": 1.5, "compile/count": 100.0, "mem/live_arrays": 138.0},
            {"step": 2, "mem/host_rss_gb": 1.6, "compile/count": 107.0, "mem/live_arrays": 138.0},
            {"step": 3, "mem/host_rss_gb": 2.0, "compile/count": 109.0, "mem/live_arrays": 138.0,
             "mem/gc_objects": 500.0},
            {"step": 4, "mem/host_rss_gb": 2.1, "compile/count": 109.0, "mem/live_arrays": 140.0,
             "mem/gc_objects": 550.0}]


def test_growth_and_summary_by_hand():
    g = growth(_rows(), "mem/host_rss_gb", 3)
    assert g["from"] == 3 and g["to"] == 4 and g["first"] == 2.0 and g["last"] == 2.1
    assert math.isclose(g["delta"], 0.1) and math.isclose(g["percent"], 5.0)
    assert growth(_rows(), "mem/host_rss_gb", 7) is None      # step 7 was not logged
    assert growth(_rows(), "mem/malloc_free_gb", 3) is None   # no row has it
    s = summary(_rows(), 3)
    assert s["compiles_after_step_2"] == 2.0                  # 109 at the end - 107 at step 2
    assert s["live_arrays"]["delta"] == 2.0 and s["gc_objects"]["percent"] == 10.0
    assert s["malloc_in_use"] is None


def test_table_has_a_column_per_metric_present():
    lines = table(_rows()).splitlines()
    assert lines[0].split() == ["step", "rss", "arrays", "gc_obj", "compiles"]
    assert lines[1].split() == ["1", "1.500", "138", "-", "100"]
    assert lines[4].split() == ["4", "2.100", "140", "550", "109"]
