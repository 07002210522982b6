"""The executor: runs one rank's program of a lowered schedule, one instruction at a time.

[Note: executor semantics]
- First step: before its first instruction, every rank publishes the schedule it
  runs and compares it with every other rank's; any difference stops every rank
  with a `ScheduleMismatchError` ([Note: schedule agreement] in agreement). Later
  steps skip this.
- Dispatch: every op goes through one table (`self._dispatch`); an op without a
  handler raises.
- Buffers: every buffer of [Note: buffers] lives in `self.buffers` (a `BufferTable`),
  from the instruction that produces it to its FREE, and nowhere else.
- Batches: a maximal run of consecutive communication instructions is one batch: it is
  posted as one `Transport.post` and waited on as a whole before the next instruction,
  the semantics under which the verifier proves a schedule deadlock-free (rule 4); a
  transport that copies its sends out at post (host staging) is waited on for the
  batch's receives only, and the step ends once its sends have arrived ([Note: sends in
  the background] in transport).
- Stage hand-off: when stages s and s+1 run on the same rank, F(s)'s output becomes
  act_in of s+1 (detached, requiring grad as the output did) and B(s+1)'s input
  gradient becomes grad_out of s; no message is sent. Either way it is handed on as a
  received tensor would be: contiguous, at the start of its storage
  ([Note: contiguous boundaries]).
- Stage graphs ([Note: stage graph] in compiler/graph.py): on a graph that is not the
  chain, a stage's forward takes {producer stage: tensor} (stage 0: the data-loader
  input) and returns {consumer stage: tensor} ([Note: stages protocol]); each tensor
  travels on its own edge, as a message or a local hand-off, with its own act_out,
  act_in, grad_out and grad_in ([Note: buffers]); B back-propagates from every output
  that requires grad with its consumer's gradient, and hands each producer the
  gradient of its input (zeros where none reached it).
- Output release: at FREE act_out (after its send completed) the output's storage is
  released by replacing its `.data` with an empty tensor, as Megatron's
  `deallocate_output_tensor` does; the tensor object and its grad_fn stay in the stash
  for B, so a stage never holds its outputs until backward. Outputs that are views, or
  that are the act_in itself, are only dropped, not emptied. On a stage graph one
  output may be computed from another (h to one consumer, a Linear of h to another),
  and autograd then holds the first as an input of the second, so emptying it would
  break B: outputs are emptied there only where the stages say that none is used by
  anything else they compute (`separate_outputs`, [Note: stages protocol]); otherwise
  they go with the stash.
- Stash bytes: F measures what autograd saves with the ledger's saved-tensor hooks
  ([Note: what the ledger counts]) on the first F of each stage and input signature
  (`measure_stash="first"`: again each step, or only when the stage's `Stages.state`
  changed where the stages give one) or on every F (`"every"`); a stash that may be offloaded
  is always packed through them. Where no hooks ran, autograd keeps its own shallow copy
  of a saved output, so emptying the output's `.data` (below) is safe either way.
- Shapes: each boundary tensor's shape is given (`shapes=`) or exchanged once
  ([Note: first-use metadata]); every send is checked against it, since the receiver
  allocates exactly that. A gradient has its output's shape and dtype.
- Loss: the last stage's loss is divided by m before backward, so gradients accumulate
  to the mean over microbatches; the step returns the scaled, detached losses.
- Split backward: in a schedule with W, each F defers its stage's weight-gradient
  matmuls into the stash's W part (`Stash.weights`, [Note: split backward]); B computes
  input gradients and the gradients that could not defer, W the deferred ones. From B
  to W the ledger charges the stash with what the W part holds (`Ledger.resize`).
  `split_mode[stage]` says "split" or "full" (nothing deferred: B runs the full backward,
  W runs nothing), `split_report[stage]` the counts; each stage is logged once.
- Host offload: OFFLOAD / RELOAD of a stash copy its saved tensors to host memory and
  back on a side stream ([Note: host offload] in host_offload); B and W wait on the
  reload's event, and raise if the stash was not reloaded. Only `stash` moves.
- Timeline: with `timeline` set (a `Timeline`), every F, B and W is timed, by the
  host's clock on CPU and by CUDA events on the current stream on a GPU ([Note: measured
  timeline] in timeline); the spans of the last step are the timeline's.
- Buffer pool: with `pool=True` (the default) receive and send buffers come from a
  `BufferPool` sized by the schedule ([Note: buffer pool] in pool); the stage output
  is then copied into its send buffer at F and its own storage released at once.

[Note: contiguous boundaries] Every tensor that crosses a stage boundary, the output
going forward and its gradient coming back, reaches the other stage contiguous and at
the start of its own storage: that is what a receive produces, and a same-rank hand-off
produces the same (`_handed`: the tensor itself when it already is, else a copy).
Kernels take other paths for other strides (a transposed GEMM packs its operands
differently), so when a same-rank hand-off kept a transposed output's strides and a
receive did not, gradients differed in the last bits from one placement to another
(2.8e-17 in a Linear's weight gradient, reported for interleaved at pp 2 and 3; in
tests/runtime/test_runtime_layout.py, pp=1 and zbv at pp=2 against the others). The other
way out, carrying strides in the shape exchange and receiving with `torch.empty_strided`,
matches the plain model in more cases but not in all: the gradient sent back has the
layout autograd gives the input's `.grad` (its layout contract), not the one the
consumer's backward made, so a consumer that reads its input through `.contiguous()`
or a sum still differed (tried: a transposed output read that way), and outputs with
gaps or overlaps need more. With contiguous boundaries every placement, schedule and
pp computes the same bits whatever layouts the stages return: those of the single-
process model whose stage outputs are made contiguous before the next stage reads them,
which is the model itself when they already are (nanotron's packed boundaries are). An
output that is already contiguous is handed on as it is, at no cost.

[Note: executor hooks] Two public hooks let a caller add what its stages need without
subclassing the executor (both None by default; given to the constructor or set as
attributes between steps):

- `around_gradients(instr)` returns a context manager entered around every B and W the
  program runs (not around F, messages, FREE, OFFLOAD or RELOAD): where gradients go
  during that instruction. The nanotron adapter enters DDP's sync or no-sync, its fp32
  accumulator's no_sync, and the folding of shared and accumulated gradients there
  ([Note: gradient sync] in integration/nanotron/pipeline/grad_sync.py).
- `side_inputs(instr)` returns what an F's stage reads besides its act_in and target (the
  adapter's stages read the data loader's microbatch themselves); it joins the input
  signature by which a measured stash is reused ([Note: what the ledger counts]), so
  two microbatches of different shapes are measured apart.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
import traceback
from collections import deque
from typing import Any, Callable, ContextManager, Mapping, Sequence

import torch
from torch.autograd.variable import Variable

from pipeschedule.checks import check_int, is_int, is_number, shown
from pipeschedule.errors import ParameterError
from pipeschedule.compiler.effects import (
    BACKWARD_OPS, COMPUTE_OPS, EFFECTS, RECV_OPS, SEND_OPS, boundary_keys, edge_side,
)
from pipeschedule.compiler.ir import COMM_OPS, Instr, Op, Schedule, edge_end
from pipeschedule.compiler.passes import is_lowered
from pipeschedule.compiler.program import instructions
from pipeschedule.runtime.agreement import Agreement, ScheduleSummary
from pipeschedule.runtime.buffers import BufferTable, Stash, buffer_key
from pipeschedule.runtime.driver import RemoteOutput, StepTimes, describe_batch, run_blocking
from pipeschedule.errors import RuntimeScheduleError, ScheduleMismatchError
from pipeschedule.compiler.offload import streamed_stashes
from pipeschedule.runtime.host_offload import Offloader
from pipeschedule.runtime.ledger import Ledger, nbytes, saved_storages, signature_of, storage_ptrs
from pipeschedule.runtime.pool import BufferPool
from pipeschedule.runtime.shapes import Shapes, TensorMeta, describe
from pipeschedule.runtime.split_backward import SplitReport, WeightGrads
from pipeschedule.runtime.stages import ModuleStages, Stages
from pipeschedule.runtime.timeline import Timeline
from pipeschedule.runtime.transport import P2P, Pending, Transport

_LOG = logging.getLogger("pipeschedule.runtime")
MEASURE_STASH = ("first", "every")
GRADIENT_OPS = COMPUTE_OPS & BACKWARD_OPS  # the instructions `around_gradients` wraps: B, W
# Receives of an activation (RECV_F): the tensor requires grad as the sender's did, and its
# shape is learnt at the first step ([Note: first-use metadata]; a gradient has its output's).
ACTIVATION_RECEIVES = frozenset(op for op in RECV_OPS if EFFECTS[op].buffer == "act_in")
STASH_SIZES_KEPT = 256  # measured stash sizes kept across steps, at most (then measured afresh)


class Executor:
    """Runs `schedule.programs[rank]`; see [Note: executor semantics].

    `step(inputs, targets)` runs one training step, blocking on each wait under the
    watchdog of `driver.run_blocking`; `run(inputs, targets)` is the same step as a
    generator that yields a `Pending` whenever the rank must wait (the in-process
    driver uses it).
    `inputs` holds one data-loader input per microbatch (needed on the rank of stage 0),
    `targets` one target per microbatch (handed to the last stage, may be None).
    `pool`: boundary buffers from a `BufferPool` (allocated once, reused across steps);
    False allocates each one afresh, as the caching allocator serves it.
    `measure_stash`: "first" (the default) measures the stash of the first F of each stage
    and input signature, and charges later ones of the same signature the same bytes, in
    this step and, where `stages` has `state(stage)`, in later steps of the same state;
    "every" measures every F (for stages whose saved tensors vary with the data,
    not only with the input shapes). See [Note: what the ledger counts] in ledger.
    `offload_chunk`: bytes; a stash the program offloads before its B streams to host
    memory in chunks of this size while F saves it, and back `reload_window` chunks ahead
    while B consumes it ([Note: streamed offload] in stream_offload). None (the default):
    each moves whole at its OFFLOAD and RELOAD ([Note: host offload]).

    Two hooks for a caller whose stages need more than the executor knows (the nanotron
    adapter's gradient paths, [Note: gradient sync] in integration/nanotron/pipeline/grad_sync.py),
    given to the constructor or set as attributes between steps ([Note: executor hooks]).
    """

    def __init__(
        self, schedule: Schedule, rank: int, stages: Stages, transport: Transport, *,
        device: str | torch.device = "cpu", timeout: float = 300.0,
        shapes: Mapping[int, TensorMeta] | None = None, history: int = 6, pool: bool = True,
        measure_stash: str = "first", offload_chunk: int | None = None, reload_window: int = 2,
        around_gradients: Callable[[Instr], ContextManager] | None = None,
        side_inputs: Callable[[Instr], Any] | None = None,
    ):
        for name, hook in (("around_gradients", around_gradients), ("side_inputs", side_inputs)):
            if hook is not None and not callable(hook):
                raise ParameterError(f"{name}={shown(hook)}: give a function of the instruction, or None")
        if measure_stash not in MEASURE_STASH:
            raise ParameterError(f"measure_stash={measure_stash!r}: accepted values are "
                                 f"{', '.join(map(repr, MEASURE_STASH))}")
        if not is_int(rank) or not 0 <= rank < schedule.pp:
            raise ParameterError(f"rank {shown(rank)} is not a rank of {schedule.name!r} "
                                 f"(pp={schedule.pp}: ranks 0..{schedule.pp - 1}, an int)")
        if not is_lowered(schedule):
            raise ParameterError(f"schedule {schedule.name!r} is a compute order (no SEND, RECV or FREE): lower it "
                                 f"first (pipeschedule.lower, or compile_schedule, which lowers and verifies)")
        _check_timeout(timeout)
        check_int("history", history, minimum=0)
        if isinstance(stages, ModuleStages) and not schedule.is_chain:
            raise ParameterError(f"ModuleStages runs chain schedules; {schedule.name!r} has the stage graph "
                                 f"{[list(e) for e in schedule.edges]}: give Stages whose forward takes "
                                 "{producer stage: tensor} and returns {consumer stage: tensor} "
                                 "([Note: stages protocol])")
        if isinstance(stages, ModuleStages) and len(stages.chunks) != schedule.num_stages:
            raise ParameterError(f"ModuleStages has {len(stages.chunks)} chunks for the {schedule.num_stages} stages "
                                 f"of {schedule.name!r} (one per global stage, None for those other ranks run): its "
                                 f"last chunk is the one it adds the loss to")
        if transport.failure is not None:
            raise RuntimeScheduleError(
                f"rank {rank}: a step over this transport failed earlier ({transport.failure}); a new executor needs a "
                f"new process group and transport, or a new job ([Note: no retry on a failed group] in transport)",
                rank=rank)
        self.measure_stash = measure_stash
        self.around_gradients = around_gradients  # [Note: executor hooks]
        self.side_inputs = side_inputs
        self.exact_times = False  # StepTimes' compute times: synchronise around each F, B, W (slower)
        self.timeline: Timeline | None = None  # spans of each F, B, W when set ([Note: measured timeline])
        self.schedule, self.rank, self.stages, self.transport = schedule, rank, stages, transport
        self.program: tuple[Instr, ...] = instructions(schedule.programs[rank])
        self.device = torch.device(device)
        self.timeout = timeout
        self.last_stage = schedule.num_stages - 1
        self.graph, self.chain = schedule.graph, schedule.is_chain
        # per pc, the boundary a message carries (`_boundary`), None for other instructions
        self._boundary_at = [self._boundary(i) if i.op in COMM_OPS else None for i in self.program]
        self._separate_outputs = getattr(stages, "separate_outputs", False) is True  # [Note: stages protocol]
        self.ledger = Ledger()
        self.buffers = BufferTable(self.ledger)
        self.times = StepTimes()
        self.steps = 0  # completed steps
        self._agreed = self._agreeing = False  # every rank runs this schedule ([Note: schedule agreement])
        if shapes is not None and not (isinstance(shapes, Mapping) and all(
                (is_int(s) and 0 <= s < schedule.num_stages - 1 if schedule.is_chain else s in schedule.graph.index)
                and isinstance(meta, TensorMeta) for s, meta in shapes.items())):
            what = (f"a stage whose output crosses a boundary (0..{schedule.num_stages - 2})" if schedule.is_chain
                    else f"an edge (producer, consumer) of the stage graph {[list(e) for e in schedule.edges]}")
            raise ParameterError(f"shapes= maps {what} to its TensorMeta, got {shown(shapes)}")
        self.shapes = Shapes(transport, shapes)
        self._history: deque[tuple[int, Instr]] = deque(maxlen=history)
        self._stash_bytes: dict[tuple, int] = {}  # (stage, state, input signature) -> stash bytes
        self._state_of = getattr(stages, "state", None)  # Stages.state, where given
        self._pc, self._waiting, self._broken, self._running = 0, None, False, False
        self.split = schedule.split_backward
        self.split_mode: dict[int, str] = {}  # stage -> "split" | "full", from its first F
        self.split_report: dict[int, SplitReport] = {}
        self.pool = BufferPool(schedule, rank, self.device) if pool else None
        self._pooled = boundary_keys(schedule)  # (buf, stage, peer stage) the pool serves
        # F packs saved tensors in holders where the program moves buffers to the host
        self.offloads = any(EFFECTS[i.op].moves_to == "host" for i in self.program)
        self.offloader = Offloader(self.device, self.ledger, offload_chunk, reload_window)
        self._streamed = streamed_stashes(self.program) if offload_chunk is not None else frozenset()
        self._dispatch = {  # one handler per op ([Note: instruction effects] in compiler/effects.py)
            Op.F: self._forward, Op.B: self._backward, Op.W: self._weight, Op.FREE: self._free,
            Op.SEND_F: self._send_f, Op.RECV_F: self._recv_f, Op.SEND_B: self._send_b, Op.RECV_B: self._recv_b,
            Op.OFFLOAD: self._offload, Op.RELOAD: self._reload,
        }

    # -- the step ----------------------------------------------------------------------

    def step(self, inputs: Sequence[Any] | None = None, targets: Sequence[Any] | None = None, *,
             timeout: float | None = None) -> list:
        """One step; returns `_outputs()`. Raises RuntimeScheduleError (and makes every
        other rank raise) on any failure, or when one wait exceeds `timeout` seconds
        (default: the executor's)."""
        if timeout is not None:
            _check_timeout(timeout)
        return run_blocking(self, self.run(inputs, targets), self.timeout if timeout is None else timeout)

    def run(self, inputs: Sequence[Any] | None = None, targets: Sequence[Any] | None = None):
        """One step as a generator: yields `Pending`s, returns the outputs (see `_outputs`)."""
        batch: list[tuple[int, Instr]] = []
        try:
            self._begin()
            if not self._agreed:
                yield from self._agree()
            self._running = True  # past the agreement: messages may be in flight from here on
            self._take(inputs, targets)
            for pc, instr in enumerate(self.program):
                if instr.op in COMM_OPS:
                    batch.append((pc, instr))
                    continue
                if batch:
                    yield from self._exchange(batch)
                    batch = []
                self._pc = pc
                if self.offloads:
                    self.offloader.poll()
                self._execute(instr)
                self._ran(pc, instr)
            if batch:
                yield from self._exchange(batch)
            yield from self._sends_received()
            return self._outputs()
        except Exception as err:  # (the step stays marked broken: see _begin)
            wrapped = self._fail(err)
            if wrapped is err:
                raise
            raise wrapped from err

    def _begin(self) -> None:
        if self._broken:
            raise RuntimeScheduleError(
                "this executor stopped with an error in an earlier step; a new one needs a new process group and "
                "transport, or a new job ([Note: no retry on a failed group] in transport)")
        self._pc = 0
        self._losses: list[torch.Tensor | None] = [None] * self.schedule.microbatches
        self._persistent: dict[int, set[int]] = {}
        self._states: dict[int, Any] = {}  # stage -> Stages.state this step
        if self._state_of is None or len(self._stash_bytes) > STASH_SIZES_KEPT:
            self._stash_bytes = {}  # measured afresh this step
        self._broken = True  # until the step completes; a failed or abandoned step leaves it set
        self._running = False
        self.ledger.begin_step()
        self.times = StepTimes(start=time.perf_counter())
        if self.timeline is not None:
            self.timeline.begin_step()

    def _agree(self):
        """Generator, at the first step: publishes this rank's schedule and waits for every
        rank's; raises ScheduleMismatchError unless they are all the same
        ([Note: schedule agreement])."""
        self._agreeing = True
        try:
            summary = ScheduleSummary.of(self.schedule, self.shapes.given)
            agreement = Agreement(self.transport, self.shapes.namespace, self.rank, summary)
            problem = agreement.wrong_world()
            if problem is not None:
                raise self.error(problem, error_type=ScheduleMismatchError, fields=("pp",))
            if not agreement.ready():
                yield agreement
            found = agreement.mismatch()
            if found is not None:
                message, fields, ranks = found
                raise self.error(message, error_type=ScheduleMismatchError, fields=fields, ranks=ranks)
            self._agreed = True
        finally:
            self._agreeing = False

    def _take(self, inputs, targets) -> None:
        """Checks and keeps the step's inputs and targets."""
        m = self.schedule.microbatches
        for name, values in (("inputs", inputs), ("targets", targets)):
            if values is not None and len(values) != m:
                raise RuntimeScheduleError(f"{len(values)} {name} given for {m} microbatches")
        if inputs is None and self.schedule.placement[0] == self.rank:
            raise RuntimeScheduleError("this rank runs stage 0 and needs inputs (one per microbatch)")
        self._inputs, self._targets = inputs, targets

    def _handler(self, instr: Instr):
        handler = self._dispatch.get(instr.op)
        if handler is None:
            raise RuntimeScheduleError(
                f"no handler for op {instr.op.value} ({instr}); this executor runs "
                f"{', '.join(op.value for op in self._dispatch)}"
            )
        return handler

    def _execute(self, instr: Instr) -> None:
        """Runs one compute or memory instruction; B and W inside `around_gradients(instr)`
        where one is set ([Note: executor hooks])."""
        handler = self._handler(instr)
        timed = self.timeline.span(instr) if self.timeline is not None and instr.op in COMPUTE_OPS else None
        with timed if timed is not None else contextlib.nullcontext():
            if instr.op in GRADIENT_OPS and self.around_gradients is not None:
                with self.around_gradients(instr):
                    handler(instr)
            else:
                handler(instr)

    def _ran(self, pc: int, instr: Instr) -> None:
        self.ledger.record(pc, instr)
        self._history.append((pc, instr))
        self.times.instructions += 1

    def _exchange(self, batch: list[tuple[int, Instr]]):
        """Posts one batch of communication and waits for all of it ([Note: executor semantics])."""
        self._waiting = batch
        posted, waiting = [], batch
        while waiting:  # the first step: receives wait for their shapes ([Note: first-use metadata])
            now, waiting = self._split_unknown(waiting)
            if now:
                posted.append(self._post(now))
            if waiting:  # each peer's first waiting message is a receive whose shape is unknown
                firsts = {}
                for pc, i in waiting:
                    firsts.setdefault(i.peer, self._boundary_at[pc])
                yield from self.shapes.learn(*firsts.values())
        for pending, _, _ in posted:
            if not pending.ready():
                yield pending
        start = time.perf_counter()
        for pending, ops, pcs in posted:
            _finish(pending, {op.peer for op in ops})
            for op, pc in zip(ops, pcs):
                if op.instr.op in ACTIVATION_RECEIVES:
                    op.tensor.requires_grad_(self.shapes[self._boundary_at[pc]].requires_grad)
        self.times.transport_s += time.perf_counter() - start
        self._waiting = None

    def _sends_received(self):
        """Waits for the sends still travelling at the end of the step ([Note: sends in
        the background] in transport); raises a send's error."""
        pending = self.transport.outstanding_sends()
        if pending is None:
            return
        self._waiting = [(len(self.program), "the sends of this step")]
        if not pending.ready():
            yield pending
        _finish(pending, {i.peer for i in self.program if i.op in SEND_OPS})
        self._waiting = None

    def _split_unknown(self, batch):
        """(messages to post now, messages to post once the shapes they need are known):
        a receive whose shape is unknown, and every later receive from the same peer (the
        channel delivers in order), waits ([Note: first-use metadata])."""
        now, later, waiting_peers = [], [], set()
        for pc, instr in batch:
            if instr.op in ACTIVATION_RECEIVES and self._boundary_at[pc] not in self.shapes:
                waiting_peers.add(instr.peer)
            is_recv = instr.op in RECV_OPS
            (later if is_recv and instr.peer in waiting_peers else now).append((pc, instr))
        return now, later

    def _post(self, batch):
        """Posts `batch`'s messages as one; returns (the Pending, the P2Ps, their pcs)."""
        ops, pcs = [], []
        for pc, instr in batch:
            self._pc = pc
            ops.append(self._handler(instr)(instr))
            pcs.append(pc)
            self._ran(pc, instr)
        start = time.perf_counter()
        pending = self.transport.post(ops)
        self.times.transport_s += time.perf_counter() - start
        return pending, ops, pcs

    def _outputs(self) -> list:
        """m dicts {"loss": loss / m, detached} on the rank of the last stage; elsewhere m
        `RemoteOutput(rank)` markers naming that rank (nanotron returns TensorPointer)."""
        self.buffers.check_empty()
        self.offloader.finish()
        if self.pool is not None:
            self.pool.check_idle()
        self._broken = False
        self.steps += 1
        self.times.total_s = time.perf_counter() - self.times.start
        owner = self.schedule.placement[self.last_stage]
        if owner != self.rank:
            return [RemoteOutput(owner)] * self.schedule.microbatches
        return [{"loss": loss} for loss in self._losses]

    # -- compute -----------------------------------------------------------------------

    def _forward(self, i: Instr) -> None:
        x = self._load_input(i)
        target = self._targets[i.mb] if i.stage == self.last_stage and self._targets is not None else None
        weights = WeightGrads() if self.split else None
        holders = [] if self.offloads else None
        signature = None
        if self.measure_stash == "first" and holders is None:
            try:
                signature = (i.stage, self._stage_state(i.stage), self._input_signature(i, x, target))
            except (RuntimeError, TypeError):  # inputs without plain sizes and strides (nested tensors): measure
                pass
        stash_bytes = None if signature is None else self._stash_bytes.get(signature)
        key = ("stash", i.stage, i.mb)
        stream = self.offloader.stream(key) if (i.stage, i.mb) in self._streamed else None
        with (contextlib.nullcontext({}) if stash_bytes is not None else
              saved_storages(self._persistent_storages(i.stage) | storage_ptrs((x, target)), holders, key,
                             stream.add if stream is not None else None)) as saved:
            start = self._clock()
            with weights.deferring() if weights is not None else contextlib.nullcontext():
                y = self.stages.forward(i.stage, i.mb, x, target)
            elapsed = self._clock() - start
            self.times.compute_s += elapsed
            self.times.forward_s += elapsed
        if stash_bytes is None:
            stash_bytes = sum(saved.values())
            self.times.measured += 1
            if signature is not None:
                self._stash_bytes[signature] = stash_bytes
        if weights is not None:
            weights.close_forward(y)
            self._report_split(i.stage, weights)
        root, meta = self._emit_output(i, y, x)
        landed = 0
        if stream is not None:  # its storages, counted as it copied them ([Note: streamed offload])
            landed = stream.end_forward()
            stash_bytes = sum(chunk.nbytes for chunk in stream.chunks)
        self.buffers.add(key, Stash(root, meta, weights, holders), stash_bytes, hosted=landed)

    def _stage_state(self, stage: int):
        """`Stages.state(stage)` once per step (None where the stages give none)."""
        if stage not in self._states:
            self._states[stage] = None if self._state_of is None else self._state_of(stage)
        return self._states[stage]

    def _input_signature(self, i: Instr, x, target):
        """What F(i)'s saved tensors may depend on besides the values
        ([Note: what the ledger counts]), with `side_inputs(i)` where stages read other
        inputs ([Note: executor hooks])."""
        if self.side_inputs is None:
            return signature_of((x, target))
        return signature_of((x, target, self.side_inputs(i)))

    def _load_input(self, i: Instr):
        """F's act_in: the data loader's on stage 0, else the received or handed-over
        tensor, or on a stage graph {producer stage: tensor} ([Note: stages protocol])."""
        if i.stage == 0:
            x = self._inputs[i.mb]
            self.buffers.add(("act_in", 0, i.mb), x, nbytes(x))
            return x
        if self.chain:
            return self.buffers.need("act_in", i)
        return {p: self.buffers.need("act_in", i, edge_end(i.stage, p)) for p in self.graph.producers[i.stage]}

    def _boundary(self, i: Instr):
        """The boundary message i carries, as `Shapes` names it: the producing stage on a
        chain, the edge (producer, consumer) on any other graph."""
        step = edge_side(i.op, i.buf)  # +1: the peer stage is the consumer (SEND_F, RECV_B)
        other = i.stage + step if i.peer_stage is None else i.peer_stage
        producer, consumer = (i.stage, other) if step > 0 else (other, i.stage)
        return producer if self.chain else (producer, consumer)

    def _emit_output(self, i: Instr, y, x) -> tuple[torch.Tensor, TensorMeta | None]:
        s, mb = i.stage, i.mb
        if not self.chain and s != self.last_stage:
            return self._emit_outputs(i, y, x)
        if not isinstance(y, torch.Tensor):
            raise RuntimeScheduleError(f"stage {s} forward returned {type(y).__name__}; a stage returns one tensor")
        if s == self.last_stage:
            if y.numel() != 1:
                raise RuntimeScheduleError(f"the last stage must return a scalar loss, got {describe(y)}")
            if not y.requires_grad and torch.is_grad_enabled() and not self.schedule.forward_only:
                raise RuntimeScheduleError(
                    "the last stage returned a loss that does not require grad (detached, computed under no_grad, "
                    "or from nothing that requires grad): its backward would leave every gradient zero")
            root = y / self.schedule.microbatches
            self._losses[mb] = root.detach()
            return root, None
        if self.schedule.placement[s + 1] == self.rank:  # local hand-off ([Note: contiguous boundaries])
            self.buffers.add(("act_in", s + 1, mb), _handed(y.detach()).requires_grad_(y.requires_grad), y.nbytes)
            return y, None  # (no RECV_B: its gradient is handed off too)
        meta = self.shapes.publish(s, y)
        sent = y
        if self.pool is not None and y.numel() > 0:  # [Note: buffer pool]
            # a wrong shape is named at SEND_F, against the meta the receiver allocates
            sent = self.pool.take("act_out", meta if meta.matches(y) else TensorMeta.of(y))
            sent.copy_(y.detach())
            _release(y, x)
        self.buffers.add(("act_out", s, mb), sent, sent.nbytes)
        return y, meta

    def _emit_outputs(self, i: Instr, y, x) -> tuple[tuple, dict]:
        """`_emit_output` on a stage graph: one tensor per consumer stage, each handed over
        or put in its act_out as a chain's output is. Returns the stash's root, ((consumer,
        output), ...), and the meta of each output that leaves the rank, by consumer."""
        s, mb = i.stage, i.mb
        consumers = self.graph.consumers[s]
        if not isinstance(y, dict) or set(y) != set(consumers) or not all(
                isinstance(t, torch.Tensor) for t in y.values()):
            got = {k: type(v).__name__ for k, v in y.items()} if isinstance(y, dict) else type(y).__name__
            raise RuntimeScheduleError(f"stage {s} forward returned {got}; on the stage graph {list(self.graph.edges)} "
                                       f"it returns one tensor per consumer stage, {{stage: tensor}} for stages "
                                       f"{list(consumers)}")
        metas, copied = {}, []
        for t in consumers:
            y_t = y[t]
            if self.schedule.placement[t] == self.rank:  # local hand-off ([Note: contiguous boundaries])
                self.buffers.add(buffer_key("act_in", t, mb, edge_end(t, s)),
                                 _handed(y_t.detach()).requires_grad_(y_t.requires_grad), y_t.nbytes)
                continue
            meta = metas[t] = self.shapes.publish((s, t), y_t)
            sent = y_t
            if self.pool is not None and y_t.numel() > 0:  # [Note: buffer pool]
                sent = self.pool.take("act_out", meta if meta.matches(y_t) else TensorMeta.of(y_t))
                sent.copy_(y_t.detach())
                copied.append(y_t)
            self.buffers.add(buffer_key("act_out", s, mb, edge_end(s, t)), sent, sent.nbytes)
        if self._separate_outputs:  # after every copy: an output may go to two stages
            for y_t in {id(y_t): y_t for y_t in copied}.values():
                _release(y_t, x)
        return tuple((t, y[t]) for t in consumers), metas

    def _backward(self, i: Instr) -> None:
        if not self.chain:
            return self._backward_on_graph(i)
        s, mb = i.stage, i.mb
        stash, x = self.buffers.need("stash", i), self.buffers.need("act_in", i)
        grad = None if s == self.last_stage else self.buffers.need("grad_out", i)
        if self.offloads:  # (a program without OFFLOAD moves nothing to wait for)
            self.offloader.ready(("stash", s, mb), str(i))
        start = self._clock()
        if stash.root.requires_grad:
            _backward_from(stash.root, grad)
        self.times.compute_s += self._clock() - start
        if stash.weights is not None:  # from here the stash holds W's part only
            held = stash.weights.held_bytes(self._persistent_storages(s))
            self.buffers.resize(("stash", s, mb), held)
        if s > 0:
            grad_in = x.grad if x.grad is not None else torch.zeros_like(x)  # zeros, not silence
            x.grad = None
            local = self.schedule.placement[s - 1] == self.rank
            if local:
                grad_in = _handed(grad_in)  # [Note: contiguous boundaries]
            elif self.pool is not None and grad_in.numel() > 0:  # [Note: buffer pool]
                grad_in = self.pool.take("grad_in", self.shapes[s - 1]).copy_(grad_in)
            self.buffers.add(("grad_out", s - 1, mb) if local else ("grad_in", s, mb), grad_in, grad_in.nbytes)

    def _backward_on_graph(self, i: Instr) -> None:
        """`_backward` on a stage graph: from every output that requires grad, with its
        consumer's gradient (the loss on the last stage), then each producer's input
        gradient (zeros where none reached it) handed over or put in its grad_in."""
        s, mb = i.stage, i.mb
        stash, x = self.buffers.need("stash", i), self._load_held_inputs(i)
        if s == self.last_stage:
            roots, grads = ((stash.root,), (None,)) if stash.root.requires_grad else ((), ())
        else:
            pairs = [(y_t, self.buffers.need("grad_out", i, edge_end(s, t))) for t, y_t in stash.root]
            roots, grads = tuple(y for y, _ in pairs if y.requires_grad), tuple(g for y, g in pairs if y.requires_grad)
        if self.offloads:
            self.offloader.ready(("stash", s, mb), str(i))
        start = self._clock()
        if roots and grads[0] is None:
            _backward_from(roots[0], None)
        elif roots:
            Variable._execution_engine.run_backward(roots, grads, False, False, (), True, True)  # see _backward_from
        self.times.compute_s += self._clock() - start
        if stash.weights is not None:
            self.buffers.resize(("stash", s, mb), stash.weights.held_bytes(self._persistent_storages(s)))
        if s == 0:
            return
        for p in self.graph.producers[s]:
            x_p = x[p]
            grad_in = x_p.grad if x_p.grad is not None else torch.zeros_like(x_p)  # zeros, not silence
            x_p.grad = None
            if self.schedule.placement[p] == self.rank:
                self.buffers.add(buffer_key("grad_out", p, mb, edge_end(p, s)), _handed(grad_in), grad_in.nbytes)
                continue
            if self.pool is not None and grad_in.numel() > 0:  # [Note: buffer pool]
                grad_in = self.pool.take("grad_in", self.shapes[(p, s)]).copy_(grad_in)
            self.buffers.add(buffer_key("grad_in", s, mb, edge_end(s, p)), grad_in, grad_in.nbytes)

    def _load_held_inputs(self, i: Instr):
        """B's act_in: as `_load_input` gives it to F, from the buffers (held since F)."""
        if i.stage == 0:
            return self.buffers.need("act_in", i)
        return {p: self.buffers.need("act_in", i, edge_end(i.stage, p)) for p in self.graph.producers[i.stage]}

    def _weight(self, i: Instr) -> None:
        """W: the weight gradients B deferred ([Note: split backward]); the stash is
        freed by the FREE that follows."""
        stash = self.buffers.need("stash", i)
        if stash.weights is None:
            raise RuntimeScheduleError(f"{i}: the stash of (stage {i.stage}, mb {i.mb}) has no W part")
        if self.offloads:
            self.offloader.ready(("stash", i.stage, i.mb), str(i))
        start = self._clock()
        stash.weights.run()
        elapsed = self._clock() - start
        self.times.compute_s += elapsed
        self.times.weight_s += elapsed

    def _clock(self) -> float:
        """perf_counter, after the device's queued work when `exact_times` is set."""
        if self.exact_times and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _report_split(self, stage: int, weights: WeightGrads) -> None:
        if stage in self.split_report:
            return
        report = weights.report(stage, self.stages.parameters(stage))
        self.split_report[stage], self.split_mode[stage] = report, report.mode
        if report.mode == "full":
            _LOG.warning("pipeschedule rank %d: %s", self.rank, report.describe())
        else:
            _LOG.info("pipeschedule rank %d: %s", self.rank, report.describe())

    def _free(self, i: Instr) -> None:
        s, mb, other = i.stage, i.mb, i.peer_stage
        value = self.buffers.drop((i.buf, s, mb) if other is None else (i.buf, s, mb, other))  # `buffer_key`
        if i.buf == "stash":
            self.offloader.forget(("stash", s, mb))
            if self.pool is not None:
                self.pool.stash_freed(s, mb)
        elif self.pool is not None and (i.buf, s, other) in self._pooled and self.pool.owns(value):
            # autograd may read a received buffer until its stash goes ([Note: buffer pool])
            held = i.buf in ("act_in", "grad_out") and ("stash", s, mb) in self.buffers.held
            self.pool.give(value, after_stash=(s, mb) if held else None)
        elif i.buf == "act_out" and (self.chain or self._separate_outputs):
            held = self.buffers.held
            inputs = held.get(("act_in", s, mb)) if self.chain else [
                held.get(buffer_key("act_in", s, mb, edge_end(s, p))) for p in self.graph.producers[s]]
            _release(value, inputs)  # the sent output

    # -- host offload ([Note: host offload]) ---------------------------------------------

    def _offload(self, i: Instr) -> None:
        stash = self._movable(i)
        leaves = stash.weights.leaves() if stash.weights is not None else ()
        self.offloader.offload(("stash", i.stage, i.mb), stash.holders, f"{i} at pc {self._pc}", leaves)

    def _reload(self, i: Instr) -> None:
        self._movable(i)
        self.offloader.reload(("stash", i.stage, i.mb), f"{i} at pc {self._pc}")

    def _movable(self, i: Instr) -> Stash:
        if i.buf != "stash":
            raise RuntimeScheduleError(f"{i}: this runtime moves only the stash to host memory, not {i.buf}")
        stash = self.buffers.need("stash", i)
        if stash.holders is None:
            raise RuntimeScheduleError(f"{i}: the stash of (stage {i.stage}, mb {i.mb}) was made without holders")
        return stash

    # -- communication: each handler returns the message its instruction posts -----------

    def _send_f(self, i: Instr) -> P2P:
        y = self.buffers.need("act_out", i, i.peer_stage)
        meta = self.shapes[self._boundary_at[self._pc]]
        if not meta.matches(y):
            Shapes.check(i, y, meta, f"stage {i.stage + 1 if i.peer_stage is None else i.peer_stage}")
        return P2P(True, i.peer, y.detach().contiguous(), i)  # the P2P keeps a copy alive until sent

    def _recv_f(self, i: Instr) -> P2P:
        s, mb, other = i.stage, i.mb, i.peer_stage
        key = ("act_in", s, mb) if other is None else ("act_in", s, mb, other)  # `buffer_key`
        return P2P(False, i.peer, self._allocate(key, self.shapes[self._boundary_at[self._pc]]), i)

    def _send_b(self, i: Instr) -> P2P:
        grad = self.buffers.need("grad_in", i, i.peer_stage)
        meta = self.shapes[self._boundary_at[self._pc]]
        if not meta.matches(grad):
            Shapes.check(i, grad, meta, f"stage {i.stage - 1 if i.peer_stage is None else i.peer_stage}")
        return P2P(True, i.peer, grad.contiguous(), i)

    def _recv_b(self, i: Instr) -> P2P:
        s, mb, other = i.stage, i.mb, i.peer_stage
        meta = self.buffers.need("stash", i).out_meta
        if not self.chain:  # one per consumer on another rank
            meta = meta[s + 1 if other is None else other]
        key = ("grad_out", s, mb) if other is None else ("grad_out", s, mb, other)  # `buffer_key`
        return P2P(False, i.peer, self._allocate(key, meta), i)

    def _allocate(self, key: tuple[str, int, int], meta: TensorMeta) -> torch.Tensor:
        if self.pool is not None and math.prod(meta.shape) > 0:
            tensor = self.pool.take(key[0], meta)
        else:
            tensor = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
        self.buffers.add(key, tensor, tensor.nbytes)
        return tensor

    def _persistent_storages(self, stage: int) -> set[int]:
        if stage not in self._persistent:
            self._persistent[stage] = storage_ptrs(self.stages.parameters(stage))
        return self._persistent[stage]

    # -- errors ------------------------------------------------------------------------

    def error(self, what: str, *, remote: bool = False, error_type: type[RuntimeScheduleError] = RuntimeScheduleError,
              **details) -> RuntimeScheduleError:
        """`what` located: rank, step, pc, the instruction or batch it is at, and the last
        instructions it ran; an `error_type` (a RuntimeScheduleError) with `details`."""
        here = f"rank {self.rank}, step {self.steps}, pc {self._pc}"
        if self._agreeing:
            here += " (comparing schedules, before its first instruction)"
        elif self._waiting:
            here += f" (at batch {describe_batch(self._waiting)})"
        elif self._pc < len(self.program):
            here += f" ({self.program[self._pc]})"
        ran = ", ".join(f"pc {pc} {instr}" for pc, instr in self._history) or "nothing"
        return error_type(
            f"{here}: {what}\n  last instructions run: {ran}", rank=self.rank, step=self.steps, pc=self._pc,
            instr=self.program[self._pc] if self._pc < len(self.program) else None, remote=remote, **details,
        )

    def stopped_by(self, message: str, local: str = "") -> RuntimeScheduleError:
        """The error of a rank that stops because another rank failed with `message`."""
        quoted = "\n    ".join(message.splitlines())
        return self.error(f"stopped because another rank failed:\n    {quoted}"
                          + (f"\n  here: {local}" if local else ""), remote=True)

    def _fail(self, err: Exception) -> RuntimeScheduleError:
        """Locates `err` and, unless another rank failed first, tells every rank to stop."""
        if isinstance(err, RuntimeScheduleError) and err.rank == self.rank:
            located = err  # already located: the watchdog, another rank's abort
        else:
            what = str(err) if isinstance(err, RuntimeScheduleError) else f"{type(err).__name__}: {err}{_where(err)}"
            try:
                earlier = self.transport.aborted()
            except Exception:  # the store is gone too (its server exited): this rank's own error stands
                earlier = None
            located = self.stopped_by(earlier, what) if earlier else self.error(what)
        if not located.remote:
            try:
                self.transport.abort(str(located))
            except Exception as lost:  # noqa: BLE001  (the others learn it from their own wait)
                _LOG.error("pipeschedule rank %d: could not tell the other ranks to stop: %s", self.rank, lost)
        if self._running:  # (a failed agreement posted nothing, on any rank: the group stays usable)
            self.transport.mark_failed(str(located))
        return located


_NOT_THE_MODEL = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _where(err: BaseException) -> str:
    """' (raised at FILE:LINE in FUNCTION)': the innermost frame of `err`'s traceback outside
    torch and pipeschedule (the model code that failed; else the innermost), which a
    launcher's one-line error would otherwise lose."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return ""
    ours = [f for f in frames if not os.path.abspath(f.filename).startswith(_NOT_THE_MODEL)]
    frame = (ours or frames)[-1]
    return f" (raised at {frame.filename}:{frame.lineno} in {frame.name})"


def _finish(pending: Pending, peers: set[int]) -> None:
    """`pending.finish()`; a transport's error names the ranks at the other end. A rank
    whose process ends (killed, out of host memory, a crash in native code) says nothing
    itself; its neighbours learn it from the transport (gloo: "Connection closed by
    peer"), and their messages are what the launcher shows first."""
    try:
        pending.finish()
    except RuntimeScheduleError:
        raise  # already says what and where
    except Exception as err:
        names = ", ".join(map(str, sorted(peers)))
        raise RuntimeScheduleError(
            f"the transfer with rank{'s' if len(peers) > 1 else ''} {names} failed (where a rank's process ended, "
            f"this is what its neighbours see; its exit code or its own message says why): "
            f"{type(err).__name__}: {err}{_where(err)}") from err


def _check_timeout(timeout) -> None:
    """The watchdog's seconds per wait: a number > 0 (math.inf: no watchdog)."""
    if not (is_number(timeout) and timeout > 0):
        raise ParameterError(f"timeout must be a number of seconds > 0 (math.inf: wait for ever), got {shown(timeout)}")


def _handed(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as a receive would deliver it: contiguous, at the start of its storage
    ([Note: contiguous boundaries]); itself when it already is."""
    if tensor.is_contiguous() and tensor.storage_offset() == 0:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _release(output: torch.Tensor, act_in) -> None:
    """Releases a stage output's storage by replacing its `.data`
    ([Note: executor semantics]); views and an output that is the act_in itself (or, on a
    stage graph, one of the act_ins, given as a dict or list) are left alone."""
    inputs = act_in.values() if isinstance(act_in, dict) else act_in if isinstance(act_in, list) else (act_in,)
    if output._base is None and not any(output is x for x in inputs):
        output.data = torch.empty(0, dtype=output.dtype, device=output.device)


def _backward_from(root: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Backward from `root` with gradient `grad` (None for the scalar loss).

    The output's `.data` may already be released ([Note: executor semantics]), and
    `torch.autograd.backward` would refuse a gradient whose shape differs from the
    emptied output, so the engine is called directly, as Megatron's `custom_backward`
    does; the gradient's shape was checked against the output's meta when received.
    """
    if grad is None:
        torch.autograd.backward(root)
    else:
        Variable._execution_engine.run_backward((root,), (grad,), False, False, (), True, True)
