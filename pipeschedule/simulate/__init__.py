"""The simulator: one step of a lowered schedule under a cost model, event by event.

`simulate(schedule, cost)` runs every rank's program with the semantics of rule 4
(docs/architecture.md) and returns a `SimResult`: step time, bubble, per-rank busy time, peak
in-flight microbatches, and the live-buffer memory curve of every rank.

    cost           CostModel: per-stage times and bytes, message and host-link costs; cost files
    engine         the event-driven run, and the semantics it implements
                   ([Note: simulated semantics], [Note: when bytes count], [Note: host link],
                   [Note: simulated streaming])
    hostlink       one rank's host link: OFFLOAD / RELOAD copies and the bytes they move
    critical_path  the critical path of a simulated step, a lower bound for every cost
    render         ASCII timeline, Chrome/Perfetto trace, PNG
    offload_search how much to offload within a step-time budget (`choose_offload`)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from pipeschedule.compiler.gcpause import gc_paused
from pipeschedule.compiler.effects import COPY_OPS
from pipeschedule.compiler.ir import Schedule
from pipeschedule.compiler.passes import is_lowered, lower
from pipeschedule.errors import ParameterError
from pipeschedule.simulate.cost import CostModel, load_cost
from pipeschedule.simulate.engine import Event, EventLog, MemoryCurves, run


@dataclass(frozen=True)
class SimResult:
    """What one simulated step looks like.

    step_time: when the last rank finishes. bubble_fraction: 1 - sum(busy) /
    (pp * step_time). busy: per-rank compute time. peak_inflight: per rank, the most
    (stage, mb) whose F has run and whose B has not (0 in a forward-only schedule, which
    keeps nothing for a backward, as rule 6 reads it). peak_bytes / memory: per rank, the
    most live buffer bytes and the (time, live bytes) step curve, one point per time at
    which the bytes change ([Note: when bytes count]); it starts at (0, ...) and ends at
    0 when every buffer is freed. events: one `Event(rank, index, instr, start, end)`
    per executed instruction, rank by rank in program order (a lazy sequence; for a
    communication op, start is its batch's post time and end its message's completion,
    for a send too, though a send does not hold its rank; for OFFLOAD / RELOAD, start
    is its issue and end its copy's landing). peak_host_bytes:
    per rank, the most bytes held in host memory ([Note: host link] in engine.py; 0 without offload).
    """

    step_time: float
    bubble_fraction: float
    busy: tuple[float, ...]
    peak_inflight: tuple[int, ...]
    peak_bytes: tuple[float, ...]
    memory: tuple[tuple[tuple[float, float], ...], ...]
    events: Sequence[Event] = field(repr=False, hash=False)
    peak_host_bytes: tuple[float, ...] = ()

    def to_dict(self, *, memory: bool = False, events: bool = False) -> dict[str, Any]:
        """JSON-able summary; `memory` / `events` add the (large) curves and events."""
        out: dict[str, Any] = {
            "step_time": float(self.step_time),
            "bubble_fraction": float(self.bubble_fraction),
            "busy": [float(b) for b in self.busy],
            "peak_inflight": list(self.peak_inflight),
            "peak_bytes": [float(b) for b in self.peak_bytes],
            "peak_host_bytes": [float(b) for b in self.peak_host_bytes],
        }
        if memory:
            out["memory"] = [[[float(t), float(b)] for t, b in curve] for curve in self.memory]
        if events:
            out["events"] = [
                {"rank": e.rank, "index": e.index, "instr": str(e.instr), "start": float(e.start), "end": float(e.end)}
                for e in self.events
            ]
        return out


@gc_paused
def simulate(schedule: Schedule, cost: CostModel | None = None) -> SimResult:
    """Simulate one step of a lowered schedule ([Note: simulated semantics] in engine.py).

    A compute-only schedule (no communication and no FREE) is lowered first with
    `passes.lower` under unit costs (`lower(schedule, cost)` first places the messages
    by a cost instead). `cost` defaults to `CostModel.default(schedule)`. Raises ScheduleError(rule=
    "deadlock") when the programs cannot finish, ParameterError when the cost model
    does not have one entry per stage.
    """
    if not is_lowered(schedule):
        schedule = lower(schedule)
    if cost is None:
        cost = CostModel.default(schedule)
    if cost.num_stages != schedule.num_stages:
        raise ParameterError(
            f"the cost model has {cost.num_stages} stages but the schedule has "
            f"pp*virtual = {schedule.pp}*{schedule.virtual} = {schedule.num_stages}"
        )
    if cost.weight_stash is not None and schedule.split_backward:
        moved = next(((r, i) for r, program in enumerate(schedule.programs) for i in program
                      if i.op in COPY_OPS), None)
        if moved is not None:
            raise ParameterError(f"cost 'weight_stash' (a stash resized at its B) is not modelled together with "
                                 f"OFFLOAD (rank {moved[0]} runs {moved[1]}); leave one of them out")
    trace = run(schedule, cost)
    events = EventLog(schedule.programs, trace.ends, trace.waits, trace.channels)
    step_time = max(trace.finish, default=0)
    total = sum(trace.busy)
    sums = (step_time, total, *trace.peak_bytes, *trace.peak_host_bytes)
    if not all(math.isfinite(x) for x in sums):
        raise ParameterError(
            f"the cost model's numbers are too large for this schedule: its simulated sums overflow (step time "
            f"{step_time:g}, busy {total:g}, peak bytes {max(trace.peak_bytes, default=0):g}); scale the costs down "
            f"(e.g. times in ms, not ns)")
    bubble = 1 - total / (schedule.pp * step_time) if step_time > 0 else 0.0
    return SimResult(
        step_time=step_time,
        bubble_fraction=bubble,
        busy=tuple(trace.busy),
        # a forward-only schedule holds nothing for a backward ([Note: forward-only schedules] in verify.py)
        peak_inflight=(0,) * schedule.pp if schedule.forward_only else tuple(trace.peak_inflight),
        peak_bytes=tuple(trace.peak_bytes),
        memory=MemoryCurves(trace.memory, trace.replay, events),
        events=events,
        peak_host_bytes=tuple(trace.peak_host_bytes),
    )


__all__ = ["CostModel", "Event", "EventLog", "SimResult", "load_cost", "simulate"]
