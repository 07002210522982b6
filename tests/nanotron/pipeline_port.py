"""What nanotron's own pipeline tests check, run over gloo with pipeschedule's engines
(test_nanotron_pipeline_port.py).

nanotron tests its engines (tests/test_pipeline_parallel.py and
tests/test_parameters_accumulate_gradient_in_fp32.py in its repository) on small models of
`PipelineBlock`s that the test places itself with `build_and_set_rank`, against a copy of
the model whose blocks all run on one rank. This module does the same in its own words,
with the models of `block_chains` (nanotron's two shapes) and every engine built through
nanotron's config path (`ParallelismArgs(pp_engine=...)`).

- `run_pipelines(job)`: one spawned gloo group (pp ranks) that performs every `Run` in turn
  on a freshly built model (the same weights and data in every run) and returns per run
  the losses, the evaluation losses, the gradients by parameter name and the first error.
- `run_tied(job)`: one spawned group of dp x pp ranks that ties the linear weights across
  the pipeline, trains through DDP with nanotron's fp32 gradient accumulator, its ZeRO
  optimizer and its DDP hook (all-reduce or reduce-scatter), and returns what the
  accumulator holds when `train_batch_iter` returns (for nanotron's own engines, once the
  all-reduce they leave in flight is done) and after nanotron's tied-gradient sync,
  beside a reference made microbatch by microbatch with nanotron's AFAB.

Models are named in `MODELS` (name -> class with `__init__(p2p, pp, pairs=None)`, a
`ranks` attribute, None where the engine places the blocks, and `data(pp_rank, generator)`);
"chain:N" asks for N pairs placed by the engine's layout.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch
from torch import nn

import integration.nanotron  # noqa: F401  (first: nanotron 0.4 imports once repaired; installs the patches)
import nanotron.distributed as nanotron_dist
from nanotron.config import ParallelismArgs
from nanotron.optim import ZeroDistributedOptimizer
from nanotron.optim.gradient_accumulator import (
    FP32GradBucketManager,
    FP32GradientAccumulator,
    get_fp32_accum_hook,
)
from nanotron.optim.named_optimizer import NamedOptimizer
from nanotron.optim.optimizer_from_gradient_accumulator import OptimizerFromGradientAccumulator
from nanotron.parallel.parameters import NanotronParameter
from nanotron.parallel.pipeline_parallel.block import PipelineBlock
from nanotron.parallel.tied_parameters import sync_tied_weights_gradients, tie_parameters
from nanotron.parallel.utils import initial_sync
from torch.nn.parallel import DistributedDataParallel

from benchmarks.llama.reference import clear_shared_state
from block_chains import NanotronChain, NanotronNoGrad, NanotronSerialize
from integration.nanotron.patches.cpu import cpu_p2p, cpu_parallel_context
from integration.nanotron.gloo import CudaToCpu
from integration.nanotron.pipeline.engine_spec import NANOTRON_ENGINES
from pipeschedule.runtime.launch import spawn

MODELS = {"chain": NanotronChain, "no_grad": NanotronNoGrad, "serialize": NanotronSerialize}
SEQUENTIAL = "sequential"  # every block on pp rank 0, one microbatch after another: the tests' reference


@dataclass(frozen=True)
class Run:
    """One training step of `model` ("chain", "no_grad": nanotron's placement; "chain:N":
    N pairs placed by the engine) under `engine` (a pp_engine value, nanotron's "afab" /
    "1f1b", or SEQUENTIAL); with `evaluate`, first `validate_batch_iter` on the same data."""

    model: str
    engine: str
    microbatches: int
    evaluate: bool = False


@dataclass(frozen=True)
class Job:
    pp: int
    runs: tuple[Run, ...]
    timeout: float = 240.0


def engine_of(value: str, pp: int, dp: int = 1):
    """The engine nanotron's config builds for `value` (its own names included)."""
    return ParallelismArgs(dp=dp, pp=pp, tp=1, pp_engine=value).pp_engine


def build(model: str, p2p, pp: int, engine, *, sequential: bool = False):
    """The model of `model`, each block built from seed = its index (the same weights
    wherever it is placed): on pp rank 0 if `sequential`, else where the model's test
    puts it or, for "name:N", where `engine`'s layout does."""
    name, _, pairs = model.partition(":")
    cls = MODELS[name]
    module = cls(p2p, pp, int(pairs)) if pairs else cls(p2p, pp)
    blocks = [m for m in module.modules() if isinstance(m, PipelineBlock)]
    if sequential:
        ranks = [0] * len(blocks)
    elif module.ranks is not None:
        ranks = module.ranks
    else:
        ranks = engine.model_layout(module, pp).block_ranks
    for index, (block, rank) in enumerate(zip(blocks, ranks)):
        torch.manual_seed(index)
        block.build_and_set_rank(rank)
    return module, cls


def batch(cls, pp_rank: int, m: int, seed: int = 7, dtype: torch.dtype = torch.float32) -> list[dict]:
    """m microbatches of the model's data as pp rank `pp_rank` sees them (tensors of
    `dtype` on the input rank, TensorPointers elsewhere); the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    return [{key: value.to(dtype) if isinstance(value, torch.Tensor) else value
             for key, value in cls.data(pp_rank, generator).items()} for _ in range(m)]


# -- training steps over gloo ----------------------------------------------------------------


def run_pipelines(job: Job) -> list[dict]:
    """Every run of `job` in one spawned group; per run the ranks' pieces merged."""
    pieces = spawn(_worker, job.pp, args=(job,), timeout=job.timeout)
    merged = []
    for index, run in enumerate(job.runs):
        parts = [p[index] for p in pieces]
        merged.append({
            "run": run,
            "error": next((p["error"] for p in parts if p["error"]), None),
            "losses": next((p["losses"] for p in parts if p["losses"] is not None), None),
            "eval_losses": next((p["eval_losses"] for p in parts if p["eval_losses"] is not None), None),
            "grads": {name: g for p in parts for name, g in p["grads"].items()},
            "no_grad": sorted(name for p in parts for name in p["no_grad"]),
            "misbuilt": sorted(name for p in parts for name in p["misbuilt"]),
            "ranks_agree": all(p["block_ranks"] == parts[0]["block_ranks"] for p in parts),
        })
    return merged


def _worker(rank: int, world_size: int, store, job: Job) -> list[dict]:
    context = cpu_parallel_context(pp=job.pp)
    p2p = cpu_p2p(context.pp_pg)
    return [_step(job, run, context, p2p, rank) for run in job.runs]


def _step(job: Job, run: Run, context, p2p, rank: int) -> dict:
    clear_shared_state()  # nanotron's class-level queues ([Note: nanotron's shared deques])
    out = {"error": None, "losses": None, "eval_losses": None, "grads": {}, "no_grad": [], "misbuilt": [],
           "block_ranks": {}}
    try:
        sequential = run.engine == SEQUENTIAL
        engine = None if sequential else engine_of(run.engine, job.pp)
        model, cls = build(run.model, p2p, job.pp, engine, sequential=sequential)
        data = batch(cls, rank, run.microbatches)
        if sequential:
            out["losses"], out["eval_losses"] = _sequential(model, data, rank, run)
        else:
            if run.evaluate:
                out["eval_losses"] = _losses(engine.validate_batch_iter(model, iter(data), run.microbatches))
            outputs = engine.train_batch_iter(model, pg=context.pp_pg, batch=iter(data),
                                              nb_microbatches=run.microbatches, grad_accumulator=None)
            out["losses"] = _losses(outputs)
        p2p.wait_sends()
    except Exception:  # noqa: BLE001  (reported per run; the test says which)
        out["error"] = traceback.format_exc()
        return out
    blocks = {name: m for name, m in model.named_modules() if isinstance(m, PipelineBlock)}
    out["block_ranks"] = {name: block.rank for name, block in blocks.items()}
    out["misbuilt"] = [name for name, block in blocks.items() if hasattr(block, "pp_block") != (block.rank == rank)]
    local = [(name, p) for name, p in model.named_parameters()]
    out["grads"] = {name: p.grad.clone() for name, p in local if p.grad is not None}
    out["no_grad"] = [name for name, p in local if p.grad is None]
    return out


def _sequential(model, data: list[dict], rank: int, run: Run):
    """The reference: on pp rank 0, each microbatch's loss / m, back-propagated in turn
    (and, first, the forward alone under no_grad: the evaluation reference)."""
    if rank != 0:
        return None, None
    m = run.microbatches
    with torch.no_grad():
        evaluated = torch.stack([model(**micro) / m for micro in data])
    losses = []
    for micro in data:
        loss = model(**micro) / m
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses), evaluated


def _losses(outputs) -> torch.Tensor | None:
    held = [o["loss"] for o in outputs if isinstance(o["loss"], torch.Tensor)]
    return torch.stack(held) if held else None


# -- tied weights, fp32 accumulation, ZeRO, DDP -----------------------------------------------


@dataclass(frozen=True)
class TiedRun:
    """`engine` trains `model` (as in `Run`) of dtype `dtype` under DDP with the
    accumulator and ZeRO; nanotron's DDP hook reduce-scatters if `reduce_scatter`."""

    model: str
    engine: str
    reduce_scatter: bool
    dtype: str = "float16"
    microbatches: int = 2


@dataclass(frozen=True)
class TiedJob:
    pp: int
    dp: int
    runs: tuple[TiedRun, ...]
    timeout: float = 240.0


def run_tied(job: TiedJob) -> list[list[dict]]:
    """Per run, every rank's record (see `_tied_step`), in world-rank order."""
    pieces = spawn(_tied_worker, job.pp * job.dp, args=(job,), timeout=job.timeout)
    return [[piece[index] for piece in pieces] for index in range(len(job.runs))]


def _tied_worker(rank: int, world_size: int, store, job: TiedJob) -> list[dict]:
    context = cpu_parallel_context(pp=job.pp, dp=job.dp)
    p2p = cpu_p2p(context.pp_pg)
    with CudaToCpu():  # nanotron's accumulator and ZeRO put their buffers on "cuda"
        return [_tied_step(job, run, context, p2p) for run in job.runs]


def _tied_model(run: TiedRun, p2p, context, engine):
    """The model with every linear weight tied across the pipeline (one parameter where
    two uses share a rank), biases as nanotron parameters, replicas synced as nanotron does."""
    dtype = getattr(torch, run.dtype)
    model, cls = build(run.model, p2p, context.pipeline_parallel_size, engine)
    model.to(dtype)
    blocks = {name: m for name, m in model.named_modules() if isinstance(m, PipelineBlock)}
    linears = [name for name, block in blocks.items() if block.module_builder is _linear_builder(model)]
    ties = [(f"{name}.pp_block.weight", (_world_rank(context, blocks[name].rank),)) for name in linears]
    tie_parameters(root_module=model, ties=ties, parallel_context=context, reduce_op=nanotron_dist.ReduceOp.SUM)
    for module in model.modules():
        if isinstance(module, nn.Linear) and not isinstance(module.bias, NanotronParameter):
            module.bias = NanotronParameter(module.bias)
    with torch.no_grad():  # in-place collectives on parameters: autograd sees gloo's writes
        initial_sync(model=model, parallel_context=context)
    return model, cls


def _linear_builder(model):
    return model.mlp[0].linear.module_builder


def _world_rank(context, pp_rank: int) -> int:
    coordinates = (nanotron_dist.get_rank(context.expert_pg), pp_rank, nanotron_dist.get_rank(context.dp_pg),
                   nanotron_dist.get_rank(context.tp_pg))
    return int(context.world_rank_matrix[coordinates])


def _names(model) -> dict[int, str]:
    """Parameter id -> the name the accumulator knows it by (a tied one's full tied name)."""
    prefixes = {id(module): f"{name}." if name else "" for name, module in model.named_modules()}
    return {id(p): p.get_tied_info().get_full_name_from_module_id_to_prefix(module_id_to_prefix=prefixes)
            if p.is_tied else name for name, p in model.named_parameters()}


def _tied_step(job: TiedJob, run: TiedRun, context, p2p) -> dict:
    clear_shared_state()
    out = {"error": None}
    try:
        out.update(_tied_train(run, context, p2p))
        p2p.wait_sends()
    except Exception:  # noqa: BLE001
        out["error"] = traceback.format_exc()
    return out


def _tied_train(run: TiedRun, context, p2p) -> dict:
    pp_rank, dp_rank = nanotron_dist.get_rank(context.pp_pg), nanotron_dist.get_rank(context.dp_pg)
    engine = engine_of(run.engine, context.pipeline_parallel_size, context.data_parallel_size)
    m = run.microbatches
    reference = _tied_reference(run, context, p2p, engine, pp_rank, dp_rank)

    model, cls = _tied_model(run, p2p, context, engine)
    names = _names(model)
    named = [(names[id(p)], p) for _, p in model.named_parameters()]
    ddp = DistributedDataParallel(model, process_group=context.dp_pg)
    optimizer = ZeroDistributedOptimizer(
        dp_pg=context.dp_pg, named_params_or_groups=named,
        optimizer_builder=lambda groups: OptimizerFromGradientAccumulator(
            gradient_accumulator_builder=lambda params: FP32GradientAccumulator(
                named_parameters=params, grad_buckets_named_params=named),
            named_params_or_groups=groups,
            optimizer_builder=lambda inner: NamedOptimizer(named_params_or_groups=inner,
                                                           optimizer_builder=lambda p: torch.optim.AdamW(p))))
    accumulator = optimizer.optimizer.gradient_accumulator
    accumulator.assign_param_offsets(dp_rank=dp_rank, param_name_to_offsets=optimizer.param_name_to_dp_rank_offsets)
    ddp.register_comm_hook(state=FP32GradBucketManager(dp_pg=context.dp_pg, accumulator=accumulator,
                                                       param_id_to_name=names),
                           hook=get_fp32_accum_hook(reduce_scatter=run.reduce_scatter,
                                                    reduce_op=nanotron_dist.ReduceOp.AVG))
    data = batch(cls, pp_rank, m, seed=7 + dp_rank, dtype=getattr(torch, run.dtype))
    engine.train_batch_iter(ddp, pg=context.pp_pg, batch=iter(data), nb_microbatches=m, grad_accumulator=accumulator)
    handle = accumulator.fp32_grads_allreduce_handle
    pending = handle is not None and not (handle.done() if hasattr(handle, "done") else handle.is_completed())
    if pending and run.engine in NANOTRON_ENGINES:
        # nanotron's engines leave the DDP hook's all-reduce in flight; its trainer waits on
        # it (on a GPU the stream orders any later read after it; over gloo nothing does)
        handle.wait()
    returned = {name: accumulator.get_grad_buffer(name=name).clone() for name in accumulator.fp32_grad_buffers}
    sync_tied_weights_gradients(module=model, parallel_context=context, grad_accumulator=accumulator)
    tied_synced = {name: accumulator.get_grad_buffer(name=name).clone() for name in accumulator.fp32_grad_buffers}
    views = {}
    for name in accumulator.fp32_grad_buffers:  # the optimizer's fp32 grad is this replica's slice of the buffer
        start, _ = accumulator.param_name_to_offsets[name]
        view, flat = accumulator.parameters[name]["fp32"].grad, accumulator.get_grad_buffer(name).view(-1)
        views[name] = view is not None and view.data_ptr() == flat[start:].data_ptr()
    return {
        "pp_rank": pp_rank, "dp_rank": dp_rank, "returned": returned, "pending": pending, "tied_synced": tied_synced,
        "offsets": dict(accumulator.param_name_to_offsets), "reference": reference, "views": views,
        "tied": sorted({names[id(p)] for p in model.parameters() if p.is_tied}),
    }


def _tied_reference(run: TiedRun, context, p2p, engine, pp_rank: int, dp_rank: int) -> dict:
    """nanotron's AFAB, one microbatch per step, no accumulator: each parameter's gradient
    summed in fp32 over the microbatches, averaged over the replicas; and that summed over
    the ranks sharing a tied weight (what the tied sync must give). Not divided by m: each
    reference step is a whole step of one microbatch."""
    afab = engine_of("afab", context.pipeline_parallel_size, context.data_parallel_size)
    model, cls = _tied_model(run, p2p, context, engine)
    names = _names(model)
    total: dict[str, torch.Tensor] = {}
    for micro in batch(cls, pp_rank, run.microbatches, seed=7 + dp_rank, dtype=getattr(torch, run.dtype)):
        clear_shared_state()
        afab.train_batch_iter(model, pg=context.pp_pg, batch=[micro], nb_microbatches=1, grad_accumulator=None)
        p2p.wait_sends()
        for p in model.parameters():
            name = names[id(p)]
            total[name] = p.grad.float() if name not in total else total[name] + p.grad.float()
        model.zero_grad()
    for name in sorted(total):
        nanotron_dist.all_reduce(total[name], group=context.dp_pg, op=nanotron_dist.ReduceOp.AVG)
    summed = {name: grad.clone() for name, grad in total.items()}
    for p in model.parameters():
        if p.is_tied:
            group = context.world_ranks_to_pg[p.get_tied_info().global_ranks]
            nanotron_dist.all_reduce(summed[names[id(p)]], group=group, op=nanotron_dist.ReduceOp.SUM)
    return {"averaged": total, "tied_summed": summed}
