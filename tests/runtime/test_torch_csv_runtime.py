"""Our CSVs run in PyTorch's own pipeline runtime (`_PipelineScheduleRuntime`, PyTorch
2.13, two gloo processes) train exactly like a single process: losses and every
gradient equal the reference bit for bit.

Bitwise because m is a power of 2: the reference back-propagates loss / m per
microbatch, PyTorch back-propagates each loss and divides the accumulated gradients by m
at REDUCE_GRAD ([Note: REDUCE_GRAD] in torch_csv.py); scaling by a power of 2 is exact
and commutes with every sum and product of the backward, and both accumulate in
microbatch order on every stage. Without REDUCE_GRAD in a compute_comms file every
gradient came out exactly m times the reference."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.pipelining")

from pipeschedule import compile_schedule  # noqa: E402
from pipeschedule.runtime.launch import spawn  # noqa: E402
from pipeschedule.compiler.torch_csv import FORMS, dump_csv  # noqa: E402

from runtime_helpers import grads, make_chunks, make_data, reference  # noqa: E402
from torch_runtime_workers import torch_runtime_worker  # noqa: E402

pytestmark = pytest.mark.spawn

PP, M = 2, 4
SCHEDULES = [("1f1b", {}), ("interleaved_1f1b", {"virtual": 2}), ("zbv", {}),
             # issue 42's families: PyTorch's DualPipeV, InterleavedZeroBubble and LoopedBFS, and ZB-H2
             ("dualpipev", {}), ("interleaved_zb", {"virtual": 2}), ("looped_bfs", {"virtual": 2}), ("zb_h2", {})]


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """Every (schedule, form) in one spawn of PP processes (starting them dominates)."""
    folder = tmp_path_factory.mktemp("csv")
    cases = []
    for name, kwargs in SCHEDULES:
        schedule = compile_schedule(name, pp=PP, microbatches=M, **kwargs)
        for form in FORMS:
            path = folder / f"{name}-{form}.csv"
            dump_csv(schedule, str(path), form=form)
            cases.append((f"{name}-{form}", str(path), form, schedule.placement, M))
    per_rank = spawn(torch_runtime_worker, PP, timeout=240, args=(cases,))
    return cases, per_rank


@pytest.mark.parametrize("label", [f"{name}-{form}" for name, _ in SCHEDULES for form in FORMS])
def test_pytorch_runs_our_csv_exactly(ran, label):
    cases, per_rank = ran
    case = next(c for c in cases if c[0] == label)
    placement = case[3]
    num_stages = len(placement)
    chunks = make_chunks(num_stages)
    inputs, targets = make_data(num_stages, M)
    expected_losses = reference(chunks, inputs, targets)  # loss / m per microbatch
    expected = grads(chunks, range(num_stages))
    got: dict = {}
    losses = None
    for rank_results in per_rank:
        name, rank_losses, rank_grads = next(r for r in rank_results if r[0] == label)
        got.update(rank_grads)
        if rank_losses is not None:
            losses = rank_losses
    assert len(losses) == M and all(torch.equal(a / M, b) for a, b in zip(losses, expected_losses))
    assert set(got) == set(expected)
    for key in expected:
        assert torch.equal(got[key], expected[key]), (key, (got[key] / expected[key]).flatten()[:3])
