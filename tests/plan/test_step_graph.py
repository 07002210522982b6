"""The step graph ([Note: step graph]) and the peaks from program order ([Note: peaks from
program order]) against the simulator they stand in for: the same step time, bitwise, the
same critical path and the same peaks, over every family, caps, placements and costs;
schedules they cannot time are refused."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeschedule import compile_schedule
from pipeschedule.compiler.ir import Instr, Op
from pipeschedule.compiler.offload import OffloadPolicy, add_offload
from pipeschedule.errors import ParameterError, ScheduleError
from pipeschedule.plan.peaks import Peaks
from pipeschedule.plan.step_graph import StepGraph
from pipeschedule.simulate import CostModel, simulate
from pipeschedule.simulate.critical_path import critical_path
from strategies import examples, schedules


def per_stage(draw, S, low=0.0):
    values = st.one_of(st.just(0.0), st.just(1.0), st.floats(low, 7.0, allow_nan=False)) if low == 0.0 \
        else st.floats(low, 7.0, allow_nan=False)
    return tuple(draw(st.lists(values, min_size=S, max_size=S)))


@st.composite
def costs(draw, schedule):
    S = schedule.num_stages
    weight = per_stage(draw, S) if schedule.split_backward else (0.0,) * S
    sizes = {k: per_stage(draw, S) for k in ("act_in", "act_out", "stash", "grad_out", "grad_in")}
    kept = per_stage(draw, S) if schedule.split_backward and draw(st.booleans()) else None
    return CostModel(per_stage(draw, S), per_stage(draw, S), weight, sizes,
                     latency=draw(st.sampled_from([0.0, 0.25, 1.0])),
                     bandwidth=draw(st.sampled_from([math.inf, 0.5, 3.0])), weight_stash=kept)


def graph_step(graph, cost):
    msgs = graph.message_times(cost.buffer_bytes["act_out"], cost.buffer_bytes["grad_in"], cost.latency,
                               cost.bandwidth)
    return graph.step(cost.forward, cost.backward, cost.weight, msgs)


@settings(max_examples=examples(300), deadline=None)
@given(st.data())
def test_step_graph_is_the_simulator(data):
    """Step time equal to the last bit and the same chain, under two costs of one graph
    (the graph holds nothing of a cost)."""
    schedule = data.draw(schedules(max_pp=6, max_m=10, max_v=3, offload=False))
    graph, peaks = StepGraph(schedule), Peaks(schedule)
    for _ in range(2):
        cost = data.draw(costs(schedule))
        result = simulate(schedule, cost)
        step, path = graph_step(graph, cost)
        assert step == result.step_time
        assert path == critical_path(schedule, result, cost)
        assert peaks.of(cost) == (result.peak_bytes, result.peak_inflight)


def test_step_graph_at_the_benchmark_size():
    """pp=16, m=64 (the planner's headline): 1F1B, capped, interleaved and ZB-H1."""
    for family, params in (("1f1b", {}), ("capped_1f1b", {"cap": 3}), ("interleaved_1f1b", {"virtual": 2}),
                           ("zb_h1", {})):
        schedule = compile_schedule(family, pp=16, microbatches=64, **params)
        S = schedule.num_stages
        forward = tuple(1.0 + 0.01 * s for s in range(S))
        sizes = {"act_in": (5.0,) * S, "act_out": (5.0,) * S, "stash": (7.5,) * S, "grad_out": (5.0,) * S,
                 "grad_in": (5.0,) * S}
        cost = CostModel(forward, tuple(2.1 * f for f in forward), (0.3,) * S if schedule.split_backward else
                         (0.0,) * S, sizes, latency=0.01, bandwidth=100.0,
                         weight_stash=(3.3,) * S if schedule.split_backward else None)
        result = simulate(schedule, cost)
        step, path = graph_step(StepGraph(schedule), cost)
        assert step == result.step_time
        assert path == critical_path(schedule, result, cost)
        assert Peaks(schedule).of(cost) == (result.peak_bytes, result.peak_inflight)


def test_host_copies_are_refused():
    schedule = add_offload(compile_schedule("1f1b", pp=2, microbatches=3), OffloadPolicy(fraction=1.0))
    with pytest.raises(ParameterError, match="without host copies; rank 0 runs .*OFFLOAD"):
        StepGraph(schedule)
    with pytest.raises(ParameterError, match="without host copies; rank 0 runs .*OFFLOAD"):
        Peaks(schedule)


def test_deadlock_and_unmatched_sends_are_refused():
    """Two ranks that each receive before they send never finish; a send nobody receives
    is a matching error, as the simulator says."""
    good = compile_schedule("1f1b", pp=2, microbatches=1)
    first = [Instr(Op.RECV_B, 0, 0, peer=1), Instr(Op.F, 0, 0), Instr(Op.SEND_F, 0, 0, peer=1)]
    second = [Instr(Op.RECV_F, 1, 0, peer=0), Instr(Op.B, 1, 0), Instr(Op.SEND_B, 1, 0, peer=0)]
    stuck = good.replace_programs([first, second])
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(stuck)
    with pytest.raises(ScheduleError, match="deadlock"):
        StepGraph(stuck)
    lonely = good.replace_programs([[Instr(Op.SEND_F, 0, 0, peer=1)], []])
    with pytest.raises(ScheduleError, match="matching"):
        StepGraph(lonely)


def _backward_ends(schedule, stash) -> tuple:
    """The saved activations alive as each B ends, its own stash left out, walked plainly
    over the instructions: the reference of `Peaks.at_backward_ends`."""
    out = []
    for program in schedule.programs:
        live, top = 0.0, 0.0
        for instr in program:
            if instr.op is Op.F:
                live += stash[instr.stage]
            elif instr.op is Op.FREE and instr.buf == "stash":
                live -= stash[instr.stage]
            elif instr.op is Op.B:
                top = max(top, live - stash[instr.stage])
        out.append(top)
    return tuple(out)


@settings(max_examples=examples(200), deadline=None)
@given(st.data())
def test_backward_ends_walk_the_program(data):
    """Where nanotron's engines hold every bf16 gradient of a stage ([Note: memory terms]):
    the reference walk, over every family without a split backward (nanotron's engines
    run none), under stash bytes alone as the planner asks."""
    schedule = data.draw(schedules(max_pp=6, max_m=10, max_v=3, offload=False))
    S = schedule.num_stages
    stash = tuple(float(x) for x in data.draw(st.lists(st.integers(0, 7), min_size=S, max_size=S)))
    zeros = (0.0,) * S
    cost = CostModel(zeros, zeros, zeros, {"act_in": zeros, "act_out": zeros, "stash": stash, "grad_out": zeros,
                                           "grad_in": zeros})
    got = Peaks(schedule).at_backward_ends(cost)
    if not schedule.split_backward:
        assert got == pytest.approx(_backward_ends(schedule, stash))
    assert all(g <= p for g, p in zip(got, Peaks(schedule).of(cost)[0]))


@pytest.mark.parametrize("pp,m", [(2, 1), (4, 8), (4, 3), (8, 16)])
def test_backward_ends_of_1f1b_and_afab_in_closed_form(pp, m):
    """1F1B: rank r's first B finds min(pp - r, m) microbatches in flight, so one fewer is
    left beside the gradients; AFAB: all m, one fewer."""
    for family, inflight in (("1f1b", [min(pp - r, m) for r in range(pp)]), ("afab", [m] * pp)):
        schedule = compile_schedule(family, pp=pp, microbatches=m)
        cost = CostModel.default(schedule)
        stash = cost.buffer_bytes["stash"][0]
        only_stash = CostModel(cost.forward, cost.backward, cost.weight,
                               {k: (v if k == "stash" else (0.0,) * len(v)) for k, v in cost.buffer_bytes.items()})
        got = Peaks(schedule).at_backward_ends(only_stash)
        assert got == tuple((k - 1) * stash for k in inflight), family
