"""1F1B (PipeDream-flush), and 1F1B with a per-rank cap on microbatches in flight.

pp=4, m=6 (F = 1 cell, B = 2 cells):

    rank 0  F0 F1 F2 F3 .  .  .  B0 B0 F4 B1 B1 F5 B2 B2 ...
    rank 1  .  F0 F1 F2 .  .  B0 B0 F3 B1 B1 F4 ...
    rank 2  .  .  F0 F1 .  B0 B0 F2 B1 B1 ...
    rank 3  .  .  .  F0 B0 B0 F1 B1 B1 ...

Plain 1F1B: rank r runs k_r = min(pp - r, m) forwards, then alternates backward and
forward, then drains the remaining backwards; k_r microbatches are in flight at its peak.

Capped: rank r may hold at most k_r = min(cap_r, pp - r, m, k_{r-1}) in flight. A rigid
"k_r forwards, then alternate" order is a poor way to honour a cap: at pp=8, cap 7 it
runs at 57% of 1F1B's throughput, because every rank then waits for the slowest round
trip in lock step. Instead the order is found by list scheduling under unit costs
(F = 1, B = 2; or a given cost's per-stage times, [Note: cost-aware timing]): whenever a
rank is free it runs its next backward if that is ready, else
its next forward if that is ready and the rank is under its cap, else it waits. This
gives about c/pp of 1F1B's throughput (pp=8, cap 7: 90%; cap 4: 56%), never breaks the
cap, and with no effective cap it is 1F1B instruction for instruction (tested).

[Note: cap monotonicity] A microbatch in flight on rank r (its F done, its B not) is also
in flight on every earlier rank, whose B comes after r's. So rank r can never hold more
than rank r-1 does; a cap list that grows along the pipeline is clipped to the running
minimum, which is also what keeps the order free of cycles: rank r+1's B(i) needs
F(i + k_{r+1} - 1) from rank r, which rank r runs before its B(i) iff k_{r+1} <= k_r.
"""

import heapq

from pipeschedule.compiler.generators.common import (
    check_common, compute_templates, interleave_1f1b, make, per_rank_caps,
)
from pipeschedule.compiler.timing import StageTimes, stage_times
from pipeschedule.compiler.ir import Op, make_instr

DEFAULT_CAP_DOC = "ceil(pp / 2): half of 1F1B's first-stage activation memory"


def default_cap(pp: int) -> int:
    """The cap `capped_1f1b` uses when none is given: ceil(pp / 2)."""
    return (pp + 1) // 2


def effective_caps(cap, pp: int, microbatches: int) -> list[int]:
    """Per-rank k_r of [Note: cap monotonicity]."""
    caps = per_rank_caps(cap, pp)
    out, running = [], microbatches
    for r in range(pp):
        running = min(running, caps[r], pp - r)
        out.append(running)
    return out


def one_f_one_b(pp: int, microbatches: int):
    check_common(pp, microbatches)
    programs, table = [], compute_templates(pp)
    for r, k in enumerate(effective_caps(pp, pp, microbatches)):
        forwards = [(r, mb) for mb in range(microbatches)]
        programs.append(interleave_1f1b(forwards, forwards, k - 1, table))  # warmup, steady, cooldown
    return make("1f1b", pp, 1, microbatches, range(pp), programs, {})


def list_schedule(pp: int, microbatches: int, caps: list[int], cost: StageTimes | None = None) -> list[list]:
    """The capped order of the module docstring: event-driven list scheduling under unit
    costs, or under `cost`'s per-stage F and B times ([Note: cost-aware timing]). Phases
    emerge rather than being written out: forwards while under the cap (warmup), a
    backward whenever one is ready (steady), the last backwards (cooldown)."""
    f_cost, b_cost = (cost.forward, cost.backward) if cost is not None else ((1,) * pp, (2,) * pp)
    f_end = [[None] * microbatches for _ in range(pp)]
    b_end = [[None] * microbatches for _ in range(pp)]
    next_f, next_b, inflight, free_at = [0] * pp, [0] * pp, [0] * pp, [0] * pp
    programs: list[list] = [[] for _ in range(pp)]
    wakeups = [(0, r) for r in range(pp)]
    last = pp - 1
    while wakeups:
        t, r = heapq.heappop(wakeups)
        if free_at[r] > t:
            continue
        b, f = next_b[r], next_f[r]
        if b < f and f_end[r][b] <= t and (r == last or (b_end[r + 1][b] is not None and b_end[r + 1][b] <= t)):
            programs[r].append(make_instr(Op.B, r, b))
            end = b_end[r][b] = free_at[r] = t + b_cost[r]
            next_b[r], inflight[r] = b + 1, inflight[r] - 1
        elif (f < microbatches and inflight[r] < caps[r]
              and (r == 0 or (f_end[r - 1][f] is not None and f_end[r - 1][f] <= t))):
            programs[r].append(make_instr(Op.F, r, f))
            end = f_end[r][f] = free_at[r] = t + f_cost[r]
            next_f[r], inflight[r] = f + 1, inflight[r] + 1
        else:
            continue  # idle until a neighbour or this rank finishes something
        for q in (r - 1, r, r + 1):  # whose next step may have become ready
            if 0 <= q < pp:
                heapq.heappush(wakeups, (end, q))
    # [Note: cap monotonicity] keeps the order free of cycles whatever the times; fail
    # loudly if it ever does not.
    done = sum(len(p) for p in programs)
    if done != 2 * pp * microbatches:
        raise AssertionError(f"capped list schedule blocked after {done} of {2 * pp * microbatches} instructions "
                             f"(caps {caps})")
    return programs


def capped_1f1b(pp: int, microbatches: int, cap=None, cost=None):
    """1F1B in which rank r keeps at most cap[r] microbatches in flight.

    `cap` is one int for all ranks or a list of pp ints; None means `default_cap(pp)`.
    With cap >= pp and unit costs this is 1F1B instruction for instruction. `cost`
    (see `stage_times`) times the list schedule instead of unit costs.
    """
    check_common(pp, microbatches)
    caps = effective_caps(default_cap(pp) if cap is None else cap, pp, microbatches)
    times = stage_times(cost, pp)
    programs = list_schedule(pp, microbatches, caps, times)
    return make("capped_1f1b", pp, 1, microbatches, range(pp), programs, {"cap": caps})
