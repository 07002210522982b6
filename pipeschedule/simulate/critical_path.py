"""The critical path of a simulated step, as a lower bound valid for every cost model.

[Note: critical path bound] Under the simulator's semantics ([Note: simulated semantics]
in engine.py) every instruction's end is a max over fixed predecessors plus its own cost:
the previous instruction on its rank, and for a message the partner's batch post. Which
instruction precedes which depends on program order and on send/receive
matching only, never on costs. So a chain found by walking back from the last instruction
to finish (each step taking the predecessor that set the start time) is a path of a fixed
graph: its length under ANY other compute costs, with the same message times, is a lower
bound on that cost model's step time, and equal to it under the costs it was found with.
`partition.optimal_split` collects such chains as cutting planes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from pipeschedule.compiler.effects import EFFECTS
from pipeschedule.compiler.ir import COMM_OPS, RECV_OPS, SEND_OPS, Schedule
from pipeschedule.compiler.program import instructions

# Ops that take no time on their rank, which a chain steps over: FREE (instant), OFFLOAD and
# RELOAD (copies; a compute that waits for one is not modelled here), an op with no time.
_TIMELESS = frozenset(op for op, row in EFFECTS.items() if not row.message and row.time is None)


@dataclass(frozen=True)
class CriticalPath:
    """How many F, B and W of each stage a longest chain holds, and its message time."""

    forward: tuple[int, ...]
    backward: tuple[int, ...]
    weight: tuple[int, ...]
    messages: float

    def length(self, forward: Sequence[float], backward: Sequence[float], weight: Sequence[float]) -> float:
        """The chain's length under per-stage costs: a lower bound on that step time."""
        total = self.messages
        for counts, costs in ((self.forward, forward), (self.backward, backward), (self.weight, weight)):
            total += sum(n * c for n, c in zip(counts, costs) if n)
        return total


def message_partners(schedule: Schedule) -> dict[tuple[int, int], tuple[int, int]]:
    """(rank, pc) of each send or receive -> (rank, pc) of its partner (k-th send on a
    channel meets the k-th receive)."""
    sends: dict[tuple[int, int], list] = defaultdict(list)
    recvs: dict[tuple[int, int], list] = defaultdict(list)
    for r, program in enumerate(schedule.programs):
        for pc, instr in enumerate(program):
            if instr.op in SEND_OPS:
                sends[r, instr.peer].append((r, pc))
            elif instr.op in RECV_OPS:
                recvs[instr.peer, r].append((r, pc))
    partner = {}
    for channel, ops in sends.items():
        for a, b in zip(ops, recvs.get(channel, ())):
            partner[a] = b
            partner[b] = a
    return partner


def _batch_starts(program) -> list[int]:
    """For each pc, the first pc of the maximal run of communication ops holding it."""
    first, start = [], None
    for pc, instr in enumerate(program):
        if instr.op in COMM_OPS:
            if start is None:
                start = pc
            first.append(start)
        else:
            start = None
            first.append(pc)
    return first


_STRUCTURE: dict = {}  # id(schedule) -> (schedule, batch starts, matching); a schedule is immutable


def _structure(schedule: Schedule):
    entry = _STRUCTURE.get(id(schedule))
    if entry is None or entry[0] is not schedule:
        if len(_STRUCTURE) > 64:
            _STRUCTURE.clear()
        entry = (schedule, [_batch_starts(p) for p in schedule.programs], message_partners(schedule))
        _STRUCTURE[id(schedule)] = entry
    return entry[1], entry[2]


def critical_path(schedule: Schedule, result, cost) -> CriticalPath:
    """Walk back from the rank that finishes last ([Note: critical path bound]).

    `result` is `simulate(schedule, cost)`; `cost` supplies message times (latency,
    bandwidth, act_out / grad_in bytes).
    """
    programs, stages = [instructions(p) for p in schedule.programs], schedule.num_stages
    times = [result.events.times(r) for r in range(schedule.pp)]
    first, partner = _structure(schedule)
    counts = {"forward": [0] * stages, "backward": [0] * stages, "weight": [0] * stages}  # by a compute's `time`

    def message(instr) -> float:
        size = cost.buffer_bytes[EFFECTS[instr.op].buffer][instr.stage]
        return cost.latency + (size / cost.bandwidth if cost.bandwidth != float("inf") else 0)

    # A send's event lasts until its message completes, but the rank does not wait for it
    # ([Note: simulated semantics]): only the other instructions' ends are the rank's.
    finish = [max((end for instr, end in zip(program, ends) if instr.op not in SEND_OPS), default=0)
              for program, (_, ends) in zip(programs, times)]
    r = max(range(schedule.pp), key=lambda k: finish[k])
    i = len(programs[r])
    messages = 0.0
    while True:
        j = i - 1
        while j >= 0 and programs[r][j].op in _TIMELESS:
            j -= 1
        if j < 0:
            break
        instr = programs[r][j]
        if instr.op not in COMM_OPS:
            counts[EFFECTS[instr.op].time][instr.stage] += 1
            i = j
            continue
        starts, ends = times[r]
        f = first[r][j]
        post = starts[f]
        receives = [pc for pc in range(f, j + 1) if programs[r][pc].op in RECV_OPS]  # what the batch waits for
        k = max(receives, key=lambda pc: ends[pc], default=None)
        if k is None or ends[k] <= post:  # every message was in before the batch was posted
            i = f
            continue
        p, q = partner[r, k]
        messages += message(programs[p][q])
        if post >= times[p][0][q]:
            i = f
        else:
            r, i = p, first[p][q]
    return CriticalPath(tuple(counts["forward"]), tuple(counts["backward"]), tuple(counts["weight"]), messages)


__all__ = ["CriticalPath", "critical_path", "message_partners"]
