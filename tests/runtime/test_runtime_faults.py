"""Faults over real gloo process groups: every rank must stop with an error within the
watchdog's timeout, and the parent must see an error from every rank, never a hang.
One spawn per scenario: a failed step leaves its process group unusable."""

from __future__ import annotations

import time

import pytest

from pipeschedule.errors import LaunchError
from pipeschedule.runtime.launch import spawn

from runtime_helpers import fault_worker

pytestmark = pytest.mark.spawn

TIMEOUT = 3.0


def _run(scenario: str, pp: int) -> dict:
    start = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        spawn(fault_worker, pp, timeout=60, args=(scenario, TIMEOUT))
    assert time.monotonic() - start < 45, "the parent waited far past the watchdog"
    failures = caught.value.failures
    assert sorted(failures) == list(range(pp)), str(caught.value)
    assert all(f.kind == "RuntimeScheduleError" for f in failures.values()), str(caught.value)
    times = [f.at for f in failures.values()]
    # Every rank stopped within the timeout of the first failure (plus scheduling slack).
    assert max(times) - min(times) < TIMEOUT + 1.0, str(caught.value)
    return {rank: f.message for rank, f in failures.items()}


def test_missing_receive_stops_every_rank():
    messages = _run("missing_recv", 2)
    assert "1F2 needs act_in of (stage 1, mb 2), which is not held" in messages[1]
    assert messages[1].startswith("rank 1, step 0")
    assert "another rank failed" in messages[0] and "rank 1" in messages[0]


def test_missing_send_is_caught_by_the_watchdog_everywhere():
    messages = _run("missing_send", 2)
    # Rank 0 no longer sends mb 2, so rank 1 takes mb 3's activation for it (messages
    # match in order, as over NCCL) and at the end some rank waits forever.
    timed_out = [r for r, m in messages.items() if f"timed out after {TIMEOUT:g} s" in m]
    assert timed_out, messages
    for rank, message in messages.items():
        assert "pc " in message and "last instructions run: pc" in message
        if rank not in timed_out:
            assert "another rank failed" in message or "timed out" in message


def test_failing_forward_on_one_rank_stops_every_rank():
    messages = _run("forward_raises", 3)
    assert "ValueError: injected failure in stage 1, microbatch 2" in messages[1]
    assert "(1F2)" in messages[1]
    for rank in (0, 2):
        assert "stopped because another rank failed" in messages[rank], messages[rank]
        assert "injected failure" in messages[rank]


def test_a_rank_whose_process_ends_is_named_by_the_others():
    """Rank 1's process ends in its forward without a word (killed, out of host memory, a
    crash in native code): its neighbours learn it from gloo ("Connection closed by peer")
    and name rank 1, and rank 3, no neighbour of it, stops with their message. Before,
    they quoted gloo's error alone, and rank 0 quoted rank 2's as the failure."""
    start = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        spawn(fault_worker, 4, timeout=60, args=("process_dies", TIMEOUT))
    assert time.monotonic() - start < 45, "the parent waited far past the watchdog"
    failures = caught.value.failures
    assert sorted(failures) == [0, 1, 2, 3], str(caught.value)
    assert failures[1].kind == "Died" and "code 3" in failures[1].message, str(caught.value)
    for rank in (0, 2, 3):
        assert failures[rank].kind == "RuntimeScheduleError", str(caught.value)
        assert "the transfer with rank 1 failed" in failures[rank].message, failures[rank].message
    for rank in (0, 2):  # the neighbours say so themselves, or quote the other neighbour
        assert failures[rank].message.startswith(f"rank {rank}, step 0"), failures[rank].message


def test_wrong_shape_is_named_with_the_expected_one():
    messages = _run("wrong_shape", 2)
    assert ("0SEND_F1@1 sends float32[3, 13] for microbatch 1, but rank 1 (stage 1) receives float32[3, 12]"
            in messages[0])
    assert "another rank failed" in messages[1] and "float32[3, 13]" in messages[1]
