"""The README is a user's guide: short, its links and the paths it names exist, and its test command
is the one CI runs. The pages under docs/ link only to files that exist."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_README_LINES = 300

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# a path in backticks with a directory and a file extension: `eagle3/config.py`, `bench/prompts/x.jsonl`
CODE_PATH = re.compile(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|yaml|md|jsonl|json|sh|toml|ipynb))`")


def local_links(md: Path) -> list[str]:
    """The relative targets of markdown links in md (no URL, no pure anchor), without a #fragment."""
    out = []
    for target in LINK.findall(md.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0])
    return out


def broken_links(md: Path) -> list[str]:
    return [t for t in local_links(md) if not (md.parent / t).exists()]


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; topics belong in docs/ (at most {MAX_README_LINES})"


def test_readme_links_exist():
    assert local_links(README), "the README links no local file: the link pattern is broken"
    assert broken_links(README) == []


def test_readme_code_paths_exist():
    paths = CODE_PATH.findall(README.read_text())
    assert paths
    assert [p for p in paths if not (REPO / p).exists()] == []


@pytest.mark.parametrize("md", sorted((REPO / "docs").glob("*.md")), ids=lambda p: p.name)
def test_docs_links_exist(md):
    assert broken_links(md) == []


def test_ci_runs_the_readme_test_command():
    """.ci/run's command is, character for character, the README's second quick-start command."""
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert len(ci) == 1
    quick = README.read_text().split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in quick.splitlines() if line.strip() and not line.startswith("#")]
    assert commands == ["bash scripts/install.sh && python3 -m eagle3", ci[0]]


def test_broken_link_is_found(tmp_path):
    md = tmp_path / "x.md"
    (tmp_path / "there.md").write_text("")
    md.write_text("[a](there.md) [b](missing.md#x) [c](https://example.com) [d](#anchor)")
    assert broken_links(md) == ["missing.md"]
