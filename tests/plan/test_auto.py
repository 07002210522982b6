"""pp_engine auto's choice ([Note: auto choice] in pipeschedule/plan/auto.py)."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeschedule.compiler.families import generate
from pipeschedule.compiler.passes import lower
from pipeschedule.errors import ParameterError
from pipeschedule.plan.auto import choose_cap, inflight
from pipeschedule.plan.memory import GiB
from pipeschedule.simulate import simulate


@given(pp=st.integers(2, 8), m=st.integers(1, 16), cap=st.integers(1, 8))
def test_inflight_closed_form_is_the_simulated_peak(pp, m, cap):
    cap = min(cap, pp)
    schedule = lower(generate("capped_1f1b", pp=pp, microbatches=m, cap=cap))
    peak = simulate(schedule).peak_inflight
    assert list(peak) == [inflight(pp, m, cap, r) for r in range(pp)]


def test_choices():
    g = GiB
    assert choose_cap(4, 16, [10 * g] * 4, [1 * g] * 4, [20 * g] * 4).engine == "ps_1f1b"
    # rank 0 holds 4 under 1F1B: 10 + 4 > 13, cap 3 fits
    choice = choose_cap(4, 16, [10 * g] * 4, [1 * g] * 4, [13 * g] * 4)
    assert choice.engine == "capped_1f1b:cap=3" and choice.peaks == (13 * g, 13 * g, 12 * g, 11 * g)
    # rank 0 can hold 1, the others more: non-increasing caps make it uniform cap 1
    assert choose_cap(4, 16, [12 * g, 10 * g, 10 * g, 10 * g], [1 * g] * 4, [13 * g] * 4).engine == "capped_1f1b:cap=1"
    # rank 1 is the tight one: per-rank caps
    choice = choose_cap(4, 16, [9 * g, 11 * g, 9 * g, 9 * g], [1 * g] * 4, [13 * g] * 4)
    assert choice.engine == "capped_1f1b:cap=4/2/2/1"
    with pytest.raises(ParameterError, match="rank 2 needs 14.00 GiB.*budget 13.00 GiB"):
        choose_cap(4, 16, [1 * g, 1 * g, 13 * g, 1 * g], [1 * g] * 4, [13 * g] * 4)
    assert choose_cap(2, 4, [0.0, 0.0], [1.0, 1.0], [math.inf, math.inf]).engine == "ps_1f1b"  # CPU: unbounded
    with pytest.raises(ParameterError, match="bytes >= 0"):
        choose_cap(2, 4, [math.nan, 0.0], [1.0, 1.0], [1.0, 1.0])
    with pytest.raises(ParameterError, match=r"auto's stash figure of rank 1 is inf; accepted: bytes >= 0"):
        choose_cap(2, 4, [0.0, 0.0], [1.0, math.inf], [1.0, 1.0])
    with pytest.raises(ParameterError, match="one static, stash and budget figure per rank"):
        choose_cap(4, 16, [1.0] * 3, [1.0] * 4, [1.0] * 4)


@given(pp=st.integers(2, 8), m=st.integers(1, 32), static=st.lists(st.integers(0, 20), min_size=8, max_size=8),
       budget=st.integers(1, 40))
def test_the_choice_fits_and_no_larger_cap_does(pp, m, static, budget):
    static, stash, limit = [s * GiB for s in static[:pp]], [GiB] * pp, [budget * GiB] * pp
    try:
        choice = choose_cap(pp, m, static, stash, limit)
    except ParameterError:
        assert any(s + GiB > budget * GiB for s in static)
        return
    assert all(p <= b for p, b in zip(choice.peaks, limit))
    caps = choice.cap if isinstance(choice.cap, tuple) else [choice.cap or pp] * pp
    assert all(a >= b for a, b in zip(caps, caps[1:])) or choice.cap is None or isinstance(choice.cap, int)
    for r in range(pp):  # one more microbatch on the first rank whose cap binds would overflow somewhere
        if inflight(pp, m, caps[r], r) < min(pp - r, m) and (r == 0 or caps[r] < caps[r - 1]):
            assert static[r] + (inflight(pp, m, caps[r], r) + 1) * GiB > budget * GiB
