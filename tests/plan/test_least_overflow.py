"""`least_overflow`'s scan of stage ends stops early ([`_least_end`]); here it is held to
the full scan it replaced (kept below as the reference), split for split and byte for
byte, on problems where the layers differ (the dynamic-programming path)."""

from __future__ import annotations

import math
import random

import pytest

from pipeschedule.compiler.families import generate
from pipeschedule.compiler.passes import lower
from pipeschedule.plan.split_problem import Evaluator, least_overflow, worst_rank
from split_cases import problem


def full_scan(ev: Evaluator):
    """The scan before the early stop: every start j for every stage end e."""
    L, S, p = ev.p.num_layers, ev.p.num_stages, ev.p
    best = [[math.inf] * (L + 1) for _ in range(S + 1)]
    back = [[0] * (L + 1) for _ in range(S + 1)]
    best[0][0] = -math.inf
    static, stash = ev.prefix["layer_static"], ev.prefix["layer_stash"]
    for s in range(S):
        cap, row, k = ev.cap[ev.rank_of[s]], best[s], ev.inflight[s]
        extra_static, extra_stash = p.stage_static[s], p.stage_stash[s]
        starts = [j for j in range(s, L + 1) if row[j] != math.inf]
        for e in range(s + 1, L - (S - s - 1) + 1):
            values = [max(row[j], (static[e] - static[j]) + extra_static + k * ((stash[e] - stash[j]) + extra_stash)
                          - cap) for j in starts if j < e]
            if values:
                i = min(range(len(values)), key=values.__getitem__)
                if values[i] < best[s + 1][e]:
                    best[s + 1][e], back[s + 1][e] = values[i], starts[i]
    split, e = [], L
    for s in range(S, 0, -1):
        j = back[s][e]
        split.append(e - j)
        e = j
    return worst_rank(ev, tuple(reversed(split)))


@pytest.mark.parametrize("seed", range(60))
def test_the_early_stop_answers_as_the_full_scan(seed):
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
    assert least_overflow(ev) == full_scan(ev)
