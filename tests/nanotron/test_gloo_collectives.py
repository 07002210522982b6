"""nanotron's `all_reduce_coalesced` over gloo ([Note: nanotron over gloo]): gloo's coalesced
all-reduce takes CPU tensors only, so for CUDA tensors (ranks sharing a GPU: nanotron's
fp32-accumulation DDP hook under ZeRO-0 with dp > 1) the patch sends them through one
flat all-reduce and copies the result back, at once or at the handle's wait()."""

from __future__ import annotations

import pytest
import torch

from pipeschedule.runtime.launch import spawn

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def tensors_of(rank: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    shapes = [(3, 5), (7,), (2, 2, 2), (0,)]
    return [torch.randn(shape, generator=g).to(device) for shape in shapes]


def reduce_three_ways(rank, world_size, store, device):
    import torch.distributed as dist

    from integration.nanotron.patches import gloo

    if device == "cuda":
        torch.cuda.set_device(0)  # both ranks share the GPU
    plain = tensors_of(rank, "cpu")
    dist.all_reduce_coalesced(plain, op=dist.ReduceOp.AVG)  # gloo's own, on the host: the reference
    now = tensors_of(rank, device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    assert gloo.flat_all_reduce(now, dist.ReduceOp.AVG, None, async_op=False) is None
    if device == "cuda":  # the flat buffer is on the host: the device's peak did not move
        assert torch.cuda.max_memory_allocated() == before
    later = tensors_of(rank, device)
    handle = gloo.flat_all_reduce(later, dist.ReduceOp.AVG, None, async_op=True)
    before_wait = [t.detach().cpu().clone() for t in later]
    handle.wait()
    handle.wait()  # a second wait copies nothing again
    buckets = [tensors_of(rank, device)[:2], tensors_of(rank, device)[2:]]  # two DDP buckets, as nanotron's hook
    handles = [gloo.flat_all_reduce(bucket, dist.ReduceOp.AVG, None, async_op=True) for bucket in buckets]
    handles[-1].wait()  # nanotron's trainer waits on the last bucket's handle only
    return ([t.tolist() for t in plain], [t.cpu().tolist() for t in now], [t.cpu().tolist() for t in later],
            [t.tolist() for t in before_wait], str(later[0].device),
            [t.cpu().tolist() for bucket in buckets for t in bucket], handles[0].is_completed())


@pytest.mark.spawn
@pytest.mark.parametrize("device", DEVICES)
def test_flat_all_reduce_equals_gloos_coalesced_one(device):
    results = spawn(reduce_three_ways, 2, args=(device,), timeout=60)
    mine = [tensors_of(r, "cpu") for r in range(2)]
    expected = [((a + b) / 2).tolist() for a, b in zip(*mine)]
    for rank, (plain, now, later, before_wait, where, buckets, first_done) in enumerate(results):
        assert plain == now == later == expected
        # waiting on the last of several handles completed the earlier ones too
        assert buckets == expected and first_done
        assert torch.device(where).type == device
        # until wait() the tensors hold this rank's own values (the copy back is wait's)
        assert before_wait == [t.tolist() for t in mine[rank]]


def test_mixed_dtypes_are_refused_with_both_named():
    from integration.nanotron.patches import gloo

    with pytest.raises(ValueError, match=r"dtypes torch.bfloat16, torch.float32; one dtype is accepted"):
        gloo.flat_all_reduce([torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)], None, None, async_op=False)


def test_the_patch_routes_cuda_tensors_flat_and_cpu_tensors_to_nanotron():
    from integration.nanotron.patches import gloo

    patch = next(p for p in gloo.PATCHES if p.name.endswith("all_reduce_coalesced"))
    assert "CUDA tensors" in patch.why
    assert sum(p.name.endswith("all_reduce_coalesced") for p in gloo.PATCHES) == 1  # one rebind of the name
