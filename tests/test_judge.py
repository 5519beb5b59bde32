"""Self-judgment verdict parsing -> judge flags."""
from __future__ import annotations

import numpy as np

from strata_jax.rollout import judge_flags, parse_bad_steps


def test_parse_bad_steps():
    assert parse_bad_steps("<think>..</think><bad_steps>1, 4</bad_steps>", 5) == (1, 4)
    assert parse_bad_steps("<BAD_STEPS> 4,1 4\n2 </bad_steps>", 5) == (1, 2, 4)
    assert parse_bad_steps("<bad_steps>0, 3, 6, 12</bad_steps>", 5) == (3,)   # outside [1, T] dropped
    assert parse_bad_steps("<bad_steps>3, 2, -1</bad_steps>", 3) == (2, 3)  # keep ints in [1, T]
    assert parse_bad_steps("<bad_steps>-2 +1, 0</bad_steps>", 3) == (1,)
    assert parse_bad_steps("<bad_steps>-1</bad_steps>", 5) == ()  # only out-of-range ints
    # leading zeros are not significant digits: 5000 characters that spell 3
    assert parse_bad_steps("<bad_steps>2, " + "0" * 4999 + "3</bad_steps>", 5) == (2, 3)
    assert parse_bad_steps("<bad_steps>999999999</bad_steps>", 5) == ()   # nine digits: in the rule
    assert parse_bad_steps("<bad_steps>None</bad_steps>", 5) == ()
    assert parse_bad_steps("<bad_steps>2</bad_steps> <bad_steps>3</bad_steps>", 5) == (2,)
    for bad in ("steps 1 and 2", "<bad_steps>1, two</bad_steps>", "<bad_steps>1, 2",
                "<bad_steps>1.5</bad_steps>", "<bad_steps>-1.5, 2</bad_steps>",
                "<bad_steps>第1步</bad_steps>", "<bad_steps></bad_steps>",
                # more significant digits than any step index: a malformed verdict, not a crash
                "<bad_steps>" + "5" * 5000 + "</bad_steps>",
                "<bad_steps>2, 1" + "0" * 9 + "</bad_steps>",
                "<bad_steps>-" + "7" * 4301 + ", 1</bad_steps>"):
        assert parse_bad_steps(bad, 5) == (), bad


def test_judge_flags():
    np.testing.assert_array_equal(judge_flags((1, 4), 5), [True, False, False, True, False])
    np.testing.assert_array_equal(judge_flags((), 3), [False] * 3)
