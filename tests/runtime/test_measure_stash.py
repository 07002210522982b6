"""The executor's stash measurement (`Executor(measure_stash=...)`,
[Note: what the ledger counts]): "first" runs the ledger's saved-tensor hooks on the
first F of each stage and input signature and charges the others the same bytes (in
later steps too while the stage's `Stages.state` is the same); "every" runs them on
every F. Both must give exact gradients, and the same ledger wherever what a stage
saves depends only on the input shapes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeschedule.compiler.families import generate
from pipeschedule.compiler.passes import lower
from pipeschedule.runtime import Executor, InProcessPipeline, InProcessWorld, ModuleStages
from pipeschedule.runtime.ledger import signature_of

from runtime_helpers import grads, loss_fn, make_data, reference, width


def sigmoid_chunks(num_stages: int, seed: int = 0) -> list[nn.Module]:
    """Each stage ends in a sigmoid, which saves its output: the stage output that the
    executor empties after the send is a saved tensor."""
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(width(s), width(s) + 4), nn.GELU(), nn.Linear(width(s) + 4, width(s + 1)),
                          nn.Sigmoid())
            for s in range(num_stages)]


def run(schedule, chunks, inputs, targets, **kwargs):
    pipeline = InProcessPipeline(schedule, ModuleStages(chunks, loss_fn), **kwargs)
    outputs = pipeline.step(inputs, targets)
    return pipeline, outputs


@pytest.mark.parametrize("name,kwargs", [("1f1b", {}), ("interleaved_1f1b", {"virtual": 2}), ("zb_h1", {}),
                                         ("capped_1f1b", {"cap": 1})])
@pytest.mark.parametrize("pool", [True, False])
def test_first_and_every_give_the_same_ledger_and_exact_gradients(name, kwargs, pool):
    schedule = lower(generate(name, pp=2, microbatches=5, **kwargs))
    inputs, targets = make_data(schedule.num_stages, 5)
    ledgers = {}
    for mode in ("first", "every"):
        chunks = sigmoid_chunks(schedule.num_stages)
        pipeline, outputs = run(schedule, chunks, inputs, targets, measure_stash=mode, pool=pool)
        expected_chunks = sigmoid_chunks(schedule.num_stages)
        expected = reference(expected_chunks, inputs, targets)
        last = schedule.placement[schedule.num_stages - 1]
        assert [o["loss"] for o in outputs[last]] == expected
        ours, theirs = grads(chunks, range(schedule.num_stages)), grads(expected_chunks, range(schedule.num_stages))
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
        ledgers[mode] = [(e.ledger.sizes, e.ledger.resized, e.ledger.high_total) for e in pipeline.executors]
        assert all(e.ledger.live_total == 0 for e in pipeline.executors)
    assert ledgers["first"] == ledgers["every"]
    # the sigmoid's saved output is counted: every stash holds at least the stage output
    sizes = ledgers["first"][0][0]
    assert all(sizes["stash", s, mb] >= sizes["act_out", s, mb] > 0 for (kind, s, mb) in sizes if kind == "act_out")


def test_a_new_input_signature_is_measured_again():
    """Microbatches of different batch sizes (one stage, so no boundary shape to agree
    on): each signature is measured, so "first" equals "every" and the sizes differ."""
    schedule = lower(generate("afab", pp=1, microbatches=3))
    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randn(b, width(0), generator=generator) for b in (2, 5, 2)]
    targets = [torch.randn(b, width(1), generator=generator) for b in (2, 5, 2)]
    sizes = {}
    for mode in ("first", "every"):
        pipeline, _ = run(schedule, sigmoid_chunks(1), inputs, targets, measure_stash=mode)
        sizes[mode] = {k: v for k, v in pipeline.executors[0].ledger.sizes.items() if k[0] == "stash"}
    assert sizes["first"] == sizes["every"]
    assert sizes["first"]["stash", 0, 0] == sizes["first"]["stash", 0, 2] != sizes["first"]["stash", 0, 1]


class SavesMoreWhenPositive(nn.Module):
    """Saves an extra tensor when its input sums above zero: what it saves depends on
    the values, not the shapes."""

    def forward(self, x):
        y = x * 2
        return y * y if x.sum() > 0 else y + 1


def test_value_dependent_stash_is_exact_only_with_every():
    schedule = lower(generate("afab", pp=1, microbatches=2))
    inputs = [torch.ones(3, 4), -torch.ones(3, 4)]
    targets = [torch.zeros(3, 4)] * 2
    sizes = {}
    for mode in ("first", "every"):
        chunk = nn.Sequential(SavesMoreWhenPositive())
        pipeline, _ = run(schedule, [chunk], [x.clone().requires_grad_() for x in inputs], targets, measure_stash=mode)
        ledger = pipeline.executors[0].ledger
        sizes[mode] = (ledger.sizes["stash", 0, 0], ledger.sizes["stash", 0, 1])
        assert ledger.live_total == 0
    # every: y*y saves y (3*4 floats, beside the loss's saved output); y+1 saves nothing of y
    assert sizes["every"][0] > sizes["every"][1]
    # first: the second microbatch has the first one's signature and is charged its bytes
    assert sizes["first"] == (sizes["every"][0], sizes["every"][0])


def test_the_measurement_starts_afresh_when_the_stage_state_changes():
    """A stage that saves more in its second step (dropout in training mode keeps a mask)
    is measured again: its training flag is part of `Stages.state`."""
    schedule = lower(generate("1f1b", pp=2, microbatches=2))
    torch.manual_seed(0)
    chunks = [nn.Sequential(nn.Linear(width(0), width(1)), nn.Dropout(0.5)), nn.Linear(width(1), width(2))]
    chunks[0].eval()
    pipeline = InProcessPipeline(schedule, ModuleStages(chunks, loss_fn), measure_stash="first")
    inputs, targets = make_data(2, 2)
    pipeline.step(inputs, targets)
    before = pipeline.executors[0].ledger.sizes["stash", 0, 1]
    chunks[0].train()
    pipeline.step(inputs, targets)
    after = pipeline.executors[0].ledger.sizes["stash", 0, 1]
    assert after > before


def test_steady_steps_measure_nothing_and_charge_the_same_bytes():
    """With the stage state unchanged, only the first step runs the hooks; the ledger of
    every later step equals the first one's and "every"'s."""
    schedule = lower(generate("1f1b", pp=2, microbatches=4))
    inputs, targets = make_data(2, 4)
    cached = InProcessPipeline(schedule, ModuleStages(sigmoid_chunks(2), loss_fn), measure_stash="first")
    every = InProcessPipeline(schedule, ModuleStages(sigmoid_chunks(2), loss_fn), measure_stash="every")
    measured = []
    for _ in range(3):
        cached.step(inputs, targets)
        measured.append([e.times.measured for e in cached.executors])
    every.step(inputs, targets)
    assert measured == [[1, 1], [0, 0], [0, 0]]
    assert [e.ledger.trace for e in cached.executors] == [e.ledger.trace for e in every.executors]


def test_freezing_a_layer_is_measured_again():
    """A frozen layer changes what the stage saves (its input is no longer needed for the
    weight gradient); requires_grad is part of `Stages.state`, so the next step measures
    again."""
    schedule = lower(generate("1f1b", pp=2, microbatches=2))
    torch.manual_seed(0)
    chunks = [nn.Sequential(nn.Linear(width(0), 6), nn.GELU(), nn.Linear(6, width(1))), nn.Linear(width(1), width(2))]
    pipeline = InProcessPipeline(schedule, ModuleStages(chunks, loss_fn))
    inputs, targets = make_data(2, 2)
    pipeline.step(inputs, targets)
    before = pipeline.executors[0].ledger.sizes["stash", 0, 0]
    chunks[0][2].requires_grad_(False)
    pipeline.step(inputs, targets)
    assert pipeline.executors[0].times.measured == 1
    frozen = pipeline.executors[0].ledger.sizes["stash", 0, 0]
    every = InProcessPipeline(schedule, ModuleStages(chunks, loss_fn), measure_stash="every")
    every.step(inputs, targets)
    assert frozen == every.executors[0].ledger.sizes["stash", 0, 0] < before


class Stateless:
    """`Stages` without `state`: what the executor cannot tell about a step."""

    def __init__(self, inner):
        self.inner = inner

    def forward(self, stage, mb, act_in, target):
        return self.inner.forward(stage, mb, act_in, target)

    def parameters(self, stage):
        return self.inner.parameters(stage)


def test_stages_without_state_are_measured_every_step():
    schedule = lower(generate("1f1b", pp=2, microbatches=3))
    pipeline = InProcessPipeline(schedule, Stateless(ModuleStages(sigmoid_chunks(2), loss_fn)))
    inputs, targets = make_data(2, 3)
    for _ in range(2):
        pipeline.step(inputs, targets)
        assert [e.times.measured for e in pipeline.executors] == [1, 1]


def test_signature_separates_shapes_dtypes_grad_mode_and_structure():
    x = torch.zeros(2, 3)
    base = signature_of((x, None))
    assert signature_of((torch.ones(2, 3), None)) == base  # values do not matter
    assert signature_of((torch.zeros(3, 2), None)) != base
    assert signature_of((x.double(), None)) != base
    assert signature_of((x.requires_grad_(), None)) != signature_of((torch.zeros(2, 3), None))
    with torch.no_grad():
        assert signature_of((torch.zeros(2, 3), None)) != base
    assert signature_of(({"a": torch.zeros(2, 3)}, None)) != signature_of(({"b": torch.zeros(2, 3)}, None))
    assert signature_of(([x, x], None)) != signature_of(([x], None))


def test_unknown_measure_stash_is_refused_with_the_accepted_values():
    schedule = lower(generate("1f1b", pp=1, microbatches=1))
    world = InProcessWorld(1)
    with pytest.raises(ValueError, match=r"measure_stash='sometimes': accepted values are 'first', 'every'"):
        Executor(schedule, 0, ModuleStages([nn.Linear(2, 2)], loss_fn), world.transport(0), measure_stash="sometimes")


def test_signature_separates_strides_and_refuses_tensors_without_strides():
    x = torch.zeros(4, 6)
    assert signature_of((x.t(), None)) != signature_of((x.t().contiguous(), None))
    nested = torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(4, 3)])
    with pytest.raises(RuntimeError):
        signature_of((nested, None))
