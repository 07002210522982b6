"""`HostStagedP2P` (integration/nanotron/patches/cpu.py, [Note: host-staged P2P]) on real gloo ranks.

On this CPU machine its device is "cpu", so staging is a plain copy; where CUDA is
present the unit test also runs with both ranks on cuda:0, as the one-GPU benchmarks do.
"""

from __future__ import annotations

import pytest
import torch

from pipeschedule.runtime.launch import spawn
from benchmarks.llama.model import ModelConfig

pytestmark = pytest.mark.spawn

CFG = ModelConfig(hidden=32, layers=4, heads=4, kv_heads=2, ffn=64, vocab=128, seq=16, seed=7)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def sent_tensors(rank: int, device: str) -> list[torch.Tensor]:
    """Tensors of every layout nanotron's wire format describes, different on each rank."""
    base = torch.arange(24, dtype=torch.float32, device=device).reshape(4, 6) + 100 * rank
    return [
        base.clone().requires_grad_(),  # an activation
        base.t(),  # not contiguous: its whole storage travels
        base[1:3],  # contiguous, with a storage offset and a larger storage
        (base > 110).to(torch.bool),
        base.to(torch.bfloat16).unsqueeze(1),  # a size-1 dimension
    ]


def layout(tensor: torch.Tensor) -> dict:
    return {"dtype": tensor.dtype, "shape": tuple(tensor.shape), "stride": tensor.stride(),
            "storage_offset": tensor.storage_offset(), "storage_bytes": tensor.untyped_storage().nbytes(),
            "requires_grad": tensor.requires_grad, "is_leaf": tensor.is_leaf, "device": str(tensor.device)}


def exchange(rank, world_size, store, device):
    """Both ranks send every tensor twice, then receive each once with nanotron's own
    receive (`CpuP2P`'s is nanotron's) and once with `HostStagedP2P`'s."""
    from integration.nanotron.patches.cpu import CpuP2P, HostStagedP2P, cpu_parallel_context

    if device == "cuda":
        device = torch.device("cuda", 0)  # both ranks share the GPU
        torch.cuda.set_device(device)
    context = cpu_parallel_context(pp=2)
    staged = HostStagedP2P(context.pp_pg, device=device)
    theirs = CpuP2P(context.pp_pg, device="cpu")
    peer = 1 - rank
    for tensor in sent_tensors(rank, device):
        staged.send_tensors([tensor], to_rank=peer)
        staged.send_tensors([tensor], to_rank=peer)  # both before any receive: sends must not wait
    out = []
    for _ in sent_tensors(rank, device):
        (reference,) = theirs.recv_tensors(num_tensors=1, from_rank=peer)
        (received,) = staged.recv_tensors(num_tensors=1, from_rank=peer)
        out.append((layout(reference), layout(received), received.detach().cpu().clone()))
    staged.wait_sends()
    return out, str(staged.device), staged.first_metadata.device.type, staged.second_metadata.device.type


@pytest.mark.parametrize("device", DEVICES)
def test_received_tensors_look_like_nanotrons_and_live_on_the_device(device):
    for rank, (received, p2p_device, first_meta, second_meta) in enumerate(
            spawn(exchange, 2, args=(device,), timeout=60)):
        assert (first_meta, second_meta) == ("cpu", "cpu")  # gloo reads the metadata buffers
        expected = sent_tensors(1 - rank, "cpu")
        assert len(received) == len(expected)
        for sent, (reference, got, values) in zip(expected, received, strict=True):
            # nanotron's receive (on the host) and ours differ only in the device
            assert {**got, "device": "cpu"} == reference, (sent.shape, sent.stride())
            assert (got["dtype"], got["shape"], got["stride"], got["requires_grad"]) == (
                sent.dtype, tuple(sent.shape), sent.stride(), sent.requires_grad)
            assert torch.device(got["device"]) == torch.device(p2p_device)
            assert torch.device(p2p_device).type == device
            assert torch.equal(values, sent.detach())
        assert not expected[1].is_contiguous() and received[1][1]["stride"] == (1, 6)  # the transpose's stride


def train_both(rank, world_size, store, m):
    """nanotron's 1F1B at pp=world_size, once over `CpuP2P` and once over `HostStagedP2P`."""
    import nanotron.distributed as nanotron_dist
    from nanotron.parallel.pipeline_parallel.engine import OneForwardOneBackwardPipelineEngine

    from integration.nanotron.patches.cpu import HostStagedP2P, cpu_p2p, cpu_parallel_context
    from benchmarks.llama.reference import clear_shared_state, for_rank, microbatch
    from benchmarks.llama.model import build_llama, llama_block_ranks

    context = cpu_parallel_context(pp=world_size)
    pp_rank = nanotron_dist.get_rank(context.pp_pg)
    results = {}
    for name, p2p in (("cpu", cpu_p2p(context.pp_pg)), ("staged", HostStagedP2P(context.pp_pg, device="cpu"))):
        clear_shared_state()
        model = build_llama(CFG, p2p, llama_block_ranks(CFG, world_size, split=(1,) * world_size))
        data = (for_rank(microbatch(CFG, 2, i, 11), pp_rank, model.input_pp_rank, model.output_pp_rank)
                for i in range(m))
        outputs = OneForwardOneBackwardPipelineEngine().train_batch_iter(
            model, pg=context.pp_pg, batch=data, nb_microbatches=m, grad_accumulator=None)
        p2p.wait_sends()
        losses = [o["loss"] for o in outputs if isinstance(o["loss"], torch.Tensor)]
        grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}
        results[name] = (losses, grads)
    return results


def test_nanotron_1f1b_over_host_staged_p2p_equals_cpu_p2p_bitwise():
    pieces = spawn(train_both, 4, args=(6,), timeout=90)
    assert len(pieces[3]["cpu"][0]) == 6  # the last rank holds the losses
    for rank, piece in enumerate(pieces):
        (cpu_losses, cpu_grads), (losses, grads) = piece["cpu"], piece["staged"]
        assert len(losses) == len(cpu_losses) and all(torch.equal(a, b) for a, b in zip(losses, cpu_losses))
        assert grads.keys() == cpu_grads.keys() and grads, f"rank {rank} holds no parameters"
        for name, grad in cpu_grads.items():
            assert grad is not None and grads[name] is not None, f"rank {rank}: {name} has no gradient"
            assert torch.equal(grads[name], grad), f"rank {rank}: {name} differs"
