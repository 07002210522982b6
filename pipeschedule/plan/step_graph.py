"""The step time and critical path of one lowered schedule under many compute costs, from
its fixed graph: what `simulate` and `critical_path` give, without an event-driven run.

[Note: step graph] Under [Note: simulated semantics] (simulate/engine.py) without OFFLOAD
or RELOAD, a rank's clock moves by its computes' costs, one after the other; at a batch
of communication it stops at the post time P (the clock), and resumes at
max(P, over the batch's receives: max(P, P') + message), P' the post time of the batch
holding the matching send. Which batch waits for which is fixed by program order and
send/receive matching ([Note: critical path bound]), so the posts and ends of the
batches can be put once in an order where every time is known before it is read, and
each step evaluated by one pass over them. The pass adds the same numbers in the same order as the simulator,
so step times come out bitwise equal; `critical_path` walks back over the same times
with the same choices (the rank that finishes first among the last, the first receive
to complete last in program order), so the chains are equal too.
tests/plan/test_step_graph.py pins both to `simulate` and `critical_path` over every
family, caps, placements and costs. The split search (split_problem.Evaluator) simulates
thousands of stage-cost vectors of one schedule this way: one graph, built once. The
graph keeps the step times, chains and message times it computed ([Note: run-wide
memos] in memo.py): the plans of one run ask for many of them again.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

from pipeschedule.compiler.effects import COPY, EFFECTS, SEND
from pipeschedule.compiler.gcpause import gc_paused
from pipeschedule.compiler.ir import Schedule
from pipeschedule.compiler.program import Template, packed
from pipeschedule.errors import ParameterError, ScheduleError
from pipeschedule.plan.memo import Memo, plain
from pipeschedule.simulate.critical_path import CriticalPath

MEMO_CELLS = 2**20  # numbers each of a graph's memos keeps ([Note: run-wide memos])
POST, DONE, BOTH = 1, 2, 3  # what an entry of StepGraph.order evaluates: the post, the end, both
_OTHER, _COMPUTE, _SEND, _RECV, _MOVE = "other", "compute", "send", "recv", "move"  # what a template is to the graph


TIMES = ("forward", "backward", "weight")  # the flat costs' parts, as `step` takes them


def _kind(t: Template, S: int) -> tuple[str, int | None]:
    """What instructions of template `t` are to the step graph, by its row ([Note:
    instruction effects] in compiler/effects.py), and for a compute its flat cost index
    part * S + stage (its `time`: forward, backward, weight). An op of no time (FREE) is
    "other"."""
    row = EFFECTS[t.op]
    if row.message:
        return (_SEND if row.kind == SEND else _RECV), None
    if row.kind == COPY:
        return _MOVE, None
    if row.time is not None:
        return _COMPUTE, TIMES.index(row.time) * S + t.stage
    return _OTHER, None


class StepGraph:
    """The timing graph of a lowered schedule without OFFLOAD / RELOAD.

    Batches are numbered globally. For batch b: `rank[b]`, `before[b]` (flat cost
    indices kind * S + stage of the computes between the previous batch of its rank and
    b, in program order), `recvs[b]` (per receive in program order: the batch of its
    send and the index of its message in `messages`), `prev[b]` (the rank's previous
    batch, -1 for none). `tail[r]`: the computes after rank r's last batch, `last[r]`
    its last batch (-1 for none). `order`: (batch, POST / DONE / BOTH) in an order
    that evaluates the post of every batch holding a send before the end of the batch
    receiving it. `messages[i]`: (buffer kind, stage) of
    the send of message i, which sets its time.
    """

    @gc_paused  # many small tuples and lists, none in a cycle (compiler/gcpause.py)
    def __init__(self, schedule: Schedule) -> None:
        self.pp, self.num_stages = schedule.pp, schedule.num_stages
        S = self.num_stages
        self.rank, self.before, self.recvs, self.prev = [], [], [], []
        self.tail, self.last = [], []
        sends: dict[tuple[int, int], list] = defaultdict(list)  # (src, dst) -> (batch, op, stage) per send
        pending: dict[tuple[int, int], list] = defaultdict(list)  # (src, dst) -> (batch, slot) per receive
        templates, ids_by_rank, mbs_by_rank = packed(schedule.programs)  # [Note: packed programs]
        kinds = [_kind(t, S) for t in templates]  # per template: what it is here, and its cost index
        for r, ids in enumerate(ids_by_rank):
            computes, batch, prev = [], None, -1
            for pc, k in enumerate(ids):
                kind, cost = kinds[k]
                if kind is _OTHER:  # FREE, an op of no time
                    batch = None
                elif kind is _COMPUTE:
                    batch = None
                    computes.append(cost)
                elif kind is _SEND or kind is _RECV:
                    if batch is None:
                        batch = len(self.rank)
                        self.rank.append(r)
                        self.before.append(tuple(computes))
                        self.recvs.append([])
                        self.prev.append(prev)
                        computes, prev = [], batch
                    t = templates[k]
                    if kind is _SEND:
                        sends[r, t.peer].append((batch, EFFECTS[t.op].buffer, t.stage))
                    else:
                        pending[t.peer, r].append((batch, len(self.recvs[batch])))
                        self.recvs[batch].append(None)
                else:
                    raise ParameterError(f"the step graph times schedules without host copies; rank {r} runs "
                                         f"{templates[k].instr(mbs_by_rank[r][pc])} (simulate it with "
                                         "pipeschedule.simulate)")
            self.tail.append(tuple(computes))
            self.last.append(prev)
        self.messages = []
        for channel in sorted(set(sends) | set(pending)):
            out, into = sends.get(channel, []), pending.get(channel, [])
            if len(out) != len(into):
                raise ScheduleError(f"rule matching: rank {channel[0]} sends {len(out)} messages to rank "
                                    f"{channel[1]}, which receives {len(into)}", rule="matching")
            for (src, buf, stage), (batch, slot) in zip(out, into):
                self.recvs[batch][slot] = (src, len(self.messages))
                self.messages.append((buf, stage))
        self.recvs = [tuple(x) for x in self.recvs]
        self.order = self._order()
        # [Note: run-wide memos]: a message tuple is kept once, and the steps refer to it
        self.message_memo = Memo(MEMO_CELLS, lambda key, value: len(key[0]) + len(key[1]) + 2 + len(value))
        self.step_memo = Memo(MEMO_CELLS, lambda key, value: 2 * len(key[0]) + 1)

    def _order(self) -> list[tuple[int, int]]:
        """(batch, what) in an order that evaluates every post time before it is read:
        what is POST (the clock reaches the batch), DONE (its last receive is in) or
        BOTH; the same simulation of ranks as [Note: event-driven run], without times.
        ScheduleError when the ranks cannot finish (a deadlock)."""
        n = len(self.rank)
        readers = [[] for _ in range(n)]  # batch -> the other batches receiving its sends
        waiting = [0] * n  # batch -> its receives whose send's batch is not posted yet
        for b, recvs in enumerate(self.recvs):
            for src, _ in recvs:
                if src != b:
                    readers[src].append(b)
                    waiting[b] += 1
        at, stop = [0] * self.pp, [0] * self.pp  # per rank: its next batch, and the end of its batches
        for b in range(n - 1, -1, -1):  # batches are numbered rank by rank
            at[self.rank[b]] = b
        for b, r in enumerate(self.rank):
            stop[r] = b + 1
        posted = [False] * n
        order, stack, rank = [], list(range(self.pp - 1, -1, -1)), self.rank
        while stack:
            r = stack.pop()
            b, end = at[r], stop[r]
            while b < end:
                resumed = posted[b]
                if not resumed:
                    posted[b] = True
                    for c in readers[b]:
                        waiting[c] -= 1
                        if waiting[c] == 0 and posted[c]:
                            stack.append(rank[c])
                if waiting[b]:
                    order.append((b, POST))
                    break
                order.append((b, DONE if resumed else BOTH))
                b += 1
            at[r] = b
        stuck = [r for r in range(self.pp) if at[r] < stop[r]]
        if stuck:
            raise ScheduleError(f"deadlock (rule 4): ranks {stuck} cannot finish (simulate the schedule for "
                                f"the grid)", rule="deadlock", rank=stuck[0])
        return order

    def message_times(self, act_out: Sequence[float], grad_in: Sequence[float], latency: float = 0.0,
                      bandwidth: float = math.inf) -> tuple:
        """Each message's time, as the simulator computes it from its send's bytes (kept:
        equal arguments get the same tuple back)."""
        key = (tuple(act_out), tuple(grad_in), latency, bandwidth)
        if not plain(key[0] + key[1] + key[2:]):
            return self._message_times(*key)
        return self.message_memo.get(key, lambda: self._message_times(*key))

    def _message_times(self, act_out: tuple, grad_in: tuple, latency: float, bandwidth: float) -> tuple:
        sizes = {"act_out": act_out, "grad_in": grad_in}  # by the buffer a message sends
        out = []
        for buf, stage in self.messages:
            size = sizes[buf][stage]
            out.append(latency + size / bandwidth if bandwidth != math.inf else latency)
        return tuple(out)

    def times(self, flat: Sequence[float], msgs: Sequence[float]) -> tuple[list, list]:
        """(post time of every batch, finish time of every rank) under the flat costs
        (forward + backward + weight, per stage) and message times."""
        n = len(self.rank)
        post, clock = [0] * n, [0] * self.pp
        rank, before, recvs = self.rank, self.before, self.recvs
        for b, what in self.order:
            r = rank[b]
            if what & POST:
                t = clock[r]
                for i in before[b]:
                    t += flat[i]
                post[b] = t
                if what == POST:
                    continue
            t = end = post[b]
            for src, k in recvs[b]:
                other = post[src]
                done = other if other > t else t
                if msgs[k]:
                    done += msgs[k]
                if done > end:
                    end = done
            clock[r] = end
        finish = []
        for r in range(self.pp):
            t = clock[r]
            for i in self.tail[r]:
                t += flat[i]
            finish.append(t)
        return post, finish

    def step(self, forward: Sequence[float], backward: Sequence[float], weight: Sequence[float],
             msgs: Sequence[float]) -> tuple[float, CriticalPath]:
        """(step time, critical path) as `simulate(...).step_time` and `critical_path`
        give them ([Note: step graph]); kept by the costs and message times ([Note:
        run-wide memos])."""
        flat = (*forward, *backward, *weight)
        msgs = msgs if isinstance(msgs, tuple) else tuple(msgs)
        if not (plain(flat) and plain(msgs)):
            return self._step(flat, msgs)
        return self.step_memo.get((flat, msgs), lambda: self._step(flat, msgs))

    def _step(self, flat: tuple, msgs: tuple) -> tuple[float, CriticalPath]:
        post, finish = self.times(flat, msgs)
        step = max(finish, default=0)
        counts = [0] * (3 * self.num_stages)
        r = max(range(self.pp), key=lambda k: finish[k])
        for i in self.tail[r]:
            counts[i] += 1
        b, messages = self.last[r], 0.0
        while b >= 0:
            at, best, chosen = post[b], None, None
            for src, k in self.recvs[b]:  # the receive that completes last, the first such
                other = post[src]
                done = other if other > at else at
                if msgs[k]:
                    done += msgs[k]
                if best is None or done > best:
                    best, chosen = done, (src, k)
            if chosen is not None and best > at:
                src, k = chosen
                messages += msgs[k]
                if at < post[src]:
                    b = src  # the chain goes on before the sender's batch
            for i in self.before[b]:
                counts[i] += 1
            b = self.prev[b]
        S = self.num_stages
        return step, CriticalPath(tuple(counts[:S]), tuple(counts[S:2 * S]), tuple(counts[2 * S:]), messages)


__all__ = ["StepGraph"]
