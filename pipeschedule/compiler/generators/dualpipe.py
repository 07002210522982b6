"""DualPipeV: DeepSeek's DualPipe cut in half (V placement, 2 stages a rank, split
backward), as PyTorch 2.13's ScheduleDualPipeV runs it.

Rank r holds stages a = r and b = 2pp-1-r (the V of v_shape.py). After a warmup, every
step pairs the forward of one microbatch with the backward of another on the rank's
other stage ("F(a) & B(b)", then "F(b) & B(a)"), which DeepSeek overlaps so that one's
communication hides behind the other's compute; here a pair is adjacent instructions,
the F first, and a paired backward is whole (its W right after its B). Phases of rank
r, written for n = max(m, 2pp) microbatches and cut to m ([Note: padded phases] in
phases.py; PyTorch refuses m < 2pp), "W?" the oldest pending weight gradient:

    1 warmup     F(a) x 2(pp-r-1)
    2            (F(a), F(b)) x (r+1)
    3            (B(b), W?, F(b)) x (pp-r-1)
    4 steady     (F(a) & B(b), F(b) & B(a)) x (n - 2pp + r + 1)
    5            (B(b), F(b) & B(a)) x (pp-r-1)
    6 cooldown   (B(b), B(a)) x (r+1), whole backwards until halfway, then split
    7            (W?, B(a)) x (pp-r-1)
    8            W? x (r+1)

pp=2, m=4, unit costs (F = B = W = 1 cell per stage; stages 0, 3 on rank 0, 1, 2 on rank 1),
each instruction as soon as it can run:

    rank 0  0F0 0F1 0F2 3F0 3B0 3W0 3F1 0F3 3B1 3W1 3F2 0B0 0W0 3B2 3W2 3F3 0B1 0W1 3B3 3W3 0B2 0W2 .   0B3 0W3
    rank 1  .   1F0 2F0 1F1 2F1 1F2 2B0 2W0 2F2 1B0 1W0 1F3 2B1 2W1 2F3 1B1 1W1 2B2 2W2 1B2 1W2 2B3 1B3 2W3 1W3

[Note: DualPipeV bubble] DeepSeek's table gives DualPipe a bubble of
(PP/2-1)(F&B + B - 3W) per rank, F, B (whole), W the times of one stage, F&B that of an
overlapped pair, PP its stages (2pp here: DualPipeV is DualPipe folded onto pp ranks), and
PP+1 microbatches of activations. Our runtime does not overlap a pair, so F&B = F + B.
Under unit costs (a stage F = B = W, B the input half) the handcrafted order's step, for
m >= 2pp, is 6m + pp - 1 stage-times: (pp-1)F of bubble per rank, half the formula's
(pp-1)(F + 2B - W) = 2(pp-1)F, and the same as ZB-V's; it holds 2pp+1
stage-microbatches between an F and its W on every rank (ZB-V: 2pp), pp + 1/2
microbatches of a rank's layers (tests/compiler/test_new_families.py asserts both for pp
2..8). Under the H200 costs at pp=4, m=8: 213.65 ms against the formula's 219.11
(benchmarks/results/pytorch_orders.md). `dualpipev` takes the handcrafted order, or the
list schedule of [Note: split list scheduling] under the same per-rank stash limits where
that finishes first under the given cost (unit costs when none; the handcrafted order on
a tie): never slower than PyTorch's order, at the same memory.

`cap` (one int or pp ints, >= 2, stage-microbatches as rule 6 counts them) lowers the
stash limits; where the handcrafted order does not fit them the list schedule runs.
`cost` (see `stage_times`) times the choice ([Note: cost-aware timing]).
"""

from __future__ import annotations

from pipeschedule.compiler.generators.common import check_common, make
from pipeschedule.compiler.generators.phases import FULL_B, PENDING_W, PhaseWriter, faster, stash_peaks
from pipeschedule.compiler.generators.v_shape import VIRTUAL, v_placement
from pipeschedule.compiler.generators.zero_bubble import split_list_schedule, stage_limits
from pipeschedule.compiler.ir import Op
from pipeschedule.compiler.timing import stage_times


def _rank_order(pp: int, microbatches: int, r: int) -> list:
    n = max(microbatches, 2 * pp)
    a, b = r, 2 * pp - 1 - r
    rank = PhaseWriter()
    rank.repeat(2 * (pp - r - 1), [(a, Op.F)])  # 1 warmup
    rank.repeat(r + 1, [(a, Op.F), (b, Op.F)])  # 2
    rank.repeat(pp - r - 1, [(b, Op.B), (b, PENDING_W), (b, Op.F)])  # 3
    rank.repeat(n - 2 * pp + r + 1, [(a, Op.F), (b, FULL_B), (b, Op.F), (a, FULL_B)])  # 4 steady
    rank.repeat(pp - r - 1, [(b, FULL_B), (b, Op.F), (a, FULL_B)])  # 5
    half = (r + 1) // 2  # 6 cooldown: split from the pair `half` on (from its B(a) on an even rank)
    for i in range(r + 1):
        rank.step(b, Op.B if i > half or (i == half and r % 2 == 1) else FULL_B)
        rank.step(a, Op.B if i >= half else FULL_B)
    rank.repeat(pp - r - 1, [(a, PENDING_W), (a, Op.B)])  # 7
    rank.repeat(r + 1, [(a, PENDING_W)])  # 8
    rank.flush()
    return rank.below(microbatches)


def handcrafted_dualpipev(pp: int, microbatches: int) -> list[list]:
    """The handcrafted DualPipeV compute order of every rank (the module's phases)."""
    return [_rank_order(pp, microbatches, r) for r in range(pp)]


def dualpipev(pp: int, microbatches: int, cap=None, cost=None):
    """DualPipeV: V placement, split backward, forwards paired with backwards."""
    check_common(pp, microbatches, VIRTUAL)
    handcrafted = handcrafted_dualpipev(pp, microbatches)
    natural = stash_peaks(handcrafted)
    limits = stage_limits("dualpipev", pp, microbatches, VIRTUAL, natural, cap)
    placement = v_placement(pp)
    times = stage_times(cost, 2 * pp)
    listed = split_list_schedule(pp, microbatches, placement, limits, times)
    if all(p <= limit for p, limit in zip(natural, limits)):
        programs = faster(2 * pp, [handcrafted, listed], times)
    else:
        programs = listed
    params = {"stash_limit": limits}
    if cap is not None:
        params["cap"] = limits
    return make("dualpipev", pp, VIRTUAL, microbatches, placement, programs, params)
