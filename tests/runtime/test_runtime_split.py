"""Split backward (B, then W) in the runtime, run for real: gloo process groups at pp 1, 2
and 4 (spawned once each, every configuration looped inside) and the in-process world,
compared with the single-process reference of runtime_helpers.py.

Schedules: the generator families with W (zb_h1, zbv, v_half, v_min, when
`pipeschedule.compiler.generators.FAMILIES` lists them), and split schedules built here from
compute orders, so the runtime is tested independently of those generators: 1F1B and
interleaved 1F1B with each W right after its B, or delayed, or all at the end of the
rank's program, and a V-shape placement (rank r runs stages r and 2pp-1-r) with all
forwards, then all backwards.

Bitwise equality is expected everywhere ([Note: split backward]): B and W run autograd's
own derivative of the same matmuls, and every schedule here runs the W of each stage in
microbatch order.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeschedule.compiler.families import FAMILIES, generate
from pipeschedule.compiler.generators.common import make
from pipeschedule.compiler.ir import BUFFERS, Op, make_instr
from pipeschedule.compiler.passes import lower
from pipeschedule.runtime import DistTransport, Executor, InProcessPipeline, ModuleStages
from pipeschedule.runtime.launch import spawn
from pipeschedule.runtime.split_backward import WeightGrads
from pipeschedule.compiler.verify import verify

from replay import replay_high_water
from runtime_helpers import BATCH, grads, loss_fn, make_chunks, make_data, reference, width

SPLIT_FAMILIES = tuple(name for name, family in FAMILIES.items() if family.split_backward)


# -- split schedules built from compute orders --------------------------------------------


def with_w(schedule, *, delay: int | None = 0):
    """A compute-only schedule with W(s, mb) inserted on B(s, mb)'s rank, `delay` compute
    instructions after it (None: all W at the end of the program, in B order)."""
    programs = []
    for program in schedule.programs:
        out, pending = [], []  # pending: [countdown, W]
        for instr in program:
            out.append(instr)
            for entry in pending:
                entry[0] -= 1
            while pending and pending[0][0] < 0:
                out.append(pending.pop(0)[1])
            if instr.op is Op.B:
                w = make_instr(Op.W, instr.stage, instr.mb)
                if delay == 0:
                    out.append(w)
                else:
                    pending.append([delay if delay is not None else float("inf"), w])
        out += [w for _, w in pending]
        programs.append(out)
    return make(schedule.name + "+W", schedule.pp, schedule.virtual, schedule.microbatches, schedule.placement,
                programs, dict(schedule.params))


def v_afab(pp: int, m: int):
    """V-shape placement (rank r: stages r and 2pp-1-r), all forwards then all backwards,
    each W right after its B: the simplest acyclic order on a V."""
    S = 2 * pp
    placement = list(range(pp)) + list(reversed(range(pp)))
    programs = []
    for r in range(pp):
        first, second = r, S - 1 - r
        order = [make_instr(Op.F, first, mb) for mb in range(m)] + [make_instr(Op.F, second, mb) for mb in range(m)]
        for stage in (second, first):
            for mb in range(m):
                order += [make_instr(Op.B, stage, mb), make_instr(Op.W, stage, mb)]
        programs.append(order)
    return make("v_afab", pp, 2, m, placement, programs, {})


def split_configs(pp: int):
    """(label, builder arguments) of every split configuration at pp."""
    out = []
    for m in sorted({1, pp, 2 * pp + 1}):
        out += [
            (f"1f1b+W-pp{pp}-m{m}", ("1f1b", m, 0)),
            (f"1f1b+W-delay3-pp{pp}-m{m}", ("1f1b", m, 3)),
            (f"interleaved+W-at-end-pp{pp}-m{m}", ("interleaved_1f1b", m, None)),
            (f"v_afab-pp{pp}-m{m}", ("v_afab", m, 0)),
        ]
        out += [(f"{name}-pp{pp}-m{m}", (name, m, "family")) for name in SPLIT_FAMILIES]
    return out


def build(pp: int, args):
    name, m, delay = args
    if name == "v_afab":
        schedule = lower(v_afab(pp, m))
    elif delay == "family":
        schedule = lower(generate(name, pp=pp, microbatches=m))
    else:
        virtual = 2 if name == "interleaved_1f1b" else 1
        schedule = lower(with_w(generate(name, pp=pp, microbatches=m, virtual=virtual), delay=delay))
    assert schedule.split_backward
    verify(schedule)
    return schedule


def w_part_bytes(stage: int) -> int:
    """What W of one (stage, mb) of `make_chunks` holds from B on: both Linears' inputs
    (the act_in and the GELU output) and both output gradients, fp32."""
    inner = width(stage) + 4
    return 4 * BATCH * (width(stage) + inner + inner + width(stage + 1))


# -- the spawned ranks --------------------------------------------------------------------


def split_worker(rank: int, world: int, store) -> dict:
    torch.set_num_threads(1)
    transport = DistTransport(store, prefix="split/")
    out = {}
    for label, args in split_configs(world):
        schedule = build(world, args)
        inputs, targets = make_data(schedule.num_stages, schedule.microbatches)
        chunks = make_chunks(schedule.num_stages)
        executor = Executor(schedule, rank, ModuleStages(chunks, loss_fn), transport, timeout=30)
        outputs = executor.step(inputs, targets)
        row = {
            "losses": [o["loss"] for o in outputs] if isinstance(outputs[0], dict) else None,
            "grads": grads(chunks, schedule.stages_of(rank)),
            "sizes": executor.ledger.sizes, "resized": executor.ledger.resized,
            "high_total": executor.ledger.high_total, "left": (dict(executor.buffers.held), executor.ledger.live_total),
            "split_mode": dict(executor.split_mode),
        }
        if rank == 0:
            ref = make_chunks(schedule.num_stages)
            row["ref_losses"] = reference(ref, inputs, targets)
            row["ref_grads"] = grads(ref, range(schedule.num_stages))
            chunks = make_chunks(schedule.num_stages)
            pipeline = InProcessPipeline(schedule, ModuleStages(chunks, loss_fn))
            row["inproc_losses"] = [o["loss"] for o in pipeline.step(inputs, targets)[schedule.placement[-1]]]
            row["inproc_grads"] = grads(chunks, range(schedule.num_stages))
        out[label] = row
    return out


@pytest.fixture(scope="module", params=(1, 2, 4), ids=lambda pp: f"pp{pp}")
def split_runs(request):
    pp = request.param
    start = time.monotonic()
    ranks = spawn(split_worker, pp, timeout=180)
    print(f"pp={pp}: {len(split_configs(pp))} split configurations in {time.monotonic() - start:.1f} s")
    return pp, ranks


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_split_schedules_include_v_shape_placements():
    v = tuple(range(4)) + tuple(reversed(range(4)))
    assert build(4, ("v_afab", 3, 0)).placement == v
    for name in [name for name in SPLIT_FAMILIES if FAMILIES[name].virtual == 2]:
        assert build(4, (name, 3, "family")).placement == v


@pytest.mark.spawn
def test_losses_and_gradients_equal_the_reference(split_runs):
    pp, ranks = split_runs
    for label, args in split_configs(pp):
        schedule = build(pp, args)
        ref = ranks[0][label]
        last = schedule.placement[-1]
        assert _equal(ranks[last][label]["losses"], ref["ref_losses"]), label
        assert _equal(ref["inproc_losses"], ref["ref_losses"]), label
        for rank in range(pp):
            row = ranks[rank][label]
            assert row["grads"].keys() == {k for k in ref["ref_grads"]
                                           if int(k.split(".")[0]) in schedule.stages_of(rank)}
            for name, grad in row["grads"].items():
                assert torch.equal(grad, ref["ref_grads"][name]), f"{label}: rank {rank} {name}"
                assert torch.equal(ref["inproc_grads"][name], grad), f"{label}: in-process {name}"
            assert row["split_mode"] == dict.fromkeys(schedule.stages_of(rank), "split"), label


@pytest.mark.spawn
def test_buffers_are_empty_and_the_ledger_counts_w_parts_until_w(split_runs):
    pp, ranks = split_runs
    for label, args in split_configs(pp):
        schedule = build(pp, args)
        for rank in range(pp):
            row = ranks[rank][label]
            assert row["left"] == ({}, 0), label
            assert {kind for kind, _, _ in row["sizes"]} <= set(BUFFERS)
            stashes = {key for key in row["sizes"] if key[0] == "stash"}
            assert set(row["resized"]) == stashes and stashes, label
            for _, stage, mb in stashes:
                assert row["resized"]["stash", stage, mb] == w_part_bytes(stage), (label, stage, mb)
            assert replay_high_water(schedule, rank, row["sizes"], row["resized"]) == row["high_total"], label


# -- in-process checks: deferral happens, fallback, tied weights ------------------------


class RecordingStages(ModuleStages):
    """ModuleStages that notes, at each F, which parameters of its stage hold a gradient."""

    def __init__(self, chunks):
        super().__init__(chunks, loss_fn)
        self.seen: list[tuple[int, int, int]] = []  # (stage, mb, parameters with .grad)

    def forward(self, stage, mb, act_in, target):
        self.seen.append((stage, mb, sum(p.grad is not None for p in self.chunks[stage].parameters())))
        return super().forward(stage, mb, act_in, target)


def test_weight_gradients_wait_for_w():
    # 1F1B at pp=2, m=4 with every W at the end: rank 0 runs F(0, 2) after B(0, 0) and
    # before any W. Unsplit, stage 0's four parameters would hold gradients by then.
    schedule = lower(with_w(generate("1f1b", pp=2, microbatches=4), delay=None))
    inputs, targets = make_data(2, 4)
    chunks = make_chunks(2)
    stages = RecordingStages(chunks)
    pipeline = InProcessPipeline(schedule, stages)
    pipeline.step(inputs, targets)
    program = [str(i) for i in schedule.programs[0] if i.op in (Op.F, Op.B, Op.W)]
    assert program.index("0B0") < program.index("0F2") < program.index("0W0")
    assert (0, 2, 0) in stages.seen
    ref = make_chunks(2)
    reference(ref, inputs, targets)
    assert all(torch.equal(a, b) for a, b in zip(grads(chunks, (0, 1)).values(), grads(ref, (0, 1)).values()))
    unsplit = lower(generate("1f1b", pp=2, microbatches=4))
    stages = RecordingStages(make_chunks(2))
    InProcessPipeline(unsplit, stages).step(inputs, targets)
    assert (0, 2, 4) in stages.seen  # the same point without W: the gradients are there


class Scale(nn.Module):
    """A stage with no linear layer: nothing to defer."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, n))
        self.bias = nn.Parameter(torch.linspace(-0.1, 0.1, n))

    def forward(self, x):
        return F.gelu(x * self.weight + self.bias)


class Tied(nn.Module):
    """A linear whose weight another op also uses (tied): its weight half runs at B."""

    def __init__(self, n: int):
        super().__init__()
        self.proj = nn.Linear(n, n)

    def forward(self, x):
        return F.gelu(self.proj(x)) + x @ self.proj.weight.t()


def odd_chunks(num_stages: int, seed: int = 0):
    chunks = make_chunks(num_stages, seed)
    torch.manual_seed(seed + 7)
    chunks[1] = Scale(width(1))  # keeps its width: the next chunk takes width(1)
    chunks[2] = nn.Sequential(nn.Linear(width(1), width(2)), Tied(width(2)), nn.Linear(width(2), width(3)))
    return chunks


def test_a_stage_that_cannot_defer_falls_back_exactly_and_says_so(caplog):
    schedule = lower(with_w(generate("interleaved_1f1b", pp=2, microbatches=3, virtual=2), delay=1))
    inputs, targets = make_data(4, 3)
    chunks = odd_chunks(4)
    with caplog.at_level(logging.INFO, logger="pipeschedule.runtime"):
        pipeline = InProcessPipeline(schedule, ModuleStages(chunks, loss_fn))
        outputs = pipeline.step(inputs, targets)
        pipeline.step(inputs, targets)  # logged once per stage, not per step
    ref = odd_chunks(4)
    ref_losses = reference(ref, inputs, targets)
    reference(ref, inputs, targets)
    assert _equal([o["loss"] for o in outputs[1]], ref_losses)
    for name, grad in grads(ref, range(4)).items():
        assert torch.equal(grads(chunks, range(4))[name], grad), name
    rank1 = pipeline.executors[1]
    assert rank1.split_mode == {1: "full", 3: "split"}
    assert pipeline.executors[0].split_mode == {0: "split", 2: "split"}
    tied = pipeline.executors[0].split_report[2]
    assert (tied.deferred, tied.at_b, tied.tied) == (4, 2, 2)  # outer linears deferred; proj at B
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "stage 1" in warnings[0].getMessage()
    assert "B runs the full backward" in warnings[0].getMessage()
    assert all(size == 0 for (kind, stage, _), size in rank1.ledger.resized.items() if stage == 1)
    assert all(len(e.buffers) == 0 and e.ledger.live_total == 0 for e in pipeline.executors)


def test_weight_grads_alone_split_a_backward_bitwise():
    torch.manual_seed(3)
    layer = nn.Sequential(nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 4))
    twin = nn.Sequential(nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 4))
    twin.load_state_dict(layer.state_dict())
    x = torch.randn(2, 3, 6, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    store = WeightGrads()
    with store.deferring():
        y = layer(x)
    store.close_forward()
    y.square().sum().backward()
    twin(x_ref).square().sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    assert all(p.grad is None for p in layer.parameters())  # every weight waits for W
    assert store.held_bytes(set()) == 4 * (2 * 3) * (6 + 5 + 5 + 4)
    store.run()
    for p, q in zip(layer.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert store.records == []
