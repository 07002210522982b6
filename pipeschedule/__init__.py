"""pipeschedule: pipeline-parallel schedules compiled to per-rank instruction lists,
verified, simulated and executed.

The compiler (everything here outside `runtime/`) is pure Python and imports no torch:

    >>> from pipeschedule import compile_schedule
    >>> schedule = compile_schedule("capped_1f1b", pp=4, microbatches=8, cap=2)
    >>> print(schedule.programs[0][:3])
"""

from pipeschedule.errors import FormatError, ParameterError, PipescheduleError, ScheduleError
from pipeschedule.compiler.families import FAMILIES, Family, generate
from pipeschedule.compiler.ir import BUFFERS, Instr, Op, Schedule, dump, load
from pipeschedule.compiler.passes import forward_only, lower, on_graph
from pipeschedule.compiler.verify import verify


def compile_schedule(name: str, *, pp: int, microbatches: int, virtual: int | None = None, cap=None, cost=None,
                     edges=None, check: bool = True) -> Schedule:
    """Generates the compute order of family `name`, lowers it (communication, FREE) and,
    unless `check` is False, verifies every rule. Raises ParameterError on bad
    parameters and ScheduleError if the result breaks a rule.

    `cost` (None: unit costs; a `CostModel`, or one (forward, backward, weight) time tuple
    per stage) is what the list-scheduled families order by and what lowering places the
    messages by; see `generators.generate`. `edges` is the stage graph (None: the chain;
    [Note: stage graph] in compiler/graph.py)."""
    order = generate(name, pp=pp, microbatches=microbatches, virtual=virtual, cap=cap, cost=cost, edges=edges)
    schedule = lower(order, cost)
    if check:
        verify(schedule)
    return schedule


__all__ = [
    "BUFFERS", "FAMILIES", "Family", "FormatError", "Instr", "Op", "ParameterError", "PipescheduleError",
    "Schedule", "ScheduleError", "compile_schedule", "dump", "forward_only", "generate", "load", "lower", "on_graph",
    "verify",
]
