"""Lowering: compute order -> + SEND/RECV -> + FREE.

Each pass is a pure function `Schedule -> Schedule`; `PASSES` lists them in order and
`lower` applies them. Every pass keeps the relative order of the instructions it is
given and only inserts new ones.
"""

from __future__ import annotations

from pipeschedule.gcpause import gc_paused

from bisect import bisect_left
from collections import defaultdict

from pipeschedule.errors import ScheduleError
from pipeschedule.generators.common import UNIT_COST, asap
from pipeschedule.ir import Instr, Op, Schedule, make_instr

F, B, W, FREE = Op.F, Op.B, Op.W, Op.FREE
SEND_F, RECV_F, SEND_B, RECV_B = Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B


def add_communication(schedule: Schedule) -> Schedule:
    """Adds SEND_F right after each F whose output leaves the rank, SEND_B right after
    each B whose input gradient leaves it, and the matching RECV_F / RECV_B early enough.
    Input: compute only. Output: compute + communication, deadlock-free under rule 4
    whenever the compute order itself is free of cycles.

    [Note: message placement] The compute order is first timed as soon as possible
    (`asap`, unit costs). A message is sent right after its producer, so the sender never
    waits to send. It is received right before the receiver's first compute that starts
    no earlier than min(the sender's next compute, the consumer): as late as possible
    (so its buffer lives no longer than needed; in 1F1B this is Megatron's pairing, a
    forward send travelling with the next backward receive and a backward send with the
    next forward receive), yet early enough for rule 4. By induction on start times:
    when a rank reaches the batch before a compute starting at t, each partner of the
    batch is either a send right after a compute that started before t, or a receive
    before a compute whose predecessor started before the sender's next compute, and so
    before t; its rank has run that far and posted it, so no batch waits forever.
    (Receiving right before the consumer alone can deadlock interleaved schedules: the
    sender's batch then waits for a consumer that waits for the sender.) Between two
    ranks, receives keep the order of the sends (rule 3): a receive that would come after
    a later message's receive is moved up to it, and within one gap messages go in the
    order they were produced.
    """
    starts, stuck = asap(schedule.num_stages, schedule.programs)
    if stuck:
        rank = stuck[0]
        pc = starts[rank].index(None)
        raise ScheduleError(
            f"rule deadlock: the compute order cannot finish: ranks {stuck} wait on each other "
            f"(rank {rank} is blocked at step {pc}, {schedule.programs[rank][pc]})",
            rule="deadlock", rank=rank, index=pc, instr=schedule.programs[rank][pc],
            mb=schedule.programs[rank][pc].mb,
        )
    placement = schedule.placement
    # gaps[r][pc]: the messages that go right before rank r's pc-th compute (pc == len:
    # after the last one), each as (production time, sender rank, sender pc, instr).
    gaps = [[None] * (len(program) + 1) for program in schedule.programs]
    position = {}  # (op, stage, mb) -> (rank, pc) of every compute
    for rank, program in enumerate(schedule.programs):
        for pc, i in enumerate(program):
            position[i.op, i.stage, i.mb] = (rank, pc)
    sends_forward = [schedule.sends_forward(s) for s in range(schedule.num_stages)]
    sends_backward = [schedule.sends_backward(s) for s in range(schedule.num_stages)]
    channels: dict[tuple[int, int], list] = defaultdict(list)  # (src, dst) -> receives, in send order
    inf = float("inf")
    for rank, program in enumerate(schedule.programs):
        rank_starts, rank_gaps = starts[rank], gaps[rank]
        for pc, i in enumerate(program):
            op, stage, mb = i.op, i.stage, i.mb
            if op is F and sends_forward[stage]:
                recv = make_instr(RECV_F, stage + 1, mb, rank)
                send = make_instr(SEND_F, stage, mb, placement[stage + 1])
                c_rank, c_pc = position[F, stage + 1, mb]
            elif op is B and sends_backward[stage]:
                recv = make_instr(RECV_B, stage - 1, mb, rank)
                send = make_instr(SEND_B, stage, mb, placement[stage - 1])
                c_rank, c_pc = position[B, stage - 1, mb]
            else:
                continue
            entry = (rank_starts[pc] + UNIT_COST[op], rank, pc, send)  # exists from its producer's end
            _put(rank_gaps, pc + 1, entry)
            sender_next = rank_starts[pc + 1] if pc + 1 < len(program) else inf
            due = min(sender_next, starts[c_rank][c_pc])
            channels[rank, c_rank].append([bisect_left(starts[c_rank], due), entry[:3] + (recv,)])
    for (_, dst), recvs in channels.items():
        # NCCL matches by order: a receive never goes after a later message's receive.
        for k in range(len(recvs) - 2, -1, -1):
            recvs[k][0] = min(recvs[k][0], recvs[k + 1][0])
        for at, entry in recvs:
            _put(gaps[dst], at, entry)
    programs = []
    for program, rank_gaps in zip(schedule.programs, gaps):
        out: list[Instr] = []
        for pc, gap in enumerate(rank_gaps):
            if gap is not None:
                if len(gap) > 1:
                    gap.sort(key=_gap_order)
                out.extend(entry[3] for entry in gap)
            if pc < len(program):
                out.append(program[pc])
        programs.append(out)
    return schedule.replace_programs(programs)


def _put(gaps: list, at: int, entry) -> None:
    if gaps[at] is None:
        gaps[at] = [entry]
    else:
        gaps[at].append(entry)


def _gap_order(entry):
    return entry[:3]


def add_frees(schedule: Schedule) -> Schedule:
    """Adds one FREE per buffer right after its last use. When the last use is a
    communication instruction, the FREE goes after the whole run of communication it
    belongs to: that run is posted as one batch and completes as one, and a FREE inside
    it would split it. Input: compute + communication. Output: the full program.
    """
    split = schedule.split_backward
    last = schedule.num_stages - 1
    after_b = ("act_in",) if split else ("act_in", "stash")
    programs = []
    for program in schedule.programs:
        out: list[Instr] = []
        append = out.append
        pending: list[Instr] = []  # frees waiting for the current comm run to end
        for i in program:
            op = i.op
            if pending and op is not SEND_F and op is not SEND_B and op is not RECV_F and op is not RECV_B:
                out.extend(pending)
                pending = []
            append(i)
            if op is B:
                for buf in after_b:
                    append(make_instr(FREE, i.stage, i.mb, None, buf))
                if i.stage < last:
                    append(make_instr(FREE, i.stage, i.mb, None, "grad_out"))
            elif op is W:
                append(make_instr(FREE, i.stage, i.mb, None, "stash"))
            elif op is SEND_F:
                pending.append(make_instr(FREE, i.stage, i.mb, None, "act_out"))
            elif op is SEND_B:
                pending.append(make_instr(FREE, i.stage, i.mb, None, "grad_in"))
        out.extend(pending)
        programs.append(out)
    return schedule.replace_programs(programs)


PASSES = (add_communication, add_frees)


@gc_paused
def lower(schedule: Schedule) -> Schedule:
    """Applies every pass of `PASSES` in order to a compute-only schedule."""
    for lowering_pass in PASSES:
        schedule = lowering_pass(schedule)
    return schedule
