"""benchmarks/searched_bound.py's exact bound ([Note: exact bound] there) against every
order of tiny problems, enumerated: the program's optimum is the least step time of the
search model over all orders within the limits, stage by stage out of microbatch order
included."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("scipy")

from benchmarks.searched_bound import exact_bound, implied_stash_limit  # noqa: E402
from pipeschedule.compiler.generators.search import B, F, W, Problem, finish, held_peaks  # noqa: E402


def _problem(pp: int, m: int, limits, stash_limits) -> Problem:
    """Unequal stage times and message delays, so that ties are rare."""
    return Problem(tuple(range(pp)), m, tuple(limits), tuple(stash_limits),
                   forward=(1.0, 1.3, 0.9)[:pp], backward=(1.9, 2.2, 1.7)[:pp], weight=(0.6, 0.4, 0.8)[:pp],
                   send_f=(0.15, 0.05, 0.0)[:pp - 1] + (0.0,), send_b=(0.0, 0.1, 0.2)[:pp])


def _rank_orders(s: int, m: int):
    """Every order of one stage's F, B and W that keeps each microbatch's F before B before W."""
    ops = [(op, s, mb) for mb in range(m) for op in (F, B, W)]
    for perm in itertools.permutations(ops):
        where = {step: i for i, step in enumerate(perm)}
        if all(where[(F, s, mb)] < where[(B, s, mb)] < where[(W, s, mb)] for mb in range(m)):
            yield list(perm)


def _brute_force(problem: Problem) -> float:
    per_rank = []
    for s in range(problem.pp):
        kept = []
        for order in _rank_orders(s, problem.microbatches):
            inflight, held = held_peaks(problem, [order])
            if inflight[0] <= problem.limits[s] and held[0] <= problem.stash_limits[s]:
                kept.append(order)
        per_rank.append(kept)
    times = (finish(problem, list(orders)) for orders in itertools.product(*per_rank))
    return min(key[0] for key in times if key is not None)


@pytest.mark.parametrize("pp, m, limits, stash_limits", [
    (2, 2, (2, 2), (2, 2)),  # no limit binds
    (2, 2, (1, 2), (1, 2)),  # one microbatch at a time on rank 0
    (3, 2, (2, 1, 2), (2, 2, 1)),  # rule 6 binds on rank 1, stashes on rank 2
    (2, 3, (2, 2), (2, 3)),  # three microbatches: out of microbatch order orders exist
])
def test_exact_bound_is_the_least_time_of_every_order(pp, m, limits, stash_limits):
    problem = _problem(pp, m, limits, stash_limits)
    found = exact_bound(problem, time_limit=60)
    assert found["optimal"]
    assert found["bound"] == pytest.approx(_brute_force(problem), abs=1e-6)


def test_exact_bound_rises_when_a_limit_tightens():
    """A limit that binds shows in the bound (the rows are not inert)."""
    loose = exact_bound(_problem(2, 3, (2, 2), (3, 3)))["bound"]
    tight = exact_bound(_problem(2, 3, (1, 1), (1, 1)))["bound"]
    assert tight > loose + 0.5


def test_implied_stash_limit():
    # goal case's figures: a stash of 1.95 GB shrinking to 1.28 GB at B, capped_1f1b's peak 3.94 GB
    assert implied_stash_limit(3_937_281_760, 1_951_858_768, 1_279_262_720) == 2
    assert implied_stash_limit(3 * 1_951_858_768, 1_951_858_768, 1_279_262_720) == 4  # (5.86 - 1.95) // 1.28 = 3
    assert implied_stash_limit(1_951_858_768, 1_951_858_768, 1_279_262_720) == 1
