"""The runtime: executes one rank's program of a lowered schedule with torch.

The only part of pipeschedule that imports torch. Pieces:

    executor    Executor: one rank's program, instruction by instruction
    stages      Stages protocol (what runs at F and B), ModuleStages adapter
    transport   DistTransport (torch.distributed), HostStagedTransport (ranks sharing a GPU)
    shapes      TensorMeta, the one-time exchange of boundary shapes
    agreement   ScheduleSummary: every rank runs the same schedule, compared at the first step
    inprocess   InProcessPipeline: every rank in one process, stepped deterministically
    ledger      Ledger: live bytes per buffer kind (device and host), high-water marks, per-instruction trace
    host_offload  Offloader: OFFLOAD / RELOAD of stashes on a side stream, pinned host buffers
    stream_offload  a stash streamed to the host while F saves it and back while B consumes it
    saved       the holders of a stash's saved tensors, their storages, the host buffer pool
    buffers     BufferTable: every buffer of (kind, stage, mb) from its producer to its FREE
    pool        BufferPool: boundary buffers sized by the schedule, allocated once
    split_backward  WeightGrads: B's deferred weight-gradient matmuls, run at W
    driver      the blocking driver and its watchdog
    launch      spawn: one process per rank, for tests and benchmarks

    >>> from pipeschedule.compiler.families import generate
    >>> from pipeschedule.compiler.passes import lower
    >>> schedule = lower(generate("1f1b", pp=2, microbatches=4))
    >>> executor = Executor(schedule, rank, ModuleStages(chunks, loss_fn), DistTransport(store))
    >>> outputs = executor.step(inputs, targets)   # [{"loss": ...}] * 4 on rank 1
"""

from pipeschedule.runtime.driver import RemoteOutput, StepTimes
from pipeschedule.runtime.agreement import ScheduleSummary
from pipeschedule.errors import LaunchError, RuntimeScheduleError, ScheduleMismatchError
from pipeschedule.runtime.buffers import BufferTable, Stash
from pipeschedule.runtime.executor import Executor
from pipeschedule.runtime.inprocess import (
    InProcessPipeline, InProcessTransport, InProcessWorld, run_in_process, run_in_threads,
)
from pipeschedule.runtime.host_offload import Offloader
from pipeschedule.runtime.saved import HostPool, SavedTensor
from pipeschedule.runtime.ledger import Ledger
from pipeschedule.runtime.pool import BufferPool
from pipeschedule.runtime.stages import ModuleStages, Stages
from pipeschedule.runtime.shapes import Shapes, TensorMeta
from pipeschedule.runtime.split_backward import SplitReport, WeightGrads
from pipeschedule.runtime.transport import DistTransport, HostStagedTransport, P2P, Pending, Transport

__all__ = [
    "BufferPool", "BufferTable", "DistTransport", "Executor", "HostStagedTransport", "InProcessPipeline",
    "InProcessTransport", "HostPool", "InProcessWorld", "LaunchError", "Ledger", "ModuleStages", "Offloader", "P2P",
    "Pending", "RemoteOutput", "RuntimeScheduleError", "SavedTensor", "ScheduleMismatchError", "ScheduleSummary",
    "Shapes", "SplitReport", "Stages", "Stash", "StepTimes", "TensorMeta", "Transport", "WeightGrads", "run_in_process",
    "run_in_threads",
]
