"""The simulator on stage graphs ([Note: stage graph] in pipeschedule/compiler/graph.py):
dependencies and bytes over edges ([Note: when bytes count] in simulate/engine.py)."""

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeschedule import BUFFERS, Op, compile_schedule
from pipeschedule.compiler.offload import OffloadPolicy, add_offload
from pipeschedule.simulate import simulate
from pipeschedule.simulate.cost import CostModel
from pipeschedule.simulate.engine import _Run

from strategies import examples, graph_schedules
from test_simulate import reference

DIAMOND = [(0, 1), (0, 2), (1, 3), (2, 3)]


def drawn_cost(data, schedule, times=(1, 2, 3)):
    stages = schedule.num_stages
    values = st.lists(st.sampled_from(times), min_size=stages, max_size=stages)
    return CostModel(
        tuple(data.draw(values)), tuple(data.draw(values)), tuple(data.draw(values)),
        {k: tuple(data.draw(values)) for k in BUFFERS},
        latency=data.draw(st.sampled_from([0, 0.5, 2])), bandwidth=data.draw(st.sampled_from([math.inf, 1, 4])),
    )


def edge_bytes_peaks(schedule, cost):
    """Each rank's peak of live bytes read off its program: every buffer of every edge
    counted from the instruction that makes it to its FREE, with its stage's bytes of
    its kind ([Note: when bytes count]); written from the buffers of [Note: buffers]
    rather than from the simulator's tables."""
    size = cost.buffer_bytes
    graph, placement = schedule.graph, schedule.placement
    peaks = []
    for program in schedule.programs:
        live = peak = 0
        for i in program:
            s = i.stage
            if i.op is Op.F:
                live += size["stash"][s] + (size["act_in"][s] if s == 0 else 0)
                for t in graph.consumers[s]:
                    live += size["act_out"][s] if placement[t] != placement[s] else size["act_in"][t]
            elif i.op is Op.B:
                for p in graph.producers[s]:
                    live += size["grad_in"][s] if placement[p] != placement[s] else size["grad_out"][p]
            elif i.op is Op.RECV_F:
                live += size["act_in"][s]
            elif i.op is Op.RECV_B:
                live += size["grad_out"][s]
            elif i.op is Op.FREE:
                live -= size[i.buf][s]
            peak = max(peak, live)
        assert live == 0
        peaks.append(peak)
    return peaks


@settings(max_examples=examples(80), deadline=None)
@given(graph_schedules(max_pp=6, max_m=8, offload=False), st.data())
def test_graph_schedules_match_the_reference(schedule, data):
    """Every random graph schedule finishes, at the times a direct reading of the
    semantics gives, and its bytes are those of every edge buffer."""
    cost = drawn_cost(data, schedule)
    expected = reference(schedule, cost)
    assert expected is not None  # verified schedules never deadlock
    result = simulate(schedule, cost)
    assert math.isclose(result.step_time, max(expected))
    assert list(result.peak_bytes) == edge_bytes_peaks(schedule, cost)
    for curve in result.memory:
        assert curve[-1][1] == 0
    plain, general = _Run(schedule, cost).trace(), _Run(schedule, cost, general=True).trace()
    for field in ("finish", "busy", "peak_inflight", "peak_bytes", "ends", "channels"):  # the two loops agree
        assert getattr(plain, field) == getattr(general, field), field


@settings(max_examples=examples(40), deadline=None)
@given(graph_schedules(max_pp=5, max_m=6, offload=False), st.data())
def test_graph_schedules_with_offload_finish_and_free_everything(schedule, data):
    cost = drawn_cost(data, schedule)
    cost = CostModel(cost.forward, cost.backward, cost.weight, cost.buffer_bytes, offload_bandwidth=2,
                     reload_bandwidth=3)
    result = simulate(add_offload(schedule, OffloadPolicy(fraction=1.0, lead=1)), cost)
    for curve in result.memory:
        assert curve[-1][1] == 0


@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_afab_on_the_diamond_is_one_stage_shorter_than_the_chain(m):
    """Unit costs (F = 1, B = 2), free messages: AFAB's step is 3 (m + depth - 1) for a
    graph whose longest path has `depth` stages: 4 on the chain of pp=4, 3 on the
    diamond, where stages 1 and 2 run side by side."""
    cost = lambda s: CostModel((1,) * 4, (2,) * 4, (0,) * 4, {k: (1,) * 4 for k in BUFFERS})  # noqa: E731
    chain = compile_schedule("afab", pp=4, microbatches=m)
    diamond = compile_schedule("afab", pp=4, microbatches=m, edges=DIAMOND)
    assert simulate(chain, cost(chain)).step_time == 3 * (m + 3)
    assert simulate(diamond, cost(diamond)).step_time == 3 * (m + 2)


def test_the_bytes_of_each_edge_count():
    """AFAB on the diamond, one microbatch: rank 0 holds its act_in, its stash and one
    act_out per consumer on another rank (stages 1 and 2); rank 3 one act_in per producer."""
    sizes = {"act_in": (1, 10, 100, 1000), "act_out": (Fraction(1, 2), 3, 30, 300), "stash": (7, 70, 700, 7000),
             "grad_out": (0,) * 4, "grad_in": (0,) * 4}
    cost = CostModel((1,) * 4, (2,) * 4, (0,) * 4, sizes)
    diamond = compile_schedule("afab", pp=4, microbatches=1, edges=DIAMOND)
    peaks = simulate(diamond, cost).peak_bytes
    assert peaks[0] == 1 + 7 + 2 * Fraction(1, 2)
    assert peaks[3] == 2 * 1000 + 7000
    assert peaks[1] == 10 + 70 + 3 and peaks[2] == 100 + 700 + 30
