"""Issue 42's families (dualpipev, zb_h2, interleaved_zb, looped_bfs): closed-form step
times and memory under unit costs (the simulator's defaults: a rank's share of layers F =
1, B = 2, split in B = W = 1, each of its v stages 1/v of that), their caps, and broken
variants that the verifier rejects. Every rule over (pp, m, virtual, caps) of every family
is tests/compiler/test_verify.py's and test_verify_walk.py's Hypothesis properties
(tests/strategies.py draws from every family)."""

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeschedule import Op, Schedule, ScheduleError, compile_schedule, lower, verify
from pipeschedule.compiler.families import generate
from pipeschedule.compiler.generators.dualpipe import handcrafted_dualpipev
from pipeschedule.compiler.generators.phases import stash_peaks
from pipeschedule.compiler.generators.v_shape import handcrafted_zbv, v_placement
from pipeschedule.errors import ParameterError
from pipeschedule.simulate import simulate
from strategies import examples

PPS = range(2, 9)


def figures(name, pp, m, **kw):
    schedule = compile_schedule(name, pp=pp, microbatches=m, **kw)
    result = simulate(schedule)
    return schedule, result, stash_peaks(generate(name, pp=pp, microbatches=m, **kw).programs)


@pytest.mark.parametrize("pp", PPS)
def test_dualpipev_closed_form(pp):
    """[Note: DualPipeV bubble]: for m >= 2pp, 3m + (pp-1)/2 a step (the bubble one stage's F,
    (pp-1)/2, per rank), 2pp+1 stage-microbatches held on every rank, and the handcrafted
    order is the one chosen (PyTorch's own, tests/benchmarks/test_pytorch_orders.py)."""
    for m in (2 * pp, 2 * pp + 1, 3 * pp):
        schedule, result, stash = figures("dualpipev", pp, m)
        assert result.step_time == 3 * m + Fraction(pp - 1, 2)
        assert result.busy == (3 * m,) * pp
        assert result.peak_inflight == (2 * pp + 1,) * pp and stash == [2 * pp + 1] * pp
        order = [[i for i in p if i.op in (Op.F, Op.B, Op.W)] for p in schedule.programs]
        assert order == [list(p) for p in handcrafted_dualpipev(pp, m)]


@pytest.mark.parametrize("pp", PPS)
def test_zb_h2_closed_form(pp):
    """[Note: ZB-H2 bubble]: for m >= pp, the bound 3m + pp - 1; at most 2pp-1 stashed and
    2(pp-r)-1 in flight on rank r; never slower than ZB-H1."""
    for m in (pp, 2 * pp, 2 * pp + 3):
        _, result, stash = figures("zb_h2", pp, m)
        assert result.step_time == 3 * m + pp - 1
        assert max(stash) <= 2 * pp - 1
        assert all(p <= 2 * (pp - r) - 1 for r, p in enumerate(result.peak_inflight))
        assert result.step_time <= simulate(compile_schedule("zb_h1", pp=pp, microbatches=m)).step_time


def test_zb_h2_beats_zb_h1_where_w_is_cheap():
    """Measured-like costs (W a third of B, the last stage heavier): the larger warmup pays."""
    cost = [(1.0, 1.5, 0.5)] * 3 + [(1.5, 2.0, 0.6)]
    from pipeschedule.simulate import CostModel

    model = CostModel(*zip(*cost), {})
    h2 = simulate(compile_schedule("zb_h2", pp=4, microbatches=8, cost=cost), model)
    h1 = simulate(compile_schedule("zb_h1", pp=4, microbatches=8, cost=cost), model)
    assert h2.step_time < h1.step_time and max(h2.peak_inflight) > max(h1.peak_inflight)


@pytest.mark.parametrize("pp", PPS)
def test_interleaved_zb_closed_form(pp):
    """v=2, m a multiple of pp from 2pp: 3m + (pp-1)/2, 2pp - r in flight on rank r."""
    for m in (2 * pp, 3 * pp):
        _, result, _ = figures("interleaved_zb", pp, m, virtual=2)
        assert result.step_time == 3 * m + Fraction(pp - 1, 2)
        assert result.peak_inflight == tuple(2 * pp - r for r in range(pp))


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("virtual", [1, 2, 3])
def test_looped_bfs_closed_form(pp, virtual):
    """AFAB over v chunks: for m >= pp, 3m + 3(pp-1)/v (a stage of 1/v waits on each of the
    pp-1 ranks before it in F, and after it in B), every rank holding all v*m."""
    for m in (pp, 2 * pp + 1):
        _, result, _ = figures("looped_bfs", pp, m, virtual=virtual)
        assert result.step_time == pytest.approx(3 * m + 3 * (pp - 1) / virtual, rel=1e-12)
        assert result.peak_inflight == (virtual * m,) * pp


def test_looped_bfs_at_one_chunk_is_afab():
    assert generate("looped_bfs", pp=3, microbatches=5, virtual=1).programs == \
        generate("afab", pp=3, microbatches=5).programs


CAPPED = st.sampled_from(["dualpipev", "zb_h2", "interleaved_zb"])


@settings(max_examples=examples(60), deadline=None)
@given(CAPPED, st.integers(1, 6), st.integers(1, 14), st.integers(1, 3), st.data())
def test_caps_hold_for_every_m(name, pp, m, virtual, data):
    """Every cap from the least a rank takes (one stage-microbatch per local stage) up."""
    kw = {"virtual": virtual} if name == "interleaved_zb" else {}
    low = virtual if name == "interleaved_zb" else (2 if name == "dualpipev" else 1)
    cap = data.draw(st.integers(low, low + 2 * pp))
    schedule = compile_schedule(name, pp=pp, microbatches=m, cap=cap, **kw)  # verified, rule 6 included
    assert max(simulate(schedule).peak_inflight) <= cap
    assert max(stash_peaks(generate(name, pp=pp, microbatches=m, cap=cap, **kw).programs)) <= cap


def test_a_cap_below_a_ranks_stages_or_a_cap_on_looped_bfs_is_refused_in_one_line():
    with pytest.raises(ParameterError, match="dualpipev: cap 1 is below 2"):
        generate("dualpipev", pp=4, microbatches=8, cap=1)
    with pytest.raises(ParameterError, match="interleaved_zb: cap 2 is below 3"):
        generate("interleaved_zb", pp=4, microbatches=8, virtual=3, cap=2)
    with pytest.raises(ParameterError, match="looped_bfs takes no cap"):
        generate("looped_bfs", pp=4, microbatches=8, virtual=2, cap=4)
    with pytest.raises(ParameterError, match="dualpipev places exactly 2 stages on each rank"):
        generate("dualpipev", pp=4, microbatches=8, virtual=3)


def _edited(schedule: Schedule, rank: int, program) -> Schedule:
    return schedule.replace_programs([program if r == rank else p for r, p in enumerate(schedule.programs)])


@pytest.mark.parametrize("name, kw", [("dualpipev", {}), ("zb_h2", {}), ("interleaved_zb", {"virtual": 2}),
                                      ("looped_bfs", {"virtual": 2})])
def test_broken_variants_are_rejected(name, kw):
    schedule = compile_schedule(name, pp=3, microbatches=6, **kw)
    program = list(schedule.programs[0])
    # the first B moved before its own F: coverage (F before B)
    first_b = next(k for k, i in enumerate(program) if i.op is Op.B)
    forward = next(k for k, i in enumerate(program) if i.op is Op.F and (i.stage, i.mb) ==
                   (program[first_b].stage, program[first_b].mb))
    moved = program[:forward] + [program[first_b]] + [i for k, i in enumerate(program[forward:], forward)
                                                        if k != first_b]
    with pytest.raises(ScheduleError):
        verify(_edited(schedule, 0, moved))
    # a FREE dropped: liveness
    free = next(k for k, i in enumerate(program) if i.op is Op.FREE)
    with pytest.raises(ScheduleError) as info:
        verify(_edited(schedule, 0, program[:free] + program[free + 1:]))
    assert info.value.rule == "liveness"
    # a cap below what the order holds: rule 6
    peak = max(simulate(schedule).peak_inflight)
    capped = Schedule(schedule.name, schedule.pp, schedule.virtual, schedule.microbatches, schedule.placement,
                      schedule.programs, {**schedule.params, "cap": [peak - 1] * schedule.pp})
    with pytest.raises(ScheduleError) as info:
        verify(capped)
    assert info.value.rule == "cap"
    verify(schedule)


def test_faster_passes_over_a_blocked_order_and_keeps_the_first_on_a_tie():
    from pipeschedule.compiler.generators.phases import faster
    from pipeschedule.compiler.ir import make_instr

    def order(*ranks):
        return [[make_instr(op, s, mb) for op, s, mb in rank] for rank in ranks]

    F, B = Op.F, Op.B
    good = order([(F, 0, 0), (B, 0, 0)], [(F, 1, 0), (B, 1, 0)])
    twin = order([(F, 0, 0), (B, 0, 0)], [(F, 1, 0), (B, 1, 0)])
    cyclic = order([(B, 0, 0), (F, 0, 0)], [(F, 1, 0), (B, 1, 0)])  # B before its own F: never runs
    assert faster(2, [cyclic, good, twin]) is good
    with pytest.raises(AssertionError, match="every candidate order blocks"):
        faster(2, [cyclic])


def test_padded_phases_keep_every_order_valid_below_the_minimum():
    """[Note: padded phases]: DualPipeV written for 2pp and ZB-V for 2pp-1, cut to every m
    below, lower and verify."""
    for pp in range(1, 7):
        for m in range(1, 2 * pp):
            for name, programs in (("dualpipev", handcrafted_dualpipev(pp, m)), ("zbv", handcrafted_zbv(pp, m))):
                assert sum(len(p) for p in programs) == 3 * 2 * pp * m
                order = Schedule(name, pp, 2, m, tuple(v_placement(pp)), tuple(map(tuple, programs)), {})
                verify(lower(order))
