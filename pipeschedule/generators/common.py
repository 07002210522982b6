"""What the generators share: parameter checks, 1F1B-style interleaving of a forward and
a backward order, and a dependency check on compute order.

Every generator returns a `Schedule` whose programs hold compute instructions only
(F, B, W); the lowering passes add communication and FREE.
"""

from __future__ import annotations

from typing import Sequence

from pipeschedule.errors import ParameterError
from pipeschedule.ir import Instr, Op, Schedule

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
    order = [Instr(Op.F, s, mb) for s, mb in forwards[:warmup]]  # warmup
    b = 0
    for s, mb in forwards[warmup:]:  # steady
        order.append(Instr(Op.F, s, mb))
        order.append(Instr(Op.B, *backwards[b]))
        b += 1
    order.extend(Instr(Op.B, s, mb) for s, mb in backwards[b:])  # cooldown
    return order


def stuck_ranks(num_stages: int, programs: Sequence[Sequence[Instr]]) -> list[int]:
    """Ranks that cannot finish when compute order alone is followed.

    F(s, mb) waits for F(s-1, mb); B(s, mb) for F(s, mb) and B(s+1, mb); W(s, mb) for
    B(s, mb). Communication is ignored (the verifier checks it after lowering); an empty
    list means the compute order is free of dependency cycles.
    """
    done: set[tuple[Op, int, int]] = set()
    pcs = [0] * len(programs)
    last = num_stages - 1

    def ready(i: Instr) -> bool:
        if i.op is Op.F:
            return i.stage == 0 or (Op.F, i.stage - 1, i.mb) in done
        if i.op is Op.B:
            return (Op.F, i.stage, i.mb) in done and (i.stage == last or (Op.B, i.stage + 1, i.mb) in done)
        return (Op.B, i.stage, i.mb) in done

    progress = True
    while progress:
        progress = False
        for r, program in enumerate(programs):
            pc = pcs[r]
            while pc < len(program) and ready(program[pc]):
                done.add((program[pc].op, program[pc].stage, program[pc].mb))
                pc += 1
            if pc != pcs[r]:
                pcs[r] = pc
                progress = True
    return [r for r, program in enumerate(programs) if pcs[r] < len(program)]


def make(name: str, pp: int, virtual: int, microbatches: int, placement, programs, params=None) -> Schedule:
    return Schedule(name, pp, virtual, microbatches, tuple(placement), tuple(tuple(p) for p in programs), params or {})
