"""The one launcher (pipeschedule/runtime/launch.py): results in rank order, a rank's
error with its traceback, the others stopped a grace after it, a hang ended at the
deadline with the stacks, torchrun's environment in every rank."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from pipeschedule.errors import LaunchError
from pipeschedule.runtime.launch import spawn

pytestmark = pytest.mark.spawn


def rank_and_world(rank, world_size, store, offset):
    environment = tuple(int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    return rank * 10 + offset, world_size, dist.get_rank(), dist.get_backend(), environment, torch.get_num_threads()


def raise_on_rank_one(rank, world_size, store):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.recv(torch.zeros(1), src=1)  # would wait for ever without the launcher


def sleep_unless_rank_one(rank, world_size, store):
    if rank == 1:
        raise ValueError("boom on rank 1")
    time.sleep(60)  # not blocked on rank 1: only the launcher can stop it


def wait_for_nothing(rank, world_size, store):
    dist.recv(torch.zeros(1), src=1 - rank)


def test_results_come_back_in_rank_order():
    assert spawn(rank_and_world, 3, args=(5,), timeout=60) == [
        (10 * r + 5, 3, r, "gloo", (r, 3, r, 3), 1) for r in range(3)]


def test_a_child_error_is_raised_in_the_parent_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(LaunchError, match="(?s)rank 1 raised.*ValueError: boom on rank 1"):
        spawn(raise_on_rank_one, 2, timeout=60, grace=5)
    assert time.monotonic() - start < 30  # rank 0, blocked on rank 1, failed or was stopped after the grace


def test_the_others_are_stopped_a_grace_after_the_first_failure_with_their_stacks():
    start = time.monotonic()
    with pytest.raises(LaunchError, match="(?s)rank 0: Stopped: still running 3 s after rank 1 failed") as caught:
        spawn(sleep_unless_rank_one, 2, timeout=60, grace=3)
    assert time.monotonic() - start < 30
    assert "in sleep_unless_rank_one" in caught.value.failures[0].traceback
    assert caught.value.failures[1].kind == "ValueError"


def test_a_hang_ends_at_the_deadline_with_the_stacks():
    start = time.monotonic()
    with pytest.raises(LaunchError, match="(?s)rank 0: Timeout.*rank 1: Timeout.*rank 0 stacks.*in recv"):
        spawn(wait_for_nothing, 2, timeout=10)  # long enough for the children to start
    assert time.monotonic() - start < 30
