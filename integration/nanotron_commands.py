"""The nanotron adapter's commands of `pipeschedule` (`check`, `train`) and its part of
`pipeschedule demo`, registered as entry points in pyproject.toml ([Note: registered
commands] in pipeschedule/cli/command.py).

This module imports neither torch nor nanotron, and sits beside the `integration.nanotron`
package rather than in it (importing that package repairs nanotron and installs its
patches): `pipeschedule -h` lists these commands wherever pipeschedule is installed. A
command's run looks for torch and nanotron first and, where one is missing, says in one
line what to install; then it imports the adapter
(`integration.nanotron.check`, `.launch`, `.demo`), which repairs nanotron and installs
its patches.
"""

from __future__ import annotations

import argparse
import importlib.util

from pipeschedule.checks import int_arg, path_arg
from pipeschedule.cli.command import Command
from pipeschedule.errors import ParameterError

NEEDS = ("torch", "nanotron", "einops")  # what `import integration.nanotron` imports
INSTALL = "pip install torch -e '.[nanotron]' (from the pipeschedule checkout)"


def missing() -> list[str]:
    """The packages of NEEDS that are not installed."""
    return [name for name in NEEDS if importlib.util.find_spec(name) is None]


def _needs(what: str) -> None:
    absent = missing()
    if absent:
        raise ParameterError(f"{what} reads the config with nanotron's own loader and needs {', '.join(absent)}: "
                             f"{INSTALL}")


# -- check ------------------------------------------------------------------------------------------


def _add_check(parser: argparse.ArgumentParser) -> None:
    from pipeschedule.plan.assumptions import add_arguments as add_assumptions  # the planner: for check only

    parser.add_argument("config", metavar="CONFIG", type=path_arg("CONFIG"), help="nanotron YAML config")
    parser.add_argument("--nproc", type=int_arg("--nproc"), default=None,
                        help="processes the job starts (torchrun's --nproc-per-node times its nodes): checked "
                             "against parallelism dp * tp * pp")
    add_assumptions(parser)  # [Note: shared assumptions]: the same flags and defaults as plan's
    parser.set_defaults(run=_run_check)


def _run_check(args) -> int:
    from pipeschedule.plan.assumptions import Assumptions

    _needs("pipeschedule check")
    assumptions = Assumptions.from_args(args)  # (a bad --gpu is refused before nanotron loads)
    from integration.nanotron.check import main as check_main  # torch and nanotron: for this command only

    return check_main(args.config, nproc=args.nproc, assumptions=assumptions)


CHECK = Command(
    "check a nanotron YAML before launching it: engine, layout, world size, schedule, data, memory per rank",
    "Read a nanotron config through nanotron's own loader (with pipeschedule's engines), parse its pp_engine, lay "
    "its model out as the engine will, check the world size, compile and verify the schedule, check the dataset "
    "and tokenizer it reads, and predict the memory per rank under the same assumptions as `pipeschedule plan` "
    "(the same flags and defaults; printed). No GPU and no processes are needed; torch and nanotron are. Exit 0: "
    "it would run (the last line says so); 2: one line naming the value and the fix.",
    ("pipeschedule check config.yaml", "pipeschedule check config.yaml --nproc 8 --gpu h100 --reserve 4"),
    _add_check)


# -- train ------------------------------------------------------------------------------------------


def _add_train(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", type=path_arg("CONFIG"), help="nanotron YAML config")
    parser.add_argument("--nproc", type=int_arg("--nproc"), required=True,
                        help="processes per node (torchrun's --nproc-per-node)")
    parser.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                        help="auto: NCCL with one GPU per local rank, else gloo")
    parser.add_argument("--record", metavar="DIR",
                        help="write DIR/rank{R}.json per rank: losses, step times, peak memory, the first step's stash")
    parser.epilog = ("torchrun's own options (--nnodes, --node-rank, --rdzv-endpoint, --master-port, ...) may follow; "
                     "they are passed to it as given.\n\n" + (parser.epilog or ""))
    parser.set_defaults(run=_run_train)


def _run_train(args) -> int:
    _needs("pipeschedule train")
    from integration.nanotron.launch import launch  # torch and nanotron: for this command only

    return launch(args.config, nproc=args.nproc, torchrun=list(args.passed), backend=args.backend,
                  record=args.record)


TRAIN = Command(
    "train a nanotron YAML: the pre-flight once, then the ranks under torchrun",
    "Check the config once as `pipeschedule check` does (engine, layout, world size against --nproc times the "
    "nodes, schedule, data), then start the ranks with torchrun (`-m integration.nanotron.train`). A refused config "
    "is said in one line before any rank starts (exit 2); a rank that fails or is killed ends every rank, and its "
    "one line is said once, naming the rank (exit 1). torchrun's own options may follow.",
    ("pipeschedule train config.yaml --nproc 4", "pipeschedule train config.yaml --nproc 8 --nnodes 2 --node-rank 0 "
     "--rdzv-endpoint host:29500"),
    _add_train, passes_unknown=True)


# -- demo -------------------------------------------------------------------------------------------


def demo_training() -> int:
    """`pipeschedule demo`'s part after the schedules: nanotron's trainer on CPU
    (integration.nanotron.demo), or one line saying what to install."""
    absent = missing()
    if absent:
        print(f"\n(training part skipped: {', '.join(absent)} not installed; install it with "
              f"`pip install torch==2.13.0 -e '.[nanotron]'`)")
        return 0
    from integration.nanotron.demo import run_training_demo  # repairs nanotron 0.4, registers our engines

    print("\n== training: nanotron's trainer and Llama, its own 1F1B against pipeschedule's capped_1f1b (cap 2)")
    return run_training_demo()


__all__ = ["CHECK", "TRAIN", "demo_training", "missing"]
