"""README.md and docs/ kept true (the checks themselves: docs_check.py).

(a) Every path, module (`pipeschedule.x.y`, `integration.nanotron.z`, `benchmarks.w`),
    `pipeschedule` subcommand and option, and link target (with its anchor) that README.md,
    docs/*.md and examples/README.md name exists.
    docs/architecture.md's file map lists every module of `pipeschedule/` and
    `integration/`, and nothing that is not there.
(b) Every Note referenced anywhere in the code and the Markdown is defined once, in the
    file a reference names ([Note: Note definitions] in tests/package/docs_check.py).
(c) Every fenced shell command of README.md runs in CI, or its block is marked GPU
    ([Note: GPU blocks] in tests/package/docs_check.py): the others run for real, in
    order, in one temporary folder that stands for the checkout (its shipped examples/
    linked in), with the files the guide calls the user's own (a corpus, a tokenizer, a
    launch script) made first. `pip install` prefixes are taken off: CI installed the
    extras before the suite ran (`.ci/run`), and README's test command is the one
    `.ci/run` runs, so it is compared with it rather than run inside itself.
Each checker is also shown to catch a made-up broken reference, Note and command.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from docs_check import (ROOT, USER_FILES, Command, broken_references, cli_parser, file_map, guide_commands,
                        markdown_table, schedule_of, table_mismatches,
                        note_problems, unmapped, without_install)

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md"]
README = (ROOT / "README.md").read_text()
COMMANDS = guide_commands(README)
TEST_COMMAND = "python -m pytest -q"


@pytest.fixture(scope="module")
def parser():
    return cli_parser()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_module_and_command_a_page_names_exists(page, parser):
    assert broken_references(page.read_text(), page, parser) == []


def test_the_file_map_lists_every_module_and_only_those():
    text = (ROOT / "docs" / "architecture.md").read_text()
    listed = file_map(text.split("## The files", 1)[1].split("```", 2)[1])
    assert len(listed) > 50
    assert [path for path in listed if not (ROOT / path).exists()] == []
    assert unmapped(listed) == []


def test_the_file_map_checker_catches_a_missing_and_an_unlisted_module():
    listed = file_map("pipeschedule/      what\n  compiler/        schedules\n    gone.py        a file\n"
                      "    walk.py, verify.py   two files\n                   a description going on\n"
                      "integration/nanotron/   the adapter\n  run.py   a file\n")
    assert listed == ["pipeschedule/", "pipeschedule/compiler/", "pipeschedule/compiler/gone.py",
                      "pipeschedule/compiler/walk.py", "pipeschedule/compiler/verify.py", "integration/nanotron/",
                      "integration/nanotron/run.py"]
    missing = unmapped(listed)
    assert "pipeschedule/compiler/passes.py" in missing and "integration/nanotron/train.py" in missing
    assert "pipeschedule/compiler/walk.py" not in missing and "pipeschedule/checks.py" in missing


def test_the_readme_is_a_guide_of_at_most_about_250_lines():
    assert len(README.splitlines()) <= 260
    assert README.index("```bash") < README.index("## What it is")  # the two commands at the very top


def _sources() -> dict[str, str]:
    folders = ("pipeschedule", "integration", "benchmarks", "tests", "docs", "examples")
    files = [p for folder in folders for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md")]
    files += [ROOT / "README.md"]
    return {str(p.relative_to(ROOT)): p.read_text() for p in files}


def test_every_note_referenced_is_defined_once_where_it_is_said_to_be():
    assert note_problems(_sources()) == []


# --- the checkers catch what they are for --------------------------------------------

def test_a_page_naming_what_does_not_exist_is_caught(parser):
    page = ROOT / "docs" / "made_up.md"
    text = ("Run `pipeschedule/compiler/nowhere.py` or tests/runtime/test_gone.py, see\n"
            "[the rules](architecture.md#no-such-heading) and [missing](../docs/missing.md);\n"
            "`pipeschedule.compiler.passes.no_such_pass` and `python -m benchmarks.no_such_benchmark`;\n"
            "```bash\npipeschedule frobnicate --pp 4\npipeschedule compile 1f1b --pp 4 --no-such-flag 2\n```\n")
    assert broken_references(text, page, parser) == [
        "path `pipeschedule/compiler/nowhere.py`", "path tests/runtime/test_gone.py",
        "link anchor architecture.md#no-such-heading", "link target ../docs/missing.md",
        "module pipeschedule.compiler.passes.no_such_pass", "module benchmarks.no_such_benchmark",
        "subcommand pipeschedule frobnicate", "option pipeschedule compile --no-such-flag"]
    good = ("`pipeschedule/compiler/passes.py`, [the rules](architecture.md#the-rules-pipeschedule-verify), "
            "`pipeschedule.compiler.passes.forward_only`, `pipeschedule.lower`, `pipeschedule compile 1f1b --pp 4 "
            "-m 8 --cap 2 --json s.json`")
    assert broken_references(good, page, parser) == []


def test_a_note_undefined_defined_twice_or_elsewhere_is_caught():
    note = "[Note" + ": "  # built, so that this file itself neither defines nor references a Note
    files = {"a.py": f'"""One, after {note}lost].\n\n{note}twice] First.\n"""\n# {note}moved] A note.\n',
             "b.py": f'"""Two.\n\n{note}twice] Again.\n\nSee {note}moved] in c.py and {note}gone\n   away].\n"""\n',
             "c.md": f"{note}twice] in `a.py`, {note}lost] in a.py\n"}
    assert note_problems(files) == [
        f"{note}twice] defined 2 times: a.py:3, b.py:3",
        f"a.py:1: {note}lost] is defined nowhere",
        f"b.py:5: {note}gone away] is defined nowhere",
        f"b.py:5: {note}moved] in c.py, but it is defined in a.py",
        f"c.md:1: {note}lost] is defined nowhere"]
    assert note_problems({"a.py": f"# {note}kept] Its text.\nx = 1  # {note}kept]: a reference\n",
                          "b.md": f"{note}kept] in a.py"}) == []


def test_readme_commands_are_run_or_marked_gpu_and_the_marker_is_read():
    text = ("```bash\n# GPU: not run in CI\ntorchrun --nproc-per-node 8 -m x\n```\n"
            "```bash\npython -m pip install -e . && pipeschedule demo\npipeschedule compile 1f1b --pp 2 \\\n"
            "    -m 2 --json s.json   # a comment\n# a comment line\n```\n```\nshown output\n```\n")
    assert guide_commands(text) == [
        Command("torchrun --nproc-per-node 8 -m x", gpu=True, shown=None),
        Command("python -m pip install -e . && pipeschedule demo", gpu=False, shown=None),
        Command("pipeschedule compile 1f1b --pp 2 -m 2 --json s.json # a comment", gpu=False, shown="shown output\n")]
    assert without_install("python -m pip install -e '.[nanotron]' && pipeschedule demo") == "pipeschedule demo"
    assert without_install("pip install -e '.[data]'   # the extra") == ""
    assert [c for c in COMMANDS if c.gpu] and [c for c in COMMANDS if not c.gpu]  # README has both kinds


def test_readme_test_command_is_what_ci_runs():
    """README's second command installs what `.ci/run` installs (less its `-q`) and runs
    the command `.ci/run` runs."""
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#")]
    (line,) = [c.line for c in COMMANDS if TEST_COMMAND in c.line]
    install, test = (part.strip() for part in line.split("&&"))
    assert test == TEST_COMMAND == ci[-1]
    assert shlex.split(install) == [word for word in shlex.split(ci[-2]) if word != "-q"]


# --- the guide, run ------------------------------------------------------------------

USER_SCRIPT = '''\
"""A fork's run_train.py: nanotron first, and no line of pipeschedule's."""
import argparse

from nanotron import logging  # noqa: F401  (the 0.4 wheel alone cannot import it first)
from nanotron.trainer import DistributedTrainer

from integration.nanotron import data

parser = argparse.ArgumentParser()
parser.add_argument("--config-file", required=True)
trainer = DistributedTrainer(parser.parse_args().config_file)
trainer.train(data.train_dataloader(trainer, data.load(trainer.config)))
'''


def make_user_files(folder: Path, line: str) -> None:
    """What the guide calls the user's own, for a command that names it."""
    sys.path.insert(0, str(ROOT / "tests" / "nanotron"))
    try:
        from text_corpus import write_corpus, write_tokenizer
    finally:
        sys.path.remove(str(ROOT / "tests" / "nanotron"))
    if "my-corpus" in line and not (folder / "my-corpus").exists():
        write_corpus(folder / "my-corpus", 40 * 257 + 1)  # two runs of 2 steps x 8 samples of 256 + 1 tokens
    if "my-tokenizer" in line and not (folder / "my-tokenizer").exists():
        write_tokenizer(folder / "my-tokenizer")
    if "run_train.py" in line:
        (folder / "run_train.py").write_text(USER_SCRIPT)


EXPECTED = {  # what a command's output must hold, beside exit code 0
    "pipeschedule demo": "equal",
    "torchrun": "iteration: 2 / 2",
    "pipeschedule check": "would run",
    "pipeschedule verify": "valid",
    "pipeschedule --version": "pipeschedule ",
}


def _free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


@pytest.mark.spawn
def test_the_readme_guide_runs(tmp_path):
    """Every CPU command of README.md, as a user types it after the install. torchrun's
    rendezvous port comes from the environment (PET_MASTER_PORT, torchrun's own variable),
    so the commands stay as written and a port in use elsewhere cannot fail them."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    run = [c for c in COMMANDS if not c.gpu and TEST_COMMAND not in c.line and without_install(c.line)]
    assert len(run) >= 15
    for command in run:
        line = without_install(command.line)
        make_user_files(tmp_path, line)
        env["PET_MASTER_PORT"] = _free_port()
        result = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, f"{line}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        for start, expected in EXPECTED.items():
            if line.startswith(start):
                assert expected in result.stdout, f"{line}\n{result.stdout[-2000:]}"
        if command.shown:  # the output README shows is the output it gives
            got = {" ".join(out.split()) for out in result.stdout.splitlines()}
            missing = [shown for shown in command.shown.splitlines()
                       if shown.strip() not in ("", "...") and " ".join(shown.split()) not in got]
            assert not missing, f"{line}: README shows lines it no longer prints: {missing}"
    assert (tmp_path / "config.yaml").exists() and (tmp_path / "s.json").exists()


@pytest.mark.spawn
def test_a_failing_guide_command_is_caught(tmp_path):
    """The runner above fails on a command that fails; shown on a made-up one."""
    bad = guide_commands("```bash\npipeschedule compile no_such_family --pp 2 -m 2 --json s.json\n```\n")[0]
    result = subprocess.run(["bash", "-c", without_install(bad.line)], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 2 and "no_such_family" in result.stderr


def test_user_files_are_named_so():
    """The names the pages may use for the user's own files are not the repository's."""
    assert not [name for name in USER_FILES if (ROOT / name).exists()]


# (d) the schedule tables' figures are the simulator's (pp=4, m=16, default costs)

SCHEDULES_MD = (ROOT / "docs" / "schedules.md").read_text()
TABLES = [
    (README, "| `pp_engine` |", {"activations, first stage (fullest)": "activations", "bubble": "bubble",
                                  "throughput vs 1F1B": "throughput"}),
    (SCHEDULES_MD, "| schedule | step time |", {"step time": "step", "bubble": "bubble",
                                                "in flight per rank": "inflight",
                                                "first-stage activations": "activations",
                                                "throughput vs 1f1b": "throughput"}),
    (SCHEDULES_MD, "| schedule | placement, stages a rank |", {"bubble": "bubble",
                                                               "activations, rank 0 (fullest)": "activations",
                                                               "throughput vs 1f1b": "throughput"}),
]


@pytest.mark.parametrize("text, header, columns", TABLES, ids=["readme", "side-by-side", "pytorch-families"])
def test_the_schedule_tables_figures_are_the_simulators(text, header, columns):
    rows = markdown_table(text, header)
    assert len([r for r in rows if schedule_of(next(iter(r.values())))]) >= 4
    assert table_mismatches(rows, columns) == []


def test_a_wrong_figure_in_a_schedule_table_is_caught():
    text = ("| schedule | step time | bubble |\n|---|---|---|\n| `1f1b` | 57.0 | 0.158 |\n"
            "| `zb_h2` | 51.0 | 0.159 |\n| `looped_bfs --virtual 2` | 52.0 | 0.086 |\n")
    wrong = table_mismatches(markdown_table(text, "| schedule |"), {"step time": "step", "bubble": "bubble"})
    assert [w.split()[0] for w in wrong] == ["zb_h2", "looped_bfs"], wrong
