"""Errors the runtime raises on purpose."""

from __future__ import annotations

from pipeschedule.errors import PipescheduleError


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
