"""What the generators share: parameter checks, the round-robin placement, 1F1B-style
interleaving of a forward and a backward order.

Every generator returns a `Schedule` whose programs hold compute instructions only
(F, B, W); the lowering passes add communication and FREE. When a compute order can run
is `timing.py`'s business.
"""

from __future__ import annotations

from typing import Sequence

from pipeschedule.errors import ParameterError
from pipeschedule.compiler.ir import Instr, Op, Schedule, make_instr
from pipeschedule.checks import check_int, check_schedule_size

Slot = tuple[int, int]  # (stage, mb)


def check_common(pp, microbatches, virtual=1) -> None:
    """The counts every generator takes, checked before any work: integers >= 1, and
    within [Note: size limits] together."""
    check_int("pp", pp)
    check_int("microbatches", microbatches)
    check_int("virtual", virtual)
    check_schedule_size(pp, virtual, microbatches)


def per_rank_caps(cap, pp: int) -> list[int]:
    """A cap as given (one int for all ranks, or one per rank) as a list of pp ints."""
    if isinstance(cap, (list, tuple)):
        if len(cap) != pp:
            raise ParameterError(f"cap list has {len(cap)} entries, but pp = {pp}: "
                                 "give one cap per rank or a single integer")
        for r, c in enumerate(cap):
            check_int(f"cap[{r}]", c)
        return list(cap)
    check_int("cap", cap)
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


def round_robin(pp: int, virtual: int = 1) -> list[int]:
    """Rank of each of pp * virtual stages when stage s runs on rank s % pp (chunk c of
    rank r is stage c * pp + r): [0, 1, 0, 1] for pp=2, virtual=2; 0..pp-1 without
    interleaving. nanotron's `build_model(target_pp_ranks=...)` takes the same list."""
    return [s % pp for s in range(pp * virtual)]


def make(name: str, pp: int, virtual: int, microbatches: int, placement, programs, params=None) -> Schedule:
    return Schedule(name, pp, virtual, microbatches, tuple(placement), tuple(tuple(p) for p in programs), params or {})
