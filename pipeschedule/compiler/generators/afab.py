"""All forwards, then all backwards (GPipe; nanotron's AFAB).

    rank 0  F0 F1 F2 F3 .. .. .. .. .. .. B0 B0 B1 B1 B2 B2 B3 B3
    rank 1  .. F0 F1 F2 F3 .. .. B0 B0 B1 B1 B2 B2 B3 B3
    ...
Every rank holds all m microbatches in flight at its peak.
"""

from pipeschedule.compiler.generators.common import check_common, make
from pipeschedule.compiler.ir import Op, Schedule, make_instr


def afab(pp: int, microbatches: int) -> Schedule:
    check_common(pp, microbatches)
    programs = []
    for r in range(pp):
        order = [make_instr(Op.F, r, mb) for mb in range(microbatches)]  # warmup: every forward
        order += [make_instr(Op.B, r, mb) for mb in range(microbatches)]  # cooldown: every backward
        programs.append(order)
    return make("afab", pp, 1, microbatches, range(pp), programs)
