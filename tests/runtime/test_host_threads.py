"""A host thread per rank ([Note: a host thread per rank] in pipeschedule/runtime/inprocess.py):
the same step as the round-robin driver, bitwise, for every family; a deadlock and a
failing rank end every thread with the error, never a hang.
"""

from __future__ import annotations

import threading

import pytest
import torch

from pipeschedule.compiler.families import FAMILIES, generate
from pipeschedule.compiler.ir import Instr
from pipeschedule.compiler.passes import lower
from pipeschedule.runtime import InProcessPipeline, ModuleStages, RuntimeScheduleError

from runtime_helpers import grads, loss_fn, make_chunks, make_data, reference

CASES = [(name, pp, m) for name in FAMILIES if name != "searched" for pp, m in ((2, 3), (4, 8))]


def _schedule(name: str, pp: int, m: int):
    virtual = FAMILIES[name].virtual
    kwargs = {"virtual": 2} if virtual is None else {}
    return lower(generate(name, pp=pp, microbatches=m, **kwargs))


def _step(schedule, threads: bool, steps: int = 2):
    chunks = make_chunks(schedule.num_stages)
    pipeline = InProcessPipeline(schedule, ModuleStages(chunks, loss_fn), threads=threads)
    inputs, targets = make_data(schedule.num_stages, schedule.microbatches)
    for _ in range(steps):
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        outputs = pipeline.step(inputs, targets)
    losses = [o["loss"] for o in outputs[schedule.placement[-1]]]
    return losses, grads(chunks, range(schedule.num_stages)), pipeline


def _no_thread_left() -> bool:
    return not any(t.name.startswith("pipeschedule-rank-") for t in threading.enumerate())


@pytest.mark.parametrize("name,pp,m", CASES, ids=[f"{n}-pp{p}-m{m}" for n, p, m in CASES])
def test_threads_step_equals_the_round_robin_step(name, pp, m):
    schedule = _schedule(name, pp, m)
    losses, grads_threads, pipeline = _step(schedule, threads=True)
    expected_losses, expected_grads, _ = _step(schedule, threads=False)
    assert losses == expected_losses and len(losses) == m
    assert grads_threads.keys() == expected_grads.keys()
    assert all(torch.equal(grads_threads[k], expected_grads[k]) for k in expected_grads)
    for executor in pipeline.executors:  # the step completed on every rank, nothing held
        assert len(executor.buffers) == 0 and executor.ledger.live_total == 0
    assert _no_thread_left()


def test_threads_step_equals_the_reference():
    schedule = _schedule("1f1b", 4, 6)
    losses, ours, _ = _step(schedule, threads=True, steps=1)
    ref_chunks = make_chunks(4)
    inputs, targets = make_data(4, 6)
    assert losses == reference(ref_chunks, inputs, targets)
    theirs = grads(ref_chunks, range(4))
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def _bounded(call, seconds: float = 60.0):
    """call()'s result or exception, or a failure if it has not returned within `seconds`
    (a hang would otherwise stop the suite)."""
    done: dict = {}

    def run():
        try:
            done["value"] = call()
        except BaseException as err:  # noqa: BLE001  (raised again below)
            done["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"the step still runs after {seconds} s: the threads hang")
    if "error" in done:
        raise done["error"]
    return done["value"]


def _without(schedule, rank: int, text: str):
    programs = [list(p) for p in schedule.programs]
    programs[rank].remove(Instr.parse(text))
    return schedule.replace_programs(programs)


def test_a_deadlock_is_reported_by_the_threads():
    schedule = _without(lower(generate("1f1b", pp=2, microbatches=2)), 0, "0SEND_F1@1")
    chunks = make_chunks(2)
    pipeline = InProcessPipeline(schedule, ModuleStages(chunks, loss_fn), threads=True)
    with pytest.raises(RuntimeScheduleError, match="every unfinished rank waits") as caught:
        _bounded(lambda: pipeline.step(*make_data(2, 2)))
    assert "rank 0, step 0" in str(caught.value) and "rank 1, step 0" in str(caught.value)
    assert _no_thread_left()
    with pytest.raises(RuntimeScheduleError, match="stopped with an error in an earlier step"):
        pipeline.step(*make_data(2, 2))


def test_a_failing_rank_stops_the_others():
    class Failing(ModuleStages):
        def forward(self, stage, mb, act_in, target):
            if stage == 2 and mb == 1:
                raise ValueError("stage 2 cannot run microbatch 1")
            return super().forward(stage, mb, act_in, target)

    schedule = lower(generate("1f1b", pp=4, microbatches=4))
    pipeline = InProcessPipeline(schedule, Failing(make_chunks(4), loss_fn), threads=True)
    with pytest.raises(RuntimeScheduleError, match="stage 2 cannot run microbatch 1") as caught:
        _bounded(lambda: pipeline.step(*make_data(4, 4)))
    assert "rank 2" in str(caught.value)
    assert _no_thread_left()
    for executor in pipeline.executors:  # every rank's step was stopped, none completed
        with pytest.raises(RuntimeScheduleError, match="stopped with an error in an earlier step"):
            executor.step(*make_data(4, 4))
