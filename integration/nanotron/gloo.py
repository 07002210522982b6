"""nanotron's own trainer over gloo: on a machine without a GPU, or with several ranks on one GPU.

[Note: nanotron over gloo] nanotron's `DistributedTrainer` assumes NCCL and one GPU per
rank. Neither holds on this project's two test machines: the CPU machine has no GPU,
and the benchmark machine has one H200 that four pipeline ranks share (NCCL refuses two
ranks of a communicator on one device). `use_gloo()` prepares a process so that
nanotron's unchanged trainer, model, optimizer and engines run over gloo. What it changes,
each for a reason found in nanotron 0.4's code:

1. torch.distributed is initialised with gloo from torchrun's environment before the
   trainer does it (nanotron's `initialize_torch_distributed` raises without CUDA and
   always picks NCCL; `ParallelContext` only asserts its own default argument).
2. `ParallelContext.set_device` (`torch.cuda.set_device(LOCAL_RANK)`) becomes: the one
   GPU, `LOCAL_RANK % device_count`, on a GPU machine; nothing on a CPU one.
3. The pipeline P2P that nanotron's Llama builds (`P2P(pp_pg, device="cuda")`) becomes
   `CpuP2P` on CPU or `HostStagedP2P` on a shared GPU ([Note: nanotron on CPU],
   [Note: host-staged P2P] in cpu.py): gloo sends are rendezvous (nanotron's own 1F1B
   deadlocks on them) and carry no CUDA tensors. pipeschedule's engines do not use it;
   nanotron's own engines, run for comparison, do.
4. CPU only: nanotron creates tensors on `"cuda"` in about fifteen places on the
   trainer's path (the fp32 gradient accumulator's buffers, ZeRO's buffers, rotary
   tables, `build_model`'s default device, the parameter count, gradient clipping, the
   data loader check) and calls `torch.cuda.synchronize` and
   `torch.cuda.reset_peak_memory_stats`. `CudaToCpu`, a `TorchFunctionMode` entered for
   the life of the process, turns every `device="cuda"` and `.to("cuda")` / `.cuda()`
   into the CPU, and those two functions (with `current_device` and `set_device`)
   become no-ops on a CPU build of torch; nanotron's rotary table, whose builder asserts
   it is on CUDA, is built by `_init_rotary_on_cpu`. Everything else (ops, collectives, autograd)
   is unchanged; the mode only rewrites device arguments. It costs one Python call per
   torch function, which matters only for speed, which the CPU is not for.

5. Collectives nanotron calls through `nanotron.distributed` run under `torch.no_grad`:
   gloo writes a result into its tensor with an in-place op autograd sees, and refuses
   a leaf that requires grad (nanotron all-reduces its parameters in place when it
   initialises them); NCCL's kernels are not seen by autograd. nanotron's own
   tensor-parallel collectives run inside autograd functions, where grad is off anyway.

nanotron's flash-attn imports are satisfied by `flash_attn_standin` when flash-attn is
missing (it is on both machines); the launcher (`train.py`) installs it before nanotron's
Llama is imported.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from integration.nanotron._compat import import_nanotron
from integration.nanotron.errors import UnsupportedConfigError

import_nanotron()

import nanotron.distributed as nanotron_dist  # noqa: E402
from nanotron.parallel.context import ParallelContext  # noqa: E402

from integration.nanotron.cpu import CpuP2P, HostStagedP2P  # noqa: E402

_active: dict[str, object] = {}


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


def use_gloo(*, timeout_s: float = 600.0) -> str:
    """Prepare this process for nanotron's trainer over gloo ([Note: nanotron over gloo]);
    returns "cuda" (ranks share the GPU) or "cpu". Idempotent; call it before building
    the trainer, after `flash_attn_standin.install()` and before nanotron's Llama is
    first imported (it rebinds the P2P class nanotron's Llama builds)."""
    if "device" in _active:
        return _active["device"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _init_process_group(timeout_s)
    ParallelContext.set_device = _set_device
    for name in COLLECTIVES:
        setattr(nanotron_dist, name, _without_grad(getattr(nanotron_dist, name)))
    import nanotron.models.llama as nanotron_llama

    nanotron_llama.P2P = _gloo_p2p
    if device == "cpu":
        nanotron_llama.RotaryEmbedding.init_rotary_embeddings = _init_rotary_on_cpu
        mode = CudaToCpu()
        mode.__enter__()  # for the life of the process
        _active["mode"] = mode
        for name, result in (("synchronize", None), ("reset_peak_memory_stats", None), ("set_device", None),
                             ("current_device", 0)):
            setattr(torch.cuda, name, _returning(name, result))
    _active["device"] = device
    return device


def _init_process_group(timeout_s: float) -> None:
    if dist.is_initialized():
        if dist.get_backend() != "gloo":
            raise UnsupportedConfigError(
                f"torch.distributed is already initialised with {dist.get_backend()!r}; the gloo mode needs gloo")
        return
    missing = [key for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if key not in os.environ]
    if missing:
        raise UnsupportedConfigError(
            f"the environment lacks {', '.join(missing)}: start the processes with torchrun "
            "(e.g. torchrun --nproc-per-node 4 -m integration.nanotron.train --config-file CONFIG)")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))


COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "broadcast", "all_gather", "all_gather_into_tensor",
               "reduce_scatter_tensor", "reduce")


def _without_grad(collective):
    """A collective of nanotron's namespace run under `torch.no_grad`
    ([Note: nanotron over gloo], item 5); applied once."""
    if getattr(collective, "__pipeschedule_no_grad__", False):
        return collective

    def run(*args, **kwargs):
        with torch.no_grad():
            return collective(*args, **kwargs)

    run.__pipeschedule_no_grad__ = True
    run.__name__ = run.__qualname__ = collective.__name__
    run.__wrapped__ = collective
    return run


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


__all__ = ["CudaToCpu", "use_gloo"]
