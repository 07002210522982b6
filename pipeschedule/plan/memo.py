"""`Memo`: results of a pure computation kept by its arguments, within a bound.

[Note: run-wide memos] One `pipeschedule plan` run plans every data-parallel size, ZeRO
stage and recompute mode it compares (levers.py, advice.py), and they share one
ScheduleCache (schedule_cache.py), so one step graph and one Peaks per schedule. Much of what
those plans compute repeats exactly: the pipeline does not change with dp or the ZeRO
stage (only the tail after it and the memory do), the activation bytes do not change
with them either, and the memory of a split problem does not change with dp under
ZeRO-0. So the step graph keeps its simulations and message times (step_graph.py), Peaks
its peaks (peaks.py), the ScheduleCache the split problem's memory tables (the boundary
tables and the least overflow, split_problem.py) and the offload lever's two simulations
(fitting.offloaded), by their arguments, across the plans of a run. Every
value is what the computation returns for those arguments, so the answers are the same
with or without them; only the time changes. A memo keeps at most `cells` numbers
(keys and values together, as `size` counts them) and is emptied when the next one would
pass it: a bound on memory whatever the run, and a long run only loses time. Keys are
plain numbers only (`plain`; the offload lever's are the planner's own float costs): a
Fraction equals the float of the same value, and the exact sums it stands for must not
come back as the float's.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

_MISSING = object()
_PLAIN = {float, int}


def plain(values) -> bool:
    """Every value a float or an int (not a bool, a Fraction or a Decimal)."""
    return set(map(type, values)) <= _PLAIN


class Memo:
    """Values by key, at most `cells` numbers in all (`size(key, value)` counts one
    entry's); `hits` and `misses` count the lookups."""

    def __init__(self, cells: int, size: Callable[[Hashable, object], int]) -> None:
        self.cells, self.size = cells, size
        self.values: dict = {}
        self.used = 0
        self.hits = self.misses = 0

    def get(self, key: Hashable, compute: Callable[[], object]):
        """The value of `key`, computed by `compute()` when it is not kept."""
        value = self.values.get(key, _MISSING)
        if value is not _MISSING:
            self.hits += 1
            return value
        self.misses += 1
        value = compute()
        cells = self.size(key, value)
        if self.used + cells > self.cells:
            self.values.clear()
            self.used = 0
        if cells <= self.cells:
            self.values[key] = value
            self.used += cells
        return value


__all__ = ["Memo", "plain"]
