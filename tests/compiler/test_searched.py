"""The `searched` family ([Note: searched schedule] in
pipeschedule/compiler/generators/searched.py): verified, within its cap, never slower in
simulation than any fixed family under the same cap, and its checks reject broken orders."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from pipeschedule import compile_schedule, generate, lower
from pipeschedule.compiler.families import FAMILIES
from pipeschedule.compiler.generators.search import (
    B, F, W, finish, held_peaks, improve, list_order, split_after, within_limits,
)
from pipeschedule.compiler.generators.searched import cost_models, order_of, problem_of, searched, stage_limits
from pipeschedule.compiler.ir import Op, Schedule, make_instr
from pipeschedule.compiler.verify import verify
from pipeschedule.errors import ParameterError, ScheduleError
from pipeschedule.simulate import simulate
from pipeschedule.simulate.cost import CostModel
from strategies import examples

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ONE_CHUNK = [name for name, f in FAMILIES.items() if name != "searched" and f.chunks() == 1]


def _cost(path: str, stages: int) -> CostModel:
    schedule = compile_schedule("1f1b", pp=stages, microbatches=1, check=False)
    return CostModel.from_dict(json.loads((EXAMPLES / path).read_text()), schedule)


def _fixed_steps(pp: int, m: int, cap, split: CostModel, whole: CostModel) -> dict[str, float]:
    """Each one-chunk family's own simulated step time under `cap` (rule 6's count),
    compiled with the cost it reads; a family whose order holds more in flight is left out."""
    caps = [cap] * pp if isinstance(cap, int) else cap
    out = {}
    for name in ONE_CHUNK:
        f = FAMILIES[name]
        cost = split if f.split_backward else whole
        options = {"cap": cap} if f.takes_cap and cap is not None else {}
        try:
            schedule = compile_schedule(name, pp=pp, microbatches=m, cost=cost, **options)
        except ParameterError:
            continue
        result = simulate(schedule, cost)
        if cap is None or all(p <= c for p, c in zip(result.peak_inflight, caps)):
            out[name] = result.step_time
    return out


@st.composite
def problems(draw, max_pp=5, max_m=10):
    pp = draw(st.integers(1, max_pp))
    m = draw(st.integers(1, max_m))
    cap = None
    if draw(st.booleans()):
        caps = st.integers(1, pp + 1)
        cap = draw(st.lists(caps, min_size=pp, max_size=pp) if draw(st.booleans()) else caps)
    times = st.sampled_from((0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0))
    cost = None
    if draw(st.booleans()):
        cost = [(draw(times) + 0.25, draw(times) + 0.25, draw(times)) for _ in range(pp)]
    return pp, m, cap, cost


@settings(max_examples=examples(40), deadline=None)
@given(problems())
def test_searched_is_verified_capped_and_never_slower_than_a_fixed_family(problem):
    pp, m, cap, cost = problem
    schedule = compile_schedule("searched", pp=pp, microbatches=m, cap=cap, cost=cost)  # verified (all six rules)
    split, whole = cost_models(cost, list(range(pp)))
    result = simulate(schedule, split)
    if cap is not None:
        caps = [cap] * pp if isinstance(cap, int) else cap
        assert all(p <= c for p, c in zip(result.peak_inflight, caps))
        assert all(h <= c for h, c in zip(held_peaks(None, order_of(schedule))[1], caps))  # stashes, F to W
        assert schedule.params["cap"] == [min(c, m) for c in caps]
    fixed = _fixed_steps(pp, m, cap, split, whole)
    assert "capped_1f1b" in fixed or cap is None  # every cap has a fixed family to beat
    for name, step in fixed.items():
        assert result.step_time <= step * (1 + 1e-9), (name, result.step_time, step)


def test_goal_pp4_m8_cap2_under_the_h200_costs():
    """The issue's goal case: pp=4, m=8, cap 2 on every rank (rank 0 is what binds), the
    H200 cost files. With the cap on stashes (the default) rank 0 holds what capped_1f1b
    holds and the step is 6.8% shorter; with W pending uncounted (rule 6's count only)
    12.3% shorter, rank 0 holding two more stashes' weight-gradient part."""
    split, whole = _cost("cost_pp4_split.json", 4), _cost("cost_pp4.json", 4)
    capped = simulate(compile_schedule("capped_1f1b", pp=4, microbatches=8, cap=2, cost=whole), whole)
    ours = simulate(compile_schedule("searched", pp=4, microbatches=8, cap=2, cost=split), split)
    assert ours.step_time <= 0.94 * capped.step_time
    assert ours.peak_bytes[0] <= capped.peak_bytes[0] * (1 + 1e-9)
    free = searched(4, 8, cap=2, cost=split, uncounted_w=True, seeds=_seeds)
    free_result = simulate(lower(free, split), split)
    assert free_result.step_time <= 0.9 * capped.step_time
    assert max(free_result.peak_inflight) <= 2 and free_result.peak_bytes[0] > capped.peak_bytes[0]


def _seeds(pp, m, cap, split, whole):
    return [(name, generate(name, pp=pp, microbatches=m, cost=split if FAMILIES[name].split_backward else whole,
                            **({"cap": cap} if FAMILIES[name].takes_cap and cap is not None else {})))
            for name in ("capped_1f1b", "zb_h1")]


def test_the_cap_counts_stashes_unless_w_is_uncounted():
    for cap in (1, 2, 3):
        held = held_peaks(None, order_of(searched(4, 16, cap=cap, seeds=_seeds)))
        assert max(held[0]) <= cap and max(held[1]) <= cap  # F to B, and F to W
        inflight, stash = held_peaks(None, order_of(searched(4, 16, cap=cap, seeds=_seeds, uncounted_w=True)))
        assert max(inflight) <= cap
    assert max(stash) > 3  # W deferred past the cap: what the default forbids


def test_every_candidate_is_a_seed_or_the_search():
    schedule = compile_schedule("searched", pp=4, microbatches=8, cap=2)
    assert schedule.params["seed"] in {*ONE_CHUNK, "list", "list+search", *(f"{n}+search" for n in ONE_CHUNK)}
    assert schedule.split_backward and schedule.name == "searched"


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(pp=64, microbatches=128), "at most 4096"),
    (dict(pp=4, microbatches=8, cap=0), "cap must be an integer >= 1, got 0"),
    (dict(pp=4, microbatches=8, cap=[2, 2]), "cap list has 2 entries, but pp = 4"),
    (dict(pp=4, microbatches=8, cost=[(1, 1, 1)] * 3), "cost has 3 forward times, but the schedule has 4 stages"),
])
def test_bad_parameters_are_refused_in_one_line(kwargs, fragment):
    with pytest.raises(ParameterError) as err:
        generate("searched", **kwargs)
    assert fragment in str(err.value) and "\n" not in str(err.value)


# -- the checks reject broken orders ------------------------------------------------------


def _problem(cap=2, pp=4, m=6):
    split, _ = cost_models(None, list(range(pp)))
    limits = stage_limits(cap, list(range(pp)), pp, m)
    return problem_of(list(range(pp)), m, limits, stage_limits(None, list(range(pp)), pp, m), split)


def test_finish_rejects_a_cyclic_order():
    problem = _problem()
    order = list_order(problem, prefer_b=True, eager_w=False)
    assert finish(problem, order) is not None
    program = order[1]
    first_b = next(k for k, step in enumerate(program) if step[0] == B)
    program.insert(0, program.pop(first_b))  # B(1, 0) before F(1, 0): waits for itself
    assert finish(problem, order) is None


def test_within_limits_rejects_an_order_over_its_cap():
    problem = _problem(cap=2)
    order = split_after(order_of(generate("afab", pp=4, microbatches=6)))  # 6 in flight on every rank
    assert not within_limits(problem, order)
    assert within_limits(_problem(cap=6), order)


def test_local_search_keeps_its_order_valid_and_no_worse():
    problem = _problem(cap=2, m=8)
    start = list_order(problem, prefer_b=False, eager_w=True)
    key, order, left = improve(problem, start, 2**16)
    assert left >= 0 and within_limits(problem, order)
    assert key == finish(problem, order) and key <= finish(problem, start)
    assert sorted(map(sorted, order)) == sorted(map(sorted, start))  # the same instructions


def test_the_verifier_rejects_a_broken_searched_schedule():
    schedule = compile_schedule("searched", pp=4, microbatches=6, cap=2)
    programs = [list(p) for p in schedule.programs]
    k = next(k for k, instr in enumerate(programs[0]) if instr.op.value == "W")
    programs[0].pop(k)  # a W missing: coverage
    with pytest.raises(ScheduleError, match="coverage"):
        verify(type(schedule)(schedule.name, schedule.pp, schedule.virtual, schedule.microbatches,
                              schedule.placement, tuple(map(tuple, programs)), schedule.params))
    over = dict(schedule.params, cap=[1, 1, 1, 1])  # the same order under a lower cap
    with pytest.raises(ScheduleError, match="cap"):
        verify(type(schedule)(schedule.name, schedule.pp, schedule.virtual, schedule.microbatches,
                              schedule.placement, schedule.programs, over))


def test_list_order_never_stops_short_b_first():
    for pp in (1, 2, 3, 5):
        for cap in (1, 2, pp):
            problem = _problem(cap=cap, pp=pp, m=7)
            for eager in (False, True):
                order = list_order(problem, prefer_b=True, eager_w=eager)
                assert order is not None and within_limits(problem, order)
                assert sum(op == W for program in order for op, _, _ in program) == pp * 7
                assert sum(op == F for program in order for op, _, _ in program) == pp * 7


@settings(max_examples=examples(30), deadline=None)
@given(problems(max_pp=5, max_m=8), st.booleans())
def test_with_free_messages_the_model_time_is_the_simulated_time(problem, annealed):
    """[Note: free messages]: what `searched` compares instead of simulating, where
    messages cost nothing, equals the simulator's step time of the lowered order."""
    pp, m, cap, cost = problem
    split, whole = cost_models(cost, list(range(pp)))
    limits = stage_limits(cap, list(range(pp)), pp, m)
    model = problem_of(list(range(pp)), m, limits, limits, split)
    orders = [list_order(model, prefer_b=b, eager_w=e) for b in (True, False) for e in (True, False)]
    seeds = [s for _, s in _seeds(pp, m, cap, split, whole)]
    orders += [order_of(s) if s.split_backward else split_after(order_of(s)) for s in seeds]
    orders = [o for o in orders if o is not None and within_limits(model, o)]
    if annealed and orders:
        orders.append(improve(model, orders[0], 2**14, seed=1)[1])
    for order in orders:
        programs = tuple(tuple(make_instr((Op.F, Op.B, Op.W)[op], s, mb) for op, s, mb in p) for p in order)
        candidate = Schedule("candidate", pp, 1, m, tuple(range(pp)), programs, {})
        assert simulate(lower(candidate, split), split).step_time == pytest.approx(finish(model, order)[0], rel=1e-12)
