"""The project's error types.

Every error a user can cause derives from `PipescheduleError`, so the command line can
catch exactly these and print one line, and fuzz tests can assert that nothing else
escapes a loader.
"""


class PipescheduleError(Exception):
    """Base of every error this package raises on purpose."""


class ParameterError(PipescheduleError, ValueError):
    """A schedule parameter (pp, microbatches, virtual, cap, name) is out of range."""


class FormatError(PipescheduleError, ValueError):
    """A schedule file (JSON, text, CSV) cannot be read: bad syntax, types or fields."""


class ArgumentError(PipescheduleError):
    """A command-line value that cannot be read (`limits.int_arg`, `limits.number_arg`).
    Not a ValueError, so argparse passes it on as it is instead of its own message."""


class ScheduleError(PipescheduleError):
    """A schedule breaks one of the verifier's rules.

    `rule` is the rule's short name (coverage, dependency, matching, deadlock,
    liveness, cap); `rank`, `index` (program counter), `instr` and `mb` locate it.
    The message already contains the rank x step grid around the failing cell.
    """

    def __init__(self, message, *, rule, rank=None, index=None, instr=None, mb=None):
        super().__init__(message)
        self.rule = rule
        self.rank = rank
        self.index = index
        self.instr = instr
        self.mb = mb
