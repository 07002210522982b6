"""The simulator's engine: runs the programs of a lowered schedule event by event, with
the semantics below (`simulate` in this package's __init__ is the entry point, cost.py
the cost model).

[Note: simulated semantics]
- A rank runs its program in order. F, B and W take their stage's cost; FREE takes no
  time.
- A maximal run of consecutive communication instructions is one batch, posted when the
  rank reaches it. For each ordered rank pair (a, b), the k-th send a->b matches the
  k-th receive on b from a. Sends are asynchronous: posting one costs the sender no time
  and never holds it up (the runtime posts them with `batch_isend_irecv` and only waits
  for them before their buffer is reused). A message completes at
  max(post time of the send, post time of the receive) + latency + bytes / bandwidth
  (bytes: act_out of the sending stage for SEND_F, grad_in for SEND_B): the transfer
  starts once both sides are posted, as NCCL's does. The rank resumes when the last
  receive of its batch completes. A receive whose send is never posted deadlocks the
  schedule: `ScheduleError(rule="deadlock")` names the stuck ranks. (The verifier's
  rule 4 is stricter, treating every send as blocking until its receive is posted, so a
  verified schedule is deadlock-free whether or not the transport buffers sends.)

[Note: when bytes count] A buffer's bytes count from the *start* of the instruction that
produces it (memory is allocated before it is written) until its FREE:
- F(s) produces act_out (when the output leaves the rank), stash, act_in on stage 0
  (the data loader's input) and act_in of s+1 when s+1 runs on the same rank;
- B(s) produces grad_in (when the gradient leaves the rank) and grad_out of s-1 when
  s-1 runs on the same rank;
- on a stage graph ([Note: stage graph] in compiler/graph.py) the buffers of edges are
  one per edge: F(s) produces an act_out per consumer on another rank and the act_in of
  each consumer on its rank, B(t) a grad_in per producer on another rank and the
  grad_out of each producer on its rank; each holds its stage's bytes of its kind (the
  cost's figures are per stage, so every edge of a stage counts the same), and each
  message carries the bytes of its sender's act_out or grad_in, as on a chain;
- RECV_F / RECV_B produce act_in / grad_out when their batch is posted (a receive
  buffer exists before the message lands).
- In a schedule with W and a cost with `weight_stash`, B(s) resizes its stash at its
  *end* to weight_stash[s] (autograd has freed what only B needed; W keeps its inputs
  and output gradients until the FREE after it), as the runtime's ledger does
  (`Ledger.resize`). The ledger resizes before it adds B's grad_in, while here grad_in
  counts from B's start, so the simulated peak can exceed the ledger's by at most one
  grad_in (or local grad_out) per rank: during B the allocator holds both.
Live bytes, and so the peak, therefore depend on program order only; time only places
the points of the curve (except where OFFLOAD moves bytes, below).

[Note: host link] Each rank has a link to host memory with a bandwidth per direction
(`offload_bandwidth` device->host, `reload_bandwidth` host->device; infinite by default,
so that offload then costs nothing). Copies are queued per direction in program order;
compute overlaps them (slowed by `offload_slowdown` over the part of a compute that
overlaps a running copy; 0 by default, as measured on the H200: a 1 GiB copy on a side
stream beside bf16 matmuls cost them 2%).
- OFFLOAD of a buffer takes no time on the rank. Its copy starts when the device->host
  queue is free, and lasts bytes / offload_bandwidth. The host holds the bytes from the
  OFFLOAD; the device releases them when the copy lands.
- RELOAD allocates the device bytes at once; its copy starts when the host->device queue
  is free (and the buffer's own offload has landed), lasts bytes / reload_bandwidth, and
  releases the host bytes when it lands. An instruction that reads the buffer (F, B, W of
  its (stage, mb); SEND_F / SEND_B for act_out / grad_in) does not start before then.
- FREE releases whichever copies exist; an unfinished copy of a freed buffer is dropped.
- A rank's finish time is that of its last instruction: a copy still running then (only
  one that is never waited for) does not count.
With offload the device peak depends on time as well as on program order; `peak_host_bytes`
reports the most bytes each rank held on the host.

[Note: simulated streaming] With `offload_chunk` set, a stash offloaded before its B (an
OFFLOAD between its F and its B) streams, as the runtime does with `offload_chunk`
([Note: streamed offload] in runtime/stream_offload.py): it moves in n = ceil(stash /
chunk) equal pieces, copied out while F saves them and back while B consumes them.
- F: piece j is produced over the j-th n-th of the F; it counts on the device from the
  start of that part, its copy starts at the end of it (or once the device->host queue
  is free), and the device releases it when the copy lands. The OFFLOAD after the F
  issues nothing more; it ends when the last piece lands.
- RELOAD issues the copies back of the last `reload_window` pieces (backward consumes
  what forward saved last first), each counted on the device from then.
- B starts once the piece it consumes first has landed (as a B waits for a whole
  RELOAD), then consumes the pieces last saved first, each for its share of the B's
  time (its share of the bytes). It starts on a later piece only once that piece has
  landed (a wait lengthens the B; busy time does not count it), and starting on a piece issues the
  copy back of the piece `reload_window` further down. Without W a piece leaves the
  device when its share ends (autograd releases saved tensors node by node), so the FREE
  after the B releases nothing more; with W every piece stays until the stash's FREE
  (an upper bound: the runtime keeps only what W needs). A B without a RELOAD before it
  (which the verifier rejects) issues the window at its own start.
- An OFFLOAD after the B (between B and W) moves what is left whole, as without
  streaming.
- The slowdown applies over the copies queued when a compute starts; a streamed F is
  also slowed over the part of it that its own pieces' copies run beside (and earlier
  copies do not), its pieces keeping the pace set by the earlier copies alone.
With one piece per stash (a chunk at least every stash) and no slowdown, a streamed
schedule simulates exactly as the whole-stash one: same step time and peaks. Where the
runtime differs ([Note: streamed offload] in runtime/stream_offload.py): its chunks are
whole storages (a storage larger than the chunk is one larger chunk), and a chunk still
being copied out when its RELOAD comes stays on the device instead of coming back.

[Note: replayed memory] Without OFFLOAD, RELOAD, streamed or resized stashes, a rank's live
bytes change only at the instructions of [Note: when bytes count], by amounts fixed by
program order, at the start of each (a receive's: its batch's post), which `EventLog`
derives from the ends anyway. Such a schedule ("plain") therefore runs a loop that
counts time alone (`_Run.advance_plain`: about 40% less time than the general loop at
pp=64, v=2, m=512); each rank's peak is the largest running sum of its instructions'
byte changes in program order (the same additions in the same order as the general
loop's, so the same number), and `MemoryCurves` replays a rank's changes from its
program and its start times when the curve is first read. The general loop
(`_Run.advance`) writes the curves as it goes (the host link adds points of its own).
The plain loop posts its batches inline, a copy of `post_batch` less the host link and
the curves (a call per batch cost 12% of the plain run); tests/simulate/test_simulate.py
pins the plain run to the general one, field by field: ends, channels, busy time,
in-flight and byte peaks, events and curves.

[Note: event-driven run] Ranks wait on each other only at communication batches, so a
rank runs straight through its program until it posts a batch some of whose partners
are not yet posted. It then parks, holding a count of missing partners. Posting an op
whose partner was posted earlier decrements the partner rank's count; at zero that rank
goes back on the work stack. Every instruction is visited once and every message
touched twice, so a run is O(instructions). A message's times depend only on the post
times of its two batches, so the order in which parked ranks resume does not change
any result. When the stack empties with a rank still parked, the schedule deadlocks.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Iterator, NamedTuple, Sequence

from pipeschedule.errors import ScheduleError
from pipeschedule.compiler.offload import streamed_stashes
from pipeschedule.simulate.hostlink import HostLink
from pipeschedule.compiler.effects import COPY, EFFECTS, INSTANT, RECV, SEND, bytes_of, keys_of
from pipeschedule.compiler.ir import COMM_OPS, SEND_OPS, Instr, Schedule
from pipeschedule.compiler.program import Template, check_stages, packed, used_ids

MOVE_OPS = frozenset(op for op, row in EFFECTS.items() if row.kind == COPY)  # OFFLOAD, RELOAD


class Event(NamedTuple):
    """One executed instruction: `program[rank][index]` ran from `start` to `end`."""

    rank: int
    index: int
    instr: Instr
    start: float
    end: float


class EventLog(Sequence[Event]):
    """Every executed instruction as an `Event`, rank by rank in program order.

    Only the end of each instruction is stored (None for FREE, which takes no time; the
    post for a send, whose end is its message's, found from `channels`); start times are
    derived per rank on first use, and `Event` objects are made only when read, because
    a large schedule has about a million of them.
    """

    def __init__(self, programs, ends, waits=None, channels=None) -> None:
        self._programs, self._ends = programs, ends
        self._waits = waits or [{} for _ in programs]  # per rank: pc -> start of a compute that waited for a RELOAD
        # as `run` keeps them: (src << 32 | dst) -> (send posts, message times, receive posts)
        self._channels = channels or {}
        self._times: dict[int, tuple[list, list]] = {}  # rank -> (starts, ends), on demand
        self._packed = None  # the programs' `packed` columns, on demand
        self._offsets = [0, *accumulate(len(p) for p in programs)]

    def times(self, rank: int) -> tuple[list, list]:
        """(starts, ends) of every instruction of `rank`. A rank's clock moves with each
        compute; a communication op starts when its batch is posted and ends when its
        message completes, and the clock moves to the end of the batch's last receive (a
        send does not hold its rank: [Note: simulated semantics]); a FREE starts and ends
        at the clock; an OFFLOAD or RELOAD starts at the clock and ends when its copy
        lands, leaving the clock where it is."""
        if rank not in self._times:
            if self._packed is None:
                self._packed = packed(self._programs)
            templates, ids, _ = self._packed
            starts, ends, clock, post = [], [], 0, None
            waits = self._waits[rank]
            sent: dict[int, int] = {}  # peer -> sends to it so far: the k of the next one
            for pc, (k, end) in enumerate(zip(ids[rank], self._ends[rank])):
                op, peer = templates[k].op, templates[k].peer
                if op in COMM_OPS:
                    if post is None:
                        post = batch_end = clock
                    starts.append(post)
                    if op in SEND_OPS:
                        j = sent.get(peer, 0)
                        sent[peer] = j + 1
                        end = self._message_end(rank << 32 | peer, j, end)
                    elif end > batch_end:
                        batch_end = end
                else:
                    if post is not None:
                        clock, post = batch_end, None
                    if waits and pc in waits:
                        clock = waits[pc]
                    starts.append(clock)
                    if end is None:
                        end = clock
                    elif op in MOVE_OPS:
                        ends.append(end)
                        continue
                    clock = end
                ends.append(end)
            self._times[rank] = starts, ends
        return self._times[rank]

    def _message_end(self, channel: int, k: int, post):
        """When the k-th message of `channel` completes: max(its two posts) plus its
        message time, as a receive's end (`post` where it is never received)."""
        found = self._channels.get(channel)
        if found is None or k >= len(found[2]):
            return post
        sends, msgs, recvs = found
        done = sends[k] if sends[k] > recvs[k] else recvs[k]
        return done + msgs[k] if msgs[k] else done

    def __len__(self) -> int:
        return self._offsets[-1]

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"event {index} out of range 0..{len(self) - 1}")
        rank = bisect_right(self._offsets, index) - 1
        pc = index - self._offsets[rank]
        starts, ends = self.times(rank)
        return Event(rank, pc, self._programs[rank][pc], starts[pc], ends[pc])

    def __iter__(self) -> Iterator[Event]:
        for rank in range(len(self._programs)):
            yield from self.of_rank(rank)

    def of_rank(self, rank: int) -> Iterator[Event]:
        """The events of one rank, in program order."""
        starts, ends = self.times(rank)
        for pc, instr in enumerate(self._programs[rank]):
            yield Event(rank, pc, instr, starts[pc], ends[pc])

    def __eq__(self, other) -> bool:
        if isinstance(other, EventLog):
            return (self._programs, self._ends) == (other._programs, other._ends)
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"EventLog({len(self)} events)"


@dataclass
class Trace:
    """Raw per-rank results of `run`."""

    finish: list
    busy: list
    peak_inflight: list
    peak_bytes: list
    memory: list | None  # per rank: (times, live bytes) lists of equal length, every change as it happened
    ends: list  # per rank: end of each instruction, None for FREE
    peak_host_bytes: list  # per rank: the most bytes held in host memory by OFFLOAD
    waits: list  # per rank: pc -> start of each compute that waited for a RELOAD
    channels: dict  # (src << 32 | dst) -> (send posts, message times, receive posts), message by message
    replay: _Replay | None = None  # where `memory` is None: the changes, replayed ([Note: replayed memory])


def _point(times: list, values: list, t, live) -> None:
    """Adds (t, live) to a memory curve. Changes at one instant are folded into at most
    two points, the highest value reached at t and the value after, so the curve's
    maximum is always the peak even when a buffer lives for no time at all."""
    if times[-1] != t:
        times.append(t)
        values.append(live)
    elif len(times) >= 2 and times[-2] == t:
        if live > values[-2]:
            values[-2] = live
        values[-1] = live
    elif live >= values[-1]:
        values[-1] = live
    else:
        times.append(t)
        values.append(live)


def _change(times: list, values: list, t, live) -> None:
    """Records (t, live) as it happened; `MemoryCurves` folds a rank's changes with
    `_point` when the curve is first read (the same points, and nothing to pay in the run
    loop or for a caller that never reads them)."""
    times.append(t)
    values.append(live)


class MemoryCurves(Sequence):
    """Per rank, the (time, live bytes) step curve of `SimResult.memory`: the changes `run`
    recorded (or, where it recorded none, `replay`'s, timed by `events`: [Note: replayed
    memory]), folded by `_point` on first read of each rank."""

    def __init__(self, changes: list[tuple[list, list]] | None, replay: _Replay | None = None,
                 events: EventLog | None = None) -> None:
        self._changes, self._replay, self._events = changes, replay, events
        self._curves: dict[int, tuple] = {}

    def __getitem__(self, rank):
        if isinstance(rank, slice):
            return tuple(self[r] for r in range(*rank.indices(len(self))))
        rank = range(len(self))[rank]  # negative indices; IndexError past the end
        if rank not in self._curves:
            if self._changes is None:
                times, values = self._replay.changes(rank, self._events.times(rank)[0])
            else:
                times, values = self._changes[rank]
            folded_t, folded_v = [times[0]], [values[0]]
            for t, live in zip(times[1:], values[1:]):
                _point(folded_t, folded_v, t, live)
            self._curves[rank] = tuple(zip(folded_t, folded_v))
        return self._curves[rank]

    def __len__(self) -> int:
        return len(self._changes) if self._changes is not None else len(self._replay.ids)

    def __eq__(self, other) -> bool:
        if isinstance(other, (MemoryCurves, tuple, list)):
            return len(self) == len(other) and all(a == tuple(b) for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))


class _Replay:
    """The memory changes of ranks that `run` did not write ([Note: replayed memory]): the
    bytes each instruction adds or releases, by template, as `_Run` counts them."""

    def __init__(self, templates, ids, act, nbytes) -> None:
        self.templates, self.ids, self.act, self.nbytes = templates, ids, act, nbytes
        # per template, the change of live bytes an instruction of it makes
        self.change = [-b if a == _FREE else b if a == _COMPUTE or a == _RECV else 0 for a, b in zip(act, nbytes)]

    def peak(self, ids) -> float:
        """The most live bytes of a rank whose program has these template ids: the
        largest running sum of its changes, from 0."""
        return max(accumulate(map(self.change.__getitem__, ids), initial=0))

    def changes(self, rank: int, starts: list) -> tuple[list, list]:
        """(times, live bytes) of every change on `rank`, as `_Run` writes them; `starts`:
        each instruction's start (`EventLog.times`)."""
        act, nbytes = self.act, self.nbytes
        times, values, live = [0], [0], 0
        for k, t in zip(self.ids[rank], starts):
            a = act[k]
            if a == _FREE:
                live -= nbytes[k]
            elif a == _COMPUTE:
                if not nbytes[k]:  # W: no bytes
                    continue
                live += nbytes[k]
            elif a == _RECV:
                live += nbytes[k]
            else:  # SEND_F, SEND_B: no bytes (OFFLOAD, RELOAD: never replayed)
                continue
            times.append(t)
            values.append(live)
        return times, values


def _complete(ops, end, ends):
    """Completes the ops of a batch that were waiting for their partners (all posted by
    now): writes each op's message completion into `ends` and returns the batch's end,
    at least `end` ([Note: simulated semantics]). `ops`: (channel, k, pc) of each."""
    for (send_posts, send_msgs, recv_posts), k, pc in ops:
        done = max(send_posts[k], recv_posts[k])
        if send_msgs[k]:
            done += send_msgs[k]
        ends[pc] = done
        if done > end:
            end = done
    return end


def run(schedule: Schedule, cost) -> Trace:
    """Simulate `schedule` (lowered) under `cost`; see [Note: event-driven run].

    Per rank, `ends[pc]` is the end of instruction pc (None for FREE, which takes no
    time; the landing of its copy for OFFLOAD and RELOAD); `EventLog` derives the start
    times from them. OFFLOAD and RELOAD go to the rank's `HostLink`, which also sees
    every buffer-touching instruction while some buffer of the rank is moved. The memory
    curves are replayed when read where nothing moves ([Note: replayed memory])."""
    return _Run(schedule, cost).trace()


class _RankState:
    """Where a rank stands between two runs of `_Run.advance`: its next instruction, its
    clock, live and peak device bytes, (stage, mb) in flight and their peak, busy time."""

    __slots__ = ("pc", "t", "live", "peak", "inflight", "peak_inflight", "busy")

    def __init__(self) -> None:
        self.pc = self.t = self.live = self.peak = self.inflight = self.peak_inflight = self.busy = 0


# What the run does with an instruction, by its template's row ([Note: instruction effects]
# in compiler/effects.py): _FREE releases bytes (an instant op that frees); _COMPUTE takes
# its time, with the bytes it makes counted from its start and its in-flight step (a
# compute, or an instant op that frees nothing: no time, no bytes); messages; copies.
_FREE, _COMPUTE, _SEND, _RECV, _OFFLOAD, _RELOAD = range(6)


def message_time(cost, nbytes) -> float:
    """A message's time: latency + bytes / bandwidth. Infinite bandwidth adds exactly
    `latency`, so exact (e.g. Fraction) costs stay exact."""
    return cost.latency + nbytes / cost.bandwidth if cost.bandwidth != math.inf else cost.latency


def _act(row) -> int:
    if row.kind == SEND or row.kind == RECV:
        return _SEND if row.kind == SEND else _RECV
    if row.kind == COPY:
        return _OFFLOAD if row.moves_to == "host" else _RELOAD
    return _FREE if row.kind == INSTANT and row.frees else _COMPUTE


class _Run:
    """One simulated step: the schedule's programs as columns and, per template, what an
    instruction of it does, its bytes and its time ([Note: packed programs]); each rank's
    state, the message channels and the ranks parked on a batch ([Note: event-driven
    run]). `advance_plain` and `advance` are the loops over instructions, the first for
    a schedule where nothing moves ([Note: replayed memory]), the second for any; they run
    a million times for pp=64, m=512, so they read everything through local variables.
    `advance` calls out for what is rare (a copy to or from the host, a streamed or
    resized stash) and once per batch of messages. `general`: run the general loop
    whatever the schedule (tests compare the two)."""

    def __init__(self, schedule: Schedule, cost, general: bool = False) -> None:
        self.schedule, pp = schedule, schedule.pp
        stash = cost.buffer_bytes["stash"]
        self.stash = stash
        self.free_bytes = dict(cost.buffer_bytes)
        self.b_shrink = None  # per stage: bytes a B releases at its end, < 0 for growth ([Note: when bytes count])
        if cost.weight_stash is not None and schedule.split_backward:
            self.b_shrink = [whole - kept for whole, kept in zip(stash, cost.weight_stash)]
            self.free_bytes["stash"] = cost.weight_stash
        self.cost = cost
        self.programs = schedule.programs
        self.templates, self.ids, self.mbs = packed(schedule.programs)
        self.used = used_ids(schedule.programs, self.ids)  # per rank, the templates its program uses
        self.act, self.nbytes, self.spend, self.steps, self.reads = self._per_template()
        # channel (src << 32 | dst) -> (post times of its sends, their message times, post
        # times of its receives); entry k of each belongs to the channel's k-th message.
        # A peer that is not a rank gets a channel nobody posts to, so it deadlocks.
        self.channels: dict[int, tuple] = {}
        self.chan = [self._rank_channels(r) for r in range(pp)]  # per rank, by template: a message's channel
        self.ends = [[None] * len(ids) for ids in self.ids]
        self.memory = [([0], [0]) for _ in range(pp)]
        self.links = [HostLink(cost.offload_bandwidth, cost.reload_bandwidth, cost.offload_slowdown, *self.memory[r],
                               _change, cost.offload_chunk, cost.reload_window) for r in range(pp)]
        self.streamed = [streamed_stashes(p) or None for p in self.programs] if cost.offload_chunk is not None \
            else [None] * pp
        self.states = [_RankState() for _ in range(pp)]
        self.parked = [None] * pp  # per rank: (waiting ops, end so far, first pc) of its parked batch
        self.waiting = [0] * pp  # per rank: partners its parked batch still misses
        self.stack = list(range(pp - 1, -1, -1))  # ranks that can run, rank 0 first
        # What each call of `advance` and `post_batch` reads, gathered once.
        self.parts = [(self.ids[r], self.mbs[r], self.ends[r], *self.memory[r], self.links[r]) for r in range(pp)]
        self.special = [streamed is not None or self.b_shrink is not None for streamed in self.streamed]
        moving = {k for k, a in enumerate(self.act) if a == _OFFLOAD or a == _RELOAD}
        moves = any(not moving.isdisjoint(used) for used in self.used)
        self.plain = not (general or moves or any(self.special))  # [Note: replayed memory]

    def _per_template(self) -> tuple[list, list, list, list, list]:
        """Per template, from its row ([Note: instruction effects] in compiler/effects.py):
        what its instructions do; their bytes (a compute's: those it makes, allocated at
        its start ([Note: when bytes count]); RECV: its buffer's; FREE, OFFLOAD, RELOAD: the
        buffer's); their time (a compute's: its stage's cost, `time`; SEND: the message's);
        their in-flight step; the buffers they read (keys less the mb). Raises
        ScheduleError for an instruction of a stage the schedule does not have (a
        template no program uses has no bytes or time)."""
        cost, schedule, free_bytes = self.cost, self.schedule, self.free_bytes
        acts, nbytes, spends, steps, reads = [], [], [], [], []
        S = schedule.num_stages
        by_op = {op: (_act(row), row, getattr(cost, row.time) if row.time is not None else None)
                 for op, row in EFFECTS.items()}
        for t in self.templates:
            a, row, times = by_op[t.op]
            s = t.stage
            acts.append(a)
            steps.append(row.inflight)
            if s >= S:
                nbytes.append(None), spends.append(None), reads.append(())
                continue
            if row.direct and a != _COMPUTE:  # a message's buffer, or the one it names (most templates)
                reads.append(())
                if a == _SEND:
                    nbytes.append(0), spends.append(message_time(cost, cost.buffer_bytes[row.buffer][s]))
                else:
                    nbytes.append(cost.buffer_bytes[row.buffer][s] if a == _RECV else
                                  free_bytes[t.buf][s] if row.frees or row.moves_to else 0)
                    spends.append(0)
                continue
            made, read, freed, moved = keys_of(schedule, t.op, s, t.peer_stage, t.buf)
            reads.append(read)
            nbytes.append(bytes_of(cost.buffer_bytes, made) if a == _COMPUTE else bytes_of(free_bytes, freed or moved))
            spends.append(times[s] if times is not None else 0)
        check_stages(S, self.templates, self.ids, self.mbs)
        return acts, nbytes, spends, steps, reads

    def _rank_channels(self, r: int) -> dict:
        """Rank r's channel of each message template its program holds, by template id (a
        dict: a list as long as the table, per rank, would be O(pp^2) at pp=20000)."""
        chan, channels = {}, self.channels
        for k in self.used[r]:
            a = self.act[k]
            if a == _SEND or a == _RECV:
                peer = self.templates[k].peer
                key = r << 32 | peer if a == _SEND else peer << 32 | r
                chan[k] = channels.setdefault(key, ([], [], []))
        return chan

    def trace(self) -> Trace:
        """Runs every rank until none can ([Note: event-driven run]); raises ScheduleError
        for a deadlock or a message never received."""
        stack, advance = self.stack, self.advance_plain if self.plain else self.advance
        while stack:
            advance(stack.pop())
        self.check_finished()
        for state, link in zip(self.states, self.links):
            if link.pending:  # copies landing after the program's end (a FREE cancels the rest)
                state.live = link.finish(state.live)
        states, replay = self.states, None
        if self.plain:  # the peaks from program order ([Note: replayed memory])
            replay = _Replay(self.templates, self.ids, self.act, self.nbytes)
            for state, ids in zip(states, self.ids):
                state.peak = replay.peak(ids)
        return Trace([s.t for s in states], [s.busy for s in states], [s.peak_inflight for s in states],
                     [s.peak for s in states], None if self.plain else self.memory, self.ends,
                     [link.peak_host for link in self.links], [link.waited for link in self.links],
                     dict(self.channels), replay)

    def advance_plain(self, r: int) -> None:
        """`advance` for a schedule where nothing moves ([Note: replayed memory]): time,
        in-flight counts and busy time; the bytes are counted once the run ends."""
        ids, rank_ends, chan, act, spends = self.ids[r], self.ends[r], self.chan[r], self.act, self.spend
        waiting, stack, state, steps = self.waiting, self.stack, self.states[r], self.steps
        pc, t, inflight, peak_inflight, busy = state.pc, state.t, state.inflight, state.peak_inflight, state.busy
        if self.parked[r] is not None:  # resumed: every partner of the parked batch has posted
            ops, batch_end, _ = self.parked[r]
            self.parked[r] = None
            t = _complete(ops, batch_end, rank_ends)
        n = len(ids)
        while pc < n:
            k = ids[pc]
            a = act[k]
            if a == _FREE:
                pc += 1
                continue
            if a == _COMPUTE:
                step = steps[k]
                if step:
                    inflight += step
                    if inflight > peak_inflight:
                        peak_inflight = inflight
                spend = spends[k]
                t += spend
                busy += spend
                rank_ends[pc] = t
                pc += 1
                continue
            post = batch_end = t  # a run of communication: one batch ([Note: simulated semantics])
            first, ops, missing = pc, None, 0
            while True:
                if a == _SEND:  # it does not hold the sender up
                    mine, msgs, theirs = chan[k]
                    msgs.append(spends[k])
                    j = len(mine)
                    mine.append(post)
                    rank_ends[pc] = post
                    if len(theirs) > j:  # the receiver posted first and is parked on this ...
                        peer = self.templates[k].peer
                        if peer == r:  # ... earlier in this very batch
                            missing -= 1
                        else:
                            waiting[peer] -= 1
                            if not waiting[peer]:
                                stack.append(peer)
                else:  # a receive: done now if its send is posted, else it waits
                    channel = chan[k]
                    theirs, msgs, mine = channel
                    j = len(mine)
                    mine.append(post)
                    if len(theirs) <= j:
                        missing += 1
                        ops = ops or []
                        ops.append((channel, j, pc))
                    else:
                        done = theirs[j] if theirs[j] > post else post
                        if msgs[j]:
                            done += msgs[j]
                        rank_ends[pc] = done
                        if done > batch_end:
                            batch_end = done
                pc += 1
                if pc == n:
                    break
                k = ids[pc]
                a = act[k]
                if a != _SEND and a != _RECV:
                    break
            if missing:
                self.parked[r], waiting[r] = (ops, batch_end, first), missing
                break
            t = batch_end if ops is None else _complete(ops, batch_end, rank_ends)  # ops: messages to self
        state.pc, state.t, state.inflight, state.peak_inflight, state.busy = pc, t, inflight, peak_inflight, busy

    def advance(self, r: int) -> None:
        """Runs rank r's program from where it stands until it parks on a batch whose
        partners have not all posted, or ends."""
        ids, mbs, rank_ends, mem_t, mem_v, link = self.parts[r]
        act, nbytes, spends, templates, steps = self.act, self.nbytes, self.spend, self.templates, self.steps
        state, moved, special = self.states[r], link.moved, self.special[r]
        pc, t, live, peak = state.pc, state.t, state.live, state.peak
        inflight, peak_inflight, busy = state.inflight, state.peak_inflight, state.busy
        if self.parked[r] is not None:  # resumed: every partner of the parked batch has posted
            ops, batch_end, _ = self.parked[r]
            self.parked[r] = None
            t = _complete(ops, batch_end, rank_ends)
        n = len(ids)
        while pc < n:
            k = ids[pc]
            a = act[k]
            if a == _FREE:
                if moved:  # some buffer is off the device: [Note: host link]
                    tpl = templates[k]
                    live, released = link.free(_moved_key(tpl, mbs[pc]), nbytes[k], t, live)
                    live -= released
                    mem_t.append(t)
                    mem_v.append(live)
                else:
                    live -= nbytes[k]
                    mem_t.append(t)
                    mem_v.append(live)
            elif a == _COMPUTE:
                grow, spend = nbytes[k], spends[k]
                step = steps[k]
                if step:
                    inflight += step
                    if inflight > peak_inflight:
                        peak_inflight = inflight
                if moved or special:  # copies to or from the host, a streamed or resized stash
                    t, live, peak, spend = self.compute_aside(r, pc, k, mbs[pc], grow, spend, t, live, peak)
                else:
                    if grow:
                        live += grow
                        if live > peak:
                            peak = live
                        mem_t.append(t)
                        mem_v.append(live)
                    t += spend
                    rank_ends[pc] = t
                busy += spend
            elif a <= _RECV:  # a run of communication: one batch
                pc, t, live, peak = self.post_batch(r, pc, t, live, peak)
                if self.parked[r] is not None:
                    break
                continue
            else:  # asynchronous copies: [Note: host link]
                tpl = templates[k]
                key = _moved_key(tpl, mbs[pc])
                if a == _OFFLOAD:
                    live, rank_ends[pc] = link.offload(key, nbytes[k], t, live)
                else:
                    live, peak, rank_ends[pc] = link.reload(key, nbytes[k], t, live, peak)
            pc += 1
        state.pc, state.t, state.live, state.peak = pc, t, live, peak
        state.inflight, state.peak_inflight, state.busy = inflight, peak_inflight, busy

    def compute_aside(self, r: int, pc: int, k: int, mb: int, grow, spend, t, live, peak):
        """A compute (of template k, microbatch `mb`) on a rank with moved buffers,
        streamed stashes or stashes resized at B: it waits for the reloads of what it
        reads and lands finished copies ([Note: host link]), streams its stash ([Note:
        simulated streaming]: out during the compute that makes it, F, back during the one
        that releases it, B) or shrinks it at its end ([Note: when bytes count]).
        Returns (t, live, peak, busy time spent)."""
        link, streams, (mem_t, mem_v), rank_ends = self.links[r], self.streamed[r], self.memory[r], self.ends[r]
        tpl = self.templates[k]
        row, s = EFFECTS[tpl.op], tpl.stage
        out = "stash" in row.makes  # F: its stash streams out as it saves it
        stream = streams is not None and (s, mb) in streams and (out or row.releases_stash)
        if stream and out:
            grow -= self.stash[s]  # its pieces count as they are produced
        if link.moved:
            ready = link.ready(self.reads[k], mb, t)
            if ready != t:
                link.waited[pc] = t = ready
            live = link.drain(t, live)
            if not (stream and out):  # a streamed F is stretched once, with its own copies
                spend = link.stretch(t, spend)
        if grow:
            live += grow
            if live > peak:
                peak = live
            mem_t.append(t)
            mem_v.append(live)
        if stream and out:
            live, peak, spend = link.stream_out(("stash", s, mb), self.stash[s], t, spend, live, peak)
            t += spend
        elif stream:
            live, peak, t = link.stream_b(("stash", s, mb), t, spend, live, peak, self.schedule.split_backward)
        else:
            t += spend
        rank_ends[pc] = t
        if self.b_shrink is not None and row.releases_stash and self.b_shrink[s]:
            live -= self.b_shrink[s]
            if live > peak:
                peak = live
            mem_t.append(t)
            mem_v.append(live)
        return t, live, peak, spend

    def post_batch(self, r: int, pc: int, t, live, peak):
        """Posts the maximal run of communication ops from `pc` as one batch ([Note:
        simulated semantics]): a send records its post (it does not hold the rank), a
        receive whose send is posted completes now, the others wait. Returns (pc after the
        batch, clock, live, peak); when a receive waits, the rank is parked on the batch."""
        ids, mbs, rank_ends, mem_t, mem_v, link = self.parts[r]
        act, nbytes, spends, chan, waiting = self.act, self.nbytes, self.spend, self.chan[r], self.waiting
        moved = link.moved
        if moved:
            live = link.drain(t, live)
        post = batch_end = t
        first, ops, missing, n = pc, None, 0, len(ids)
        while pc < n:
            k = ids[pc]
            a = act[k]
            if a == _SEND:
                mine, msgs, theirs = chan[k]
                msgs.append(spends[k])
                j = len(mine)
                if moved:  # a reloaded buffer is read once it lands
                    tpl = self.templates[k]
                    mine.append(link.ready_buffer(_moved_key(tpl, mbs[pc], EFFECTS[tpl.op].buffer), post))
                else:
                    mine.append(post)
                rank_ends[pc] = post  # sends do not hold the sender up ([Note: simulated semantics])
                if len(theirs) > j:  # the receiver posted first and is parked on this ...
                    peer = self.templates[k].peer
                    if peer == r:  # ... earlier in this very batch
                        missing -= 1
                    else:
                        waiting[peer] -= 1
                        if waiting[peer] == 0:
                            self.stack.append(peer)
            elif a == _RECV:
                channel = chan[k]
                theirs, msgs, mine = channel
                live += nbytes[k]
                if live > peak:
                    peak = live
                mem_t.append(t)
                mem_v.append(live)
                j = len(mine)
                mine.append(post)
                if len(theirs) <= j:  # a receive whose send is not posted yet
                    missing += 1
                    ops = ops or []
                    ops.append((channel, j, pc))
                else:
                    done = theirs[j] if theirs[j] > post else post
                    if msgs[j]:
                        done += msgs[j]
                    rank_ends[pc] = done
                    if done > batch_end:
                        batch_end = done
            else:
                break
            pc += 1
        if missing:
            self.parked[r], waiting[r] = (ops, batch_end, first), missing
        else:
            t = batch_end if ops is None else _complete(ops, batch_end, rank_ends)  # ops: messages to self
        return pc, t, live, peak

    def check_finished(self) -> None:
        """Raises for ranks still parked (a deadlock) and for a send nobody receives (an
        asynchronous send does not hang, but it is an error)."""
        stuck = [r for r, parked in enumerate(self.parked) if parked is not None]
        if stuck:
            raise _deadlock(self.schedule, stuck, [state.pc for state in self.states], self.parked)
        for channel, (sends, _, recvs) in self.channels.items():
            if len(sends) > len(recvs):
                src, dst = channel >> 32, channel & 0xFFFFFFFF
                k = len(recvs)
                programs = self.programs
                pc = [i for i, instr in enumerate(programs[src]) if instr.op in SEND_OPS and instr.peer == dst][k]
                instr = programs[src][pc]
                raise ScheduleError(
                    f"rule matching: rank {src}'s send #{k} to rank {dst} ({instr}, step {pc}) is never received",
                    rule="matching", rank=src, index=pc, instr=instr, mb=instr.mb)


def _moved_key(tpl: Template, mb: int, buf: str | None = None) -> tuple:
    """The host link's key of the buffer `buf` (the template's own by default) of the
    template's stage and `mb`: (buf, stage, mb), and the peer stage after them for a
    buffer of an edge that is not the neighbour's ([Note: peer stage] in instr.py)."""
    buf = tpl.buf if buf is None else buf
    return (buf, tpl.stage, mb) if tpl.peer_stage is None else (buf, tpl.stage, mb, tpl.peer_stage)


def _deadlock(schedule: Schedule, stuck, pcs, parked) -> ScheduleError:
    """The error for parked ranks: each one's batch and the partners it waits for."""
    programs = schedule.programs
    where = {r: parked[r][2] for r in stuck}  # rank -> first step of its parked batch
    lines = [f"deadlock (rule 4): {len(stuck)} rank(s) cannot finish: "
             + ", ".join(f"rank {r} at step {where[r]}" for r in stuck)]
    for r in stuck:
        program, first = programs[r], where[r]
        lo, hi = max(0, first - 3), min(len(program), pcs[r] + 2)
        cells = [f">>{program[i]}<<" if first <= i < pcs[r] else str(program[i]) for i in range(lo, hi)]
        lines.append(f"  rank {r}, steps {lo}..{hi - 1}: " + " ".join(cells))
        for _, k, pc in parked[r][0]:
            instr, peer = program[pc], program[pc].peer
            partner = f"receive #{k} from rank {r}" if instr.op in SEND_OPS else f"send #{k} to rank {r}"
            if peer >= schedule.pp:
                state = f"there is no rank {peer} (pp = {schedule.pp})"
            elif peer in where:
                state = f"rank {peer} is parked at step {where[peer]}"
            else:
                state = f"rank {peer} finished without posting it"
            lines.append(f"    {instr} waits for rank {peer}'s {partner}: {state}")
    r = stuck[0]
    instr = programs[r][where[r]]
    return ScheduleError("\n".join(lines), rule="deadlock", rank=r, index=where[r], instr=instr, mb=instr.mb)
