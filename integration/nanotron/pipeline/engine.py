"""The nanotron `PipelineEngine` that runs pipeschedule's compiled schedules: one class,
`PipescheduleEngine`, for every schedule family. What differs between families (virtual
stages, cap and its default, placement, split backward) comes from the family's record
(`pipeschedule.compiler.families.FAMILIES`), and its `pp_engine` value is the core's
`ScheduleSpec` ([Note: pp_engine syntax] in pipeschedule/compiler/spec.py):

    ps_afab            AFAB (nanotron's AllForwardAllBackward), pipeschedule's runtime
    ps_1f1b            1F1B (nanotron's OneForwardOneBackward), pipeschedule's runtime
    capped_1f1b        1F1B with at most `cap` microbatches in flight per rank; cap
                       defaults to the family's default_cap(pp) = ceil(pp/2) (cap = pp is
                       exactly 1F1B)
    interleaved_1f1b   `virtual` chunks per rank (required), round-robin placement; optional cap
    zb_h1              zero-bubble ZB-H1: split backward (B input gradients, W weight
                       gradients), 1F1B's memory; optional cap
    zbv, v_half, v_min split backward on the V-shape placement (rank r runs stages r and
                       2pp-1-r): ZB-V (1F1B's memory), V-Half (about half), V-Min (about
                       a third); optional cap in stage-microbatches
    zb_h2, dualpipev,  ZB-H2 (split backward, up to 2pp-1 stashed), DualPipeV (V shape),
    interleaved_zb,    interleaved zero bubble and looped BFS (round robin, virtual
    looped_bfs         required); a cap where the family takes one (not looped_bfs)
    searched           split backward, one stage per rank, ordered for the F/B/W times the
                       first step measures under the cap ([Note: searched engine]); optional cap

Use: name the engine in nanotron's YAML (`parallelism.pp_engine: capped_1f1b:cap=2`,
[Note: pp_engine syntax]) and start nanotron's trainer through
`python -m integration.nanotron.train --config-file CONFIG`, or import
`integration.nanotron` first in your own launch script. nanotron then builds the model
with the engine's split and placement ([Note: build hook] in patches/trainer.py) and its trainer
calls `train_batch_iter` as it does for its own engines.

At its first step on a model the engine checks that the model is laid out as it runs
([Note: model layout] in layout.py); then each step runs the verified schedule for
(pp, m) through pipeschedule's runtime: `train_batch_iter` hands the spec to
`build_runner` (once per (pg, m), cached), which compiles it (the core's `compile_spec`) and makes
the `step.Runner`, which makes the runtime's `Executor` with the spec's offload settings.
Returns what nanotron's engines return: on the rank of the loss block m dicts
`{"loss": loss / m}` (detached), elsewhere m dicts `{"loss": TensorPointer(rank of the
loss)}`. Gradients end where nanotron's optimizer paths expect them (DDP, fp32
accumulation, ZeRO-1: [Note: gradient sync] in grad_sync), by one rule for every schedule:
under DDP, `train_batch_iter` returns with every gradient averaged over the data-parallel
group (with the fp32 accumulator, its all-reduce has completed and the handle the trainer
waits on is done); without DDP (dp = 1, or ZeRO-1 with fp32 accumulation) it returns with
each gradient summed over this replica's microbatches, and the data-parallel sum is the
trainer's own `sync_gradients_across_dp` after the call, as under nanotron's engines. With
the fp32 accumulator each bf16 gradient is folded into fp32 as autograd produces it
([Note: gradient folding]), so one parameter's bf16 gradient lives at a time.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

import nanotron.models.base as nanotron_base
from nanotron.parallel.pipeline_parallel.engine import PipelineEngine

from integration.nanotron.pipeline.engine_spec import AutoSpec, ScheduleSpec, parse_engine
from integration.nanotron.pipeline.errors import EngineRuntimeError, ParameterError
from integration.nanotron.pipeline.layout import ModelLayout, engine_layout, layer_mask, model_stages
from integration.nanotron.pipeline.recompute import apply_recompute
from integration.nanotron.pipeline.step import Runner, pipeline_blocks, unwrap
from pipeschedule.compiler.families import FAMILIES
from pipeschedule.compiler.spec import compile_spec
from pipeschedule.plan.auto import Measured, choose
from pipeschedule.compiler.ir import Schedule
from pipeschedule.compiler.passes import forward_only
from pipeschedule.runtime import DistTransport, HostStagedTransport
from pipeschedule.compiler.verify import verify

_LOG = logging.getLogger("pipeschedule.nanotron")
_engines_built: dict[tuple[int, ...], itertools.count] = {}  # pp group -> engine counter (store prefixes)


SEARCHED = "searched"  # the family whose engine measures its costs first ([Note: searched engine])


class PipescheduleEngine(PipelineEngine):
    """Runs the schedules of one parsed `pp_engine` value (`spec`) of any family."""

    def __init__(self, spec: ScheduleSpec):
        super().__init__()
        if not isinstance(spec, ScheduleSpec):
            names = ", ".join(f.engine for f in FAMILIES.values())
            raise ParameterError(f"PipescheduleEngine runs pipeschedule's engines (a ScheduleSpec of {names}), "
                                 f"got {spec!r}")
        self.spec = spec
        self.family = FAMILIES[spec.family]
        self._runners: dict[tuple, Runner] = {}
        self._transport: DistTransport | None = None

    # -- parameters, from the family's record ---------------------------------------------

    @property
    def name(self) -> str:
        """The config name (`capped_1f1b`, `ps_1f1b`, ...)."""
        return self.spec.name

    @property
    def virtual(self) -> int:
        """Model chunks per rank (the spec's, else the family's own)."""
        return self.spec.chunks

    def cap(self, pp: int):
        """The spec's cap, else the family's default (capped_1f1b: ceil(pp/2)), else None."""
        return self.spec.cap_at(pp)

    def placement(self, pp: int) -> list[int]:
        """Rank of each stage: the family's placement (round robin; the V shapes: rank r
        runs stages r and 2pp-1-r), which every schedule it compiles has."""
        return self.spec.placement(pp)

    @property
    def splits(self) -> bool:
        """Whether this engine's schedules split the backward into B and W
        ([Note: split backward] in pipeschedule.runtime.split_backward: each F defers its linear layers'
        weight gradients; the runtime reports per stage whether deferral applied,
        `executor.split_mode`)."""
        return self.family.split_backward

    def check(self, *, pp: int, num_layers: int | None = None) -> None:
        """`check_spec(spec, pp=, num_layers=)`: cap and split lengths, split sum, and
        what this adapter does not run."""
        check_spec(self.spec, pp=pp, num_layers=num_layers)

    def compile(self, *, pp: int, microbatches: int) -> Schedule:
        """The lowered, verified schedule this engine runs for (pp, m), with the spec's
        OFFLOAD / RELOAD when it has `offload` (the core's `compile_spec`)."""
        return compile_spec(self.spec, pp=pp, microbatches=microbatches)

    # -- the model's layout ([Note: model layout]) ---------------------------------------

    def pipeline_blocks(self, model) -> list:
        """The model's `PipelineBlock`s in forward order."""
        return pipeline_blocks(model)

    def model_layout(self, model, pp: int) -> ModelLayout:
        """Where this engine puts each block of `model` (what nanotron's build_model
        applies under [Note: build hook])."""
        blocks = self.pipeline_blocks(model)
        return self.layout([b.module_builder for b in blocks], _block_costs(model, blocks), pp)

    def layout(self, builders, costs, pp: int) -> ModelLayout:
        """Where this engine puts blocks of these module builders and nanotron compute
        costs (forward order) at `pp` ranks: `model_layout` from numbers alone, as
        `pipeschedule check` lays out a model it does not build."""
        self.check(pp=pp)
        return engine_layout(builders, costs, placement=self.placement(pp), split=self.spec.split,
                             engine=self.spec.to_string())

    def model_stages(self, model, blocks, pp: int) -> list[int]:
        """The stage of each block of a built model; refuses a model not laid out as this
        engine runs it."""
        self.check(pp=pp)
        return model_stages([b.rank for b in blocks], [b.module_builder for b in blocks], _block_costs(model, blocks),
                            placement=self.placement(pp), split=self.spec.split, engine=self.spec.to_string(),
                            hook=_build_hook())

    def prepare_model(self, model, blocks, stage_of: dict[int, int], rank: int) -> None:
        """Once per model, at its first step: layer recompute as `recompute=` says."""
        if self.spec.recompute is not None:
            layers = layer_mask([b.module_builder for b in blocks], _block_costs(model, blocks))
            report = apply_recompute(blocks, stage_of, rank, self.spec.recompute, layers=layers,
                                     split_backward=self.splits)
            if report:
                _LOG.warning("pipeschedule rank %d: %s", rank, report)

    # -- nanotron's interface ----------------------------------------------------------

    def train_batch_iter(self, model, pg, batch: Iterable[dict], nb_microbatches: int, grad_accumulator):
        self.nb_microbatches = nb_microbatches
        runner = self._runner(self.spec, model, pg, nb_microbatches, train=True)
        return runner.step(model, batch, grad_accumulator)

    def validate_batch_iter(self, model, batch: Iterable[dict], nb_microbatches: int):
        """Forward only, through the executor: this engine's forwards lowered and verified
        as an evaluation schedule (`pipeschedule.compiler.passes.forward_only`), under
        `torch.no_grad` (losses / m on the loss rank, as nanotron)."""
        self.nb_microbatches = nb_microbatches
        pg = self.pipeline_blocks(model)[0].p2p.pg
        runner = self._runner(self.spec, model, pg, nb_microbatches, train=False)
        with torch.no_grad():
            return runner.step(model, batch, None)

    # -- internals ---------------------------------------------------------------------

    def _runner(self, spec: ScheduleSpec, model, pg, m: int, *, train: bool) -> Runner:
        """The runner of `spec` (this engine's) for (pg, m, train|eval), built at its first step."""
        key = (id(pg), m, train)
        if key not in self._runners:
            self._runners[key] = build_runner(spec, self, model, pg, m, train=train, transport=self._transport_for(pg))
        return self._runners[key]

    def training_ledger(self):
        """The memory `Ledger` of this rank's executor for training steps (its sizes, peaks
        and per-instruction trace cover the last step), or None before the first
        `train_batch_iter`. Raises if the engine trained at several (pg, m): the ledger
        would be ambiguous."""
        executor = self.training_executor("ledger")
        return None if executor is None else executor.ledger

    def training_times(self):
        """The `StepTimes` of this rank's executor for the last training step (host seconds
        in computes, transport and waits), or None before the first `train_batch_iter`;
        raises as `training_ledger` does."""
        executor = self.training_executor("step times")
        return None if executor is None else executor.times

    def training_executor(self, what: str = "executor"):
        """This rank's `Executor` of training steps (a benchmark sets its `timeline`), or None
        before the first `train_batch_iter`; raises where the engine trained at several (pg, m),
        naming `what` would be ambiguous."""
        executors = [runner.executor for (_, _, train), runner in self._runners.items() if train]
        if len(executors) > 1:
            raise EngineRuntimeError(f"this engine ran {len(executors)} training configurations; the {what} "
                                     "would be ambiguous")
        return executors[0] if executors else None

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


class AutoEngine(PipescheduleEngine):
    """`pp_engine: auto[:reserve=GiB]`.

    [Note: auto engine] The model is built with 1F1B's layout (nanotron's split, one stage
    per rank), and the first step runs capped 1F1B with cap 1, the least memory that
    layout can run with. That step measures, per rank, the stash of one microbatch (the
    executor's ledger, `high["stash"]`) and what the rank holds besides it (the
    allocator's peak of the step minus that stash, plus the Adam moments that do not
    exist before the first optimizer step: 8 bytes per parameter of the rank, an upper
    bound under ZeRO-1), and times that step's F and B exactly (synchronising around
    each, this step only) and one copy to host memory; the pp ranks exchange these, and
    each picks, with `pipeschedule.plan.auto.choose`, the fastest that fits the GPU's
    memory less `reserve` GiB (default 2) of 1F1B, capped 1F1B (one cap or per-rank
    caps) and 1F1B with the overflowing ranks' stashes streamed to host memory
    ([Note: auto offload] there: caps and offload are set against each other in
    simulation under the measured costs). From the second step on the engine runs
    exactly that engine (the first step's losses are those of any 1F1B-family engine: the
    same computation in another order, bitwise equal on CPU). It logs the choice and the
    YAML line that pins it. On CPU, where the allocator reports nothing, the budget is
    unbounded and 1F1B is chosen. When neither cap 1 nor offload fits, it raises with the
    rank and its figures. The split and V-shape schedules are not chosen: they need another layout
    (`pipeschedule plan` recommends those, with the YAML to pin them).
    """

    DEFAULT_RESERVE = 2

    def __init__(self, spec: AutoSpec):
        super().__init__(ScheduleSpec("capped_1f1b", cap=1))
        self.auto = spec
        self.choice = None
        self.figures: dict[str, tuple[float, ...]] = {}  # what the first step measured, per pp rank
        self._switch = False

    @property
    def name(self) -> str:
        return self.auto.name if self.choice is None else self.spec.name

    @property
    def saved_spec(self) -> AutoSpec:
        """What a saved config holds: the user's `auto...` value, not the engine it runs
        (a run resumed from a checkpoint's config.yaml chooses again)."""
        return self.auto

    def train_batch_iter(self, model, pg, batch: Iterable[dict], nb_microbatches: int, grad_accumulator):
        first = self.choice is None
        if self._switch:  # the first step's runner stays until now: its ledger is that step's record
            self._runners, self._switch = {}, False
        if first and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        if first:  # F and B timed exactly in the measured step ([Note: auto offload])
            self._runner(self.spec, model, pg, nb_microbatches, train=True).executor.exact_times = True
        out = super().train_batch_iter(model, pg, batch, nb_microbatches, grad_accumulator)
        if first:
            self._choose(model, pg, nb_microbatches)
        return out

    def _choose(self, model, pg, m: int) -> None:
        stash = float(self.training_ledger().high["stash"])
        device = _device_of(model)
        params = sum(p.numel() for p in unwrap(model).parameters())
        if device.type == "cuda":
            static = torch.cuda.max_memory_allocated(device) - stash + 8 * params
            reserve = self.DEFAULT_RESERVE if self.auto.reserve is None else self.auto.reserve
            budget = torch.cuda.get_device_properties(device).total_memory - reserve * 2**30
        else:
            static, budget = 0.0, float("inf")
        times = self.training_times()
        forward, backward = times.forward_s / m, (times.compute_s - times.forward_s) / m  # one stage per rank
        figures = [None] * pg.size()
        dist.all_gather_object(figures, (static, stash, budget, forward, backward, _host_bandwidth(device, stash)),
                               group=pg)
        statics, stashes, budgets, forwards, backwards, links = zip(*figures)
        self.figures = {"static": statics, "stash": stashes, "budget": budgets,  # bytes per pp rank
                        "forward_s": forwards, "backward_s": backwards, "host_bandwidth": links}
        self.choice = choose(pg.size(), m, Measured(statics, stashes, budgets, forwards, backwards, links))
        self.spec = self.choice.spec
        self.family = FAMILIES[self.spec.family]
        self._switch = True
        peaks = "/".join(f"{p / 2**30:.2f}" for p in self.choice.peaks)
        text = (f"pipeschedule pp_engine auto (rank {dist.get_rank(pg)}): {self.choice.why}: running "
                f"{self.choice.engine} from step 2 on; predicted peak GiB per rank {peaks}; pin it with\n"
                f"  parallelism:\n    pp_engine: {self.choice.engine}")
        warn_lines(text)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.auto.to_string()!r}, running {self.spec.to_string()!r})"


class SearchedEngine(PipescheduleEngine):
    """`pp_engine: searched[:cap=N|N0/N1/...][,split=...]`.

    [Note: searched engine] The `searched` family orders its computes for given per-stage
    F, B and W times ([Note: searched schedule] in pipeschedule/compiler/generators/searched.py);
    this engine takes them from the run itself, as `auto` takes its memory: the model is
    laid out as for 1F1B (one stage per rank, nanotron's split or `split=`), the first
    step runs the order searched for unit costs (F = B = W = 1 a stage) under the cap,
    and times every rank's F, B and W exactly (synchronising around each, this step
    only). Every rank of the job gathers these, over the whole world rather than its
    pipeline group: the ranks of one stage in other pipelines (tensor parallel, data
    parallel) must run the same order, or the collectives inside the stage would pair
    across different microbatches; each stage's times are the mean over the ranks that
    run it, so every rank searches the same numbers and finds the same order (the
    runtime checks that the pipeline's ranks agree, [Note: schedule agreement]). From
    the second step on the engine runs the order searched for those times, messages
    free (the search's model needs no link figures to order the computes of one-stage
    ranks). Each step computes the same gradients in another order: bitwise those of
    nanotron's engines on CPU (tests/nanotron/test_nanotron_trainer.py). The times
    are logged with the order's simulated step time for them.
    """

    def __init__(self, spec: ScheduleSpec):
        super().__init__(spec)
        self.cost: tuple[tuple[float, float, float], ...] | None = None  # per stage, at the first step
        self._switch = False

    def train_batch_iter(self, model, pg, batch: Iterable[dict], nb_microbatches: int, grad_accumulator):
        first = self.cost is None
        if self._switch:  # the first step's runner stays until now: its ledger is that step's record
            self._runners, self._switch = {}, False
        if first:
            self._runner(self.spec, model, pg, nb_microbatches, train=True).executor.exact_times = True
        out = super().train_batch_iter(model, pg, batch, nb_microbatches, grad_accumulator)
        if first:
            self._measure(pg, nb_microbatches)
        return out

    def _measure(self, pg, m: int) -> None:
        times = self.training_times()
        mine = (dist.get_rank(pg), times.forward_s / m, (times.compute_s - times.forward_s - times.weight_s) / m,
                times.weight_s / m)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        sums: dict[int, list[float]] = {}
        for stage, *figures in every:
            row = sums.setdefault(stage, [0.0, 0.0, 0.0, 0])
            for k, x in enumerate(figures):
                row[k] += x
            row[3] += 1
        self.cost = tuple(tuple(total / row[3] for total in row[:3]) for _, row in sorted(sums.items()))
        self._switch = True
        ms = ", ".join("/".join(f"{1000 * x:.3g}" for x in stage) for stage in self.cost)
        warn_lines(f"pipeschedule pp_engine {self.spec.to_string()} (rank {dist.get_rank(pg)}): F/B/W ms per "
                   f"microbatch and stage measured at step 1: {ms}; from step 2 on the order searched for them")

    def _runner(self, spec: ScheduleSpec, model, pg, m: int, *, train: bool) -> Runner:
        key = (id(pg), m, train)
        if key not in self._runners:
            self._runners[key] = build_runner(spec, self, model, pg, m, train=train,
                                              transport=self._transport_for(pg), cost=self.cost)
        return self._runners[key]


def warn_lines(text: str) -> None:
    """`text` as one warning a line: nanotron's handler (`NewLineStreamHandler`) splits a
    record's format string at newlines and formats each piece with all the record's
    arguments, so a multi-line message with arguments ended in 'Logging error' tracebacks."""
    for line in text.splitlines():
        _LOG.warning("%s", line)


def check_spec(spec: ScheduleSpec, *, pp: int, num_layers: int | None = None) -> None:
    """`spec.check_against(pp=, num_layers=)` (cap, split and recompute lengths, split sum,
    offload ranks), and what this adapter does not run: several chunks per rank at pp = 1."""
    spec.check_against(pp=pp, num_layers=num_layers)
    if pp == 1 and spec.chunks > 1:
        raise ParameterError(
            f"pp_engine {spec.to_string()!r} runs {spec.chunks} model chunks per rank, which this adapter does not "
            f"run at pp = 1 (one rank holds every chunk, and the data loader's tensors reach each chunk directly "
            f"instead of through the stage before: the first step stopped with an internal error); at pp = 1 "
            f"use ps_1f1b, capped_1f1b or nanotron's own 1f1b"
        )


def build_runner(spec: ScheduleSpec, engine: PipescheduleEngine, model, pg, microbatches: int, *, train: bool,
                 transport: DistTransport, cost=None) -> Runner:
    """The runner of `spec` for (pg, m): its schedule checked against pp and compiled
    (evaluation: the forward half, lowered and verified as one, [Note: forward-only
    schedules]), run by an executor over `transport` with `spec`'s offload settings;
    `engine` checks and prepares the model at its first step ([Note: model layout])."""
    pp = pg.size()
    check_spec(spec, pp=pp)
    schedule = compile_spec(spec, pp=pp, microbatches=microbatches, cost=cost)
    if not train:
        schedule = forward_only(schedule)
        verify(schedule)
    return Runner(engine, schedule, transport, _device_of(model), offload_chunk=spec.offload_chunk,
                  offload_policy=spec.offload_policy())


def build_engine(spec: ScheduleSpec | AutoSpec | str) -> PipescheduleEngine:
    """The engine of a pipeschedule `pp_engine` value (a spec, or its text, parsed by
    `engine_spec.parse_engine`); what nanotron's config loader builds for our names."""
    spec = parse_engine(spec) if isinstance(spec, str) else spec
    if isinstance(spec, AutoSpec):
        return AutoEngine(spec)
    return SearchedEngine(spec) if spec.family == SEARCHED else PipescheduleEngine(spec)


def _host_bandwidth(device: torch.device, stash_bytes: float) -> float:
    """Bytes per second of one copy from `device` into (pinned) host memory, the size of a
    stash up to 256 MiB (at least 1 MiB), the faster of two ([Note: auto offload]). The
    ranks measure at the same moment, so ranks that share a link share it here too."""
    size = int(min(max(stash_bytes, 2**20), 256 * 2**20))
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
    best = math.inf
    for _ in range(2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        target.copy_(source, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return size / max(best, 1e-9)


def _build_hook() -> str:
    """Whether nanotron's `build_model` is pipeschedule's ([Note: build hook] in
    patches/trainer.py), for the layout refusal."""
    if hasattr(nanotron_base.build_model, "__pipeschedule_original__"):
        return "nanotron's build_model is pipeschedule's"
    return ("nanotron's build_model is not pipeschedule's: import integration.nanotron before nanotron's trainer "
            "(integration.nanotron.patches.patching.describe() says what is installed)")


def _block_costs(model, blocks) -> list[int]:
    """nanotron's compute cost of each block (`get_block_compute_costs`; 0 without it)."""
    inner = unwrap(model)
    costs = inner.get_block_compute_costs() if hasattr(inner, "get_block_compute_costs") else {}
    return [costs.get(b.module_builder, 0) for b in blocks]


def _device_of(model) -> torch.device:
    """Where received boundary tensors are allocated: the device of the rank's parameters."""
    parameter = next(iter(unwrap(model).parameters()), None)
    return parameter.device if parameter is not None else torch.device("cpu")


__all__ = ["AutoEngine", "PipescheduleEngine", "SearchedEngine", "build_engine", "build_runner", "check_spec"]
