"""Handcrafted orders written as phases of (stage, op) steps, and the choice between a
handcrafted order and a list-scheduled one.

A handcrafted schedule (PyTorch's ZBVZeroBubble and DualPipeV, the zero-bubble paper's
ZB-H2) is a few phases per rank, each a short pattern of steps repeated a number of
times: "F of stage 0, then F of stage 7, three times". `PhaseWriter` numbers the steps:
each (stage, op) has its own counter, so the k-th F of a stage is microbatch k, and a
`PENDING_W` step takes the oldest weight gradient whose B ran without its W.

[Note: padded phases] A pattern is often written for m >= some minimum (DualPipeV needs
m >= 2pp to fill its phases). For a smaller m the phases are written for that minimum
and every instruction of a microbatch >= m is dropped afterwards. Dropping whole
microbatches keeps an order valid: each dependency (F after F of the previous stage, B
after F and after B of the next stage, W after B) is between instructions of one
microbatch, so the remaining ones keep every dependency they had and gain none, and an
acyclic order stays acyclic.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from pipeschedule.compiler.ir import Instr, Op, make_instr
from pipeschedule.compiler.timing import asap, finish_time

PENDING_W = "pending W"  # a step that runs the oldest pending weight gradient, if any
FULL_B = "B+W"  # a whole backward: B and its W at once (PyTorch's FULL_BACKWARD in a split schedule)


class PhaseWriter:
    """One rank's order, step by step. `step(stage, op)` appends the next microbatch of
    that (stage, op); op is Op.F, Op.B (its W is left pending), FULL_B (B then its W),
    Op.W (the next W of that stage) or PENDING_W (the oldest pending W; nothing if none)."""

    def __init__(self) -> None:
        self.order: list[Instr] = []
        self._next: dict[tuple[int, object], int] = {}
        self._pending: deque[tuple[int, int]] = deque()

    def _take(self, stage: int, op) -> int:
        mb = self._next.get((stage, op), 0)
        self._next[(stage, op)] = mb + 1
        return mb

    def step(self, stage: int, op) -> None:
        if op is PENDING_W:
            if self._pending:
                self.order.append(make_instr(Op.W, *self._pending.popleft()))
            return
        if op is Op.F:
            self.order.append(make_instr(Op.F, stage, self._take(stage, Op.F)))
            return
        if op is Op.W:
            self.order.append(make_instr(Op.W, stage, self._take(stage, Op.W)))
            return
        mb = self._take(stage, Op.B)  # B and FULL_B share the counter of B
        self.order.append(make_instr(Op.B, stage, mb))
        if op is FULL_B:
            self.order.append(make_instr(Op.W, stage, mb))
            self._next[(stage, Op.W)] = self._next.get((stage, Op.W), 0) + 1
        else:
            self._pending.append((stage, mb))

    def repeat(self, times: int, pattern: Iterable[tuple[int, object]]) -> None:
        """`pattern`, a sequence of (stage, op) steps, `times` times over."""
        pattern = tuple(pattern)
        for _ in range(max(0, times)):
            for stage, op in pattern:
                self.step(stage, op)

    def flush(self) -> None:
        """Every pending W, oldest first."""
        while self._pending:
            self.step(0, PENDING_W)

    def below(self, microbatches: int) -> list[Instr]:
        """The order without the microbatches >= `microbatches` ([Note: padded phases])."""
        return [i for i in self.order if i.mb < microbatches]


def stash_peaks(programs: Sequence[Sequence[Instr]]) -> list[int]:
    """Per rank, the most stage-microbatches held between an F and its W (its B where
    the backward is whole): the stash the order keeps."""
    split = any(i.op is Op.W for program in programs for i in program)
    release = Op.W if split else Op.B
    peaks = []
    for program in programs:
        held = peak = 0
        for i in program:
            if i.op is Op.F:
                held += 1
                peak = max(peak, held)
            elif i.op is release:
                held -= 1
        peaks.append(peak)
    return peaks


def faster(num_stages: int, candidates: Iterable[list], times=None) -> list:
    """The candidate order (a list of programs) that finishes first, timed as soon as
    possible under `times` (`StageTimes`; None: unit costs); the earliest on a tie. A
    candidate whose compute order cannot finish (a dependency cycle) is passed over; one
    of them must finish."""
    best, best_time = None, None
    for programs in candidates:
        timing = asap(num_stages, programs, times)
        if timing[1]:
            continue
        took = finish_time(programs, timing, times)
        if best is None or took < best_time:
            best, best_time = programs, took
    if best is None:
        raise AssertionError("every candidate order blocks")  # each caller passes one that cannot
    return best
