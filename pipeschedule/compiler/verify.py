"""The verifier: proves a lowered schedule obeys the six rules of DESIGN.md.

`verify(schedule)` runs `RULES` in order and raises `ScheduleError` at the first
violation, naming the rule, the rank, the instruction, its program counter and the
microbatch, with the step x rank grid around it. The order of `RULES` matters only for
which rule is named when one edit breaks several: structure and coverage first (is every
instruction where it belongs, once), then data dependencies, matching, deadlock,
liveness and caps.

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
from pipeschedule.compiler.ir import BUFFERS, COMM_OPS, Instr, Op, Schedule

# Plain names for the ops: enum attribute lookups dominate loops over a million steps.
F, B, W, FREE = Op.F, Op.B, Op.W, Op.FREE
OFFLOAD, RELOAD = Op.OFFLOAD, Op.RELOAD
SEND_F, RECV_F, SEND_B, RECV_B = Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B

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
    S, m, pp, split = schedule.num_stages, schedule.microbatches, schedule.pp, schedule.split_backward
    placement = schedule.placement
    forward_only = schedule.forward_only
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
            if forward_only and (op is B or op is W or op is SEND_B or op is RECV_B):
                raise _fail(schedule, "coverage", rank, index, f"{op.value} of (stage {stage}, mb {mb}) in a forward-only schedule, which runs no backward (accepted: F, SEND_F, RECV_F, FREE, OFFLOAD, RELOAD)")
            if op is F or op is B or op is W:
                key = (op, stage, mb)
                if key in seen:
                    raise _fail(schedule, "coverage", rank, index, f"second {op.value} of (stage {stage}, mb {mb}); the first is at step {seen[key]}")
                seen[key] = index
                if op is B and (F, stage, mb) not in seen:
                    raise _fail(schedule, "coverage", rank, index, f"B of (stage {stage}, mb {mb}) before its F")
                if op is W and (B, stage, mb) not in seen:
                    raise _fail(schedule, "coverage", rank, index, f"W of (stage {stage}, mb {mb}) before its B")
        ops = (F,) if forward_only else (F, B, W) if split else (F, B)
        stages = schedule.stages_of(rank)
        # Every key of `seen` is one of the len(ops) * len(stages) * m wanted (checked
        # above, and a W anywhere makes the schedule split), each once: when the counts
        # agree nothing is missing, and the search below for what is can be skipped.
        if len(seen) == len(ops) * len(stages) * m:
            continue
        for stage in stages:
            for mb in range(m):
                for op in ops:
                    if (op, stage, mb) not in seen:
                        raise _fail(schedule, "coverage", rank, len(program), f"no {op.value} for (stage {stage}, mb {mb})")


# -- rule 2: data dependencies ---------------------------------------------------------


def check_dependencies(schedule: Schedule) -> None:
    """F(s, mb) follows its RECV_F (or F(s-1, mb) on the same rank); B(s, mb) follows its
    RECV_B (or B(s+1, mb) on the same rank); each transfer exists exactly once, between
    the ranks of the two stages it connects. (That SEND_F follows its F and SEND_B its B
    is the liveness of act_out and grad_in, checked by check_liveness.) A forward-only
    schedule has only the forward half of this ([Note: forward-only schedules])."""
    S, placement = schedule.num_stages, schedule.placement
    last = S - 1
    # For each stage: what its F and its B wait for, and the peer of each transfer.
    f_needs = [None] + [RECV_F if placement[s - 1] != placement[s] else F for s in range(1, S)]
    b_needs = [RECV_B if placement[s + 1] != placement[s] else B for s in range(last)] + [None]
    for rank, program in enumerate(schedule.programs):
        done: set[tuple[Op, int, int]] = set()
        add = done.add
        for index, i in enumerate(program):
            op = i.op
            if op is FREE or op is W:
                continue  # nothing below waits for them (W's place is rule 1's business)
            s, mb = i.stage, i.mb
            if op is F:
                need = f_needs[s]
                if need is not None:
                    key = (need, s, mb) if need is RECV_F else (F, s - 1, mb)
                    if key not in done:
                        raise _fail(schedule, "dependency", rank, index, f"F(stage {s}, mb {mb}) runs before its input arrives: no {need.value} of (stage {key[1]}, mb {mb}) earlier on rank {rank}")
            elif op is B:
                need = b_needs[s]
                if need is not None:
                    key = (need, s, mb) if need is RECV_B else (B, s + 1, mb)
                    if key not in done:
                        raise _fail(schedule, "dependency", rank, index, f"B(stage {s}, mb {mb}) runs before its output gradient arrives: no {need.value} of (stage {key[1]}, mb {mb}) earlier on rank {rank}")
            else:
                if op is OFFLOAD or op is RELOAD:
                    continue  # moves between device and host: no data dependency, no message
                other = s + 1 if (op is SEND_F or op is RECV_B) else s - 1
                if not 0 <= other < S or placement[other] == rank:
                    raise _fail(schedule, "dependency", rank, index, f"{op.value} of stage {s} has no remote neighbour stage {other} to talk to")
                if i.peer != placement[other]:
                    raise _fail(schedule, "dependency", rank, index, f"peer is {i.peer}, but stage {other} runs on rank {placement[other]}")
                key = (op, s, mb)
                if key in done:
                    raise _fail(schedule, "dependency", rank, index, f"second {op.value} of (stage {s}, mb {mb})")
                # A send before the compute that produces its tensor uses a buffer that
                # does not exist yet: check_liveness reports it, after check_matching has
                # had its say on the order of messages.
                add(key)
                continue
            add((op, s, mb))
        # Every key in `done` is one this rank needs, each once: its F and B (rule 1 has
        # passed), a receive or send only of a stage that has it (checked above). Each F
        # and B found its receive, so when the counts agree no send is missing either, and
        # the search below for the missing one can be skipped (130k lookups at pp=64, m=512).
        stages = schedule.stages_of(rank)
        if len(done) == _needed_per_microbatch(schedule, stages) * schedule.microbatches:
            continue
        for s in stages:
            for op, needed in ((SEND_F, schedule.sends_forward(s)),
                               (SEND_B, schedule.sends_backward(s) and not schedule.forward_only)):
                if needed:
                    for mb in range(schedule.microbatches):
                        if (op, s, mb) not in done:
                            raise _fail(schedule, "dependency", rank, len(program), f"no {op.value} of (stage {s}, mb {mb}): its consumer on another rank never gets it")


def _needed_per_microbatch(schedule: Schedule, stages) -> int:
    """How many of F, B and transfers (what check_dependencies records) a rank running
    `stages` has per microbatch: F and B of each stage, and each stage's messages."""
    if schedule.forward_only:
        return sum(1 + schedule.recvs_forward(s) + schedule.sends_forward(s) for s in stages)
    return sum(2 + schedule.recvs_forward(s) + schedule.sends_forward(s) + schedule.sends_backward(s)
               + schedule.recvs_backward(s) for s in stages)


# -- rule 3: matching ------------------------------------------------------------------



def _communication(schedule: Schedule):
    """One walk over the programs for rules 3 and 4: per (src, dst), the sends in src's
    order and the receives in dst's order, each as (tensor, step, batch), batch being the
    index of its step's batch; and the batches, every maximal run of communication
    instructions as (rank, start, end), with per rank its batches in program order.
    `verify` finds this once and hands it to rules 3 and 4 (nothing is kept on the
    schedule).

    [Note: tensor ints] A tensor is named by the receive that takes it, RECV_F or RECV_B
    of (stage, mb), as one int: (stage * m + mb) * 2, plus 1 for a gradient. One int per
    message rather than a tuple: the tables hold one per send and per receive (260k at
    pp=64, v=2, m=512), and making then freeing tuples of them cost 0.05 s of verify."""
    m = schedule.microbatches
    sends, recvs = {}, {}
    batches: list[tuple[int, int, int]] = []
    rank_batches: list[list[int]] = []
    for rank, program in enumerate(schedule.programs):
        # This rank's sends and receives by peer: an int key per step is cheaper than a
        # (src, dst) tuple (this loop sees every instruction); merged below.
        to_peer: dict[int, list] = {}
        from_peer: dict[int, list] = {}
        mine: list[int] = []
        run_start = run_end = -1  # the current run of communication steps: [run_start, run_end)
        batch = -1
        for index, i in enumerate(program):
            op = i.op
            if op is not SEND_F and op is not SEND_B and op is not RECV_F and op is not RECV_B:
                continue
            if index != run_end:  # not right after the previous comm step: a new batch
                if run_end >= 0:
                    batches.append((rank, run_start, run_end))
                run_start, batch = index, len(batches)
                mine.append(batch)
            run_end = index + 1
            if op is SEND_F or op is SEND_B:
                entries = to_peer.get(i.peer)
                if entries is None:
                    entries = to_peer[i.peer] = []
                if op is SEND_F:
                    entries.append(((((i.stage + 1) * m + i.mb) << 1), index, batch))  # [Note: tensor ints]
                else:
                    entries.append(((((i.stage - 1) * m + i.mb) << 1 | 1), index, batch))
            else:
                entries = from_peer.get(i.peer)
                if entries is None:
                    entries = from_peer[i.peer] = []
                entries.append((((i.stage * m + i.mb) << 1 | (op is RECV_B)), index, batch))
        if run_end >= 0:
            batches.append((rank, run_start, run_end))
        rank_batches.append(mine)
        for peer, entries in to_peer.items():
            sends[rank, peer] = entries
        for peer, entries in from_peer.items():
            recvs[peer, rank] = entries
    return sends, recvs, batches, rank_batches


def check_matching(schedule: Schedule, communication=None) -> None:
    """For each ordered pair of ranks, the k-th send from a to b and the k-th receive on b
    from a carry the same tensor (NCCL matches by order alone). `communication`:
    `_communication(schedule)` where the caller has it already."""
    sends, recvs, _, _ = communication or _communication(schedule)
    m = schedule.microbatches
    for src, dst in sorted(set(sends) | set(recvs)):
        out, into = sends.get((src, dst), []), recvs.get((src, dst), [])
        for k, ((sent, s_index, _), (wanted, r_index, _)) in enumerate(zip(out, into)):
            if sent != wanted:
                def name(tensor):
                    stage, mb = divmod(tensor >> 1, m)
                    return f"{'gradient' if tensor & 1 else 'activation'} for (stage {stage}, mb {mb})"
                raise _fail(schedule, "matching", dst, r_index, f"receive #{k} from rank {src} expects the {name(wanted)}, but rank {src}'s send #{k} (step {s_index}) carries the {name(sent)}")
        if len(out) != len(into):
            rank, index = (src, out[len(into)][1]) if len(out) > len(into) else (dst, into[len(out)][1])
            raise _fail(schedule, "matching", rank, index, f"rank {src} sends {len(out)} messages to rank {dst}, which receives {len(into)}")


# -- rule 4: deadlock ------------------------------------------------------------------


def comm_batches(schedule: Schedule):
    """Every maximal run of communication instructions as (rank, start, end); per rank,
    its batches in program order; and for each batch the set of partner batches its
    operations are matched with (rule 3's order)."""
    sends, recvs, batches, rank_batches = _communication(schedule)
    partners: list[set[int]] = [set() for _ in batches]
    for key, out in sends.items():
        for (_, _, a), (_, _, b) in zip(out, recvs.get(key, ())):
            partners[a].add(b)
            partners[b].add(a)
    return batches, rank_batches, partners


def check_deadlock(schedule: Schedule, communication=None) -> None:
    """Runs every program under rule 4's semantics: a batch is posted when its rank
    reaches it, and the rank moves past it once every partner batch is posted. Only the
    batches matter: compute never blocks, so each rank walks its batches in order.
    `communication`: `_communication(schedule)` where the caller has it already."""
    sends, recvs, batches, rank_batches = communication or _communication(schedule)
    # Per batch, the partner batch of each of its messages, a partner listed once per
    # message. Lists rather than `comm_batches`' sets: there are about as many batches as
    # messages (130k at pp=64, v=2, m=512), and building a set per batch took half of
    # this rule. Counting messages instead of partner batches changes nothing: a batch
    # waits until each of its messages' partners is posted either way.
    partners: list[list[int]] = [[] for _ in batches]
    for key, out in sends.items():
        for (_, _, a), (_, _, b) in zip(out, recvs.get(key, ())):
            partners[a].append(b)
            partners[b].append(a)
    unposted = [len(p) for p in partners]  # messages whose partner batch is not yet posted
    posted = [False] * len(batches)
    nexts = [0] * schedule.pp  # per rank: index of its next batch in rank_batches
    waiting: dict[int, int] = {}  # batch -> the rank blocked on it
    runnable = list(range(schedule.pp))
    while runnable:
        rank = runnable.pop()
        mine, k = rank_batches[rank], nexts[rank]
        while k < len(mine):
            batch = mine[k]
            if not posted[batch]:
                posted[batch] = True
                for other in partners[batch]:  # posting it may complete a partner's batch
                    unposted[other] -= 1
                    if unposted[other] == 0 and other in waiting:
                        runnable.append(waiting.pop(other))
            if unposted[batch]:
                waiting[batch] = rank
                break
            k += 1
        nexts[rank] = k
    blocked = [r for r in range(schedule.pp) if nexts[r] < len(rank_batches[r])]
    if blocked:
        pcs = {r: batches[rank_batches[r][nexts[r]]][1] for r in blocked}
        rank = blocked[0]
        states = ", ".join(f"rank {r} at step {pcs[r]} ({schedule.programs[r][pcs[r]]})" for r in blocked[:8])
        more = f" and {len(blocked) - 8} more ranks" if len(blocked) > 8 else ""
        raise _fail(schedule, "deadlock", rank, pcs[rank], f"the programs cannot finish: {states}{more} wait for partners that never post")


# -- rule 5: liveness ------------------------------------------------------------------


def check_liveness(schedule: Schedule) -> None:
    """Every buffer is produced once, used only while live, and freed exactly once after
    its last use; nothing is live when the program ends ([Note: buffers] in ir.py).

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

    Each instruction produces its buffers, then uses its inputs, in the order of
    [Note: buffers] (`_LIVENESS_STEPS`); the first failing check names the error.
    """
    for rank, program in enumerate(schedule.programs):
        buffers = _RankBuffers(schedule, rank)
        for index, i in enumerate(program):
            _LIVENESS_STEPS[i.op](buffers, index, i, (i.stage, i.mb))
        leak = buffers.first_leak()
        if leak is not None:
            raise leak


# What check_liveness says of a buffer it refuses, by what the instruction does to it.
_LIVENESS_MESSAGES = {
    "use": "uses {buf} of (stage {s}, mb {mb}), which is {where}",
    "free": "frees {buf} of (stage {s}, mb {mb}), which is {freed}{where}",
    "offload": "offloads {buf} of (stage {s}, mb {mb}), which is {offloaded}{where}",
    "reload": "reloads {buf} of (stage {s}, mb {mb}), which is {where}; RELOAD needs an OFFLOAD before it",
    "early": "{send} of (stage {s}, mb {mb}) runs before the {producer} that produces its {buf}",
    "twice": "{buf} of (stage {s}, mb {mb}) produced a second time",
}


class _RankBuffers:
    """check_liveness' record of one rank's buffers ([Note: buffer states]) and the checks
    every instruction makes on them."""

    def __init__(self, schedule: Schedule, rank: int) -> None:
        self.schedule, self.rank = schedule, rank
        self.states: dict[str, dict[tuple[int, int], int]] = {buf: {} for buf in BUFFERS}
        self.host = -(len(schedule.programs[rank]) + 1)  # states <= host: on the host
        self.frees = 0

    def error(self, index: int, buf: str, key, what: str) -> ScheduleError:
        state, host = self.states[buf].get(key), self.host
        if state is None:
            where = "never produced"
        elif state <= host:
            where = f"on the host (offloaded at step {host - state}, not reloaded since)"
        elif state < 0:
            where = f"freed at step {~state}"
        else:
            where = f"on the device (produced or reloaded at step {state})"
        send, producer = ("SEND_F", "F") if buf == "act_out" else ("SEND_B", "B")
        message = _LIVENESS_MESSAGES[what].format(
            buf=buf, s=key[0], mb=key[1], where=where, send=send, producer=producer,
            freed="already " if state is not None and host < state < 0 else "",
            offloaded="already " if state is not None and state <= host else "")
        return _fail(self.schedule, "liveness", self.rank, index, message)

    def produce(self, index: int, buf: str, key) -> None:
        if key in self.states[buf]:
            raise self.error(index, buf, key, "twice")
        self.states[buf][key] = index

    def use(self, index: int, buf: str, key, unknown: str = "use") -> None:
        """A read of the buffer; `unknown` names the error when it was never produced."""
        state = self.states[buf].get(key)
        if state is None or state < 0:
            raise self.error(index, buf, key, unknown if state is None else "use")

    def release(self, index: int, i: Instr, key) -> None:  # FREE: either copy may go
        state = self.states[i.buf].get(key)
        if state is None or self.host < state < 0:
            raise self.error(index, i.buf, key, "free")
        self.states[i.buf][key] = ~index
        self.frees += 1

    def offload(self, index: int, i: Instr, key) -> None:
        state = self.states[i.buf].get(key)
        if state is None or state < 0:
            raise self.error(index, i.buf, key, "offload")
        self.states[i.buf][key] = self.host - index

    def reload(self, index: int, i: Instr, key) -> None:
        state = self.states[i.buf].get(key)
        if state is None or state > self.host:
            raise self.error(index, i.buf, key, "reload")
        self.states[i.buf][key] = index

    def first_leak(self) -> ScheduleError | None:
        """The first buffer never freed, in program order (the buffers one instruction
        produces in the order it produces them: stash, act_in, act_out; [Note: buffers])."""
        if sum(map(len, self.states.values())) <= self.frees:  # every key produced once; each FREE released one
            return None
        host, order = self.host, {"stash": 0, "act_in": 1, "act_out": 2, "grad_in": 3, "grad_out": 4}
        index, _, s, buf, mb = min(
            (state if state >= 0 else host - state, order[buf], s, buf, mb)
            for buf, states_of in self.states.items() for (s, mb), state in states_of.items()
            if state >= 0 or state <= host
        )
        where = " on the host" if self.states[buf][s, mb] <= host else ""
        return _fail(self.schedule, "liveness", self.rank, index, f"{buf} of (stage {s}, mb {mb}) is never freed{where} (a leak)")


def _liveness_forward(buffers: _RankBuffers, index: int, i: Instr, key) -> None:
    """F produces its stash, the data loader's act_in on stage 0, its act_out (sent) or
    the next stage's act_in (a local hand-off); then reads its act_in."""
    schedule, s = buffers.schedule, key[0]
    buffers.produce(index, "stash", key)
    if s == 0:
        buffers.produce(index, "act_in", key)
    if schedule.sends_forward(s):
        buffers.produce(index, "act_out", key)
    elif s + 1 < schedule.num_stages:
        buffers.produce(index, "act_in", (s + 1, key[1]))
    buffers.use(index, "act_in", key)


def _liveness_backward(buffers: _RankBuffers, index: int, i: Instr, key) -> None:
    """B produces its grad_in (sent) or the previous stage's grad_out (a local hand-off);
    then reads its act_in, stash and grad_out (none on the last stage: the loss is there)."""
    schedule, s = buffers.schedule, key[0]
    if schedule.sends_backward(s):
        buffers.produce(index, "grad_in", key)
    elif s > 0:
        buffers.produce(index, "grad_out", (s - 1, key[1]))
    buffers.use(index, "act_in", key)
    buffers.use(index, "stash", key)
    if s + 1 < schedule.num_stages:
        buffers.use(index, "grad_out", key)


_LIVENESS_STEPS = {
    Op.F: _liveness_forward,
    Op.B: _liveness_backward,
    Op.W: lambda buffers, index, i, key: buffers.use(index, "stash", key),
    Op.RECV_F: lambda buffers, index, i, key: buffers.produce(index, "act_in", key),
    Op.RECV_B: lambda buffers, index, i, key: buffers.produce(index, "grad_out", key),
    Op.SEND_F: lambda buffers, index, i, key: buffers.use(index, "act_out", key, unknown="early"),
    Op.SEND_B: lambda buffers, index, i, key: buffers.use(index, "grad_in", key, unknown="early"),
    Op.FREE: _RankBuffers.release,
    Op.OFFLOAD: _RankBuffers.offload,
    Op.RELOAD: _RankBuffers.reload,
}


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
            if i.op is F:
                inflight += 1
                if inflight > caps[rank]:
                    raise _fail(schedule, "cap", rank, index, f"{inflight} microbatch-stages in flight, cap is {caps[rank]}")
            elif i.op is B:
                inflight -= 1


RULES = (check_coverage, check_dependencies, check_matching, check_deadlock, check_liveness, check_caps)


# -- the merged walk -------------------------------------------------------------------


def _passes_walked_rules(schedule: Schedule):
    """One walk per rank that answers whether check_coverage, check_dependencies and
    check_liveness all pass: what `_communication(schedule)` returns when they do (it
    collects the same on the way), None when any fails.

    [Note: merged walk] Each of those rules walks every instruction (717k at pp=64, v=2,
    m=512). Walking once, reading each instruction's fields once, and dropping the
    checks that the others imply (below) took about a fifth of `verify`'s time off.
    The rules name the first error by rule, then rank, then step, which one walk cannot
    reproduce cheaply, so this walk never raises: any failed check returns None and
    `verify` runs the separate rules, which raise the right error. None is therefore
    always safe (only slower); tables must come back only when each of the three rules
    would pass. Checks left out because, when every check here passes, they cannot fail:
    - liveness "produced a second time": each buffer key has one producer, unique by
      coverage (F: stash, act_out, local act_in; B: grad_in, local grad_out) or by the
      dependency checks (RECV_F / RECV_B only of a stage whose neighbour is remote, once);
    - dependency's "F runs before its input arrives": F's use of act_in needs it
      produced, by RECV_F of a remote neighbour or by F(s-1) of a local one, which is
      exactly what dependency asks for (stage 0 needs nothing); likewise B's use of
      grad_out covers B's input gradient (the last stage needs nothing);
    - coverage's "B before its F": B's use of stash needs it produced, and only F(s, mb)
      produces stash (s, mb).
    The per-rank counts at the end are the rules' own: each key is one a rule wants,
    each once, so a count that agrees means nothing is missing.
    tests/test_verify_walk.py pins this walk to the three rules (a differential test on
    valid and edited schedules of every family, with offload); a check added here or
    there without the other fails it. A forward-only schedule
    is left to the separate rules (None): evaluation schedules are small and rare.
    """
    if schedule.forward_only:
        return None
    S, m, pp = schedule.num_stages, schedule.microbatches, schedule.pp
    placement = schedule.placement
    last = S - 1
    sends_fwd = [schedule.sends_forward(s) for s in range(S)]
    sends_bwd = [schedule.sends_backward(s) for s in range(S)]
    n_ops = 3 if schedule.split_backward else 2
    stages_by_rank: list[list[int]] = [[] for _ in range(pp)]
    for s, r in enumerate(placement):
        stages_by_rank[r].append(s)
    sends, recvs = {}, {}
    batches: list[tuple[int, int, int]] = []
    rank_batches: list[list[int]] = []
    for rank, program in enumerate(schedule.programs):
        stages = stages_by_rank[rank]
        own = frozenset(stages)  # coverage: stage in range and on this rank (and >= 0)
        # check_liveness' states ([Note: buffer states]); stash's keys are exactly the
        # F's (only F produces stash), so it is also coverage's record of them.
        act_in: dict = {}
        act_out: dict = {}
        stash: dict = {}
        grad_out: dict = {}
        grad_in: dict = {}
        states = {"act_in": act_in, "act_out": act_out, "stash": stash, "grad_out": grad_out, "grad_in": grad_in}
        host = -(len(program) + 1)
        frees = 0
        # Coverage's B and W, dependency's sends, by (stage, mb); receives are unique
        # exactly when their act_in / grad_out is produced once (checked there).
        b_done: set = set()
        w_done: set = set()
        sent_f: set = set()
        sent_b: set = set()
        comm = 0  # communication instructions
        # _communication's collections, built as there.
        to_peer: dict[int, list] = {}
        from_peer: dict[int, list] = {}
        mine: list[int] = []
        run_start = run_end = -1
        batch = -1
        for index, i in enumerate(program):
            op, s, mb = i.op, i.stage, i.mb
            if s not in own or mb >= m:
                return None
            peer = i.peer
            key = (s, mb)
            if op is FREE:
                if peer is not None:
                    return None
                states_of = states.get(i.buf)
                if states_of is None:
                    return None  # not a buffer name: let the rules decide what fails first
                state = states_of.get(key)
                if state is None or (host < state < 0):
                    return None
                states_of[key] = ~index
                frees += 1
            elif op is F:
                if peer is not None or key in stash:  # second F
                    return None
                stash[key] = index
                if s == 0:
                    act_in[key] = index
                if sends_fwd[s]:
                    act_out[key] = index
                elif s < last:  # local hand-off
                    act_in[(s + 1, mb)] = index
                state = act_in.get(key)
                if state is None or state < 0:
                    return None
            elif op is B:
                if peer is not None or key in b_done:
                    return None
                b_done.add(key)
                if sends_bwd[s]:
                    grad_in[key] = index
                elif s > 0:  # local hand-off
                    grad_out[(s - 1, mb)] = index
                state = act_in.get(key)
                if state is None or state < 0:
                    return None
                state = stash.get(key)
                if state is None or state < 0:
                    return None
                if s < last:
                    state = grad_out.get(key)
                    if state is None or state < 0:
                        return None
            elif op is W:
                if peer is not None or key in w_done or key not in b_done:
                    return None
                w_done.add(key)
                state = stash.get(key)
                if state is None or state < 0:
                    return None
            elif op is OFFLOAD or op is RELOAD:
                if peer is not None:
                    return None
                states_of = states.get(i.buf)
                if states_of is None:
                    return None
                state = states_of.get(key)
                if op is OFFLOAD:
                    if state is None or state < 0:
                        return None
                    states_of[key] = host - index
                else:
                    if state is None or state > host:
                        return None
                    states_of[key] = index
            else:  # SEND_F, RECV_F, SEND_B, RECV_B
                # dependency: a remote neighbour stage, which is the peer (so the peer is
                # in range and not this rank, as coverage wants)
                other = s + 1 if (op is SEND_F or op is RECV_B) else s - 1
                if not 0 <= other < S or placement[other] == rank or peer != placement[other]:
                    return None
                comm += 1
                if index != run_end:  # a new batch, as in _communication
                    if run_end >= 0:
                        batches.append((rank, run_start, run_end))
                    run_start, batch = index, len(batches)
                    mine.append(batch)
                run_end = index + 1
                if op is SEND_F:
                    if key in sent_f:
                        return None
                    sent_f.add(key)
                    state = act_out.get(key)
                    if state is None or state < 0:
                        return None
                    entries = to_peer.get(peer)
                    if entries is None:
                        entries = to_peer[peer] = []
                    entries.append(((((s + 1) * m + mb) << 1), index, batch))  # [Note: tensor ints]
                elif op is SEND_B:
                    if key in sent_b:
                        return None
                    sent_b.add(key)
                    state = grad_in.get(key)
                    if state is None or state < 0:
                        return None
                    entries = to_peer.get(peer)
                    if entries is None:
                        entries = to_peer[peer] = []
                    entries.append(((((s - 1) * m + mb) << 1 | 1), index, batch))
                else:
                    if op is RECV_F:
                        if key in act_in:  # second RECV_F
                            return None
                        act_in[key] = index
                    else:
                        if key in grad_out:  # second RECV_B
                            return None
                        grad_out[key] = index
                    entries = from_peer.get(peer)
                    if entries is None:
                        entries = from_peer[peer] = []
                    entries.append((((s * m + mb) << 1 | (op is RECV_B)), index, batch))
        if run_end >= 0:
            batches.append((rank, run_start, run_end))
        rank_batches.append(mine)
        for p, entries in to_peer.items():
            sends[rank, p] = entries
        for p, entries in from_peer.items():
            recvs[p, rank] = entries
        # The end-of-rank checks of the three rules, by their counts.
        fb = len(stash) + len(b_done)
        if fb + len(w_done) != n_ops * len(stages) * m:  # coverage: an F, B or W missing
            return None
        if fb + comm != _needed_per_microbatch(schedule, stages) * m:  # dependency: a send missing
            return None
        if len(act_in) + len(act_out) + len(stash) + len(grad_out) + len(grad_in) > frees:  # liveness: a leak
            return None
    return sends, recvs, batches, rank_batches


@gc_paused
def verify(schedule: Schedule) -> None:
    """Raises ScheduleError at the first broken rule; returns None for a valid schedule."""
    communication = _passes_walked_rules(schedule)
    if communication is not None:
        # Coverage, dependencies and liveness pass ([Note: merged walk]): the remaining
        # rules in RULES' order name the first error, if any.
        check_matching(schedule, communication)
        check_deadlock(schedule, communication)
        check_caps(schedule)
        return
    for rule in RULES:
        rule(schedule)
