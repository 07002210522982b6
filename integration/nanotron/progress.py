"""The one block the launcher logs after the first step: the engine, its schedule, and the
stash per pipeline rank predicted beside measured.

[Note: the first-step block] nanotron's log at its default verbosity (`info`) says what
the trainer does (config, model size, then one line per step: loss, tokens/s, memory)
but not how the pipeline holds memory. After the first step of a run, world rank 0 logs,
through nanotron's logging (its format, its `log_level`), one block:

    pipeschedule: engine capped_1f1b:cap=1 (pipeschedule), family capped_1f1b, pp 2, m 4 microbatches a step
    pipeschedule:   schedule: cap 1; placement (rank of each stage) 0/1; decoder layers per stage 2/2
    pipeschedule:   stash per rank in step 1 (predicted: pipeschedule's memory model; measured: the engine's ledger)
    pipeschedule:     rank  stages  layers  in flight  predicted  measured
    pipeschedule:        0  0            2          1   24.5 KiB  23.9 KiB
    ...

then nanotron's own per-step lines follow as nanotron prints them. The prediction is the
planner's ([Note: memory terms] in pipeschedule/plan/memory.py): each stage's stash of
one microbatch, played through the compiled schedule of (pp, m) in program order
(`pipeschedule.plan.peaks`), so the in-flight count is the schedule's. What is measured
is what each rank really kept for backward in that step: pipeschedule's engines count it
in their ledger (saved storages, less the received input and the targets:
[Note: what the ledger counts]); nanotron's own engines keep no ledger, so for them a
stash meter (`stash.StashMeter`, saved storages less the parameters) is attached for the
first step only. On CUDA the allocator's peak of each rank's pipeline part of the step is
added (`peak allocated`); on CPU the allocator reports nothing. (The meter's hooks cost
host time in that one step, which nanotron's line of step 1 includes.)
"""

from __future__ import annotations

from dataclasses import dataclass

from integration.nanotron.pipeline.engine import AutoEngine, PipescheduleEngine, _block_costs
from integration.nanotron.pipeline.layout import layer_mask
from integration.nanotron.pipeline.step import pipeline_blocks
from pipeschedule import compile_schedule
from pipeschedule.errors import PipescheduleError
from pipeschedule.plan.memory import ModelSpec, TrainingSetup, stage_footprints, weight_stash_bytes
from pipeschedule.plan.peaks import Peaks
from pipeschedule.simulate.cost import CostModel

PREFIX = "pipeschedule: "
NANOTRON_FAMILIES = {"OneForwardOneBackwardPipelineEngine": "1f1b", "AllForwardAllBackwardPipelineEngine": "afab"}


@dataclass(frozen=True)
class EngineView:
    """What the block says of an engine on a built model: its config name, who runs it,
    its schedule family and parameters, and the layout (placement: rank of each stage;
    layers: decoder layers per stage). `family` None: an engine with no schedule model."""

    name: str
    ours: bool
    family: str | None
    pp: int
    microbatches: int
    virtual: int
    cap: int | tuple[int, ...] | None
    placement: tuple[int, ...]
    layers: tuple[int, ...]
    recompute: object = None
    offload: tuple[int, ...] | None = None

    def schedule(self):
        """The compiled schedule of (family, pp, m), as the engine compiles it but without
        host copies."""
        return compile_schedule(self.family, pp=self.pp, microbatches=self.microbatches, virtual=self.virtual,
                                cap=self.cap)


def view_of(engine, model, pp: int, microbatches: int) -> EngineView:
    """The `EngineView` of `engine` on `model` (the step about to run: for `auto`, its
    measuring step, capped 1F1B with cap 1)."""
    if isinstance(engine, PipescheduleEngine):
        layout = engine.model_layout(model, pp)
        spec = engine.spec
        name = spec.to_string()
        if isinstance(engine, AutoEngine):
            name = f"{engine.auto.to_string()} (step 1: {name})"
        return EngineView(name, True, engine.family.name, pp, microbatches, engine.virtual, engine.cap(pp),
                          tuple(layout.placement), tuple(layout.layers_per_stage), spec.recompute, spec.offload)
    blocks = pipeline_blocks(model)
    layers = [0] * pp
    for block, is_layer in zip(blocks, layer_mask([b.module_builder for b in blocks], _block_costs(model, blocks))):
        layers[block.rank] += is_layer
    family = NANOTRON_FAMILIES.get(type(engine).__name__)
    return EngineView(family or type(engine).__name__, False, family, pp, microbatches, 1, None, tuple(range(pp)),
                      tuple(layers))


def predicted_stash(view: EngineView, config, model_config, *,
                    attention: str) -> tuple[tuple[float, ...], tuple[int, ...]] | str:
    """(stash bytes, microbatches in flight) per rank at the schedule's peak, from the
    memory model; or why there is no prediction. `attention` is the memory model's
    attention kind of this run ("flash-attn" or "sdpa-standin", which the launcher knows)."""
    if view.family is None:
        return f"no schedule model for {view.name}"
    if not all(hasattr(model_config, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads")):
        return f"the memory model covers Llama-style models, not {type(model_config).__name__}"
    try:
        model = ModelSpec("nanotron", layers=model_config.num_hidden_layers, hidden=model_config.hidden_size,
                          heads=model_config.num_attention_heads,
                          kv_heads=model_config.num_key_value_heads or model_config.num_attention_heads,
                          ffn=model_config.intermediate_size, vocab=model_config.vocab_size,
                          tied_embeddings=bool(getattr(model_config, "tie_word_embeddings", False)))
        setup = _setup(config, view, attention)
        recomputed = recomputed_layers(view)
        footprints = stage_footprints(model, setup, view.layers, recomputed)
        schedule = view.schedule()
        n = schedule.num_stages
        kept = tuple(weight_stash_bytes(model, setup, fp.layers, last=fp.last, recomputed=fp.recomputed)
                     for fp in footprints) if schedule.split_backward else None
        cost = CostModel((1.0,) * n, (2.0,) * n, (0.0,) * n, {"stash": tuple(fp.stash_bytes for fp in footprints)},
                         weight_stash=kept)
        return Peaks(schedule).of(cost)
    except PipescheduleError as err:
        return f"the memory model does not cover this run: {err}"


def _setup(config, view: EngineView, attention: str) -> TrainingSetup:
    parallelism, optimizer = config.parallelism, config.optimizer
    itemsize = config.model.dtype.itemsize
    mode = getattr(parallelism.tp_mode, "name", str(parallelism.tp_mode))
    return TrainingSetup(
        tp=parallelism.tp, dp=parallelism.dp, zero_stage=optimizer.zero_stage, seq=config.tokens.sequence_length,
        micro_batch=config.tokens.micro_batch_size, recompute="selective" if view.recompute == "selective" else "none",
        sequence_parallel=mode == "REDUCE_SCATTER", param_bytes=itemsize, act_bytes=itemsize,
        fp32_grad_accum=bool(optimizer.accumulate_grad_in_fp32),
        tp_async=bool(parallelism.tp_linear_async_communication),
        attention=attention)


def recomputed_layers(view: EngineView) -> tuple[int, ...] | None:
    """Decoder layers each stage recomputes (the spec's `recompute=`; selective is a mode of the setup)."""
    recompute = view.recompute
    if recompute is None or recompute == "selective":
        return None
    if recompute == "full":
        return view.layers
    per_stage = recompute if isinstance(recompute, tuple) else (recompute,) * len(view.layers)
    return tuple(min(n, layers) for n, layers in zip(per_stage, view.layers))


@dataclass(frozen=True)
class Measured:
    """What one rank measured in the first step: its ranks, the peak bytes it kept for
    backward, and (CUDA) the allocator's peak of the pipeline part of the step."""

    pp_rank: int
    dp_rank: int
    tp_rank: int
    stash: float | None
    allocated: float | None


def block(view: EngineView, predicted, measured: list[Measured], *, step: int) -> str:
    """The block's text, one line per line ([Note: the first-step block])."""
    who = "pipeschedule" if view.ours else "nanotron's own"
    lines = [f"engine {view.name} ({who}), family {view.family or 'unknown'}, pp {view.pp}, "
             f"m {view.microbatches} microbatches a step"]
    parts = []
    if view.virtual > 1:
        parts.append(f"virtual {view.virtual}")
    if view.family in ("1f1b", "afab") and not view.ours:
        parts.append("no cap" + (" (pp - r microbatches in flight on rank r)" if view.family == "1f1b" else ""))
    elif view.cap is not None:
        parts.append(f"cap {_joined(view.cap)}")
    parts.append(f"placement (rank of each stage) {_joined(view.placement)}")
    parts.append(f"decoder layers per stage {_joined(view.layers)}")
    if view.recompute is not None:
        parts.append(f"recompute {_joined(view.recompute)}")
    if view.offload is not None:
        parts.append(f"offload ranks {_joined(view.offload)} (not in the prediction, which keeps every stash on the "
                     "device)")
    lines.append("  schedule: " + "; ".join(parts))
    source = "the engine's ledger" if view.ours else "a stash meter (nanotron's engines keep no ledger)"
    model = predicted if isinstance(predicted, str) else "pipeschedule's memory model"
    lines.append(f"  stash per rank in step {step} (predicted: {model}; measured: {source})")
    cuda = any(m.allocated is not None for m in measured)
    lines.append("    rank  stages  layers  in flight   predicted    measured" + ("  peak allocated" if cuda else ""))
    by_rank = {m.pp_rank: m for m in measured if m.dp_rank == 0 and m.tp_rank == 0}
    for rank in range(view.pp):
        stages = [s for s, r in enumerate(view.placement) if r == rank]
        got = by_rank.get(rank)
        stash, inflight = (None, "-") if isinstance(predicted, str) else (predicted[0][rank], predicted[1][rank])
        row = (f"    {rank:>4}  {_joined(stages):<6}  {_joined([view.layers[s] for s in stages]):>6}  {inflight:>9}  "
               f"{_size(stash):>10}  {_size(None if got is None else got.stash):>10}")
        if cuda:
            row += f"  {_size(None if got is None else got.allocated):>14}"
        lines.append(row)
    return "\n".join(PREFIX + line for line in lines)


def _joined(value) -> str:
    if isinstance(value, (tuple, list)):
        return "/".join(map(str, value))
    return str(value)


def _size(nbytes) -> str:
    if nbytes is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


__all__ = ["EngineView", "Measured", "block", "predicted_stash", "recomputed_layers", "view_of"]
