"""ZB-H2 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): split backward, round-robin
placement, about twice 1F1B's activation memory for (nearly) no bubble.

Rank r runs 2(pp-r)-1 forwards of warmup, which is what it can run before the first
backward comes back to it (at time 2pp-1-r under unit costs, where it started at r):
the warmup fills the bubble ZB-H1 leaves before its first B. Then B, W and F per
microbatch, the W of rank r put off by r backwards. This handcrafted order at pp=4, m=8,
unit costs (F = B = W = 1 cell), each instruction as soon as it can run, the first 26 of
its 27 steps:

    rank 0  0F0 0F1 0F2 0F3 0F4 0F5 0F6 0B0 0W0 0F7 0B1 0W1 0B2 0W2 .   0B3 0W3 0B4 0W4 .   0B5 0W5 0B6 0W6 .   0B7
    rank 1  .   1F0 1F1 1F2 1F3 1F4 1B0 1F5 1B1 1W0 1F6 1B2 1W1 1F7 1B3 1W2 1B4 1W3 .   1B5 1W4 1B6 1W5 .   1B7 1W6
    rank 2  .   .   2F0 2F1 2F2 2B0 2F3 2B1 2F4 2B2 2W0 2F5 2B3 2W1 2F6 2B4 2W2 2F7 2B5 2W3 2B6 2W4 .   2B7 2W5 2W6
    rank 3  .   .   .   3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3W0 3F4 3B4 3W1 3F5 3B5 3W2 3F6 3B6 3W3 3F7 3B7 3W4 3W5 3W6
            warmup 2(pp-r)-1                   steady: B, (W), F

[Note: ZB-H2 bubble] The paper gives ZB-H2 a bubble of (pp-1)(F + B - 2W) per rank
at a stash of 2pp-1 microbatches (1F1B's first rank holds pp). The last rank cannot start
before (pp-1)F, so no order finishes before (pp-1)F + m(F + B + W) on it: under unit
costs 3m + pp - 1, which ZB-H1 already reaches for m >= pp. The paper's zero counts a
step whose ranks do not wait for each other at its ends (its post-validation lets the
next step's forwards start while the last rank finishes: the parallelogram tiles); one
step, flushed, as simulated here, keeps the (pp-1)F ramp. ZB-H2 gains where F + B - W
exceeds F, as on measured costs (examples/cost_pp4_split.json at m=8: ZB-H1 215.4 ms,
ZB-H2 188.2 ms, below the paper's busiest rank + (pp-1)(F + B - 2W) = 221.7 ms;
benchmarks/results/pytorch_orders.md). The order is the fastest, under the
cost it is given (unit costs when none), of these, each holding at most 2pp-1
stage-microbatches between an F and its W on any rank (or `cap` where lower):
  - the handcrafted order above, its W put off by r backwards on rank r, or by none;
  - ZB-H1's warmup with the same two choices of W;
  - the list schedule of [Note: split list scheduling] under limits of 2pp-1 per rank,
    and under 2(pp-r)-1 on rank r;
the one holding the least (its stash summed over ranks) on a tie. ZB-H1's own order is
among them, so ZB-H2 is never slower than ZB-H1 under the same cost, and where ZB-H1
already reaches the bound (unit costs, m >= pp) it is ZB-H1's order; the larger warmup
pays where B and W differ from F.

`cap` (one int or pp ints, >= 1) lowers the stash limit; candidates that do not fit it
are left out, and the list schedule always fits.
"""

from __future__ import annotations

from pipeschedule.compiler.generators.common import check_common, make
from pipeschedule.compiler.generators.phases import faster, stash_peaks
from pipeschedule.compiler.generators.zero_bubble import split_list_schedule, stage_limits, zb_h1_order
from pipeschedule.compiler.timing import stage_times


def natural_limit(pp: int) -> int:
    """ZB-H2's stash per rank, in stage-microbatches: 2pp-1."""
    return 2 * pp - 1


def _candidates(pp: int, m: int, limits, times):
    for warmup in ([min(m, 2 * (pp - r) - 1) for r in range(pp)], [min(m, pp - r) for r in range(pp)]):
        for delays in (list(range(pp)), [0] * pp):
            yield [zb_h1_order(r, m, warmup[r], delays[r]) for r in range(pp)]
    yield split_list_schedule(pp, m, list(range(pp)), limits, times)
    lower = [min(limit, 2 * (pp - r) - 1) for r, limit in enumerate(limits)]
    yield split_list_schedule(pp, m, list(range(pp)), lower, times)


def zb_h2(pp: int, microbatches: int, cap=None, cost=None):
    """ZB-H2: round-robin placement, split backward, 2pp-1 stage-microbatches per rank
    ([Note: ZB-H2 bubble])."""
    check_common(pp, microbatches)
    limits = stage_limits("zb_h2", pp, microbatches, 1, [natural_limit(pp)] * pp, cap)
    times = stage_times(cost, pp)
    fitting = []
    for k, programs in enumerate(_candidates(pp, microbatches, limits, times)):
        peaks = stash_peaks(programs)
        if all(p <= limit for p, limit in zip(peaks, limits)):
            fitting.append((sum(peaks), k, programs))
    programs = faster(pp, [programs for *_, programs in sorted(fitting)], times)  # the leanest on a tie
    params = {"stash_limit": limits}
    if cap is not None:
        params["cap"] = limits
    return make("zb_h2", pp, 1, microbatches, range(pp), programs, params)
