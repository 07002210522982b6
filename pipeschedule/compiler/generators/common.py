"""What the generators share: parameter checks, the round-robin placement, 1F1B-style
interleaving of a forward and a backward order.

Every generator returns a `Schedule` whose programs hold compute instructions only
(F, B, W); the lowering passes add communication and FREE. When a compute order can run
is `timing.py`'s business.
"""

from __future__ import annotations

from typing import Sequence

from pipeschedule.errors import ParameterError
from pipeschedule.compiler.ir import Op, Program, Schedule
from pipeschedule.compiler.program import Templates
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


def compute_templates(num_stages: int) -> Templates:
    """A template table holding F and B of every stage, stage by stage: what
    `interleave_1f1b` packs against ([Note: packed programs])."""
    table = Templates()
    for s in range(num_stages):
        table.id(Op.F, s)
        table.id(Op.B, s)
    return table


def interleave_1f1b(forwards: Sequence[Slot], backwards: Sequence[Slot], warmup: int, table: Templates) -> Program:
    """`warmup` forwards, then pairs (F, B), then the remaining backwards, as a `Program`
    over `table` (`compute_templates`).

    The number of forwards before the first backward is warmup + 1 (all of them when
    warmup >= len(forwards)), and that is the rank's peak in-flight count.
    """
    warmup = min(warmup, len(forwards))
    steady = len(forwards) - warmup  # pairs
    columns = []
    for op, slots in ((Op.F, forwards), (Op.B, backwards)):
        stages, mbs = zip(*slots) if slots else ((), ())
        ids = {s: table.id(op, s) for s in set(stages)}
        columns.append((list(map(ids.__getitem__, stages)), list(mbs)))
    order = []
    for f, b in zip(*columns):  # the ids, then the mbs
        pairs = [0] * (2 * steady)
        pairs[0::2], pairs[1::2] = f[warmup:], b[:steady]
        order.append(f[:warmup] + pairs + b[steady:])  # warmup, steady, cooldown
    return table.program(*order)


def round_robin(pp: int, virtual: int = 1) -> list[int]:
    """Rank of each of pp * virtual stages when stage s runs on rank s % pp (chunk c of
    rank r is stage c * pp + r): [0, 1, 0, 1] for pp=2, virtual=2; 0..pp-1 without
    interleaving. nanotron's `build_model(target_pp_ranks=...)` takes the same list."""
    return [s % pp for s in range(pp * virtual)]


def make(name: str, pp: int, virtual: int, microbatches: int, placement, programs, params=None) -> Schedule:
    """The schedule of these programs (each a sequence of `Instr` or a `Program`)."""
    return Schedule(name, pp, virtual, microbatches, tuple(placement), tuple(programs), params or {})
