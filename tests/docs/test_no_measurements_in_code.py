"""Docstrings and comments of the library, the env bridge and the configs say why, not what a
machine measured on a date: measured numbers live in the write-ups docs/results.md indexes and
in the benchmark and study scripts that produce them (benchmarks/ and studies/ are exempt). A citation ("Hu et al. 2021") is not a measurement."""
from __future__ import annotations

import io
import os
import re
import tokenize
from tests.fixtures.paths import REPO_ROOT

ROOT = REPO_ROOT
CHECKED = ("strata_jax", "envs_bridge", "configs")

# What narrates a measurement: a date, a machine's load, "measured on / at / :", the box.
PATTERNS = [
    re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    re.compile(r"\bload(?: average)? ~?\d", re.I),
    re.compile(r"\bmeasured(?: \w+)? (?:on|at)\b", re.I),
    re.compile(r"\bmeasured\s*[:(]", re.I),
    re.compile(r"\b\d+[- ]core (?:box|cpu|machine)\b", re.I),
    re.compile(r"\b(?:quiet|loaded|shared) (?:\d+-core )?box\b", re.I),
]


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every string statement (docstrings) of `source`."""
    out = []
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    prev = tokenize.NEWLINE
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
        elif tok.type == tokenize.STRING and prev in (tokenize.NEWLINE, tokenize.NL,
                                                      tokenize.INDENT, tokenize.DEDENT):
            out.append((tok.start[0], tok.string))
        if tok.type not in (tokenize.COMMENT,):
            prev = tok.type
    return out


def offences(source: str) -> list[tuple[int, str]]:
    """(line, matched text) of each measurement `source`'s comments and docstrings quote."""
    found = []
    for line, text in prose(source):
        for pat in PATTERNS:
            for m in pat.finditer(text):
                found.append((line + text[: m.start()].count("\n"), m.group(0)))
    return found


def test_the_check_finds_measurements_and_spares_citations_and_code():
    src = ('"""Decodes 5 tok/s (measured on 2026-12-01 at load 7)."""\n'
           "x = '2026-12-01'   # a string in code is data, not prose\n"
           "# LoRA (Hu et al. 2021): rank-r adapters\n"
           "def f():\n"
           "    # Measured: 1.1 s on a quiet box\n"
           "    return 'load 3'\n")
    got = [m for _, m in offences(src)]
    assert got == ["2026-12-01", "load 7", "measured on", "Measured:", "quiet box"]
    assert offences("# scheduled at load time\n# one 2-core step\n") == []


def test_no_library_env_or_config_prose_quotes_a_measurement():
    bad = []
    for top in CHECKED:
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    with open(path, encoding="utf-8") as f:
                        for line, text in offences(f.read()):
                            bad.append(f"{os.path.relpath(path, ROOT)}:{line}: {text!r}")
    assert not bad, ("measurements belong in a write-up (docs/results.md indexes them) or the "
                     "benchmark that makes them:\n"
                     + "\n".join(bad))
