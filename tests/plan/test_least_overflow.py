"""`least_overflow`'s scan of stage ends stops early ([`_least_end`]); here it is held to
the full scan it replaced (put in `_least_end`'s place below), split for split and byte for
byte, on problems where the layers differ (the dynamic-programming path)."""

from __future__ import annotations

import math
import random

import pytest

from pipeschedule.compiler.families import generate
from pipeschedule.compiler.passes import lower
from pipeschedule.plan import split_problem
from pipeschedule.plan.split_problem import Evaluator, least_overflow
from split_cases import problem


def full_scan(row, starts, floor, n: int, over):
    """The scan before the early stop, in `_least_end`'s place: every start i < n, the first
    least value kept."""
    values = [max(row[j], over(j)) for j in starts[:n]]
    i = min(range(n), key=values.__getitem__, default=None)
    return (math.inf, None) if i is None or values[i] == math.inf else (values[i], i)


@pytest.mark.parametrize("seed", range(60))
def test_the_early_stop_answers_as_the_full_scan(seed, monkeypatch):
    rng = random.Random(seed)
    family, cap = rng.choice([("1f1b", None), ("capped_1f1b", 2), ("afab", None), ("zb_h1", None)])
    pp = rng.randint(1, 6)
    L = rng.randint(pp, pp + 40)
    budget = rng.choice([0.0, 1.0 * L / pp, 3.0 * L / pp + 4.0, 50.0])
    prob = problem(rng, L, pp, pp, alike=False, budget=budget)
    if rng.random() < 0.3:  # ties: layers of a few distinct sizes only
        sizes = [rng.choice([1.0, 2.0]) for _ in range(L)]
        prob = type(prob)(**{**prob.__dict__, "layer_static": tuple(sizes), "layer_stash": tuple(sizes)})
    schedule = lower(generate(family, pp=pp, microbatches=rng.randint(1, 8), cap=cap))
    ev = Evaluator(prob, schedule)
    assert not ev.homogeneous
    early = least_overflow(ev)
    monkeypatch.setattr(split_problem, "_least_end", full_scan)
    assert early == least_overflow(ev)
