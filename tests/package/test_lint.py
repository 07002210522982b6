"""The linter is part of the suite: `python -m pytest` (the README's test command and
`.ci/run`) fails where `ruff check` would. ruff is pinned in the test extra and its
rules live in pyproject.toml ([tool.ruff])."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> list[str]:
    """ruff as installed by the test extra: its module, else its command."""
    probe = subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True, text=True)
    if probe.returncode == 0:
        return [sys.executable, "-m", "ruff"]
    if shutil.which("ruff"):
        return ["ruff"]
    pytest.fail("ruff is not installed: pip install -e '.[test]' installs the pinned version")


@pytest.mark.spawn
def test_the_tree_is_ruff_clean():
    result = subprocess.run([*_ruff(), "check", "--no-cache", "--output-format", "concise", "."],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.mark.spawn
def test_ruff_reports_a_finding(tmp_path):
    """The check can fail: an unused import and a long line are reported with the
    project's configuration."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nx = '" + "a" * 130 + "'\n")
    result = subprocess.run([*_ruff(), "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"),
                             "--output-format", "concise", str(bad)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "F401" in result.stdout and "E501" in result.stdout, result.stdout
