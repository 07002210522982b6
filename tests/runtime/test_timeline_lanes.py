"""The measured timeline ([Note: measured timeline]) and the in-process driver's lanes
([Note: partitioned stepping]), on CPU; the partitioned pipeline itself on a CUDA GPU."""

from __future__ import annotations

import contextlib

import pytest
import torch

from pipeschedule.compiler.families import FAMILIES, generate
from pipeschedule.compiler.ir import COMPUTE_OPS
from pipeschedule.compiler.passes import lower
from pipeschedule.runtime import InProcessPipeline, ModuleStages, run_in_process
from pipeschedule.runtime.timeline import Timeline, busy_seconds

from runtime_helpers import grads, loss_fn, make_chunks, make_data, reference

FAMILY_CASES = [(name, {"virtual": 2} if FAMILIES[name].takes_virtual else {}) for name in FAMILIES]


@pytest.mark.parametrize("name,kwargs", FAMILY_CASES, ids=[c[0] for c in FAMILY_CASES])
def test_timeline_spans_every_compute_in_program_order(name, kwargs):
    schedule = lower(generate(name, pp=2, microbatches=3, **kwargs))
    inputs, targets = make_data(schedule.num_stages, 3)
    pipeline = InProcessPipeline(schedule, ModuleStages(make_chunks(schedule.num_stages), loss_fn))
    for executor in pipeline.executors:
        executor.timeline = Timeline("cpu")
    for _ in range(2):  # a second step starts the timeline afresh
        pipeline.step(inputs, targets)
    for rank, executor in enumerate(pipeline.executors):
        spans = executor.timeline.spans()
        assert [s.instr for s in spans] == [i for i in schedule.programs[rank] if i.op in COMPUTE_OPS]
        assert all(0 <= s.start <= s.end for s in spans)
        assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))  # one rank computes one thing at a time
        assert spans[-1].end <= executor.times.total_s
        # a span holds the stage's call and the executor's work around it (inputs, stash, hooks)
        assert executor.times.compute_s * 0.999 <= busy_seconds(spans) <= executor.times.total_s


def test_timeline_off_by_default_and_changes_nothing():
    schedule = lower(generate("1f1b", pp=2, microbatches=4))
    inputs, targets = make_data(schedule.num_stages, 4)
    plain_chunks, timed_chunks = make_chunks(2), make_chunks(2)
    plain = InProcessPipeline(schedule, ModuleStages(plain_chunks, loss_fn))
    timed = InProcessPipeline(schedule, ModuleStages(timed_chunks, loss_fn))
    assert all(e.timeline is None for e in plain.executors)
    for executor in timed.executors:
        executor.timeline = Timeline("cpu")
    a, b = plain.step(inputs, targets), timed.step(inputs, targets)
    assert [o["loss"] for o in a[1]] == [o["loss"] for o in b[1]]
    want, got = grads(plain_chunks, range(2)), grads(timed_chunks, range(2))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


class _LaneCheck:
    """A lane per rank that records which rank's lane is entered; the stages assert that
    every forward of stage s runs inside the lane of the rank that owns s."""

    def __init__(self, placement):
        self.placement, self.current, self.entered = placement, None, 0

    @contextlib.contextmanager
    def lane(self, rank):
        outer, self.current = self.current, rank
        self.entered += 1
        try:
            yield
        finally:
            self.current = outer


class _CheckedStages(ModuleStages):
    def __init__(self, chunks, lanes: _LaneCheck):
        super().__init__(chunks, loss_fn)
        self.lanes, self.wrong = lanes, []

    def forward(self, stage, mb, act_in, target):
        if self.lanes.current != self.lanes.placement[stage]:
            self.wrong.append((stage, mb, self.lanes.current))
        return super().forward(stage, mb, act_in, target)


@pytest.mark.parametrize("name,kwargs", [("1f1b", {}), ("interleaved_1f1b", {"virtual": 2}), ("zbv", {})])
def test_lanes_wrap_every_stretch_of_their_rank(name, kwargs):
    schedule = lower(generate(name, pp=3, microbatches=4, **kwargs))
    chunks = make_chunks(schedule.num_stages)
    inputs, targets = make_data(schedule.num_stages, 4)
    lanes = _LaneCheck(schedule.placement)
    stages = _CheckedStages(chunks, lanes)
    pipeline = InProcessPipeline(schedule, stages)
    outputs = run_in_process(pipeline.executors, inputs, targets, lane=lanes.lane)
    assert stages.wrong == [] and lanes.entered >= schedule.pp
    expected_losses = reference(make_chunks(schedule.num_stages), inputs, targets)
    last = schedule.placement[-1]
    assert [float(o["loss"]) for o in outputs[last]] == [float(x) for x in expected_losses]
    # the checker itself sees a wrong lane
    lanes.placement = [(r + 1) % schedule.pp for r in schedule.placement]
    run_in_process(InProcessPipeline(schedule, stages).executors, inputs, targets, lane=lanes.lane)
    assert stages.wrong


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("route", ["streams", "torch", "driver"])
def test_partitioned_pipeline_matches_in_process(route):
    from pipeschedule.runtime.partitioned import PartitionedPipeline, sm_partitions

    try:
        contexts, streams = sm_partitions(2, route=route)
    except Exception as err:  # a route this machine lacks (no cuda-bindings, an older torch)
        pytest.skip(f"route {route}: {err}")
    schedule = lower(generate("interleaved_1f1b", pp=2, microbatches=5, virtual=2))
    chunks = [c.cuda() for c in make_chunks(4)]
    inputs, targets = ([t.cuda() for t in ts] for ts in make_data(4, 5))
    want = InProcessPipeline(schedule, ModuleStages(chunks, loss_fn), device="cuda").step(inputs, targets)
    want_grads = grads(chunks, range(4))
    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
    got = PartitionedPipeline(schedule, ModuleStages(chunks, loss_fn), streams).step(inputs, targets)
    torch.cuda.synchronize()
    assert [float(o["loss"]) for o in got[1]] == [float(o["loss"]) for o in want[1]]
    got_grads = grads(chunks, range(4))
    for key, value in want_grads.items():
        torch.testing.assert_close(got_grads[key], value)
    del contexts
