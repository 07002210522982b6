"""Gradients under pipeschedule's engines as nanotron's optimizer paths expect them.

[Note: gradient sync] nanotron's trainer has three ways of getting the data-parallel
gradient sum, chosen by `make_ddp = dp > 1 and not (accumulate_grad_in_fp32 and
zero_stage > 0)` (nanotron/trainer.py:608-610) and `optimizer.accumulate_grad_in_fp32`:

    DDP, no accumulator     DDP's reducer all-reduces the half-precision `.grad`s in
                            buckets during the backward nanotron marks as the sync one
    DDP and accumulator     the accumulator's DDP comm hook folds each bucket into its
                            fp32 buffers and all-reduces them (AVG), leaving the handle in
                            `fp32_grads_allreduce_handle`, which the trainer waits on
                            (trainer.py:334-339)
    no DDP (dp = 1, or      the trainer calls `sync_gradients_across_dp` after the step
    ZeRO-1 with fp32)       (trainer.py:341-350): one all-reduce of the accumulator's
                            contiguous fp32 buffer

pipeschedule's engines run every B and W under DDP's `no_sync` and, with an accumulator,
fold each half gradient into its fp32 buffer the moment autograd has accumulated it
([Note: gradient folding]). Then:

- with DDP and an accumulator, after the step one all-reduce (AVG) of the contiguous
  fp32 buffer over DDP's group, waited for before `train_batch_iter` returns; the
  completed handle is left in `fp32_grads_allreduce_handle`, where the trainer looks;
- with DDP and no accumulator, where one instruction touches every parameter of the rank
  last (the last B of a schedule without virtual stages or split backward), that B runs
  under nanotron's `ddp_trigger_sync_in_bwd`, which is nanotron's own path; otherwise
  (virtual stages, split backward) the sync runs after the step, as one collective per
  bucket: the half-precision gradients are flattened into buckets of DDP's
  `bucket_bytes_cap`, divided by the group size and summed, as DDP's reducer does;
- without DDP, nothing: the trainer's own `sync_gradients_across_dp` follows.

The rule every schedule keeps (a test reads the gradients right after the call): under
DDP, `train_batch_iter` returns with every gradient averaged over the data-parallel
group (summed over the microbatches, divided by dp); without DDP it returns with every
gradient summed over this replica's microbatches and the data-parallel sum is the
trainer's, after the call, as under nanotron's own engines. Parameters shared by two
stages of one rank are completed in the same place as nanotron's tied parameters
([Note: parameters shared by stages of one rank]).

Elementwise every path computes the same (a + b) / n or a / n + b / n as nanotron's, in
the same order for two replicas.

[Note: gradient folding] nanotron's `FP32GradientAccumulator.backward`
(nanotron/optim/gradient_accumulator.py:204-210) runs `loss.backward()` to its end and
only then adds each parameter's bf16 `.grad` into its fp32 buffer and drops it
(`_accumulate_grad`, :212-232, `half_param.grad = None` at :223). So at the end of every
microbatch's backward the whole stage's bf16 gradients exist at once: 2 bytes per
parameter, 8.9 GiB on stage 0 of Llama3-70B at pp=4, tp=4. pipeschedule's engines fold
instead from a post-accumulate-grad hook on each parameter (`GradFolder`): the moment
autograd has accumulated a parameter's gradient into `.grad` (its AccumulateGrad node,
in B, in W of a split backward, or in the inner backward of a recomputed layer), the
hook adds it into the fp32 buffer with the accumulator's own `_accumulate_grad` and
drops it. One parameter's gradient lives at a time; the values are those of the
accumulator's own path, since each parameter gets the same one addition per backward
(B, W and recomputed layers each run one autograd pass: [Note: layer recompute] reruns a
layer's forward inside the same backward). The hooks act only while one of our B or W runs
(`GradFolder.stage`), so another engine's backward on the same model is untouched.
After each B and W any gradient that arrived without its hook (none is known) is folded
as the accumulator would.

[Note: parameters shared by stages of one rank] A parameter used by two stages on one
rank (tied embeddings under a V shape: the embedding on stage 0 and the LM head on stage
2pp-1, both on rank 0) would sum its two stages' microbatch gradients interleaved in
schedule order. Under nanotron's 1F1B the two uses sit on two ranks: each accumulates its
own sum in microbatch order and `sync_tied_weights_gradients` adds the two after the
data-parallel sync. `SharedGrads` keeps that order: the first stage using the parameter
accumulates where nanotron would (`.grad`, or the accumulator's fp32 buffer); each later
stage into its own tensor (B and W of that stage see it as `.grad`). The partial sums are
added after the data-parallel sync, where nanotron adds tied gradients: under DDP at the
end of the step (the sync is complete there), otherwise from nanotron's
`sync_tied_weights_gradients` (patches/trainer.py), which the trainer calls after its own
data-parallel sync; the extra tensors are averaged over the data-parallel group first,
where the trainer's own sync does not reach them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel

from nanotron.parallel.data_parallel.utils import ddp_trigger_sync_in_bwd

from integration.nanotron.pipeline.errors import ParameterError


class GradFolder:
    """Folds each half gradient into the accumulator's fp32 buffer as autograd produces it
    ([Note: gradient folding]); one per (model, accumulator), its hooks registered once."""

    def __init__(self, accumulator, shared: SharedGrads | None):
        self.accumulator, self.shared = accumulator, shared
        self.stage: int | None = None  # the stage whose B or W runs; None: fold nothing
        self.names = {id(entry["half"]): name for name, entry in accumulator.fp32_grad_buffers.items()}
        self.handles = [entry["half"].register_post_accumulate_grad_hook(self._hook)
                        for entry in accumulator.fp32_grad_buffers.values()]

    def _hook(self, param: torch.Tensor) -> None:
        if self.stage is not None and param.grad is not None:
            self._fold(self.names[id(param)], param, self.stage)

    def _fold(self, name: str, half: torch.Tensor, stage: int) -> None:
        if self.shared is not None and self.shared.takes(half, stage):
            self.shared.fold(half, stage)
        else:
            self.accumulator._accumulate_grad(name=name, half_param=half)

    @contextlib.contextmanager
    def folding(self, stage: int):
        """During one B or W of `stage`: each gradient folded as it arrives; after it, any
        gradient that arrived without its hook."""
        self.stage = stage
        try:
            yield
        finally:
            self.stage = None
        for name, entry in self.accumulator.fp32_grad_buffers.items():
            if entry["half"].grad is not None:
                self._fold(name, entry["half"], stage)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class GradientSync:
    """What runs around each B and W, and after the step ([Note: gradient sync])."""

    def __init__(self, ddp: DistributedDataParallel | None, accumulator, *, sync_in_backward: bool, last_backward,
                 shared: SharedGrads | None, folder: GradFolder | None = None):
        if (accumulator is None) != (folder is None):
            raise ParameterError("GradientSync: a GradFolder comes with an accumulator, and only with one (got "
                                 f"accumulator={type(accumulator).__name__}, folder={type(folder).__name__})")
        self.ddp, self.accumulator, self.shared, self.folder = ddp, accumulator, shared, folder
        # DDP's reducer syncs inside the last B only without an accumulator: with one, each
        # gradient is folded as it arrives and the fp32 buffer is reduced after the step.
        self.sync_at = last_backward if (ddp is not None and sync_in_backward and accumulator is None) else None

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
                    stack.enter_context(self.accumulator.no_sync())  # the accumulator adds (not DDP's hook)
            if self.shared is not None:
                stack.enter_context(self.shared.using(stage))
            if self.folder is not None:
                stack.enter_context(self.folder.folding(stage))
            yield

    def after_step(self) -> None:
        """The data-parallel sync of schedules whose B cannot carry DDP's, completed before
        the step returns ([Note: gradient sync])."""
        if self.ddp is None:
            return
        group = self.ddp.process_group
        if self.shared is not None:
            self.shared.average(group)
        if self.accumulator is not None:
            buffer = self.accumulator._contiguous_fp32_grad_buffer
            handle = dist.all_reduce(buffer, op=dist.ReduceOp.AVG, group=group, async_op=True)
            handle.wait()
            self.accumulator.fp32_grads_allreduce_handle = handle  # completed; the trainer waits on it
        elif self.sync_at is None:
            average_in_buckets([p for p in self.ddp.module.parameters() if p.grad is not None], group,
                               self.ddp.bucket_bytes_cap)
        if self.shared is not None:
            self.shared.finish(group)  # averaged above: complete now, as nanotron's tied sync would


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


__all__ = ["GradFolder", "GradientSync", "SharedGrads", "average_in_buckets", "finish_pending", "leave_pending",
           "unfinished"]
