"""Peak live bytes and peak in-flight microbatches per rank from program order alone:
what `simulate` reports as `peak_bytes` and `peak_inflight`, without timing a step.

[Note: peaks from program order] Without OFFLOAD or RELOAD the bytes a rank holds change
only at its own instructions ([Note: when bytes count] in simulate/engine.py): F(s) adds
act_in (stage 0), stash, act_out (when the output leaves the rank) and the next stage's
act_in (when it runs on the same rank); B(s) adds grad_in (when the gradient leaves the
rank) and the previous stage's grad_out (same rank), and at its end shrinks the stash to
`weight_stash` where the cost resizes it; a receive adds its buffer; FREE releases one.
So the peak is the largest running sum of these changes in program order, added in the
simulator's order (the same float sums), and the planner, which needs peaks of many byte
tables of one schedule, gets them without running it. tests/plan/test_step_graph.py
pins `Peaks` to `simulate` over every family and byte table. Peaks keeps what it
computed by the byte tables ([Note: run-wide memos] in memo.py): the plans of one run
share it, and their activations do not change with dp or the ZeRO stage.
"""

from __future__ import annotations

from pipeschedule.compiler.effects import COPY, EFFECTS, bytes_of, keys_of
from pipeschedule.compiler.gcpause import gc_paused
from pipeschedule.compiler.ir import BUFFERS, Schedule
from pipeschedule.compiler.program import Template, packed
from pipeschedule.errors import ParameterError
from pipeschedule.plan.memo import Memo, plain

MEMO_CELLS = 2**20  # numbers each memo of a Peaks keeps ([Note: run-wide memos])

# What each instruction changes, as an index into the table `_deltas` builds per cost: a
# block of S entries (one per stage) for what each op that makes buffers allocates, one for
# the stash a B shrinks at its end, one per buffer kind for what a FREE releases.
_ALLOCATING = tuple(op for op, row in EFFECTS.items() if row.makes and row.kind != COPY)  # F, B, RECV_F, RECV_B
_ALLOC = {op: k for k, op in enumerate(_ALLOCATING)}
_SHRINK = len(_ALLOCATING)
_RELEASING = frozenset(_ALLOC[op] for op in _ALLOCATING if EFFECTS[op].releases_stash)  # B's block
_FREE = {buf: _SHRINK + 1 + i for i, buf in enumerate(BUFFERS)}


def _effect(t: Template, schedule: Schedule) -> tuple[tuple[int, ...], int] | None:
    """What an instruction of template `t` does here, from its row ([Note: instruction
    effects] in compiler/effects.py): its changes (table * S + stage, in the order they
    happen: what it makes, a B's stash shrinking, what it frees) and its in-flight move
    (+1 for F, -1 for B); None for OFFLOAD and RELOAD, which this does not model."""
    row, s, S = EFFECTS[t.op], t.stage, schedule.num_stages
    if row.kind == COPY:
        return None
    changes = (_ALLOC[t.op] * S + s,) if t.op in _ALLOC else ()
    if row.releases_stash:
        changes += (_SHRINK * S + s,)
    if row.frees:
        freed = keys_of(schedule, t.op, s, t.peer_stage, t.buf).frees
        changes += tuple(_FREE[buf] * S + stage for buf, stage, _ in freed)
    return changes, row.inflight


class Peaks:
    """Per rank, the sequence of byte changes of a lowered schedule without host copies;
    `of(cost)` evaluates it under one cost's buffer bytes."""

    @gc_paused  # many small tuples and lists, none in a cycle (compiler/gcpause.py)
    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        S = schedule.num_stages
        self.changes = []  # per rank: table * S + stage per change, in program order
        self.inflight = []  # per rank: +1 / -1 per F / B
        templates, ids_by_rank, mbs_by_rank = packed(schedule.programs)  # [Note: packed programs]
        effects = [_effect(t, schedule) for t in templates]  # per template: its changes and its in-flight move
        # per op of _ALLOCATING and stage, the buffers it makes ([Note: when bytes count])
        self.made = [[keys_of(schedule, op, s).makes for s in range(S)] for op in _ALLOCATING]
        for r, ids in enumerate(ids_by_rank):
            changes, moves = [], []
            for pc, k in enumerate(ids):
                effect = effects[k]
                if effect is None:
                    raise ParameterError(f"peaks from program order hold without host copies; rank {r} runs "
                                         f"{templates[k].instr(mbs_by_rank[r][pc])} (simulate it with "
                                         "pipeschedule.simulate)")
                changes += effect[0]
                if effect[1]:
                    moves.append(effect[1])
            self.changes.append(changes)
            self.inflight.append(moves)
        self.memo = Memo(MEMO_CELLS, lambda key, value: sum(map(len, key[1])) + (len(key[2] or ())) + 2 * S)

    def _deltas(self, cost) -> list:
        """The signed change of each table entry, as the simulator's `_Run` tables make them."""
        sched, S = self.schedule, self.schedule.num_stages
        stash = cost.buffer_bytes["stash"]
        table = []
        for made in self.made:  # what each op that makes buffers allocates at its start, per stage
            table += [bytes_of(cost.buffer_bytes, keys) for keys in made]
        free = dict(cost.buffer_bytes)
        shrink = [0] * S
        if cost.weight_stash is not None and sched.split_backward:
            shrink = [-(whole - kept) for whole, kept in zip(stash, cost.weight_stash)]
            free["stash"] = cost.weight_stash
        table += shrink
        for buf in BUFFERS:
            table += [-x for x in free[buf]]
        return table

    def _kept(self, what: str, cost, compute):
        """`compute(cost)`, kept by what it reads of `cost`: the buffer bytes, and the
        weight stash under a split backward ([Note: run-wide memos])."""
        tables = tuple(tuple(cost.buffer_bytes[k]) for k in BUFFERS)
        kept = tuple(cost.weight_stash) if cost.weight_stash is not None and self.schedule.split_backward else None
        if not all(plain(t) for t in tables) or not plain(kept or ()):
            return compute(cost)
        return self.memo.get((what, tables, kept), lambda: compute(cost))

    def of(self, cost) -> tuple[tuple, tuple]:
        """(peak bytes, peak in-flight) per rank, as `simulate(schedule, cost)` gives them."""
        return self._kept("of", cost, self._of)

    def _of(self, cost) -> tuple[tuple, tuple]:
        table = self._deltas(cost)
        peaks = []
        for changes in self.changes:
            live = peak = 0
            for i in changes:
                d = table[i]
                if d:
                    live += d
                    if live > peak:
                        peak = live
            peaks.append(peak)
        inflight = []
        for moves in self.inflight:
            now = top = 0
            for d in moves:
                now += d
                if now > top:
                    top = now
            inflight.append(top)
        return tuple(peaks), tuple(inflight)

    def at_backward_ends(self, cost) -> tuple:
        """Per rank, the most bytes alive as one of its B ends, that B's own stash left out
        (nanotron's engines run a microbatch's backward to its end, by which autograd has
        released what it saved): the moment nanotron's engines hold the stage's bf16
        gradients ([Note: memory terms] in plan/memory.py). Same cost as `of`; 0 where a
        rank runs no B."""
        return self._kept("ends", cost, self._at_backward_ends)

    def _at_backward_ends(self, cost) -> tuple:
        table = self._deltas(cost)
        S, stash = self.schedule.num_stages, cost.buffer_bytes["stash"]
        out = []
        for changes in self.changes:
            live = top = 0
            for i in changes:
                live += table[i]
                if i // S in _RELEASING:  # B: its allocation, at its start
                    top = max(top, live - stash[i % S])
            out.append(top)
        return tuple(out)


__all__ = ["Peaks"]
