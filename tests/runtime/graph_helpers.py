"""A model whose stages form a graph ([Note: stage graph] in pipeschedule/compiler/graph.py),
its single-process reference, and the worker `launch.spawn` runs it with (it must live in
an importable module). Holds no tests itself.

Stage s mixes its inputs, one Linear per producer summed (stage 0: one Linear of the
data), through GELU into h_s; it hands each consumer t either h_s itself (t even: the
same tensor to several consumers) or a Linear of it of the edge's own width (t odd);
the last stage's loss is the MSE of h against the target. Every edge has its own
shape, so a tensor put on the wrong edge fails. A stage with several producers leaves
some producers' tensors unused (`ignored`): their gradient is zeros, which the runtime
must send rather than nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeschedule import compile_schedule
from pipeschedule.compiler.graph import StageGraph
from pipeschedule.runtime import DistTransport, Executor, InProcessPipeline

BATCH = 3
DATA_WIDTH = 5


def hidden(stage: int) -> int:
    return 6 + stage % 3


def edge_width(s: int, t: int) -> int:
    return hidden(s) if t % 2 == 0 else 3 + (s + t) % 4


class GraphStages:
    """The runtime's `Stages` ([Note: stages protocol]) for the model above, every stage
    of it (stages other ranks run are built too, and left alone)."""

    def __init__(self, num_stages: int, edges, seed: int = 0):
        self.graph = StageGraph.of(num_stages, edges)
        torch.manual_seed(seed)
        self.mix, self.heads = [], []
        for s in range(num_stages):
            inputs = {p: edge_width(p, s) for p in self.graph.producers[s]} or {-1: DATA_WIDTH}
            self.mix.append(nn.ModuleDict({str(p): nn.Linear(w, hidden(s)) for p, w in inputs.items()}))
            self.heads.append(nn.ModuleDict({str(t): nn.Linear(hidden(s), edge_width(s, t))
                                             for t in self.graph.consumers[s] if t % 2}))

    def forward(self, stage: int, mb: int, act_in, target):
        """On the chain the runtime hands one tensor each way; on any other graph dicts."""
        if stage > 0 and self.graph.chain:
            return self._forward(stage, {stage - 1: act_in}, target)[stage + 1] if stage < self.graph.num_stages - 1 \
                else self._forward(stage, {stage - 1: act_in}, target)
        out = self._forward(stage, act_in if stage > 0 else {-1: act_in}, target)
        return out[1] if stage == 0 and self.graph.chain and self.graph.num_stages > 1 else out

    def _forward(self, stage: int, inputs: dict, target):
        z = None
        for p, x in sorted(inputs.items()):
            if len(inputs) > 1 and ignored(p, stage):  # its gradient is zeros, not silence
                continue
            term = self.mix[stage][str(p)](x)
            z = term if z is None else z + term
        h = nn.functional.gelu(z)
        if stage == self.graph.num_stages - 1:
            return nn.functional.mse_loss(h, target)
        return {t: self.heads[stage][str(t)](h) if t % 2 else h for t in self.graph.consumers[stage]}

    def parameters(self, stage: int):
        return [*self.mix[stage].parameters(), *self.heads[stage].parameters()]

    def grads(self, stages) -> dict[str, torch.Tensor]:
        out = {}
        for s in stages:
            named = [*self.mix[s].named_parameters(prefix="mix"), *self.heads[s].named_parameters(prefix="head")]
            for name, p in named:  # a parameter nothing reached has no gradient in the reference, zeros here
                out[f"{s}.{name}"] = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        return out


def ignored(producer: int, stage: int) -> bool:
    """Whether a stage with several producers leaves this one's tensor unused."""
    return (7 * producer + stage) % 5 == 0


def make_data(num_stages: int, m: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(BATCH, DATA_WIDTH, generator=generator) for _ in range(m)]
    targets = [torch.randn(BATCH, hidden(num_stages - 1), generator=generator) for _ in range(m)]
    return inputs, targets


def reference(stages: GraphStages, inputs, targets) -> list[torch.Tensor]:
    """The plain computation: per microbatch, every stage in order on its producers'
    outputs (each tensor as the producer hands it), then backward of loss / m."""
    m, last, losses = len(inputs), stages.graph.num_stages - 1, []
    for mb in range(m):
        outputs = {}
        for s in range(last + 1):
            act_in = {-1: inputs[mb]} if s == 0 else {p: outputs[p][s] for p in stages.graph.producers[s]}
            outputs[s] = stages._forward(s, act_in, targets[mb] if s == last else None)
        loss = outputs[last] / m
        loss.backward()
        losses.append(loss.detach())
    return losses


CASES = [  # (label, compile_schedule arguments, edges)
    ("1f1b-diamond", dict(name="1f1b", pp=4, microbatches=6), [(0, 1), (0, 2), (1, 3), (2, 3)]),
    ("afab-diamond", dict(name="afab", pp=4, microbatches=5), [(0, 1), (0, 2), (1, 3), (2, 3)]),
    ("zb_h1-skips", dict(name="zb_h1", pp=4, microbatches=5), [(0, 1), (0, 3), (1, 2), (1, 3), (2, 3)]),
    ("capped-fan", dict(name="capped_1f1b", pp=4, microbatches=7, cap=2), [(0, 1), (0, 2), (0, 3), (1, 2), (2, 3)]),
]


def graph_worker(rank: int, world: int, store) -> dict:
    """Each case of `CASES` over gloo; rank 0 also runs the reference and the in-process
    pipeline. Returns losses and gradients by case."""
    torch.set_num_threads(1)
    transport = DistTransport(store, prefix="graph/")
    out = {}
    for label, args, edges in CASES:
        args = dict(args)
        schedule = compile_schedule(args.pop("name"), edges=edges, **args)
        inputs, targets = make_data(schedule.num_stages, schedule.microbatches)
        stages = GraphStages(schedule.num_stages, edges)
        executor = Executor(schedule, rank, stages, transport, timeout=30)
        outputs = executor.step(inputs, targets)
        row = {"losses": [o["loss"] for o in outputs] if isinstance(outputs[0], dict) else None,
               "grads": stages.grads(schedule.stages_of(rank)), "left": len(executor.buffers)}
        if rank == 0:
            ref = GraphStages(schedule.num_stages, edges)
            row["ref_losses"] = reference(ref, inputs, targets)
            row["ref_grads"] = ref.grads(range(schedule.num_stages))
            inproc = GraphStages(schedule.num_stages, edges)
            pipeline = InProcessPipeline(schedule, inproc)
            row["inproc_losses"] = [o["loss"] for o in pipeline.step(inputs, targets)[schedule.placement[-1]]]
            row["inproc_grads"] = inproc.grads(range(schedule.num_stages))
        out[label] = row
    return out
