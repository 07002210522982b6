"""What the generators share: parameter checks, 1F1B-style interleaving of a forward and
a backward order, and a dependency check on compute order.

Every generator returns a `Schedule` whose programs hold compute instructions only
(F, B, W); the lowering passes add communication and FREE.
"""

from __future__ import annotations

from typing import Sequence

from pipeschedule.errors import ParameterError
from pipeschedule.ir import Instr, Op, Schedule, make_instr

Slot = tuple[int, int]  # (stage, mb)


def check_positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ParameterError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def check_common(pp, microbatches, virtual=1) -> None:
    check_positive("pp", pp)
    check_positive("microbatches", microbatches)
    check_positive("virtual", virtual)


def per_rank_caps(cap, pp: int) -> list[int]:
    """A cap as given (one int for all ranks, or one per rank) as a list of pp ints."""
    if isinstance(cap, (list, tuple)):
        if len(cap) != pp:
            raise ParameterError(f"cap list has {len(cap)} entries, but pp = {pp}: give one cap per rank or a single integer")
        for r, c in enumerate(cap):
            check_positive(f"cap[{r}]", c)
        return list(cap)
    check_positive("cap", cap)
    return [cap] * pp


def interleave_1f1b(forwards: Sequence[Slot], backwards: Sequence[Slot], warmup: int) -> list[Instr]:
    """`warmup` forwards, then pairs (F, B), then the remaining backwards.

    The number of forwards before the first backward is warmup + 1 (all of them when
    warmup >= len(forwards)), and that is the rank's peak in-flight count.
    """
    warmup = min(warmup, len(forwards))
    F, B = Op.F, Op.B  # an enum's attribute costs more than a local, per instruction here
    order = [make_instr(F, s, mb) for s, mb in forwards[:warmup]]  # warmup
    b = 0
    for s, mb in forwards[warmup:]:  # steady
        order.append(make_instr(F, s, mb))
        order.append(make_instr(B, *backwards[b]))
        b += 1
    order.extend(make_instr(B, s, mb) for s, mb in backwards[b:])  # cooldown
    return order


UNIT_COST = {Op.F: 1, Op.B: 2, Op.W: 1}  # B is the whole backward
SPLIT_UNIT_COST = {Op.F: 1, Op.B: 1, Op.W: 1}  # the backward's 2 split in B (input) and W (weights)


def unit_cost(programs: Sequence[Sequence[Instr]]) -> dict:
    """The unit costs of a compute order: `SPLIT_UNIT_COST` when it splits the backward
    (its first non-empty program has a W), else `UNIT_COST`."""
    for program in programs:
        if program:
            return SPLIT_UNIT_COST if any(i.op is Op.W for i in program) else UNIT_COST
    return UNIT_COST


def asap(num_stages: int, programs: Sequence[Sequence[Instr]], cost=None):
    """Start time of every compute instruction when each runs as soon as its rank is
    free and its inputs exist, under integer unit costs (`unit_cost(programs)` unless
    `cost` is given); communication takes no time.

    F(s, mb) waits for F(s-1, mb); B(s, mb) for F(s, mb) and B(s+1, mb); W(s, mb) for
    B(s, mb). Returns (starts, stuck): starts[r][k] is the start of rank r's k-th
    instruction (None where it never runs); stuck lists the ranks that cannot finish
    (empty when the compute order is free of dependency cycles).
    """
    F, B = Op.F, Op.B
    if cost is None:
        cost = unit_cost(programs)
    # [Note: asap keys] (stage, mb) is packed into one int, stage * span + mb, with span
    # above every mb in the programs: distinct for every stage >= 0, and cheaper to build
    # and hash than a tuple (this loop runs once per compute instruction). Only the ends
    # of F and B are ever waited for, so only those are kept.
    span = 1 + max((i.mb for program in programs for i in program), default=0)
    f_end: dict[int, int] = {}
    b_end: dict[int, int] = {}
    pcs = [0] * len(programs)
    free_at = [0] * len(programs)
    starts = [[None] * len(p) for p in programs]
    last = num_stages - 1
    cost_f, cost_b, cost_w = cost[Op.F], cost[Op.B], cost[Op.W]
    progress = True
    while progress:
        progress = False
        for r, program in enumerate(programs):
            pc, n, t_free, rank_starts = pcs[r], len(program), free_at[r], starts[r]
            while pc < n:
                i = program[pc]
                op, s = i.op, i.stage
                key = s * span + i.mb
                if op is F:
                    if s == 0:
                        ready = 0
                    else:
                        ready = f_end.get(key - span)  # F(s - 1, mb)
                        if ready is None:
                            break
                    start = ready if ready > t_free else t_free
                    t_free = f_end[key] = start + cost_f
                elif op is B:
                    ready = f_end.get(key)
                    if ready is None:
                        break
                    if s != last:
                        after = b_end.get(key + span)  # B(s + 1, mb)
                        if after is None:
                            break
                        if after > ready:
                            ready = after
                    start = ready if ready > t_free else t_free
                    t_free = b_end[key] = start + cost_b
                else:
                    ready = b_end.get(key)
                    if ready is None:
                        break
                    start = ready if ready > t_free else t_free
                    t_free = start + cost_w
                rank_starts[pc] = start
                pc += 1
            if pc != pcs[r]:
                pcs[r], free_at[r] = pc, t_free
                progress = True
    stuck = [r for r, program in enumerate(programs) if pcs[r] < len(program)]
    return starts, stuck


# [Note: asap memo] Lowering times the compute order with `asap` to place the messages.
# A generator that has already run `asap` on the very programs it returns (interleaved
# does, to find blocked ranks) leaves the result on the schedule, so that lowering does
# not compute it a second time (0.1 s at pp=64, v=2, m=512). A schedule is immutable and
# a new one starts without the memo, so the memo cannot go stale.


def remember_asap(schedule: Schedule, timing) -> Schedule:
    """Keeps `timing`, the result of `asap(schedule.num_stages, schedule.programs)`, on
    `schedule` for `asap_of`; returns the schedule."""
    object.__setattr__(schedule, "_asap", timing)
    return schedule


def asap_of(schedule: Schedule):
    """`asap(schedule.num_stages, schedule.programs)`, taken from the memo where a
    generator left one ([Note: asap memo]). The caller must not modify it."""
    timing = schedule.__dict__.get("_asap")
    if timing is None:
        timing = asap(schedule.num_stages, schedule.programs)
    return timing


def stuck_ranks(num_stages: int, programs: Sequence[Sequence[Instr]]) -> list[int]:
    """Ranks that cannot finish when compute order alone is followed (see `asap`)."""
    return asap(num_stages, programs)[1]


def make(name: str, pp: int, virtual: int, microbatches: int, placement, programs, params=None) -> Schedule:
    return Schedule(name, pp, virtual, microbatches, tuple(placement), tuple(tuple(p) for p in programs), params or {})
