"""What `pipeschedule` says about itself: its version, what it is for, a help line, a
description and examples for every command (each example a command line the parser
takes); and that a command loads only what it needs ([Note: one command, its own
imports] in cli/main.py)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pipeschedule.cli import main
from pipeschedule.cli.main import COMMANDS, all_commands, build_parser, command_of

ROOT = Path(__file__).resolve().parents[2]


def test_version_is_the_projects(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out.strip() == f"pipeschedule {version}"


def test_the_top_level_help_says_what_the_tool_is_for(capsys):
    with pytest.raises(SystemExit):
        main(["-h"])
    text = capsys.readouterr().out
    assert "nanotron" in text and "pp_engine" in text
    assert "torchrun --nproc-per-node N -m integration.nanotron.train --config-file CONFIG" in text
    for name, command in all_commands().items():
        assert f"    {name}" in text and command.help.split()[0] in text
    assert {"check", "train"} <= set(all_commands()) - set(COMMANDS)  # the nanotron adapter's, registered


@pytest.mark.parametrize("name", list(all_commands()))
def test_every_command_has_a_description_and_examples_the_parser_takes(capsys, name):
    with pytest.raises(SystemExit):
        main([name, "-h"])
    text = capsys.readouterr().out
    command = all_commands()[name]
    assert command.help and command.description.split()[0] in text
    assert "examples:\n" in text and command.examples
    for example in command.examples:
        assert f"  {example}\n" in text + "\n"
        words = shlex.split(example)
        assert words[0] == "pipeschedule" and words[1] == name
        parser = build_parser()  # every flag and value of the example is accepted (or passed on, where it may be)
        args = parser.parse_known_args(words[1:])[0] if command.passes_unknown else parser.parse_args(words[1:])
        assert args.command == name


def test_a_parser_for_one_command_builds_that_command_alone():
    parser = build_parser("compile")
    assert parser.parse_args(["compile", "1f1b", "--pp", "2", "-m", "2", "--json", "s.json"]).pp == 2
    with pytest.raises(Exception, match="unrecognized arguments: --model"):
        parser.parse_args(["plan", "--model", "llama3-8b"])  # plan's options were not built
    assert command_of(["--version"]) is None and command_of(["show", "1f1b"]) == "show"


# A fresh interpreter in which torch, nanotron and einops cannot be imported (as where
# `pip install -e .` installed pipeschedule and its adapter without their dependencies)
# runs one command and says what it loaded.
LOADED = ("import json, sys\n"
          "for name in ('torch', 'nanotron', 'einops'):\n"
          "    sys.modules[name] = None  # import raises ImportError, find_spec says not installed\n"
          "from pipeschedule.cli import main\n"
          "try:\n"
          "    code = main(sys.argv[1:])\n"
          "except SystemExit as stop:  # -h\n"
          "    code = stop.code\n"
          "print(json.dumps([code, sorted(m for m, module in sys.modules.items() if module is not None and "
          "m.startswith('pipeschedule.plan'))]))\n")


@pytest.mark.spawn
@pytest.mark.parametrize("argv, planner", [
    (["compile", "1f1b", "--pp", "4", "-m", "8", "--offload", "auto", "--json", "{tmp}/s.json"], False),
    (["compile", "capped_1f1b", "--pp", "4", "-m", "8", "--offload", "fraction=0.5", "--text", "{tmp}/s.txt"], False),
    (["verify", "{tmp}/s.json"], False),
    (["simulate", "zbv", "--pp", "2", "-m", "4", "--json"], False),
    (["show", "capped_1f1b", "--pp", "2", "-m", "4"], False),
    (["demo"], False),  # (its training part, the adapter's, skipped: torch and nanotron are not there)
    (["-h"], False),  # every registered command listed: their modules load no planner, no torch
    (["plan", "--model", "llama3-8b", "--pp", "2", "--microbatches", "4", "--tables", "none", "--recompute",
      "none", "--zero", "0"], True),
])
def test_a_command_runs_without_torch_and_loads_the_planner_only_when_it_plans(tmp_path, argv, planner):
    """Each command runs where torch, nanotron and the adapter cannot be imported; the
    compiler's commands leave no pipeschedule.plan module loaded."""
    if argv[0] == "verify":
        assert main(["compile", "1f1b", "--pp", "2", "-m", "2", "--json", str(tmp_path / "s.json")]) == 0
    argv = [word.replace("{tmp}", str(tmp_path)) for word in argv]
    result = subprocess.run([sys.executable, "-c", LOADED, *argv], capture_output=True, text=True, timeout=300)
    code, loaded = json.loads(result.stdout.splitlines()[-1])
    assert code == 0, result.stderr[-2000:]
    assert bool(loaded) == planner, loaded


@pytest.mark.spawn
def test_check_without_torch_or_nanotron_says_what_to_install_in_one_line(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("parallelism: {dp: 1, pp: 2, tp: 1}\n")
    result = subprocess.run([sys.executable, "-c", LOADED, "check", str(config)], capture_output=True, text=True,
                            timeout=300)
    assert json.loads(result.stdout.splitlines()[-1])[0] == 2
    assert result.stderr.splitlines() == [
        "pipeschedule: error: pipeschedule check reads the config with nanotron's own loader and needs torch, "
        "nanotron, einops: pip install torch -e '.[nanotron]' (from the pipeschedule checkout)"], result.stderr
