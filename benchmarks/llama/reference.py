"""Run nanotron's own pipeline engines (and ours) for real on the project's Llama, on CPU
with gloo, and collect results.

`run_nanotron(job)`: one process group of pp * dp ranks (spawned by the one launcher,
`pipeschedule.runtime.launch.spawn`) that performs every `Run` of the
job in turn (one spawn per group keeps the tests fast), each on a freshly built model
  ([Note: deterministic init] makes all of them start from the same weights), and
  returns per run the losses nanotron reports, the gradients by parameter name (merged
  across pp ranks, so runs with different splits compare by name), the stash
  measurements and the error if the engine refused.

Usage:

    from benchmarks.llama.reference import Job, Run, run_nanotron
    from benchmarks.llama.model import ModelConfig

    cfg = ModelConfig(hidden=32, layers=4, heads=4, kv_heads=2, ffn=64, vocab=128, seq=16)
    runs = (Run("1f1b", microbatches=4), Run("afab", microbatches=4, split=(1, 3)))
    pipelined = run_nanotron(Job(cfg, pp=2, runs=runs)).runs
    reference = run_nanotron(Job(cfg, pp=1, runs=(Run("loop", microbatches=4),))).runs[0]
    assert pipelined[0].losses.equal(reference.losses)
    assert all(pipelined[1].grads[name].equal(g) for name, g in reference.grads.items())

Engines: "1f1b" and "afab" are nanotron's `OneForwardOneBackwardPipelineEngine` and
`AllForwardAllBackwardPipelineEngine`; "loop" (pp=1 only) is the plain reference: for
each microbatch, `(model(**mb)["loss"] / m).backward()`.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field

import torch

import integration.nanotron  # noqa: F401  (first: nanotron 0.4 imports once repaired; installs the patches)
import nanotron.distributed as nanotron_dist
from nanotron.models.base import build_model
from nanotron.parallel.pipeline_parallel.engine import (
    AllForwardAllBackwardPipelineEngine,
    OneForwardOneBackwardPipelineEngine,
)
from nanotron.parallel.pipeline_parallel.state import PipelineBatchState, PipelineTrainBatchState
from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer
from torch.nn.parallel import DistributedDataParallel

from benchmarks.llama.model import ModelConfig, PipelinedLlama, block_seed, build_llama, llama_block_ranks
from integration.nanotron.patches.cpu import cpu_p2p, cpu_parallel_context
from integration.nanotron.pipeline.engine import build_engine
from integration.nanotron.pipeline.engine_spec import parse_engine
from integration.nanotron.stash import StashMeter
from pipeschedule.runtime.launch import spawn

# -- data ------------------------------------------------------------------------------


def microbatch(cfg: ModelConfig, batch_size: int, index: int, seed: int) -> dict[str, torch.Tensor]:
    """Microbatch number `index` of the data stream `seed`: the same tensors whatever pp, dp or m.

    input_ids / label_ids are a random token sequence and the same shifted by one;
    input_mask is all True; label_mask drops about one token in ten (never a whole
    microbatch), so the masked mean is exercised.
    """
    generator = torch.Generator().manual_seed(block_seed(seed, index))
    tokens = torch.randint(0, cfg.vocab, (batch_size, cfg.seq + 1), generator=generator)
    label_mask = torch.rand(batch_size, cfg.seq, generator=generator) > 0.1
    label_mask[0, 0] = True
    return {
        "input_ids": tokens[:, :-1].contiguous(),
        "input_mask": torch.ones(batch_size, cfg.seq, dtype=torch.bool),
        "label_ids": tokens[:, 1:].contiguous(),
        "label_mask": label_mask,
    }


def for_rank(batch: dict, pp_rank: int, input_pp_rank: int, output_pp_rank: int) -> dict:
    """nanotron's data-loader convention: inputs on the input rank, labels on the output
    rank, `TensorPointer`s to them everywhere else."""
    out = {}
    for key, value in batch.items():
        owner = input_pp_rank if key.startswith("input") else output_pp_rank
        out[key] = value if pp_rank == owner else TensorPointer(group_rank=owner)
    return out


# -- jobs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One training step.

    engine        "1f1b" | "afab" (nanotron's engines) | "loop" (pp=1 reference) | any
                  pipeschedule pp_engine value ("capped_1f1b:cap=2", "ps_1f1b", ...)
    microbatches  m per data-parallel replica (replica d takes stream items d*m .. d*m+m-1)
    split         decoder layers per stage; None = nanotron's cost-balanced split
    evaluate      run the engine's validate_batch_iter on the same data first; its
                  losses go to `eval_losses`
    placement     rank of each stage; None = 0..pp-1, or round-robin when split lists
                  a multiple of pp stages (interleaving: nanotron's AFAB runs it, its
                  1F1B deadlocks, see docs/training.md); with a pipeschedule engine, None =
                  the engine's placement (`engine.placement(pp)`: the V
                  shape of zbv, v_half, v_min)
    measure_stash attach a StashMeter (integration.nanotron.stash) to the model
    """

    engine: str
    microbatches: int
    split: tuple[int, ...] | None = None
    measure_stash: bool = False
    placement: tuple[int, ...] | None = None
    evaluate: bool = False  # first an evaluation step (validate_batch_iter) on the same data


@dataclass(frozen=True)
class Job:
    """A process group (pp * dp ranks, tp = 1) and the runs it performs in order.

    split_checks: entries (ModelConfig, target_pp_ranks or None); for each, build that
    model with nanotron's own `build_model` and report its block ranks next to ours
    (`llama_block_ranks` with nanotron's split). No training.
    """

    model: ModelConfig
    pp: int
    runs: tuple[Run, ...]
    dp: int = 1
    batch_size: int = 2
    data_seed: int = 1234
    split_checks: tuple = ()
    timeout: float = 120.0


@dataclass
class RunResult:
    """What one run produced, merged over the ranks.

    losses       the per-microbatch losses as nanotron returns them (loss / m), replicas
                 concatenated in dp order; None if the engine raised
    scale        m, so that losses * scale are the raw microbatch losses
    grads        parameter name -> gradient, from dp replica 0, all pp ranks merged
    dp_grad_gap  largest |difference| between any replica's gradient and replica 0's
    stash        per pp rank (replica 0): StashMeter summary, or None
    error        the first rank's traceback if the engine raised (same on every rank
                 for the refusals seen so far), else None
    block_ranks  rank of each block
    split_modes  stage -> "split" | "full" (split-backward engines: whether the stage
                 deferred its weight gradients to W), all pp ranks of replica 0
    """

    run: Run
    losses: torch.Tensor | None
    scale: int
    grads: dict[str, torch.Tensor]
    dp_grad_gap: float
    stash: list[dict] | None
    error: str | None
    block_ranks: list[int]
    leftover_state: list[str] = field(default_factory=list)
    split_modes: dict[int, str] = field(default_factory=dict)
    eval_losses: torch.Tensor | None = None


@dataclass
class JobResult:
    """`runs[i]` is the RunResult of `job.runs[i]`; `split_checks[i]` a dict with keys
    target_pp_ranks, nanotron, nanotron_output_pp_rank, ours (block ranks)."""

    runs: list[RunResult]
    split_checks: list[dict]
    seconds: float


def run_nanotron(job: Job) -> JobResult:
    """Spawn the group, perform every run and split check, merge the ranks' pieces."""
    start = time.monotonic()
    pieces = spawn(_worker, job.pp * job.dp, args=(job,), timeout=job.timeout)
    runs = [_merge(job, i, [piece["runs"][i] for piece in pieces]) for i in range(len(job.runs))]
    return JobResult(runs, pieces[0]["split_checks"], time.monotonic() - start)


def _merge(job: Job, index: int, pieces: list[dict]) -> RunResult:
    run = job.runs[index]
    replica0 = [p for p in pieces if p["dp_rank"] == 0]
    error = next((p["error"] for p in pieces if p["error"]), None)
    grads: dict[str, torch.Tensor] = {}
    for piece in replica0:
        grads.update(piece["grads"])
    gap = 0.0
    for piece in pieces:
        for name, grad in piece["grads"].items():
            if grad is not None and grads.get(name) is not None:
                gap = max(gap, (grad - grads[name]).abs().max().item())
    losses = None
    if error is None:
        holders = sorted((p for p in pieces if p["losses"] is not None), key=lambda p: p["dp_rank"])
        losses = torch.cat([torch.stack(p["losses"]) for p in holders]) if holders else None
    stash = None
    if run.measure_stash:
        stash = [p["stash"] for p in sorted(replica0, key=lambda p: p["pp_rank"])]
    leftover = sorted({item for p in pieces for item in p["leftover_state"]})
    split_modes = {s: mode for p in replica0 for s, mode in p["split_modes"].items()}
    evaluated = sorted((p for p in pieces if p.get("eval_losses") is not None), key=lambda p: p["dp_rank"])
    eval_losses = torch.cat([torch.stack(p["eval_losses"]) for p in evaluated]) if evaluated else None
    return RunResult(run, losses, run.microbatches, grads, gap, stash, error, pieces[0]["block_ranks"], leftover,
                     split_modes, eval_losses)


# -- inside each rank ------------------------------------------------------------------


def _worker(rank: int, world_size: int, store, job: Job) -> dict:
    context = cpu_parallel_context(tp=1, pp=job.pp, dp=job.dp)
    pp_rank = nanotron_dist.get_rank(context.pp_pg)
    dp_rank = nanotron_dist.get_rank(context.dp_pg)
    p2p = cpu_p2p(context.pp_pg)
    runs = [_train_once(job, run, context, p2p, pp_rank, dp_rank) for run in job.runs]
    checks = [_split_check(cfg, target, context, p2p) for cfg, target in job.split_checks]
    return {"pp_rank": pp_rank, "dp_rank": dp_rank, "runs": runs, "split_checks": checks}


def _train_once(job: Job, run: Run, context, p2p, pp_rank: int, dp_rank: int) -> dict:
    engines = {"1f1b": OneForwardOneBackwardPipelineEngine, "afab": AllForwardAllBackwardPipelineEngine}
    placement, split = run.placement, run.split
    if run.engine not in engines and run.engine != "loop":
        spec = parse_engine(run.engine)  # a pipeschedule engine (raises for unknown names)
        engines[run.engine] = lambda: build_engine(spec)
        if placement is None:
            placement = build_engine(spec).placement(job.pp)  # V shapes: the engine's placement
        if split is None:
            split = spec.split  # what nanotron's build_model does under [Note: build hook]
    if run.engine == "loop" and job.pp != 1:
        raise ValueError("the 'loop' reference runs at pp=1 only")

    leftover = clear_shared_state()  # [Note: nanotron's shared deques]
    block_ranks = llama_block_ranks(job.model, job.pp, split=split, placement=placement)
    model = build_llama(job.model, p2p, block_ranks)
    meter = StashMeter.for_model(model) if run.measure_stash else None
    model.stash_meter = meter
    wrapped = model
    if job.dp > 1:
        # nanotron's trainer also passes broadcast_buffers=False, which torch 2.13 deprecates
        # with a warning; the model has no buffers, so the default does the same.
        wrapped = DistributedDataParallel(model, process_group=context.dp_pg)
    m = run.microbatches
    # Lazily, like a data loader: a list would keep every microbatch's inputs alive.
    data = (
        for_rank(microbatch(job.model, job.batch_size, dp_rank * m + i, job.data_seed),
                 pp_rank, model.input_pp_rank, model.output_pp_rank)
        for i in range(m)
    )
    error = None
    outputs: list = []
    evaluated: list = []
    engine = None
    try:
        if run.evaluate:
            evaluated = engines[run.engine]().validate_batch_iter(
                model=wrapped, batch=(for_rank(microbatch(job.model, job.batch_size, dp_rank * m + i, job.data_seed),
                                               pp_rank, model.input_pp_rank, model.output_pp_rank) for i in range(m)),
                nb_microbatches=m)
        if run.engine == "loop":
            for batch in data:
                loss = wrapped(**batch)["loss"] / m
                loss.backward()
                outputs.append({"loss": loss.detach()})
        else:
            engine = engines[run.engine]()
            outputs = engine.train_batch_iter(
                model=wrapped, pg=context.pp_pg, batch=data, nb_microbatches=m, grad_accumulator=None
            )
        # Sends are only posted (cpu.CpuP2P); the last gradient sends of the step may still
        # wait for their receives. Finish them, as a GPU run synchronises its streams.
        p2p.wait_sends()
    except Exception:  # noqa: BLE001  (nanotron refuses some (pp, m) with an AssertionError)
        error = traceback.format_exc()
    stash = meter.finish() if meter is not None else None
    losses = [o["loss"] for o in outputs if isinstance(o["loss"], torch.Tensor)] or None
    eval_losses = [o["loss"] for o in evaluated if isinstance(o["loss"], torch.Tensor)] or None
    grads = {name: (p.grad.detach().clone() if p.grad is not None else None) for name, p in model.named_parameters()}
    split_modes = {s: r.mode for s, r in engine.split_report().items()} if hasattr(engine, "split_report") else {}
    return {
        "pp_rank": pp_rank, "dp_rank": dp_rank, "losses": losses, "grads": grads, "stash": stash,
        "error": error, "block_ranks": block_ranks, "leftover_state": leftover, "split_modes": split_modes,
        "eval_losses": eval_losses,
    }


def clear_shared_state() -> list[str]:
    """Empty nanotron's class-level queues; return the names of those that were not empty.

    [Note: nanotron's shared deques] `PipelineTrainBatchState` declares its queues as
    class attributes of a dataclass without annotations, so every instance in a process
    shares them (and `PipelineBatchState.activations_buffer`). A step that stops half
    way leaves entries that the next step in the same process would consume as its own.
    """
    leftover = []
    for owner in (PipelineBatchState, PipelineTrainBatchState):
        for name, value in list(vars(owner).items()):
            if hasattr(value, "clear") and hasattr(value, "popleft"):
                if len(value):
                    leftover.append(f"{owner.__name__}.{name}")
                value.clear()
    return leftover


def _split_check(cfg: ModelConfig, target, context, p2p) -> dict:
    model = build_model(
        model_builder=lambda: PipelinedLlama(cfg, p2p), parallel_context=context,
        dtype=torch.float32, target_pp_ranks=None if target is None else list(target), device=torch.device("cpu"),
    )
    return {
        "target_pp_ranks": target,
        "nanotron": [block.rank for block in model.pipeline_blocks()],
        "nanotron_output_pp_rank": model.output_pp_rank,
        "ours": llama_block_ranks(cfg, context.pipeline_parallel_size, placement=target),
    }
