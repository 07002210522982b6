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

1. Rank masking: the blocks of this rank's *other* stages (other chunks, when
   interleaved) get the fake rank -1 for the duration of the call, so they behave as
   remote and compute nothing; misuse of -1 fails loudly. Ranks are restored in a
   `finally`.
2. A fresh `StageCall` (a `PipelineBatchState`, deliberately not a
   `PipelineTrainBatchState`, whose queue `PipelineBlock.forward` would drain itself) is
   attached to every block for the call. It is keyed by (stage, mb): it holds the
   tensors this stage receives and collects those it sends. Nothing in it ever calls
   nanotron's P2P.
3. Receives: the executor's `act_in` for (stage, mb) is unpacked ([Note: packed
   boundary]) and handed out, in order, to the blocks that ask; a tensor keeps the
   sender's `requires_grad`. A hand-off between two stages on the same rank arrives
   detached (the executor does that), so backward never runs through the earlier chunk
   twice.
4. Sends: a send counts only if its consumer block belongs to stage + 1 (a forward
   pre-hook tells the state which block is running). All others are dropped, with the
   backward roots nanotron registers for them: data-loader tensors handed to masked
   blocks (labels, masks), and duplicates of data-loader tensors that an earlier stage
   delivers. The kept tensors, in nanotron's order (sorted by name), are packed into the
   stage output; the executor sends it at SEND_F and back-propagates from it at B.
5. Gradients: nanotron's receive function does not pass the gradient to its input; it
   registers it as a send (`register_send_grad`). The state writes it into the matching
   slice of `act_in.grad`, where the executor picks it up as the input gradient and
   sends it at SEND_B. A received tensor that gets no gradient contributes zeros (the
   executor sends zeros, not silence: nanotron's peers match gradients first in, first
   out).
"""

from __future__ import annotations

import collections
import contextlib

import torch

from integration.nanotron._compat import import_nanotron

import_nanotron()  # the nanotron 0.4 repair runs first, so the imports below stay after it (E402)

from nanotron.parallel.pipeline_parallel.block import PipelineBlock  # noqa: E402
from nanotron.parallel.pipeline_parallel.state import PipelineBatchState  # noqa: E402

from integration.nanotron.boundary import Layout  # noqa: E402
from integration.nanotron.errors import EngineRuntimeError  # noqa: E402

FAKE_RANK = -1  # the rank of a masked block: matches no process, so misuse fails loudly


class StageCall(PipelineBatchState):
    """The state attached to the blocks during the model call of F(stage, mb)
    ([Note: one chunk per model call])."""

    def __init__(self, stage: int, mb: int, block_stage: dict[int, int], *, sender_rank: int | None,
                 act_in: torch.Tensor | None, layout: Layout | None):
        self.stage, self.mb = stage, mb
        self.block_stage = block_stage  # id(block) -> stage
        self.consumer_stage: int | None = None  # stage of the block whose forward runs
        self.sender_rank = sender_rank  # from_rank the blocks of this stage receive from
        self.act_in, self.layout = act_in, layout
        self.inbox = collections.deque(layout.unpack(act_in) if layout is not None else ())
        self.entries = collections.deque(layout.entries if layout is not None else ())
        self.given: list = []  # (entry, tensor) handed out, for gradients
        self.activations_buffer = collections.deque()  # shadows nanotron's class-level deque
        self.outbox: list[torch.Tensor] = []

    # -- forward -----------------------------------------------------------------------

    def register_send_activation(self, activation, to_rank, p2p):
        if self.consumer_stage == self.stage + 1:
            self.outbox.append(activation)
        # else dropped: see [Note: one chunk per model call], point 4

    def register_activation_requiring_backward(self, activation):
        pass  # nanotron's backward roots: the executor back-propagates from the packed output

    def register_recv_activation(self, from_rank, p2p):
        if from_rank != self.sender_rank or not self.inbox:
            raise EngineRuntimeError(
                f"stage {self.stage}, microbatch {self.mb}: a block of stage {self.consumer_stage} asks for a "
                f"tensor from rank {from_rank}, but this stage receives "
                + (f"{len(self.layout.entries)} tensor(s) {self.layout.describe()} from rank {self.sender_rank}"
                   if self.layout is not None else "nothing (it is stage 0)")
                + f" and {len(self.inbox)} remain. A stage may only consume what the previous stage sends."
            )
        tensor = self.inbox.popleft()
        self.given.append((self.entries.popleft(), tensor))
        self.activations_buffer.append(tensor)

    def register_recv_grad(self, from_rank, p2p):
        raise EngineRuntimeError(f"stage {self.stage}, microbatch {self.mb}: backward reached one of nanotron's send "
                           "roots; the executor back-propagates from the packed stage output only")

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
        one received tensor goes into its slice of act_in.grad."""
        candidates = [e for e, t in self.given if e.requires_grad and tuple(grad.shape) == e.shape]
        if len({(e.offset) for e in candidates}) != 1:
            raise EngineRuntimeError(
                f"stage {self.stage}: cannot tell which of the received tensors {self.layout.describe()} a gradient "
                f"of shape {list(grad.shape)} belongs to (nanotron's receive function does not say); a boundary "
                "may carry one tensor requiring grad per shape"
            )
        entry = candidates[0]
        x = self.act_in
        if x.grad is None:
            x.grad = torch.zeros_like(x)
        x.grad[entry.offset: entry.offset + entry.length].add_(grad.reshape(-1))

    # -- after the call ----------------------------------------------------------------

    def finish_forward(self) -> list[torch.Tensor]:
        """The kept sends, in order; checks every received tensor was consumed."""
        if self.inbox:
            raise EngineRuntimeError(
                f"stage {self.stage}, microbatch {self.mb}: {len(self.inbox)} of the received tensors "
                f"{self.layout.describe()} were never used by a block of the stage"
            )
        out, self.outbox = self.outbox, []
        self.activations_buffer.clear()
        return out


@contextlib.contextmanager
def one_stage(blocks: list[PipelineBlock], stage_of: dict[int, int], call: StageCall, rank: int):
    """Masks this rank's other stages and attaches `call` for one model call
    ([Note: one chunk per model call])."""
    masked = [b for b in blocks if b.rank == rank and stage_of[id(b)] != call.stage]
    previous = [b.pipeline_state for b in blocks]
    try:
        for block in masked:
            block.rank = FAKE_RANK
        for block in blocks:
            block.set_pipeline_state(call)
        yield call
    finally:
        for block in masked:
            block.rank = rank
        for block, state in zip(blocks, previous):
            block.set_pipeline_state(state)


@contextlib.contextmanager
def consumer_tracking(blocks: list[PipelineBlock], stage_of: dict[int, int]):
    """Forward pre-hooks telling the attached `StageCall` which stage's block runs."""

    def hook(block, args):
        state = block.pipeline_state
        if isinstance(state, StageCall):
            state.consumer_stage = stage_of[id(block)]

    handles = [block.register_forward_pre_hook(hook) for block in blocks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


__all__ = ["FAKE_RANK", "StageCall", "consumer_tracking", "one_stage"]
