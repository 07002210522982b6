"""Lowering: compute order -> + SEND/RECV -> + FREE.

Each pass is a pure function `(schedule, *, cost=None) -> Schedule` of its arguments
alone; `PASSES` lists them in order and `lower` applies them. `cost` is what the compute
order is timed with (None: unit costs; a `CostModel` or one (F, B, W) tuple per stage,
as `generate` takes it: [Note: cost-aware timing]); only `add_communication` reads it.
Every pass keeps the relative order of the instructions it is given and only inserts
new ones.
"""

from __future__ import annotations

from bisect import bisect_left

from pipeschedule.errors import ScheduleError
from pipeschedule.compiler.gcpause import gc_paused
from pipeschedule.compiler.timing import asap, durations_of, stage_times
from pipeschedule.compiler.ir import COMPUTE_OPS, Instr, Op, Schedule, make_instr

F, B, W, FREE = Op.F, Op.B, Op.W, Op.FREE
SEND_F, RECV_F, SEND_B, RECV_B = Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B


# [Note: message placement] The compute order is first timed as soon as possible
# (`asap`, under unit costs or `cost`: [Note: cost-aware timing] in timing.py). A message
# is sent right after its producer, so the sender never waits to send. It is received
# right before the receiver's first compute that starts no earlier than min(the sender's
# next compute, the consumer): as late as possible (so its buffer lives no longer than
# needed; in 1F1B this is Megatron's pairing, a forward send travelling with the next
# backward receive and a backward send with the next forward receive), yet early enough
# for rule 4. By induction on start times: when a rank reaches the batch before a
# compute starting at t, each partner of the batch is either a send right after a
# compute that started before t, or a receive before a compute whose predecessor
# started before the sender's next compute, and so before t; its rank has run that far
# and posted it, so no batch waits forever. (Receiving right before the consumer alone
# can deadlock interleaved schedules: the sender's batch then waits for a consumer that
# waits for the sender.) Between two ranks, receives keep the order of the sends
# (rule 3): a receive that would come after a later message's receive is moved up to
# it, and within one gap messages go in the order they were produced.


def add_communication(schedule: Schedule, *, cost=None) -> Schedule:
    """Adds SEND_F right after each F whose output leaves the rank, SEND_B right after
    each B whose input gradient leaves it, and the matching RECV_F / RECV_B early enough
    ([Note: message placement]). Input: compute only. Output: compute + communication,
    deadlock-free under rule 4 whenever the compute order itself is free of cycles.

    gaps[r][pc] holds the messages that go right before rank r's pc-th compute (pc ==
    len: after the last one), each as (production time, sender rank, sender pc, kind,
    instr), kind 0 for the send and 1 for the receive. Sorting a gap orders its messages
    by when they were produced; (time, rank, pc, kind) never ties (a producer sends one
    message), so the sort never compares instructions."""
    starts, times = _timed(schedule, cost)
    gaps = _gaps(schedule, starts, times)
    return schedule._with_trusted_programs(tuple(tuple(_merged(p, g)) for p, g in zip(schedule.programs, gaps)))


def _timed(schedule: Schedule, cost):
    """`asap` of the compute order under `cost` ([Note: cost-aware timing]) and the
    per-stage times it used; raises ScheduleError (rule deadlock) for a cyclic order."""
    times = stage_times(cost, schedule.num_stages)  # None for None: unit costs
    starts, stuck = asap(schedule.num_stages, schedule.programs, times)
    if stuck:
        rank = stuck[0]
        pc = starts[rank].index(None)
        instr = schedule.programs[rank][pc]
        raise ScheduleError(
            f"rule deadlock: the compute order cannot finish: ranks {stuck} wait on each other "
            f"(rank {rank} is blocked at step {pc}, {instr})",
            rule="deadlock", rank=rank, index=pc, instr=instr, mb=instr.mb,
        )
    return starts, times


def _gaps(schedule: Schedule, starts, times) -> list:
    """gaps[r][pc] of `add_communication`: every message in the gap it goes in."""
    gaps = [[None] * (len(program) + 1) for program in schedule.programs]
    channels = _send_and_due(schedule, starts, durations_of(schedule.programs, schedule.num_stages, times), gaps)
    for channel, (dues, receives) in channels.items():
        dst_gaps = gaps[channel % schedule.pp]
        at = len(dst_gaps)  # NCCL matches by order: a receive never goes after a later message's receive
        for due, entry in zip(reversed(dues), reversed(receives)):
            if due < at:
                at = due
            if dst_gaps[at] is None:
                dst_gaps[at] = [entry]
            else:
                dst_gaps[at].append(entry)
    return gaps


def _send_and_due(schedule: Schedule, starts, durations, gaps) -> dict:
    """Puts each send in the gap right after its producer and returns, per channel
    (src * pp + dst), the gap each receive is due in ([Note: message placement]) and the
    receive's gap entry, in send order."""
    pp = schedule.pp
    forward, backward = _message_kinds(schedule, durations)
    channels: dict[int, tuple[list[int], list[tuple]]] = {}
    for rank, program in enumerate(schedule.programs):
        rank_starts, rank_gaps = starts[rank], gaps[rank]
        rank_starts.append(float("inf"))  # the sender's next compute after its last
        to = [None] * pp  # this rank's channels, by the rank they go to
        for pc, i in enumerate(program):
            op = i.op
            kind = forward[i.stage] if op is F else backward[i.stage] if op is B else None
            if kind is None:
                continue
            c_rank, c_pcs, cost, send_op, recv_op, recv_stage = kind
            mb = i.mb
            c_pc = c_pcs[mb]
            produced = rank_starts[pc] + cost  # the message exists from its producer's end
            rank_gaps[pc + 1] = [(produced, rank, pc, 0, make_instr(send_op, i.stage, mb, c_rank))]  # its first entry
            # due: the consumer rank's first compute that starts no earlier than
            # min(sender's next, consumer's start); starts on a rank never decrease.
            c_starts = starts[c_rank]
            due = c_starts[c_pc]
            if rank_starts[pc + 1] < due:
                due = rank_starts[pc + 1]
            channel = to[c_rank]
            if channel is None:
                channel = to[c_rank] = channels[rank * pp + c_rank] = ([], [])
            channel[0].append(bisect_left(c_starts, due, 0, c_pc))
            channel[1].append((produced, rank, pc, 1, make_instr(recv_op, recv_stage, mb, rank)))
    return channels


def _message_kinds(schedule: Schedule, durations) -> tuple[list, list]:
    """Per stage, the message its F (first list) or its B (second) sends, None where the
    neighbour stage runs on the same rank: (the consumer's rank, the consumer's pc by mb
    (`_consumer_pcs`), the producer's duration, the send's op, the receive's op, the
    receive's stage)."""
    placement, stages = schedule.placement, schedule.num_stages
    sends_fwd = [schedule.sends_forward(s) for s in range(stages)]
    sends_bwd = [schedule.sends_backward(s) for s in range(stages)]
    f_pc, b_pc = _consumer_pcs(schedule, sends_fwd, sends_bwd)
    forward = [(placement[s + 1], f_pc[s + 1], durations.forward[s], SEND_F, RECV_F, s + 1) if sends_fwd[s] else None
               for s in range(stages)]
    backward = [(placement[s - 1], b_pc[s - 1], durations.backward[s], SEND_B, RECV_B, s - 1) if sends_bwd[s]
                else None for s in range(stages)]
    return forward, backward


def _consumer_pcs(schedule: Schedule, sends_fwd, sends_bwd) -> tuple[list, list]:
    """f_pc[s][mb] / b_pc[s][mb]: the pc of F(s, mb) / B(s, mb) on its rank, for the
    stages whose F / B consume a message (None for the others)."""
    m, stages = schedule.microbatches, schedule.num_stages
    f_pc = [[0] * m if s and sends_fwd[s - 1] else None for s in range(stages)]
    b_pc = [[0] * m if s + 1 < stages and sends_bwd[s + 1] else None for s in range(stages)]
    for program in schedule.programs:
        for pc, i in enumerate(program):
            op = i.op
            row = f_pc[i.stage] if op is F else b_pc[i.stage] if op is B else None
            if row is not None:
                row[i.mb] = pc
    return f_pc, b_pc


def _merged(program, rank_gaps):
    """One rank's compute order with each gap's messages, in production order, before
    the compute they precede (an iterator)."""
    n = len(program)
    for pc, gap in enumerate(rank_gaps):
        if gap is not None:
            if len(gap) > 1:
                gap.sort()
            for entry in gap:
                yield entry[4]
        if pc < n:
            yield program[pc]


def add_frees(schedule: Schedule, *, cost=None) -> Schedule:
    """Adds one FREE per buffer right after its last use. When the last use is a
    communication instruction, the FREE goes after the whole run of communication it
    belongs to: that run is posted as one batch and completes as one, and a FREE inside
    it would split it. Input: compute + communication. Output: the full program.
    Where a FREE goes depends on program order alone, so `cost` is not read.

    In a forward-only schedule F is the last use of its act_in and of its stash (nothing
    is kept for a backward), so both are freed right after it; a local hand-off's act_in
    of the next stage goes after that stage's F, and act_out after its SEND_F's run, as
    in training.
    """
    programs = tuple(_lowered(schedule, *_gapped(program)) for program in schedule.programs)
    return schedule._with_trusted_programs(programs)


def _gapped(program) -> tuple[list, list]:
    """A compute + communication program as `_lowered` takes it: its other instructions
    in order, and the gap before each of them (and after the last): the run of
    communication there, each as a gap entry (program index, 0, 0, kind, instr) in
    program order, or None."""
    others: list[Instr] = []
    gaps: list = []
    gap = None
    for index, i in enumerate(program):
        op = i.op
        if op is SEND_F or op is SEND_B or op is RECV_F or op is RECV_B:
            if gap is None:
                gap = []
            gap.append((index, 0, 0, 0 if op is SEND_F or op is SEND_B else 1, i))
        else:
            others.append(i)
            gaps.append(gap)
            gap = None
    gaps.append(gap)
    return others, gaps


PASSES = (add_communication, add_frees)


@gc_paused
def forward_only(schedule: Schedule, *, cost=None) -> Schedule:
    """The evaluation form of a schedule: each rank's F in the order it has them, lowered
    as a forward-only schedule (`forward_only=True`): SEND_F / RECV_F placed by
    `add_communication` ([Note: message placement], timed with `cost`), act_in and stash
    freed right after each F, act_out after its send (`add_frees`).
    Input: any schedule (compute order or lowered; its B, W, gradient messages, FREE,
    OFFLOAD and RELOAD are dropped). Output: a lowered forward-only schedule.
    Preserved: each rank's order of F, the placement, name and params.

    The messages are placed anew rather than kept from a lowered input: dropping the
    backward half of a lowered program joins runs of communication that B kept apart,
    and a joined batch can wait on a partner that waits on it (rule 4); placing them on
    the forward order alone keeps the proof of [Note: message placement], whose only
    premise, an acyclic compute order, holds for any part of an acyclic one."""
    forwards = tuple(tuple(i for i in program if i.op is F) for program in schedule.programs)
    order = Schedule(schedule.name, schedule.pp, schedule.virtual, schedule.microbatches, schedule.placement,
                     forwards, dict(schedule.params), forward_only=True)
    return lower(order, cost)


def is_lowered(schedule: Schedule) -> bool:
    """False for a compute order only: no communication and no FREE anywhere."""
    return any(i.op not in COMPUTE_OPS for program in schedule.programs for i in program)


@gc_paused
def lower(schedule: Schedule, cost=None) -> Schedule:
    """Applies the passes of `PASSES` in order to a compute-only schedule, the order timed
    with `cost` (None: unit costs). A function of its arguments alone: equal schedules
    lower to equal programs. Give the cost the order was generated with
    (`generate(..., cost=c)`) to place the messages as `compile_schedule(..., cost=c)` does."""
    # add_frees(add_communication(schedule, cost=cost)), the passes of PASSES, with each
    # rank's merged order and its frees made in one loop (`_lowered`) rather than built
    # as a program of its own. Pinned to PASSES by tests/compiler/test_lowering_pure.py.
    starts, times = _timed(schedule, cost)
    gaps = _gaps(schedule, starts, times)
    return schedule._with_trusted_programs(tuple(_lowered(schedule, p, g) for p, g in zip(schedule.programs, gaps)))


def _lowered(schedule: Schedule, program, rank_gaps) -> tuple:
    """One rank's lowered program: `program` (its instructions other than communication)
    with each gap's messages, in production order, before the instruction they precede
    (`_merged`), and add_frees' FREEs. A run of communication is exactly one gap (the
    program's instructions stand between gaps), so the frees of a gap's sends go right
    after the gap, and only the program's own instructions need their op looked at."""
    split = schedule.split_backward
    forward_only = schedule.forward_only
    last = schedule.num_stages - 1
    out: list[Instr] = []
    append = out.append
    n = len(program)
    for pc, gap in enumerate(rank_gaps):
        if gap is not None:
            if len(gap) > 1:
                gap.sort()
            pending = []
            for entry in gap:
                i = entry[4]
                append(i)
                if not entry[3]:  # a send: its buffer is freed after the run
                    pending.append(make_instr(FREE, i.stage, i.mb, None, "act_out" if i.op is SEND_F else "grad_in"))
            out += pending
        if pc == n:
            break
        i = program[pc]
        append(i)
        op = i.op
        if op is F:
            if forward_only:
                append(make_instr(FREE, i.stage, i.mb, None, "act_in"))
                append(make_instr(FREE, i.stage, i.mb, None, "stash"))
        elif op is B:
            stage, mb = i.stage, i.mb
            append(make_instr(FREE, stage, mb, None, "act_in"))
            if not split:  # else W frees the stash
                append(make_instr(FREE, stage, mb, None, "stash"))
            if stage < last:
                append(make_instr(FREE, stage, mb, None, "grad_out"))
        elif op is W:
            append(make_instr(FREE, i.stage, i.mb, None, "stash"))
    return tuple(out)
