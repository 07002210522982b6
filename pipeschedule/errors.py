"""The project's error types: one hierarchy.

Every error pipeschedule raises on purpose derives from `PipescheduleError`, so the
command line can catch exactly these and print one line, fuzz tests can assert that
nothing else escapes a loader, and a launcher can stop every rank on one. The compiler's
and the planner's (`ParameterError`, `FormatError`, `ArgumentError`, `ScheduleError`)
and the runtime's (`RuntimeScheduleError`, `ScheduleMismatchError`, `LaunchError`) are
here; the nanotron adapter adds its own subclasses (integration/nanotron/pipeline/errors.py).

    PipescheduleError
      ParameterError (ValueError)     a parameter out of range
      FormatError (ValueError)        a file that cannot be read
      ArgumentError                   a command-line value that cannot be read
      ScheduleError                   a schedule that breaks a rule
      RuntimeScheduleError            a rank that could not run its program
        ScheduleMismatchError         ranks given different schedules
      LaunchError                     spawned ranks that failed or hung
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


class RuntimeScheduleError(PipescheduleError):
    """A rank could not run its program: a missing or leftover buffer, a tensor of the
    wrong shape, a failing stage, a wait past the watchdog's timeout, or another rank's
    failure.

    `rank`, `step`, `pc` and `instr` locate it; `remote` is True when this rank stopped
    because another rank failed first (the message then quotes that rank's error).
    """

    def __init__(self, message, *, rank=None, step=None, pc=None, instr=None, remote=False):
        super().__init__(message)
        self.rank = rank
        self.step = step
        self.pc = pc
        self.instr = instr
        self.remote = remote


class ScheduleMismatchError(RuntimeScheduleError):
    """The ranks of one transport run different schedules ([Note: schedule agreement]).

    `fields` names what differs ("m", "params.cap", "placement", "programs", ...) and
    `ranks` the ranks whose schedule differs from this rank's; the message quotes each
    schedule in words.
    """

    def __init__(self, message, *, fields=(), ranks=(), **located):
        super().__init__(message, **located)
        self.fields = tuple(fields)
        self.ranks = tuple(ranks)


class LaunchError(PipescheduleError):
    """One or more ranks started by `launch.spawn` failed, or did not finish in time.

    `failures` maps rank -> `launch.RankFailure` (exception type name, message, traceback,
    time); ranks that never reported appear with type name "Timeout" or "Died".
    """

    def __init__(self, message, failures):
        super().__init__(message)
        self.failures = failures
