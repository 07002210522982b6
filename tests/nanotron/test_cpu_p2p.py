"""nanotron's point-to-point layer and parallel context on CPU with gloo
(integration/nanotron/patches/cpu.py), on ranks of the one launcher."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pipeschedule.runtime.launch import spawn

pytestmark = pytest.mark.spawn


def cross_sends(rank, world_size, store):
    """Both ranks send first, then receive: a deadlock with nanotron's own P2P on gloo."""
    from integration.nanotron.patches.cpu import cpu_p2p, cpu_parallel_context

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
    from integration.nanotron.patches.cpu import cpu_parallel_context

    context = cpu_parallel_context(pp=2, dp=2)
    return (dist.get_process_group_ranks(context.pp_pg), dist.get_process_group_ranks(context.dp_pg),
            context.world_rank_matrix.tolist())


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
