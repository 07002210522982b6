"""Interleaved zero bubble (PyTorch's ScheduleInterleavedZeroBubble: the zero-bubble
paper's ZB1P over round-robin virtual stages): interleaved 1F1B's order of F and B
(interleaved.py), with the backward split and each W put off to fill the bubbles.

Rank r runs stages r, r + pp, ..., r + (v-1)pp in groups of microbatches as interleaved
1F1B does ([Note: interleaved groups]; PyTorch's rounds), with a warmup of
(v-1)g + pp-1-r forwards (1F1B's pp-1-r more than the first chunk needs, not
interleaved 1F1B's 2(pp-1-r): the W fill the rest), then pairs (F, B) and the remaining
B, the W of rank r put off by r backwards, the last W at the end. pp=2, v=2, m=4, unit
costs per stage (F = B = W = 1 cell), each instruction as soon as it can run:

    rank 0  0F0 0F1 2F0 2F1 .   2B0 2W0 0F2 2B1 2W1 0F3 0B0 0W0 2F2 0B1 0W1 2F3 2B2 2W2 2B3 2W3 0B2 0W2 0B3 0W3
    rank 1  .   1F0 1F1 3F0 3B0 3F1 3B1 3W0 1F2 1B0 3W1 1F3 1B1 1W0 3F2 3B2 1W1 3F3 3B3 3W2 1B2 3W3 1B3 1W2 1W3

[Note: interleaved ZB choice] The order is the faster, under the cost it is given (unit
costs when none), of that handcrafted order and, where a rank holds at most 2 chunks,
the list schedule of [Note: split list scheduling] under the handcrafted order's own
per-rank stash (its peak between an F and its W), so that it is never slower than
PyTorch's at the same memory; the handcrafted one on a tie. Where the handcrafted order
would block (a short group; PyTorch refuses such m), the warmup of the blocked ranks is
raised until it completes, as interleaved 1F1B does.

`cap` (one int or pp ints, >= virtual) bounds the stash per rank: the fastest of the
orders that fit it, among the handcrafted ones (PyTorch's rounds, and groups of pp where m
is not a multiple of pp), the list schedule under the cap (v <= 2,
where it never blocks) and capped interleaved 1F1B's order with each W right after its
B (which fits every cap >= virtual: its stash is its count in flight).
"""

from __future__ import annotations

from pipeschedule.compiler.generators.common import check_common, make, round_robin
from pipeschedule.compiler.generators.interleaved import _orders, groups_of, interleaved_1f1b, rounds_of
from pipeschedule.compiler.generators.phases import faster, stash_peaks
from pipeschedule.compiler.generators.zero_bubble import split_list_schedule, stage_limits
from pipeschedule.compiler.ir import Op, make_instr
from pipeschedule.compiler.timing import asap, stage_times


def _rank_order(forwards, backwards, warmup: int, delay: int) -> list:
    """`warmup` forwards, then per backward: the next F (while any is left), the B and,
    once more than `delay` are pending, the oldest pending W; the W left at the end."""
    order = [make_instr(Op.F, *slot) for slot in forwards[:warmup]]  # warmup
    ahead = warmup
    done_w = 0
    for k, slot in enumerate(backwards):  # steady, then cooldown once the F run out
        if ahead < len(forwards):
            order.append(make_instr(Op.F, *forwards[ahead]))
            ahead += 1
        order.append(make_instr(Op.B, *slot))
        if k + 1 - done_w > delay:
            order.append(make_instr(Op.W, *backwards[done_w]))
            done_w += 1
    order.extend(make_instr(Op.W, *slot) for slot in backwards[done_w:])  # cooldown
    return order


def with_weights(program) -> list:
    """A compute order with each B followed by its W (a whole backward, split)."""
    out = []
    for i in program:
        out.append(i)
        if i.op is Op.B:
            out.append(make_instr(Op.W, i.stage, i.mb))
    return out


def handcrafted_interleaved_zb(pp: int, microbatches: int, virtual: int, groups=None) -> list[list]:
    """The handcrafted order of the module's docstring over microbatch groups `groups`
    (None: PyTorch's rounds), warmups raised where it would block."""
    groups = list(groups or rounds_of(pp, microbatches))
    total = virtual * microbatches
    warm = [min(total, (virtual - 1) * groups[0] + pp - 1 - r) for r in range(pp)]
    orders = [_orders(pp, virtual, microbatches, r, groups) for r in range(pp)]
    while True:
        programs = [_rank_order(f, b, w, r) for r, ((f, b), w) in enumerate(zip(orders, warm))]
        stuck = asap(pp * virtual, programs)[1]
        if not stuck:
            return programs
        raised = [r for r in stuck if warm[r] < total]
        if not raised:  # every stuck rank already runs all its forwards first: cannot happen
            raise AssertionError(f"interleaved zero bubble blocks with every warmup at its most ({warm})")
        for r in raised:
            warm[r] += 1


def interleaved_zb(pp: int, microbatches: int, virtual: int = 2, cap=None, cost=None):
    """Interleaved zero bubble (ZB1P over virtual stages) ([Note: interleaved ZB choice])."""
    check_common(pp, microbatches, virtual)
    placement = round_robin(pp, virtual)
    S = pp * virtual
    times = stage_times(cost, S)
    handcrafted = [handcrafted_interleaved_zb(pp, microbatches, virtual, g)
                   for g in dict.fromkeys((tuple(rounds_of(pp, microbatches)), tuple(groups_of(microbatches, pp))))]
    natural = stash_peaks(faster(S, handcrafted, times))  # the uncapped order's own stash
    limits = stage_limits("interleaved_zb", pp, microbatches, virtual, natural, cap)
    candidates = [h for h in handcrafted if all(p <= limit for p, limit in zip(stash_peaks(h), limits))]
    if virtual <= 2:  # [Note: split list scheduling] never blocks with one or two stages a rank
        candidates.append(split_list_schedule(pp, microbatches, placement, limits, times))
    if not candidates:
        capped = interleaved_1f1b(pp, microbatches, virtual, cap=limits).programs
        candidates.append([with_weights(program) for program in capped])
    programs = faster(S, candidates, times)
    params = {"stash_limit": limits}
    if cap is not None:
        params["cap"] = limits
    return make("interleaved_zb", pp, virtual, microbatches, placement, programs, params)
