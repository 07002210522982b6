"""The shared-chip model of SM partitions (benchmarks/parallel/shared_chip.py, [Note: a
shared chip]): at slope 0 it is the simulator's model, a positive slope only slows a step
and by no more than the factor of all ranks busy, and a schedule that cannot finish is
refused."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.parallel.predict import cost_model, predict
from benchmarks.parallel.report import schedule_of
from benchmarks.parallel.shared_chip import factor, predict_shared
from pipeschedule.compiler.ir import Op

ENGINES = ["ps_1f1b", "ps_afab", "capped_1f1b:cap=2", "zb_h1", "zbv", "dualpipev", "interleaved_1f1b:virtual=2"]
MESSAGE_S = 2e-5


def work_of(schedule) -> dict:
    """Uneven costs: every (op, stage) its own figure."""
    return {(op, s): 0.01 * (1 + 0.3 * s) * (1.0, 1.9, 0.7)[k] for k, op in enumerate("FBW")
            for s in range(schedule.num_stages)}


@pytest.mark.parametrize("engine", ENGINES)
def test_at_slope_zero_it_is_the_simulator(engine):
    schedule = schedule_of(engine, 4, 8)
    work = work_of(schedule)
    stages = range(schedule.num_stages)
    costs = {name: [work[op, s] if op != "W" or any(i.op is Op.W for p in schedule.programs for i in p) else 0.0
                    for s in stages] for name, op in (("forward", "F"), ("backward", "B"), ("weight", "W"))}
    simulated = predict(schedule, cost_model(costs, boundary_bytes=0, latency_s=MESSAGE_S, bandwidth=float("inf")))
    assert predict_shared(schedule, work, 0.0, MESSAGE_S) == pytest.approx(simulated["step_s"], rel=1e-9)


@pytest.mark.parametrize("engine", ENGINES)
def test_sharing_slows_a_step_within_the_factor_of_all_busy(engine):
    schedule = schedule_of(engine, 4, 8)
    work = work_of(schedule)
    alone = predict_shared(schedule, work, 0.0, MESSAGE_S)
    shared = predict_shared(schedule, work, 0.1, MESSAGE_S)
    assert alone < shared <= factor(4, 0.1) * alone + 1e-9


def test_a_schedule_that_cannot_finish_is_refused():
    schedule = schedule_of("ps_1f1b", 4, 8)
    first_send = next(pc for pc, i in enumerate(schedule.programs[0]) if i.op is Op.SEND_F)
    broken = [list(p) for p in schedule.programs]
    del broken[0][first_send]  # rank 1 waits for a message never sent
    broken = dataclasses.replace(schedule, programs=tuple(tuple(p) for p in broken))
    with pytest.raises(RuntimeError, match="deadlocks|stalls"):
        predict_shared(broken, work_of(schedule), 0.0, MESSAGE_S)
