"""The verifier's one walk: rules 1 to 6 proved in one pass over packed programs.

[Note: one walk] The rules of verify.py each walk every instruction (717k at pp=64, v=2,
m=512), and rules 3 and 4 then walk the messages and batches they collected. `passes`
proves all six in one walk over the packed columns ([Note: packed programs]), run in
the order rule 4 describes: each rank runs until it posts a batch some of whose partners
are not yet posted, and parks there; a message posted after its partner completes it,
and a parked rank whose last missing partner posts goes back on the stack ([Note:
event-driven run] in simulate/engine.py is the same loop with times). The rules name the
first error by rule, then rank, then step, which one walk cannot reproduce cheaply, so
the walk never raises: at any failed check it returns False and `verify` runs the rules
one by one, which raise the right error. False is therefore always safe (only slower);
True must come back only when every rule would pass.

What each instruction does is its op's row ([Note: instruction effects] in effects.py),
resolved once per template: the buffers it makes, reads and frees, its message, its
copy, its place in the order of computes, its in-flight step. The checks below name the
ops there are today; an op with other effects is checked by what its row says (`_USE`:
each buffer it makes never made before, each it reads live, each it frees neither never
made nor freed, once per (stage, mb) where it has an order).

What the walk checks, and where:
- once per template of each rank's program, before the walk: its stage runs on that
  rank (coverage), a message's edge is one of the stage graph's, its other stage runs
  on another rank and its peer is another rank (dependency; the walk's count of
  partners needs the last: a partner is another rank, and the rules below would refuse
  such a message anyway); every microbatch is below m (coverage);
- per instruction, on buffer states (`_Walk`): F, B and W run once each, W after its B
  (coverage); each reads live buffers and makes its own; a send's tensor is live
  (dependency, liveness); a FREE, OFFLOAD or RELOAD finds its buffer in a state that
  allows it (liveness); F and B keep the in-flight count within the cap (caps);
- per message, when its second side posts: both sides name the same tensor ([Note:
  tensor ints] in verify.py) (matching);
- per rank at its end: the counts the rules would find (an F, B, W or message missing
  or extra: coverage, dependency; a buffer never freed: liveness);
- at the end: no rank is parked (deadlock; a message never matched leaves its batch
  parked, so matching's "n sends, m receives" shows here too).
Checks of the rules left out because, when every check here passes, they cannot fail:
- a message's peer is the rank of the stage at the other end of its edge: a tensor is
  named by its edge, whose receive names the receiving stage, and a rank whose template
  names a stage it does not run fails; so a message to the wrong rank finds no partner
  of its tensor there (matching, or a deadlock);
- a second send or receive of one (stage, mb): the counts then want one missing, and
  the tensor it stood for reaches no consumer (an F or B that reads a buffer never
  produced) or no partner (matching, deadlock);
- liveness "produced a second time": each buffer key (buffer, stage, peer stage, mb)
  has one producer, unique by coverage (F: stash, act_out, local act_in; B: grad_in,
  local grad_out) or by the above (RECV_F / RECV_B of an edge between ranks, never one
  a local hand-off also produces);
- dependency's "F runs before its input arrives": F's use of each producer's act_in
  needs it produced, by RECV_F of a remote producer or by F of a local one, which is
  exactly what dependency asks for (stage 0 needs nothing); likewise B's use of each
  consumer's grad_out covers B's input gradients (the last stage needs nothing);
- coverage's "B before its F": B's use of stash needs it produced, and only F(s, mb)
  produces stash (s, mb).
The counts at a rank's end are the rules' own: each key is one a rule wants, each once,
so a count that agrees means nothing is missing; and since every buffer is produced once
(above), a rank whose FREEs (each of a produced buffer, once) number its productions has
no leak. tests/compiler/test_verify_walk.py pins this walk to the rules (a differential
test on valid and edited schedules of every family, with offload and caps, and every
single edit of small ones); each check above, removed in turn, fails it;
tests/compiler/test_effects.py adds an op and checks both on it. A forward-only
schedule is left to the separate rules (False): evaluation schedules are small and rare.
"""

from __future__ import annotations

from pipeschedule.compiler.effects import (
    BACKWARD, COMM_OPS, COPY, COVERED, EFFECTS, HANDED, INSTANT, NAMED, SEND, SIDE, allowed, covered_ops, keys_of,
)
from pipeschedule.compiler.instr import BUFFERS
from pipeschedule.compiler.ir import Schedule
from pipeschedule.compiler.program import Template, packed, used_ids
from pipeschedule.errors import FormatError

# What the walk does with an instruction, by its template's row ([Note: instruction
# effects] in effects.py): messages last (`>= _SEND`). _COMPUTE: a compute that frees
# nothing (F, B, W); _USE: any other op that makes, reads or frees buffers, checked the
# same way, but slower; _FREE: an op that frees its named buffer and does nothing else.
_FREE, _COMPUTE, _USE, _OFFLOAD, _RELOAD, _SEND, _RECV = range(7)
# The ops of _FREE: instant, freeing the buffer they name and touching no other (FREE).
_FREES_ONLY = frozenset(op for op, row in EFFECTS.items()
                        if row.kind == INSTANT and row.frees == (NAMED,) and not row.makes and not row.reads)


def message_edge(i) -> tuple[tuple[int, int], int]:
    """(the edge (producer, consumer) message `i` (an Instr or a Template) travels on, the
    stage at its other end): its `peer_stage`, or the neighbour ([Note: peer stage])."""
    step = SIDE[EFFECTS[i.op].buffer]
    other = i.stage + step if i.peer_stage is None else i.peer_stage
    return ((i.stage, other) if step == 1 else (other, i.stage)), other


def recorded_ops(schedule: Schedule) -> tuple:
    """The computes check_dependencies records, those a compute of another stage may wait
    for: each covered compute that hands a buffer over (F, B; [Note: instruction effects])."""
    return tuple(op for op in covered_ops(schedule) if any(role in HANDED for role in EFFECTS[op].makes))


def message_sides(schedule: Schedule) -> tuple[int, ...]:
    """The side of the edge of each message op `schedule` may hold (SEND_F: +1, ...)."""
    return tuple(SIDE[EFFECTS[op].buffer] for op in COMM_OPS if allowed(schedule, op))


def messages_per_microbatch(schedule: Schedule, stages, sides=None) -> int:
    """The messages a rank running `stages` sends and receives per microbatch: one of each
    message op the schedule may hold per edge across ranks on its buffer's side (two per
    edge in training, one in a forward-only schedule). `sides`: `message_sides(schedule)`."""
    sides = message_sides(schedule) if sides is None else sides
    if not sides:
        return 0
    producers = sum(len(schedule.remote_producers(s)) for s in stages) if min(sides) < 0 else 0
    consumers = sum(len(schedule.remote_consumers(s)) for s in stages) if max(sides) > 0 else 0
    return sum(producers if side < 0 else consumers for side in sides)


def needed_per_microbatch(schedule: Schedule, stages) -> int:
    """How many of F, B and transfers (what check_dependencies records) a rank running
    `stages` has per microbatch: the recorded computes of each stage (`recorded_ops`), and
    each stage's messages (`messages_per_microbatch`)."""
    return len(recorded_ops(schedule)) * len(stages) + messages_per_microbatch(schedule, stages)


def passes(schedule: Schedule) -> bool:
    """True when every rule of verify.py holds for `schedule`, False when some check of
    [Note: one walk] fails (or the schedule is forward-only)."""
    if schedule.forward_only:
        return False
    try:
        caps = schedule.caps()
    except FormatError:  # check_caps reports it, after the rules before it
        return False
    walk = _Walk(schedule, caps)
    if not walk.ready:
        return False
    stack = walk.stack
    while stack:
        if not walk.advance(stack.pop()):
            return False
    return walk.finished == schedule.pp


class _Walk:
    """The state of [Note: one walk]: per template what its instructions do (`act`) and
    with which tables (`arg`); per rank its columns, where it stands and what it has
    counted; the ranks that can run (`stack`) and the partners each parked rank waits
    for (`waiting`). `ready` is False when a template sits on a rank it cannot.

    Buffer states use check_liveness' encoding ([Note: buffer states] in verify.py) with
    one more value for a buffer not yet produced, NEVER = -(n + 1) (n: the longest
    program), and HOST = -(n + 2): a step's own freed state ~pc lies in -n..-1, so every
    state below 0 (freed, never produced, on the host) is unusable, every one strictly
    between HOST and 0 (freed or never produced) cannot be freed, every one above HOST
    cannot be reloaded, and no check needs to ask for None. They live in one list per
    buffer, stage and peer stage (`state`), indexed by mb (a stage's keys belong to one
    rank, so ranks never share an entry)."""

    def __init__(self, schedule: Schedule, caps) -> None:
        self.schedule = schedule
        S, m, pp = schedule.num_stages, schedule.microbatches, schedule.pp
        self.templates, self.ids, self.mbs = packed(schedule.programs)
        self.used = used_ids(schedule.programs, self.ids)  # per rank, the templates its program uses
        self.stages: list[list[int]] = [[] for _ in range(pp)]  # per rank, its stages
        for s, r in enumerate(schedule.placement):
            self.stages[r].append(s)
        longest = max(map(len, self.ids))
        self.never, self.host = -(longest + 1), -(longest + 2)
        self.states: dict = {buf: {} for buf in BUFFERS}  # [buf][stage, peer_stage] -> the states by mb
        self.done = {op: [[False] * m for _ in range(S)] for op in COVERED}
        self.S, self.m, self.placement, self.edges = S, m, schedule.placement, schedule.graph.index
        self.covered = covered_ops(schedule)  # the computes each (stage, mb) runs, in order
        self.sides = message_sides(schedule)
        self.after = {op: self._before(op) for op in self.covered}  # a compute -> the one it must follow, or None
        self.channels: dict[tuple[int, int], tuple[list, list]] = {}  # (src, dst) -> tensors sent, received
        self.owner, self.act, self.arg = [], [], []
        for t in self.templates:
            owner, act, arg = self._template(t)
            self.owner.append(owner)
            self.act.append(act)
            self.arg.append(arg)
        self.caps = caps if caps is not None else [len(ids) for ids in self.ids]  # in flight never exceeds these
        self.steps = self._steps(caps is not None)
        self.at = [[0, 0, 0, 0, 0, 0] for _ in range(pp)]  # per rank: pc, computes, messages, made, moves, in flight
        self.waiting = [0] * pp
        self.stack = list(range(pp - 1, -1, -1))  # rank 0 first
        self.finished = 0
        self.ready = all(self._placed(r) for r in range(pp))
        # what `advance` reads, gathered once: per rank, and shared by all
        self.ranks = [(ids, mbs, at, cap, len(ids))
                      for ids, mbs, at, cap in zip(self.ids, self.mbs, self.at, self.caps)]
        self.shared = self.act, self.arg, self.steps, self.host, self.waiting, self.stack

    def state(self, buf: str, stage: int, other: int | None) -> list:
        """The states by mb of buffer `buf` of `stage` and peer stage `other` ([Note: peer
        stage]), made on first use."""
        found = self.states[buf].get((stage, other))
        if found is None:
            found = self.states[buf][stage, other] = [self.never] * self.m
        return found

    def _template(self, t: Template) -> tuple:
        """(the rank where instructions of `t` may run, or -1 for none; what they do;
        with which tables), from its row ([Note: instruction effects])."""
        s, row = t.stage, EFFECTS[t.op]
        if s >= self.S:
            return -1, None, None
        owner = self.placement[s]
        if row.message:
            return self._message(t, row, owner)
        state = self.state
        if t.op in _FREES_ONLY:
            return owner, _FREE, state(t.buf, s, t.peer_stage)  # FREE (most templates): nothing to resolve
        keys = keys_of(self.schedule, t.op, s, t.peer_stage, t.buf)
        if row.kind == COPY:
            return owner, _OFFLOAD if row.moves_to == "host" else _RELOAD, state(*keys.moves[0])
        makes, uses = tuple(state(*key) for key in keys.makes), tuple(state(*key) for key in keys.reads)
        if row.kind == INSTANT and row.frees == (NAMED,) and not makes and not uses:
            return owner, _FREE, state(*keys.frees[0])
        flags = before = None
        if row.order is not None:
            flags = self.done[t.op][s]
            after = self.after.get(t.op)
            before = self.done[after][s] if after is not None else None
        if row.frees or flags is None or row.kind != "compute":
            return owner, _USE, (flags, makes, uses, before, tuple(state(*key) for key in keys.frees))
        return owner, _COMPUTE, (flags, makes, uses, before)

    def _message(self, t: Template, row, owner: int) -> tuple:
        """`_template` of a message: its buffer's states, its channel's two lists of tensors,
        its tensor ([Note: tensor ints] in verify.py), its peer."""
        S, m, placement = self.S, self.m, self.placement
        sending, step, s = row.kind == SEND, SIDE[row.buffer], t.stage
        other = s + step if t.peer_stage is None else t.peer_stage
        edge = (s, other) if step == 1 else (other, s)  # `message_edge`, inlined
        if not 0 <= other < S or edge not in self.edges or placement[other] == owner or t.peer == owner:
            # no such edge, or none between ranks; or a message to its own rank, which the
            # rules refuse anyway (it waits on itself) but which would break the count of
            # partners `advance` keeps per parked rank: a partner is another rank
            return -1, None, None
        sent, received = self.channels.setdefault((owner, t.peer) if sending else (t.peer, owner), ([], []))
        mine, theirs = (sent, received) if sending else (received, sent)
        tensor = (((edge[0] * S + edge[1]) * m) << 1) | (row.phase == BACKWARD)  # [Note: tensor ints]
        return owner, _SEND if sending else _RECV, (self.state(row.buffer, t.stage, t.peer_stage), mine, theirs,
                                                     tensor, t.peer)

    def _before(self, op):
        """The compute that must run before `op` on its (stage, mb) (rule coverage: the one
        before it in order), or None where reading a buffer only that one makes already
        proves it ran (B reads the stash F makes; W reads nothing B makes)."""
        ops = self.covered
        k = ops.index(op)
        if k == 0:
            return None
        prev = EFFECTS[ops[k - 1]]
        if any(role in prev.makes and SIDE.get(role) == 0 for role in EFFECTS[op].reads):
            return None
        return ops[k - 1]

    def _steps(self, capped: bool) -> list[int]:
        """Per template, what an instruction of it adds to its rank's in-flight count (its
        row's `inflight`: +1 for F, -1 for B, 0 for the rest; 0 for every one without caps)."""
        return [EFFECTS[t.op].inflight if capped and (act == _COMPUTE or act == _USE) else 0
                for t, act in zip(self.templates, self.act)]

    def _placed(self, rank: int) -> bool:
        """Whether every template rank's program uses may run there, and every mb is in range."""
        mbs = self.mbs[rank]
        if mbs and max(mbs) >= self.schedule.microbatches:
            return False
        owner = self.owner
        return all(owner[k] == rank for k in self.used[rank])

    def advance(self, r: int) -> bool:
        """Runs rank r from where it stands until it parks on a batch some of whose
        partners have not posted, or ends; False at the first failed check. One loop on
        purpose: posting a batch through a method of its own made the walk of zbv at pp=64,
        m=128 10-20% slower (three alternating runs, 2026-12-07), where its many small
        batches each paid the call."""
        ids, mbs, at, cap, n = self.ranks[r]
        act, arg, steps, host, waiting, stack = self.shared
        pc, computes, messages, made, moves, inflight = at
        while pc < n:
            k = ids[pc]
            a = act[k]
            if a == _FREE:
                states_of = arg[k]
                mb = mbs[pc]
                if host < states_of[mb] < 0:  # never produced, or freed
                    return False
                states_of[mb] = ~pc
            elif a == _COMPUTE:
                flags, makes, uses, before = arg[k]
                mb = mbs[pc]
                if flags[mb] or (before is not None and not before[mb]):  # a second one, W before its B
                    return False
                flags[mb] = True
                for states_of in makes:
                    states_of[mb] = pc
                made += len(makes)
                for states_of in uses:
                    if states_of[mb] < 0:
                        return False
                step = steps[k]
                if step:
                    inflight += step
                    if inflight > cap:
                        return False
                computes += 1
            elif a >= _SEND:  # a batch: this message and the ones right after it
                missing = 0
                while True:
                    buffer, mine, theirs, tensor, peer = arg[k]
                    mb = mbs[pc]
                    if a == _SEND:  # its tensor live
                        if buffer[mb] < 0:
                            return False
                    else:
                        buffer[mb] = pc
                        made += 1
                    tensor += mb << 1
                    j = len(mine)
                    mine.append(tensor)
                    if len(theirs) > j:  # its partner posted first, and is parked on it
                        if theirs[j] != tensor:
                            return False
                        waiting[peer] -= 1
                        if not waiting[peer]:
                            stack.append(peer)
                    else:
                        missing += 1
                    messages += 1
                    pc += 1
                    if pc == n:
                        break
                    k = ids[pc]
                    a = act[k]
                    if a < _SEND:
                        break
                if missing:  # parked until the partners post
                    waiting[r] = missing
                    at[:] = pc, computes, messages, made, moves, inflight
                    return True
                continue
            elif a == _USE:
                if not self.use(arg[k], mbs[pc], pc, steps[k], inflight, cap):
                    return False
                flags, makes, _, _, frees = arg[k]
                made += len(makes) - len(frees)  # a buffer freed here is one less for a FREE to free
                if flags is not None:
                    computes += 1
                else:
                    moves += 1  # (not a FREE: the count of FREEs at the end leaves it out)
                inflight += steps[k]
            else:  # OFFLOAD needs the buffer on the device, RELOAD on the host
                states_of = arg[k]
                mb = mbs[pc]
                if states_of[mb] < 0 if a == _OFFLOAD else states_of[mb] > host:
                    return False
                states_of[mb] = host - pc if a == _OFFLOAD else pc
                moves += 1
            pc += 1
        at[:] = pc, computes, messages, made, moves, inflight
        self.finished += 1
        return self._counts_agree(r, computes, messages, made, n - computes - messages - moves)

    def use(self, arg, mb: int, pc: int, step: int, inflight: int, cap: int) -> bool:
        """The checks of an instruction of `_USE` ([Note: instruction effects]): once, after
        the compute before it (where its op has an order), each buffer it makes never made
        before (the walk's proof takes every buffer's producer to be unique: a second one
        is left to the rules), each it reads live, each it frees neither never made nor
        freed, the cap."""
        flags, makes, uses, before, frees = arg
        if flags is not None:
            if flags[mb] or (before is not None and not before[mb]):
                return False
            flags[mb] = True
        for states_of in makes:
            if states_of[mb] != self.never:
                return False
            states_of[mb] = pc
        if any(states_of[mb] < 0 for states_of in uses):
            return False
        for states_of in frees:
            if self.host < states_of[mb] < 0:
                return False
            states_of[mb] = ~pc
        return inflight + step <= cap

    def _counts_agree(self, rank: int, computes: int, messages: int, made: int, frees: int) -> bool:
        """The counts at a rank's end ([Note: one walk]): every covered compute there (F, B,
        and W where split), every message, and as many FREEs as buffers made."""
        schedule = self.schedule
        stages = self.stages[rank]
        if computes != len(self.covered) * len(stages) * schedule.microbatches:  # coverage: one missing
            return False
        if messages != messages_per_microbatch(schedule, stages, self.sides) * schedule.microbatches:  # dependency
            return False  # a message missing, or one too many
        return made == frees  # liveness: a leak
