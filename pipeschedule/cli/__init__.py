"""The `pipeschedule` command (`main`); `python -m pipeschedule.cli` runs it too.

    main   the subcommands compile, verify, simulate, show, demo, plan, check; --version
    plan   `pipeschedule plan`: its flags and its run
    check  `pipeschedule check`: its flags; its run is nanotron's adapter's (integration.nanotron.check)
    demo   `pipeschedule demo`
"""

from pipeschedule.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
