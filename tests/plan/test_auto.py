"""pp_engine auto's choice ([Note: auto choice] in pipeschedule/plan/auto.py)."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeschedule.compiler.families import generate
from pipeschedule.compiler.passes import lower
from pipeschedule.errors import ParameterError
from pipeschedule.plan.auto import Measured, choose, choose_cap, inflight
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


# -- caps against offload ([Note: auto offload]) -------------------------------------------

def _measured(link: float, budget_gib: float = 9.8, pp: int = 4):
    """The H200 benchmark model's figures (benchmarks/results/auto_engine.md), with F and B
    times of that order and a host link of `link` bytes/s."""
    static = (5.27 * GiB, 3.40 * GiB, 3.40 * GiB, 4.06 * GiB)[:pp]
    stash = (2.05 * GiB, 1.64 * GiB, 1.64 * GiB, 1.80 * GiB)[:pp]
    return Measured(static, stash, (budget_gib * GiB,) * pp, (0.03,) * pp, (0.06,) * pp, (link,) * pp)


def test_a_fast_link_streams_the_first_stage_instead_of_capping_it():
    choice = choose(4, 8, _measured(450e9))  # GH200's link
    assert choice.engine == "ps_1f1b:offload=0,stream=64" and choice.offload == (0,)
    assert all(p <= 9.8 * GiB for p in choice.peaks)
    assert "simulated step time of capped_1f1b:cap=2" in choice.why


def test_a_slow_link_keeps_the_cap():
    choice = choose(4, 8, _measured(1e8))  # 0.1 GB/s: every copy outlasts the step
    assert choice.engine == "capped_1f1b:cap=2" and choice.offload == ()
    assert choice.step_time is not None


def test_without_times_or_when_1f1b_fits_nothing_is_simulated():
    m = _measured(450e9)
    assert choose(4, 8, Measured(m.static, m.stash, m.budget)).engine == "capped_1f1b:cap=2"
    roomy = choose(4, 8, Measured(m.static, m.stash, (20 * GiB,) * 4, m.forward_s, m.backward_s, m.host_bandwidth))
    assert roomy.engine == "ps_1f1b" and roomy.step_time is None


def test_offload_counts_one_stash_so_it_never_fits_where_cap_1_does_not():
    m = _measured(450e9, budget_gib=7.0)  # rank 0: 5.27 + one 2.05 stash > 7
    with pytest.raises(ParameterError, match="rank 0 needs 7.32 GiB"):
        choose(4, 8, m)
    choice = choose(4, 8, _measured(450e9, budget_gib=7.4))  # cap 1 fits; offload too, and is faster
    assert choice.engine == "ps_1f1b:offload=0/1,stream=64"
    assert choice.peaks[0] == pytest.approx((5.27 + 2.05) * GiB) and all(p <= 7.4 * GiB for p in choice.peaks)


def test_copies_slower_than_a_forward_keep_the_cap():
    """The H200 run: four ranks on one GPU and PCIe link, 2 GiB stashes at ~31 GB/s (66 ms)
    against 54 ms forwards; offload ran slower than cap 2 there (auto_engine.md)."""
    m = _measured(31e9)
    m = Measured(m.static, m.stash, m.budget, (0.054,) * 4, (0.026,) * 4, m.host_bandwidth)
    choice = choose(4, 8, m)
    assert choice.engine == "capped_1f1b:cap=2" and "would not hide behind their forwards" in choice.why


def test_bad_times_are_named():
    m = _measured(450e9)
    with pytest.raises(ParameterError, match=r"forward_s figures must be one finite number >= 0 per rank"):
        choose(4, 8, Measured(m.static, m.stash, m.budget, (0.03,) * 3, m.backward_s, m.host_bandwidth))
    with pytest.raises(ParameterError, match=r"host_bandwidth must be > 0"):
        choose(4, 8, Measured(m.static, m.stash, m.budget, m.forward_s, m.backward_s, (0.0,) * 4))


@given(pp=st.integers(2, 6), m=st.integers(1, 12), budget=st.integers(3, 16),
       link=st.sampled_from([1e8, 1e10, 5e10, 4.5e11]), static=st.lists(st.integers(1, 6), min_size=6, max_size=6))
def test_the_choice_fits_and_is_the_faster_of_what_fits(pp, m, budget, link, static):
    measured = Measured(tuple(s * GiB for s in static[:pp]), (GiB,) * pp, (budget * GiB,) * pp, (1.0,) * pp,
                        (2.0,) * pp, (link,) * pp)
    try:
        choice = choose(pp, m, measured)
    except ParameterError:
        assert any(s + 1 > budget for s in static[:pp])  # cap 1 does not fit somewhere
        return
    assert all(p <= budget * GiB for p in choice.peaks)
    if choice.offload:
        assert all(choice.peaks[r] >= measured.static[r] + measured.stash[r] for r in choice.offload)
    if choice.step_time is not None and "x the simulated step time of" in choice.why:
        assert float(choice.why.rsplit("; ", 1)[1].split("x", 1)[0]) <= 1.0
