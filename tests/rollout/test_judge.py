"""Self-judgment verdict parsing -> judge flags."""
from __future__ import annotations

import numpy as np

from strata_jax.rollout import judge_flags, parse_bad_steps
from tests.fixtures.paths import REPO_ROOT


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


def test_first_block_rule_equals_the_lazy_block_search():
    """The two-scan parser takes the same first block as ``<bad_steps>(.*?)</bad_steps>``
    searched with IGNORECASE | DOTALL, on nested, unclosed, stray and mixed-case tags."""
    import re
    lazy = re.compile(r"<bad_steps>(.*?)</bad_steps>", re.IGNORECASE | re.DOTALL)

    def reference(text, t):
        m = lazy.search(text)
        return parse_bad_steps(f"<bad_steps>{m.group(1)}</bad_steps>", t) if m else ()

    rng = np.random.default_rng(0)
    pieces = ["<bad_steps>", "</bad_steps>", "<BAD_STEPS>", "</Bad_Steps>", "1", "2, 3", " ",
              "none", "x", "\n", "</bad_steps", "<bad_steps"]
    for _ in range(2000):
        text = "".join(rng.choice(pieces, size=rng.integers(0, 8)))
        assert parse_bad_steps(text, 5) == reference(text, 5), text


def test_a_verdict_of_many_unclosed_blocks_parses_in_linear_time():
    """200,000 unclosed opening tags: a lazy pattern rescans the rest from every one (hours,
    holding the GIL); the two plain searches read the text once each. In a subprocess with a
    bound far above the linear parse and far below the quadratic one (whatever the machine's
    load), so a regression fails instead of hanging the suite."""
    import os
    import subprocess
    import sys
    code = ("from strata_jax.rollout import parse_bad_steps\n"
            "print(parse_bad_steps('<bad_steps>1, ' * 200_000, 5))")
    root = REPO_ROOT
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "()"
