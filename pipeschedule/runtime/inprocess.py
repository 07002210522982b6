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

[Note: a host thread per rank] `run_in_threads` steps the same executors each from its
own host thread, as pp processes would: a rank whose host call blocks (a full launch
queue on its device stream, a synchronising op) holds up only itself. The world's
state changes under its `changed` condition (every post and publish notifies it); a
rank whose wait is not ready sleeps on it. The arithmetic of each rank is the same, in
the same order, so losses and gradients equal the round-robin step's. Every live rank
asleep on a wait that is not ready is a deadlock: it raises, naming where each stands;
an exception in one rank stops the others at their next wait. It does not share out the
host's work: the threads' Python runs one at a time under the GIL. Measured on SM
partitions of an H100, where one host thread cannot keep four ranks fed, a thread per
rank was 16-22% slower than one (benchmarks/results/parallel_gpu_partitions_host_both.md).
"""

from __future__ import annotations

import contextlib
import threading
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
        # held while the state changes, notified after: [Note: a host thread per rank]
        self.changed = threading.Condition()

    def transport(self, rank: int) -> InProcessTransport:
        return InProcessTransport(self, rank)

    def post(self, rank: int, op: P2P) -> _Message:
        with self.changed:
            message = self.message(op, rank)
            src, dst = (rank, op.peer) if op.send else (op.peer, rank)
            partners = self.unmatched[src, dst, not op.send]
            if partners:
                partner = partners.popleft()
                send, recv = (message, partner) if op.send else (partner, message)
                _check_match(send, recv)
                self.deliver(send, recv)
                message.done = partner.done = True
                self.changed.notify_all()
            else:
                self.unmatched[src, dst, op.send].append(message)
            return message

    def publish(self, key: str, value: str) -> None:
        with self.changed:
            self.metadata[key] = value
            self.changed.notify_all()

    def abort(self, message: str) -> None:
        with self.changed:
            if self.abort_message is None:
                self.abort_message = message
            self.changed.notify_all()

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
        self.world.publish(key, value)

    def lookup(self, key: str) -> str | None:
        return self.world.metadata.get(key)

    def abort(self, message: str) -> None:
        self.world.abort(message)

    def aborted(self) -> str | None:
        return self.world.abort_message


class InProcessPipeline:
    """Every rank's `Executor` over one `InProcessWorld`; `step` runs them all
    ([Note: in-process stepping]). `stages` serves every stage (e.g. `ModuleStages`
    over all chunks); keyword arguments go to each `Executor`; `threads`: a host thread
    per rank ([Note: a host thread per rank])."""

    def __init__(self, schedule: Schedule, stages: Stages, *, threads: bool = False, **executor_args: Any):
        self.world = InProcessWorld(schedule.pp)
        self.schedule, self.threads = schedule, threads
        self.executors = [Executor(schedule, r, stages, self.world.transport(r), **executor_args)
                          for r in range(schedule.pp)]

    def step(self, inputs: Sequence[Any] | None = None, targets: Sequence[Any] | None = None) -> list[list]:
        """One step of every rank; returns each rank's outputs (`Executor.run`); with
        `threads`, each rank from its own host thread ([Note: a host thread per rank])."""
        if self.threads:
            return run_in_threads(self.executors, self.world, inputs, targets)
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


def run_in_threads(executors: Sequence[Executor], world: InProcessWorld, inputs=None, targets=None,
                   lane: Callable[[int], ContextManager] | None = None) -> list[list]:
    """`run_in_process`, each rank from its own host thread ([Note: a host thread per
    rank]); `world` is the one the executors' transports share. Returns each rank's
    outputs, in order; raises the first rank's error (or the deadlock)."""
    count = len(executors)
    results: list[list] = [[] for _ in executors]
    errors: dict[int, BaseException] = {}
    asleep: dict[int, Pending] = {}  # rank -> the wait it sleeps on
    live = set(range(count))

    def stuck() -> bool:  # under world.changed
        return len(asleep) == len(live) and not any(wait.ready() for wait in asleep.values())

    def sleep(rank: int, wait: Pending) -> bool:
        """Until `wait` is ready (True), or the step stops (False)."""
        with world.changed:
            asleep[rank] = wait
            try:
                while not wait.ready():
                    if errors:
                        return False
                    if stuck():
                        where = "\n  ".join(str(executors[r].error("waits")) for r in sorted(asleep))
                        errors.setdefault(-1, RuntimeScheduleError(
                            f"in-process step cannot go on: every unfinished rank waits\n  {where}"))
                        world.changed.notify_all()
                        return False
                    world.changed.wait()
                return True
            finally:
                del asleep[rank]

    def drive(rank: int) -> None:
        steps = executors[rank].run(inputs, targets)
        try:
            with lane(rank) if lane is not None else contextlib.nullcontext():
                wait = None
                while wait is None or sleep(rank, wait):
                    try:
                        wait = next(steps)
                    except StopIteration as stop:
                        results[rank] = stop.value
                        return
        except BaseException as err:  # noqa: BLE001  (handed to the caller below)
            with world.changed:
                errors.setdefault(rank, err)
                world.changed.notify_all()
        finally:
            steps.close()
            with world.changed:
                live.discard(rank)
                world.changed.notify_all()  # a rank that ends may leave the others stuck

    threads = [threading.Thread(target=drive, args=(r,), name=f"pipeschedule-rank-{r}", daemon=True)
               for r in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise next(iter(errors.values()))  # the first: later ones are ranks stopped by it
    return results
