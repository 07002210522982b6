"""V-shape placements with split backward: ZB-V, V-Half and V-Min.

Rank r holds stages r and 2pp-1-r, so a microbatch goes down the ranks and back up:

    stage   0  1  2  3  4  5  6  7        (pp=4)
    rank    0  1  2  3  3  2  1  0

The first rank runs both the first and the last stage, so a microbatch's round trip
starts and ends there and every rank waits about as long for its backward: memory is
balanced across ranks, where 1F1B's first rank holds pp microbatches and its last one.
(Qi et al. 2024, "Zero Bubble Pipeline Parallelism" for ZB-V and "Pipeline Parallelism
with Controllable Memory" for V-Half and V-Min.)

The three differ only in the stash limit each rank keeps to, in stage-microbatches
(2 per microbatch: one for each of a rank's two stages, each half of its layers), and
are all built by the list scheduler of [Note: split list scheduling] (zero_bubble.py):

    zbv     2pp              1F1B's first-rank memory (pp microbatches), near-zero bubble
    v_half  pp + 2           about half of it: the paper's (pp+2)//2 microbatches
    v_min   2((pp+4)//3)     about a third: the paper's (pp+4)//3 microbatches

(each at most 2pp). The halves and thirds are asymptotic: at pp=4 V-Half holds 3/4 of
1F1B's first-rank activations and V-Min 1/2, at pp=8 5/8 and 1/2, at pp=16 9/16 and 3/8.

ZB-V, pp=4, m=8, unit costs (F = B = W = 1 cell per stage), the first 19 steps:

    rank 0  0F0  0F1  0F2  0F3  0F4  0F5  0F6  7F0  7B0  7W0  7F1  7B1  7W1  7F2  7B2  0B0  7W2  7F3  7B3
    rank 1  .    1F0  1F1  1F2  1F3  1F4  6F0  1F5  6F1  6B0  6W0  6F2  6B1  6W1  1B0  6B2  6F3  1W0  1B1
    rank 2  .    .    2F0  2F1  2F2  5F0  2F3  5F1  2F4  5F2  5B0  5W0  5F3  2B0  5B1  2W0  5B2  2B1  5W1
    rank 3  .    .    .    3F0  4F0  3F1  4F1  3F2  4F2  3F3  4F3  4B0  3B0  4W0  3W0  4B1  3B1  4B2  3B2

`cap` (one int or pp ints) lowers the limit where it is smaller; it counts
stage-microbatches as rule 6 does, so it must be >= 2. `cost` (see `stage_times`) times
the list schedule instead of unit costs ([Note: cost-aware timing]).

[Note: handcrafted ZB-V] The paper's own ZB-V order (PyTorch's ScheduleZBVZeroBubble
runs it) is the phases below, on rank r with stages a = r and b = 2pp-1-r, written for
n = max(m, 2pp-1) microbatches and cut to m ([Note: padded phases] in phases.py):

    warmup     F(a) x (2(pp-r)-1); (F(b), F(a)) x r; (F(b), B(b), W(b)) x (pp-r)
    steady     (F(a) while any is left, B(a), W(a), F(b), B(b), W(b)) until F(b) reaches n
    cooldown   (B(a), B(b)) x r; (B(a), W(a)) x (pp-r); the W left, of b then of a

It holds at most 2pp stage-microbatches, as the list schedule does, and finishes earlier
than it for some (pp, m) (unit costs: pp=3 m=7 in 22 against 22.5; pp=8 m=16 by 1), and
later for others (every m < 2pp-1, where its padding idles). `zbv` takes whichever of the
two finishes first under the cost it is given (unit costs when none; the list schedule on
a tie), the handcrafted one only where its stash fits the limits.
"""

from __future__ import annotations

from pipeschedule.compiler.generators.common import check_common, make
from pipeschedule.compiler.generators.phases import PhaseWriter, faster, stash_peaks
from pipeschedule.compiler.ir import Op
from pipeschedule.compiler.timing import stage_times
from pipeschedule.compiler.generators.zero_bubble import split_list_schedule, stage_limits

VIRTUAL = 2


def v_placement(pp: int) -> list[int]:
    """Rank of each of the 2pp stages: r for stage r and for stage 2pp-1-r."""
    return list(range(pp)) + list(reversed(range(pp)))


def natural_limit(name: str, pp: int) -> int:
    """The stash limit of V-shape family `name` at pp, in stage-microbatches (never more
    than ZB-V's 2pp: more cannot help a V)."""
    if name == "zbv":
        return 2 * pp
    if name == "v_half":
        return min(pp + 2, 2 * pp)
    return min(2 * ((pp + 4) // 3), 2 * pp)  # v_min


def handcrafted_zbv(pp: int, microbatches: int) -> list[list]:
    """The compute order of [Note: handcrafted ZB-V], every rank's."""
    n = max(microbatches, 2 * pp - 1)
    programs = []
    for r in range(pp):
        a, b = r, 2 * pp - 1 - r
        rank = PhaseWriter()
        rank.repeat(2 * (pp - r) - 1, [(a, Op.F)])  # warmup
        rank.repeat(r, [(b, Op.F), (a, Op.F)])
        rank.repeat(pp - r, [(b, Op.F), (b, Op.B), (b, Op.W)])
        forwards_a = 2 * pp - r - 1
        for _ in range(n - pp):  # steady: F(b) goes from pp to n
            if forwards_a < n:
                rank.step(a, Op.F)
                forwards_a += 1
            rank.repeat(1, [(a, Op.B), (a, Op.W), (b, Op.F), (b, Op.B), (b, Op.W)])
        rank.repeat(r, [(a, Op.B), (b, Op.B)])  # cooldown
        rank.repeat(pp - r, [(a, Op.B), (a, Op.W)])
        rank.repeat(r, [(b, Op.W)])
        rank.repeat(r, [(a, Op.W)])
        programs.append(rank.below(microbatches))
    return programs


def _v_schedule(name: str, pp: int, microbatches: int, cap, cost):
    check_common(pp, microbatches, VIRTUAL)
    limits = stage_limits(name, pp, microbatches, VIRTUAL, [natural_limit(name, pp)] * pp, cap)
    placement = v_placement(pp)
    times = stage_times(cost, 2 * pp)
    programs = split_list_schedule(pp, microbatches, placement, limits, times)
    if name == "zbv":  # [Note: handcrafted ZB-V]
        handcrafted = handcrafted_zbv(pp, microbatches)
        if all(p <= limit for p, limit in zip(stash_peaks(handcrafted), limits)):
            programs = faster(2 * pp, [programs, handcrafted], times)
    params = {"stash_limit": limits}
    if cap is not None:
        params["cap"] = limits
    return make(name, pp, VIRTUAL, microbatches, placement, programs, params)


def zbv(pp: int, microbatches: int, cap=None, cost=None):
    """ZB-V: V-shape placement, split backward, 2pp stage-microbatches per rank."""
    return _v_schedule("zbv", pp, microbatches, cap, cost)


def v_half(pp: int, microbatches: int, cap=None, cost=None):
    """V-Half: V-shape placement, split backward, about half of 1F1B's activation memory."""
    return _v_schedule("v_half", pp, microbatches, cap, cost)


def v_min(pp: int, microbatches: int, cap=None, cost=None):
    """V-Min: V-shape placement, split backward, about a third of 1F1B's activation memory."""
    return _v_schedule("v_min", pp, microbatches, cap, cost)
