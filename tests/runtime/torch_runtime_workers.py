"""Per-rank worker of tests/runtime/test_torch_csv_runtime.py (spawned processes import it by
name, so it lives in its own module and holds no tests): runs our CSVs in PyTorch's own
pipeline runtime, `torch.distributed.pipelining.schedules._PipelineScheduleRuntime`."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

from runtime_helpers import loss_fn, make_chunks, make_data


def torch_runtime_worker(rank: int, world_size: int, store, cases) -> list:
    """For each (label, csv_path, form, placement, m): a fresh model (the same seed on
    every rank, so every rank holds the reference's weights), this rank's stages as
    `PipelineStage`s, the CSV loaded by PyTorch and one step run. Returns, per case,
    (losses on the loss rank or None, {name: gradient} of this rank's stages)."""
    out = []
    for label, path, form, placement, m in cases:
        num_stages = len(placement)
        chunks = make_chunks(num_stages)
        mine = [s for s, r in enumerate(placement) if r == rank]
        stages = [PipelineStage(chunks[s], s, num_stages, torch.device("cpu")) for s in mine]
        schedule = _PipelineScheduleRuntime(stages, m, loss_fn=loss_fn)  # scale_grads=True: mean losses
        schedule._load_csv(path, format=form)
        inputs, targets = make_data(num_stages, m)
        losses: list = []
        args = (torch.cat(inputs),) if 0 in mine else ()
        target = torch.cat(targets) if num_stages - 1 in mine else None
        schedule.step(*args, target=target, losses=losses)
        grads = {f"{s}.{name}": p.grad.clone() for s in mine for name, p in chunks[s].named_parameters()}
        out.append((label, [loss.detach() for loss in losses] if num_stages - 1 in mine else None, grads))
        dist.barrier()
    return out
