"""One training or evaluation step of a pipeschedule engine over a nanotron model.

`Runner` holds what the steps of one (pp group, m, train|eval) share: the compiled
schedule, the runtime's `Executor` over the engine's transport, the boundary layouts
([Note: packed boundary]) and, per model, its blocks and their stages ([Note: model
layout]). Each F is one model call that runs one stage ([Note: one chunk per model
call] in stage_call); around each B and W the gradients go where nanotron's optimizer
paths expect them ([Note: gradient sync] in grad_sync).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from integration.nanotron._compat import import_nanotron

import_nanotron()

from nanotron.parallel.pipeline_parallel.block import PipelineBlock  # noqa: E402
from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer  # noqa: E402

from integration.nanotron import grad_sync  # noqa: E402
from integration.nanotron.boundary import Layout  # noqa: E402
from integration.nanotron.errors import EngineRuntimeError  # noqa: E402
from integration.nanotron.grad_sync import GradFolder, GradientSync, SharedGrads  # noqa: E402
from integration.nanotron.stage_call import StageCall, consumer_tracking, one_stage  # noqa: E402
from pipeschedule.compiler.ir import Instr, Op, Schedule  # noqa: E402
from pipeschedule.runtime import DistTransport, Executor, RemoteOutput  # noqa: E402
from pipeschedule.runtime.ledger import signature_of  # noqa: E402
from pipeschedule.runtime.stages import module_state  # noqa: E402

LAYOUT_WAIT_S = 60.0  # how long a receiving rank waits for its sender's boundary layout


def unwrap(model):
    return model.module if isinstance(model, DistributedDataParallel) else model


def pipeline_blocks(model) -> list[PipelineBlock]:
    """The model's `PipelineBlock`s in forward order (nanotron registers them so)."""
    inner = unwrap(model)
    if hasattr(inner, "pipeline_blocks"):
        return list(inner.pipeline_blocks())
    return [m for m in inner.modules() if isinstance(m, PipelineBlock)]


class Runner:
    """The executor of one (pg, m, train|eval) and what its steps share."""

    def __init__(self, engine, schedule: Schedule, transport: DistTransport, device: torch.device):
        self.engine, self.schedule, self.transport = engine, schedule, transport
        self.rank = transport.rank
        self.layouts: dict[int, Layout] = {}  # producing stage -> boundary layout
        self.stages = ModelStages(self)
        self.executor = NanotronExecutor(schedule, self.rank, self.stages, transport, device=device,
                                         offload_chunk=engine.spec.offload_chunk)
        backwards = [i for i in self.executor.program if i.op is Op.B]
        self.last_backward = backwards[-1] if backwards else None
        # [Note: gradient sync]: DDP syncs inside the last B only when that B is the last
        # touch of every parameter of the rank.
        self.sync_in_backward = schedule.virtual == 1 and not schedule.split_backward
        self._models: dict[int, tuple] = {}  # id(model) -> (model, blocks, stage_of)
        # (id(model), id(accumulator)) -> the model, the accumulator, and their SharedGrads and GradFolder
        self._grads: dict[tuple[int, int], tuple] = {}

    def step(self, model, batch, grad_accumulator) -> list[dict]:
        inner = unwrap(model)
        blocks, stage_of = self._layout(inner)
        train = torch.is_grad_enabled()
        if train and grad_sync.unfinished(inner) is not None:
            raise EngineRuntimeError(
                "the previous step's gradients of parameters shared by two stages of this rank were never completed: "
                "call nanotron's sync_tied_weights_gradients after each train_batch_iter, as nanotron's trainer does "
                "([Note: parameters shared by stages of one rank])"
            )
        self.stages.begin(model, blocks, stage_of, batch)
        shared, folder = self._gradients(inner, grad_accumulator) if train else (None, None)
        ddp = model if isinstance(model, DistributedDataParallel) else None
        sync = GradientSync(ddp, grad_accumulator if train else None, sync_in_backward=self.sync_in_backward,
                            last_backward=self.last_backward, shared=shared, folder=folder)
        self.executor.begin(sync)
        try:
            with consumer_tracking(blocks, stage_of), sync.step_context():
                outputs = self.executor.step([None] * self.schedule.microbatches)  # data: ModelStages
        finally:
            self.stages.end()
            self.executor.end()
        if train:
            sync.after_step()
            grad_sync.leave_pending(inner, shared)
        return [
            {"loss": TensorPointer(group_rank=o.rank)} if isinstance(o, RemoteOutput) else o for o in outputs
        ]

    def _layout(self, inner) -> tuple[list[PipelineBlock], dict[int, int]]:
        """The model's blocks and the stage of each (by id), checked against the engine's
        layout the first time this model is seen ([Note: model layout])."""
        found = self._models.get(id(inner))
        if found is None or found[0] is not inner:
            blocks = pipeline_blocks(inner)
            stages = self.engine.model_stages(inner, blocks, self.schedule.pp)
            stage_of = {id(block): s for block, s in zip(blocks, stages)}
            self.engine.prepare_model(inner, blocks, stage_of, self.rank)
            found = self._models[id(inner)] = (inner, blocks, stage_of)
        return found[1], found[2]

    def _gradients(self, inner, accumulator) -> tuple[SharedGrads | None, GradFolder | None]:
        """The SharedGrads and GradFolder of (model, accumulator), made once ([Note:
        gradient folding]); a new model or accumulator replaces the old ones' hooks."""
        key = (id(inner), id(accumulator))
        found = self._grads.get(key)
        if found is None or found[0] is not inner or found[1] is not accumulator:
            if found is not None and found[3] is not None:
                found[3].remove()
            local = [s for s, r in enumerate(self.schedule.placement) if r == self.rank]
            shared = SharedGrads.of({s: list(self.stages.parameters(s)) for s in local}, accumulator)
            folder = GradFolder(accumulator, shared) if accumulator is not None else None
            found = self._grads[key] = (inner, accumulator, shared, folder)
        return found[2], found[3]


class ModelStages:
    """The runtime's `Stages` ([Note: stages protocol]) over a nanotron model: F(stage, mb)
    is one model call on microbatch mb ([Note: one chunk per model call])."""

    def __init__(self, runner: Runner):
        self.runner = runner
        self.schedule = runner.schedule
        self.local = [s for s, r in enumerate(self.schedule.placement) if r == runner.rank]

    def begin(self, model, blocks, stage_of, batch) -> None:
        self.model, self.blocks, self.stage_of = model, blocks, stage_of
        self.batch = iter(batch)
        self.cached: dict[int, dict] = {}
        self.fetched = 0
        self.calls_left = dict.fromkeys(range(self.schedule.microbatches), len(self.local))

    def end(self) -> None:
        self.cached.clear()
        self.model = self.batch = None

    def peek(self, mb: int) -> dict:
        """Microbatch mb of the data loader, read lazily; `micro_batch` without using it up."""
        while self.fetched <= mb:
            try:
                self.cached[self.fetched] = next(self.batch)
            except StopIteration:
                raise EngineRuntimeError(
                    f"the data loader gave {self.fetched} microbatches, but the step runs "
                    f"{self.schedule.microbatches} (nb_microbatches)"
                ) from None
            self.fetched += 1
        return self.cached[mb]

    def micro_batch(self, mb: int) -> dict:
        """Microbatch mb of the data loader, read lazily and dropped after its last local F."""
        found = self.peek(mb)
        self.calls_left[mb] -= 1
        if self.calls_left[mb] == 0:
            del self.cached[mb]
        return found

    def forward(self, stage: int, mb: int, act_in: Any, target: Any) -> torch.Tensor:
        schedule, rank = self.schedule, self.runner.rank
        micro_batch = self.micro_batch(mb)
        layout = self._layout(stage - 1) if stage > 0 else None
        sender = None if stage == 0 else (-1 if schedule.placement[stage - 1] == rank
                                          else schedule.placement[stage - 1])
        call = StageCall(stage, mb, self.stage_of, sender_rank=sender,
                         act_in=act_in if stage > 0 else None, layout=layout)
        with one_stage(self.blocks, self.stage_of, call, rank):
            output = self.model(**micro_batch)
        sends = call.finish_forward()
        if stage == schedule.num_stages - 1:
            loss = output["loss"] if isinstance(output, dict) else output
            if not isinstance(loss, torch.Tensor):
                raise EngineRuntimeError(f"the last stage {stage} returned {loss!r}, not the loss")
            return loss
        if not sends:
            raise EngineRuntimeError(f"stage {stage}, microbatch {mb}: no block of stage {stage + 1} received anything")
        if stage not in self.runner.layouts:
            self.runner.layouts[stage] = Layout.of(sends)
            self.runner.transport.publish(f"layout/{stage}", self.runner.layouts[stage].encode())
        return self.runner.layouts[stage].pack(sends)

    def _layout(self, stage: int) -> Layout:
        if stage not in self.runner.layouts:  # published by the sender before it sent (see forward)
            deadline = time.monotonic() + LAYOUT_WAIT_S
            while (text := self.runner.transport.lookup(f"layout/{stage}")) is None:
                if time.monotonic() > deadline:
                    raise EngineRuntimeError(
                        f"the layout of stage {stage}'s output was not published within {LAYOUT_WAIT_S:.0f} s")
                time.sleep(0.001)
            self.runner.layouts[stage] = Layout.decode(text)
        return self.runner.layouts[stage]

    def parameters(self, stage: int):
        return itertools.chain.from_iterable(
            itertools.chain(b.parameters(), b.buffers()) for b in self.blocks if self.stage_of[id(b)] == stage
        )

    def state(self, stage: int) -> tuple:
        return module_state(b for b in self.blocks if self.stage_of[id(b)] == stage)


class NanotronExecutor(Executor):
    """The runtime's Executor with nanotron's gradient paths around B and W
    ([Note: gradient sync]).

    TODO(runtime): a public hook around B and W (a context and an after-callback) would
    replace these overrides of `Executor._backward` and `_weight`.
    """

    def begin(self, sync: GradientSync) -> None:
        self._sync = sync

    def end(self) -> None:
        self._sync = None

    def _input_signature(self, i: Instr, x, target):
        """The stages read the data loader's microbatch themselves (the executor is given
        None inputs), so its tensors' shapes join the signature of the stash measurement."""
        return signature_of((x, target, self.stages.peek(i.mb)))

    def _backward(self, i: Instr) -> None:
        with self._sync.around(i, i.stage):
            super()._backward(i)

    def _weight(self, i: Instr) -> None:
        with self._sync.around(i, i.stage):  # never the sync point ([Note: gradient sync])
            super()._weight(i)


__all__ = ["ModelStages", "NanotronExecutor", "Runner", "pipeline_blocks", "unwrap"]
