"""nanotron's trainer over gloo: the patches `use_gloo()` installs ([Note: nanotron over gloo]
in integration/nanotron/gloo.py, items 2 to 5; [Note: nanotron patches]).

`patching.install(gloo=True)` applies them after torch.distributed is up; the CPU-only
ones (the rotary table, four `torch.cuda` functions, the `CudaToCpu` mode) only where
torch has no GPU. nanotron's Llama is imported when they apply (it rebinds the P2P class
that Llama builds), so after `flash_attn_standin.install()`.
"""

from __future__ import annotations

import os

import nanotron.distributed as nanotron_dist
import torch
from nanotron.parallel.context import ParallelContext
from torch.overrides import TorchFunctionMode

from integration.nanotron.patches.cpu import CpuP2P, HostStagedP2P
from integration.nanotron.patches.base import Patch, rebind

class CudaToCpu(TorchFunctionMode):
    """Every CUDA device argument of a torch function becomes the CPU
    ([Note: nanotron over gloo], item 4)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and _is_cuda(device):
            kwargs = {**kwargs, "device": "cpu"}
        if func in _MOVES and args:
            if func is torch.Tensor.cuda:
                return args[0]
            if len(args) > 1 and _is_cuda(args[1]):
                args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


_MOVES = (torch.Tensor.to, torch.Tensor.cuda)


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "broadcast", "all_gather", "all_gather_into_tensor",
               "reduce_scatter_tensor", "reduce")


def _without_grad(name: str):
    """nanotron's collective `name` run under `torch.no_grad` ([Note: nanotron over gloo],
    item 5); the original is the patch's."""

    def run(*args, **kwargs):
        with torch.no_grad():
            return run.__pipeschedule_original__(*args, **kwargs)

    run.__name__ = run.__qualname__ = name
    return run


class _CopiedBack:
    """The handle of `flat_all_reduce(async_op=True)`: `wait()` waits for the flat
    all-reduce, then copies its result back into the tensors, once; and first does the
    same for every handle issued before it in this process that nobody waited on
    ([Note: a wait completes the earlier reductions])."""

    def __init__(self, work, flat: torch.Tensor, tensors: list[torch.Tensor]):
        self.work, self.flat, self.tensors = work, flat, tensors
        _UNWAITED.append(self)

    def wait(self, timeout=None) -> bool:
        if self.flat is not None:
            while _UNWAITED:
                handle = _UNWAITED.pop(0)
                handle._finish(timeout)
                if handle is self:
                    break
        return True

    def _finish(self, timeout) -> None:
        if self.flat is None:
            return
        if timeout is None:
            self.work.wait()
        else:
            self.work.wait(timeout)
        _copy_back(self.flat, self.tensors)
        self.flat, self.tensors = None, []

    def is_completed(self) -> bool:
        return self.flat is None or self.work.is_completed()


_UNWAITED: list[_CopiedBack] = []  # async flat all-reduces issued, in order, not yet copied back

# [Note: a wait completes the earlier reductions] nanotron's fp32-accumulation DDP hook
# (nanotron/optim/gradient_accumulator.py, `get_fp32_accum_hook`) calls
# `all_reduce_coalesced(async_op=True)` once per DDP bucket and keeps only the last handle
# (`fp32_grads_allreduce_handle`), which the trainer waits on. Over NCCL that suffices:
# the reductions are in place and ordered on one stream, so the last one's end is every
# one's. Here the result of each reduction lands in its host buffer and is copied back at
# its handle's `wait()`, so waiting on the last handle alone left every other bucket's
# gradients un-averaged (each rank kept its own sum; a model of more than one bucket
# trained on wrong gradients). So a wait first completes, in order, every earlier handle
# nobody waited on, as a wait on NCCL's last work implies the earlier ones.


def _copy_back(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    with torch.no_grad():
        offset = 0
        for tensor in tensors:
            tensor.copy_(flat[offset:offset + tensor.numel()].view(tensor.shape))
            offset += tensor.numel()


def flat_all_reduce(tensors, op, group, async_op: bool):
    """All-reduce `tensors` (of one dtype) as one flat buffer in host memory (one
    `dist.all_reduce`), the result copied back into them: at once, or at the returned
    handle's `wait()` with `async_op`. The buffer is on the host whatever the tensors'
    device: gloo reduces on the host anyway, and a flat copy on the GPU would add the
    whole set's bytes to the device's peak, which nanotron's NCCL path (each tensor reduced
    in place) does not (measured: 2.99 GiB more on the first stage of a ZeRO-0 step,
    benchmarks/results/zero1_step_zero0.md)."""
    dtypes = sorted({str(t.dtype) for t in tensors})
    if len(dtypes) > 1:
        raise ValueError(f"all_reduce_coalesced over gloo: the tensors have dtypes {', '.join(dtypes)}; "
                         "one dtype is accepted (as gloo's own coalesced all-reduce)")
    with torch.no_grad():
        flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype)
        offset = 0
        for tensor in tensors:
            flat[offset:offset + tensor.numel()].copy_(tensor.reshape(-1))
            offset += tensor.numel()
        work = torch.distributed.all_reduce(flat, op=op, group=group, async_op=async_op)
    if async_op:
        return _CopiedBack(work, flat, list(tensors))
    _copy_back(flat, tensors)
    return None


def _all_reduce_coalesced(tensors, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
    """nanotron's `all_reduce_coalesced` over gloo, under torch.no_grad. gloo's coalesced
    all-reduce takes CPU tensors only ("ProcessGroupGloo::allreduce_coalesced: unsupported
    device type cuda": nanotron's fp32-accumulation DDP hook under ZeRO-0 with dp > 1 and
    ranks sharing a GPU); CUDA tensors go through one flat `all_reduce` of a host buffer,
    and back (`flat_all_reduce`)."""
    if tensors and tensors[0].is_cuda:
        if group is None:
            group = torch.distributed.distributed_c10d._get_default_group()
        if group.size() == 1:
            return None
        return flat_all_reduce(tensors, op, group, async_op)
    with torch.no_grad():
        return _all_reduce_coalesced.__pipeschedule_original__(tensors, op=op, group=group, async_op=async_op)


def _set_device(self) -> None:
    """`ParallelContext.set_device` for ranks sharing the GPUs of a machine, or none."""
    if torch.cuda.is_available():
        local_rank = int(os.getenv("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


def _gloo_p2p(pg, device=None):
    """The P2P nanotron's Llama builds, for a gloo pipeline group ([Note: nanotron over gloo], item 3)."""
    if torch.cuda.is_available():
        return HostStagedP2P(pg, device=torch.device("cuda", torch.cuda.current_device()))
    return CpuP2P(pg, device="cpu")


def _init_rotary_on_cpu(self) -> None:
    """nanotron's `RotaryEmbedding.init_rotary_embeddings` asserts its table is on CUDA;
    this builds the same table on the CPU: row t holds (cos, sin) of t * theta^(-2i/dim)
    for i < dim/2, in fp32, as a non-persistent buffer `freqs_cis` of shape (end, dim/2, 2)."""
    if self._initialized_buffer:
        return
    inverse = 1.0 / (self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.float)[: self.dim // 2] / self.dim))
    angles = torch.outer(torch.arange(self.end), inverse).float()
    table = torch.view_as_real(torch.polar(torch.ones_like(angles), angles))
    self.register_buffer("freqs_cis", table.contiguous(), persistent=False)
    self._initialized_buffer = True


def _returning(name: str, result):
    """A stand-in for `torch.cuda.<name>` on a CPU build (one function object per name:
    torch's compiler keys its rules by function)."""

    def stand_in(*args, **kwargs):
        return result

    stand_in.__name__ = stand_in.__qualname__ = name
    return stand_in


def _on_cpu() -> bool:
    return not torch.cuda.is_available()


_mode: list[CudaToCpu] = []


def _enter_mode() -> None:
    mode = CudaToCpu()
    mode.__enter__()  # for the life of the process, or until uninstalled
    _mode.append(mode)


def _exit_mode() -> None:
    _mode.pop().__exit__(None, None, None)


SET_DEVICE = rebind(ParallelContext, "set_device", _set_device, parameters=("self",),
                    why="ranks share the machine's GPUs (LOCAL_RANK % device_count), or none on a CPU")
NO_GRAD_COLLECTIVES = tuple(
    rebind(nanotron_dist, name, _without_grad(name), why="gloo refuses an in-place collective on a leaf that "
           "requires grad: nanotron's collectives run under torch.no_grad")
    for name in COLLECTIVES if name != "all_reduce_coalesced") + (
    rebind(nanotron_dist, "all_reduce_coalesced", _all_reduce_coalesced,
           why="under torch.no_grad as the other collectives; CUDA tensors (ranks sharing a GPU) through one flat "
               "all_reduce: gloo's coalesced all-reduce takes CPU tensors only"),)
LLAMA_P2P = rebind("nanotron.models.llama", "P2P", _gloo_p2p,
                   why="nanotron's Llama builds CpuP2P (CPU) or HostStagedP2P (a shared GPU) for its gloo pipe group")
ROTARY_ON_CPU = rebind("nanotron.models.llama:RotaryEmbedding", "init_rotary_embeddings", _init_rotary_on_cpu,
                       parameters=("self",), needed=_on_cpu, why="the rotary table built on the CPU")
CUDA_STAND_INS = tuple(
    rebind(torch.cuda, name, _returning(name, result), needed=_on_cpu,
           why=f"torch.cuda.{name} a no-op on a CPU build of torch")
    for name, result in (("synchronize", None), ("reset_peak_memory_stats", None), ("set_device", None),
                         ("current_device", 0)))
CUDA_TO_CPU = Patch("torch function mode CudaToCpu", "every device='cuda' of a torch function becomes the CPU",
                    check=lambda: None, apply=_enter_mode, undo=_exit_mode, needed=_on_cpu)
PATCHES = (SET_DEVICE, *NO_GRAD_COLLECTIVES, LLAMA_P2P, ROTARY_ON_CPU, CUDA_TO_CPU, *CUDA_STAND_INS)

__all__ = ["COLLECTIVES", "CUDA_TO_CPU", "CudaToCpu", "PATCHES"]
