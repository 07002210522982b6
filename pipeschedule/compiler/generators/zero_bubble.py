"""Split-backward schedules: ZB-H1, and the list scheduler of the V shapes (and of a
capped ZB-H1 where that is faster).

The backward of a (stage, mb) is split in B (input gradient: the next stage back waits
for it) and W (weight gradient: nobody waits for it). A W can run any time after its B,
so it fills the gaps 1F1B leaves idle (Qi et al. 2024, "Zero Bubble Pipeline
Parallelism"). The stash of (stage, mb) lives from its F to its W.

ZB-H1 (`zb_h1`) is the paper's handcrafted schedule: 1F1B's order of F and B, with the
W of rank r put off by r backwards, so that every rank holds up to pp stage-microbatches
between an F and its W (1F1B's first rank holds pp), and the W held back fill the
cooldown. pp=4, m=8, unit costs (F = B = W = 1 cell):

    rank 0  F0 F1 F2 F3 .  .  .  B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7
    rank 1  .  F0 F1 F2 .  .  B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7
    rank 2  .  .  F0 F1 .  B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7
    rank 3  .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7
            warmup        steady: B, (W), F                                  cooldown: B, (W); W

[Note: ZB-H1 bubble] Rank r runs its min(pp - r, m) warmup forwards from time r on, and
B0 comes back to it at time 2pp-1-r (down the pp ranks, back up pp-1-r): when m >= pp it
idles r units before its warmup and pp-1-r after it, pp-1 in all, and never again: every
instruction it reaches is ready by then (asap and the simulator show it; the tests
assert it for pp = 2..8 and 16). So under unit costs the step time is
3m + pp - 1 + max(0, pp - m): for m >= pp the paper's (pp-1)(F + B - W) of bubble per
rank against 1F1B's 3(pp-1), a third. Peak stash: min(pp, m) on every rank; peak F-to-B
in flight: 1F1B's min(pp - r, m). The order is acyclic because its F and B are in 1F1B's
order and nothing waits for a W.

[Note: split list scheduling] The V shapes (v_shape.py), and ZB-H1 under some caps, are
one event-driven list schedule under unit costs (F = B = W = 1 per stage; or a given
cost's per-stage times, [Note: cost-aware timing] in timing.py), differing only
in the placement and in `limit[r]`, the most stage-microbatches rank r may hold between
an F and its W (its stash). Whenever a rank is free it runs, in this order of preference:
  1. a B whose output gradient is there (the backward chain is the critical path);
  2. an F whose input is there, if the stash limit allows it;
  3. its oldest pending W;
otherwise it waits for a neighbour. Among several ready B or F it takes the oldest
microbatch, then the stage later in the pipeline. Each stage runs its F and its B in
microbatch order. Phases emerge rather than being written out: forwards up to the limit
(warmup), B then W then F (steady), the W left over (cooldown).

A microbatch that enters a rank through its first local stage will need a stash slot at
the rank's later stage (V-shape: stage 2pp-1-r after stage r), so an F that starts a new
microbatch on a rank must leave that many slots free (it needs held + local stages <=
limit); an F on a later local stage needs one free slot. That keeps the oldest
unfinished microbatch moving (for one or two stages per rank): a rank holds only it and
newer microbatches, none of which passes it on any stage, so when it waits for its
second F the rank's slots are taken by first-stage entries alone, which left one free;
a B needs no slot and a W only its own B. So the list schedule never blocks for any
limit >= the number of local stages, and the order it writes down is acyclic (it was
timed). A user cap (rule 6 counts F to B) is folded into the limit, which counts F to W
and so bounds the cap's count too.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Sequence

from pipeschedule.errors import ParameterError
from pipeschedule.compiler.generators.common import check_common, make, per_rank_caps
from pipeschedule.compiler.timing import StageTimes, asap, finish_time, stage_times
from pipeschedule.compiler.ir import Op, make_instr
from pipeschedule.checks import shown


def stage_limits(name: str, pp: int, microbatches: int, local_stages: int, natural: Sequence[int], cap) -> list[int]:
    """Per-rank stash limits: the family's `natural` limits, lowered to `cap` where given
    (one int or pp ints, checked by `per_rank_caps`), and to the most a rank can hold
    (local_stages * microbatches). A limit below `local_stages` cannot carry one
    microbatch through the rank's stages and is refused."""
    limits = list(natural)
    if cap is not None:
        caps = per_rank_caps(cap, pp)
        low = min(caps)
        if low < local_stages:
            raise ParameterError(
                f"{name}: cap {shown(cap)} is below {local_stages}: a rank holds one microbatch in each of its "
                f"{local_stages} stages between their F and B, so cap must be >= {local_stages} "
                f"stage-microbatches (per rank)"
            )
        limits = [min(n, c) for n, c in zip(limits, caps)]
    return [max(local_stages, min(n, local_stages * microbatches)) for n in limits]


def split_list_schedule(pp: int, microbatches: int, placement: Sequence[int], limits: Sequence[int],
                        cost: StageTimes | None = None) -> list[list]:
    """The compute order of [Note: split list scheduling]: F, B and W of every
    (stage, mb), stage s on rank placement[s], rank r holding at most limits[r]
    stage-microbatches between an F and its W; timed under unit costs, or under `cost`'s
    per-stage times ([Note: cost-aware timing])."""
    S, m = len(placement), microbatches
    if cost is None:
        cost = StageTimes((1,) * S, (1,) * S, (1,) * S)
    duration = {Op.F: cost.forward, Op.B: cost.backward, Op.W: cost.weight}
    last = S - 1
    local = [[s for s in range(S) if placement[s] == r] for r in range(pp)]
    entry = [stages[0] for stages in local]  # the stage through which a microbatch enters a rank
    f_end = [[None] * m for _ in range(S)]
    b_end = [[None] * m for _ in range(S)]
    next_f, next_b = [0] * S, [0] * S
    held, reserved, free_at = [0] * pp, [0] * pp, [0] * pp
    pending_w: list[deque] = [deque() for _ in range(pp)]
    programs: list[list] = [[] for _ in range(pp)]
    wakeups = [(0, r) for r in range(pp)]
    while wakeups:
        t, r = heapq.heappop(wakeups)
        if free_at[r] > t:
            continue
        choice = None
        for s in local[r]:  # 1. a ready B, oldest microbatch first, then the later stage
            mb = next_b[s]
            if (mb < next_f[s] and f_end[s][mb] <= t
                    and (s == last or (b_end[s + 1][mb] is not None and b_end[s + 1][mb] <= t))):
                if choice is None or (mb, -s) < (choice[2], -choice[1]):
                    choice = (Op.B, s, mb)
        if choice is None:
            for s in local[r]:  # 2. a ready F that the stash limit allows
                mb = next_f[s]
                if mb >= m or not (s == 0 or (f_end[s - 1][mb] is not None and f_end[s - 1][mb] <= t)):
                    continue
                if held[r] + (len(local[r]) if s == entry[r] else 1) > limits[r]:
                    continue  # entering the rank keeps a slot free for its later stage
                if choice is None or (mb, -s) < (choice[2], -choice[1]):
                    choice = (Op.F, s, mb)
        if choice is None and pending_w[r]:
            choice = (Op.W, *pending_w[r].popleft())  # 3. the oldest pending W
        if choice is None:
            continue  # idle until a neighbour or this rank finishes something
        op, s, mb = choice
        end = free_at[r] = t + duration[op][s]
        programs[r].append(make_instr(op, s, mb))
        if op is Op.F:
            f_end[s][mb] = end
            next_f[s] += 1
            held[r] += 1
            if s == entry[r]:
                reserved[r] += len(local[r]) - 1
            else:
                reserved[r] -= 1
            neighbours = (s + 1,)
        elif op is Op.B:
            b_end[s][mb] = end
            next_b[s] += 1
            pending_w[r].append((s, mb))
            neighbours = (s - 1,)
        else:
            held[r] -= 1
            neighbours = ()
        heapq.heappush(wakeups, (end, r))
        for q in neighbours:  # whose next step may have become ready
            if 0 <= q < S and placement[q] != r:
                heapq.heappush(wakeups, (end, placement[q]))
    # [Note: split list scheduling] proves this cannot happen; fail loudly if it does.
    done = sum(len(p) for p in programs)
    if done != 3 * S * m:
        raise AssertionError(f"split list schedule blocked after {done} of {3 * S * m} instructions "
                             f"(limits {list(limits)})")
    return programs


def zb_h1_order(rank: int, microbatches: int, warmup: int, delay: int) -> list:
    """Rank `rank`'s ZB-H1 compute order ([Note: ZB-H1 bubble]): `warmup` forwards, then
    for each microbatch in turn its B, the oldest pending W once more than `delay` are
    pending, and the next F while any is left; the W still pending at the end. It holds
    at most warmup + delay stashes; its F and B are in 1F1B's order when warmup is 1F1B's."""
    order = [make_instr(Op.F, rank, mb) for mb in range(warmup)]  # warmup
    next_w = 0
    for mb in range(microbatches):  # steady (B, W, F), then cooldown (B, W) once the F run out
        order.append(make_instr(Op.B, rank, mb))
        if mb + 1 - next_w > delay:
            order.append(make_instr(Op.W, rank, next_w))
            next_w += 1
        if warmup + mb < microbatches:
            order.append(make_instr(Op.F, rank, warmup + mb))
    order.extend(make_instr(Op.W, rank, mb) for mb in range(next_w, microbatches))  # cooldown
    return order


def zb_h1(pp: int, microbatches: int, cap=None, cost=None):
    """ZB-H1: round-robin placement, split backward, every rank holding at most pp
    stage-microbatches between an F and its W (1F1B's peak, on its first rank), or `cap`
    where lower.

    `cap` is one int for all ranks or a list of pp ints (>= 1); it bounds the stash (F to
    W), and so also rule 6's count (F to B). Which order a cap gets:
    - cap >= min(pp, m) on every rank: the handcrafted ZB-H1 ([Note: ZB-H1 bubble]);
    - otherwise, if every rank r may still hold 1F1B's min(pp - r, m): the handcrafted
      order with rank r's W put off by only cap[r] - min(pp - r, m) backwards, or the list
      schedule of [Note: split list scheduling] under the cap, whichever finishes first
      under unit costs (the handcrafted one on a tie);
    - otherwise (a cap below 1F1B's in-flight count on some rank): the list schedule.
    `cost` (see `stage_times`) times the list schedule and the choice instead of unit
    costs ([Note: cost-aware timing]).
    """
    check_common(pp, microbatches)
    m = microbatches
    times = stage_times(cost, pp)
    limits = stage_limits("zb_h1", pp, m, 1, [pp] * pp, cap)
    warmups = [min(pp - r, m) for r in range(pp)]  # 1F1B's forwards before the first B
    # W put off by r backwards (the handcrafted form) where the limit allows its
    # min(pp, m) stashes, else by as many as the limit allows (< 0: not even 1F1B's order)
    delays = [r if limits[r] >= min(pp, m) else limits[r] - warmups[r] for r in range(pp)]
    params = {"stash_limit": limits}
    if cap is not None:
        params["cap"] = limits
    if min(delays) < 0:
        programs = split_list_schedule(pp, m, list(range(pp)), limits, times)
        return make("zb_h1", pp, 1, m, range(pp), programs, params)
    programs = [zb_h1_order(r, m, warmups[r], delays[r]) for r in range(pp)]
    if delays == list(range(pp)):
        return make("zb_h1", pp, 1, m, range(pp), programs, params)
    # a cap between 1F1B's in-flight count and ZB-H1's: keep whichever order is faster
    listed = split_list_schedule(pp, m, list(range(pp)), limits, times)
    if finish_time(listed, asap(pp, listed, times), times) < finish_time(programs, asap(pp, programs, times), times):
        programs = listed
    return make("zb_h1", pp, 1, m, range(pp), programs, params)
