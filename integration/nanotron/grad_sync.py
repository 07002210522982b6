"""Gradients under pipeschedule's engines as nanotron's optimizer paths expect them.

[Note: gradient sync] nanotron's trainer has three ways of getting the data-parallel
gradient sum, chosen by `make_ddp = dp > 1 and not (accumulate_grad_in_fp32 and
zero_stage > 0)` and `optimizer.accumulate_grad_in_fp32`:

    DDP, no accumulator     DDP's reducer all-reduces the half-precision `.grad`s in
                            buckets during the backward nanotron marks as the sync one
    DDP and accumulator     the accumulator's DDP comm hook folds each bucket into its
                            fp32 buffers and all-reduces them (AVG), leaving the handle in
                            `fp32_grads_allreduce_handle`, which the trainer waits on
    no DDP (dp = 1, or      the trainer calls `sync_gradients_across_dp` after the step:
    ZeRO-1 with fp32)       one all-reduce of the accumulator's contiguous fp32 buffer

nanotron marks the sync backward by count (the (m-1)-th). pipeschedule's engines run
every B under DDP's `no_sync` (and the accumulator's `no_sync`, so each B's half
gradients are folded into the fp32 buffers right after it, as the accumulator's own
`backward` does) and then:

- where one instruction touches every parameter of the rank last (the last B of a
  schedule without virtual stages or split backward), that B runs under nanotron's
  `ddp_trigger_sync_in_bwd`, which is nanotron's own path, comm hook included;
- otherwise (virtual stages, where the last B touches one chunk; split backward, where
  the W that follow it touch the deferred weights) the sync runs after the step, as one
  collective per bucket: with the accumulator, the contiguous fp32 buffer is averaged
  over DDP's group and the handle is left where the trainer looks for it; without,
  the half-precision gradients are flattened into buckets of DDP's `bucket_bytes_cap`,
  divided by the group size and summed, as DDP's reducer does.

Elementwise every path computes the same (a + b) / n or a / n + b / n as nanotron's, in
the same order for two replicas.

[Note: parameters shared by stages of one rank] A parameter used by two stages on one
rank (tied embeddings under a V shape: the embedding on stage 0 and the LM head on stage
2pp-1, both on rank 0) would sum its two stages' microbatch gradients interleaved in
schedule order. Under nanotron's 1F1B the two uses sit on two ranks: each accumulates its
own sum in microbatch order and `sync_tied_weights_gradients` adds the two after the
data-parallel sync. `SharedGrads` keeps that order: the first stage using the parameter
accumulates where nanotron would (`.grad`, or the accumulator's fp32 buffer); each later
stage into its own tensor (B and W of that stage see it as `.grad`). The partial sums are
added after the data-parallel sync, where nanotron adds tied gradients: `finish()` runs
from nanotron's `sync_tied_weights_gradients` (hooks.py), averaging the extra tensors over
the data-parallel group first where the trainer's own sync does not reach them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel

from integration.nanotron._compat import import_nanotron

import_nanotron()

from nanotron.parallel.data_parallel.utils import ddp_trigger_sync_in_bwd  # noqa: E402


class GradientSync:
    """What runs around each B and W, and after the step ([Note: gradient sync])."""

    def __init__(self, ddp: DistributedDataParallel | None, accumulator, *, sync_in_backward: bool, last_backward,
                 shared: SharedGrads | None):
        self.ddp, self.accumulator, self.shared = ddp, accumulator, shared
        self.sync_at = last_backward if (ddp is not None and sync_in_backward) else None

    def step_context(self):
        """Around the whole step: DDP's no_sync (every B but the sync one accumulates)."""
        return self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def around(self, instr, stage: int):
        """Around one B or W of `stage`."""
        with contextlib.ExitStack() as stack:
            if self.ddp is not None:
                if instr == self.sync_at:
                    stack.enter_context(ddp_trigger_sync_in_bwd(model_ddp=self.ddp))
                elif self.accumulator is not None:
                    stack.enter_context(self.accumulator.no_sync())
            if self.shared is not None:
                stack.enter_context(self.shared.using(stage))
            yield
            self.fold(stage)  # inside the accumulator's no_sync, which decides whether it adds

    def fold(self, stage: int) -> None:
        """What `GradientAccumulator.backward` does after `loss.backward()`: each half
        gradient into its fp32 buffer (a shared parameter's later stages into their own)."""
        accumulator = self.accumulator
        if accumulator is None:
            return
        for name, entry in accumulator.fp32_grad_buffers.items():
            half = entry["half"]
            if half.grad is None:
                continue
            if self.shared is not None and self.shared.takes(half, stage):
                self.shared.fold(half, stage)
            else:
                accumulator._accumulate_grad(name=name, half_param=half)

    def after_step(self) -> None:
        """The data-parallel sync of schedules whose B cannot carry DDP's."""
        if self.ddp is None:
            return
        group = self.ddp.process_group
        if self.shared is not None:
            self.shared.average(group)
        if self.sync_at is not None:
            return
        if self.accumulator is not None:
            buffer = self.accumulator._contiguous_fp32_grad_buffer
            self.accumulator.fp32_grads_allreduce_handle = dist.all_reduce(
                buffer, op=dist.ReduceOp.AVG, group=group, async_op=True)
        else:
            average_in_buckets([p for p in self.ddp.module.parameters() if p.grad is not None], group,
                               self.ddp.bucket_bytes_cap)


def average_in_buckets(params: list[torch.Tensor], group, bucket_bytes: int) -> None:
    """Average `.grad` of `params` over `group` as DDP's reducer does (divide, then sum),
    one all-reduce per bucket of at most `bucket_bytes` (parameters in reverse order, as
    DDP fills its buckets; one dtype and device per bucket)."""
    world = dist.get_world_size(group)
    bucket: list[torch.Tensor] = []
    size = 0
    for param in reversed(params):
        grad = param.grad
        if bucket and (size + grad.nbytes > bucket_bytes or grad.dtype != bucket[0].dtype
                       or grad.device != bucket[0].device):
            _all_reduce_bucket(bucket, group, world)
            bucket, size = [], 0
        bucket.append(grad)
        size += grad.nbytes
    if bucket:
        _all_reduce_bucket(bucket, group, world)


def _all_reduce_bucket(grads: list[torch.Tensor], group, world: int) -> None:
    flat = _flatten_dense_tensors(grads)
    flat.div_(world)
    dist.all_reduce(flat, group=group)
    for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(synced)


class SharedGrads:
    """Per-stage partial gradients of parameters used by several stages of one rank
    ([Note: parameters shared by stages of one rank])."""

    def __init__(self, stage_params: dict[int, Iterable[torch.Tensor]], accumulator):
        self.accumulator = accumulator
        users: dict[int, list[int]] = {}
        params: dict[int, torch.Tensor] = {}
        for stage in sorted(stage_params):
            for p in stage_params[stage]:
                if p.requires_grad and stage not in users.setdefault(id(p), []):
                    users[id(p)].append(stage)
                    params[id(p)] = p
        self.owner = {pid: stages[0] for pid, stages in users.items() if len(stages) > 1}
        self.params = {pid: params[pid] for pid in self.owner}
        self.names = {}
        if accumulator is not None:
            self.names = {id(e["half"]): name for name, e in accumulator.fp32_grad_buffers.items()
                          if id(e["half"]) in self.owner}
        self.extra: dict[tuple[int, int], torch.Tensor] = {}  # (param id, stage) -> partial sum
        self.averaged = False

    @staticmethod
    def of(stage_params: dict[int, Iterable[torch.Tensor]], accumulator) -> SharedGrads | None:
        shared = SharedGrads(stage_params, accumulator)
        return shared if shared.owner else None

    def takes(self, param: torch.Tensor, stage: int) -> bool:
        """Whether `param`'s gradient from `stage` goes to a partial sum of its own."""
        owner = self.owner.get(id(param))
        return owner is not None and owner != stage

    @contextlib.contextmanager
    def using(self, stage: int):
        """Without an accumulator: during B / W of `stage`, each shared parameter that
        `stage` does not own sees that stage's partial sum as `.grad`."""
        if self.accumulator is not None:
            yield
            return
        swapped = [(pid, p, p.grad) for pid, p in self.params.items() if self.owner[pid] != stage]
        for pid, p, _ in swapped:
            p.grad = self.extra.get((pid, stage))
        try:
            yield
        finally:
            for pid, p, outer in swapped:
                if p.grad is not None:
                    self.extra[pid, stage] = p.grad
                p.grad = outer

    def fold(self, half: torch.Tensor, stage: int) -> None:
        """With an accumulator: `half.grad` into `stage`'s fp32 partial sum."""
        key = (id(half), stage)
        if key not in self.extra:
            self.extra[key] = torch.zeros_like(half, dtype=torch.float)
        self.extra[key].add_(half.grad)
        half.grad = None

    def average(self, group) -> None:
        """Average the partial sums over a data-parallel `group` (once)."""
        if self.averaged or dist.get_world_size(group) == 1:
            return
        for key in sorted(self.extra):
            dist.all_reduce(self.extra[key], op=dist.ReduceOp.AVG, group=group)
        self.averaged = True

    def finish(self, dp_group) -> None:
        """Add each partial sum to its parameter's gradient, later stages in stage order
        (after the data-parallel sync, before nanotron's tied sync)."""
        if dp_group is not None:
            self.average(dp_group)
        for (pid, stage) in sorted(self.extra, key=lambda key: key[1]):
            partial = self.extra.pop((pid, stage))
            param = self.params[pid]
            if self.accumulator is not None:
                name = self.names[pid]
                self.accumulator.get_grad_buffer(name).add_(partial)
                # nanotron's own bookkeeping for the optimizer (fp32 param.grad views)
                param.grad = torch.zeros_like(param)
                self.accumulator._accumulate_grad(name=name, half_param=param)
            elif param.grad is None:
                param.grad = partial
            else:
                param.grad.add_(partial)
        self.averaged = False


_PENDING: dict[int, SharedGrads] = {}  # id(model) -> partial sums waiting for the tied sync


def leave_pending(model, shared: SharedGrads | None) -> None:
    """Record that `model`'s shared gradients wait for `finish_pending` (the tied sync)."""
    if shared is not None and shared.extra:
        _PENDING[id(model)] = shared


def unfinished(model) -> SharedGrads | None:
    return _PENDING.get(id(model))


def finish_pending(model, dp_group) -> None:
    """Complete the gradients of parameters shared by stages of one rank of `model`
    ([Note: parameters shared by stages of one rank]); called from nanotron's
    `sync_tied_weights_gradients`, after the trainer's data-parallel sync."""
    shared = _PENDING.pop(id(model), None)
    if shared is not None:
        shared.finish(dp_group)


__all__ = ["GradientSync", "SharedGrads", "average_in_buckets", "finish_pending", "leave_pending", "unfinished"]
