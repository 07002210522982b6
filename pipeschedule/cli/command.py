"""A subcommand of `pipeschedule`, and the commands other packages register.

[Note: registered commands] The core's commands (compile, verify, simulate, show, demo,
plan) are its own; a command that needs more than the core (nanotron's `check` and
`train`, which read nanotron's config with nanotron's loader) is registered by the
package that provides it, as an entry point of the group `pipeschedule.commands` naming a
`Command` (pyproject.toml: `check = "integration.nanotron.commands:CHECK"`). So the core
imports nothing of the nanotron adapter, and a command appears wherever a package that
registers it is installed. What `pipeschedule demo` runs after its schedules is
registered the same way, in the group `pipeschedule.demo` (a function returning an exit
code). A registered command is loaded only when it runs, or when the help lists it; its
module imports nothing heavy at load (torch and nanotron only once it runs, [Note: one
command, its own imports] in main.py). An editable install (`pip install -e .`) records
the entry points: after they change, install again.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

from pipeschedule.errors import ParameterError

COMMAND_GROUP = "pipeschedule.commands"
DEMO_GROUP = "pipeschedule.demo"


@dataclass(frozen=True)
class Command:
    """One subcommand: its line in `pipeschedule -h`, what its own -h says above and below
    its options, and the function that adds its options and its run (`set_defaults(run=)`).
    `passes_unknown`: options the parser does not know are handed to the run as
    `args.passed` (a launcher's options for the tool it starts) instead of refused."""

    help: str
    description: str
    examples: tuple[str, ...]
    add: Callable[[argparse.ArgumentParser], None]
    passes_unknown: bool = False


def registered(group: str = COMMAND_GROUP) -> dict[str, metadata.EntryPoint]:
    """The entry points of `group` by name (not loaded), first of each name."""
    found: dict[str, metadata.EntryPoint] = {}
    for entry in metadata.entry_points(group=group):
        found.setdefault(entry.name, entry)
    return found


def load_command(name: str, entry: metadata.EntryPoint) -> Command:
    """The `Command` entry point `name` names; a ParameterError in one line where it cannot
    be loaded or is no Command."""
    try:
        command = entry.load()
    except Exception as err:  # noqa: BLE001  (an entry point's module failing to import: say which and why)
        raise ParameterError(f"command {name!r} is registered by {entry.value}, which cannot be loaded: "
                             f"{type(err).__name__}: {err} (reinstall: pip install -e .)") from None
    if not isinstance(command, Command):
        raise ParameterError(f"command {name!r} is registered by {entry.value}, which is no "
                             f"pipeschedule.cli.command.Command (got {type(command).__name__})")
    return command


__all__ = ["COMMAND_GROUP", "DEMO_GROUP", "Command", "load_command", "registered"]
