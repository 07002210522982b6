"""The runtime run for real: one gloo process group per pp in {1, 2, 4} (spawned once,
every configuration looped inside it), compared with a single-process reference.

Bitwise equality is expected everywhere: every stage runs the same fp32 ops on the
same data as the reference, messages carry exact bytes, and every schedule here runs
the backwards of each stage in microbatch order 0..m-1, the order in which the
reference accumulates each parameter's gradient.
"""

from __future__ import annotations

import time

import pytest
import torch

from pipeschedule.compiler.ir import BUFFERS
from pipeschedule.runtime.launch import spawn

from replay import replay_high_water
from runtime_helpers import (background_send_worker, configs, exact_worker, memory_worker, schedule_of,
                             staged_send_on_a_busy_stream_worker)

pytestmark = pytest.mark.spawn

PPS = (1, 2, 4)


@pytest.fixture(scope="module", params=PPS, ids=lambda pp: f"pp{pp}")
def exact(request):
    pp = request.param
    start = time.monotonic()
    ranks = spawn(exact_worker, pp, timeout=180)
    print(f"pp={pp}: {len(configs(pp))} configurations x 2 transports in {time.monotonic() - start:.1f} s")
    return pp, ranks


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_losses_and_gradients_equal_the_reference(exact):
    pp, ranks = exact
    for label, args in configs(pp):
        schedule = schedule_of(args)
        ref = ranks[0][label]
        last = schedule.placement[-1]
        assert _equal(ranks[last][label]["losses"], ref["ref_losses"]), label
        for rank in range(pp):
            row = ranks[rank][label]
            if rank != last:
                assert row["losses"] is None, label
            assert row["grads"].keys() == {k for k in ref["ref_grads"]
                                           if int(k.split(".")[0]) in schedule.stages_of(rank)}
            for name, grad in row["grads"].items():
                assert torch.equal(grad, ref["ref_grads"][name]), f"{label}: rank {rank} {name}"


def test_in_process_equals_multi_process(exact):
    pp, ranks = exact
    for label, args in configs(pp):
        last = schedule_of(args).placement[-1]
        row0 = ranks[0][label]
        assert _equal(row0["inproc_losses"], ranks[last][label]["losses"]), label
        for rank in range(pp):
            for name, grad in ranks[rank][label]["grads"].items():
                assert torch.equal(grad, row0["inproc_grads"][name]), f"{label}: rank {rank} {name}"


def test_host_staged_transport_equals_plain_gloo(exact):
    pp, ranks = exact
    if pp > 1:
        assert all(r["staged_bytes"] > 0 for r in ranks)
    for label, _ in configs(pp):
        for rank in range(pp):
            row = ranks[rank][label]
            assert (row["staged_losses"] is None if row["losses"] is None
                    else _equal(row["staged_losses"], row["losses"]))
            assert row["staged_grads"].keys() == row["grads"].keys()
            assert all(torch.equal(row["staged_grads"][k], g) for k, g in row["grads"].items()), label


def test_ledger_is_empty_after_the_step_and_replays_exactly(exact):
    pp, ranks = exact
    for label, args in configs(pp):
        schedule = schedule_of(args)
        for rank in range(pp):
            row = ranks[rank][label]
            assert row["left"] == ({}, 0), label
            assert {kind for kind, _, _ in row["sizes"]} <= set(BUFFERS)
            assert replay_high_water(schedule, rank, row["sizes"]) == row["high_total"], f"{label} rank {rank}"


@pytest.fixture(scope="module")
def memory():
    start = time.monotonic()
    ranks = spawn(memory_worker, 4, timeout=180)
    print(f"memory: 3 schedules x 50 steps at pp=4 in {time.monotonic() - start:.1f} s")
    return ranks


def test_fifty_steps_release_everything_and_nothing_grows(memory):
    for rank, result in enumerate(memory):
        for label, run in result.items():
            per_step = run["per_step"]
            assert all(buffers == 0 and live == 0 for buffers, live, *_ in per_step), (label, rank)
            # The trace length and the high-water mark are the same every step, and the
            # tensors alive in the process (counted after steps 3 and 50) do not grow.
            assert len({row[2:4] for row in per_step}) == 1, (label, rank, per_step[:4])
            counted = [row[4] for row in per_step if row[4] is not None]
            assert len(counted) == 2 and counted[1] <= counted[0], (label, rank, counted)


def test_first_stage_stash_high_water_is_cap_microbatches(memory):
    rank0 = memory[0]
    for label, run in rank0.items():
        assert run["stash_one"] > 0
        expected = min(run["cap"], 4)  # 1f1b: pp; capped_1f1b: min(cap, pp)
        assert run["stash_high"] == expected * run["stash_one"], label
    assert rank0["1f1b{}"]["cap"] == 4 and rank0["capped_1f1b{'cap': 1}"]["cap"] == 1
    assert rank0["capped_1f1b{'cap': 2}"]["cap"] == 2


@pytest.mark.parametrize("staged", [True, False], ids=["host-staged", "gloo"])
def test_gloo_batches_wait_for_their_receives_only(staged):
    """[Note: sends in the background]: rank 0's batch [send, receive] is ready once its
    receive has arrived, while its send waits for rank 1's late receive; the send is then
    still outstanding, arrives intact (though rank 0 reuses its tensor at once), and
    nothing is left outstanding after it. Both gloo transports: host-staged and plain."""
    delay = 1.5
    results = spawn(background_send_worker, 2, timeout=60, args=(delay, staged))
    first, second = results[0], results[1]
    assert first["received"] and second["received"]
    assert first["ready_after"] < delay / 2, first
    assert first["still_sending"], first
    assert first["arrived_after"] >= delay * 0.9, first
    assert first["after"] is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_staged_send_leaves_the_host_free_while_the_stream_is_busy():
    """[Note: staged sends leave the host free]: posting a send of a tensor whose producer
    is still queued returns at once; the message carries the value written after the wait."""
    first, second = spawn(staged_send_on_a_busy_stream_worker, 2, timeout=120)
    assert second["received"]
    assert first["busy_after_post"], first  # the premise: the post returned with the producer still queued
    assert first["held"] < 0.5 * first["drained"], first  # it did not wait for the stream
    assert first["sent"] >= first["drained"] - 0.01, first  # the send went out once the copy had landed
