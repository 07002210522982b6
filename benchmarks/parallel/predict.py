"""The simulator's prediction of a measured step, from costs measured in the same run.

A measured step gives, per rank, the spans of its F, B and W ([Note: measured timeline] in
pipeschedule/runtime/timeline.py). Their medians per (op, stage) over the measured steps
are the stage costs; a point-to-point link measured in the same setting (latency and
bandwidth) prices each message. `predict` simulates the engine's own compiled schedule
under those costs: what the step would take if the runtime added nothing to the order's
own waits. Measured over predicted is then the runtime's (and the cost model's) error.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from pipeschedule.compiler.ir import Op, Schedule
from pipeschedule.simulate import CostModel, SimResult, simulate

SpanRow = tuple[str, int, int, float, float]  # (op, stage, mb, start s, end s), as the rank workers write them


def stage_costs(steps: list[list[list[SpanRow]]], stages: int) -> dict[str, list[float]]:
    """{"forward", "backward", "weight"} -> per-stage median seconds over every measured
    step (`steps[k][rank]` is rank's spans in step k); a stage with no W has weight 0."""
    seconds: dict[tuple[str, int], list[float]] = defaultdict(list)
    for step in steps:
        for spans in step:
            for op, stage, _mb, start, end in spans:
                seconds[op, stage].append(end - start)
    missing = [(op, s) for op in ("F", "B") for s in range(stages) if not seconds[op, s]]
    if missing:
        raise ValueError(f"no measured span for {missing[:4]} (of {stages} stages): the steps hold no timeline")
    return {name: [statistics.median(seconds[op, s]) if seconds[op, s] else 0.0 for s in range(stages)]
            for name, op in (("forward", "F"), ("backward", "B"), ("weight", "W"))}


def cost_model(costs: dict[str, list[float]], *, boundary_bytes: float, latency_s: float,
               bandwidth: float) -> CostModel:
    """A `CostModel` of measured stage seconds; each message carries `boundary_bytes` over a
    link of `latency_s` and `bandwidth` bytes/s."""
    stages = len(costs["forward"])
    per_stage = [boundary_bytes] * stages
    return CostModel(forward=tuple(costs["forward"]), backward=tuple(costs["backward"]),
                     weight=tuple(costs["weight"]), buffer_bytes={"act_out": per_stage, "grad_in": per_stage},
                     latency=latency_s, bandwidth=bandwidth)


def predict(schedule: Schedule, cost: CostModel) -> dict:
    """The simulated step of `schedule` under `cost`: seconds, bubble fraction, per-rank busy."""
    return summary(simulate(schedule, cost))


def summary(result: SimResult) -> dict:
    """`predict`'s figures of a simulation already run."""
    return {"step_s": float(result.step_time), "bubble": float(result.bubble_fraction),
            "busy_s": [float(b) for b in result.busy], "peak_inflight": list(result.peak_inflight)}


def late_split(result: SimResult, spans_per_rank: list[list[SpanRow]]) -> dict:
    """Where a measured step differs from the simulated one (`result`), per rank: "blocks_s", the sum
    over its F, B and W of (measured duration - simulated duration), and "gaps_s", the sum
    of (measured idle before the block - simulated idle before it), each block's idle
    counted from the end of the rank's previous block (the first's from the step's start).
    Longer gaps with matching blocks are waits the simulator does not have (messages,
    the host); longer blocks are compute that ran slower than its median."""
    simulated = {(ev.rank, ev.instr.op.value, ev.instr.stage, ev.instr.mb): (ev.start, ev.end)
                 for ev in result.events if ev.instr.op in (Op.F, Op.B, Op.W)}
    blocks, gaps = [], []
    for rank, spans in enumerate(spans_per_rank):
        block = gap = previous = previous_simulated = 0.0
        for op, stage, mb, start, end in spans:
            sim_start, sim_end = simulated[rank, op, stage, mb]
            block += (end - start) - (sim_end - sim_start)
            gap += (start - previous) - (sim_start - previous_simulated)
            previous, previous_simulated = end, sim_end
        blocks.append(block)
        gaps.append(gap)
    return {"blocks_s": blocks, "gaps_s": gaps}


def measured_bubble(step_s: float, spans_per_rank: list[list[SpanRow]]) -> list[float]:
    """Per rank, the share of the step it did not compute: 1 - busy / step."""
    return [1.0 - sum(end - start for _op, _s, _mb, start, end in spans) / step_s for spans in spans_per_rank]


def span_rows(spans) -> list[SpanRow]:
    """A rank's `Timeline.spans()` as plain rows (JSON-able)."""
    return [(span.instr.op.value, span.instr.stage, span.instr.mb, span.start, span.end) for span in spans]


def has_weight_ops(schedule: Schedule) -> bool:
    return any(instr.op is Op.W for program in schedule.programs for instr in program)


__all__ = ["cost_model", "has_weight_ops", "late_split", "measured_bubble", "predict", "span_rows", "stage_costs",
           "summary"]
