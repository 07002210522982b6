"""The verifier: proves a lowered schedule obeys the six rules of DESIGN.md.

`verify(schedule)` proves every rule in one walk ([Note: one walk] in walk.py); where that
walk finds a fault, it runs `RULES` in order and raises `ScheduleError` at the first
violation, naming the rule, the rank, the instruction, its program counter and the
microbatch, with the step x rank grid around it. The order of `RULES` matters only for
which rule is named when one edit breaks several: structure and coverage first (is every
instruction where it belongs, once), then data dependencies, matching, deadlock,
liveness and caps.

On a stage graph that is not the chain ([Note: stage graph] in graph.py), every rule
reads the graph's edges where it read neighbours: F needs the act_in of each producer,
B the grad_out of each consumer; each message belongs to one edge (its stage and
`peer_stage`, [Note: peer stage] in instr.py) and exists once per remote edge and
microbatch; buffers of edges are named by their stage, microbatch and peer stage. An
error names the edge where there is one.

[Note: forward-only schedules] A schedule with `forward_only` set (an evaluation step,
`passes.forward_only`) runs forwards only. Every rule reads it from the schedule, so
`verify(schedule)` checks it as what it says it is, and equal schedules get equal
verdicts:
- coverage: each (stage, mb) has exactly one F on its rank, and nothing of a backward
  (B, W, SEND_B, RECV_B) appears;
- dependency: F follows its RECV_F (or F(s-1) on the same rank); each SEND_F / RECV_F
  exists once, between the right ranks;
- matching and deadlock: unchanged;
- liveness: unchanged; F is the last use of its act_in and stash, so both must be freed
  after it (there is no B to free them);
- cap: does not apply: rule 6 counts (stage, mb) held between F and B, and a
  forward-only schedule holds none for a backward.
"""

from __future__ import annotations

from pipeschedule.compiler.gcpause import gc_paused

from pipeschedule.errors import ScheduleError
from pipeschedule.compiler.effects import (
    BACKWARD, COMM_OPS, COVERED, EFFECTS, SEND, SEND_OPS, SIDE, Op, allowed, covered_ops, first_reader, handed_by,
    keys_of, maker_of, received_by,
)
from pipeschedule.compiler.ir import BUFFERS, Instr, Schedule, edge_end
from pipeschedule.compiler.walk import message_edge, needed_per_microbatch, passes, recorded_ops

# What each rule reads of the rows ([Note: instruction effects] in effects.py), by op.
_INFLIGHT = {op: row.inflight for op, row in EFFECTS.items()}  # rule 6
_GRADIENT = {op: row.phase == BACKWARD for op, row in EFFECTS.items()}  # a message's tensor: [Note: tensor ints]

def grid(schedule: Schedule, rank: int, index: int, window: int = 4) -> str:
    """The steps around `index` of every rank, one column per rank, the bad cell marked."""
    lo, hi = max(0, index - window), index + window + 1
    ranks = range(max(0, rank - 3), min(schedule.pp, rank + 4))  # wide pipelines: the neighbours
    header = ["step"] + [f"rank {r}" for r in ranks]
    rows = []
    for step in range(lo, hi):
        cells = [str(step)]
        for r in ranks:
            program = schedule.programs[r]
            cell = str(program[step]) if step < len(program) else ""
            if r == rank and step == index:
                cell = f"[{cell}]"
            cells.append(cell)
        rows.append(cells + (["<-- ERROR HERE"] if step == index else []))
    widths = [max(len(row[c]) for row in [header] + rows if c < len(row)) for c in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    for row in rows:
        line = "  ".join(cell.ljust(w) for cell, w in zip(row, widths))
        lines.append(line + ("  " + row[-1] if len(row) > len(header) else ""))
    return "\n".join(line.rstrip() for line in lines)


def _fail(schedule: Schedule, rule: str, rank: int, index: int, message: str) -> ScheduleError:
    program = schedule.programs[rank]
    instr = program[index] if 0 <= index < len(program) else None
    where = f"rank {rank}, step {index}" + (f", instruction {instr}" if instr is not None else "")
    mb = instr.mb if instr is not None else None
    text = f"rule {rule}: {where}: {message}\n{grid(schedule, rank, max(index, 0))}"
    return ScheduleError(text, rule=rule, rank=rank, index=index, instr=instr, mb=mb)


# -- rule 1: coverage ------------------------------------------------------------------


def check_coverage(schedule: Schedule) -> None:
    """Every instruction names a stage of its own rank and a microbatch in range; each
    (stage, mb) has exactly one F and one B (and one W if the schedule splits the
    backward), in the order F, B, W; communication names a peer in range, not itself.
    A forward-only schedule: exactly one F, and no B, W, SEND_B or RECV_B
    ([Note: forward-only schedules])."""
    S, m, pp = schedule.num_stages, schedule.microbatches, schedule.pp
    placement = schedule.placement
    forward_only = schedule.forward_only
    ops = covered_ops(schedule)
    previous = {op: ops[k - 1] if k else None for k, op in enumerate(ops)}  # a compute -> the one it follows
    for op, row in EFFECTS.items():  # one of the order the schedule does not have (W without a split): once
        if row.order is not None and op not in previous:
            previous[op] = None
    for rank, program in enumerate(schedule.programs):
        seen: dict[tuple[Op, int, int], int] = {}
        for index, i in enumerate(program):
            op, stage, mb = i.op, i.stage, i.mb
            if stage >= S or placement[stage] != rank:
                owner = f"rank {placement[stage]}" if stage < S else f"no rank (there are {S} stages)"
                raise _fail(schedule, "coverage", rank, index, f"stage {stage} belongs to {owner}")
            if mb >= m:
                raise _fail(schedule, "coverage", rank, index, f"microbatch {mb} is out of range 0..{m - 1}")
            peer = i.peer
            if peer is not None and (peer >= pp or peer == rank):
                raise _fail(schedule, "coverage", rank, index, f"peer {peer} is not another rank in 0..{pp - 1}")
            if forward_only and not allowed(schedule, op):
                accepted = ", ".join(o.value for o in Op if allowed(schedule, o))
                raise _fail(schedule, "coverage", rank, index,
                            f"{op.value} of (stage {stage}, mb {mb}) in a forward-only schedule, which runs no "
                            f"backward (accepted: {accepted})")
            before = previous.get(op, False)
            if before is not False:  # a compute of the order: [Note: instruction effects]
                key = (op, stage, mb)
                if key in seen:
                    raise _fail(schedule, "coverage", rank, index,
                                f"second {op.value} of (stage {stage}, mb {mb}); the first is at step {seen[key]}")
                seen[key] = index
                if before is not None and (before, stage, mb) not in seen:
                    raise _fail(schedule, "coverage", rank, index,
                                f"{op.value} of (stage {stage}, mb {mb}) before its {before.value}")
        stages = schedule.stages_of(rank)
        # Every key of `seen` is one of the len(ops) * len(stages) * m wanted (checked
        # above, a B in a forward-only schedule refused, and a W anywhere makes the
        # schedule split), each once: when the counts
        # agree nothing is missing, and the search below for what is can be skipped.
        if len(seen) == len(ops) * len(stages) * m:
            continue
        for stage in stages:
            for mb in range(m):
                for op in ops:
                    if (op, stage, mb) not in seen:
                        raise _fail(schedule, "coverage", rank, len(program),
                                    f"no {op.value} for (stage {stage}, mb {mb})")


# -- rule 2: data dependencies ---------------------------------------------------------


def check_dependencies(schedule: Schedule) -> None:
    """F(s, mb) follows the RECV_F of each producer on another rank (or its F on the same
    rank); B(s, mb) follows the RECV_B of each consumer on another rank (or its B on the
    same rank); each transfer exists exactly once per edge between ranks, between the
    ranks of the two stages it connects. (That SEND_F follows its F and SEND_B its B is
    the liveness of act_out and grad_in, checked by check_liveness.) A forward-only
    schedule has only the forward half of this ([Note: forward-only schedules])."""
    S, placement, graph = schedule.num_stages, schedule.placement, schedule.graph
    # For each recorded compute and stage: what it waits for, (op, stage, peer_stage, what
    # arrives) with the keys without the mb ([Note: instruction effects]).
    recorded = recorded_ops(schedule)
    needs = {op: [_needs(schedule, op, s) for s in range(S)] for op in recorded}
    for rank, program in enumerate(schedule.programs):
        done: set[tuple] = set()  # (op, stage, mb, peer_stage)
        add = done.add
        for index, i in enumerate(program):
            op = i.op
            message = op in COMM_OPS
            if not message and op not in needs:
                continue  # nothing below waits for it (W's place is rule 1's business; FREE, copies: no message)
            s, mb = i.stage, i.mb
            if not message:
                for need, stage, other, what in needs[op][s]:
                    if (need, stage, mb, other) not in done:
                        arrives, side = _ARRIVES[what]
                        edge = "" if other is None else f" {side} stage {other}"
                        raise _fail(schedule, "dependency", rank, index,
                                    f"{op.value}(stage {s}, mb {mb}) runs before {arrives}: no {need.value} of (stage "
                                    f"{stage}, mb {mb}){edge} earlier on rank {rank}")
            else:
                edge, other = message_edge(i)
                if not 0 <= other < S or edge not in graph.index or placement[other] == rank:
                    raise _fail(schedule, "dependency", rank, index, _no_edge(schedule, i, edge, other))
                if i.peer != placement[other]:
                    raise _fail(schedule, "dependency", rank, index,
                                f"peer is {i.peer}, but stage {other} runs on rank {placement[other]}")
                key = (op, s, mb, i.peer_stage)
                if key in done:
                    raise _fail(schedule, "dependency", rank, index,
                                f"second {op.value} of (stage {s}, mb {mb}){_edge_text(i)}")
                # A send before the compute that produces its tensor uses a buffer that
                # does not exist yet: check_liveness reports it, after check_matching has
                # had its say on the order of messages.
                add(key)
                continue
            add((op, s, mb, None))
        # Every key in `done` is one this rank needs, each once: its F and B (rule 1 has
        # passed), a receive or send only of a stage that has it (checked above). Each F
        # and B found its receive, so when the counts agree no send is missing either, and
        # the search below for the missing one can be skipped (130k lookups at pp=64, m=512).
        stages = schedule.stages_of(rank)
        if len(done) == needed_per_microbatch(schedule, stages) * schedule.microbatches:
            continue
        for s in stages:
            sends = [(op, other) for op in sorted(SEND_OPS) if allowed(schedule, op)
                     for other in (schedule.remote_producers(s) if SIDE[EFFECTS[op].buffer] < 0
                                   else schedule.remote_consumers(s))]
            for op, other in sends:
                for mb in range(schedule.microbatches):
                    if (op, s, mb, edge_end(s, other)) not in done:
                        edge = "" if edge_end(s, other) is None else f" for stage {other}"
                        raise _fail(schedule, "dependency", rank, len(program),
                                    f"no {op.value} of (stage {s}, mb {mb}){edge}: its consumer on another rank never "
                                    "gets it")


# What a compute waits for by the kind of buffer it reads: what arrives, and how an edge is named.
_ARRIVES = {"act_in": ("its input arrives", "from"), "grad_out": ("its output gradient arrives", "for")}


def _needs(schedule: Schedule, op: Op, s: int) -> tuple:
    """What compute `op` of stage s waits for (rule 2): for each buffer it reads first among
    the computes of the order that arrives over an edge (act_in, grad_out), the receive of
    it from another rank or the compute of the stage at the other end that hands it over
    on this one; each as (op, stage, peer_stage, kind), without the mb."""
    out = []
    ops = covered_ops(schedule)
    for kind, stage, other in keys_of(schedule, op, s).reads:
        if kind not in _ARRIVES or not first_reader(op, kind, ops) or other is None and not (
                0 <= stage + SIDE[kind] < schedule.num_stages):
            continue  # not an edge's (the data loader's act_in), or read first by an earlier compute
        end = stage + SIDE[kind] if other is None else other
        if schedule.placement[end] != schedule.placement[stage]:
            out.append((received_by(kind), stage, other, kind))
        else:
            out.append((handed_by(kind), end, None, kind))
    return tuple(out)


def _edge_text(i: Instr) -> str:
    """' for stage t' / ' from stage s' where i names an edge to a stage not its neighbour."""
    if i.peer_stage is None:
        return ""
    return f" {'for' if i.peer_stage > i.stage else 'from'} stage {i.peer_stage}"


def _no_edge(schedule: Schedule, i: Instr, edge, other: int) -> str:
    """Why message i has no edge of the stage graph between ranks to travel on."""
    if i.peer_stage is None and (schedule.is_chain or not 0 <= other < schedule.num_stages):
        return f"{i.op.value} of stage {i.stage} has no remote neighbour stage {other} to talk to"
    if edge not in schedule.graph.index:
        return (f"{i.op.value} of stage {i.stage} travels on edge {edge}, which the stage graph does not have "
                f"(edges: {[list(e) for e in schedule.edges]})")
    return f"{i.op.value} of stage {i.stage} travels on edge {edge}, whose two stages both run on rank {i.peer}"


# -- rule 3: matching ------------------------------------------------------------------



def _communication(schedule: Schedule):
    """One walk over the programs for rules 3 and 4: per (src, dst), the sends in src's
    order and the receives in dst's order, each as two lists (the tensor of every
    message, the batch of every message), a batch being the index of a maximal run of
    communication instructions in `batches`, which holds each as (rank, start, end);
    and per rank its batches in program order.

    [Note: tensor ints] A tensor is named by its edge (s, t) and microbatch, as one int:
    ((s * S + t) * m + mb) * 2, plus 1 for a gradient (S stages; an edge the graph lacks
    gets an int too, so that a bad message is still named). Ints in plain lists, one list
    per column: rule 3 then compares a channel's two tensor lists at once, and nothing is
    built per message beyond the ints (260k messages at pp=64, v=2, m=512)."""
    m, S = schedule.microbatches, schedule.num_stages
    sends, recvs = {}, {}
    batches: list[tuple[int, int, int]] = []
    rank_batches: list[list[int]] = []
    for rank, program in enumerate(schedule.programs):
        mine: list[int] = []
        run_start = run_end = batch = -1  # the current run of communication steps: [run_start, run_end)
        for index, i in enumerate(program):
            op = i.op
            if op not in COMM_OPS:
                continue
            if index != run_end:  # not right after the previous comm step: a new batch
                if run_end >= 0:
                    batches.append((rank, run_start, run_end))
                run_start, batch = index, len(batches)
                mine.append(batch)
            run_end = index + 1
            (a, b), _ = message_edge(i)
            tensor = (((a * S + b) * m + i.mb) << 1) | _GRADIENT[op]  # [Note: tensor ints]
            if op in SEND_OPS:
                tensors, at = sends.setdefault((rank, i.peer), ([], []))
            else:
                tensors, at = recvs.setdefault((i.peer, rank), ([], []))
            tensors.append(tensor)
            at.append(batch)
        if run_end >= 0:
            batches.append((rank, run_start, run_end))
        rank_batches.append(mine)
    return sends, recvs, batches, rank_batches


def _step_of_message(schedule: Schedule, rank: int, peer: int, sending: bool, k: int) -> int:
    """The step of rank's k-th send to `peer` (or k-th receive from it)."""
    ops = SEND_OPS if sending else COMM_OPS - SEND_OPS
    steps = [index for index, i in enumerate(schedule.programs[rank]) if i.op in ops and i.peer == peer]
    return steps[k]


def check_matching(schedule: Schedule) -> None:
    """For each ordered pair of ranks, the k-th send from a to b and the k-th receive on b
    from a carry the same tensor (NCCL matches by order alone)."""
    sends, recvs, _, _ = _communication(schedule)
    m = schedule.microbatches
    for src, dst in sorted(set(sends) | set(recvs)):
        out, into = sends.get((src, dst), ([], []))[0], recvs.get((src, dst), ([], []))[0]
        if out == into:
            continue
        k = next((k for k, (sent, wanted) in enumerate(zip(out, into)) if sent != wanted), None)
        if k is not None:
            def name(tensor):
                edge, mb = divmod(tensor >> 1, m)
                a, b = divmod(edge, schedule.num_stages)
                if tensor & 1:  # named by the stage that receives it, as [Note: tensor ints] once did
                    return f"gradient for (stage {a}, mb {mb})" + ("" if b == a + 1 else f" from stage {b}")
                return f"activation for (stage {b}, mb {mb})" + ("" if b == a + 1 else f" from stage {a}")
            s_index = _step_of_message(schedule, src, dst, True, k)
            raise _fail(schedule, "matching", dst, _step_of_message(schedule, dst, src, False, k),
                        f"receive #{k} from rank {src} expects the {name(into[k])}, but rank {src}'s send #{k} "
                        f"(step {s_index}) carries the {name(out[k])}")
        rank, index = ((src, _step_of_message(schedule, src, dst, True, len(into))) if len(out) > len(into)
                       else (dst, _step_of_message(schedule, dst, src, False, len(out))))
        raise _fail(schedule, "matching", rank, index, f"rank {src} sends {len(out)} messages to rank {dst}, "
                    f"which receives {len(into)}")


# -- rule 4: deadlock ------------------------------------------------------------------


def comm_batches(schedule: Schedule):
    """Every maximal run of communication instructions as (rank, start, end); per rank,
    its batches in program order; and for each batch the set of partner batches its
    operations are matched with (rule 3's order)."""
    sends, recvs, batches, rank_batches = _communication(schedule)
    partners: list[set[int]] = [set() for _ in batches]
    for key, (_, out) in sends.items():
        for a, b in zip(out, recvs.get(key, ((), ()))[1]):
            partners[a].add(b)
            partners[b].add(a)
    return batches, rank_batches, partners


def check_deadlock(schedule: Schedule) -> None:
    """Runs every program under rule 4's semantics: a batch is posted when its rank
    reaches it, and the rank moves past it once every partner batch is posted. Only the
    batches matter: compute never blocks, so each rank walks its batches in order."""
    sends, recvs, batches, rank_batches = _communication(schedule)
    # Per batch, the partner batch of each of its messages, a partner listed once per
    # message. Lists rather than `comm_batches`' sets: there are about as many batches as
    # messages (130k at pp=64, v=2, m=512), and building a set per batch took half of
    # this rule. Counting messages instead of partner batches changes nothing: a batch
    # waits until each of its messages' partners is posted either way.
    partners: list[list[int]] = [[] for _ in batches]
    for key, (_, out) in sends.items():
        for a, b in zip(out, recvs.get(key, ((), ()))[1]):
            partners[a].append(b)
            partners[b].append(a)
    unposted = list(map(len, partners))  # messages whose partner batch is not yet posted
    for mine in rank_batches:  # every rank reaches its first batch at once: compute never blocks
        for other in partners[mine[0]] if mine else ():
            unposted[other] -= 1
    nexts = [0] * schedule.pp  # per rank: index of its posted batch in rank_batches
    waiting: dict[int, int] = {}  # batch -> the rank blocked on it
    runnable = list(range(schedule.pp))
    while runnable:
        rank = runnable.pop()
        mine, k = rank_batches[rank], nexts[rank]
        n = len(mine)
        while k < n:
            if unposted[mine[k]]:  # its batch waits for a partner
                waiting[mine[k]] = rank
                break
            k += 1
            if k < n:  # posts the next one, which may complete a partner's batch
                for other in partners[mine[k]]:
                    unposted[other] -= 1
                    if unposted[other] == 0 and other in waiting:
                        runnable.append(waiting.pop(other))
        nexts[rank] = k
    blocked = [r for r in range(schedule.pp) if nexts[r] < len(rank_batches[r])]
    if blocked:
        pcs = {r: batches[rank_batches[r][nexts[r]]][1] for r in blocked}
        rank = blocked[0]
        states = ", ".join(f"rank {r} at step {pcs[r]} ({schedule.programs[r][pcs[r]]})" for r in blocked[:8])
        more = f" and {len(blocked) - 8} more ranks" if len(blocked) > 8 else ""
        raise _fail(schedule, "deadlock", rank, pcs[rank],
                    f"the programs cannot finish: {states}{more} wait for partners that never post")


# -- rule 5: liveness ------------------------------------------------------------------


def check_liveness(schedule: Schedule) -> None:
    """Every buffer is produced once, used only while live, and freed exactly once after
    its last use; nothing is live when the program ends ([Note: buffers] in instr.py).
    A buffer is named by (stage, mb, peer_stage): on a stage graph the buffers of edges
    are one per edge ([Note: peer stage] in instr.py).

    [Note: buffer states] Per rank, one dict per buffer kind maps (stage, mb) to the state
    of that buffer: the step that produced it (or last reloaded it) while it is live on
    the device, ~step (a negative number, -n..-1 for a program of n steps) of the FREE
    that released it once freed, host - step of the OFFLOAD that moved it (host = -(n+1),
    so every such value is below every freed one) while it is on the host, absent before
    it is produced. One lookup then answers "is it usable" (state >= 0) and "did it ever
    exist", and one (stage, mb) tuple serves every buffer an instruction touches;
    schedules without OFFLOAD pay nothing for the third state.

    [Note: offload liveness] OFFLOAD needs the buffer live on the device and puts it on
    the host; RELOAD needs it on the host and puts it back on the device. Any use of a
    buffer on the host (the op that reads it: F, B, W, SEND_F, SEND_B, per [Note: buffers])
    is an error: its RELOAD is missing or comes too late. FREE is allowed in either state
    and releases whichever copy exists, so a buffer need not come back only to be
    dropped. Both are neither compute nor communication: no other rule counts them, and
    like FREE they end a run of communication (so a pass must not put them inside one,
    which would split its batch).

    Each instruction produces its buffers, then uses its inputs, then frees, then moves,
    as its op's row says ([Note: instruction effects] in effects.py: `_liveness_step`);
    the first failing check names the error.
    """
    resolved: dict = {}  # what each instruction does to buffers, by its (op, stage, peer_stage, buf)
    for rank, program in enumerate(schedule.programs):
        buffers = _RankBuffers(schedule, rank)
        for index, i in enumerate(program):
            _liveness_step(buffers, index, i, resolved)
        leak = buffers.first_leak()
        if leak is not None:
            raise leak


# What check_liveness says of a buffer it refuses, by what the instruction does to it.
_LIVENESS_MESSAGES = {
    "use": "uses {buf} of (stage {s}, mb {mb}){edge}, which is {where}",
    "free": "frees {buf} of (stage {s}, mb {mb}){edge}, which is {freed}{where}",
    "offload": "offloads {buf} of (stage {s}, mb {mb}){edge}, which is {offloaded}{where}",
    "reload": "reloads {buf} of (stage {s}, mb {mb}){edge}, which is {where}; RELOAD needs an OFFLOAD before it",
    "early": "{send} of (stage {s}, mb {mb}){edge} runs before the {producer} that produces its {buf}",
    "twice": "{buf} of (stage {s}, mb {mb}){edge} produced a second time",
}


def buffer_edge(buf: str, stage: int, other: int | None) -> str:
    """' for stage t' / ' from stage s': the edge of a buffer whose peer_stage is not the
    neighbour ([Note: peer stage]); '' otherwise."""
    if other is None:
        return ""
    return f" {'for' if other > stage else 'from'} stage {other}"


class _RankBuffers:
    """check_liveness' record of one rank's buffers ([Note: buffer states]) and the checks
    every instruction makes on them."""

    def __init__(self, schedule: Schedule, rank: int) -> None:
        self.schedule, self.rank = schedule, rank
        self.states: dict[str, dict[tuple[int, int], int]] = {buf: {} for buf in BUFFERS}
        self.host = -(len(schedule.programs[rank]) + 1)  # states <= host: on the host
        self.frees = 0

    def error(self, index: int, buf: str, key, what: str, op: Op | None = None) -> ScheduleError:
        state, host = self.states[buf].get(key), self.host
        if state is None:
            where = "never produced"
        elif state <= host:
            where = f"on the host (offloaded at step {host - state}, not reloaded since)"
        elif state < 0:
            where = f"freed at step {~state}"
        else:
            where = f"on the device (produced or reloaded at step {state})"
        maker = maker_of(buf, COVERED)
        send, producer = (op.value if op is not None else "", maker.value if maker is not None else "")
        message = _LIVENESS_MESSAGES[what].format(
            buf=buf, s=key[0], mb=key[1], edge=buffer_edge(buf, key[0], key[2]), where=where, send=send,
            producer=producer,
            freed="already " if state is not None and host < state < 0 else "",
            offloaded="already " if state is not None and state <= host else "")
        return _fail(self.schedule, "liveness", self.rank, index, message)

    def produce(self, index: int, buf: str, key) -> None:
        if key in self.states[buf]:
            raise self.error(index, buf, key, "twice")
        self.states[buf][key] = index

    def use(self, index: int, buf: str, key, unknown: str = "use", op: Op | None = None) -> None:
        """A read of the buffer; `unknown` names the error when it was never produced."""
        state = self.states[buf].get(key)
        if state is None or state < 0:
            raise self.error(index, buf, key, unknown if state is None else "use", op)

    def release(self, index: int, buf: str, key) -> None:  # FREE: either copy may go
        state = self.states[buf].get(key)
        if state is None or self.host < state < 0:
            raise self.error(index, buf, key, "free")
        self.states[buf][key] = ~index
        self.frees += 1

    def offload(self, index: int, buf: str, key) -> None:
        state = self.states[buf].get(key)
        if state is None or state < 0:
            raise self.error(index, buf, key, "offload")
        self.states[buf][key] = self.host - index

    def reload(self, index: int, buf: str, key) -> None:
        state = self.states[buf].get(key)
        if state is None or state > self.host:
            raise self.error(index, buf, key, "reload")
        self.states[buf][key] = index

    def first_leak(self) -> ScheduleError | None:
        """The first buffer never freed, in program order (the buffers one instruction
        produces in the order it produces them: stash, act_in, act_out; [Note: buffers])."""
        if sum(map(len, self.states.values())) <= self.frees:  # every key produced once; each FREE released one
            return None
        host, order = self.host, {"stash": 0, "act_in": 1, "act_out": 2, "grad_in": 3, "grad_out": 4}
        index, _, s, _, buf, mb, other = min(
            (state if state >= 0 else host - state, order[buf], s, -1 if other is None else other, buf, mb, other)
            for buf, states_of in self.states.items() for (s, mb, other), state in states_of.items()
            if state >= 0 or state <= host
        )
        where = " on the host" if self.states[buf][s, mb, other] <= host else ""
        return _fail(self.schedule, "liveness", self.rank, index,
                     f"{buf} of (stage {s}, mb {mb}){buffer_edge(buf, s, other)} is never freed{where} (a leak)")


def _liveness_step(buffers: _RankBuffers, index: int, i: Instr, resolved: dict) -> None:
    """What instruction i does to buffers, checked: it makes, reads, frees and moves the
    buffers its op's row names ([Note: instruction effects] in effects.py), in that order.
    F makes its stash, the data loader's act_in on stage 0, and for each consumer its
    act_out (sent) or the consumer's act_in (a local hand-off), then reads its act_in
    (each producer's); B makes for each producer its grad_in (sent) or the producer's
    grad_out (a local hand-off), then reads its act_in, stash and grad_out (each
    consumer's; none on the last stage: the loss is there); a send reads its buffer, a
    receive makes it; FREE releases, OFFLOAD and RELOAD move the buffer they name.
    `resolved` keeps the keys per (op, stage, peer_stage, buf)."""
    op, mb = i.op, i.mb
    found = resolved.get((op, i.stage, i.peer_stage, i.buf))
    if found is None:
        found = resolved[op, i.stage, i.peer_stage, i.buf] = keys_of(buffers.schedule, op, i.stage, i.peer_stage,
                                                                     i.buf)
    makes, reads, frees, moves = found
    for buf, s, other in makes:
        buffers.produce(index, buf, (s, mb, other))
    unknown = "early" if EFFECTS[op].kind == SEND else "use"  # a send before the compute that makes its buffer
    for buf, s, other in reads:
        buffers.use(index, buf, (s, mb, other), unknown, op)
    for buf, s, other in frees:
        buffers.release(index, buf, (s, mb, other))
    for buf, s, other in moves:
        move = buffers.offload if EFFECTS[op].moves_to == "host" else buffers.reload
        move(index, buf, (s, mb, other))


# -- rule 6: caps ----------------------------------------------------------------------


def check_caps(schedule: Schedule) -> None:
    """The (stage, mb) whose F has run and whose B has not never outnumber the cap. Not
    for a forward-only schedule, which holds none for a backward
    ([Note: forward-only schedules])."""
    caps = schedule.caps()
    if caps is None or schedule.forward_only:
        return
    for rank, program in enumerate(schedule.programs):
        inflight = 0
        for index, i in enumerate(program):
            step = _INFLIGHT[i.op]  # [Note: instruction effects]: +1 for F, -1 for B
            if step:
                inflight += step
                if inflight > caps[rank]:
                    raise _fail(schedule, "cap", rank, index,
                                f"{inflight} microbatch-stages in flight, cap is {caps[rank]}")


RULES = (check_coverage, check_dependencies, check_matching, check_deadlock, check_liveness, check_caps)


@gc_paused
def verify(schedule: Schedule) -> None:
    """Raises ScheduleError at the first broken rule; returns None for a valid schedule."""
    if passes(schedule):  # every rule holds, proved in one walk ([Note: one walk] in walk.py)
        return
    for rule in RULES:  # the first error, named by rule, rank and step
        rule(schedule)
