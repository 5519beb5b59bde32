"""Command-line parsing shared by the entry points (train.py, eval.py, sft.py)."""
from __future__ import annotations

import re
import sys
from typing import Sequence

from absl import app


def parse_flags(argv: Sequence[str]) -> list[str]:
    """absl's flag parsing (`app.parse_flags_with_usage`, for
    ``app.run(main, flags_parser=parse_flags)``), with a clear message for a ``--config.<field>=``
    override that names no field of the config.

    ml_collections reports such an override as a bare KeyError / AttributeError from inside the
    flag parser; here it becomes one line naming the override and where the fields are defined,
    and exit status 2 (absl's status for bad flags). Returns the positional arguments.
    """
    try:
        return app.parse_flags_with_usage(list(argv))
    except (KeyError, AttributeError) as e:
        msg = str(e)
        overrides = [a.split("=", 1)[0] for a in argv[1:] if a.startswith("--config.")]
        # ml_collections nests the field name in quotes, sometimes with a spelling hint.
        bad = [o for o in overrides if re.search(rf"\b{re.escape(o.rsplit('.', 1)[-1])}\b", msg)]
        hint = re.search(r'Did you mean "([^"]+)"', msg.replace("\\", ""))
        sys.stderr.write(
            f"{argv[0]}: {', '.join(bad or overrides) or 'a --config override'} names no field of "
            "the config" + (f" (did you mean {hint.group(1)!r}?)" if hint else "") + ". Fields and "
            "their defaults: configs/base.py; variants: the experiment file's docstring.\n")
        raise SystemExit(2) from None
