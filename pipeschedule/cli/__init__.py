"""The `pipeschedule` command (`main`); `python -m pipeschedule.cli` runs it too.

    main   the subcommands compile, verify, simulate, show, demo, plan
    plan   `pipeschedule plan`: its flags and its run
    demo   `pipeschedule demo`
"""

from pipeschedule.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
