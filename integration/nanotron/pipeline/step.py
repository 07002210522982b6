"""One training or evaluation step of a pipeschedule engine over a nanotron model.

`Runner` holds what the steps of one (pp group, m, train|eval) share: the compiled
schedule, the runtime's `Executor` over the engine's transport, the boundary layouts
([Note: packed boundary]) and, per model, its blocks, their stages ([Note: model
layout]) and its block graph ([Note: block graph] in block_graph). Each F is one model
call that runs one stage ([Note: one chunk per model call] in stage_call); around each
B and W the gradients go where nanotron's optimizer paths expect them ([Note: gradient
sync] in grad_sync).

[Note: the schedule's graph] The engine compiles its schedule for (pp, m) on the chain
before it sees the model. At the first step on a model the runner finds the model's
block graph (one masked call per rank, on the first microbatch); where the stage graph
it gives is not the schedule's, it moves the schedule onto it (`on_graph`: the same
compute order, messages and FREEs placed anew on the graph's edges, the engine's
OFFLOAD added again, verified) and builds a new executor for it (which compares the
schedule across ranks at its first step, [Note: schedule agreement]). A chain model
keeps the schedule it was compiled with, and its executor.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from nanotron.parallel.pipeline_parallel.block import PipelineBlock
from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer

from integration.nanotron.pipeline import grad_sync
from integration.nanotron.pipeline.block_graph import LOSS, BlockGraph, find_block_graph
from integration.nanotron.pipeline.boundary import Layout
from integration.nanotron.pipeline.errors import EngineRuntimeError
from integration.nanotron.pipeline.grad_sync import GradFolder, GradientSync, SharedGrads
from integration.nanotron.pipeline.stage_call import StageCall, block_tracking, one_stage, pack_edge
from pipeschedule.compiler.ir import Op, Schedule
from pipeschedule.compiler.offload import OffloadPolicy, add_offload
from pipeschedule.compiler.passes import on_graph
from pipeschedule.compiler.verify import verify
from pipeschedule.errors import FormatError
from pipeschedule.runtime import DistTransport, RemoteOutput
from pipeschedule.runtime.executor import Executor
from pipeschedule.runtime.stages import module_state

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
    """The executor of one (pg, m, train|eval) and what its steps share. `engine` checks
    and prepares each model at its first step ([Note: model layout]); `offload_chunk`
    (bytes) and `offload_policy` are the engine spec's: the executor streams offloaded
    stashes in chunks of that size, and a schedule moved onto the model's graph gets that
    policy's OFFLOAD ([Note: the schedule's graph])."""

    def __init__(self, engine, schedule: Schedule, transport: DistTransport, device: torch.device, *,
                 offload_chunk: int | None = None, offload_policy: OffloadPolicy | None = None):
        self.engine, self.transport, self.device = engine, transport, device
        self.offload_chunk, self.offload_policy = offload_chunk, offload_policy
        self.rank = transport.rank
        self.layouts: dict[tuple[int, int], Layout] = {}  # edge -> boundary layout
        self.stages = ModelStages(self)
        self._use(schedule, offload_chunk)
        # [Note: gradient sync]: DDP syncs inside the last B only when that B is the last
        # touch of every parameter of the rank.
        self.sync_in_backward = schedule.virtual == 1 and not schedule.split_backward
        self._models: dict[int, tuple] = {}  # id(model) -> (model, blocks, stage_of, block graph)
        # (id(model), id(accumulator)) -> the model, the accumulator, and their SharedGrads and GradFolder
        self._grads: dict[tuple[int, int], tuple] = {}
        self._graphs_found = 0  # masked calls made, which name their reports in the store

    def _use(self, schedule: Schedule, offload_chunk: int | None) -> None:
        """Runs `schedule` from now on, with a new executor that streams offloaded stashes
        in chunks of `offload_chunk` bytes ([Note: the schedule's graph]; the old one's
        `exact_times` carries over)."""
        exact = getattr(getattr(self, "executor", None), "exact_times", False)
        self.schedule = self.stages.schedule = schedule
        # The stages read the data loader's microbatch themselves (the executor is given None
        # inputs): its tensors' shapes join the signature of the stash measurement.
        self.executor = Executor(schedule, self.rank, self.stages, self.transport, device=self.device,
                                 offload_chunk=offload_chunk,
                                 side_inputs=lambda i: self.stages.peek(i.mb))
        self.executor.exact_times = exact
        backwards = [i for i in self.executor.program if i.op is Op.B]
        self.last_backward = backwards[-1] if backwards else None

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
        self._on_graph_of(inner, blocks, stage_of)
        shared, folder = self._gradients(inner, grad_accumulator) if train else (None, None)
        ddp = model if isinstance(model, DistributedDataParallel) else None
        sync = GradientSync(ddp, grad_accumulator if train else None, sync_in_backward=self.sync_in_backward,
                            last_backward=self.last_backward, shared=shared, folder=folder)
        # [Note: executor hooks]: each B and W inside the gradient paths ([Note: gradient sync])
        self.executor.around_gradients = lambda i: sync.around(i, i.stage)
        try:
            with block_tracking(blocks), sync.step_context():
                outputs = self.executor.step([None] * self.schedule.microbatches)  # data: ModelStages
        finally:
            self.stages.end()
            self.executor.around_gradients = None
        if train:
            sync.after_step()
            grad_sync.leave_pending(inner, shared)
        loss_stage = self.stages.graph.loss_stage
        if loss_stage != self.schedule.num_stages - 1:  # [Note: empty stages]: where the loss's block ran
            owner = self.schedule.placement[loss_stage]
            outputs = ([{"loss": loss} for loss in self.stages.losses] if owner == self.rank
                       else [RemoteOutput(owner)] * self.schedule.microbatches)
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
            found = self._models[id(inner)] = (inner, blocks, stage_of, None)
        return found[1], found[2]

    def _on_graph_of(self, inner, blocks, stage_of) -> None:
        """At the first step on a model: its block graph, and the schedule moved onto its
        stage graph where that is not the schedule's ([Note: the schedule's graph])."""
        model, _, _, graph = self._models[id(inner)]
        if graph is None:
            block_stage = [stage_of[id(b)] for b in blocks]
            self._graphs_found += 1
            mode = "eval" if self.schedule.forward_only else "train"
            key = f"blockgraph/{self.schedule.microbatches}-{mode}/{self._graphs_found}"
            graph = find_block_graph(inner, blocks, block_stage, self.schedule.placement, self.stages.peek(0),
                                     self.rank, self.transport, key)
            self._models[id(inner)] = (model, blocks, stage_of, graph)
        self.stages.graph = graph
        edges = graph.edges
        if tuple(map(tuple, edges)) != self.schedule.edges:
            self._use(self._moved(edges), self.offload_chunk)

    def _moved(self, edges) -> Schedule:
        """The schedule on the stage graph `edges`, with the spec's OFFLOAD, verified."""
        try:
            schedule = on_graph(self.schedule, edges)
        except FormatError as err:  # a graph the compiler refuses: a stage nothing feeds, say
            raise EngineRuntimeError(f"the model's blocks give the stage graph {[list(e) for e in edges]}, which "
                                     f"cannot be pipelined: {err}") from None
        if self.offload_policy is not None and not schedule.forward_only:
            schedule = add_offload(schedule, self.offload_policy)
        verify(schedule)
        return schedule

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

    separate_outputs = True  # each edge's output is a packed tensor of its own ([Note: stages protocol])

    def __init__(self, runner: Runner):
        self.runner = runner
        self.schedule: Schedule | None = None  # set by the runner (`Runner._use`)
        self.graph: BlockGraph | None = None  # the model's, set by the runner at each step

    def begin(self, model, blocks, stage_of, batch) -> None:
        self.model, self.blocks, self.stage_of = model, blocks, stage_of
        self.batch = iter(batch)
        self.cached: dict[int, dict] = {}
        self.fetched = 0
        local = [s for s, r in enumerate(self.schedule.placement) if r == self.runner.rank]
        self.calls_left = dict.fromkeys(range(self.schedule.microbatches), len(local))
        self.losses: list = [None] * self.schedule.microbatches  # loss / m on the loss's stage when not the last

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

    def forward(self, stage: int, mb: int, act_in: Any, target: Any):
        """F(stage, mb): one model call; returns the loss on the last stage, else the packed
        output of each edge out of the stage (one tensor on a chain, {consumer stage:
        tensor} on any other graph: [Note: stages protocol])."""
        schedule, graph = self.schedule, self.schedule.graph
        micro_batch = self.micro_batch(mb)
        if stage == 0:
            received = {}
        elif schedule.is_chain:
            received = {(stage - 1, stage): act_in}
        else:
            received = {(p, stage): act_in[p] for p in graph.producers[stage]}
        if stage in self.graph.empty:
            return self._pass_on(stage, received)
        inputs = {edge: (tensor, self._layout(edge)) for edge, tensor in received.items()}
        call = StageCall(stage, mb, self.graph, inputs)
        with one_stage(self.blocks, self.stage_of, call, self.runner.rank):
            output = self.model(**micro_batch)
        sends = call.finish_forward()
        if stage == schedule.num_stages - 1 or stage == self.graph.loss_stage:
            loss = output["loss"] if isinstance(output, dict) else output
            if not isinstance(loss, torch.Tensor):
                raise EngineRuntimeError(f"the stage of the loss, {stage}, returned {loss!r}, not the loss")
            if stage == schedule.num_stages - 1:
                return loss
            self.losses[mb] = (loss / schedule.microbatches).detach()  # as the runtime divides the last stage's
            sends.setdefault(stage + 1, {})[LOSS] = loss
        packed = {t: self._pack((stage, t), sends.get(t, {})) for t in graph.consumers[stage]}
        return packed[stage + 1] if schedule.is_chain else packed

    def _pass_on(self, stage: int, received: dict):
        """F of a stage without blocks ([Note: empty stages] in block_graph): what it
        received, unpacked, packed again for each edge out; on the last stage, the loss."""
        schedule, graph = self.schedule, self.schedule.graph
        tensors = {}
        for edge, packed in received.items():
            tensors.update(zip(self.graph.edge_keys(edge), self._layout(edge).unpack(packed), strict=True))
        if stage == schedule.num_stages - 1:
            return tensors[LOSS]
        packed = {t: self._pack((stage, t), {key: tensors[key] for key in self.graph.edge_keys((stage, t))})
                  for t in graph.consumers[stage]}
        return packed[stage + 1] if schedule.is_chain else packed

    def _pack(self, edge, sends: dict) -> torch.Tensor:
        """An edge's packed output; the first one publishes the edge's layout."""
        known = self.runner.layouts.get(edge)
        tensor, layout = pack_edge(edge, sends, self.graph.edge_keys(edge), known)
        if known is None:
            self.runner.layouts[edge] = layout
            self.runner.transport.publish(_layout_key(edge), layout.encode())
        return tensor

    def _layout(self, edge) -> Layout:
        if edge not in self.runner.layouts:  # published by the sender before it sent (see forward)
            deadline = time.monotonic() + LAYOUT_WAIT_S
            while (text := self.runner.transport.lookup(_layout_key(edge))) is None:
                if time.monotonic() > deadline:
                    raise EngineRuntimeError(
                        f"the layout of stage {edge[0]}'s output for stage {edge[1]} was not published within "
                        f"{LAYOUT_WAIT_S:.0f} s")
                time.sleep(0.001)
            self.runner.layouts[edge] = Layout.decode(text)
        return self.runner.layouts[edge]

    def parameters(self, stage: int):
        return itertools.chain.from_iterable(
            itertools.chain(b.parameters(), b.buffers()) for b in self.blocks if self.stage_of[id(b)] == stage
        )

    def state(self, stage: int) -> tuple:
        return module_state(b for b in self.blocks if self.stage_of[id(b)] == stage)


def _layout_key(edge) -> str:
    """The store key of an edge's boundary layout ([Note: packed boundary])."""
    return f"layout/{edge[0]}-{edge[1]}"


__all__ = ["ModelStages", "Runner", "pipeline_blocks", "unwrap"]
