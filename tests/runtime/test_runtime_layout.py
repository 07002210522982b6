"""Stage outputs that are not contiguous ([Note: contiguous boundaries] in executor):
every stage computes tanh(F.linear(x, W)) and returns it transposed, a view with
strides (1, n), so the shapes alternate (rows, n) -> (n, rows) from stage to stage. Run
over gloo at pp 2 and 3 (one spawn of three processes; pp 2 on a subgroup of two) and in
one process at pp 1, 2 and 3, for 1F1B, interleaved and a
V-shape placement (zbv, which also splits the backward), with and without the buffer
pool: every gradient and loss equals, bitwise, the single-process model whose stage
outputs are made contiguous. Before the boundaries were made contiguous, a same-rank
hand-off kept the transposed strides and a receive did not, and interleaved runs at pp
2 and 3 differed in the last bits.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeschedule.compiler.families import generate
from pipeschedule.compiler.passes import lower
from pipeschedule.runtime import DistTransport, Executor, InProcessPipeline, ModuleStages
from pipeschedule.runtime.launch import spawn

pytestmark = pytest.mark.spawn

INPUT = (5, 7)
M = 4


class Transposing(nn.Module):
    """tanh(F.linear(x, W)).t(): a non-contiguous view."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.linear(x, self.weight)).t()


def shapes(num_stages: int) -> list[tuple[int, int]]:
    """Input shape of every stage, and the last stage's output shape (the target's)."""
    out = [INPUT]
    for s in range(num_stages):
        out.append((6 + s % 3, out[-1][0]))
    return out


def make_chunks(num_stages: int, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    dims = shapes(num_stages)
    return [Transposing(dims[s][1], dims[s + 1][0]) for s in range(num_stages)]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def make_data(num_stages: int, m: int):
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(*INPUT, generator=generator) for _ in range(m)]
    targets = [torch.randn(*shapes(num_stages)[-1], generator=generator) for _ in range(m)]
    return inputs, targets


def reference(chunks, inputs, targets) -> list[torch.Tensor]:
    """The model in one process, microbatch by microbatch, each stage output made
    contiguous before the next stage reads it ([Note: contiguous boundaries]); the
    loss reads the last one as it is."""
    m, losses = len(inputs), []
    for mb in range(m):
        x = inputs[mb]
        for chunk in chunks[:-1]:
            x = chunk(x).contiguous()
        loss = loss_fn(chunks[-1](x), targets[mb]) / m
        loss.backward()
        losses.append(loss.detach())
    return losses


def grads(chunks, stages) -> dict[int, torch.Tensor]:
    return {s: chunks[s].weight.grad.clone() for s in stages}


def configs(pp: int) -> list[tuple[str, dict]]:
    return [
        (f"1f1b-pp{pp}", dict(name="1f1b", pp=pp, microbatches=M)),
        (f"interleaved-v2-pp{pp}", dict(name="interleaved_1f1b", pp=pp, microbatches=M, virtual=2)),
        (f"interleaved-v3-pp{pp}", dict(name="interleaved_1f1b", pp=pp, microbatches=M + 1, virtual=3)),
        (f"zbv-pp{pp}", dict(name="zbv", pp=pp, microbatches=M)),
    ]


def schedule_of(args):
    args = dict(args)
    return lower(generate(args.pop("name"), **args))


def run_reference(schedule):
    inputs, targets = make_data(schedule.num_stages, schedule.microbatches)
    chunks = make_chunks(schedule.num_stages)
    losses = reference(chunks, inputs, targets)
    return losses, grads(chunks, range(schedule.num_stages))


def layout_worker(rank: int, world: int, store) -> dict:
    torch.set_num_threads(1)
    pair = dist.new_group([0, 1])  # every rank takes part in creating it
    out = {}
    for pp, group in ((2, pair), (3, None)):
        if rank >= pp:
            continue
        for pool in (True, False):
            transport = DistTransport(store, group=group, prefix=f"layout/pp{pp}/pool{int(pool)}/")
            for label, args in configs(pp):
                schedule = schedule_of(args)
                inputs, targets = make_data(schedule.num_stages, schedule.microbatches)
                chunks = make_chunks(schedule.num_stages)
                executor = Executor(schedule, rank, ModuleStages(chunks, loss_fn), transport, timeout=30, pool=pool)
                outputs = executor.step(inputs, targets)
                losses = [o["loss"] for o in outputs] if isinstance(outputs[0], dict) else None
                out[label, pool] = {"grads": grads(chunks, schedule.stages_of(rank)), "losses": losses}
    return out


@pytest.fixture(scope="module")
def gloo_runs():
    start = time.monotonic()
    ranks = spawn(layout_worker, 3, timeout=120)
    print(f"layout: pp 2 and 3 over gloo in {time.monotonic() - start:.1f} s")
    return ranks


def test_the_stage_outputs_are_transposed_views():
    chunks = make_chunks(3)
    x = make_data(3, 1)[0][0]
    for s, chunk in enumerate(chunks):
        x = chunk(x)
        assert not x.is_contiguous() and x.stride() == (1, x.shape[0]), s
        assert x.shape == shapes(3)[s + 1]


@pytest.mark.parametrize("pp", (2, 3))
def test_gloo_gradients_equal_the_reference_at_every_placement(gloo_runs, pp):
    for label, args in configs(pp):
        schedule = schedule_of(args)
        ref_losses, ref_grads = run_reference(schedule)
        for pool in (True, False):
            for rank in range(pp):
                row = gloo_runs[rank][label, pool]
                assert row["grads"].keys() == set(schedule.stages_of(rank))
                for stage, grad in row["grads"].items():
                    assert torch.equal(grad, ref_grads[stage]), f"{label} pool={pool}: rank {rank} stage {stage}"
            losses = gloo_runs[schedule.placement[-1]][label, pool]["losses"]
            assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True)), label


@pytest.mark.parametrize("pp", (1, 2, 3))
def test_in_process_gradients_equal_the_reference_at_every_placement(pp):
    for label, args in configs(pp):
        schedule = schedule_of(args)
        ref_losses, ref_grads = run_reference(schedule)
        inputs, targets = make_data(schedule.num_stages, schedule.microbatches)
        for pool in (True, False):
            chunks = make_chunks(schedule.num_stages)
            outputs = InProcessPipeline(schedule, ModuleStages(chunks, loss_fn), pool=pool).step(inputs, targets)
            ours = grads(chunks, range(schedule.num_stages))
            for stage in range(schedule.num_stages):
                assert torch.equal(ours[stage], ref_grads[stage]), f"{label} pool={pool}: stage {stage}"
            losses = [o["loss"] for o in outputs[schedule.placement[-1]]]
            assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True)), label
