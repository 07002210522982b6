"""Looped BFS (breadth-first pipeline parallelism, Lamy-Poirier 2022; PyTorch's
ScheduleLoopedBFS): round-robin virtual stages, every microbatch through a rank's first
chunk before any enters its second, then the backwards chunk by chunk in reverse.

pp=2, v=2, m=2, one cell per unit of time (F = 1, B = 2: the simulator's unit costs times v),
each instruction as soon as it can run:

    rank 0  0F0 0F1 2F0 2F1 .   .   .   2B0   '' 2B1   '' 0B0   '' 0B1   ''
    rank 1  .   1F0 1F1 3F0 3F1 3B0   '' 3B1   '' 1B0   '' 1B1   ''
            warmup: every forward, chunk by chunk    cooldown: every backward

Rank r holds all v*m stage-microbatches at its peak (AFAB's memory over v chunks), in
exchange for the fewest chunk switches. PyTorch runs each chunk's backwards in reverse
microbatch order; here they run in microbatch order, which takes the same time (the
last stage can start either, every other stage's B waits on the one after it, chunk by
chunk) and sums each weight gradient over the microbatches in AFAB's order, so a run
is bitwise equal to AFAB's. Takes no cap: a cap below v*m is no longer breadth-first
(interleaved_1f1b with cap= is the capped form).
"""

from pipeschedule.compiler.generators.common import check_common, make, round_robin
from pipeschedule.compiler.ir import Op, Schedule, make_instr


def looped_bfs(pp: int, microbatches: int, virtual: int = 2) -> Schedule:
    check_common(pp, microbatches, virtual)
    programs = []
    for r in range(pp):
        chunks = [c * pp + r for c in range(virtual)]
        order = [make_instr(Op.F, s, mb) for s in chunks for mb in range(microbatches)]  # warmup
        order += [make_instr(Op.B, s, mb) for s in reversed(chunks) for mb in range(microbatches)]  # cooldown
        programs.append(order)
    return make("looped_bfs", pp, virtual, microbatches, round_robin(pp, virtual), programs)
