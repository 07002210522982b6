"""The runtime on stage graphs ([Note: stage graph] in pipeschedule/compiler/graph.py): the
model of graph_helpers.py run in process over random graphs of every family, and over
gloo, each equal to the single-process reference.

Gradients are compared exactly: each parameter gets one gradient per microbatch, each
stage runs its backwards in microbatch order, and a tensor's gradient from two consumers
is a sum of two terms (commutative, so bitwise the same in either order); with three or
more consumers of one tensor the order of the sum could differ from autograd's in the
reference, so those cases compare within 1e-6.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeschedule import ParameterError, compile_schedule
from pipeschedule.errors import RuntimeScheduleError
from pipeschedule.runtime import Executor, InProcessPipeline, InProcessWorld, ModuleStages
from pipeschedule.runtime.launch import spawn

from graph_helpers import CASES, GraphStages, graph_worker, make_data, reference
from strategies import examples, schedule_params, stage_graphs


def assert_equal(a, b, exact: bool, what: str):
    if exact:
        assert torch.equal(a, b), what
    else:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=what)


def fan_out(graph) -> int:
    return max(len(c) for c in graph.consumers)


@st.composite
def graph_runs(draw):
    family, params = draw(schedule_params(max_pp=3, max_m=4, max_v=2))
    order = compile_schedule(family, check=False, **params)
    edges = draw(stage_graphs(order.num_stages))
    return compile_schedule(family, edges=edges, **params)


@settings(max_examples=examples(40), deadline=None)
@given(graph_runs())
def test_in_process_graph_runs_equal_the_reference(schedule):
    """Every family and placement on a random graph: losses and every gradient."""
    torch.set_num_threads(1)
    edges = schedule.edges
    inputs, targets = make_data(schedule.num_stages, schedule.microbatches)
    ref = GraphStages(schedule.num_stages, edges)
    ref_losses = reference(ref, inputs, targets)
    stages = GraphStages(schedule.num_stages, edges)
    pipeline = InProcessPipeline(schedule, stages)
    outputs = pipeline.step(inputs, targets)
    exact = fan_out(schedule.graph) <= 2
    losses = [o["loss"] for o in outputs[schedule.placement[-1]]]
    for a, b in zip(losses, ref_losses, strict=True):
        assert_equal(a, b, exact, "loss")
    ours, theirs = stages.grads(range(schedule.num_stages)), ref.grads(range(schedule.num_stages))
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert_equal(ours[name], theirs[name], exact, name)
    assert all(len(e.buffers) == 0 for e in pipeline.executors)
    for executor in pipeline.executors:  # the pool served every message it could
        if executor.pool is not None:
            assert executor.pool.outstanding == dict.fromkeys(executor.pool.outstanding, 0)


def test_a_stage_that_returns_a_tensor_on_a_graph_is_told_what_to_return():
    schedule = compile_schedule("1f1b", pp=2, microbatches=1, edges=[(0, 1)])  # the chain: tensors
    diamond = compile_schedule("afab", pp=4, microbatches=1, edges=[(0, 1), (0, 2), (1, 3), (2, 3)])
    stages = GraphStages(4, diamond.edges)

    class OneTensor(GraphStages):
        def forward(self, stage, mb, act_in, target):
            out = super().forward(stage, mb, act_in, target)
            return out[1] if stage == 0 else out

    inputs, targets = make_data(4, 1)
    with pytest.raises(RuntimeScheduleError, match=r"stage 0 forward returned Tensor; .* returns one tensor per "
                                                   r"consumer stage, \{stage: tensor\} for stages \[1, 2\]"):
        InProcessPipeline(diamond, OneTensor(4, diamond.edges)).step(inputs, targets)
    with pytest.raises(ParameterError, match="ModuleStages runs chain schedules"):
        Executor(diamond, 0, ModuleStages([None] * 4, lambda y, t: y), InProcessWorld(4).transport(0))
    assert schedule.is_chain and stages.graph.edges == diamond.edges


@pytest.mark.spawn
def test_gloo_graph_runs_equal_the_reference_and_in_process():
    """Four graphs at pp=4 over gloo (the diamond under 1F1B and AFAB, skips under
    ZB-H1, a fan-out under capped 1F1B): losses and gradients equal to the reference and
    to the in-process run, nothing left held."""
    ranks = spawn(graph_worker, 4, timeout=180)
    for label, args, edges in CASES:
        schedule = compile_schedule(args["name"], **{k: v for k, v in args.items() if k != "name"}, edges=edges)
        ref, exact = ranks[0][label], fan_out(schedule.graph) <= 2
        last = schedule.placement[-1]
        for a, b in zip(ranks[last][label]["losses"], ref["ref_losses"], strict=True):
            assert_equal(a, b, exact, label)
        for rank in range(schedule.pp):
            row = ranks[rank][label]
            assert row["left"] == 0
            for name, grad in row["grads"].items():
                assert_equal(grad, ref["ref_grads"][name], exact, f"{label}: rank {rank} {name}")
                assert torch.equal(grad, ref["inproc_grads"][name]), f"{label}: rank {rank} {name}"
