"""The shipped cost files work: every `pipeschedule` command in README.md and docs/*.md that
names a cost file (`--cost`), and every command of examples/README.md, runs as written,
from the repository's root, and exits 0."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from pipeschedule.cli import main

ROOT = Path(__file__).resolve().parents[2]


def shell_commands(path: Path) -> list[str]:
    """The `pipeschedule ...` lines of a Markdown file's fenced bash blocks (comments cut)."""
    blocks = re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith("pipeschedule ")]


README_COST_COMMANDS = [c for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
                        for c in shell_commands(page) if "--cost" in c]
EXAMPLE_COMMANDS = shell_commands(ROOT / "examples" / "README.md")


def test_the_readme_and_the_examples_name_shipped_cost_files():
    assert len(README_COST_COMMANDS) >= 2 and len(EXAMPLE_COMMANDS) >= 5
    named = {Path(words[words.index("--cost") + 1]) for words in map(shlex.split, README_COST_COMMANDS
                                                                       + EXAMPLE_COMMANDS) if "--cost" in words}
    shipped = {p.relative_to(ROOT) for p in (ROOT / "examples").glob("*.json")}
    assert named <= shipped and shipped <= named, (named, shipped)  # each shipped file is shown in use


@pytest.mark.parametrize("command", README_COST_COMMANDS + EXAMPLE_COMMANDS)
def test_the_command_runs_as_written(tmp_path, monkeypatch, capsys, command):
    words = shlex.split(command)
    outputs = ("--trace", "--png", "--text", "--csv") + (("--json",) if words[1] == "compile" else ())
    for at, word in enumerate(words[:-1]):
        if word in outputs:  # files it writes go to tmp_path, not into the checkout
            words[at + 1] = str(tmp_path / os.path.basename(words[at + 1]))
    monkeypatch.chdir(ROOT)
    assert main(words[1:]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "step time" in out or "compiled " in out


def test_a_cost_file_of_other_stages_is_refused_naming_the_counts(capsys):
    """What the shipped gpu_cost_v2.json did at pp=4 without --virtual 2 (8 stages against 4)."""
    assert main(["simulate", "1f1b", "--pp", "4", "-m", "8", "--cost", str(ROOT / "examples/cost_pp4_v2.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has 8 entries, but the schedule has 4 stages" in err, err
