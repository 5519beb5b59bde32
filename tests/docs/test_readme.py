"""The README is a front door and the docs a manual: short, free of dated measurements, every
relative link (README, docs, the study and benchmark write-ups) resolves to a file and anchor,
docs/results.md indexes every write-up, CI runs the README's test command, and every train /
eval / sft command the README and docs/running.md show parses and validates (without running)."""
from __future__ import annotations

import os
import re
import shlex

import pytest
from tests.fixtures.paths import REPO_ROOT

ROOT = REPO_ROOT

def _write_ups() -> list[str]:
    """Every study's and every benchmark's write-up: studies/<name>/README.md and
    benchmarks/results/<name>/README.md (docs/results.md is their index)."""
    out = []
    for top in ("studies", os.path.join("benchmarks", "results")):
        for name in sorted(os.listdir(os.path.join(ROOT, top))):
            if os.path.exists(os.path.join(ROOT, top, name, "README.md")):
                out.append(os.path.join(top, name, "README.md"))
    return out


WRITE_UPS = _write_ups()
PAGES = ["README.md", "benchmarks/README.md", "studies/README.md"] + [
    os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
    if f.endswith(".md")] + WRITE_UPS
# Pages a link may name before they are written (none today).
PENDING: set[str] = set()


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def bash_commands(text: str) -> list[str]:
    """The command lines of a markdown text's ```bash blocks, continuation lines joined and
    trailing comments dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #", 1)[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def entry_point_commands(text: str) -> list[list[str]]:
    """argv of each ``python train.py / eval.py / sft.py`` command that names a real config
    (placeholders such as ``...`` or ``$(...)`` are skipped)."""
    out = []
    for line in bash_commands(text):
        if "..." in line or "$(" in line or "<" in line:
            continue
        tokens, cmds = shlex.split(line), [[]]
        for t in tokens:
            cmds.append([]) if t == "&&" else cmds[-1].append(t)
        for argv in cmds:
            if len(argv) > 1 and argv[0] == "python" and argv[1] in ("train.py", "eval.py",
                                                                        "sft.py"):
                out.append(argv[1:])
    return out


def test_readme_is_short_and_quotes_no_dated_measurement():
    text = _read("README.md")
    assert len(text.splitlines()) <= 220
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text)
    assert not re.search(r"\bload(?: average)? ~?\d", text)
    for heading in ("## Install", "## Quick start", "## Running experiments", "## Tests",
                    "## Documentation", "## Known gaps", "## Citation and license"):
        assert heading in text


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a markdown text's headings."""
    return {re.sub(r"[^a-z0-9 _-]", "", h.lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, re.M)}


def broken_links(page: str, root: str = ROOT) -> list[str]:
    """The relative link targets of markdown page `page` (a path under `root`) that name no
    existing file, or a heading anchor the named .md file (or the page itself) does not have."""
    def read(rel):
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            return f.read()
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", read(page)):
        if re.match(r"[a-z]+:", target):
            continue
        rel, _, anchor = target.partition("#")
        path = os.path.normpath(os.path.join(os.path.dirname(page), rel)) if rel else page
        if not os.path.exists(os.path.join(root, path)):
            if path not in PENDING:
                missing.append(target)
        elif anchor and path.endswith(".md") and anchor not in anchors(read(path)):
            missing.append(target)
    return missing


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    missing = broken_links(page)
    assert not missing, f"{page}: {missing}"


def test_results_index_links_every_write_up():
    """docs/results.md is the index: it links every study's and benchmark's write-up, and each
    write-up links back to it."""
    index = _read("docs/results.md")
    linked = {os.path.normpath(os.path.join("docs", t.partition("#")[0]))
              for t in re.findall(r"\]\(([^)\s]+)\)", index)}
    assert len(WRITE_UPS) >= 15
    assert [w for w in WRITE_UPS if w not in linked] == []
    for w in WRITE_UPS:
        assert os.path.relpath("docs/results.md", os.path.dirname(w)) in _read(w), w


def test_link_check_catches_a_broken_link_and_anchor(tmp_path):
    """The link check above can fail: a missing file and a missing anchor are both reported."""
    (tmp_path / "a.md").write_text("# Title\n[ok](b.md#there) [gone](c.md) [bad](b.md#nowhere)"
                                   " [self](#title) ![img](b.md)\n")
    (tmp_path / "b.md").write_text("## There\n")
    assert broken_links("a.md", str(tmp_path)) == ["c.md", "b.md#nowhere"]


def test_anchor_rule_matches_github():
    assert anchors("## Learning from the real 0.5B: memory_key\n# Update memory: XLA's analysis") \
        == {"learning-from-the-real-05b-memory_key", "update-memory-xlas-analysis"}


def test_ci_runs_the_readme_test_command():
    readme = [c for c in bash_commands(_read("README.md")) if c.startswith("python -m pytest")]
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = [ln.strip() for ln in f if ln.strip().startswith("python -m pytest")]
    assert ci == ["python -m pytest -q tests"] and ci[0] in readme


def test_the_smoke_part_the_readme_shows_has_a_module_of_every_test_folder():
    """``-m smoke`` (README "Tests") selects `SMOKE_MODULES`: each exists, holds no slow test,
    and every test folder but fixtures/ has one (the top-level modules count as one folder)."""
    from tests.conftest import SMOKE_MODULES
    assert "python -m pytest -q tests -m smoke" in bash_commands(_read("README.md"))
    assert all(os.path.isfile(os.path.join(ROOT, m)) for m in SMOKE_MODULES), SMOKE_MODULES
    slow = re.compile(r"^(pytestmark = pytest\.mark\.slow|\s*@pytest\.mark\.slow)", re.M)
    assert not [m for m in SMOKE_MODULES if slow.search(_read(m))]
    folders = {d for d in os.listdir(os.path.join(ROOT, "tests"))
               if os.path.isfile(os.path.join(ROOT, "tests", d, "__init__.py"))} - {"fixtures"}
    covered = {m.split("/")[1] for m in SMOKE_MODULES if m.count("/") == 2}
    assert folders - covered == set()
    assert any(m.count("/") == 1 for m in SMOKE_MODULES)   # a top-level module too


def test_command_extraction_sees_through_continuations_and_placeholders():
    text = ("```bash\npython train.py --config=configs/builtin.py:tiny \\\n"
            "    --config.seed=2   # a comment\n"
            "python eval.py --config=configs/x.py ...\n"
            "cd strata-jax && python sft.py --config=configs/builtin.py:tiny\n```\n")
    assert entry_point_commands(text) == [
        ["train.py", "--config=configs/builtin.py:tiny", "--config.seed=2"],
        ["sft.py", "--config=configs/builtin.py:tiny"]]


@pytest.mark.parametrize("page", ["README.md", "docs/running.md", "docs/models.md"])
def test_shown_commands_parse_and_validate(page, monkeypatch):
    from strata_jax.jobs.cli import load_config, split_config_args
    from strata_jax.config import set_override
    from strata_jax.validation import validate

    monkeypatch.chdir(ROOT)
    commands = entry_point_commands(_read(page))
    assert commands or page == "docs/models.md"
    for argv in commands:
        _, overrides, spec = split_config_args(argv)
        assert spec is not None, argv
        c = load_config(spec)
        for key, value in overrides:
            set_override(c, key, value)
        validate(c)
