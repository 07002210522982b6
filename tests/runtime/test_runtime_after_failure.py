"""After a failed step over gloo ([Note: no retry on a failed group] in transport): a new
executor on the same process group is refused, on every rank, whatever the transport's
prefix (a retry there took the failed step's leftover messages for its own and returned
wrong losses and gradients without an error); on a new process group it computes exactly
what the plain model does. And with `pool=False` a sent stage output's storage is gone at
its FREE act_out ([Note: a finished batch holds nothing] in transport): a finished
batch used to keep it alive until the next batch was posted.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from pipeschedule.compiler.ir import Op
from pipeschedule import compile_schedule
from pipeschedule.runtime import DistTransport, Executor, InProcessPipeline, ModuleStages, RuntimeScheduleError
from pipeschedule.runtime.launch import spawn

from runtime_helpers import grads, loss_fn, make_chunks, make_data, reference

pytestmark = pytest.mark.spawn

M = 5


class _Failing(ModuleStages):
    """Raises at F of (stage 1, microbatch 2), once."""

    def forward(self, stage, mb, act_in, target):
        if (stage, mb) == (1, 2):
            raise ValueError("injected")
        return super().forward(stage, mb, act_in, target)


def retry_worker(rank: int, world: int, store) -> dict:
    schedule = compile_schedule("1f1b", pp=world, microbatches=M)
    inputs, targets = make_data(world, M)
    chunks = make_chunks(world)
    fresh = copy.deepcopy(chunks)  # the same weights, untouched by the failed step
    transport = DistTransport(store, prefix="first/")
    out = {}
    try:
        Executor(schedule, rank, _Failing(chunks, loss_fn), transport, timeout=20).step(inputs, targets)
        out["first"] = "returned"
    except RuntimeScheduleError as err:
        out["first"] = str(err).splitlines()[0]
    for label, build in (("same transport", lambda: transport),
                         ("new prefix, same group", lambda: DistTransport(store, prefix="retry/"))):
        try:
            Executor(schedule, rank, ModuleStages(fresh, loss_fn), build(), timeout=20)
            out[label] = "accepted"
        except RuntimeScheduleError as err:
            out[label] = str(err).splitlines()[0]
    group = dist.new_group(backend="gloo")
    executor = Executor(schedule, rank, ModuleStages(fresh, loss_fn), DistTransport(store, group=group, prefix="new/"),
                        timeout=20)
    outputs = executor.step(inputs, targets)
    out["losses"] = [o["loss"] for o in outputs] if rank == world - 1 else None
    out["grads"] = grads(fresh, [rank])
    return out


def test_a_failed_group_is_refused_and_a_new_group_computes_exactly():
    results = spawn(retry_worker, 2, timeout=90)
    assert results[1]["first"].startswith("rank 1, step 0") and "injected" in results[1]["first"], results[1]
    assert "another rank failed" in results[0]["first"], results[0]
    for out in results:
        assert "failed earlier" in out["same transport"], out
        assert "a step over this process group failed earlier" in out["new prefix, same group"], out
        assert "new process group" in out["new prefix, same group"]
    chunks = make_chunks(2)
    inputs, targets = make_data(2, M)
    losses = reference(chunks, inputs, targets)
    expected = grads(chunks, [0, 1])
    assert all(torch.equal(a, b) for a, b in zip(results[1]["losses"], losses))
    for out in results:
        for name, grad in out["grads"].items():
            assert torch.equal(grad, expected[name]), name


class _Watched(ModuleStages):
    """Records a weak reference to the storage of every stage output that is sent."""

    def __init__(self, chunks, loss_fn, last: int):
        super().__init__(chunks, loss_fn)
        self.last, self.storages = last, {}

    def forward(self, stage, mb, act_in, target):
        out = super().forward(stage, mb, act_in, target)
        if stage < self.last:
            self.storages[stage, mb] = StorageWeakRef(out.untyped_storage())
        return out


def _watch(executor, stages, stale: list, everyone=None) -> None:
    """After each instruction of `executor`, records the sent outputs whose storage is
    alive but which no buffer table (its own, or those of `everyone`) holds any more
    (their FREE act_out ran)."""
    ran = executor._ran

    def checked(pc, instr):
        ran(pc, instr)
        held = {(s, mb) for e in everyone or [executor] for kind, s, mb in e.buffers.held if kind == "act_out"}
        alive = {key for key, ref in stages.storages.items() if not ref.expired()}
        if alive - held:
            stale.append((str(instr), sorted(alive - held)))

    executor._ran = checked


def release_worker(rank: int, world: int, store, name: str) -> list:
    schedule = compile_schedule(name, pp=world, microbatches=4)
    stages = _Watched(make_chunks(world), loss_fn, world - 1)  # chunks end in GELU: autograd keeps no output
    executor = Executor(schedule, rank, stages, DistTransport(store), pool=False, timeout=30)
    stale: list = []
    _watch(executor, stages, stale)
    executor.step(*make_data(world, 4))
    assert any(i.op is Op.SEND_F for i in executor.program) == (rank < world - 1)
    return stale


@pytest.mark.parametrize("name", ["1f1b", "afab"])
def test_a_sent_output_is_gone_at_its_free_without_the_pool(name):
    assert spawn(release_worker, 2, timeout=60, args=(name,)) == [[], []]


@pytest.mark.parametrize("name", ["1f1b", "afab"])
def test_a_sent_output_is_gone_at_its_free_in_one_process_too(name):
    schedule = compile_schedule(name, pp=3, microbatches=4)
    stages = _Watched(make_chunks(3), loss_fn, 2)
    pipeline = InProcessPipeline(schedule, stages, pool=False)
    stale: list = []
    for executor in pipeline.executors:
        _watch(executor, stages, stale, pipeline.executors)
    pipeline.step(*make_data(3, 4))
    assert stale == []
