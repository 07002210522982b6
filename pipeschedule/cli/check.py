"""`pipeschedule check CONFIG`: its options, and its run, which hands the config to
nanotron's adapter (`integration.nanotron.check`).

The check reads the config through nanotron's own loader and lays the model out as
pipeschedule's engines do, so it needs torch and nanotron; the compiler does not
([Note: one command, its own imports] in main.py). The adapter is therefore imported
when the command runs, and where torch or nanotron is missing the command says, in one
line, what to install.
"""

from __future__ import annotations

import argparse
import importlib.util

from pipeschedule.checks import int_arg, path_arg
from pipeschedule.errors import ParameterError
from pipeschedule.plan.presets import GPUS

NEEDS = ("torch", "nanotron", "einops")  # what `import integration.nanotron` imports
INSTALL = "pip install torch -e '.[nanotron]' (from the pipeschedule checkout)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", type=path_arg("CONFIG"), help="nanotron YAML config")
    parser.add_argument("--nproc", type=int_arg("--nproc"), default=None,
                        help="processes the job starts (torchrun's --nproc-per-node times its nodes): checked "
                             "against parallelism dp * tp * pp")
    parser.add_argument("--gpu", default=None,
                        help=f"GPU preset ({', '.join(GPUS)}): the predicted memory per stage is checked against "
                             f"its memory less 2 GiB kept back (the planner's presets and reserve)")


def run(args) -> int:
    missing = [name for name in NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        raise ParameterError(f"pipeschedule check reads the config with nanotron's own loader and needs "
                             f"{', '.join(missing)}: {INSTALL}")
    from integration.nanotron.check import main as check_main  # torch and nanotron: for this command only

    return check_main(args.config, nproc=args.nproc, gpu=args.gpu)


__all__ = ["add_arguments", "run"]
