"""What a plan's candidates share that depends on the schedule alone: the lowered
schedules of one (pp, microbatches), their step graphs and peaks, and the step times and
peaks read from them under a cost ([Note: step graph] in step_graph.py, [Note: peaks from
program order] in peaks.py). The bottom of the planner: it knows nothing of a model.
"""

from __future__ import annotations

from pipeschedule.compiler.families import generate
from pipeschedule.compiler.ir import Schedule
from pipeschedule.compiler.passes import lower
from pipeschedule.plan import step_graph
from pipeschedule.plan.memo import Memo
from pipeschedule.plan.partition import stage_inflight
from pipeschedule.plan.peaks import Peaks
from pipeschedule.plan.step_graph import StepGraph
from pipeschedule.simulate import CostModel

Key = tuple  # (family, cap, virtual): cap None, an int, or a tuple per rank


def schedule_key(family: str, cap, virtual: int) -> Key:
    """The key of a schedule: a cap given as a list is held as a tuple."""
    return family, tuple(cap) if isinstance(cap, list) else cap, virtual


class ScheduleCache:
    """What depends on the schedule alone, for one (pp, microbatches), by `schedule_key`:
    the lowered schedules, their step graphs and peaks and each stage's most microbatches
    in flight. The plans of a lever search differ in their setup only, so they share one
    (`plan(..., schedules=)`): a third of the work for the three recompute modes. The
    graphs, peaks and split searches also keep what they computed, by its arguments
    ([Note: run-wide memos] in memo.py; each memo as large as a step graph's)."""

    def __init__(self, pp: int, microbatches: int) -> None:
        self.pp, self.microbatches = pp, microbatches
        self.schedules: dict = {}
        self.graphs: dict = {}
        self.inflights: dict = {}
        self.tables: dict = {}  # per schedule: the split searches' memory tables
        # the offload lever's simulations (fitting.offloaded), by schedule, policy and costs:
        # the planner's own costs, floats; a few numbers per rank kept for each
        self.offload_memo = Memo(step_graph.MEMO_CELLS, lambda key, value: 16 * len(key[2].forward) + 3 * self.pp + 1)

    def memo(self, key: Key) -> Memo:
        """Where the split searches of a schedule keep their memory tables."""
        if key not in self.tables:
            self.tables[key] = Memo(step_graph.MEMO_CELLS, _table_cells)
        return self.tables[key]

    def schedule(self, key: Key) -> Schedule:
        if key not in self.schedules:
            family, cap, virtual = key
            self.schedules[key] = lower(generate(family, pp=self.pp, microbatches=self.microbatches,
                                                 virtual=virtual, cap=cap))
        return self.schedules[key]

    def graph(self, key: Key) -> tuple[StepGraph, Peaks]:
        if key not in self.graphs:
            schedule = self.schedule(key)
            self.graphs[key] = (StepGraph(schedule), Peaks(schedule))
        return self.graphs[key]

    def inflight(self, key: Key) -> tuple[int, ...]:
        if key not in self.inflights:
            self.inflights[key] = stage_inflight(self.schedule(key))
        return self.inflights[key]

    def step(self, key: Key, cost: CostModel) -> float:
        """simulate(schedule, cost).step_time, from the step graph."""
        graph = self.graph(key)[0]
        msgs = graph.message_times(cost.buffer_bytes["act_out"], cost.buffer_bytes["grad_in"], cost.latency,
                                   cost.bandwidth)
        return graph.step(cost.forward, cost.backward, cost.weight, msgs)[0]

    def peaks(self, key: Key, cost: CostModel) -> tuple[tuple, tuple]:
        """(peak_bytes, peak_inflight) of simulate(schedule, cost), from program order."""
        return self.graph(key)[1].of(cost)

    def at_backward_ends(self, key: Key, cost: CostModel) -> tuple:
        """Per rank, the most bytes alive as one of its B ends, that B's own stash left out
        (`Peaks.at_backward_ends`: where nanotron's engines hold the bf16 gradients)."""
        return self.graph(key)[1].at_backward_ends(cost)


def _table_cells(key: tuple, value) -> int:
    """The numbers of a memory table kept (split_problem.Evaluator.kept): its key's
    tuples and the value's lists (or the least overflow's split)."""
    cells = sum(len(part) for part in key[1:] if part is not None)
    if isinstance(value[0], list):  # the boundary tables: two tables of stages x boundaries
        return cells + sum(len(row) for table in value for row in table)
    return cells + len(value[0]) + 2


__all__ = ["Key", "ScheduleCache", "schedule_key"]
