"""Models of nanotron `PipelineBlock`s whose blocks form a graph ([Note: block graph] in
integration/nanotron/pipeline/block_graph.py), and the workers `launch.spawn` runs them with (they
must live in an importable module). Holds no tests itself.

`diamond_worker` ports, in our own words, what nanotron's `test_pipeline_engine_diamond`
checks: at pp=4 a model whose bottom pair of blocks (Linear, ReLU) runs on rank 0, the
left pair on rank 1 and the right pair on rank 2, both reading the bottom's output, and
the top (a Bilinear of left and right, then ReLU, then a sum as the loss) on rank 3,
trained by nanotron's AFAB engine and by ours on CPU over gloo, with the adapter's gloo
P2P (`CpuP2P`) for nanotron's.

`random_worker` builds models from a spec (`model_spec`): an input block, layer blocks
each reading one to three earlier blocks (or the data directly), and a loss block reading
every block no other block reads; laid out for an engine family's placement (decoder
layers per stage given as the engine's split). Their reference is the same blocks, with
the same weights, all on one rank and run without an engine (what AFAB computes), and
nanotron's AFAB itself where it runs such a model right (`nanotron_runs`).
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist
from torch import nn

import integration.nanotron  # noqa: F401  (first: nanotron 0.4 imports once repaired; installs the patches)
from nanotron.parallel.pipeline_parallel.block import PipelineBlock
from nanotron.parallel.pipeline_parallel.engine import AllForwardAllBackwardPipelineEngine
from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer

from integration.nanotron.patches.cpu import CpuP2P
from integration.nanotron.pipeline.engine import build_engine

BATCH = 3
WIDTH = 10  # the diamond's


# -- the diamond ------------------------------------------------------------------------


class _SumLoss(nn.Module):
    def forward(self, x):
        return x.sum()


class Diamond(nn.Module):
    """bottom (rank 0) -> left (rank 1), right (rank 2) -> top (rank 3) -> loss (rank 3)."""

    def __init__(self, p2p):
        super().__init__()

        def pair(first, kwargs, keys):
            return nn.ModuleDict({
                "linear": PipelineBlock(p2p=p2p, module_builder=first, module_kwargs=kwargs, module_input_keys=keys,
                                        module_output_keys={"output"}),
                "activation": PipelineBlock(p2p=p2p, module_builder=nn.ReLU, module_kwargs={},
                                            module_input_keys={"input"}, module_output_keys={"output"}),
            })

        square = {"in_features": WIDTH, "out_features": WIDTH}
        self.bottom, self.left, self.right = (pair(nn.Linear, square, {"input"}) for _ in range(3))
        self.top = pair(nn.Bilinear, {"in1_features": WIDTH, "in2_features": WIDTH, "out_features": WIDTH},
                        {"input1", "input2"})
        self.loss = PipelineBlock(p2p=p2p, module_builder=_SumLoss, module_kwargs={}, module_input_keys={"x"},
                                  module_output_keys={"output"})

    def forward(self, x):
        x = self.bottom.activation(input=self.bottom.linear(input=x)["output"])["output"]
        left = self.left.activation(input=self.left.linear(input=x)["output"])["output"]
        right = self.right.activation(input=self.right.linear(input=x)["output"])["output"]
        top = self.top.activation(input=self.top.linear(input1=left, input2=right)["output"])["output"]
        return self.loss(x=top)["output"]

    def place(self, rank: int) -> None:
        """Blocks on their ranks, each built from its own seed (the same weights on every
        run)."""
        for seed, (pair, owner) in enumerate(((self.bottom, 0), (self.left, 1), (self.right, 2), (self.top, 3))):
            torch.manual_seed(100 + seed)
            pair.linear.build_and_set_rank(owner)
            pair.activation.build_and_set_rank(owner)
        self.loss.build_and_set_rank(3)


def diamond_batch(rank: int, m: int) -> list[dict]:
    generator = torch.Generator().manual_seed(7)
    batch = []
    for _ in range(m):
        x = torch.randn(BATCH, WIDTH, generator=generator)
        batch.append({"x": x if rank == 0 else TensorPointer(group_rank=0)})
    return batch


# -- running engines ---------------------------------------------------------------------


def grads_of(model) -> dict:
    """Every local parameter's gradient, cloned, by name (None where none arrived)."""
    return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


def zero(model) -> None:
    for p in model.parameters():
        p.grad = None


def losses_of(outputs) -> list | None:
    values = [o["loss"] for o in outputs]
    return None if isinstance(values[0], TensorPointer) else [v.detach().clone() for v in values]


def run_nanotron_afab(model, pg, p2p, batch, m) -> dict:
    outputs = AllForwardAllBackwardPipelineEngine().train_batch_iter(model, pg=pg, batch=iter(batch),
                                                                    nb_microbatches=m, grad_accumulator=None)
    p2p.wait_sends()
    out = {"losses": losses_of(outputs), "grads": grads_of(model)}
    zero(model)
    return out


def run_ours(engine_text: str, model, pg, batch, m, *, validate: bool = False) -> dict:
    """One training step of our engine (and, with `validate`, one evaluation step);
    the refusal's message where the engine refuses the model."""
    engine = build_engine(engine_text)
    try:
        outputs = engine.train_batch_iter(model, pg=pg, batch=iter(batch), nb_microbatches=m, grad_accumulator=None)
    except Exception as err:  # noqa: BLE001  (a refusal is what some tests expect)
        zero(model)
        return {"error": f"{type(err).__name__}: {err}"}
    out = {"losses": losses_of(outputs), "grads": grads_of(model), "edges": _edges_run(engine)}
    zero(model)
    if validate:
        out["eval_losses"] = losses_of(engine.validate_batch_iter(model, batch=iter(batch), nb_microbatches=m))
    return out


def _edges_run(engine) -> list:
    schedules = [runner.schedule for runner in engine._runners.values()]
    return [list(e) for e in schedules[0].edges] if schedules else []


DIAMOND_ENGINES = ("ps_afab", "ps_1f1b", "capped_1f1b", "capped_1f1b:cap=1", "capped_1f1b:cap=2", "zb_h1", "zb_h2",
                   "interleaved_1f1b:virtual=2", "zbv", "v_half", "v_min", "dualpipev")


def diamond_worker(rank: int, world: int, store, m: int) -> dict:
    """nanotron's AFAB, then each of `DIAMOND_ENGINES`, on the diamond at pp=4."""
    torch.set_num_threads(1)
    pg = dist.group.WORLD
    p2p = CpuP2P(pg)
    model = Diamond(p2p)
    model.place(rank)
    batch = diamond_batch(rank, m)
    out = {"afab": run_nanotron_afab(model, pg, p2p, batch, m)}
    for engine in DIAMOND_ENGINES:
        out[engine] = run_ours(engine, model, pg, batch, m, validate=engine == "ps_1f1b")
    return out


# -- random graphs of blocks ------------------------------------------------------------------

DATA_WIDTH = 4


class Mix(nn.Module):
    """A layer: tanh of the sum of one Linear per input (`in0`, `in1`, ...)."""

    def __init__(self, widths: tuple, width: int):
        super().__init__()
        self.inputs = nn.ModuleList(nn.Linear(w, width) for w in widths)

    def forward(self, **kwargs):
        z = sum(linear(kwargs[f"in{k}"]) for k, linear in enumerate(self.inputs))
        return torch.tanh(z)


class Embed(Mix):
    """The input block (another builder than the layers': not a decoder layer)."""


class Loss(nn.Module):
    """The loss block: the mean of the squares of its inputs, summed."""

    def __init__(self, count: int):
        super().__init__()
        self.count = count

    def forward(self, **kwargs):
        return sum((kwargs[f"in{k}"] ** 2).mean() for k in range(self.count))


class GraphModel(nn.Module):
    """Blocks of `spec["blocks"]`, each (kind, stage, inputs, width): kind "embed",
    "layer" or "loss"; inputs block indices or "x" (the data)."""

    def __init__(self, p2p, spec: dict):
        super().__init__()
        self.spec = spec
        blocks = []
        for kind, _, inputs, width in spec["blocks"]:
            keys = {f"in{k}" for k in range(len(inputs))}
            widths = tuple(DATA_WIDTH if src == "x" else spec["blocks"][src][3] for src in inputs)
            builder, kwargs = ((Loss, {"count": len(inputs)}) if kind == "loss" else
                               (Embed if kind == "embed" else Mix, {"widths": widths, "width": width}))
            blocks.append(PipelineBlock(p2p=p2p, module_builder=builder, module_kwargs=kwargs, module_input_keys=keys,
                                        module_output_keys={"out"}))
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        outputs = []
        for block, (_, _, inputs, _) in zip(self.blocks, self.spec["blocks"]):
            kwargs = {f"in{k}": x if src == "x" else outputs[src] for k, src in enumerate(inputs)}
            outputs.append(block(**kwargs)["out"])
        return outputs[-1]

    def place(self, placement) -> None:
        for j, (block, (_, stage, _, _)) in enumerate(zip(self.blocks, self.spec["blocks"])):
            torch.manual_seed(1000 + j)
            block.build_and_set_rank(placement[stage])


def random_data(m: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(BATCH, DATA_WIDTH, generator=generator) for _ in range(m)]


def nanotron_runs(spec: dict, placement) -> bool:
    """Whether nanotron's own AFAB is sure to run the model right: at most one tensor
    requiring grad per microbatch goes from any rank to any other. nanotron matches a
    gradient to the send it belongs to first in, first out, in the order its autograd
    reaches each send, which need not be the order in which the receiver's autograd
    sends them back; with several on one pair of ranks it can wait for ever (seen: a
    random graph laid out for interleaving, pp=2) or pair them wrongly."""
    ranks = [placement[stage] for _, stage, _, _ in spec["blocks"]]
    pairs = collections.Counter((ranks[src], ranks[j]) for j, (_, _, inputs, _) in enumerate(spec["blocks"])
                                for src in inputs if src != "x" and ranks[src] != ranks[j])
    return all(count <= 1 for count in pairs.values())


def run_reference(p2p, spec: dict, rank: int, data: list) -> dict:
    """The model with every block on this rank, no engine: per microbatch forward and
    backward of loss / m, gradients accumulating in microbatch order (what AFAB does)."""
    model = GraphModel(p2p, spec)
    model.place([rank] * (1 + max(stage for _, stage, _, _ in spec["blocks"])))
    losses = []
    for x in data:
        loss = model(x=x) / len(data)
        loss.backward()
        losses.append(loss.detach())
    return {"losses": losses, "grads": grads_of(model)}


def random_worker(rank: int, world: int, store, cases: list, m: int) -> list:
    """Each case (spec, placement, engines): the model in one process (every block on
    this rank), nanotron's AFAB on the model laid out by `placement` where it runs it
    right (`nanotron_runs`), then each engine; returns what each produced."""
    torch.set_num_threads(1)
    pg = dist.group.WORLD
    p2p = CpuP2P(pg)
    results = []
    for number, (spec, placement, engines) in enumerate(cases):
        data = random_data(m, seed=number)
        batch = [{"x": x if rank == 0 else TensorPointer(group_rank=0)} for x in data]
        row = {"reference": run_reference(p2p, spec, rank, data)}
        model = GraphModel(p2p, spec)
        model.place(placement)
        if nanotron_runs(spec, placement):
            row["afab"] = run_nanotron_afab(model, pg, p2p, batch, m)
        for engine in engines:
            row[engine] = run_ours(engine, model, pg, batch, m)
        results.append(row)
    return results
