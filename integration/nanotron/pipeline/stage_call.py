"""One `model(**micro_batch)` call that runs exactly one pipeline stage.

[Note: one chunk per model call] nanotron drives communication from inside the model:
a `PipelineBlock` runs only where `block.rank` equals the caller's pp rank; anywhere
else it hands each local tensor input to the attached state as a send
(`register_send_activation`) and returns `TensorPointer`s; a block whose inputs are
`TensorPointer`s asks the state for them (`register_recv_activation`, then pops
`activations_buffer`); backward through a received tensor calls `register_send_grad`.
pipeschedule's executor, not nanotron, must own every send and receive, and it calls one
stage at a time (F of (stage, mb)). So for each F the engine makes one model call and
shapes what the model sees:

1. Rank masking: every block of another stage (of this rank's other chunks, and of the
   other ranks) runs for the duration of the call under its `block_code`, a negative
   rank naming the block ([Note: block graph] in block_graph.py), so it behaves as
   remote and computes nothing, every pointer it returns names it, and every send to it
   names it; misuse of a negative rank fails loudly. Ranks are restored in a `finally`.
2. A fresh `StageCall` (a `PipelineBatchState`, deliberately not a
   `PipelineTrainBatchState`, whose queue `PipelineBlock.forward` would drain itself) is
   attached to every block for the call. It is keyed by (stage, mb): it holds the
   tensors this stage receives and collects those it sends. Nothing in it ever calls
   nanotron's P2P. A forward pre-hook tells it which block runs, with its arguments.
3. Receives: the executor's `act_in` of each edge into the stage is unpacked ([Note:
   packed boundary]) into its inputs, each named (block, input name); a block asking
   for a tensor from `from_rank` gets the input of its next pointer argument of that
   rank (nanotron asks in the order of its arguments sorted by (rank, name)). A tensor
   keeps the sender's `requires_grad`. A hand-off between two stages on the same rank
   arrives detached (the executor does that), so backward never runs through the
   earlier chunk twice.
4. Sends: a send counts only if the block graph says this stage's edge to the
   consumer's stage carries that input (its block made it, or it is data of this rank
   whose edge starts here); all others are dropped, with the backward roots nanotron
   registers for them: data-loader tensors handed to masked blocks (labels, masks),
   and duplicates of data-loader tensors that another stage delivers. The kept tensors
   of each edge are packed in the order of their names into the stage's output for that
   edge; the executor sends each at SEND_F and back-propagates from them at B.
5. Gradients: nanotron's receive function does not pass the gradient to its input; it
   registers it as a send to the rank the tensor came from (`register_send_grad`),
   which names the producing block. The state writes it into the matching slice of its
   edge's `act_in.grad`, where the executor picks it up as the input gradient and sends
   it at SEND_B. A received tensor that gets no gradient contributes zeros (the executor
   sends zeros, not silence: nanotron's peers match gradients first in, first out).
"""

from __future__ import annotations

import collections
import contextlib

import torch

from nanotron.parallel.pipeline_parallel.block import PipelineBlock
from nanotron.parallel.pipeline_parallel.state import PipelineBatchState
from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer

from integration.nanotron.pipeline.block_graph import BlockGraph, code_block, masked_ranks
from integration.nanotron.pipeline.boundary import Layout
from integration.nanotron.pipeline.errors import EngineRuntimeError


class StageCall(PipelineBatchState):
    """The state attached to the blocks during the model call of F(stage, mb)
    ([Note: one chunk per model call]). `inputs`: edge -> (the packed tensor the executor
    received or was handed, its `Layout`)."""

    def __init__(self, stage: int, mb: int, graph: BlockGraph, inputs: dict):
        self.stage, self.mb, self.graph = stage, mb, graph
        self.inputs = inputs
        self.inbox: dict = {}  # (block, name) -> received tensor, until a block takes it
        self.entry_of: dict = {}  # (block, name) -> (edge, its Entry in the edge's layout)
        for edge, (packed, layout) in inputs.items():
            keys = graph.edge_keys(edge)
            for key, entry, tensor in zip(keys, layout.entries, layout.unpack(packed), strict=True):
                self.inbox[key], self.entry_of[key] = tensor, (edge, entry)
        self.given: list = []  # (key, from_rank) handed out, for gradients (not the tensor: see finish_forward)
        self.got: set = set()  # keys whose gradient arrived
        self.block: int | None = None  # index of the block whose forward runs, and its arguments
        self.kwargs: dict = {}
        self.asked: dict = {}  # block -> names of its pointer arguments already served
        self.matched: dict = {}  # block -> names of its tensor arguments already sent
        self.activations_buffer = collections.deque()  # shadows nanotron's class-level deque
        self.outbox: dict = {}  # consumer stage -> {(block, name): tensor}

    def enter(self, block: int, kwargs: dict) -> None:
        """A block's forward starts (the pre-hook of `block_tracking`)."""
        self.block, self.kwargs = block, kwargs

    # -- forward -----------------------------------------------------------------------

    def register_send_activation(self, activation, to_rank, p2p):
        consumer = code_block(to_rank)
        if consumer is None or consumer != self.block:
            raise EngineRuntimeError(f"stage {self.stage}, microbatch {self.mb}: a send to rank {to_rank} outside the "
                                     "forward of the block it is for ([Note: one chunk per model call])")
        done = self.matched.setdefault(consumer, set())
        name = next((n for n, v in sorted(self.kwargs.items()) if v is activation and n not in done), None)
        if name is None:
            raise EngineRuntimeError(f"stage {self.stage}, microbatch {self.mb}: block {consumer} sends a tensor that "
                                     "is none of its arguments")
        done.add(name)
        edge = self.graph.carrier((consumer, name))
        if edge is not None and edge[0] == self.stage:
            self.outbox.setdefault(edge[1], {})[consumer, name] = activation
        # else dropped: see [Note: one chunk per model call], point 4

    def register_activation_requiring_backward(self, activation):
        pass  # nanotron's backward roots: the executor back-propagates from the packed outputs

    def register_recv_activation(self, from_rank, p2p):
        block, asked = self.block, self.asked.setdefault(self.block, set())
        name = next((n for n, v in sorted(self.kwargs.items())
                     if isinstance(v, TensorPointer) and v.group_rank == from_rank and n not in asked), None)
        key = (block, name)
        if name is None or key not in self.inbox:
            edges = sorted(self.inputs)
            raise EngineRuntimeError(
                f"stage {self.stage}, microbatch {self.mb}: block {block} asks for {name!r} from "
                f"{_who(from_rank)}, which this stage does not receive (it receives "
                f"{[list(e) for e in edges] or 'nothing'}: {sorted(self.inbox) or 'no input left'})")
        asked.add(name)
        tensor = self.inbox.pop(key)
        self.given.append((key, from_rank))
        self.activations_buffer.append(tensor)

    def register_recv_grad(self, from_rank, p2p):
        raise EngineRuntimeError(f"stage {self.stage}, microbatch {self.mb}: backward reached one of nanotron's send "
                                 "roots; the executor back-propagates from the packed stage outputs only")

    def run_communication(self, send_only_activation: bool = False):
        raise EngineRuntimeError(f"stage {self.stage}, microbatch {self.mb}: nanotron asked for communication outside "
                                 "pipeschedule's program (run_communication)")

    def new_micro_batch_forward(self):
        pass

    def pop_last_activations_requiring_backward(self):
        return []

    # -- backward ----------------------------------------------------------------------

    def register_send_grad(self, grad, to_rank, p2p):
        """Called from nanotron's receive function during B(stage, mb): the gradient of
        one received tensor (from the block or data rank `to_rank` names) goes into its
        slice of its edge's act_in.grad. Which tensor, nanotron's receive function does
        not say: the one from that block of the gradient's shape; where a block with one
        output handed this stage that output several times (to several of its blocks),
        any of them, one gradient each (the sender adds them all to the one output)."""
        candidates = [key for key, rank in self.given if rank == to_rank
                      and self.entry_of[key][1].requires_grad and tuple(grad.shape) == self.entry_of[key][1].shape]
        producer = code_block(to_rank)
        if len(candidates) > 1 and producer in self.graph.single_output:
            candidates = [key for key in candidates if key not in self.got] or candidates[:0]
        if len(candidates) != 1 and not (candidates and producer in self.graph.single_output):
            raise EngineRuntimeError(
                f"stage {self.stage}: cannot tell which of the tensors received from {_who(to_rank)} "
                f"{sorted(key for key, rank in self.given if rank == to_rank)} a gradient of shape "
                f"{list(grad.shape)} belongs to (nanotron's receive function does not say); a block with several "
                "outputs may hand one stage one tensor requiring grad per shape")
        self.got.add(candidates[0])
        edge, entry = self.entry_of[candidates[0]]
        x = self.inputs[edge][0]
        if x.grad is None:
            x.grad = torch.zeros_like(x)
        x.grad[entry.offset: entry.offset + entry.length].add_(grad.reshape(-1))

    # -- after the call ----------------------------------------------------------------

    def finish_forward(self) -> dict:
        """The kept sends, {consumer stage: {(block, name): tensor}}; checks every received
        tensor was consumed. Lets go of every tensor the forward saw.

        [Note: no cycle through autograd] nanotron's receive function keeps this state on
        its autograd node (`ctx.pipeline_state`), so the stage's graph holds it until B.
        A tensor of the forward kept here (the last block's arguments, a received tensor)
        holds that graph in turn, through its `grad_fn`: a cycle that runs through
        autograd's C++ nodes, which Python's collector cannot see, so it was never freed.
        On the last stage that was every microbatch's fp32 logits, step after step (a
        real-text run on an H100 grew stage 3 by 0.27 GiB a step under capped_1f1b; on CPU,
        tests/nanotron/test_stage_call.py counts what stays alive).
        """
        if self.inbox:
            raise EngineRuntimeError(f"stage {self.stage}, microbatch {self.mb}: the received inputs "
                                     f"{sorted(self.inbox)} were never used by a block of the stage")
        out, self.outbox = self.outbox, {}
        self.activations_buffer.clear()
        self.block, self.kwargs = None, {}
        return out


def _who(rank: int) -> str:
    block = code_block(rank)
    return f"block {block}" if block is not None else f"the data loader of rank {rank}"


@contextlib.contextmanager
def one_stage(blocks: list[PipelineBlock], stage_of: dict[int, int], call: StageCall, rank: int):
    """Masks every block of another stage and attaches `call` for one model call
    ([Note: one chunk per model call])."""
    own = {j for j, b in enumerate(blocks) if stage_of[id(b)] == call.stage}
    previous = [b.pipeline_state for b in blocks]
    try:
        with masked_ranks(blocks, own):
            for block in blocks:
                block.set_pipeline_state(call)
            yield call
    finally:
        for block, state in zip(blocks, previous):
            block.set_pipeline_state(state)


@contextlib.contextmanager
def block_tracking(blocks: list[PipelineBlock]):
    """Forward pre-hooks telling the attached `StageCall` which block runs, with what."""
    index = {id(b): j for j, b in enumerate(blocks)}

    def hook(block, args, kwargs):
        state = block.pipeline_state
        if isinstance(state, StageCall):
            state.enter(index[id(block)], kwargs)

    handles = [block.register_forward_pre_hook(hook, with_kwargs=True) for block in blocks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def pack_edge(edge, sends: dict, keys: list, layout: Layout | None) -> tuple[torch.Tensor, Layout]:
    """The packed tensor of one edge's inputs (`sends`: (block, name) -> tensor), in the
    order of `keys`; checked against `layout` (the first microbatch's) where given."""
    if set(sends) != set(keys):
        missing, extra = sorted(set(keys) - set(sends)), sorted(set(sends) - set(keys))
        raise EngineRuntimeError(f"edge {edge}: the stage sent {sorted(sends)} but the model's graph has it carry "
                                 f"{keys} (missing {missing}, extra {extra})")
    tensors = [sends[key] for key in keys]
    layout = layout if layout is not None else Layout.of(tensors)
    return layout.pack(tensors), layout


__all__ = ["StageCall", "block_tracking", "one_stage", "pack_edge"]
