"""Models of plain nanotron `PipelineBlock`s for the recompute tests (test_recompute_blocks.py).

Two parts:

- `KINDS`: module builders of every sort nanotron's `PipelineBlock` accepts (an nn.Module
  or a plain function; a bare tensor or a dict out; outputs that do not require grad,
  non-tensor values, tuples; no parameters; only inputs without grad; randomness), each
  reading and writing named entries of a running state. `BlockChain` runs a list of them
  as real PipelineBlocks in one process (a one-rank gloo group).
- `run_engines(job)`: one spawned gloo group that trains models shaped as nanotron's own
  pipeline tests (tests/test_pipeline_parallel.py in nanotron's repository: a linear and
  an activation block per rank, then a loss; the same with a tensor that does not require
  grad passed alongside) and a chain of one repeated layer builder, with pipeschedule's
  engines and nanotron's AFAB, and returns losses, gradients by parameter name and the
  ledger's stash figures of each run.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import integration.nanotron  # noqa: F401  (first: nanotron 0.4 imports once repaired; installs the patches)
from nanotron.parallel.pipeline_parallel.block import PipelineBlock
from nanotron.parallel.pipeline_parallel.engine import AllForwardAllBackwardPipelineEngine
from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer

from benchmarks.llama.reference import clear_shared_state
from integration.nanotron.patches.cpu import cpu_p2p, cpu_parallel_context
from integration.nanotron.pipeline.engine import build_engine
from pipeschedule.runtime.launch import spawn

WIDTH = 6
BATCH = 3

# -- block kinds -------------------------------------------------------------------------


class LinearWithDummyInput(nn.Linear):
    """nanotron's test block: a linear on x, y passed through untouched (no grad)."""

    def forward(self, x, y):
        return {"output": super().forward(x), "y": y}


def gate(x, y):
    return {"output": torch.sigmoid(x) * y, "y": y}


class Scaled(nn.Linear):
    """Non-tensor values in and out."""

    def forward(self, x, k):
        return {"x": super().forward(x) * k, "k": k * 0.5, "note": f"scaled by {k}"}


class Stats(nn.Module):
    """No parameters; outputs that do not require grad though computed from x."""

    def forward(self, x):
        return {"x": x * 2, "stat": x.detach().mean(), "idx": x.argmax(-1)}


class Residual(nn.Linear):
    """x used several times."""

    def forward(self, x):
        return {"x": x + torch.tanh(super().forward(x)) * x}


class FromY(nn.Linear):
    """Parameters, but every input without grad."""

    def forward(self, y, k):
        return {"w": super().forward(y) * k}


class ParamsOnly(nn.Module):
    """No tensor input at all."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(BATCH, WIDTH))

    def forward(self, k):
        return {"v": torch.tanh(self.weight) * k}


def no_grad_anywhere(y):
    return {"y": torch.relu(y) + 1}


class Pairing(nn.Linear):
    """A tuple of tensors in and out."""

    def forward(self, pair):
        return {"pair": (super().forward(pair[0]), pair[1] * 2)}


def unpair(pair, x):
    return {"x": x + pair[0] * pair[1]}


@dataclass(frozen=True)
class Kind:
    """A module builder and how a block of it is wired to the running state: `feed` maps
    the module's argument names to state keys, `out` its output keys to state keys (one
    entry when the module returns a bare tensor)."""

    name: str
    builder: Callable
    kwargs: dict
    feed: dict
    out: dict


def _kinds() -> dict[str, Kind]:
    x, xy = {"input": "x"}, {"x": "x", "y": "y"}
    kinds = [
        Kind("linear", nn.Linear, {"in_features": WIDTH, "out_features": WIDTH}, x, {"output": "x"}),
        Kind("sigmoid", nn.Sigmoid, {}, x, {"output": "x"}),  # saves its output
        Kind("identity", nn.Identity, {}, x, {"output": "x"}),  # returns its input itself
        Kind("dropout", nn.Dropout, {"p": 0.5}, x, {"output": "x"}),
        Kind("linear_dummy", LinearWithDummyInput, {"in_features": WIDTH, "out_features": WIDTH}, xy,
             {"output": "x", "y": "y"}),
        Kind("gate_function", lambda: gate, {}, xy, {"output": "x", "y": "y"}),  # a function, not a module
        Kind("scaled", Scaled, {"in_features": WIDTH, "out_features": WIDTH}, {"x": "x", "k": "k"},
             {"x": "x", "k": "k", "note": "note"}),
        Kind("stats", Stats, {}, {"x": "x"}, {"x": "x", "stat": "stat", "idx": "idx"}),
        Kind("residual", Residual, {"in_features": WIDTH, "out_features": WIDTH}, {"x": "x"}, {"x": "x"}),
        Kind("from_y", FromY, {"in_features": WIDTH, "out_features": WIDTH}, {"y": "y", "k": "k"}, {"w": "w"}),
        Kind("params_only", ParamsOnly, {}, {"k": "k"}, {"v": "v"}),
        Kind("no_grad_anywhere", lambda: no_grad_anywhere, {}, {"y": "y"}, {"y": "y"}),
        Kind("pairing", Pairing, {"in_features": WIDTH, "out_features": WIDTH}, {"pair": "pair"}, {"pair": "pair"}),
        Kind("unpair", lambda: unpair, {}, {"pair": "pair", "x": "x"}, {"x": "x"}),
    ]
    return {kind.name: kind for kind in kinds}


KINDS = _kinds()


class BlockChain(nn.Module):
    """`PipelineBlock`s of the given kinds, all on rank 0 of `p2p`'s group, run in turn on a
    state dict; `trace` gets each block's output dict."""

    def __init__(self, p2p, kinds: list[str], seed: int):
        super().__init__()
        self.kinds = [KINDS[name] for name in kinds]
        self.blocks = nn.ModuleList(
            PipelineBlock(p2p=p2p, module_builder=k.builder, module_kwargs=k.kwargs, module_input_keys=set(k.feed),
                          module_output_keys=set(k.out)) for k in self.kinds)
        for index, block in enumerate(self.blocks):
            torch.manual_seed(seed * 1000 + index)
            block.build_and_set_rank(0)

    def forward(self, state: dict, trace: list, fed: list | None = None) -> dict:
        """Runs the blocks in turn; `trace` gets each one's output dict, `fed` (if given)
        its input dict."""
        state = dict(state)
        for kind, block in zip(self.kinds, self.blocks):
            inputs = {arg: state[key] for arg, key in kind.feed.items()}
            if fed is not None:
                fed.append(inputs)
            out = block(**inputs)
            trace.append(out)
            state.update({kind.out[name]: value for name, value in out.items()})
        return state


def initial_state(seed: int, x_requires_grad: bool) -> dict:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, WIDTH, generator=generator).requires_grad_(x_requires_grad)
    y = torch.randn(BATCH, WIDTH, generator=generator)
    return {"x": x, "y": y, "k": 0.75, "pair": (x, y)}


def loss_of(state: dict) -> torch.Tensor:
    """A weighted sum of every floating tensor in the state (tuples included)."""
    total = torch.zeros(())
    for index, key in enumerate(sorted(state)):
        values = state[key] if isinstance(state[key], tuple) else (state[key],)
        for value in values:
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                total = total + (1 + index / 8) * value.sum()
    return total


# -- engines over gloo ---------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One training step: `model` one of MODELS, `engine` a pp_engine value or "afab"
    (nanotron's AllForwardAllBackward)."""

    model: str
    engine: str
    microbatches: int = 5


@dataclass(frozen=True)
class Job:
    pp: int
    runs: tuple[Run, ...]
    layers: int = 4  # of the "layers" model
    timeout: float = 240.0


class NanotronChain(nn.Module):
    """nanotron's DummyModel: per rank an nn.Linear block and an activation block (sigmoid,
    the last rank identity), then a loss block on the last rank. With `pairs`, that many
    (linear, activation) pairs, placed where the engine's layout puts them (`ranks` None)."""

    def __init__(self, p2p, pp: int, pairs: int | None = None):
        super().__init__()
        count = pp if pairs is None else pairs
        self.mlp = nn.Sequential(*(nn.ModuleDict({
            "linear": PipelineBlock(p2p=p2p, module_builder=nn.Linear,
                                    module_kwargs={"in_features": WIDTH, "out_features": WIDTH},
                                    module_input_keys={"input"}, module_output_keys={"output"}),
            "activation": PipelineBlock(p2p=p2p, module_builder=nn.Sigmoid if r < count - 1 else nn.Identity,
                                        module_kwargs={}, module_input_keys={"input"}, module_output_keys={"output"}),
        }) for r in range(count)))
        self.loss = PipelineBlock(p2p=p2p, module_builder=lambda: lambda x: x.sum(), module_kwargs={},
                                  module_input_keys={"x"}, module_output_keys={"output"})
        self.ranks = [r for r in range(pp) for _ in range(2)] + [pp - 1] if pairs is None else None

    def forward(self, x):
        for pair in self.mlp:
            x = pair.linear(input=x)["output"]
            x = pair.activation(input=x)["output"]
        return self.loss(x=x)["output"]

    @staticmethod
    def data(pp_rank: int, generator) -> dict:
        x = torch.randn(BATCH, WIDTH, generator=generator)
        return {"x": x if pp_rank == 0 else TensorPointer(group_rank=0)}


class NanotronSerialize(NanotronChain):
    """nanotron's DummyModel placed as its tests/test_serialize.py places it
    (tests/helpers/dummy.py `init_dummy_model`): the blocks in contiguous runs of
    ceil(blocks / pp) a rank, so at pp=4 its 9 blocks go 3/3/3/0 and the last rank holds
    none (nanotron trains that with AFAB)."""

    def __init__(self, p2p, pp: int, pairs: int | None = None):
        super().__init__(p2p, pp, pairs)
        blocks = 2 * (pp if pairs is None else pairs) + 1
        size = -(-blocks // pp)
        self.ranks = [index // size for index in range(blocks)] if pairs is None else None


class NanotronNoGrad(nn.Module):
    """nanotron's DummyModelPassingNonDifferentiableTensor: pp + 1 pairs of (linear with a
    passed-through input, sigmoid(x) * y), the last two pairs on the last rank, then a loss;
    asserts, as nanotron's test does, that y never requires grad and x always does (when grad
    is enabled). With
    `pairs`, that many pairs, placed where the engine's layout puts them (`ranks` None)."""

    def __init__(self, p2p, pp: int, pairs: int | None = None):
        super().__init__()
        keys = {"x", "y"}
        self.mlp = nn.Sequential(*(nn.ModuleDict({
            "linear": PipelineBlock(p2p=p2p, module_builder=LinearWithDummyInput,
                                    module_kwargs={"in_features": WIDTH, "out_features": WIDTH},
                                    module_input_keys=keys, module_output_keys={"output", "y"}),
            "activation": PipelineBlock(p2p=p2p, module_builder=lambda: gate, module_kwargs={},
                                        module_input_keys=keys, module_output_keys={"output", "y"}),
        }) for _ in range(pp + 1 if pairs is None else pairs)))
        self.loss = PipelineBlock(p2p=p2p, module_builder=lambda: lambda x: x.sum(), module_kwargs={},
                                  module_input_keys={"x"}, module_output_keys={"output"})
        self.ranks = [min(i, pp - 1) for i in range(pp + 1) for _ in range(2)] + [pp - 1] if pairs is None else None

    def forward(self, differentiable_tensor, non_differentiable_tensor):
        x, y = differentiable_tensor, non_differentiable_tensor
        for pair in self.mlp:
            out = pair.linear(x=x, y=y)
            out = pair.activation(x=out["output"], y=out["y"])
            x, y = out["output"], out["y"]
            if isinstance(x, torch.Tensor) and torch.is_grad_enabled():  # (evaluation runs it without grad)
                assert x.requires_grad is True, "x lost its grad"
            assert not isinstance(y, torch.Tensor) or y.requires_grad is False, "y requires grad"
        return self.loss(x=x)["output"]

    @staticmethod
    def data(pp_rank: int, generator) -> dict:
        x, y = torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, WIDTH, generator=generator)
        if pp_rank != 0:
            x = y = TensorPointer(group_rank=0)
        return {"differentiable_tensor": x, "non_differentiable_tensor": y}


class Layer(nn.Module):
    """One repeated builder (so every Layer block is a decoder layer), of three kinds: an
    MLP (parameters, large intermediates), a gate (no parameters, y without grad) and
    dropout; y is passed through untouched."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        if kind == "mlp":
            self.up, self.down = nn.Linear(WIDTH, 8 * WIDTH), nn.Linear(8 * WIDTH, WIDTH)

    def forward(self, x, y):
        if self.kind == "mlp":
            x = self.down(F.gelu(self.up(x)))
        elif self.kind == "gate":
            x = torch.sigmoid(x) * y
        else:
            x = F.dropout(x, p=0.3, training=True)
        return {"x": x, "y": y}


LAYER_KINDS = ("mlp", "gate", "dropout", "mlp")


class Layers(nn.Module):
    """`layers` Layer blocks (kinds cycling through LAYER_KINDS), then a loss block; the
    blocks go where the engine's layout puts them (`engine.model_layout`)."""

    def __init__(self, p2p, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(
            PipelineBlock(p2p=p2p, module_builder=Layer, module_kwargs={"kind": LAYER_KINDS[i % len(LAYER_KINDS)]},
                          module_input_keys={"x", "y"}, module_output_keys={"x", "y"}) for i in range(layers))
        self.loss = PipelineBlock(p2p=p2p, module_builder=lambda: lambda x: x.sum(), module_kwargs={},
                                  module_input_keys={"x"}, module_output_keys={"output"})
        self.ranks = None  # from the engine

    def forward(self, x, y):
        for layer in self.layers:
            out = layer(x=x, y=y)
            x, y = out["x"], out["y"]
        return self.loss(x=x)["output"]

    @staticmethod
    def data(pp_rank: int, generator) -> dict:
        x, y = torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, WIDTH, generator=generator)
        if pp_rank != 0:
            x = y = TensorPointer(group_rank=0)
        return {"x": x, "y": y}

MODELS = {"nanotron_chain": NanotronChain, "nanotron_no_grad": NanotronNoGrad, "layers": Layers}


def run_engines(job: Job) -> list[dict]:
    """Every run of `job` in one spawned group; per run the ranks' pieces merged: losses
    (rank of the loss), grads by parameter name, per rank the ledger's high stash on device
    and on host, and the first error."""
    pieces = spawn(_worker, job.pp, args=(job,), timeout=job.timeout)
    merged = []
    for index, run in enumerate(job.runs):
        parts = [p[index] for p in pieces]
        grads = {name: g for part in parts for name, g in part["grads"].items()}
        merged.append({
            "run": run,
            "error": next((p["error"] for p in parts if p["error"]), None),
            "losses": next((p["losses"] for p in parts if p["losses"] is not None), None),
            "grads": grads,
            "stash": [p["stash"] for p in parts],
            "host_stash": [p["host_stash"] for p in parts],
        })
    return merged


def _worker(rank: int, world_size: int, store, job: Job) -> list[dict]:
    context = cpu_parallel_context(pp=job.pp)
    p2p = cpu_p2p(context.pp_pg)
    return [_train(job, run, context, p2p, rank) for run in job.runs]


def _train(job: Job, run: Run, context, p2p, rank: int) -> dict:
    clear_shared_state()  # nanotron's class-level queues ([Note: nanotron's shared deques])
    cls = MODELS[run.model]
    model = cls(p2p, job.layers) if run.model == "layers" else cls(p2p, job.pp)
    engine = AllForwardAllBackwardPipelineEngine() if run.engine == "afab" else build_engine(run.engine)
    blocks = [m for m in model.modules() if isinstance(m, PipelineBlock)]
    ranks = model.ranks if model.ranks is not None else engine.model_layout(model, job.pp).block_ranks
    for index, (block, block_rank) in enumerate(zip(blocks, ranks)):
        torch.manual_seed(index)  # the same weights in every run
        block.build_and_set_rank(block_rank)
    generator = torch.Generator().manual_seed(7)
    data = [cls.data(rank, generator) for _ in range(run.microbatches)]
    error, outputs = None, []
    try:
        outputs = engine.train_batch_iter(model, pg=context.pp_pg, batch=iter(data), nb_microbatches=run.microbatches,
                                          grad_accumulator=None)
        p2p.wait_sends()
    except Exception:  # noqa: BLE001  (reported per run; the test says which)
        error = traceback.format_exc()
    losses = [o["loss"] for o in outputs if isinstance(o["loss"], torch.Tensor)] or None
    ledger = engine.training_ledger() if hasattr(engine, "training_ledger") and error is None else None
    return {
        "error": error,
        "losses": torch.stack(losses) if losses else None,
        "grads": {name: p.grad.clone() if p.grad is not None else None for name, p in model.named_parameters()},
        "stash": ledger.high["stash"] if ledger is not None else None,
        "host_stash": ledger.high_host["stash"] if ledger is not None else None,
    }
