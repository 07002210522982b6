"""The one launcher (pipeschedule/runtime/launch.py) as nanotron's code sees it, and the
CPU point-to-point layer (integration/nanotron/cpu.py)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from pipeschedule.errors import LaunchError
from pipeschedule.runtime.launch import spawn


def rank_and_world(rank, world_size, store, offset):
    return rank * 10 + offset, world_size, dist.get_rank(), dist.get_backend()


def raise_on_rank_one(rank, world_size, store):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.recv(torch.zeros(1), src=1)  # would wait for ever without the harness


def sleep_unless_rank_one(rank, world_size, store):
    if rank == 1:
        raise ValueError("boom on rank 1")
    time.sleep(60)  # not blocked on rank 1: only the launcher can stop it


def wait_for_nothing(rank, world_size, store):
    dist.recv(torch.zeros(1), src=1 - rank)


def cross_sends(rank, world_size, store):
    """Both ranks send first, then receive: a deadlock with nanotron's own P2P on gloo."""
    from integration.nanotron.cpu import cpu_p2p, cpu_parallel_context

    context = cpu_parallel_context(pp=2)
    p2p = cpu_p2p(context.pp_pg)
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * rank
    tensors = [base.requires_grad_(), base.detach().t(), base.detach() > 105]  # grad flag, non-contiguous, bool
    for tensor in tensors:
        p2p.send_tensors([tensor], to_rank=1 - rank)
    received = [p2p.recv_tensors(num_tensors=1, from_rank=1 - rank)[0] for _ in tensors]
    p2p.wait_sends()
    return [(t.detach().clone(), t.requires_grad, t.is_contiguous()) for t in received], p2p.pending_sends()


def group_layout(rank, world_size, store):
    from integration.nanotron.cpu import cpu_parallel_context

    context = cpu_parallel_context(pp=2, dp=2)
    return (dist.get_process_group_ranks(context.pp_pg), dist.get_process_group_ranks(context.dp_pg),
            context.world_rank_matrix.tolist())


def test_results_come_back_in_rank_order():
    assert spawn(rank_and_world, 3, args=(5,), timeout=60) == [(5, 3, 0, "gloo"), (15, 3, 1, "gloo"), (25, 3, 2, "gloo")]


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


def test_cpu_p2p_sends_do_not_wait_for_receives():
    for rank, (received, pending) in enumerate(spawn(cross_sends, 2, timeout=60)):
        peer = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * (1 - rank)
        (a, a_grad, _), (b, b_grad, b_contiguous), (c, c_grad, _) = received
        assert torch.equal(a, peer) and a_grad
        assert torch.equal(b, peer.t()) and not b_grad and not b_contiguous
        assert torch.equal(c, peer > 105) and c.dtype == torch.bool and not c_grad
        assert pending == 0


def test_parallel_context_has_nanotron_layout():
    # nanotron reshapes ranks as (expert, pp, dp, tp): with pp=2, dp=2 ranks 0,1 are the
    # two replicas of stage 0.
    pieces = spawn(group_layout, 4, timeout=60)
    assert [p[0] for p in pieces] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [p[1] for p in pieces] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert pieces[0][2] == [[[[0], [1]], [[2], [3]]]]
