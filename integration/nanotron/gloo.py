"""nanotron's own trainer over gloo: on a machine without a GPU, or with several ranks on one GPU.

[Note: nanotron over gloo] nanotron's `DistributedTrainer` assumes NCCL and one GPU per
rank. Neither holds on this project's two test machines: the CPU machine has no GPU,
and the benchmark machine has one H200 that four pipeline ranks share (NCCL refuses two
ranks of a communicator on one device). `use_gloo()` prepares a process so that
nanotron's unchanged trainer, model, optimizer and engines run over gloo. What it changes
(items 2 to 5 are patches, in patches/gloo.py), each for a reason found in nanotron 0.4's code:

1. torch.distributed is initialised with gloo from torchrun's environment before the
   trainer does it (nanotron's `initialize_torch_distributed` raises without CUDA and
   always picks NCCL; `ParallelContext` only asserts its own default argument).
2. `ParallelContext.set_device` (`torch.cuda.set_device(LOCAL_RANK)`) becomes: the one
   GPU, `LOCAL_RANK % device_count`, on a GPU machine; nothing on a CPU one.
3. The pipeline P2P that nanotron's Llama builds (`P2P(pp_pg, device="cuda")`) becomes
   `CpuP2P` on CPU or `HostStagedP2P` on a shared GPU ([Note: nanotron on CPU],
   [Note: host-staged P2P] in patches/cpu.py): gloo sends are rendezvous (nanotron's own 1F1B
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

from integration.nanotron.patches import patching
from integration.nanotron.pipeline.errors import UnsupportedConfigError
from integration.nanotron.patches.gloo import CudaToCpu


def use_gloo(*, timeout_s: float = 600.0) -> str:
    """Prepare this process for nanotron's trainer over gloo ([Note: nanotron over gloo]);
    returns "cuda" (ranks share the GPU) or "cpu". Idempotent; call it before building
    the trainer, after `flash_attn_standin.install()` and before nanotron's Llama is
    first imported (it rebinds the P2P class nanotron's Llama builds)."""
    _init_process_group(timeout_s)
    patching.install(gloo=True)
    return "cuda" if torch.cuda.is_available() else "cpu"


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


__all__ = ["CudaToCpu", "use_gloo"]
