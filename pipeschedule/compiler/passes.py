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
from pipeschedule.compiler.timing import asap_packed, durations_of, stage_times
from pipeschedule.compiler.effects import (
    EFFECTS, HANDED, LOADER, SEND, SEND_OPS, SIDE, covered_ops, first_reader, keys_of, last_readers, received_by,
)
from pipeschedule.compiler.ir import COMM_OPS, COMPUTE_OPS, Op, Schedule, edge_end
from pipeschedule.compiler.program import Program, Template, Templates, packed

FREE = Op.FREE


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
#
# On a stage graph ([Note: stage graph] in graph.py) a compute may send several
# messages, one per edge to another rank: F(s) one per remote consumer, B(t) one per
# remote producer. Each is placed as above; nothing in the argument needs one message
# per compute. A compute's messages keep the order of its edges (increasing stage at the
# other end) in its sends, in the channel's message order and in every receiving gap,
# so that the k-th send on a channel still meets the k-th receive.


def add_communication(schedule: Schedule, *, cost=None) -> Schedule:
    """Adds SEND_F right after each F whose output leaves the rank, SEND_B right after
    each B whose input gradient leaves it, and the matching RECV_F / RECV_B early enough
    ([Note: message placement]). Input: compute only. Output: compute + communication,
    deadlock-free under rule 4 whenever the compute order itself is free of cycles, as
    `Program`s ([Note: packed programs]).

    gaps[r][pc] holds the messages that go right before rank r's pc-th compute (pc ==
    len: after the last one), each as an entry (production time, sender rank, sender pc,
    the message's place among its producer's, template id, mb, the template id of the
    FREE after a send's run, None for a receive and for every message here, where no
    FREEs are added). Sorting a gap orders its messages by when they were produced;
    (time, rank, pc, place) never ties (a producer's messages have distinct places), so
    the sort never looks further."""
    lowering = _Lowering(schedule, frees=False)
    gaps = lowering.place(cost)
    return lowering.done(map(lowering.merged, lowering.ids, lowering.mbs, gaps))


def _timed(schedule: Schedule, cost, columns):
    """`asap` of the compute order (`columns`: its `packed` form) under `cost` ([Note:
    cost-aware timing]) and the per-stage durations it used; raises ScheduleError (rule
    deadlock) for a cyclic order."""
    times = stage_times(cost, schedule.num_stages)  # None for None: unit costs
    durations = durations_of(schedule.programs, schedule.num_stages, times)
    starts, stuck = asap_packed(schedule.num_stages, *columns, durations, schedule.graph)
    if stuck:
        rank = stuck[0]
        pc = starts[rank].index(None)
        instr = schedule.programs[rank][pc]
        raise ScheduleError(
            f"rule deadlock: the compute order cannot finish: ranks {stuck} wait on each other "
            f"(rank {rank} is blocked at step {pc}, {instr})",
            rule="deadlock", rank=rank, index=pc, instr=instr, mb=instr.mb,
        )
    return starts, durations


class _Lowering:
    """What the passes share while lowering one schedule: its programs as columns over
    one template table ([Note: packed programs]), which gains the templates of the
    messages and FREEs the passes add, and, per template, the FREEs that follow it
    (`after`) and, for a send, the FREE after its run (`send_free`)."""

    def __init__(self, schedule: Schedule, *, frees: bool) -> None:
        self.schedule = schedule
        self.order = templates, self.ids, self.mbs = packed(schedule.programs)  # the compute order's columns
        self.table = Templates(templates)
        self.after: list = [()] * len(templates)  # template id -> ids of the FREEs right after it
        self.send_free: dict[int, int] = {}  # a send's template id -> its FREE's (that of its edge's buffer)
        self.frees = frees
        if frees:
            self.last = last_readers(schedule)  # per buffer kind a compute reads, the last that reads it
            for k, t in enumerate(templates):
                self.after[k] = self._frees_after(t)

    def _frees_after(self, t: Template) -> tuple[int, ...]:
        """add_frees' FREEs right after an instruction of template `t` (none after
        communication: those go after its run): each buffer it reads that no later compute
        of the order reads (B: act_in, grad_out, and the stash unless W follows; W: the
        stash; F of a forward-only schedule: act_in), then each it makes that nothing reads
        (F of a forward-only schedule: the stash), from its row ([Note: instruction
        effects] in effects.py). A send's buffer goes after the send's run."""
        schedule, free = self.schedule, self.table.id
        row = EFFECTS[t.op]
        if t.stage >= schedule.num_stages:  # a template no program uses
            return ()
        if row.kind == SEND:
            self.send_free[self.table.id(*t)] = free(FREE, t.stage, None, row.buffer, t.peer_stage)
            return ()
        if row.kind != "compute":
            return ()
        keys = keys_of(schedule, t.op, t.stage)
        out = [free(FREE, s, None, kind, other) for kind, s, other in keys.reads if self.last.get(kind) is t.op]
        unread = [role for role in row.makes if role not in HANDED and role != LOADER and role not in self.last]
        if unread:
            out += [free(FREE, s, None, kind, other) for kind, s, other in keys.makes if kind in unread]
        return tuple(out)

    def place(self, cost) -> list:
        """gaps[r][pc] of `add_communication` for the compute order: every message in the
        gap it goes in ([Note: message placement])."""
        schedule = self.schedule
        starts, durations = _timed(schedule, cost, self.order)
        gaps = [[None] * (len(ids) + 1) for ids in self.ids]
        channels = self._send_and_due(starts, self._message_kinds(durations), gaps)
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

    def _send_and_due(self, starts, kinds: list, gaps) -> dict:
        """Puts each send in the gap right after its producer and returns, per channel
        (src * pp + dst), the gap each receive is due in ([Note: message placement]) and the
        receive's gap entry, in send order. `kinds`: `_message_kinds`."""
        pp = self.schedule.pp
        channels: dict[int, tuple[list[int], list[tuple]]] = {}
        for rank in range(pp):
            rank_starts, rank_gaps = starts[rank], gaps[rank]
            rank_starts.append(float("inf"))  # the sender's next compute after its last
            to = [None] * pp  # this rank's channels, by the rank they go to
            pc = -1
            for k, mb in zip(self.ids[rank], self.mbs[rank]):
                pc += 1
                kind = kinds[k]
                if kind is None:
                    continue
                while True:  # each message of the producer, in the order of its edges
                    c_rank, c_pcs, cost, send, receive, free, owner, place, more = kind
                    if owner != rank:  # a producer on a rank not its stage's (an order verify refuses)
                        wanted = self.table.list[receive]
                        receive = self.table.id(wanted.op, wanted.stage, rank, None, wanted.peer_stage)
                    c_pc = c_pcs[mb]
                    produced = rank_starts[pc] + cost  # the message exists from its producer's end
                    if place:
                        rank_gaps[pc + 1].append((produced, rank, pc, place, send, mb, free))
                    else:  # the gap's first entry
                        rank_gaps[pc + 1] = [(produced, rank, pc, 0, send, mb, free)]
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
                    channel[1].append((produced, rank, pc, place, receive, mb, None))
                    if more is None:
                        break
                    kind = more
        return channels

    def _message_kinds(self, durations) -> list:
        """Per template of the compute order, the messages an instruction of it sends, in
        the order of their edges, or None for none (not F or B, or every stage at the
        other end of its edges runs on the same rank): each (the consumer's rank, the
        consumer's pc by mb (`_consumer_pcs`), the producer's duration, the send's
        template id, the receive's (from the rank that runs the producer's stage), the
        id of the FREE after the send's run (None where the pass adds no FREEs), that
        rank, its place among the template's messages, the template's next message or
        None): a template's messages as a chain of tuples, so that the common case, one
        message, costs the loop in `_send_and_due` no list. A compute sends each buffer
        it makes of a sent kind ([Note: instruction effects] in effects.py) to every stage on
        that kind's side on another rank, whose first compute to read it is the consumer:
        F(s)'s act_out to stage t is read by F(t), B(t)'s grad_in to stage s by B(s)."""
        schedule, table = self.schedule, self.table
        placement = schedule.placement
        sent = self._sent_kinds()
        kinds: list = []
        for t in list(table.list):
            s = t.stage
            row = EFFECTS[t.op]
            if s >= schedule.num_stages or row.kind != "compute":  # (a template no program uses: `_timed`)
                kinds.append(None)
                continue
            messages = []
            for role in row.makes:
                if role not in sent:
                    continue
                send, receive, consumer = sent[role]
                others = schedule.remote_producers(s) if SIDE[role] < 0 else schedule.remote_consumers(s)
                cost = getattr(durations, row.time)[s]
                for other in others:
                    peer, here, there = placement[other], edge_end(s, other), edge_end(other, s)
                    free = table.id(FREE, s, None, role, here) if self.frees else None
                    messages.append((peer, (consumer, other), cost, table.id(send, s, peer, None, here),
                                     table.id(receive, other, placement[s], None, there), free, placement[s],
                                     len(messages)))
            kinds.append(messages or None)
        consumers = self._consumer_pcs({kind[1] for messages in kinds if messages for kind in messages})
        out = []
        for messages in kinds:  # each as a chain of its messages: (..., place, the next one or None)
            chained = None
            for kind in reversed(messages or ()):
                chained = (kind[0], consumers[kind[1]], *kind[2:], chained)
            out.append(chained)
        return out

    def _sent_kinds(self) -> dict:
        """Per buffer kind a compute sends (act_out, grad_in): its send op, the receive op
        of the kind it arrives as, and the compute that first reads that one."""
        ops = covered_ops(self.schedule)
        out = {}
        for role, arrives in HANDED.items():
            send = next((op for op in SEND_OPS if EFFECTS[op].buffer == role), None)
            consumer = next((op for op in ops if first_reader(op, arrives, ops)), None)
            if send is not None and consumer is not None:
                out[role] = (send, received_by(arrives), consumer)
        return out

    def _consumer_pcs(self, wanted: set) -> dict:
        """For each (op, stage) in `wanted`: the pc of its instruction on its rank by mb."""
        m = self.schedule.microbatches
        rows = {key: [0] * m for key in wanted}
        row_of = [rows.get((t.op, t.stage)) for t in self.table.list]
        for ids, mbs in zip(self.ids, self.mbs):
            pc = -1
            for k, mb in zip(ids, mbs):
                pc += 1
                row = row_of[k]
                if row is not None:
                    row[mb] = pc
        return rows

    def merged(self, ids, mbs, rank_gaps: list) -> tuple[list, list]:
        """One rank's compute order (its `ids` and `mbs` columns) with each gap's messages,
        in production order, before the compute they precede, and the FREEs the passes
        add: a template's `after` right after it, and the FREEs of a gap's sends right
        after the gap (a run of communication is exactly one gap, which a FREE inside
        would split into two batches). Returns the (ids, mbs) columns."""
        after = self.after
        out_ids: list[int] = []
        out_mbs: list[int] = []
        add_id, add_mb = out_ids.append, out_mbs.append
        n = len(ids)
        for pc, gap in enumerate(rank_gaps):
            if gap is not None:
                if len(gap) > 1:
                    gap.sort()
                for entry in gap:
                    add_id(entry[4])
                    add_mb(entry[5])
                for entry in gap:
                    if entry[6] is not None:  # a send: its buffer is freed after the run
                        add_id(entry[6])
                        add_mb(entry[5])
            if pc == n:
                break
            k, mb = ids[pc], mbs[pc]
            add_id(k)
            add_mb(mb)
            for free in after[k]:
                add_id(free)
                add_mb(mb)
        return out_ids, out_mbs

    def gapped(self, rank: int, comm: set) -> tuple[list, list, list]:
        """Rank's compute + communication program as `merged` takes it: the columns (ids,
        mbs) of its other instructions, and the gap before each of them (and after the
        last): the run of communication there (`comm`: the templates of communication),
        each as a gap entry (program index, 0, 0, 0, template id, mb, FREE id or None) in
        program order, or None."""
        send_free = self.send_free
        others_ids, others_mbs, gaps = [], [], []
        gap = None
        for index, (k, mb) in enumerate(zip(self.ids[rank], self.mbs[rank])):
            if k in comm:
                if gap is None:
                    gap = []
                gap.append((index, 0, 0, 0, k, mb, send_free.get(k)))
            else:
                others_ids.append(k)
                others_mbs.append(mb)
                gaps.append(gap)
                gap = None
        gaps.append(gap)
        return others_ids, others_mbs, gaps

    def done(self, columns) -> Schedule:
        """The schedule with these (ids, mbs) columns, one per rank, as its programs."""
        columns = list(columns)  # every template is in the table now
        return self.schedule._with_trusted_programs(tuple(self.table.program(ids, mbs) for ids, mbs in columns))


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
    lowering = _Lowering(schedule, frees=True)
    comm = {k for k, t in enumerate(lowering.table.list) if t.op in COMM_OPS}
    return lowering.done(lowering.merged(*lowering.gapped(rank, comm)) for rank in range(schedule.pp))


PASSES = (add_communication, add_frees)
_FORWARD_COMPUTES = frozenset(op for op in COMPUTE_OPS if EFFECTS[op].phase == "forward")  # F


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
    forwards = tuple(tuple(i for i in program if i.op in _FORWARD_COMPUTES) for program in schedule.programs)
    order = Schedule(schedule.name, schedule.pp, schedule.virtual, schedule.microbatches, schedule.placement,
                     forwards, dict(schedule.params), forward_only=True, edges=schedule.edges)
    return lower(order, cost)


@gc_paused
def on_graph(schedule: Schedule, edges, *, cost=None) -> Schedule:
    """`schedule`'s compute order on the stage graph `edges` (None: the chain), lowered
    ([Note: stage graph] in graph.py: an order valid on one graph of forward edges is
    valid on every one). Input: any schedule, compute order or lowered (its messages,
    FREE, OFFLOAD and RELOAD are dropped and placed anew; add OFFLOAD again with
    `add_offload`). Output: a lowered schedule, forward-only where the input is.
    Preserved: each rank's order of F, B and W, the placement, name and params."""
    computes = tuple(tuple(i for i in program if i.op in COMPUTE_OPS) for program in schedule.programs)
    order = Schedule(schedule.name, schedule.pp, schedule.virtual, schedule.microbatches, schedule.placement,
                     computes, dict(schedule.params), schedule.forward_only, edges)
    return lower(order, cost)


def is_lowered(schedule: Schedule) -> bool:
    """False for a compute order only: no communication and no FREE anywhere."""
    for program in schedule.programs:
        if type(program) is Program:  # its templates in use ([Note: packed programs])
            if program.ops - COMPUTE_OPS:
                return True
        elif any(i.op not in COMPUTE_OPS for i in program):
            return True
    return False


@gc_paused
def lower(schedule: Schedule, cost=None) -> Schedule:
    """Applies the passes of `PASSES` in order to a compute-only schedule, the order timed
    with `cost` (None: unit costs). A function of its arguments alone: equal schedules
    lower to equal programs. Give the cost the order was generated with
    (`generate(..., cost=c)`) to place the messages as `compile_schedule(..., cost=c)` does."""
    # add_frees(add_communication(schedule, cost=cost)), the passes of PASSES, with each
    # rank's messages and its FREEs merged in one loop (`_Lowering.merged`) rather than
    # built as a program of their own. Pinned to PASSES by tests/compiler/test_lowering_pure.py.
    lowering = _Lowering(schedule, frees=True)
    gaps = lowering.place(cost)
    return lowering.done(map(lowering.merged, lowering.ids, lowering.mbs, gaps))
