"""Split-backward (zero-bubble) and V-shape families: every schedule valid, the published
figures under unit costs, parameter checks, caps, and mutations the verifier rejects."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeschedule import Op, ParameterError, Schedule, ScheduleError, compile_schedule, generate, lower, verify
from pipeschedule.compiler.generators.zero_bubble import split_list_schedule, zb_h1_order
from pipeschedule.simulate import CostModel, simulate
from strategies import examples

SPLIT_FAMILIES = ("zb_h1", "zbv", "v_half", "v_min")
V_FAMILIES = ("zbv", "v_half", "v_min")


def unit_cost(schedule) -> CostModel:
    """F = B = W = 1 per stage (without a split, B is the whole backward: 2); 1 byte of
    stash per (stage, mb), no other buffer bytes; free messages."""
    S, split = schedule.num_stages, schedule.split_backward
    return CostModel((1,) * S, ((1 if split else 2),) * S, ((1 if split else 0),) * S, {"stash": (1,) * S})


def run(name, pp, m, cap=None):
    schedule = compile_schedule(name, pp=pp, microbatches=m, cap=cap)  # verified
    return schedule, simulate(schedule, unit_cost(schedule))


def stash_peak(program):
    """The most (stage, mb) between F and W (or B without a split) in a program."""
    live = peak = 0
    split = any(i.op is Op.W for i in program)
    for i in program:
        live += (i.op is Op.F) - (i.op is (Op.W if split else Op.B))
        peak = max(peak, live)
    return peak


# -- (a) every family, every parameter, every rule ------------------------------------------

@st.composite
def split_params(draw):
    name = draw(st.sampled_from(SPLIT_FAMILIES))
    pp = draw(st.integers(1, 8))
    m = draw(st.integers(1, 32))
    kind = draw(st.sampled_from(("none", "int", "list")))
    cap = None
    if kind == "int":
        cap = draw(st.integers(1, pp))
    elif kind == "list":
        cap = draw(st.lists(st.integers(1, pp), min_size=pp, max_size=pp))
    return name, pp, m, cap


@settings(max_examples=examples(150))
@given(split_params())
def test_every_split_schedule_passes_every_rule(case):
    name, pp, m, cap = case
    low = 2 if name in V_FAMILIES else 1
    if cap is not None and min(cap if isinstance(cap, list) else [cap]) < low:
        # one microbatch through both stages of a V rank is 2 stage-microbatches in flight
        with pytest.raises(ParameterError, match=r"cap .* is below 2"):
            generate(name, pp=pp, microbatches=m, cap=cap)
        return
    schedule = compile_schedule(name, pp=pp, microbatches=m, cap=cap)
    verify(schedule)
    assert schedule.split_backward
    virtual = 2 if name in V_FAMILIES else 1
    assert schedule.virtual == virtual and schedule.num_stages == virtual * pp
    if name in V_FAMILIES:
        assert schedule.placement == tuple(range(pp)) + tuple(reversed(range(pp)))
    limits = schedule.params["stash_limit"]
    for rank, program in enumerate(schedule.programs):
        for op in (Op.F, Op.B, Op.W):
            assert sum(i.op is op for i in program) == virtual * m
        assert stash_peak(program) <= limits[rank]
    if cap is not None:
        caps = cap if isinstance(cap, list) else [cap] * pp
        assert schedule.caps() == limits and all(limit <= c for limit, c in zip(limits, caps))


@pytest.mark.parametrize("name", SPLIT_FAMILIES)
def test_small_cases(name):
    for pp, m in ((1, 1), (1, 5), (2, 1), (5, 1), (5, 2), (3, 7)):
        schedule, result = run(name, pp, m)
        assert result.step_time > 0
    # pp=1: one rank, nothing to wait for: no bubble at all
    assert run(name, 1, 4)[1].bubble_fraction == 0


def test_default_costs_split_the_backward_in_halves():
    cost = CostModel.default(generate("zbv", pp=2, microbatches=2))
    assert cost.forward == cost.backward == cost.weight == (0.5,) * 4
    cost = CostModel.default(generate("zb_h1", pp=2, microbatches=2))
    assert cost.forward == cost.backward == cost.weight == (1.0,) * 2
    cost = CostModel.default(generate("1f1b", pp=2, microbatches=2))
    assert cost.backward == (2.0,) * 2 and cost.weight == (0.0,) * 2


# -- (b) the published figures, exactly as these generators produce them --------------------

# (pp, m, family): (step time, peak stash bytes per rank, peak in-flight per rank), unit
# costs per stage. 1 byte = one (stage, mb); a V-shape stage holds half a rank's layers.
FIGURES = {
    (4, 8, "1f1b"): (33, (4, 3, 2, 1), (4, 3, 2, 1)),
    (4, 8, "zb_h1"): (27, (4, 4, 4, 4), (4, 3, 2, 1)),
    (4, 8, "zbv"): (51, (8, 8, 8, 8), (8, 8, 8, 8)),
    (4, 8, "v_half"): (57, (6, 6, 6, 6), (6, 6, 6, 6)),
    (4, 8, "v_min"): (70, (4, 4, 4, 4), (4, 4, 4, 4)),
    (4, 16, "1f1b"): (57, (4, 3, 2, 1), (4, 3, 2, 1)),
    (4, 16, "zb_h1"): (51, (4, 4, 4, 4), (4, 3, 2, 1)),
    (4, 16, "zbv"): (99, (8, 8, 8, 8), (8, 8, 8, 8)),
    (4, 16, "v_half"): (105, (6, 6, 6, 6), (6, 6, 6, 6)),
    (4, 16, "v_min"): (131, (4, 4, 4, 4), (4, 4, 4, 4)),
    (8, 16, "1f1b"): (69, (8, 7, 6, 5, 4, 3, 2, 1), (8, 7, 6, 5, 4, 3, 2, 1)),
    (8, 16, "zb_h1"): (55, (8,) * 8, (8, 7, 6, 5, 4, 3, 2, 1)),
    (8, 16, "zbv"): (103, (16,) * 8, (16,) * 8),  # the handcrafted ZB-V (105 listed)
    (8, 16, "v_half"): (125, (10,) * 8, (10,) * 8),
    (8, 16, "v_min"): (139, (8,) * 8, (8,) * 8),
    (8, 32, "1f1b"): (117, (8, 7, 6, 5, 4, 3, 2, 1), (8, 7, 6, 5, 4, 3, 2, 1)),
    (8, 32, "zb_h1"): (103, (8,) * 8, (8, 7, 6, 5, 4, 3, 2, 1)),
    (8, 32, "zbv"): (199, (16,) * 8, (16,) * 8),  # the handcrafted ZB-V (201 listed)
    (8, 32, "v_half"): (221, (10,) * 8, (10,) * 8),
    (8, 32, "v_min"): (237, (8,) * 8, (8,) * 8),
}


@pytest.mark.parametrize("key", sorted(FIGURES))
def test_exact_figures_under_unit_costs(key):
    pp, m, name = key
    step, peaks, inflight = FIGURES[key]
    schedule, result = run(name, pp, m)
    work = 3 * m * schedule.virtual  # F + B + W (or F + 2B) per stage-microbatch
    assert result.step_time == step
    assert result.busy == (work,) * pp
    assert result.bubble_fraction == pytest.approx(1 - work / step)
    assert result.peak_bytes == peaks
    assert result.peak_inflight == inflight


def _bubble_time(pp, m, name):
    """Idle time per rank, in units of a rank's whole share (a V stage is half of it)."""
    step, _, _ = FIGURES[pp, m, name]
    virtual = 2 if name in V_FAMILIES else 1
    return step / virtual - 3 * m


def _activation(pp, m, name):
    """Peak stash per rank in microbatches through a rank's whole share."""
    virtual = 2 if name in V_FAMILIES else 1
    return [b / virtual for b in FIGURES[pp, m, name][1]]


@pytest.mark.parametrize("pp, m", [(4, 8), (4, 16), (8, 16), (8, 32)])
def test_published_claims(pp, m):
    one_f_one_b = _bubble_time(pp, m, "1f1b")
    assert one_f_one_b == 3 * (pp - 1)  # (pp-1)(F+B+W)
    first_rank = _activation(pp, m, "1f1b")[0]
    assert first_rank == pp
    # ZB-H1: a third of 1F1B's bubble, (pp-1)(F+B-W) = pp-1 against 3(pp-1), at the same
    # peak in-flight (F to B) per rank; its stash (F to W) is 1F1B's first-rank peak on every rank
    assert _bubble_time(pp, m, "zb_h1") == pp - 1 == one_f_one_b / 3
    assert FIGURES[pp, m, "zb_h1"][2] == FIGURES[pp, m, "1f1b"][2]
    assert _activation(pp, m, "zb_h1") == [first_rank] * pp
    assert max(FIGURES[pp, m, "zb_h1"][2]) == max(FIGURES[pp, m, "1f1b"][2]) == pp
    # ZB-V: at 1F1B's first-rank activation on every rank, bubble under 9% (m = 2pp) and
    # under 5% (m = 4pp); 1F1B's is 18-30%
    assert _activation(pp, m, "zbv") == [first_rank] * pp
    assert 1 - 6 * m / FIGURES[pp, m, "zbv"][0] < (0.05 if m == 4 * pp else 0.09)
    assert _bubble_time(pp, m, "zbv") < one_f_one_b / 2
    # V-Half: (pp+2)/2 microbatches on every rank, the first included (half of 1F1B's
    # first rank as pp grows: 3/4 at pp=4, 5/8 at pp=8), bubble below 1F1B's
    assert _activation(pp, m, "v_half") == [(pp + 2) / 2] * pp
    assert _bubble_time(pp, m, "v_half") < one_f_one_b
    # V-Min: (pp+4)//3 microbatches on every rank (a third as pp grows: 1/2 at pp=4 and 8)
    assert _activation(pp, m, "v_min") == [(pp + 4) // 3] * pp


ZB_H1_GOLDEN = {  # pp=3, m=4: rank r puts its W off by r backwards
    0: "0F0 0F1 0F2 0B0 0W0 0F3 0B1 0W1 0B2 0W2 0B3 0W3",
    1: "1F0 1F1 1B0 1F2 1B1 1W0 1F3 1B2 1W1 1B3 1W2 1W3",
    2: "2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3 2B3 2W1 2W2 2W3",
}


def test_zb_h1_golden():
    schedule = generate("zb_h1", pp=3, microbatches=4)
    for rank, text in ZB_H1_GOLDEN.items():
        assert " ".join(str(i) for i in schedule.programs[rank]) == text


@pytest.mark.parametrize("pp", [2, 3, 4, 5, 6, 7, 8, 16])
def test_zb_h1_closed_form(pp):
    """The paper's handcrafted ZB-H1 under unit costs: every rank idles pp-1 units (1F1B:
    3(pp-1)) for m >= pp, pp-1 + pp-m for m < pp; peak stash min(pp, m) on every rank,
    peak in flight (F to B) 1F1B's min(pp-r, m)."""
    for m in (1, pp - 1, pp, 2 * pp, 4 * pp):
        if m < 1:
            continue
        schedule, result = run("zb_h1", pp, m)
        idle = pp - 1 + max(0, pp - m)
        assert result.step_time == 3 * m + idle
        assert result.busy == (3 * m,) * pp
        assert result.peak_bytes == (min(pp, m),) * pp
        assert result.peak_inflight == tuple(min(pp - r, m) for r in range(pp))
        if m >= pp:
            _, base = run("1f1b", pp, m)
            assert result.bubble_fraction == pytest.approx((pp - 1) / (3 * m + pp - 1))
            assert base.bubble_fraction == pytest.approx(3 * (pp - 1) / (3 * m + 3 * (pp - 1)))
            assert base.peak_inflight == result.peak_inflight and max(base.peak_bytes) == pp


def test_zb_h1_cap_at_or_above_its_peak_changes_nothing():
    plain = generate("zb_h1", pp=4, microbatches=8)
    for cap in (4, [4, 5, 4, 8], 9):
        assert generate("zb_h1", pp=4, microbatches=8, cap=cap).programs == plain.programs
    assert generate("zb_h1", pp=4, microbatches=2, cap=2).programs == generate("zb_h1", pp=4, microbatches=2).programs


@pytest.mark.parametrize("cap", [[4, 3, 2, 1], [4, 4, 3, 2], [4, 4, 3, 4], [3, 3, 2, 1], 2])
def test_zb_h1_under_a_cap_is_no_slower_than_the_list_schedule(cap):
    """Between 1F1B's in-flight counts and pp the handcrafted order puts its W off less;
    it is kept only where it beats the list schedule under the same limits; below 1F1B's
    counts the list schedule is the only one."""
    pp, m = 4, 12
    schedule, result = run("zb_h1", pp, m, cap=cap)
    limits = schedule.params["stash_limit"]
    listed = Schedule("zb_h1", pp, 1, m, tuple(range(pp)),
                      tuple(map(tuple, split_list_schedule(pp, m, list(range(pp)), limits))),
                      {"stash_limit": limits, "cap": limits})
    listed = lower(listed)
    verify(listed)
    listed_result = simulate(listed, unit_cost(listed))
    assert result.step_time <= listed_result.step_time
    assert all(p <= c for p, c in zip(result.peak_bytes, limits))
    if cap == [4, 3, 2, 1]:  # 1F1B's own counts: 1F1B's order, each W right after its B
        compute = [[i for i in p if i.op in (Op.F, Op.B, Op.W)] for p in schedule.programs]
        assert compute == [zb_h1_order(r, m, pp - r, 0) for r in range(pp)]
        assert result.step_time == 3 * m + 2 * (pp - 1)  # still below 1F1B's 3(pp-1)


def test_v_shape_memory_fractions_at_pp16():
    """Where pp is large enough for the paper's halves and thirds to show."""
    for name, microbatches in (("v_half", 9), ("v_min", 6), ("zbv", 16)):
        schedule, result = run(name, 16, 32)
        assert result.peak_bytes == (2 * microbatches,) * 16  # 1F1B's first rank: 16 microbatches
    _, result = run("1f1b", 16, 32)
    assert result.peak_bytes[0] == 16


def test_capped_1f1b_at_v_half_memory_is_slower():
    """A plain cap at V-Half's activation pays the full round trip; V-Half does not."""
    for pp, m in ((4, 16), (8, 32)):
        cap = (pp + 2) // 2
        _, capped = run("capped_1f1b", pp, m, cap=cap)
        assert max(capped.peak_bytes) == cap
        v_half_time = FIGURES[pp, m, "v_half"][0] / 2
        assert v_half_time < capped.step_time


# -- (c) bad parameters ----------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(name="zbv", pp=4, microbatches=8, virtual=3), "virtual must be 2 or left out, got virtual=3"),
        (dict(name="v_half", pp=4, microbatches=8, virtual=1), "virtual must be 2 or left out, got virtual=1"),
        (dict(name="v_min", pp=4, microbatches=8, virtual=0), "virtual must be an integer >= 1, got 0"),
        (dict(name="zb_h1", pp=4, microbatches=8, virtual=2), "zb_h1 takes no virtual stages (got virtual=2)"),
        (dict(name="zbv", pp=0, microbatches=8), "pp must be an integer >= 1, got 0"),
        (dict(name="zb_h1", pp=4, microbatches=-1), "microbatches must be an integer >= 1, got -1"),
        (dict(name="zb_h1", pp=4, microbatches=8, cap=0), "cap must be an integer >= 1, got 0"),
        (dict(name="v_half", pp=4, microbatches=8, cap=[2, 2]), "cap list has 2 entries, but pp = 4"),
        (dict(name="zbv", pp=2, microbatches=8, cap=[2, 0]), "cap[1] must be an integer >= 1, got 0"),
        (dict(name="zbv", pp=4, microbatches=8, cap=1), "cap 1 is below 2"),
        (dict(name="v_min", pp=2, microbatches=8, cap=[3, 1]), "cap [3, 1] is below 2"),
    ],
)
def test_bad_parameters_name_the_value(kwargs, fragment):
    name = kwargs.pop("name")
    with pytest.raises(ParameterError) as info:
        generate(name, **kwargs)
    assert fragment in str(info.value)


def test_virtual_two_or_omitted_is_the_same_schedule():
    assert generate("zbv", pp=3, microbatches=5, virtual=2) == generate("zbv", pp=3, microbatches=5)


# -- (d) caps and mutations ------------------------------------------------------------

def _rule(schedule):
    with pytest.raises(ScheduleError) as info:
        verify(schedule)
    return info.value


def _with(schedule, rank, program, params=None):
    programs = list(schedule.programs)
    programs[rank] = tuple(program)
    return Schedule(schedule.name, schedule.pp, schedule.virtual, schedule.microbatches, schedule.placement,
                    tuple(programs), schedule.params if params is None else params)


@pytest.mark.parametrize("name, cap",
                         [("zb_h1", 2), ("zb_h1", [3, 2, 2, 1]), ("zbv", 3), ("v_half", [4, 3, 2, 2]), ("v_min", 2)])
def test_capped_variant_keeps_its_cap(name, cap):
    schedule, result = run(name, 4, 12, cap=cap)
    caps = cap if isinstance(cap, list) else [cap] * 4
    assert schedule.caps() == [min(c, limit) for c, limit in zip(caps, schedule.params["stash_limit"])]
    assert all(p <= c for p, c in zip(result.peak_inflight, caps))
    assert all(p <= c for p, c in zip(result.peak_bytes, caps))  # the stash too, F to W
    # the same programs with a lower cap in params break rule 6
    tighter = [max(p - 1, 1) for p in result.peak_inflight]
    error = _rule(_with(schedule, 0, schedule.programs[0], dict(schedule.params, cap=tighter)))
    assert error.rule == "cap"


def test_v_half_cap_trades_memory_for_time():
    _, uncapped = run("v_half", 8, 32)
    _, capped = run("v_half", 8, 32, cap=6)
    assert max(capped.peak_bytes) == 6 < max(uncapped.peak_bytes) == 10
    assert capped.step_time > uncapped.step_time


def test_verifier_rejects_w_before_its_b():
    schedule = compile_schedule("zb_h1", pp=2, microbatches=3)
    program = list(schedule.programs[1])
    w = next(k for k, i in enumerate(program) if i.op is Op.W)
    b = next(k for k, i in enumerate(program) if i.op is Op.B and i.mb == program[w].mb)
    program.insert(b, program.pop(w))
    error = _rule(_with(schedule, 1, program))
    assert error.rule == "coverage" and "before its B" in str(error)


def test_verifier_rejects_a_dropped_w():
    schedule = compile_schedule("zbv", pp=2, microbatches=3)
    program = [i for i in schedule.programs[0] if not (i.op is Op.W and i.stage == 3 and i.mb == 1)]
    error = _rule(_with(schedule, 0, program))
    assert error.rule == "coverage" and "no W for (stage 3, mb 1)" in str(error)


def test_verifier_rejects_stash_freed_before_w():
    schedule = compile_schedule("v_min", pp=2, microbatches=3)
    program = list(schedule.programs[1])
    free = next(k for k, i in enumerate(program) if i.op is Op.FREE and i.buf == "stash")
    target = program[free]
    w = next(k for k, i in enumerate(program) if i.op is Op.W and (i.stage, i.mb) == (target.stage, target.mb))
    b = next(k for k, i in enumerate(program) if i.op is Op.B and (i.stage, i.mb) == (target.stage, target.mb))
    assert b < w < free
    program.insert(b + 1, program.pop(free))  # free the stash right after B, before W uses it
    error = _rule(_with(schedule, 1, program))
    assert error.rule == "liveness" and "stash" in str(error)
