"""Run your own nanotron launch script (a fork's `run_train.py`) with pipeschedule's engines, unchanged.

    torchrun --nproc-per-node 4 -m integration.nanotron.run [--backend B] run_train.py --config-file config.yaml

[Note: a script's nanotron imports] A launch script selects pipeschedule's engines with
one line, `import integration.nanotron`, which must come before its first nanotron
import: the nanotron 0.4 wheel cannot import `nanotron.logging` or `nanotron.config`
(and so its trainer) on its own ([Note: nanotron 0.4 import cycle] in patches/import_cycle.py), and
a script that imports one of them first stops inside nanotron, with nanotron's
`ImportError: cannot import name ... from partially initialized module`, before any of
pipeschedule's code has run. This runner needs no line in the script at all: it imports
`integration.nanotron` (the repair, the engine names, the hooks), prepares the process
as `integration.nanotron.train` does (the flash-attn stand-in where flash-attn is
missing; gloo where the ranks have no GPU each: [Note: nanotron over gloo]), then runs
the script as `__main__` with the arguments after its path, so its nanotron imports work
in any order.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys

import integration.nanotron  # noqa: F401  (first: repairs nanotron 0.4's import, installs the patches)
from integration.nanotron.train import BACKENDS, prepare
from pipeschedule.runtime.launch import leave

USAGE = "usage: python -m integration.nanotron.run [--backend {auto,nccl,gloo}] SCRIPT [SCRIPT'S ARGUMENTS ...]"


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    backend = "auto"
    if args[:1] == ["--backend"]:
        if len(args) < 2 or args[1] not in BACKENDS:
            return _refuse(f"--backend takes one of {', '.join(BACKENDS)}, got {args[1] if len(args) > 1 else 'none'}")
        backend, args = args[1], args[2:]
    if not args or args[0] in ("-h", "--help"):
        print(USAGE + "\nruns SCRIPT (e.g. your run_train.py) as __main__ with pipeschedule's engines available")
        return 0 if args else 2
    script = args[0]
    if not os.path.isfile(script):
        return _refuse(f"no such script {script!r} ({USAGE.removeprefix('usage: ')})")
    prepare(backend)
    sys.argv = [script, *args[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` would
    runpy.run_path(script, run_name="__main__")
    return 0


def _refuse(message: str) -> int:
    print(f"integration.nanotron.run: {message}", file=sys.stderr)
    return 2


def _end(code: int) -> None:
    """After the script: its atexit handlers, as at any end, then out as
    `integration.nanotron.train` leaves (`leave`: the process groups the script's trainer
    left alive destroyed, no interpreter shutdown, where a rank whose work was done could
    die of SIGABRT, "terminate called without an active exception")."""
    atexit._run_exitfuncs()
    leave(code)


if __name__ == "__main__":
    _end(main())
