"""nanotron's process groups and point-to-point layer on CPU, over gloo; and the same
layer for ranks that share one GPU over gloo (`HostStagedP2P`, [Note: host-staged P2P]).

[Note: nanotron on CPU] Four things in nanotron 0.4 stop its pipeline engine from
running on a CPU-only torch with gloo; none of them is in the engine itself:

1. `ParallelContext.__init__` calls `torch.cuda.set_device` and asserts
   `backend == "nccl"` (and, if torch.distributed is not initialised, its
   `initialize_torch_distributed` raises without CUDA). `cpu_parallel_context` builds
   the object without running `__init__`: it sets the same attributes `__init__` sets and
   then calls nanotron's own `_init_parallel_groups`, so the group layout (ranks reshaped
   as (expert, pp, dp, tp)) is nanotron's, not a copy of it.
2. `LlamaModel` builds `P2P(pp_pg, device=torch.device("cuda"))`; P2P only uses the
   device for its metadata buffers and receive buffers, so a CPU device works, but:
3. nanotron's 1F1B deadlocks on gloo with nanotron's own `P2P`. `P2P.send_tensors`
   sends the two metadata messages with blocking `dist.send` and waits for the data
   `isend`. Under NCCL these calls return once the operation is queued on the GPU
   stream and NCCL buffers small messages, so a send never waits for its receive from
   the host's point of view. Under gloo a send is a rendezvous: it returns only once the
   peer has posted the matching receive, even for one element (both ranks calling
   `dist.send` to each other hang). In 1F1B's steady state rank r sends the activation
   of microbatch k+1 from inside a backward (`run_communication` sends pending
   activations first) while rank r+1 sends the gradient of microbatch k-1 from inside a
   forward, and each waits for the other. `CpuP2P` posts every send with `isend` (fresh
   metadata tensors, since P2P reuses one buffer for them) in the same wire format
   (7 longs of metadata, shape+stride, then the data), so nanotron's unchanged receive
   path reads it, and returns at once: NCCL's semantics. A completer thread releases
   each sent tensor once received. Because sends are only posted, call `wait_sends()`
   at the end of a step (the harness does): a process that leaves with sends pending
   loses them, and its peer fails with "Connection closed by peer". (AFAB ran at pp=2
   with nanotron's own P2P too; `CpuP2P` is used for both.)
4. `nanotron.models.llama` imports flash_attn at module level; we do not import it (our
   model is `benchmarks.llama.model`).

Everything else ran unchanged: `PipelineBlock`, the batch states, the autograd
functions, `OneForwardOneBackwardPipelineEngine`, `AllForwardAllBackwardPipelineEngine`
and DDP's gradient sync through `ddp_trigger_sync_in_bwd`. (The autograd functions
create their dummy tensors on "cpu" even on GPU, so that part is native here.)

torch.distributed must already be initialised (gloo) and the environment must hold
RANK and WORLD_SIZE: `_init_parallel_groups` reads both from `os.environ`.
"""

from __future__ import annotations

import inspect
import os
import queue
import threading

import torch
import torch.distributed as torch_dist

import nanotron
import nanotron.distributed as nanotron_dist
from nanotron.parallel.context import ParallelContext
from nanotron.parallel.pipeline_parallel.p2p import P2P, P2PTensorMetaData, view_as_contiguous

from integration.nanotron.pipeline.errors import EngineRuntimeError, ParameterError, PatchError

HOST = torch.device("cpu")  # where every tensor handed to gloo lives


def cpu_parallel_context(*, tp: int = 1, pp: int = 1, dp: int = 1, expert: int = 1) -> ParallelContext:
    """A real nanotron `ParallelContext` over the current gloo world; see [Note: nanotron on CPU].

    Collective: every rank of the world calls it with the same sizes.
    """
    if not torch_dist.is_initialized():
        raise EngineRuntimeError("initialise torch.distributed (gloo) before cpu_parallel_context()")
    world_size = torch_dist.get_world_size()
    if tp * pp * dp * expert != world_size:
        raise ParameterError(f"tp * pp * dp * expert = {tp} * {pp} * {dp} * {expert} = {tp * pp * dp * expert}, "
                         f"but the world has {world_size} processes")
    for key, value in (("RANK", torch_dist.get_rank()), ("WORLD_SIZE", world_size)):
        if os.environ.get(key) != str(value):
            raise EngineRuntimeError(f"nanotron's group setup reads {key} from the environment: set {key}={value}")
    _check_parallel_context()
    context = ParallelContext.__new__(ParallelContext)
    # What ParallelContext.__init__ sets, minus set_device() and the NCCL assert.
    context.tensor_parallel_size = tp
    context.pipeline_parallel_size = pp
    context.data_parallel_size = dp
    context.expert_parallel_size = expert
    context._groups = {}
    context.world_pg = torch_dist.new_group(ranks=list(range(world_size)), backend=torch_dist.get_backend())
    context._init_parallel_groups()
    return context


CONTEXT_INIT = ("self", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                "expert_parallel_size", "backend")  # ParallelContext.__init__ as checked (0.4 and GitHub main)


def _check_parallel_context() -> None:
    """`cpu_parallel_context` repeats what `ParallelContext.__init__` sets and calls its
    private `_init_parallel_groups` ([Note: nanotron on CPU], item 1): refused where
    nanotron's class is not the one it was written for."""
    found = tuple(inspect.signature(ParallelContext.__init__).parameters)
    if found != CONTEXT_INIT or not callable(getattr(ParallelContext, "_init_parallel_groups", None)):
        raise PatchError(
            f"cpu_parallel_context cannot build nanotron {nanotron.__version__}'s ParallelContext: its __init__ takes "
            f"{found} (written for {CONTEXT_INIT}, with _init_parallel_groups), as in nanotron 0.4 and GitHub main")


class CpuP2P(P2P):
    """nanotron's P2P with sends that return once posted ([Note: nanotron on CPU], item 3).

    Receives are nanotron's own. Sends are posted with `isend` in the order nanotron's
    receiver reads them; a daemon thread then waits for each, oldest first, and drops
    its tensors as soon as it is received (as a GPU keeps a tensor only until the NCCL
    kernel reading it has run). Two gloo facts shape this: a gloo send's
    `Work.is_completed()` stays False until someone calls `wait()`, so completion cannot
    be polled; and `wait()` may be called only once per send (a second call blocks for
    ever), so `isend_tensors` returns no work to wait on. `wait_sends()` blocks until all
    sends are received (call it at the end of a step); `pending_sends()` counts them.
    """

    def __init__(self, pg, device: torch.device | str = "cpu"):
        super().__init__(pg, device=torch.device(device))
        self._posted: queue.SimpleQueue = queue.SimpleQueue()  # (work, message, tensor)
        self._outstanding = 0
        self._done = threading.Condition()
        self._failure: BaseException | None = None
        self._completer: threading.Thread | None = None

    def send_tensors(self, tensors, to_rank: int, tag: int = 0):
        self.isend_tensors(tensors, to_rank=to_rank, tag=tag)

    def isend_tensors(self, tensors, to_rank: int, tag: int = 0):
        self._raise_failure()
        if to_rank == nanotron_dist.get_rank(self.pg):
            raise ParameterError("Tried sending tensor to itself")
        peer = nanotron_dist.get_global_rank(group=self.pg, group_rank=to_rank)
        for tensor in tensors:
            messages = (
                P2PTensorMetaData.to_first_metadata(tensor=tensor, device=HOST),
                P2PTensorMetaData.to_second_metadata(tensor=tensor, device=HOST),
                self._data_message(tensor),
            )
            for message in messages:
                work = torch_dist.isend(message, dst=peer, group=self.pg, tag=tag)
                with self._done:
                    self._outstanding += 1
                self._posted.put((work, message, tensor))
        self._start_completer()
        return []  # completion is the completer thread's job (see class docstring)

    def _data_message(self, tensor: torch.Tensor) -> torch.Tensor:
        """What nanotron's `isend_tensors` sends for `tensor`: the tensor if contiguous,
        else its whole storage; complex viewed as real."""
        buffer = tensor if tensor.is_contiguous() else view_as_contiguous(tensor)
        return torch.view_as_real(buffer) if buffer.is_complex() else buffer

    def pending_sends(self) -> int:
        with self._done:
            return self._outstanding

    def wait_sends(self, timeout: float | None = None) -> None:
        """Block until every posted send has been received; raise if one failed."""
        with self._done:
            if not self._done.wait_for(lambda: self._outstanding == 0, timeout=timeout):
                raise EngineRuntimeError(f"{self._outstanding} sends not received after {timeout} s")
        self._raise_failure()

    def _start_completer(self) -> None:
        if self._completer is None:
            self._completer = threading.Thread(target=self._complete_sends, name="CpuP2P-sends", daemon=True)
            self._completer.start()

    def _complete_sends(self) -> None:
        while True:
            item = self._posted.get()
            try:
                item[0].wait()
            except BaseException as error:  # noqa: BLE001  (re-raised on the main thread)
                self._failure = self._failure or error
            del item  # release the sent tensor now, not at the next get()
            with self._done:
                self._outstanding -= 1
                self._done.notify_all()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise EngineRuntimeError(f"a posted send failed: {self._failure}") from self._failure


class HostStagedP2P(CpuP2P):
    """`CpuP2P` for ranks whose tensors live on a GPU while their pipeline group is gloo.

    [Note: host-staged P2P] The one-GPU benchmarks run pp=4 as four processes sharing one
    GPU. NCCL refuses two ranks of a communicator on one device, so their group is gloo;
    and gloo carries only CPU tensors, so nanotron's P2P, which hands gloo the device
    tensor it sends and receives into buffers on its device, fails there. This class
    keeps nanotron's wire format and puts host memory (pinned on a GPU) between the
    device and gloo:

    - send: the metadata describes the device tensor, as nanotron's does; the data
      message is a host copy of what nanotron would send. The copy is blocking, since
      gloo's thread may read it as soon as it is posted. As in `CpuP2P` the send is only
      posted, and the completer keeps the device tensor until it is received, as NCCL
      keeps a sent tensor until the kernel reading it has run.
    - receive (`irecv_tensors`, which nanotron's `recv_tensors` calls): the metadata
      into the host buffers; the data into a host buffer shaped like nanotron's receive
      buffer; then a copy into that buffer, made on `device` by nanotron's own
      `create_empty_storage` and viewed by its `reshape`. The tensor returned is
      therefore the one nanotron's receive would return (dtype, shape, stride, storage
      size and offset, requires_grad), on `device`, and complete: no work is left to wait on.

    nanotron's engines reach the wire only through `send_tensors` / `recv_tensors` (the
    batch state's `SendActivation`, `RecvActivation`, `SendGrad`, `RecvGrad`).
    `BatchTensorSendRecvState`, which a `PipelineBlock` fills only when no engine is
    attached (under an engine its `flush()` has nothing to do), builds its own operations
    on `device` and is not staged. With device "cpu" the staging is a plain copy, which is
    how it is tested.
    """

    def __init__(self, pg, device: torch.device | str):
        super().__init__(pg, device=device)
        # P2P.__init__ puts the metadata buffers on `device`; gloo needs them on the host.
        # (nanotron's _recv_meta regrows second_metadata on `device` only for a tensor of
        # more than 512 dimensions.)
        self.first_metadata = torch.empty_like(self.first_metadata, device=HOST)
        self.second_metadata = torch.empty_like(self.second_metadata, device=HOST)
        self._pinned = self.device.type == "cuda"

    def _data_message(self, tensor: torch.Tensor) -> torch.Tensor:
        data = super()._data_message(tensor).detach()
        return torch.empty(data.shape, dtype=data.dtype, pin_memory=self._pinned).copy_(data)

    def irecv_tensors(self, num_tensors: int, from_rank: int, tag: int = 0):
        if from_rank == nanotron_dist.get_rank(self.pg):
            raise ParameterError("Tried receiving tensor from itself")
        peer = nanotron_dist.get_global_rank(group=self.pg, group_rank=from_rank)
        received = []
        for _ in range(num_tensors):
            meta = self._recv_meta(from_rank=from_rank, tag=tag)
            buffer = meta.create_empty_storage(self.device)  # what nanotron receives into
            staged = torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=self._pinned)
            torch_dist.recv(staged, src=peer, group=self.pg, tag=tag)
            buffer.detach().copy_(staged)  # detached: buffer may be a view of a leaf that requires grad
            received.append(meta.reshape(buffer=buffer))
        return received, []


def cpu_p2p(pp_pg) -> CpuP2P:
    """nanotron's P2P on the pipeline group, with CPU buffers and posted sends."""
    return CpuP2P(pp_pg, device="cpu")


def host_staged_p2p(pp_pg, device: torch.device | str) -> HostStagedP2P:
    """nanotron's P2P on a gloo pipeline group for tensors on `device` (a GPU that several
    ranks share), staged through host memory; see [Note: host-staged P2P]."""
    return HostStagedP2P(pp_pg, device=device)
