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

Use: name the engine in nanotron's YAML (`parallelism.pp_engine: capped_1f1b:cap=2`,
[Note: pp_engine syntax] in engine_spec) and start nanotron's trainer through
`python -m integration.nanotron.train --config-file CONFIG`, or import
`integration.nanotron` first in your own launch script. nanotron then builds the model
with the engine's split and placement ([Note: build hook] in hooks.py) and its trainer
calls `train_batch_iter` as it does for its own engines.

At its first step on a model the engine checks that the model is laid out as it runs
([Note: model layout] in layout.py); then each step compiles (once, cached) and runs
the verified schedule for (pp, m) through pipeschedule's runtime (`step.Runner`).
Returns what nanotron's engines return: on the rank of the loss block m dicts
`{"loss": loss / m}` (detached), elsewhere m dicts `{"loss": TensorPointer(rank of the
loss)}`. Gradients end where nanotron's optimizer paths expect them (DDP, fp32
accumulation, ZeRO-1: [Note: gradient sync] in grad_sync).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist

from integration.nanotron._compat import import_nanotron

import_nanotron()

from nanotron.parallel.pipeline_parallel.engine import PipelineEngine  # noqa: E402

from integration.nanotron import hooks  # noqa: E402
from integration.nanotron.engine_spec import EngineSpec  # noqa: E402
from integration.nanotron.errors import EngineRuntimeError, ParameterError  # noqa: E402
from integration.nanotron.layout import ModelLayout, engine_layout, layer_mask, model_stages  # noqa: E402
from integration.nanotron.recompute import apply_recompute  # noqa: E402
from integration.nanotron.step import Runner, pipeline_blocks, unwrap  # noqa: E402
from pipeschedule import compile_schedule  # noqa: E402
from pipeschedule.generators import family_virtual  # noqa: E402
from pipeschedule.generators.one_f_one_b import default_cap  # noqa: E402
from pipeschedule.generators.v_shape import v_placement  # noqa: E402
from pipeschedule.ir import Schedule  # noqa: E402
from pipeschedule.offload import add_offload  # noqa: E402
from pipeschedule.passes import forward_only  # noqa: E402
from pipeschedule.runtime import DistTransport, HostStagedTransport  # noqa: E402
from pipeschedule.verify import verify  # noqa: E402

_LOG = logging.getLogger("pipeschedule.nanotron")
_engines_built: dict[tuple[int, ...], itertools.count] = {}  # pp group -> engine counter (store prefixes)


class PipescheduleEngine(PipelineEngine):
    """Base of the engines; subclasses set `name` (the config name) and `family`."""

    name = ""
    family = ""

    def __init__(self, spec: EngineSpec | None = None):
        super().__init__()
        self.spec = spec if spec is not None else EngineSpec(self.name)
        if self.spec.name != self.name:
            raise ParameterError(f"{type(self).__name__} runs {self.name!r}, got spec {self.spec.to_string()!r}")
        self._runners: dict[tuple, Runner] = {}
        self._transport: DistTransport | None = None

    # -- parameters --------------------------------------------------------------------

    @property
    def virtual(self) -> int:
        return 1

    def cap(self, pp: int):
        return None

    def placement(self, pp: int) -> list[int]:
        """Rank of each stage: round robin over pp * virtual stages (the V-shape engines:
        rank r runs stages r and 2pp-1-r)."""
        return [s % pp for s in range(pp * self.virtual)]

    def check(self, *, pp: int, num_layers: int | None = None) -> None:
        """`spec.check_against(pp=, num_layers=)`: cap and split lengths, split sum."""
        self.spec.check_against(pp=pp, num_layers=num_layers, virtual=self.virtual)

    def compile(self, *, pp: int, microbatches: int) -> Schedule:
        """The lowered, verified schedule this engine runs for (pp, m), with the spec's
        OFFLOAD / RELOAD when it has `offload`."""
        schedule = compile_schedule(self.family, pp=pp, microbatches=microbatches, virtual=self.virtual, cap=self.cap(pp))
        policy = self.spec.offload_policy()
        if policy is not None:
            schedule = add_offload(schedule, policy)
            verify(schedule)
        return schedule

    # -- the model's layout ([Note: model layout]) ---------------------------------------

    def pipeline_blocks(self, model) -> list:
        """The model's `PipelineBlock`s in forward order."""
        return pipeline_blocks(model)

    def model_layout(self, model, pp: int) -> ModelLayout:
        """Where this engine puts each block of `model` (what nanotron's build_model
        applies under [Note: build hook])."""
        self.check(pp=pp)
        blocks = self.pipeline_blocks(model)
        return engine_layout([b.module_builder for b in blocks], _block_costs(model, blocks),
                             placement=self.placement(pp), split=self.spec.split, engine=self.spec.to_string())

    def model_stages(self, model, blocks, pp: int) -> list[int]:
        """The stage of each block of a built model; refuses a model not laid out as this
        engine runs it."""
        self.check(pp=pp)
        return model_stages([b.rank for b in blocks], [b.module_builder for b in blocks], _block_costs(model, blocks),
                            placement=self.placement(pp), split=self.spec.split, engine=self.spec.to_string(),
                            hook=hooks.describe())

    def prepare_model(self, model, blocks, stage_of: dict[int, int], rank: int) -> None:
        """Once per model, at its first step: layer recompute as `recompute=` says."""
        if self.spec.recompute is not None:
            layers = layer_mask([b.module_builder for b in blocks], _block_costs(model, blocks))
            report = apply_recompute(blocks, stage_of, rank, self.spec.recompute, layers=layers,
                                     split_backward=self.splits)
            if report:
                _LOG.warning("pipeschedule rank %d: %s", rank, report)

    @property
    def splits(self) -> bool:
        """Whether this engine's schedules split the backward into B and W."""
        return False

    # -- nanotron's interface ----------------------------------------------------------

    def train_batch_iter(self, model, pg, batch: Iterable[dict], nb_microbatches: int, grad_accumulator):
        self.nb_microbatches = nb_microbatches
        runner = self._runner(model, pg, nb_microbatches, train=True)
        return runner.step(model, batch, grad_accumulator)

    def validate_batch_iter(self, model, batch: Iterable[dict], nb_microbatches: int):
        """Forward only, through the executor: this engine's forwards lowered and verified
        as an evaluation schedule (`pipeschedule.passes.forward_only`), under
        `torch.no_grad` (losses / m on the loss rank, as nanotron)."""
        self.nb_microbatches = nb_microbatches
        pg = self.pipeline_blocks(model)[0].p2p.pg
        runner = self._runner(model, pg, nb_microbatches, train=False)
        with torch.no_grad():
            return runner.step(model, batch, None)

    # -- internals ---------------------------------------------------------------------

    def _runner(self, model, pg, m: int, *, train: bool) -> Runner:
        key = (id(pg), m, train)
        if key not in self._runners:
            pp = pg.size()
            self.check(pp=pp)
            schedule = self.compile(pp=pp, microbatches=m)
            if not train:  # evaluation: the forward half, lowered and verified as one ([Note: forward-only schedules])
                schedule = forward_only(schedule)
                verify(schedule)
            self._runners[key] = Runner(self, schedule, self._transport_for(pg), _device_of(model))
        return self._runners[key]

    def training_ledger(self):
        """The memory `Ledger` of this rank's executor for training steps (its sizes, peaks
        and per-instruction trace cover the last step), or None before the first
        `train_batch_iter`. Raises if the engine trained at several (pg, m): the ledger
        would be ambiguous."""
        ledgers = [runner.executor.ledger for (_, _, train), runner in self._runners.items() if train]
        if len(ledgers) > 1:
            raise EngineRuntimeError(f"this engine ran {len(ledgers)} training configurations; the ledger is ambiguous")
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

    @property
    def splits(self) -> bool:
        return True


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


def _block_costs(model, blocks) -> list[int]:
    """nanotron's compute cost of each block (`get_block_compute_costs`; 0 without it)."""
    inner = unwrap(model)
    costs = inner.get_block_compute_costs() if hasattr(inner, "get_block_compute_costs") else {}
    return [costs.get(b.module_builder, 0) for b in blocks]


def _device_of(model) -> torch.device:
    """Where received boundary tensors are allocated: the device of the rank's parameters."""
    parameter = next(iter(unwrap(model).parameters()), None)
    return parameter.device if parameter is not None else torch.device("cpu")


__all__ = [
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
]
