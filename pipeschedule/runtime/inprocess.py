"""All ranks of a schedule in one process: for tests and single-device experiments.

[Note: in-process stepping] `InProcessPipeline.step` advances the ranks round-robin,
in rank order, each until it waits on something not yet there (a batch whose partners
have not posted, or a shape not yet published), and repeats until every rank has
finished. Messages between two ranks match in order, as they do over NCCL and gloo,
and the data is copied when the later side posts. The order is deterministic, and the
per-rank arithmetic is the same as in the multi-process run, so losses and gradients
are bitwise equal. A full round in which no rank moves is a deadlock and raises at
once, naming where every rank stands; an exception in one rank stops the step (the
other ranks are dropped and their executors marked broken).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict, deque
from typing import Any, Callable, ContextManager, Sequence

from pipeschedule.compiler.ir import Schedule
from pipeschedule.errors import RuntimeScheduleError
from pipeschedule.runtime.executor import Executor
from pipeschedule.runtime.shapes import describe
from pipeschedule.runtime.stages import Stages
from pipeschedule.runtime.transport import P2P, Pending, Transport


class _Message:
    __slots__ = ("op", "rank", "done")

    def __init__(self, op: P2P, rank: int):
        self.op, self.rank, self.done = op, rank, False


class InProcessWorld:
    """What the ranks of one process share: point-to-point channels, metadata, abort."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.unmatched: dict[tuple[int, int, bool], deque[_Message]] = defaultdict(deque)  # (src, dst, is_send)
        self.metadata: dict[str, str] = {}
        self.abort_message: str | None = None

    def transport(self, rank: int) -> InProcessTransport:
        return InProcessTransport(self, rank)

    def post(self, rank: int, op: P2P) -> _Message:
        message = self.message(op, rank)
        src, dst = (rank, op.peer) if op.send else (op.peer, rank)
        partners = self.unmatched[src, dst, not op.send]
        if partners:
            partner = partners.popleft()
            send, recv = (message, partner) if op.send else (partner, message)
            _check_match(send, recv)
            self.deliver(send, recv)
            message.done = partner.done = True
        else:
            self.unmatched[src, dst, op.send].append(message)
        return message

    def message(self, op: P2P, rank: int) -> _Message:
        """A message as `rank` posts it."""
        return _Message(op, rank)

    def deliver(self, send: _Message, recv: _Message) -> None:
        """Copies a matched send's data into its receive (at once, on the host's order)."""
        recv.op.tensor.copy_(send.op.tensor)

    def finish(self, messages: list[_Message]) -> None:
        """What a rank does once its batch of `messages` is complete (nothing here)."""


def _check_match(send: _Message, recv: _Message) -> None:
    data, into = send.op.tensor, recv.op.tensor
    if data.shape != into.shape or data.dtype != into.dtype:
        raise RuntimeScheduleError(
            f"rank {send.rank} sends {describe(data)} ({send.op.instr}) but rank {recv.rank} "
            f"receives {describe(into)} ({recv.op.instr})"
        )


class _Posted(Pending):
    def __init__(self, world: InProcessWorld, messages: list[_Message]):
        self.world, self.messages = world, messages

    def ready(self) -> bool:
        return all(message.done for message in self.messages)

    def finish(self) -> None:
        self.world.finish(self.messages)
        self.messages = ()  # [Note: a finished batch holds nothing] in transport


class InProcessTransport(Transport):
    """One rank's view of an `InProcessWorld`."""

    def __init__(self, world: InProcessWorld, rank: int):
        super().__init__()
        self.world, self.rank, self.world_size = world, rank, world.world_size

    def post(self, ops: list[P2P]) -> Pending:
        return _Posted(self.world, [self.world.post(self.rank, op) for op in ops])

    def publish(self, key: str, value: str) -> None:
        self.world.metadata[key] = value

    def lookup(self, key: str) -> str | None:
        return self.world.metadata.get(key)

    def abort(self, message: str) -> None:
        if self.world.abort_message is None:
            self.world.abort_message = message

    def aborted(self) -> str | None:
        return self.world.abort_message


class InProcessPipeline:
    """Every rank's `Executor` over one `InProcessWorld`; `step` runs them all
    ([Note: in-process stepping]). `stages` serves every stage (e.g. `ModuleStages`
    over all chunks); keyword arguments go to each `Executor`."""

    def __init__(self, schedule: Schedule, stages: Stages, **executor_args: Any):
        world = InProcessWorld(schedule.pp)
        self.schedule = schedule
        self.executors = [Executor(schedule, r, stages, world.transport(r), **executor_args)
                          for r in range(schedule.pp)]

    def step(self, inputs: Sequence[Any] | None = None, targets: Sequence[Any] | None = None) -> list[list]:
        """One step of every rank; returns each rank's outputs (`Executor.run`)."""
        return run_in_process(self.executors, inputs, targets)


def run_in_process(executors: Sequence[Executor], inputs=None, targets=None,
                   lane: Callable[[int], ContextManager] | None = None) -> list[list]:
    """Steps executors that share one `InProcessWorld` ([Note: in-process stepping]);
    returns each one's outputs, in order. `lane(rank)`, where given, is entered around
    every stretch a rank runs (its device stream: [Note: partitioned stepping] in
    partitioned)."""
    running = {r: executor.run(inputs, targets) for r, executor in enumerate(executors)}
    waits: dict[int, Pending | None] = dict.fromkeys(running)
    results: list[list] = [[] for _ in executors]
    try:
        while running:
            moved = False
            for rank in list(running):
                with lane(rank) if lane is not None else contextlib.nullcontext():
                    while waits[rank] is None or waits[rank].ready():
                        moved = True
                        try:
                            waits[rank] = next(running[rank])
                        except StopIteration as stop:
                            results[rank] = stop.value
                            del running[rank]
                            break
            if running and not moved:
                where = "\n  ".join(str(executors[r].error("waits")) for r in running)
                raise RuntimeScheduleError(f"in-process step cannot go on: every unfinished rank waits\n  {where}")
    finally:
        for steps in running.values():
            steps.close()
    return results
