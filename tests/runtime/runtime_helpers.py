"""Shared pieces of the runtime tests: the model, the data, the reference, the schedule
configurations, and the per-rank worker functions run by `launch.spawn` (they must live
in an importable module). Holds no tests itself; the replay of a program with measured
buffer sizes is tests/replay.py.

The model is a stack of Linear+GELU blocks split into pp*v stages, fp32; widths differ
from stage to stage so that every boundary has its own shape.
"""

from __future__ import annotations

import gc
import os
import time

import torch
from torch import nn

from pipeschedule.compiler.families import generate
from pipeschedule.compiler.ir import Op
from pipeschedule.compiler.passes import lower
from pipeschedule.runtime import DistTransport, Executor, HostStagedTransport, InProcessPipeline, ModuleStages, P2P

BATCH = 3


def width(stage: int) -> int:
    return 8 + 4 * (stage % 3)


def make_chunks(num_stages: int, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    chunks = []
    for s in range(num_stages):
        inner = width(s) + 4
        chunks.append(nn.Sequential(nn.Linear(width(s), inner), nn.GELU(), nn.Linear(inner, width(s + 1)), nn.GELU()))
    return chunks


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def make_data(num_stages: int, m: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(BATCH, width(0), generator=generator) for _ in range(m)]
    targets = [torch.randn(BATCH, width(num_stages), generator=generator) for _ in range(m)]
    return inputs, targets


def reference(chunks, inputs, targets) -> list[torch.Tensor]:
    """The plain computation: per microbatch in order, forward through every chunk, then
    backward of loss / m, so parameter gradients accumulate in microbatch order."""
    stages, m, losses = ModuleStages(chunks, loss_fn), len(inputs), []
    for mb in range(m):
        x = inputs[mb]
        for s in range(len(chunks)):
            x = stages.forward(s, mb, x, targets[mb] if s == len(chunks) - 1 else None)
        loss = x / m
        loss.backward()
        losses.append(loss.detach())
    return losses


def grads(chunks, stages) -> dict[str, torch.Tensor]:
    return {f"{s}.{name}": p.grad.clone() for s in stages for name, p in chunks[s].named_parameters()}


def configs(pp: int):
    """(label, generate() arguments) for every schedule family, at m in {1, pp-1, pp, 2pp+1}."""
    families = [
        ("afab", {}), ("1f1b", {}), ("capped_1f1b", {"cap": 1}), ("capped_1f1b", {"cap": 2}),
        ("interleaved_1f1b", {"virtual": 2}), ("interleaved_1f1b", {"virtual": 2, "cap": 3}),
        ("looped_bfs", {"virtual": 2}),
    ]
    out = []
    for name, kwargs in families:
        for m in sorted({1, pp - 1, pp, 2 * pp + 1} - {0}):
            args = dict(name=name, pp=pp, microbatches=m, **kwargs)
            out.append((f"{name}{kwargs}-pp{pp}-m{m}", args))
    return out


def schedule_of(args):
    args = dict(args)
    return lower(generate(args.pop("name"), **args))


def run_one(schedule, rank, transport, inputs, targets, **executor_args):
    chunks = make_chunks(schedule.num_stages)
    executor = Executor(schedule, rank, ModuleStages(chunks, loss_fn), transport, **executor_args)
    outputs = executor.step(inputs, targets)
    return executor, outputs, grads(chunks, schedule.stages_of(rank))


def losses_of(outputs):
    return [o["loss"] for o in outputs] if isinstance(outputs[0], dict) else None


def exact_worker(rank: int, world: int, store) -> dict:
    """Every configuration of `configs(world)` over gloo (plain and host-staged); rank 0
    also runs the reference and the in-process pipeline. Returns what the tests compare."""
    torch.set_num_threads(1)
    plain, staged = DistTransport(store, prefix="plain/"), HostStagedTransport(store, prefix="staged/")
    out = {}
    for label, args in configs(world):
        schedule = schedule_of(args)
        inputs, targets = make_data(schedule.num_stages, schedule.microbatches)
        row = {}
        executor, outputs, row["grads"] = run_one(schedule, rank, plain, inputs, targets, timeout=30)
        row["losses"], row["sizes"] = losses_of(outputs), executor.ledger.sizes
        row["high_total"], row["left"] = (executor.ledger.high_total,
                                          (dict(executor.buffers.held), executor.ledger.live_total))
        _, staged_outputs, row["staged_grads"] = run_one(schedule, rank, staged, inputs, targets, timeout=30)
        row["staged_losses"] = losses_of(staged_outputs)
        if rank == 0:
            chunks = make_chunks(schedule.num_stages)
            row["ref_losses"] = reference(chunks, inputs, targets)
            row["ref_grads"] = grads(chunks, range(schedule.num_stages))
            chunks = make_chunks(schedule.num_stages)
            pipeline = InProcessPipeline(schedule, ModuleStages(chunks, loss_fn))
            row["inproc_losses"] = losses_of(pipeline.step(inputs, targets)[schedule.placement[-1]])
            row["inproc_grads"] = grads(chunks, range(schedule.num_stages))
        out[label] = row
    out["staged_bytes"] = staged.staged_bytes
    return out


def memory_worker(rank: int, world: int, store, steps: int = 50) -> dict:
    """50 steps each of 1f1b and capped_1f1b (caps 1, 2) at m = 2pp+1: after every step
    the buffer table, the ledger and the trace length; the tensors alive in the process;
    rank 0's stash high-water mark and one microbatch's stash."""
    torch.set_num_threads(1)
    transport = DistTransport(store, prefix="memory/")
    out = {}
    for name, kwargs in (("1f1b", {}), ("capped_1f1b", {"cap": 1}), ("capped_1f1b", {"cap": 2})):
        schedule = lower(generate(name, pp=world, microbatches=2 * world + 1, **kwargs))
        chunks = make_chunks(schedule.num_stages)
        executor = Executor(schedule, rank, ModuleStages(chunks, loss_fn), transport, timeout=30)
        inputs, targets = make_data(schedule.num_stages, schedule.microbatches)
        per_step = []
        for step in range(steps):
            executor.step(inputs, targets)
            tensors = _live_tensors() if step in (2, steps - 1) else None
            per_step.append((len(executor.buffers), executor.ledger.live_total, len(executor.ledger.trace),
                             executor.ledger.high_total, tensors))
        out[f"{name}{kwargs}"] = {
            "per_step": per_step,
            "stash_high": executor.ledger.high["stash"],
            "stash_one": executor.ledger.sizes[("stash", rank, 0)],
            "cap": (schedule.caps() or [world] * world)[rank],
        }
    return out


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


class FailingStages(ModuleStages):
    """ModuleStages whose forward raises, returns a wrong shape, or ends the process, at
    one (stage, mb)."""

    def __init__(self, chunks, at, how):
        super().__init__(chunks, loss_fn)
        self.at, self.how = at, how

    def forward(self, stage, mb, act_in, target):
        output = super().forward(stage, mb, act_in, target)
        if (stage, mb) == self.at:
            if self.how == "exit":  # the process ends at once, telling no one (as when killed)
                os._exit(3)
            if self.how == "raise":
                raise ValueError(f"injected failure in stage {stage}, microbatch {mb}")
            return torch.cat([output, output[:, :1]], dim=1)  # one column too many
        return output


def without(schedule, rank, op, stage, mb):
    """`schedule` with rank's first instruction (op, stage, mb) deleted (the verifier
    would reject it; the runtime must not rely on that)."""
    program = list(schedule.programs[rank])
    index = next(k for k, i in enumerate(program) if (i.op, i.stage, i.mb) == (op, stage, mb))
    del program[index]
    programs = list(schedule.programs)
    programs[rank] = program
    return schedule.replace_programs(programs)


def fault_worker(rank: int, world: int, store, scenario: str, timeout: float) -> None:
    """Runs one broken step; every rank is expected to raise RuntimeScheduleError."""
    torch.set_num_threads(1)
    schedule = lower(generate("1f1b", pp=world, microbatches=4))
    at, how = None, None
    if scenario == "missing_recv":
        schedule = without(schedule, 1, Op.RECV_F, 1, 2)
    elif scenario == "missing_send":
        schedule = without(schedule, 0, Op.SEND_F, 0, 2)
    elif scenario == "forward_raises":
        at, how = (1, 2), "raise"
    elif scenario == "process_dies":
        at, how = (1, 2), "exit"
    elif scenario == "wrong_shape":
        at, how = (0, 1), "shape"
    chunks = make_chunks(schedule.num_stages)
    stages = FailingStages(chunks, at, how)
    executor = Executor(schedule, rank, stages, DistTransport(store), timeout=timeout)
    inputs, targets = make_data(schedule.num_stages, schedule.microbatches)
    executor.step(inputs, targets)
    time.sleep(2 * timeout)  # a rank that wrongly finishes must not look like one that stopped


def background_send_worker(rank: int, world: int, store, delay: float, staged: bool = True) -> dict:
    """Rank 0 posts [send to 1, receive from 1] on a HostStagedTransport (`staged`) or a
    DistTransport over gloo; rank 1 posts its send at once and its receive only after
    `delay` seconds ([Note: sends in the background]). Returns what rank 0 saw: how long
    until its batch's Pending was ready, whether the send was still outstanding then, and
    how long until it arrived."""
    transport = (HostStagedTransport if staged else DistTransport)(store, prefix="background/")
    size = 1 << 24  # 64 MiB: far more than a socket buffers, so gloo's send waits for the receive
    out, back = torch.arange(size, dtype=torch.float32), torch.empty(size)
    if rank == 1:
        arrived = torch.empty(size)
        first = transport.post([P2P(True, 0, out * 2)])
        time.sleep(delay)
        second = transport.post([P2P(False, 0, arrived)])
        for pending in (first, second):
            assert pending.wait_for(30)
            pending.finish()
        drained = transport.outstanding_sends()
        assert drained is None or drained.wait_for(30)
        return {"received": torch.equal(arrived, out)}
    expected = out * 2
    start = time.monotonic()
    pending = transport.post([P2P(True, 1, out), P2P(False, 1, back)])
    out.zero_()  # the transport sends from its own copy: what rank 1 receives is what was posted
    assert pending.wait_for(30)
    pending.finish()
    ready_after = time.monotonic() - start
    sends = transport.outstanding_sends()
    still_sending = sends is not None and not sends.ready()
    assert sends is None or sends.wait_for(30)
    sends is None or sends.finish()
    return {"ready_after": ready_after, "still_sending": still_sending, "arrived_after": time.monotonic() - start,
            "received": torch.equal(back, expected), "after": transport.outstanding_sends()}


def staged_send_on_a_busy_stream_worker(rank: int, world: int, store) -> dict:
    """On one GPU: rank 0 queues about a second of matmuls, then posts a send of a tensor
    written after them on a HostStagedTransport; rank 1 receives it. Returns how long rank
    0's post held its host, whether the stream was still busy when it returned, and when
    (seconds after the post began) the stream drained and the send completed; rank 1, what
    it got ([Note: staged sends leave the host free]). The premise is checked, not assumed:
    on an H100 with both ranks' processes on the GPU, after `torch.cuda._sleep(2e9)` (1.01 s
    in a process alone) the send had completed 5 ms after the post began, so that spin had
    not kept the stream busy (why is not established; one suspect is clock64 read on
    another SM after the time-sliced spin resumed)."""
    torch.cuda.set_device(0)
    transport = HostStagedTransport(store, prefix="busy-stream/")
    if rank == 0:
        value = torch.zeros(1 << 20, device="cuda")
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(2):  # (the first includes cuBLAS's start)
            torch.mm(a, a)
        torch.cuda.synchronize()
        once = time.monotonic()
        torch.mm(a, a)
        torch.cuda.synchronize()
        repeats = int(1.0 / max(time.monotonic() - once, 1e-4))
        queued = time.monotonic()
        for _ in range(repeats):
            torch.mm(a, a)
        value.add_(3.0)  # written only once the matmuls have run
        ended = torch.cuda.Event()
        ended.record()
        start = time.monotonic()
        queued = start - queued  # (were the host to wait for the kernels here, the premise fails: this says so)
        transport.post([P2P(True, 1, value)])
        held = time.monotonic() - start
        busy_after_post = not ended.query()
        while not ended.query():
            time.sleep(1e-3)
        drained = time.monotonic() - start
        sends = transport.outstanding_sends()
        assert sends is None or sends.wait_for(60)
        sends is None or sends.finish()
        return {"held": held, "busy_after_post": busy_after_post, "drained": drained,
                "sent": time.monotonic() - start, "repeats": repeats, "queued": queued}
    into = torch.empty(1 << 20, device="cuda")
    pending = transport.post([P2P(False, 0, into)])
    assert pending.wait_for(60)
    pending.finish()
    torch.cuda.synchronize()
    return {"received": bool((into == 3.0).all())}
