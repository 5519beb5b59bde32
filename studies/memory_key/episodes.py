"""How the memory_key study reads an episode: the task's vault code, whether a text names it,
whether a success saw the code some other way than its strategy (a leak), and the per-policy
summary (success with its Wilson interval, code-carrying strategies, leaked successes)."""
from __future__ import annotations

import os
import re

# The code in the first observation: "A note on the wall reads: 'vault code 6-1-6'."
_NOTE = re.compile(r"vault code ([0-9](?:-[0-9])*)'")
# Text names the code when a code word precedes its digits (in order, separators allowed):
# "enter the code 6-1-6", "vault code 7", "enter 7"; list numbers ("1. go north") and counts
# ("go north (4 times)") do not, which matters with a one-digit code.
_CODE_WORD = r"(?:code|enter|vault|key|keypad|digits?|combination|password)"


def task_code(traj: dict) -> str:
    """The vault code of a memory_key trajectory record, from its first observation ("" when
    the record has no step or no note)."""
    steps = traj.get("steps") or []
    m = _NOTE.search(steps[0]["observation"]) if steps else None
    return m.group(1).replace("-", "") if m else ""


def names_code(text: str | None, code: str) -> bool:
    """Whether `text` names `code`: a code word, then within 30 characters the code's digits in
    order with at most two separator characters between them and no digit around them."""
    if not text or not code:
        return False
    digits = r"[\s,\-]{0,2}".join(code)
    pat = _CODE_WORD + r"[^0-9]{0,30}(?<![0-9])" + digits + r"(?![0-9])"
    return re.search(pat, text, flags=re.IGNORECASE) is not None


def leaked(traj: dict, code: str, history: int = 2, tail_chars: int = 30) -> bool:
    """Whether the code was in the prompt of the episode's last step from a source other than
    the strategy: the first observation still in the history window, or an action / the tail of
    a format-invalid output of the last `history` steps naming it (`names_code`)."""
    steps = traj.get("steps") or []
    t = len(steps) - 1
    if t < 0:
        return False
    if t <= history:   # the note itself is still in the window (or is the current observation)
        return True
    from strata_jax.rollout.prompts import invalid_history_action
    for s in steps[t - history:t]:   # the history text exactly as the step prompt showed it
        text = (invalid_history_action(s.get("output") or "", tail_chars) if s.get("invalid")
                else s.get("action"))
        if names_code(text, code):
            return True
    return False


def episode_rows(trajs: list[dict]) -> list[dict]:
    """One row per episode: variation, success, whether its strategy carries the code, whether a
    success leaked (`leaked`), invalid steps, steps."""
    rows = []
    for tr in trajs:
        code = task_code(tr)
        ok = bool(tr.get("success"))
        rows.append(dict(variation=int(tr.get("variation", -1)), success=ok,
                         strategy=tr.get("strategy") is not None,
                         carries=names_code(tr.get("strategy"), code),
                         leaked=ok and leaked(tr, code),
                         steps=len(tr.get("steps") or []),
                         invalid=sum(bool(s.get("invalid")) for s in tr.get("steps") or [])))
    return rows


def summary(rows: list[dict]) -> dict:
    """Success k / n with its Wilson interval, code-carrying strategies, leaked successes."""
    from studies.memory_key.stats import wilson
    n, k = len(rows), sum(r["success"] for r in rows)
    strat = [r for r in rows if r["strategy"]]
    steps = sum(r["steps"] for r in rows)
    lo, hi = wilson(k, n) if n else (0.0, 0.0)
    return dict(n=n, k=k, success=k / n if n else 0.0, ci95=[lo, hi],
                carries=(sum(r["carries"] for r in strat) / len(strat)) if strat else None,
                leaked_successes=sum(r["leaked"] for r in rows),
                invalid_step_frac=(sum(r["invalid"] for r in rows) / steps) if steps else 0.0)


def read_jsonl(path: str) -> list[dict]:
    from strata_jax.metrics import read_jsonl as _read
    return list(_read(path)) if os.path.exists(path) else []
