"""The relaxation of the split search ([Note: split relaxation]): the simplex on its dual
hands back an optimal pair, the cuts' weights and the real split, over random cuts and
boxes; the weights always make a convex combination (so a valid cut); and a search that
starts from the relaxation's cuts still finds the brute-force optimum."""

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pipeschedule.plan.split_relax import Relaxation
from pipeschedule.plan.split_search import Cut, Search, boundary_tables, relax
from strategies import examples
from test_partition import brute_force, cases


def fill_min(const, unit, lo, hi, L):
    """min of const + unit . n over lo <= n <= hi, sum n = L: the cheapest stages filled first."""
    n = list(lo)
    rest = L - sum(lo)
    for s in sorted(range(len(unit)), key=lambda s: unit[s]):
        take = min(rest, hi[s] - lo[s])
        n[s] += take
        rest -= take
    return const + sum(u * x for u, x in zip(unit, n))


@st.composite
def relaxations(draw):
    S = draw(st.integers(1, 8))
    lo = [1] * S
    hi = draw(st.lists(st.integers(1, 9), min_size=S, max_size=S))
    L = draw(st.integers(S, sum(hi)))
    number = st.floats(0, 10, allow_nan=False)
    cuts = draw(st.lists(st.tuples(number, st.lists(number, min_size=S, max_size=S)), min_size=1, max_size=12))
    return lo, hi, L, cuts


@settings(max_examples=examples(300))
@given(relaxations(), st.integers(0, 3))
@example(([1], [2], 1, [(0.0, [1.0365748405182715e-11]), (1.0, [0.0])]), 0)  # n* was 1.0000153 layers of 1
def test_relaxation_is_solved(case, split_at):
    """Weak duality both ways: the combined cut's least value over the box (a lower bound
    on the relaxation) equals the largest cut at n* (an upper bound), and both the bound
    t*; cuts added after a first solve (the warm start) change nothing of that."""
    lo, hi, L, cuts = case
    relaxation = Relaxation(lo, hi, L)
    first = max(1, min(split_at, len(cuts)))
    for const, unit in cuts[:first]:
        relaxation.add(const, unit)
    relaxation.solve()
    for const, unit in cuts[first:]:
        relaxation.add(const, unit)
    bound, n, weights = relaxation.solve()
    assert all(w >= 0 for w in weights) and sum(weights) == pytest.approx(1.0)
    assert all(a <= x <= b for a, x, b in zip(lo, n, hi)) and sum(n) == pytest.approx(L)
    combined_const = sum(w * c for w, (c, _) in zip(weights, cuts))
    combined_unit = [sum(w * u[s] for w, (_, u) in zip(weights, cuts)) for s in range(len(lo))]
    lower = fill_min(combined_const, combined_unit, lo, hi, L)
    upper = max(c + sum(u * x for u, x in zip(unit, n)) for c, unit in cuts)
    scale = 1.0 + abs(upper)
    assert lower == pytest.approx(bound, abs=1e-7 * scale)
    assert upper == pytest.approx(bound, abs=1e-7 * scale)


def test_a_wrong_bound_would_be_caught():
    """Two cuts crossing at n = (2, 2): the relaxation's bound is there, not at either
    cut's own least value."""
    relaxation = Relaxation([1, 1], [3, 3], 4)
    relaxation.add(0.0, [1.0, 3.0])
    relaxation.add(0.0, [3.0, 1.0])
    bound, n, weights = relaxation.solve()
    assert bound == pytest.approx(8.0) and n == pytest.approx([2.0, 2.0]) and weights == pytest.approx([0.5, 0.5])
    assert fill_min(0.0, [1.0, 3.0], [1, 1], [3, 3], 4) == pytest.approx(6.0) and 6.0 < bound


@settings(max_examples=examples(200))
@given(cases())
def test_relaxed_search_matches_brute_force(case):
    """The search with the relaxation's cuts first (its combined cut, the chains at n*, the
    rounded splits) still finds the least simulated step time of every split that fits:
    nothing it adds cuts off the optimum."""
    problem, schedule = case
    best, ev = brute_force(problem, schedule)
    if best is None or not problem.homogeneous:
        return
    maxe, feasible = boundary_tables(ev)
    search = Search(ev, maxe, feasible, 200_000)
    m = schedule.microbatches
    for r in range(schedule.pp):
        mine = [m if ev.rank_of[s] == r else 0 for s in range(problem.num_stages)]
        search.add_cut(Cut(ev, mine, mine, mine, 0.0))
    relax(search, rounds=2 * problem.num_stages + 10)
    assert len(search.cuts) >= schedule.pp + 2  # at least a chain at n* and the combined cut
    assert search.run()
    time = search.best_time if search.best_split else math.inf
    assert time == pytest.approx(best[0], rel=1e-9)
    assert ev.fits(search.best_split)
