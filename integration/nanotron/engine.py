"""nanotron `PipelineEngine`s that run pipeschedule's compiled schedules.

    ps_afab            AFAB (nanotron's AllForwardAllBackward), pipeschedule's runtime
    ps_1f1b            1F1B (nanotron's OneForwardOneBackward), pipeschedule's runtime
    capped_1f1b        1F1B with at most `cap` microbatches in flight per rank;
                       cap defaults to pipeschedule.generators.default_cap(pp) = ceil(pp/2)
                       (cap = pp is exactly 1F1B)
    interleaved_1f1b   `virtual` chunks per rank, round-robin placement (default virtual=2
                       when the class is built directly; a config must name it); optional cap
    zb_h1              zero-bubble ZB-H1: split backward (B input gradients, W weight
                       gradients), 1F1B's memory; optional cap
    zbv, v_half, v_min split backward on the V-shape placement (rank r runs stages r and
                       2pp-1-r): ZB-V (1F1B's memory), V-Half (about half), V-Min (about
                       a third); optional cap in stage-microbatches

Use (nanotron's trainer does exactly this; a config names the engine with
`parallelism.pp_engine: capped_1f1b:cap=2`, see `integration.nanotron.config`):

    engine = CappedOneFOneBEngine(parse_engine("capped_1f1b:cap=2"))
    engine.spec.check_against(pp=pp, num_layers=cfg.layers)        # or engine.check(pp=, num_layers=)
    model = build_llama(cfg, p2p, llama_block_ranks(cfg, pp, split=engine.spec.split))
    outputs = engine.train_batch_iter(model, pg=pp_pg, batch=..., nb_microbatches=m, grad_accumulator=None)

The layer split (`spec.split`, decoder layers per stage, pp * virtual entries) and the
placement are applied when the model is built, not by the engine: pass them to
`llama_block_ranks(cfg, pp, split=spec.split, placement=engine.placement(pp))`. The
engine derives its stages from the built model (`block_stages`: consecutive blocks on
one rank; where two consecutive stages share a rank, as at the turn of a V, the split or
nanotron's cost arithmetic divides them) and refuses a model whose stages are not the
schedule's.

How a step runs: the schedule for (pp, m) is compiled and verified once and cached; one
`Executor` of pipeschedule's runtime runs this rank's program over a `DistTransport` on
the pp group. Each F is one model call that runs one stage ([Note: one chunk per model
call] in `stage_call`); boundary tensors are packed into one ([Note: packed boundary]
in `boundary`). Returns what nanotron's engines return: on the rank of the loss block m
dicts `{"loss": loss / m}` (detached), elsewhere m dicts `{"loss": TensorPointer(rank of
the loss)}`.

[Note: gradient sync] nanotron starts DDP's gradient all-reduce by backward *count*
(the (m-1)-th backward). Here a rank runs virtual * m backwards, so the engine syncs on
the last B of this rank's program instead: every other B runs under DDP `no_sync` (the
whole step does) and, with a grad accumulator, under its `no_sync`; the last B runs under
nanotron's `ddp_trigger_sync_in_bwd`, so with a grad accumulator its fp32 all-reduce hook
sets `fp32_grads_allreduce_handle`, which the trainer waits on afterwards. After each B
(and each W) the grad accumulator folds the half-precision gradients into its fp32
buffers, as its own `backward` does. DDP's buckets fire only when one backward touches
every parameter of the rank for the last time, which no single instruction does with
virtual > 1 (the last B touches one chunk) or with a split backward (the last B leaves
the deferred weights to the W that follow it, and W of earlier microbatches may run
after it too). Then the engine all-reduces (averages) the gradients over DDP's group
after the step itself, once the last W has run, and refuses a grad accumulator (not
supported).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from integration.nanotron._compat import import_nanotron

import_nanotron()

from nanotron.parallel.data_parallel.utils import ddp_trigger_sync_in_bwd
from nanotron.parallel.pipeline_parallel.block import PipelineBlock
from nanotron.parallel.pipeline_parallel.engine import PipelineEngine
from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer
from torch.nn.parallel import DistributedDataParallel

from integration.nanotron.boundary import Layout
from integration.nanotron.engine_spec import EngineSpec
from integration.nanotron.split import nanotron_block_stages
from integration.nanotron.stage_call import (
    StageCall,
    block_stages,
    consumer_tracking,
    one_stage,
    split_block_stages,
)
from pipeschedule import compile_schedule
from pipeschedule.generators import family_virtual
from pipeschedule.generators.one_f_one_b import default_cap
from pipeschedule.generators.v_shape import v_placement
from pipeschedule.ir import Instr, Op, Schedule
from pipeschedule.offload import add_offload
from pipeschedule.runtime import DistTransport, Executor, HostStagedTransport, RemoteOutput
from pipeschedule.runtime.ledger import signature_of
from pipeschedule.verify import verify

_engines_built: dict[tuple[int, ...], itertools.count] = {}  # pp group -> engine counter (store prefixes)


class PipescheduleEngine(PipelineEngine):
    """Base of the engines; subclasses set `name` (the config name) and `family`."""

    name = ""
    family = ""

    def __init__(self, spec: EngineSpec | None = None):
        super().__init__()
        self.spec = spec if spec is not None else EngineSpec(self.name)
        if self.spec.name != self.name:
            raise ValueError(f"{type(self).__name__} runs {self.name!r}, got spec {self.spec.to_string()!r}")
        self._runners: dict[tuple, _Runner] = {}
        self._transport: DistTransport | None = None

    # -- parameters --------------------------------------------------------------------

    @property
    def virtual(self) -> int:
        return 1

    def cap(self, pp: int):
        return None

    def placement(self, pp: int) -> list[int]:
        """Rank of each stage: round robin over pp * virtual stages (the V-shape engines:
        rank r runs stages r and 2pp-1-r). Build the model with it."""
        return [s % pp for s in range(pp * self.virtual)]

    def check(self, *, pp: int, num_layers: int | None = None) -> None:
        """`spec.check_against(pp=, num_layers=)`: cap and split lengths, split sum."""
        self.spec.check_against(pp=pp, num_layers=num_layers)

    def compile(self, *, pp: int, microbatches: int) -> Schedule:
        """The lowered, verified schedule this engine runs for (pp, m), with the spec's
        OFFLOAD / RELOAD when it has `offload`."""
        schedule = compile_schedule(self.family, pp=pp, microbatches=microbatches, virtual=self.virtual, cap=self.cap(pp))
        policy = self.spec.offload_policy()
        if policy is not None:
            schedule = add_offload(schedule, policy)
            verify(schedule)
        return schedule

    # -- nanotron's interface ----------------------------------------------------------

    def train_batch_iter(self, model, pg, batch: Iterable[dict], nb_microbatches: int, grad_accumulator):
        self.nb_microbatches = nb_microbatches
        runner = self._runner(model, pg, nb_microbatches, train=True)
        return runner.step(model, batch, grad_accumulator)

    def validate_batch_iter(self, model, batch: Iterable[dict], nb_microbatches: int):
        """Forward only, through the executor: this engine's schedule without its backward
        half (`forward_only`), under `torch.no_grad` (losses / m on the loss rank, as nanotron)."""
        self.nb_microbatches = nb_microbatches
        pg = _unwrap(model).pipeline_blocks()[0].p2p.pg if hasattr(_unwrap(model), "pipeline_blocks") else None
        if pg is None:
            pg = next(m for m in _unwrap(model).modules() if isinstance(m, PipelineBlock)).p2p.pg
        runner = self._runner(model, pg, nb_microbatches, train=False)
        with torch.no_grad():
            return runner.step(model, batch, None)

    # -- internals ---------------------------------------------------------------------

    def _runner(self, model, pg, m: int, *, train: bool) -> _Runner:
        key = (id(pg), m, train)
        if key not in self._runners:
            pp = pg.size()
            self.check(pp=pp)
            schedule = self.compile(pp=pp, microbatches=m)
            if not train:
                schedule = forward_only(schedule)
            self._runners[key] = _Runner(schedule, self._transport_for(pg), _device_of(model), self.spec.split,
                                         offload_chunk=self.spec.offload_chunk)
        return self._runners[key]

    def training_ledger(self):
        """The memory `Ledger` of this rank's executor for training steps (its sizes, peaks
        and per-instruction trace cover the last step), or None before the first
        `train_batch_iter`. Raises if the engine trained at several (pg, m): the ledger
        would be ambiguous."""
        ledgers = [runner.executor.ledger for (_, _, train), runner in self._runners.items() if train]
        if len(ledgers) > 1:
            raise RuntimeError(f"this engine ran {len(ledgers)} training configurations; the ledger is ambiguous")
        return ledgers[0] if ledgers else None

    def split_report(self) -> dict:
        """stage -> `SplitReport` of this rank's stages, from the runs so far (split-backward
        schedules only): whether each stage deferred its weight gradients to W."""
        out = {}
        for runner in self._runners.values():
            out.update(runner.executor.split_report)
        return out

    def _transport_for(self, pg) -> DistTransport:
        if self._transport is None:
            ranks = tuple(dist.get_process_group_ranks(pg))
            counter = _engines_built.setdefault(ranks, itertools.count())
            prefix = f"pipeschedule/nanotron/{'-'.join(map(str, ranks))}/{next(counter)}/"
            store = dist.distributed_c10d._get_default_store()  # TODO(runtime): a public way to reach the store
            # gloo cannot carry CUDA tensors: ranks that share a GPU (gloo on a CUDA
            # machine) stage each boundary tensor through pinned host memory.
            staged = dist.get_backend(pg) == "gloo" and torch.cuda.is_available()
            transport = HostStagedTransport if staged else DistTransport
            self._transport = transport(store, group=pg, prefix=prefix)
        return self._transport

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec.to_string()!r})"


class PsAfabEngine(PipescheduleEngine):
    """`ps_afab`: all forwards, then all backwards (what nanotron's AFAB engine runs)."""

    name, family = "ps_afab", "afab"


class PsOneFOneBEngine(PipescheduleEngine):
    """`ps_1f1b`: 1F1B (what nanotron's 1F1B engine runs); accepts every m >= 1."""

    name, family = "ps_1f1b", "1f1b"


class CappedOneFOneBEngine(PipescheduleEngine):
    """`capped_1f1b`: 1F1B keeping at most `cap` microbatches in flight on each rank
    (clipped to pp - r); default cap = ceil(pp / 2) (`default_cap`)."""

    name, family = "capped_1f1b", "capped_1f1b"

    def cap(self, pp: int):
        return self.spec.cap if self.spec.cap is not None else default_cap(pp)


class InterleavedOneFOneBEngine(PipescheduleEngine):
    """`interleaved_1f1b`: `virtual` chunks per rank (default 2), round robin; optional cap
    (in stage-microbatches). The model must be built with pp * virtual stages."""

    name, family = "interleaved_1f1b", "interleaved_1f1b"

    @property
    def virtual(self) -> int:
        return self.spec.virtual or 2

    def cap(self, pp: int):
        return self.spec.cap

    def check(self, *, pp: int, num_layers: int | None = None) -> None:
        spec = self.spec if self.spec.virtual else EngineSpec(self.name, self.spec.cap, self.virtual, self.spec.split)
        spec.check_against(pp=pp, num_layers=num_layers)


class SplitBackwardEngine(PipescheduleEngine):
    """Base of the split-backward engines: each F defers its linear layers' weight
    gradients, B computes input gradients (and what cannot defer), W the deferred weight
    gradients ([Note: split backward] in pipeschedule.runtime.split_backward). The
    runtime reports per stage whether deferral applied (`executor.split_mode`)."""

    @property
    def virtual(self) -> int:
        return family_virtual(self.family)

    def cap(self, pp: int):
        return self.spec.cap


class ZeroBubbleH1Engine(SplitBackwardEngine):
    """`zb_h1`: ZB-H1, 1F1B's placement and memory, about a third of its bubble."""

    name, family = "zb_h1", "zb_h1"


class _VShapeEngine(SplitBackwardEngine):
    def placement(self, pp: int) -> list[int]:
        return v_placement(pp)


class ZeroBubbleVEngine(_VShapeEngine):
    """`zbv`: ZB-V, V-shape placement, 1F1B's activation memory, near-zero bubble."""

    name, family = "zbv", "zbv"


class VHalfEngine(_VShapeEngine):
    """`v_half`: V-Half, V-shape placement, about half of 1F1B's activation memory."""

    name, family = "v_half", "v_half"


class VMinEngine(_VShapeEngine):
    """`v_min`: V-Min, V-shape placement, about a third of 1F1B's activation memory."""

    name, family = "v_min", "v_min"


ENGINE_CLASSES = {cls.name: cls for cls in (
    PsAfabEngine, PsOneFOneBEngine, CappedOneFOneBEngine, InterleavedOneFOneBEngine,
    ZeroBubbleH1Engine, ZeroBubbleVEngine, VHalfEngine, VMinEngine,
)}


def forward_only(schedule: Schedule) -> Schedule:
    """The forward half of a lowered schedule: F, SEND_F, RECV_F and FREE act_out kept;
    act_in and stash freed right after each F (evaluation keeps no graph)."""
    programs = []
    for program in schedule.programs:
        kept = []
        for i in program:
            if i.op in (Op.SEND_F, Op.RECV_F) or (i.op is Op.FREE and i.buf == "act_out"):
                kept.append(i)
            elif i.op is Op.F:
                kept += [i, Instr(Op.FREE, i.stage, i.mb, buf="act_in"), Instr(Op.FREE, i.stage, i.mb, buf="stash")]
        programs.append(tuple(kept))
    return Schedule(schedule.name + "/forward", schedule.pp, schedule.virtual, schedule.microbatches,
                    schedule.placement, tuple(programs), dict(schedule.params))


def _device_of(model) -> torch.device:
    """Where received boundary tensors are allocated: the device of the rank's parameters."""
    parameter = next(iter(_unwrap(model).parameters()), None)
    return parameter.device if parameter is not None else torch.device("cpu")


# -- one step ----------------------------------------------------------------------------


class _Runner:
    """The executor of one (pg, m, train|eval) and what its steps share."""

    def __init__(self, schedule: Schedule, transport: DistTransport, device: torch.device, split=None,
                 offload_chunk: int | None = None):
        self.schedule, self.transport, self.split = schedule, transport, split
        self.rank = transport.rank
        self.layouts: dict[int, Layout] = {}  # producing stage -> boundary layout
        self.stages = _ModelStages(self)
        self.executor = _NanotronExecutor(schedule, self.rank, self.stages, transport, device=device,
                                          offload_chunk=offload_chunk)
        backwards = [pc for pc, i in enumerate(self.executor.program) if i.op is Op.B]
        self.last_backward = self.executor.program[backwards[-1]] if backwards else None
        # [Note: gradient sync]: DDP syncs inside the last B only when that B is the last
        # touch of every parameter of the rank.
        self.sync_in_backward = schedule.virtual == 1 and not schedule.split_backward

    def step(self, model, batch, grad_accumulator) -> list[dict]:
        inner = _unwrap(model)
        blocks = inner.pipeline_blocks() if hasattr(inner, "pipeline_blocks") else [
            m for m in inner.modules() if isinstance(m, PipelineBlock)]
        stage_of = block_stages(blocks, self.schedule.placement, candidates=_stage_candidates(inner, blocks, self.schedule, self.split))
        is_ddp = isinstance(model, DistributedDataParallel)
        if is_ddp and not self.sync_in_backward and grad_accumulator is not None:
            raise NotImplementedError(
                f"{self.schedule.name} with DDP and a grad accumulator: the gradients are synchronised after "
                "the step, which the accumulator's fp32 all-reduce hook does not support ([Note: gradient sync])"
            )
        self.stages.begin(model, blocks, stage_of, batch)
        self.executor.begin(model if is_ddp else None, grad_accumulator,
                            self.last_backward if self.sync_in_backward else None)
        try:
            with consumer_tracking(blocks, stage_of), (model.no_sync() if is_ddp else contextlib.nullcontext()):
                outputs = self.executor.step([None] * self.schedule.microbatches)  # data: _ModelStages
        finally:
            self.stages.end()
            self.executor.end()
        if is_ddp and not self.sync_in_backward and torch.is_grad_enabled():
            _average_gradients(model)
        return [
            {"loss": TensorPointer(group_rank=o.rank)} if isinstance(o, RemoteOutput) else o for o in outputs
        ]


class _ModelStages:
    """The runtime's `Stages` ([Note: stages protocol]) over a nanotron model: F(stage, mb)
    is one model call on microbatch mb ([Note: one chunk per model call])."""

    def __init__(self, runner: _Runner):
        self.runner = runner
        self.schedule = runner.schedule

    def begin(self, model, blocks, stage_of, batch) -> None:
        self.model, self.blocks, self.stage_of = model, blocks, stage_of
        self.batch = iter(batch)
        self.cached: dict[int, dict] = {}
        self.fetched = 0
        local = [s for s, r in enumerate(self.schedule.placement) if r == self.runner.rank]
        self.calls_left = dict.fromkeys(range(self.schedule.microbatches), len(local))

    def end(self) -> None:
        self.cached.clear()
        self.model = self.blocks = self.batch = None

    def peek(self, mb: int) -> dict:
        """Microbatch mb of the data loader, read lazily; `micro_batch` without using it up."""
        while self.fetched <= mb:
            self.cached[self.fetched] = next(self.batch)
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
        sender = None if stage == 0 else (-1 if schedule.placement[stage - 1] == rank else schedule.placement[stage - 1])
        call = StageCall(stage, mb, self.stage_of, sender_rank=sender,
                         act_in=act_in if stage > 0 else None, layout=layout)
        with one_stage(self.blocks, self.stage_of, call, rank):
            output = self.model(**micro_batch)
        sends = call.finish_forward()
        if stage == schedule.num_stages - 1:
            loss = output["loss"] if isinstance(output, dict) else output
            if not isinstance(loss, torch.Tensor):
                raise RuntimeError(f"the last stage {stage} returned {loss!r}, not the loss")
            return loss
        if not sends:
            raise RuntimeError(f"stage {stage}, microbatch {mb}: no block of stage {stage + 1} received anything")
        if stage not in self.runner.layouts:
            self.runner.layouts[stage] = Layout.of(sends)
            self.runner.transport.publish(f"layout/{stage}", self.runner.layouts[stage].encode())
        return self.runner.layouts[stage].pack(sends)

    def _layout(self, stage: int) -> Layout:
        if stage not in self.runner.layouts:  # published by the sender before it sent (see forward)
            deadline = time.monotonic() + 60.0
            while (text := self.runner.transport.lookup(f"layout/{stage}")) is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the layout of stage {stage}'s output was never published")
                time.sleep(0.001)
            self.runner.layouts[stage] = Layout.decode(text)
        return self.runner.layouts[stage]

    def parameters(self, stage: int):
        return itertools.chain.from_iterable(
            itertools.chain(b.parameters(), b.buffers()) for b in self.blocks if self.stage_of[id(b)] == stage
        )


class _NanotronExecutor(Executor):
    """The runtime's Executor with nanotron's gradient sync around B ([Note: gradient sync]).

    TODO(runtime): a public hook around B (context and after-backward callback) would
    replace this override of `Executor._backward`.
    """

    def begin(self, ddp_model, grad_accumulator, sync_at: Instr | None) -> None:
        self._ddp, self._accumulator, self._sync_at = ddp_model, grad_accumulator, sync_at

    def end(self) -> None:
        self._ddp = self._accumulator = None

    def _input_signature(self, i: Instr, x, target):
        """The stages read the data loader's microbatch themselves (the executor is given
        None inputs), so its tensors' shapes join the signature of the stash measurement."""
        return signature_of((x, target, self.stages.peek(i.mb)))

    def _backward(self, i: Instr) -> None:
        contexts = []
        if self._ddp is not None:
            if i == self._sync_at:
                contexts.append(ddp_trigger_sync_in_bwd(model_ddp=self._ddp))
            elif self._accumulator is not None:
                contexts.append(self._accumulator.no_sync())
        with contextlib.ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context)
            super()._backward(i)
            self._fold()

    def _weight(self, i: Instr) -> None:
        super()._weight(i)  # never the sync point ([Note: gradient sync])
        self._fold()

    def _fold(self) -> None:
        if self._accumulator is not None:  # what GradientAccumulator.backward does after loss.backward()
            for name, entry in self._accumulator.fp32_grad_buffers.items():
                if entry["half"].grad is not None:
                    self._accumulator._accumulate_grad(name=name, half_param=entry["half"])


def _stage_candidates(model, blocks, schedule: Schedule, split) -> list:
    """Ways to divide the blocks into the schedule's stages where consecutive stages
    share a rank (`block_stages`): the engine's split, then nanotron's cost arithmetic."""
    out = []
    if split is not None:
        out.append(split_block_stages(blocks, split))
    if hasattr(model, "get_block_compute_costs"):
        costs = model.get_block_compute_costs()
        out.append(nanotron_block_stages([costs.get(b.module_builder, 0) for b in blocks], schedule.num_stages))
    return out


def _unwrap(model):
    return model.module if isinstance(model, DistributedDataParallel) else model


def _average_gradients(ddp_model: DistributedDataParallel) -> None:
    group = ddp_model.process_group
    world = dist.get_world_size(group)
    for param in ddp_model.module.parameters():
        if param.grad is not None:
            param.grad.div_(world)
            dist.all_reduce(param.grad, group=group)


__all__ = [
    "ENGINE_CLASSES",
    "CappedOneFOneBEngine",
    "InterleavedOneFOneBEngine",
    "PipescheduleEngine",
    "PsAfabEngine",
    "PsOneFOneBEngine",
    "SplitBackwardEngine",
    "VHalfEngine",
    "VMinEngine",
    "ZeroBubbleH1Engine",
    "ZeroBubbleVEngine",
    "forward_only",
]
