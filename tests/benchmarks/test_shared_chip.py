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


def test_realised_shares_only_predicted_gains_and_prefers_the_paired_ratio():
    from benchmarks.parallel.shared_chip import realised, render

    def row(engine, measured, simulator, shared, paired=None):
        return {"engine": engine, "m": 8, "measured_s": measured, "simulator_s": simulator, "shared_s": shared,
                "flat_s": 1.0, "simulator_same_s": 1.0, "vs_reference": paired}

    rows = [row("ps_1f1b", 1.0, 1.0, 1.0), row("zb_h1", 0.95, 0.9, 0.95, paired=0.96),
            row("zbv", 1.05, 1.1, 0.995)]
    shares = realised(rows)
    assert shares["zb_h1"]["measured"] == 0.96  # the run's paired ratio, not the medians' 0.95
    assert shares["zb_h1"]["simulator_s"] == pytest.approx(0.04 / 0.1)
    assert shares["zb_h1"]["shared_s"] == pytest.approx(0.04 / 0.05)
    assert shares["zbv"]["simulator_s"] is None and shares["zbv"]["shared_s"] is None  # a loss; a gain under 1%
    line = next(line for line in render(rows, 0.1, "x").splitlines() if line.startswith("| `zb_h1`"))
    assert line.endswith("| 0.960 | 0.900 | 0.950 | 40% | 80% |")
