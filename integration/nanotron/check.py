"""A nanotron config checked before launch, without GPUs or processes: `pipeschedule check
CONFIG [--nproc N] [--gpu NAME]`, and the first thing `python -m integration.nanotron.train`
does on every rank.

[Note: pre-flight] `preflight` takes the steps the job would take, in its order, and stops
at the first that would fail, with one line naming the value and the fix:

    1. read        nanotron's own loader (`get_config_from_file`), with pipeschedule's
                   engine names registered: a file it cannot read, a bad `pp_engine`
                   (an unknown name gets the closest known one)
    2. world       parallelism dp * tp * pp (* expert_parallel_size) against the processes
                   started (`--nproc`; the launcher: torchrun's WORLD_SIZE), which
                   nanotron's ParallelContext would refuse with an AssertionError per rank
    3. layout      the stage and rank of each block of nanotron's Llama as the engine lays
                   it out (`PipescheduleEngine.layout`, what nanotron's build_model is hooked
                   to apply; nanotron's own cost split under its own engines): a split that
                   does not fit the model, a stage or rank left without a block, with the
                   fix that is accepted ([Note: a fix that is accepted] in pipeline/layout_fix.py)
    4. schedule    the engine's schedule for (pp, m) compiled and verified against every
                   rule, as the engine compiles it at its first step (with its OFFLOAD /
                   RELOAD where it offloads)
    5. data        the dataset and tokenizer the run reads, loaded and checked as the
                   launcher's ranks load them (`data.load`: the folder, the text column,
                   the tokenizer loads, its tokens within the model's vocab_size, the
                   sequence within max_position_embeddings); synthetic data needs none
    6. memory      (`pipeschedule check` only) per rank, the planner's prediction for this
                   engine (`pipeschedule.plan.evaluation.engine_memory`) from the config as
                   `pipeschedule plan --model-file` reads it (`plan.from_config.config_of_file`),
                   under the same assumptions as the plan ([Note: shared assumptions] in
                   pipeschedule/plan/assumptions.py: the same flags and defaults), against the
                   GPU's memory less the reserve

The model's blocks are read from numbers: nanotron's LlamaForTraining is an embedding, the
decoder layers, final norm, LM head, cast to fp32 and loss, priced as its
`get_block_compute_costs` prices them (`pipeschedule.plan.partition.llama_block_costs`);
tests/nanotron/test_nanotron_trainer.py holds the prediction to the block ranks nanotron's
trainer builds. A model config of another kind is read and its world checked, but its
layout and memory are not predicted (said in the report).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from nanotron.config import get_config_from_file  # (nanotron repaired and our names registered by the package)

from integration.nanotron.pipeline.engine import PipescheduleEngine
from integration.nanotron.pipeline.errors import LayoutError, ParameterError, PipescheduleError
from integration.nanotron.pipeline.layout import ModelLayout, layer_mask
from integration.nanotron.pipeline.layout_fix import LayoutFix, fitting_split
from integration.nanotron.progress import EngineView, NANOTRON_FAMILIES, recomputed_layers
from integration.nanotron.pipeline.split import nanotron_block_stages
from pipeschedule import compile_schedule
from pipeschedule.compiler.spec import inflight_unit, unbound_cap
from pipeschedule.plan.assumptions import Assumptions, assumption_lines
from pipeschedule.plan.candidate import Candidate
from pipeschedule.plan.config import PlanConfig
from pipeschedule.plan.from_config import config_of_file
from pipeschedule.plan.memory import GiB, ModelSpec
from pipeschedule.plan.partition import llama_block_costs
from pipeschedule.plan.evaluation import engine_memory

LLAMA_CONFIGS = ("LlamaConfig",)  # the model configs whose blocks `llama_blocks` describes


@dataclass(frozen=True)
class Preflight:
    """What `preflight` found for a config that would run.

    model: the class of the config's model config (LlamaConfig). view: the engine, its
    schedule family and parameters and the layout (progress.py's `EngineView`, as the
    first-step block shows it; None for a model whose layout is not predicted).
    block_ranks: the rank of each of the model's blocks in forward order. world: (dp, tp,
    pp, expert parallel); nproc: the processes checked against (None: not given).
    instructions: of the verified schedule. memory: the planner's `Candidate` for the
    engine (None: not predicted, and why in `notes`); plan: the PlanConfig it was
    predicted under (its GPU and budget), assumptions: the flags' [Note: shared
    assumptions]. warnings: what runs but is likely not what was meant (a cap that binds
    on no rank)."""

    config_file: str
    model: str
    view: EngineView | None
    block_ranks: tuple[int, ...]
    world: tuple[int, int, int, int]
    nproc: int | None
    instructions: int | None
    memory: Candidate | None = None
    plan: PlanConfig | None = None
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    assumptions: Assumptions = Assumptions()

    @property
    def processes(self) -> int:
        dp, tp, pp, expert = self.world
        return dp * tp * pp * expert

    def over_budget(self) -> list:
        """The ranks whose predicted memory exceeds the GPU's budget."""
        return [] if self.memory is None else [r for r in self.memory.memory if not r.fits]


def read_config(config_file: str):
    """nanotron's own reading of `config_file`: a file it cannot read (missing, not YAML, a
    value of the wrong type, a key nanotron lacks) is refused in one line that names the
    file, where nanotron's trainer would raise it from inside its constructor. Refusals of
    ours (a bad `pp_engine`) pass through as they are."""
    try:
        return get_config_from_file(config_file)
    except PipescheduleError:
        raise
    except OSError as err:
        raise PipescheduleError(f"cannot read the config file {config_file}: {err.strerror or err}") from None
    except Exception as err:  # noqa: BLE001  (yaml's, dacite's, nanotron's own checks: all say what is wrong)
        said = " ".join(str(err).split()) or "(no message)"
        raise PipescheduleError(f"nanotron cannot read the config file {config_file}: {type(err).__name__}: "
                                f"{said}") from None


def check_world(config, nproc: int | None, source: str = "--nproc") -> None:
    """Refuses a job of `nproc` processes (named `source` in the message) that the config's
    parallelism does not fill exactly; nothing when nproc is None."""
    parallelism = config.parallelism
    expert = getattr(parallelism, "expert_parallel_size", 1) or 1
    sizes = [("dp", parallelism.dp), ("tp", parallelism.tp), ("pp", parallelism.pp)]
    if expert != 1:
        sizes.append(("expert_parallel_size", expert))
    world = 1
    for _, size in sizes:
        world *= size
    if nproc is None or nproc == world:
        return
    model = world // parallelism.dp
    other = (f", or set parallelism.dp: {nproc // model} to use {nproc}" if nproc % model == 0 and nproc >= model
             else "")
    raise ParameterError(
        f"parallelism {' * '.join(name for name, _ in sizes)} = {' * '.join(str(size) for _, size in sizes)} = "
        f"{world} processes, but {source} is {nproc}: start {world} (torchrun --nproc-per-node {world} on one "
        f"node){other}")


def llama_blocks(model_config) -> tuple[list[str], list[int]]:
    """nanotron's LlamaForTraining as (block kinds, nanotron's compute cost of each) in
    forward order: the kinds stand for its module builders (the decoder layers share one,
    as `layout.layer_mask` reads them)."""
    spec = model_spec(model_config)
    costs = llama_block_costs(spec)
    layer = "decoder layer"
    kinds = ["embedding"] + [layer] * spec.layers + ["final norm", "LM head", "fp32 cast", "loss"]
    if len(kinds) != len(costs):  # llama_block_costs lists nanotron's blocks: these are their names
        raise ParameterError(f"llama_block_costs gives {len(costs)} blocks for {spec.layers} decoder layers, "
                             f"expected {len(kinds)}")
    return kinds, costs


def model_spec(model_config) -> ModelSpec:
    """The planner's description of a nanotron Llama config (the memory model's and the
    split's sizes)."""
    return ModelSpec("nanotron", layers=model_config.num_hidden_layers, hidden=model_config.hidden_size,
                     heads=model_config.num_attention_heads,
                     kv_heads=model_config.num_key_value_heads or model_config.num_attention_heads,
                     ffn=model_config.intermediate_size, vocab=model_config.vocab_size,
                     tied_embeddings=bool(getattr(model_config, "tie_word_embeddings", False)))


def engine_layout(engine, model_config, pp: int) -> ModelLayout:
    """The layout the model gets under `engine` at `pp` ranks: the engine's own
    (`PipescheduleEngine.layout`), or nanotron's cost split over pp ranks for nanotron's
    engines, refused where that leaves a rank without a block."""
    kinds, costs = llama_blocks(model_config)
    if isinstance(engine, PipescheduleEngine):
        return engine.layout(kinds, costs, pp)
    layers = layer_mask(kinds, costs)
    layout = ModelLayout(tuple(nanotron_block_stages(costs, pp)), tuple(range(pp)), tuple(layers))
    empty = sorted(set(range(pp)) - set(layout.block_stages))
    if empty:
        split = fitting_split(sum(layers), pp)
        fewer = next((p for p in range(pp - 1, 0, -1) if len(set(nanotron_block_stages(costs, p))) == p), None)
        fixes = ([LayoutFix(f"ps_{_engine_name(engine)}:split={'/'.join(map(str, split))}")] if split else []) + (
            [LayoutFix(_engine_name(engine), fewer)] if fewer else [])
        raise LayoutError(f"nanotron's cost split of {sum(layers)} decoder layers over pp = {pp} ranks leaves "
                          f"rank(s) {empty} without any block ({layout.describe()}); give "
                          f"{' or '.join(fix.text() for fix in fixes) or 'a model with more decoder layers'}")
    return layout


def engine_view(engine, layout: ModelLayout, pp: int, microbatches: int) -> EngineView:
    """What the first-step block would say of `engine` on this layout (progress.py)."""
    if isinstance(engine, PipescheduleEngine):
        spec = engine.spec
        name = spec.to_string() if getattr(engine, "auto", None) is None else (
            f"{engine.auto.to_string()} (step 1: {spec.to_string()})")
        return EngineView(name, True, engine.family.name, pp, microbatches, engine.virtual, engine.cap(pp),
                          layout.placement, tuple(layout.layers_per_stage), spec.recompute, spec.offload)
    family = NANOTRON_FAMILIES.get(type(engine).__name__)
    return EngineView(_engine_name(engine), False, family, pp, microbatches, 1, None, layout.placement,
                      tuple(layout.layers_per_stage))


def compiled(engine, view: EngineView):
    """The verified schedule the engine runs for (pp, m): the engine's own compile (with its
    OFFLOAD / RELOAD), or the schedule of nanotron's engine's family (None: an engine
    with no schedule model)."""
    if isinstance(engine, PipescheduleEngine):
        return engine.compile(pp=view.pp, microbatches=view.microbatches)
    if view.family is None:
        return None
    return compile_schedule(view.family, pp=view.pp, microbatches=view.microbatches)


def preflight(config_file: str, *, nproc: int | None = None, source: str = "--nproc",
              assumptions: Assumptions | None = None, memory: bool = True, data: bool = True,
              config=None) -> Preflight:
    """[Note: pre-flight]: the config checked step by step; raises PipescheduleError (one
    line naming the value and the fix) at the first step that would fail. `config`: what
    `read_config` gave, where the caller has read it; `data`: load and check the dataset
    and tokenizer (step 5); `memory`: predict memory (step 6) under `assumptions` (None:
    the defaults, as `pipeschedule plan`'s)."""
    assumptions = assumptions or Assumptions()
    config = read_config(config_file) if config is None else config
    check_world(config, nproc, source)
    parallelism, model_config = config.parallelism, config.model.model_config
    engine, pp = parallelism.pp_engine, parallelism.pp
    world = (parallelism.dp, parallelism.tp, pp, getattr(parallelism, "expert_parallel_size", 1) or 1)
    kind = type(model_config).__name__
    if kind not in LLAMA_CONFIGS:
        return Preflight(config_file, kind, None, (), world, nproc, None,
                         notes=(f"layout, schedule and memory not predicted: the check knows nanotron's Llama "
                                f"({', '.join(LLAMA_CONFIGS)}), not {kind}",))
    layout = engine_layout(engine, model_config, pp)
    view = engine_view(engine, layout, pp, config.tokens.batch_accumulation_per_replica)
    schedule = compiled(engine, view)
    notes, warnings = _notes(engine, view, config, assumptions, data), _warnings(engine, view)
    predicted, plan = None, None
    if memory and schedule is not None:
        predicted, plan, why = _memory(config_file, engine, view, assumptions)
        notes += (why,) if why else ()
    return Preflight(config_file, kind, view, tuple(layout.block_ranks), world, nproc,
                     None if schedule is None else sum(len(p) for p in schedule.programs), predicted, plan, notes,
                     warnings, assumptions)


def _notes(engine, view: EngineView, config, assumptions: Assumptions, data: bool) -> tuple[str, ...]:
    notes = []
    if getattr(engine, "auto", None) is not None:
        notes.append("auto chooses its engine after the first step, from what that step measures; shown: the "
                     "first step's")
    if view.offload is not None:
        notes.append(f"offload ranks {'/'.join(map(str, view.offload))}: the memory shown counts the stashes on the "
                     "host as the planner does where the GPU's host link is known (gh200, h200) and lead is 1, "
                     "else keeps every stash on the device")
    if assumptions.attention == "flash-attn" and importlib.util.find_spec("flash_attn") is None:
        notes.append("this machine has no flash-attn: a launch here runs the adapter's pure-torch stand-in "
                     "(--attention sdpa-standin prices that); the memory shown assumes flash-attn, as on the GPUs "
                     "the plan is for")
    notes.append(_data_note(config) if data else "data: not checked")
    return tuple(notes)


def _data_note(config) -> str:
    """Step 5 of [Note: pre-flight]: the run's dataset and tokenizer loaded and checked as
    the ranks load them (`data.load`, which refuses in one line); what they are."""
    from integration.nanotron import data

    if importlib.util.find_spec("datasets") is not None:
        import datasets

        datasets.disable_progress_bars()  # (a check's output is its report and its one line)
    text = data.load(config)
    if text is None:
        return "data: synthetic tokens (data.dataset: null)"
    vocab = config.model.model_config.vocab_size
    return (f"data: {text.source}, {len(text.raw)} texts, column {config.data.dataset.text_column_name!r}; tokenizer "
            f"{config.tokenizer.tokenizer_name_or_path!r}, {len(text.tokenizer)} tokens within vocab_size {vocab}")


def _warnings(engine, view: EngineView) -> tuple[str, ...]:
    """What runs but is likely not what was meant: a cap that binds on no rank."""
    spec = getattr(engine, "spec", None)
    if not isinstance(engine, PipescheduleEngine) or getattr(engine, "auto", None) is not None or spec is None:
        return ()
    unbound = unbound_cap(spec, pp=view.pp, microbatches=view.microbatches)
    return (unbound,) if unbound else ()


def _memory(config_file: str, engine, view: EngineView, assumptions: Assumptions):
    """(the planner's Candidate for the engine, its PlanConfig, None) or (None, None, why
    not): the config read as `pipeschedule plan --model-file` reads it, under `assumptions`."""
    try:
        plan = config_of_file(config_file, assumptions,
                              recompute="selective" if view.recompute == "selective" else "none")
        spec = engine.spec if isinstance(engine, PipescheduleEngine) else None
        offload = spec.offload if spec is not None and spec.lead in (None, 1) else None  # the planner's lead: 1
        return engine_memory(plan, view.name, view.family, view.cap, view.virtual, view.layers,
                             recomputed=recomputed_layers(view), offload=offload,
                             stream=None if offload is None else spec.stream), plan, None
    except PipescheduleError as err:
        return None, None, f"memory not predicted: {' '.join(str(err).split())}"


def _engine_name(engine) -> str:
    return NANOTRON_FAMILIES.get(type(engine).__name__, type(engine).__name__)


# -- the report -------------------------------------------------------------------------------------


def report(found: Preflight) -> str:
    """`pipeschedule check`'s text: what would run, the assumptions and the memory per
    rank; its last line is the verdict (`would run`) where nothing is over the GPU, else
    the report ends before the one line of the refusal (`main`)."""
    dp, tp, pp, expert = found.world
    sizes = f"dp {dp} * tp {tp} * pp {pp}" + (f" * expert {expert}" if expert != 1 else "")
    started = "" if found.nproc is None else f" (--nproc {found.nproc})"
    lines = [f"{found.config_file}:", f"  world     {sizes} = {found.processes} processes{started}"]
    view = found.view
    if view is not None:
        who = "pipeschedule" if view.ours else "nanotron's own"
        lines.append(f"  engine    {view.name} ({who}), family {view.family}" +
                     ("" if view.cap is None else f", cap {_joined(view.cap)}") +
                     ("" if view.virtual == 1 else f", virtual {view.virtual}"))
        lines.append(f"  layout    placement (rank of each stage) {_joined(view.placement)}; decoder layers per "
                     f"stage {_joined(view.layers)}")
        lines.append(f"  schedule  pp {view.pp}, m {view.microbatches} microbatches a step: " + (
            f"{found.instructions} instructions, verified against every rule" if found.instructions is not None
            else f"no schedule model of {view.name}: not compiled"))
    lines += [f"  warning   {warning}" for warning in found.warnings]
    lines += [f"  note      {note}" for note in found.notes]
    if found.memory is not None:
        lines += [f"  assumed   {line}" for line in assumption_lines(found.plan, offload=bool(view.offload))]
        lines += _memory_table(found)
    if not found.over_budget():
        lines.append(f"would run{_fits(found)}")
    return "\n".join(lines)


def _fits(found: Preflight) -> str:
    if found.memory is None:
        return ""
    peak = max(found.memory.memory, key=lambda r: r.total)
    return (f": every rank within the {found.plan.gpu_name}'s {found.plan.budget / GiB:.1f} GiB (rank {peak.rank} "
            f"the most, {_size(peak.total)})")


def _memory_table(found: Preflight) -> list[str]:
    plan = found.plan
    unit = inflight_unit(found.view.virtual if found.view is not None else 1)
    lines = [f"  memory    per rank, predicted by pipeschedule's memory model against {plan.gpu_name}: "
             f"{plan.budget / GiB:.1f} GiB after {plan.reserve / GiB:g} GiB kept back; in flight: {unit}",
             "    rank  stages  layers  in flight  activations       total  fits"]
    for rank in found.memory.memory:
        lines.append(f"    {rank.rank:>4}  {_joined(rank.stages):<6}  {_joined(rank.layers):>6}  {rank.inflight:>9}  "
                     f"{_size(rank.terms.get('activations', 0)):>11}  {_size(rank.total):>10}  "
                     + ("yes" if rank.fits else "NO"))
    return lines


def _joined(value) -> str:
    return "/".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


def main(config_file: str, *, nproc: int | None = None, assumptions: Assumptions | None = None) -> int:
    """`pipeschedule check`: the report on standard output, its last line `would run`, 0;
    or raises PipescheduleError with the one line (the command prints it and exits 2),
    after the report when only the memory does not fit the GPU."""
    found = preflight(config_file, nproc=nproc, assumptions=assumptions)
    print(report(found))
    over = found.over_budget()
    if over:
        worst = max(over, key=lambda r: r.total)
        plan = found.plan
        flags = " ".join(found.assumptions.flags())
        raise ParameterError(
            f"would not run: rank {worst.rank} needs {_size(worst.total)} (predicted), over the budget of "
            f"{plan.gpu_name}, {_size(plan.budget)} (its memory less {plan.reserve / GiB:g} GiB kept back): "
            f"see what fits with `pipeschedule plan --model-file {config_file}{' ' + flags if flags else ''}`")
    return 0


__all__ = ["Preflight", "check_world", "engine_layout", "llama_blocks", "main", "preflight", "read_config",
           "report"]
