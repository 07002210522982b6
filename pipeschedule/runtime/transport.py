"""Transports: how a batch of sends and receives travels between ranks.

A transport posts one batch at a time (`post`) and returns a `Pending` that the
executor's driver polls; it also carries small one-time metadata (`publish`/`lookup`)
and the abort message that stops every rank (`abort`/`aborted`). Three kinds:

- `DistTransport`: torch.distributed, one `dist.batch_isend_irecv` per batch (gloo on
  CPU, NCCL on GPU), metadata and abort through a c10d Store.
- `HostStagedTransport`: the same over gloo for several ranks sharing one GPU; device
  tensors are staged through pinned host memory.
- `InProcessTransport` (module `inprocess`): all ranks in one process.

[Note: waiting on gloo] gloo's send/recv work never reports `is_completed()` until
someone calls `wait()`, and `wait(timeout)` closes the connection when the timeout
expires, so a gloo batch cannot be polled from the executor's thread. A daemon thread
per transport calls `wait()` on each batch in turn and sets an event; the executor waits
on the event in short slices, checking the abort key and its watchdog in between. NCCL
work is polled with `is_completed()` directly.

[Note: sends in the background] A transport over gloo (`DistTransport` on CPU tensors,
`HostStagedTransport` always) sends from a copy it makes at `post` (a clone on CPU, a
host copy of a device tensor), so nothing the executor holds is read once `post` returns:
the `Pending` it returns covers the batch's receives only, and its sends complete in the
background (`outstanding_sends()`, which the executor waits on at the end of the step,
raising any send's error there). gloo's send completes only once the receiver has posted
its receive, so waiting on it made every rank wait for its partner to take each message:
under AFAB the first stage ran one microbatch ahead of the second instead of as far ahead
as it could, and on pinned CPU cores every schedule waited where the simulator
([Note: simulated semantics] in simulate/engine.py), like nanotron's P2P (its send only
posts), lets the sender go on. The verifier's rule 4 proves deadlock freedom for waiting
on every message of a batch; waiting on fewer never blocks a rank that could have run
(each rank posts every message no later than under the stricter wait, so every receive
finds its send at least as early), so the proof covers this too. Over NCCL the Pending
covers the whole batch: its sends read the executor's own tensors on NCCL's stream.

[Note: every rank stops] On failure a rank writes an abort message under
`<prefix>abort` in the store (the first writer wins); every waiting rank checks that key
at least every `ABORT_POLL_S` and stops with an error quoting it.

[Note: no retry on a failed group] A step that fails leaves messages in the process
group's channels: sends posted that nobody received, receives posted that nothing
matched. Messages pair by order, so a new executor on the same group would take them for
its own: a retry over gloo finished on the loss rank with every microbatch shifted by one
and wrong losses and gradients, and no error. So every executor that fails marks its
transport (`mark_failed`), and a `DistTransport` refuses to be built on a process group
a failed step used in this process, or over a store that holds an abort under its prefix:
the way on is a new process group (`torch.distributed.new_group`) and a new prefix, or
a new job. (In one process, `InProcessPipeline` builds a new world each time: a new one
runs afresh.)
"""

from __future__ import annotations

import abc
import queue
import threading
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from pipeschedule.errors import RuntimeScheduleError

ABORT_POLL_S = 0.02
_FAILED_GROUPS: dict = {}  # process group -> the first line of a failure a step over it met, in this process


@dataclass(frozen=True)
class P2P:
    """One message of a batch: send `tensor` to `peer`, or receive into it from `peer`.
    `instr` is the instruction it comes from (for error messages)."""

    send: bool
    peer: int
    tensor: torch.Tensor
    instr: object = None


class Pending(abc.ABC):
    """A posted batch (or any other wait). `ready()` never blocks; `wait_for(s)` blocks
    up to s seconds and says whether it is ready; `finish()` raises what the transport
    reported and completes the batch (copy-backs)."""

    @abc.abstractmethod
    def ready(self) -> bool: ...

    def wait_for(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        pause = 1e-5
        while not self.ready():
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
        return True

    def finish(self) -> None:  # noqa: B027  (a default, not abstract: a wait with nothing to complete keeps it)
        pass


class Transport(abc.ABC):
    """Base class; see the module docstring. `rank` and `world_size` are pipeline ranks."""

    rank: int
    world_size: int

    def __init__(self) -> None:
        self._executors = 0

    def namespace(self) -> str:
        """A key prefix for one executor's metadata. Every rank must build its executors
        on a transport in the same order (as with collectives)."""
        self._executors += 1
        return f"x{self._executors - 1}/"

    @abc.abstractmethod
    def post(self, ops: list[P2P]) -> Pending:
        """Posts one batch of messages; never blocks."""

    def outstanding_sends(self) -> Pending | None:
        """The sends posted but not yet complete, as one Pending, or None when there are
        none ([Note: sends in the background]); raises the error of a send that failed."""
        return None

    @abc.abstractmethod
    def publish(self, key: str, value: str) -> None:
        """Sets one-time metadata `key` for every rank to read."""

    @abc.abstractmethod
    def lookup(self, key: str) -> str | None:
        """The metadata under `key`, or None while nobody has published it; never blocks."""

    @abc.abstractmethod
    def abort(self, message: str) -> None:
        """Tells every rank to stop, quoting `message` (the first message stays)."""

    @abc.abstractmethod
    def aborted(self) -> str | None:
        """The abort message, or None."""

    failure: str | None = None  # the first line of a failed step's error ([Note: no retry on a failed group])

    def mark_failed(self, message: str) -> None:
        """A step over this transport failed with `message` ([Note: no retry on a failed group])."""
        if self.failure is None:
            self.failure = message.splitlines()[0]


# [Note: a finished batch holds nothing] A Pending keeps its batch's tensors alive (its
# works and ops) until the messages complete, and no longer: `finish` drops them. Others
# still hold the Pending for a while (the driver's last wait, the waiter thread's last
# batch), and a send's tensor is an alias of the stage output, so a Pending that kept
# them held a sent output's storage past its FREE act_out, until the next batch (pool=False:
# two outputs live during the next F, where the ledger counts one).


class _PolledWorks(Pending):
    def __init__(self, works, ops):
        self.works, self.ops = works, ops  # ops keep the tensors alive until completion

    def ready(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def finish(self) -> None:
        for work in self.works:
            work.wait()
        self.works, self.ops = (), ()  # [Note: a finished batch holds nothing]


class _ThreadWaited(Pending):
    def __init__(self, works, ops):
        self.works, self.ops = works, ops
        self.event = threading.Event()
        self.error: BaseException | None = None

    def begin(self) -> None:
        """Run by the waiting thread before it waits on the works (nothing: they are posted)."""

    def ready(self) -> bool:
        return self.event.is_set()

    def wait_for(self, seconds: float) -> bool:
        return self.event.wait(seconds)

    def finish(self) -> None:
        if self.error is not None:
            raise self.error
        self.works, self.ops = (), ()  # [Note: a finished batch holds nothing]


def _wait_loop(batches: queue.SimpleQueue) -> None:
    while True:  # [Note: waiting on gloo]
        _wait_all(batches.get())  # (in a call of its own: no local holds a batch while the next is awaited)


def _wait_all(pending: _ThreadWaited) -> None:
    try:
        pending.begin()
        for work in pending.works:
            work.wait()
    except BaseException as err:  # reported to the executor through finish()
        pending.error = err
    pending.event.set()


class _PostedLater(_ThreadWaited):
    """Sends that the waiting thread posts itself once `copied` (an event after the copies
    into their host buffers; None: nothing to wait for) has completed, then waits on."""

    def __init__(self, post, ops, copied):
        super().__init__((), ops)
        self.post, self.copied = post, copied

    def begin(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()
        self.works = self.post(self.ops)


# [Note: staged sends leave the host free] A staged send reads a host copy of the device
# tensor, which lands only once the device has run the copy (and the compute before it on
# the stream). `post` used to wait for the stream there, so the host stopped enqueueing at
# every send until the device had drained its queue, and the device then sat idle while
# the host posted the send, took up its next instruction and launched the next kernel: on
# four ranks sharing one H100 under MPS (benchmarks/results/parallel_mps_ranks.md) every
# message cost its rank about 1.5 ms of idle device at 16 MiB, twice as many messages (the
# schedules of two stages a rank) twice that, and those schedules missed the simulator by
# 9-18%. Now the host records an event after the copies and goes on; the transport's
# "sends" thread waits for the event, posts the sends with gloo and waits for them, one
# batch after another in posting order (messages between two ranks pair by order). The
# receives are posted by the executor's thread as before: gloo's send and receive may be
# called from different threads.


class DistTransport(Transport):
    """torch.distributed point-to-point over `group` (default: the world), one
    `batch_isend_irecv` per batch; metadata and abort through `store` under `prefix`.
    Two transports sharing a store need different prefixes."""

    def __init__(self, store: dist.Store, *, group=None, prefix: str = "pipeschedule/"):
        super().__init__()
        self.store, self.group, self.prefix = store, group, prefix
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._waiting: dict[str, queue.SimpleQueue] = {}  # waiter thread -> its queue
        self._sends: list[_ThreadWaited] = []  # sends posted, not yet seen complete
        failed = _FAILED_GROUPS.get(self._group())
        if failed is not None:
            raise RuntimeScheduleError(
                f"rank {self.rank}: a step over this process group failed earlier ({failed}); its channels may "
                f"still hold that step's messages, which a new step would take for its own: build the "
                f"executors on a new process group (torch.distributed.new_group) with a new prefix, or restart "
                f"the job ([Note: no retry on a failed group])", rank=self.rank)
        earlier = self.aborted()
        if earlier is not None:
            raise RuntimeScheduleError(
                f"rank {self.rank}: the store holds an abort under prefix {prefix!r}: "
                f"{earlier.splitlines()[0]}\n  a transport over it would stop at once: give a new prefix (and a "
                f"new process group), or restart the job", rank=self.rank)

    def _group(self):
        return self.group if self.group is not None else dist.group.WORLD

    def mark_failed(self, message: str) -> None:
        super().mark_failed(message)
        _FAILED_GROUPS.setdefault(self._group(), self.failure)

    def post(self, ops: list[P2P]) -> Pending:
        """Posts the batch. On a GPU (NCCL) the Pending covers the whole batch; on CPU (gloo)
        each send goes out from a copy and the Pending covers the receives only ([Note: sends
        in the background])."""
        if ops[0].tensor.device.type != "cpu":
            return _PolledWorks(self._post_works(ops), ops)
        self.outstanding_sends()  # drops the copies of sends already received
        staged = [replace(op, tensor=op.tensor.clone()) if op.send else op for op in ops]
        return self._split_sends(self._post_works(staged), staged)

    def _split_sends(self, works, ops: list[P2P]) -> Pending:
        """A Pending for the receives of a posted gloo batch; its sends are waited on by the
        "sends" thread and collected by `outstanding_sends` ([Note: sends in the background])."""
        if len(works) != len(ops):  # one work for the whole batch: no send can be told apart
            return self._thread_waited(works, ops)
        sent = [(work, op) for work, op in zip(works, ops) if op.send]
        received = [(work, op) for work, op in zip(works, ops) if not op.send]
        if sent:
            self._sends.append(self._thread_waited(*map(list, zip(*sent)), thread="sends"))
        return self._thread_waited(*map(list, zip(*received))) if received else _Done()

    def outstanding_sends(self) -> Pending | None:
        waiting = []
        for pending in self._sends:
            if pending.ready():
                pending.finish()  # raises a failed send's error
            else:
                waiting.append(pending)
        self._sends = waiting
        return _AllOf(list(self._sends)) if self._sends else None

    def _post_works(self, ops: list[P2P]) -> list:
        requests = [
            dist.P2POp(dist.isend if op.send else dist.irecv, op.tensor, group=self.group, group_peer=op.peer)
            for op in ops
        ]
        return dist.batch_isend_irecv(requests)

    def _thread_waited(self, works, ops, *, thread: str = "wait") -> _ThreadWaited:
        """A Pending for gloo `works`, waited on by this transport's daemon thread `thread`
        ([Note: waiting on gloo]); works given to one thread are waited on in turn."""
        return self._to_thread(_ThreadWaited(works, ops), thread)

    def _to_thread(self, pending: _ThreadWaited, thread: str) -> _ThreadWaited:
        if thread not in self._waiting:
            self._waiting[thread] = queue.SimpleQueue()
            threading.Thread(target=_wait_loop, args=(self._waiting[thread],), daemon=True,
                             name=f"pipeschedule-{thread}").start()
        self._waiting[thread].put(pending)
        return pending

    def publish(self, key: str, value: str) -> None:
        self.store.set(self.prefix + key, value)

    def lookup(self, key: str) -> str | None:
        key = self.prefix + key
        return self.store.get(key).decode() if self.store.check([key]) else None

    def abort(self, message: str) -> None:
        if self.store.add(self.prefix + "abort_count", 1) == 1:
            self.store.set(self.prefix + "abort", message)

    def aborted(self) -> str | None:
        return self.lookup("abort")


class _Done(Pending):
    """A wait with nothing to wait for (a batch of sends only)."""

    def ready(self) -> bool:
        return True


class _AllOf(Pending):
    """Ready when every one of `pendings` is; `finish` finishes each."""

    def __init__(self, pendings: list[Pending]):
        self.pendings = pendings
        self.what = f"{len(pendings)} batches of sends posted in this step to be received"

    def ready(self) -> bool:
        return all(pending.ready() for pending in self.pendings)

    def wait_for(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        return all(pending.wait_for(max(0.0, deadline - time.monotonic())) for pending in self.pendings)

    def finish(self) -> None:
        for pending in self.pendings:
            pending.finish()


class _CopyBack(Pending):
    def __init__(self, inner: Pending, copies):
        self.inner, self.copies = inner, copies

    def ready(self) -> bool:
        return self.inner.ready()

    def wait_for(self, seconds: float) -> bool:
        return self.inner.wait_for(seconds)

    def finish(self) -> None:
        self.inner.finish()
        for device_tensor, host_tensor in self.copies:
            device_tensor.copy_(host_tensor)


class HostStagedTransport(DistTransport):
    """`DistTransport` over gloo for ranks that share a GPU (NCCL refuses two ranks on
    one device; gloo cannot carry CUDA tensors): each tensor is copied to (pinned, for
    CUDA) host memory, sent with gloo, and copied back into the device buffer at
    `finish`. CPU tensors are staged the same way, which is how it is tested.
    `staged_bytes` counts the bytes copied through host memory."""

    def __init__(self, store: dist.Store, **kwargs):
        super().__init__(store, **kwargs)
        self.staged_bytes = 0

    def post(self, ops: list[P2P]) -> Pending:
        """Posts the batch's receives; its sends go out from the "sends" thread once their
        host copies have landed ([Note: staged sends leave the host free]). The Pending
        covers the receives ([Note: sends in the background])."""
        self.outstanding_sends()  # drops the host copies of sends already received
        staged = [replace(op, tensor=self._host(op.tensor, copy=op.send)) for op in ops]
        sends = [op for op in staged if op.send]
        if sends:
            copied = None
            if any(op.send and op.tensor.is_cuda for op in ops):
                copied = torch.cuda.Event()
                copied.record()  # after the copies into the host buffers, on the current stream
            self._sends.append(self._to_thread(_PostedLater(self._post_works, sends, copied), "sends"))
        receives = [op for op in staged if not op.send]
        copies = [(op.tensor, host.tensor) for op, host in zip(ops, staged) if not op.send]
        inner = self._thread_waited(self._post_works(receives), receives) if receives else _Done()
        return _CopyBack(inner, copies)

    def _host(self, tensor: torch.Tensor, *, copy: bool) -> torch.Tensor:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        self.staged_bytes += tensor.nbytes
        return host.copy_(tensor, non_blocking=True) if copy else host
