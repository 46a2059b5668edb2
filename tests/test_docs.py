"""The documentation: the MkDocs site builds with no broken link between pages, every page is
in its navigation, and the scripts the pages show are the example files CI runs."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
EXAMPLE = re.compile(r"<!-- example: (\S+) -->\n```python\n(.*?)```\n", re.S)


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                             str(tmp_path / "site")], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "memory_plan" / "index.html").is_file()


def _nav_pages(entries) -> list[str]:
    pages = []
    for entry in entries:
        for value in (entry.values() if isinstance(entry, dict) else [entry]):
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_navigation():
    nav = _nav_pages(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])
    assert sorted(nav) == sorted(p.name for p in DOCS.glob("*.md"))


def test_shown_scripts_are_the_examples_ci_runs():
    shown = {name: code for page in DOCS.glob("*.md")
             for name, code in EXAMPLE.findall(page.read_text())}
    assert {"examples/finetuner_user_script.py", "examples/own_loop.py"} <= set(shown)
    for name, code in shown.items():
        assert code == (REPO / name).read_text(), f"{name} differs from what the docs show"
