"""pp GPUs on one: every rank of a schedule in one process, each on its own partition of the
device's SMs, messages as on-device copies ordered by CUDA events.

[Note: partitioned stepping] `PartitionedPipeline` is `InProcessPipeline` ([Note: in-process
stepping] in inprocess) with one CUDA stream per rank, each made on its own SM partition
(`sm_partitions`: CUDA green contexts). The driver makes a rank's stream current while it
runs that rank, so every kernel of the rank (autograd's backward follows its forward's
stream) runs on its partition: the ranks compute side by side as on pp GPUs, and one
rank's idle partition is not lent to another, so its bubble shows. A message follows the
simulator's semantics ([Note: simulated semantics] in simulate/engine.py):

- a send copies its tensor on the sender's stream at post (the sender may reuse or free
  its own at once) and records an event after the copy;
- once the send and its receive have both been posted, the copy into the receive buffer
  is enqueued on the receiver's stream after that event (the receiver's host is held at
  its batch until then, so nothing of its later work is ahead of the copy), and the
  staged tensor is marked used by that stream (`record_stream`) so that the allocator
  does not hand its memory out again before the copy has read it;
- a batch completes on the host as soon as all its messages are matched, and no stream
  waits for another's copy: the sender goes on at once, as under NCCL's own stream, and
  the receiver's next work follows the copy on its stream.

So the host enqueues each rank's work as fast as it can run the executors, and the device
sets the pace where the host keeps up. It must enqueue every rank's work alone: measured on
an H100's partitions with the project's Llama (hidden 4096, seq 2048, four layers a stage),
a block took 10.6 ms of host time to enqueue against 27-57 ms of device time, and the one
host thread was busy 95-99% of the step, its ranks waiting for it
(benchmarks/results/parallel_gpu_partitions_host_both.md): one process emulates pp GPUs'
compute, not pp hosts. Waiting for the copy on the sender's stream too (a rendezvous, as a
blocking send) held each sender to its receiver's pace: measured on an H100 before this
rule, ZB-V's rank 0 lost about one forward before each of its warm-up forwards, 24% over
the simulated step (benchmarks/results/parallel_gpu_partitions.md). Without CUDA (or with
ordinary streams) it is the same arithmetic, so the losses and gradients equal those of
`InProcessPipeline`.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from pipeschedule.compiler.ir import Schedule
from pipeschedule.errors import ParameterError, RuntimeScheduleError
from pipeschedule.runtime.executor import Executor
from pipeschedule.runtime.inprocess import InProcessWorld, _Message, run_in_process, run_in_threads
from pipeschedule.runtime.stages import Stages
from pipeschedule.runtime.transport import P2P


class _DeviceMessage(_Message):
    __slots__ = ("staged", "posted")

    def __init__(self, op: P2P, rank: int, staged: torch.Tensor | None, posted: torch.cuda.Event | None):
        super().__init__(op, rank)
        self.staged, self.posted = staged, posted


class DeviceWorld(InProcessWorld):
    """An `InProcessWorld` whose ranks run on `streams[rank]` ([Note: partitioned stepping])."""

    def __init__(self, streams: Sequence[torch.cuda.Stream]):
        super().__init__(len(streams))
        self.streams = list(streams)

    def message(self, op: P2P, rank: int) -> _DeviceMessage:
        if not op.send:
            return _DeviceMessage(op, rank, None, None)
        stream = self.streams[rank]
        with torch.cuda.stream(stream):
            staged = op.tensor.detach().clone(memory_format=torch.contiguous_format)
        posted = torch.cuda.Event()
        posted.record(stream)
        return _DeviceMessage(op, rank, staged, posted)

    def deliver(self, send: _DeviceMessage, recv: _DeviceMessage) -> None:
        stream = self.streams[recv.rank]
        stream.wait_event(send.posted)
        with torch.cuda.stream(stream):
            recv.op.tensor.copy_(send.staged)
        send.staged.record_stream(stream)
        send.staged = send.posted = None

    def lane(self, rank: int):
        """The context in which rank `rank` runs: its stream current."""
        return torch.cuda.stream(self.streams[rank])


class PartitionedPipeline:
    """Every rank's `Executor` over one `DeviceWorld`; `step` runs them all
    ([Note: partitioned stepping]). `streams[r]` is rank r's stream (see `sm_partitions`);
    `threads`: a host thread per rank; keyword arguments go to each `Executor` (device
    defaults to the streams' device)."""

    def __init__(self, schedule: Schedule, stages: Stages, streams: Sequence[torch.cuda.Stream], *,
                 threads: bool = False, **executor_args: Any):
        if len(streams) != schedule.pp:
            raise ParameterError(f"{len(streams)} streams for the {schedule.pp} ranks of {schedule.name!r}: "
                                 "give one stream per rank")
        self.world = DeviceWorld(streams)
        self.schedule, self.threads = schedule, threads
        executor_args.setdefault("device", streams[0].device)
        self.executors = [Executor(schedule, r, stages, self.world.transport(r), **executor_args)
                          for r in range(schedule.pp)]

    def step(self, inputs=None, targets=None) -> list[list]:
        """One step of every rank, enqueued; returns each rank's outputs (`Executor.run`).
        The device may still be running it: synchronize before reading times. With
        `threads`, each rank enqueues from its own host thread ([Note: a host thread per
        rank] in inprocess)."""
        if self.threads:
            return run_in_threads(self.executors, self.world, inputs, targets, lane=self.world.lane)
        return run_in_process(self.executors, inputs, targets, lane=self.world.lane)


# -- SM partitions ---------------------------------------------------------------------------

ROUTES = ("auto", "balanced", "driver", "torch", "streams")


def sm_partitions(parts: int, *, route: str = "auto", device: int | None = None) -> tuple[list, list]:
    """(contexts, streams): `parts` partitions of an equal share of the device's SMs (a
    multiple of 8 each), each with one stream. Keep `contexts` alive as long as the streams.

    route "driver": the CUDA driver's green contexts through the cuda-bindings package
    (cuDevSmResourceSplitByCount, cuGreenCtxCreate, cuGreenCtxStreamCreate); "balanced":
    the same, each context also given its own work queues (a workqueue-config resource of
    scope GREEN_CTX_BALANCED; CUDA 13.1 drivers and later), so that no two partitions'
    work waits in one queue; "torch": `torch.cuda.green_contexts.GreenContext` and its
    stream (torch >= 2.10); "auto": the first of balanced, driver and torch that this
    machine has; "streams": ordinary streams, no partition (every kernel may use every
    SM: a control)."""
    if route not in ROUTES:
        raise ParameterError(f"route {route!r}: accepted: {', '.join(ROUTES)}")
    if route == "auto":
        for first in ("balanced", "driver"):
            try:
                return sm_partitions(parts, route=first, device=device)
            except (RuntimeScheduleError, AttributeError, TypeError):  # no cuda-bindings, or an older driver
                pass
        return sm_partitions(parts, route="torch", device=device)
    device = torch.cuda.current_device() if device is None else device
    total = torch.cuda.get_device_properties(device).multi_processor_count
    sms = total // parts // 8 * 8
    if route == "streams":
        return [], [torch.cuda.Stream(device) for _ in range(parts)]
    if sms < 8:
        raise ParameterError(f"{parts} partitions of {total} SMs leave fewer than 8 SMs each")
    if route == "torch":
        from torch.cuda.green_contexts import GreenContext

        contexts = [GreenContext.create(num_sms=sms, device_id=device) for _ in range(parts)]
        return contexts, [ctx.Stream() for ctx in contexts]
    return _driver_partitions(parts, sms, device, balanced=route == "balanced")


def _driver_partitions(parts: int, sms: int, device: int, *, balanced: bool) -> tuple[list, list]:
    try:
        from cuda.bindings import driver
    except ImportError as err:
        raise RuntimeScheduleError(f"the driver's green contexts need the cuda-bindings package ({err})") from None

    def check(result):
        err, *rest = result
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeScheduleError(f"CUDA driver call failed: {err}")
        return rest[0] if len(rest) == 1 else rest

    torch.cuda.init()
    handle = check(driver.cuDeviceGet(device))
    resource = check(driver.cuDeviceGetDevResource(handle, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    groups, count, _ = check(driver.cuDevSmResourceSplitByCount(parts, resource, 0, sms))
    if count < parts:
        raise RuntimeScheduleError(f"asked for {parts} SM groups of {sms}, the driver made {count}")
    queues = []
    if balanced:
        queues = [check(driver.cuDeviceGetDevResource(
            handle, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_WORKQUEUE_CONFIG))]
        queues[0].wqConfig.sharingScope = driver.CUdevWorkqueueConfigScope.CU_WORKQUEUE_SCOPE_GREEN_CTX_BALANCED
    contexts, streams = [], []
    for group in groups[:parts]:
        desc = check(driver.cuDevResourceGenerateDesc([group, *queues], 1 + len(queues)))
        ctx = check(driver.cuGreenCtxCreate(desc, handle, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
        raw = check(driver.cuGreenCtxStreamCreate(ctx, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
        contexts.append(ctx)
        streams.append(torch.cuda.ExternalStream(int(raw), device=device))
    return contexts, streams


def step_seconds(pipeline: PartitionedPipeline, inputs=None, targets=None) -> tuple[float, list[list]]:
    """(seconds, outputs) of one step, from the first enqueue to the end of the device's work."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = pipeline.step(inputs, targets)
    torch.cuda.synchronize()
    return time.perf_counter() - start, outputs
