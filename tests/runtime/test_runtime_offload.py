"""Host offload (OFFLOAD / RELOAD of stashes) and the buffer pool in the runtime, run for
real: gloo process groups at pp 2 and 4 (spawned once each, every schedule family looped
inside) and the in-process world, compared with the single-process reference of
runtime_helpers.py.

Offload schedules are built here from lowered schedules (`with_offload`: OFFLOAD after
each F, past its sends; RELOAD a given number of compute instructions before the B), so
the runtime is tested independently of the offload pass; where `pipeschedule.compiler.offload`
exists, its `add_offload` is run too.

Bitwise equality is expected everywhere: offload copies bytes unchanged
([Note: host offload]) and the pool only changes where boundary tensors live ([Note: buffer pool]).
"""

from __future__ import annotations

import importlib
import time

import pytest
import torch

from pipeschedule import compile_schedule
from pipeschedule.compiler.ir import COMM_OPS, COMPUTE_OPS, Instr, Op
from pipeschedule.runtime import DistTransport, Executor, InProcessPipeline, ModuleStages, RuntimeScheduleError
from pipeschedule.errors import LaunchError
from pipeschedule.runtime.host_offload import Offloader
from pipeschedule.runtime.launch import spawn
from pipeschedule.runtime.ledger import Ledger, saved_storages
from pipeschedule.runtime.pool import capacity

from runtime_helpers import grads, loss_fn, make_chunks, make_data, reference

FAMILIES = (
    ("afab", {}), ("1f1b", {}), ("capped_1f1b", {"cap": 1}), ("interleaved_1f1b", {"virtual": 2}),
    ("zb_h1", {}), ("zbv", {}), ("v_half", {}), ("v_min", {}),
    ("zb_h2", {}), ("dualpipev", {}), ("interleaved_zb", {"virtual": 2}), ("looped_bfs", {"virtual": 2}),
)


def with_offload(schedule, *, lead: int = 1, ranks=None, keep=lambda stage, mb: True, drop_reload=None):
    """`schedule` with OFFLOAD(stash) after each F(s, mb) on `ranks` (default all) for which
    `keep(s, mb)`, placed past the communication run that follows F (a batch is never
    split), and RELOAD(stash) before the compute instruction `lead` compute instructions
    before B(s, mb) (never before the OFFLOAD). `drop_reload=(s, mb)` leaves that RELOAD out."""
    programs = []
    for rank, program in enumerate(schedule.programs):
        out = list(program)
        forwards = [i for i in program if i.op is Op.F and (ranks is None or rank in ranks) and keep(i.stage, i.mb)]
        for f in forwards:
            at = out.index(f) + 1
            while at < len(out) and out[at].op in COMM_OPS:
                at += 1
            out.insert(at, Instr(Op.OFFLOAD, f.stage, f.mb, buf="stash"))
            if (f.stage, f.mb) == drop_reload:
                continue
            pos, seen = out.index(Instr(Op.B, f.stage, f.mb)), 0
            while seen < lead and pos - 1 > at:
                pos -= 1
                seen += out[pos].op in COMPUTE_OPS
            while out[pos].op not in COMPUTE_OPS:  # land right before a compute instruction
                pos += 1
            out.insert(pos, Instr(Op.RELOAD, f.stage, f.mb, buf="stash"))
        programs.append(out)
    return schedule.replace_programs(programs)


def family(pp: int, name: str, kwargs: dict, m: int):
    return compile_schedule(name, pp=pp, microbatches=m, **kwargs)


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _losses(outputs):
    return [o["loss"] for o in outputs] if isinstance(outputs[0], dict) else None


# -- the spawned ranks --------------------------------------------------------------------


def offload_pass():
    try:
        return importlib.import_module("pipeschedule.compiler.offload")
    except ImportError:
        return None


def offload_worker(rank: int, world: int, store) -> dict:
    """Every family at m = 2pp+1 with every stash offloaded (RELOAD one compute before B),
    with the pool and without, plus the plain run (no offload, no pool) and, where the
    pass exists, `add_offload` with fraction 1; rank 0 also the reference."""
    torch.set_num_threads(1)
    transport = DistTransport(store, prefix="offload/")
    out = {}
    m = 2 * world + 1
    for name, kwargs in FAMILIES:
        plain = family(world, name, kwargs, m)
        offloaded = with_offload(plain)
        inputs, targets = make_data(plain.num_stages, m)
        row = {}
        runs = [("plain", plain, False, None), ("offload+pool", offloaded, True, None),
                ("offload", offloaded, False, None),
                # streamed ([Note: streamed offload]): every storage its own chunk, and a few per chunk
                ("stream", offloaded, True, 1), ("stream 512", with_offload(plain, lead=0), False, 512)]
        module = offload_pass()
        if module is not None:
            runs.append(("pass", module.add_offload(plain, module.OffloadPolicy(fraction=1.0, lead=1)), True, None))
        for label, schedule, pool, chunk in runs:
            chunks = make_chunks(schedule.num_stages)
            executor = Executor(schedule, rank, ModuleStages(chunks, loss_fn), transport, timeout=30, pool=pool,
                                offload_chunk=chunk)
            outputs = executor.step(inputs, targets)
            ledger = executor.ledger
            row[label] = {
                "losses": _losses(outputs), "grads": grads(chunks, schedule.stages_of(rank)),
                "left": (len(executor.buffers), ledger.live_total, ledger.host_total),
                "sizes": {k: v for k, v in ledger.sizes.items() if k[0] == "stash"}, "moved": dict(ledger.moved),
                "high_host": ledger.high_host_total,
            }
        if rank == 0:
            chunks = make_chunks(plain.num_stages)
            row["ref_losses"] = reference(chunks, inputs, targets)
            row["ref_grads"] = grads(chunks, range(plain.num_stages))
        out[f"{name}{kwargs}"] = row
    return out


@pytest.fixture(scope="module", params=(2, 4), ids=lambda pp: f"pp{pp}")
def offload_runs(request):
    pp = request.param
    start = time.monotonic()
    ranks = spawn(offload_worker, pp, timeout=180)
    print(f"pp={pp}: {len(FAMILIES)} families x 3 runs in {time.monotonic() - start:.1f} s")
    return pp, ranks


@pytest.mark.spawn
def test_offload_is_bitwise_exact_on_every_family(offload_runs):
    pp, ranks = offload_runs
    for name, kwargs in FAMILIES:
        label = f"{name}{kwargs}"
        schedule = family(pp, name, kwargs, 2 * pp + 1)
        ref = ranks[0][label]
        last = schedule.placement[-1]
        for run in ("plain", "offload+pool", "offload", "stream", "stream 512", "pass"):
            if run not in ref:
                continue  # no offload pass yet
            assert _equal(ranks[last][label][run]["losses"], ref["ref_losses"]), (label, run)
            for rank in range(pp):
                for param, grad in ranks[rank][label][run]["grads"].items():
                    assert torch.equal(grad, ref["ref_grads"][param]), f"{label} {run}: rank {rank} {param}"


@pytest.mark.spawn
def test_every_stash_moved_whole_and_everything_was_released(offload_runs):
    pp, ranks = offload_runs
    for name, kwargs in FAMILIES:
        label = f"{name}{kwargs}"
        for rank in range(pp):
            for run in ("offload+pool", "offload", "stream", "stream 512"):
                row = ranks[rank][label][run]
                assert row["left"] == (0, 0, 0), (label, run, rank)
                assert row["sizes"] and row["moved"] == row["sizes"], (label, run, rank)  # all of each stash moved
                assert row["high_host"] >= max(row["sizes"].values()) > 0
            assert ranks[rank][label]["plain"]["moved"] == {} and ranks[rank][label]["plain"]["high_host"] == 0
            through = ranks[rank][label].get("pass")
            if through is not None:  # the pass leaves short waits alone; what it moves, it moves whole
                assert through["left"] == (0, 0, 0)
                assert all(through["sizes"][key] == moved for key, moved in through["moved"].items()), (label, rank)
        if offload_pass() is not None and name in ("afab", "1f1b", "zbv"):  # (cap 1: every wait is short)
            assert any(ranks[r][label]["pass"]["moved"] for r in range(pp)), label


# -- the ledger: device bytes fall by the stash, host bytes rise by it --------------------------


def test_ledger_moves_each_stash_to_the_host_and_back():
    schedule = with_offload(compile_schedule("1f1b", pp=2, microbatches=4), lead=1)
    plain = InProcessPipeline(compile_schedule("1f1b", pp=2, microbatches=4), ModuleStages(make_chunks(2), loss_fn))
    plain.step(*make_data(2, 4))
    pipeline = InProcessPipeline(schedule, ModuleStages(make_chunks(2), loss_fn))
    pipeline.step(*make_data(2, 4))
    for rank, executor in enumerate(pipeline.executors):
        ledger = executor.ledger
        stash = ledger.sizes["stash", rank, 0]
        assert stash > 0 and all(ledger.sizes["stash", rank, mb] == stash for mb in range(4))
        before = {"stash": 0}, {"stash": 0}
        seen = {Op.OFFLOAD: 0, Op.RELOAD: 0}
        for (pc, instr, device), host in zip(ledger.trace, ledger.host_trace):
            if instr.op in seen:
                sign = 1 if instr.op is Op.OFFLOAD else -1
                assert device["stash"] == before[0]["stash"] - sign * stash, (rank, pc, instr)
                assert host["stash"] == before[1]["stash"] + sign * stash, (rank, pc, instr)
                seen[instr.op] += 1
            before = device, host
        assert seen == {Op.OFFLOAD: 4, Op.RELOAD: 4}
        assert ledger.live_total == ledger.host_total == 0
        assert ledger.moved == {("stash", rank, mb): stash for mb in range(4)}
        assert ledger.high_host["stash"] == ledger.high_host_total >= stash
        # The device high-water mark of the stash falls: rank 0 holds pp stashes under 1F1B
        # without offload, here at most the one in B plus the one reloaded ahead of the next B.
        assert plain.executors[rank].ledger.high["stash"] == (2 - rank) * stash
        assert ledger.high["stash"] <= min(2, 2 - rank) * stash
    assert pipeline.executors[0].offloader.copied_to_host == pipeline.executors[0].offloader.copied_to_device > 0


def _assert_matches_a_twin(layer, x):
    """`layer`'s and `x`'s gradients equal those of a copy of the layer run without hooks."""
    twin = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.GELU(), torch.nn.Linear(6, 3))
    twin.load_state_dict(layer.state_dict())
    x2 = x.detach().clone().requires_grad_()
    twin(x2).sum().backward()
    assert torch.equal(x.grad, x2.grad)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(layer.parameters(), twin.parameters()))


def test_offloaded_tensors_leave_the_device_and_come_back_as_new_storages():
    ledger = Ledger()
    ledger.add(("stash", 0, 0), 0)
    layer = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.GELU(), torch.nn.Linear(6, 3))
    x = torch.randn(5, 4, requires_grad=True)
    holders: list = []
    exclude = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
    with saved_storages(exclude, holders, ("stash", 0, 0)) as saved:
        y = layer(x)
    live = [ref() for ref in holders]
    assert live and all(h is not None and h.tensor is not None for h in live)
    values = [h.tensor.clone() for h in live]
    offloader = Offloader(torch.device("cpu"), ledger)
    offloader.offload(("stash", 0, 0), holders, "test")
    assert all(h.tensor is None for h in live)
    assert ledger.host["stash"] == sum(saved.values()) and ledger.live["stash"] == -sum(saved.values())
    with pytest.raises(RuntimeScheduleError, match=r"while it is offloaded to host memory"):
        y.sum().backward(retain_graph=True)  # the unpack hook refuses
    offloader.reload(("stash", 0, 0), "test")
    assert all(h.tensor is not None for h in live) and ledger.host["stash"] == 0
    assert all(torch.equal(h.tensor, v) for h, v in zip(live, values))  # the bytes came back
    y.sum().backward()
    _assert_matches_a_twin(layer, x)


# -- a use without RELOAD: a clear error on every rank --------------------------------------


def test_use_without_reload_raises_in_process():
    schedule = with_offload(compile_schedule("1f1b", pp=2, microbatches=4), drop_reload=(1, 2))
    pipeline = InProcessPipeline(schedule, ModuleStages(make_chunks(2), loss_fn))
    with pytest.raises(RuntimeScheduleError, match=r"1B2 uses the stash of \(stage 1, mb 2\), which is offloaded"):
        pipeline.step(*make_data(2, 4))


def missing_reload_worker(rank: int, world: int, store, timeout: float) -> None:
    torch.set_num_threads(1)
    schedule = with_offload(compile_schedule("zb_h1", pp=world, microbatches=4), drop_reload=(1, 2))
    executor = Executor(schedule, rank, ModuleStages(make_chunks(world), loss_fn), DistTransport(store),
                        timeout=timeout)
    executor.step(*make_data(world, 4))
    time.sleep(2 * timeout)  # a rank that wrongly finishes must not look like one that stopped


@pytest.mark.spawn
def test_use_without_reload_stops_every_rank():
    start = time.monotonic()
    with pytest.raises(LaunchError) as caught:
        spawn(missing_reload_worker, 2, timeout=60, args=(3.0,))
    assert time.monotonic() - start < 45
    failures = caught.value.failures
    assert sorted(failures) == [0, 1] and all(f.kind == "RuntimeScheduleError" for f in failures.values())
    assert "1B2 uses the stash of (stage 1, mb 2), which is offloaded to host memory (1OFFLOAD2:stash at pc" in \
        failures[1].message
    assert "needs a RELOAD of it before 1B2" in failures[1].message
    assert "another rank failed" in failures[0].message and "1B2 uses the stash" in failures[0].message


# -- the buffer pool ------------------------------------------------------------------------


def test_pool_capacity_is_the_schedule_peak_and_independent_of_m_for_1f1b():
    for rank in range(4):
        caps = [capacity(compile_schedule("1f1b", pp=4, microbatches=m), rank) for m in (8, 32, 128)]
        assert caps[0] == caps[1] == caps[2], (rank, caps)
    # all forwards first: every received act_in waits for its B (the schedule's memory, not the pool's)
    afab = [capacity(compile_schedule("afab", pp=4, microbatches=m), 1) for m in (8, 32)]
    assert [c["act_in"] for c in afab] == [8, 32] and [c["act_out"] for c in afab] == [1, 1]


def _pool_run(name: str, m: int, steps: int, **kwargs):
    schedule = compile_schedule(name, pp=4, microbatches=m, **kwargs)
    chunks = make_chunks(schedule.num_stages)
    pipeline = InProcessPipeline(schedule, ModuleStages(chunks, loss_fn))
    inputs, targets = make_data(schedule.num_stages, m)
    allocations = []
    for _ in range(steps):
        outputs = pipeline.step(inputs, targets)
        for executor in pipeline.executors:
            assert len(executor.buffers) == 0 and executor.ledger.live_total == 0
            assert not executor.pool.out and all(n == 0 for n in executor.pool.outstanding.values())
        allocations.append([e.pool.allocations for e in pipeline.executors])
    return schedule, pipeline, allocations, outputs, chunks


@pytest.mark.parametrize("name,kwargs", [("1f1b", {}), ("interleaved_1f1b", {"virtual": 2}), ("zbv", {})])
def test_pool_allocations_do_not_grow_with_microbatches_or_steps(name, kwargs):
    counts = {}
    for m in (8, 32):
        schedule, pipeline, allocations, outputs, chunks = _pool_run(name, m, 2, **kwargs)
        assert allocations[0] == allocations[1], (m, allocations)  # nothing allocated after the first step
        counts[m] = allocations[0]
        for rank, executor in enumerate(pipeline.executors):
            assert executor.pool.high == executor.pool.capacity, (m, rank)  # the static peak is tight
        ref = make_chunks(schedule.num_stages)
        inputs, targets = make_data(schedule.num_stages, m)
        reference(ref, inputs, targets)
        reference(ref, inputs, targets)
        mine, theirs = grads(chunks, range(schedule.num_stages)), grads(ref, range(schedule.num_stages))
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert counts[8] == counts[32] and sum(counts[8]) > 0


# -- through the offload pass, where it exists ----------------------------------------------


def test_through_add_offload_when_the_pass_exists():
    try:
        module = importlib.import_module("pipeschedule.compiler.offload")
    except ImportError:
        pytest.skip("pipeschedule.compiler.offload (add_offload) does not exist yet")
    add_offload = module.add_offload
    policy = _full_policy(module)
    for name, kwargs in (("1f1b", {}), ("zbv", {})):
        schedule = add_offload(compile_schedule(name, pp=2, microbatches=5, **kwargs), policy)
        assert any(i.op is Op.OFFLOAD for p in schedule.programs for i in p)
        chunks = make_chunks(schedule.num_stages)
        inputs, targets = make_data(schedule.num_stages, 5)
        pipeline = InProcessPipeline(schedule, ModuleStages(chunks, loss_fn))
        pipeline.step(inputs, targets)
        ref = make_chunks(schedule.num_stages)
        reference(ref, inputs, targets)
        mine, theirs = grads(chunks, range(schedule.num_stages)), grads(ref, range(schedule.num_stages))
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs), name
        assert any(e.ledger.moved for e in pipeline.executors)


def _full_policy(module):
    """A policy that offloads every stash, built from whatever the pass module offers."""
    for name in ("OffloadPolicy", "Policy"):
        cls = getattr(module, name, None)
        if cls is not None:
            for kwargs in ({"fraction": 1.0}, {}):
                try:
                    return cls(**kwargs)
                except TypeError:
                    continue
    return {"fraction": 1.0}


# -- streamed offload ([Note: streamed offload]) --------------------------------------------------


def test_a_streamed_stash_chunk_by_chunk():
    """One stash streamed by hand on CPU: every storage its own chunk, a window of one."""
    import gc

    key = ("stash", 0, 0)
    ledger = Ledger()
    layer = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.GELU(), torch.nn.Linear(6, 3))
    x = torch.randn(5, 4, requires_grad=True)
    holders: list = []
    exclude = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
    offloader = Offloader(torch.device("cpu"), ledger, chunk=1, window=1)
    stream = offloader.stream(key)
    with saved_storages(exclude, holders, key, stream.add) as saved:
        y = layer(x)
    stash = sum(saved.values())
    ledger.add(key, stash, hosted=stream.end_forward())
    # each chunk was copied when it filled: nothing of the stash is left on the device
    assert len(stream.chunks) == len(saved) >= 2 and all(c.state == "host" for c in stream.chunks)
    assert all(ref().tensor is None for ref in holders)
    assert (ledger.live["stash"], ledger.host["stash"], ledger.high["stash"]) == (0, stash, 0)
    offloader.offload(key, holders, "OFFLOAD")
    with pytest.raises(RuntimeScheduleError, match=r"while it is offloaded to host memory"):
        y.sum().backward(retain_graph=True)
    offloader.reload(key, "RELOAD")  # the window: the last chunk only
    last, first = stream.chunks[-1], stream.chunks[0]
    assert last.state == "in" and first.state == "host" and ledger.live["stash"] == last.nbytes
    holder = next(ref() for ref in holders if ref() is not None and ref().chunk is first)
    assert holder.get() is not None and first.state == "in"  # unpacked out of turn: fetched at once
    del holder
    y.sum().backward()
    _assert_matches_a_twin(layer, x)
    del y
    gc.collect()
    # every chunk came back, and autograd released each one as it went: nothing is left
    assert all(c.state == "in" for c in stream.chunks) and all(c.alive == 0 for c in stream.chunks)
    assert (ledger.live["stash"], ledger.host["stash"]) == (0, 0)
    assert offloader.copied_to_host == offloader.copied_to_device == stash


def test_streamed_ledger_holds_less_than_one_stash():
    """1F1B at pp=2: rank 0 holds two stashes without offload, at least one with whole-stash
    offload, and under one when streamed (stage 0 saves three storages; a window of one
    chunk holds two of them at most)."""
    def run(schedule, chunk):
        modules = make_chunks(2)
        pipeline = InProcessPipeline(schedule, ModuleStages(modules, loss_fn), offload_chunk=chunk, reload_window=1)
        pipeline.step(*make_data(2, 6))
        return pipeline.executors, grads(modules, range(2))

    plain = compile_schedule("1f1b", pp=2, microbatches=6)
    offloaded = with_offload(plain, lead=0, ranks=(0,))
    (base, plain_grads), (whole, _), (streamed, streamed_grads) = (run(plain, None), run(offloaded, None),
                                                                   run(offloaded, 1))
    stash = base[0].ledger.sizes["stash", 0, 0]
    assert base[0].ledger.high["stash"] == 2 * stash
    assert whole[0].ledger.high["stash"] >= stash
    assert 0 < streamed[0].ledger.high["stash"] < stash
    assert streamed[0].ledger.moved == {("stash", 0, mb): stash for mb in range(6)}
    assert streamed[0].ledger.live_total == streamed[0].ledger.host_total == 0
    assert plain_grads.keys() == streamed_grads.keys()
    assert all(torch.equal(plain_grads[k], streamed_grads[k]) for k in plain_grads)


def test_a_storage_saved_again_after_its_chunk_landed_is_copied_once():
    """A tensor saved twice in one F (as rotary tables are by every layer) joins the group
    its first save made, found through a weak reference to its storage; a storage that was
    freed meanwhile, whose address a new one reuses, starts a new group."""
    key = ("stash", 0, 0)
    ledger = Ledger()
    x = torch.randn(5, 4, requires_grad=True)
    table = torch.randn(5, 4)
    holders: list = []
    offloader = Offloader(torch.device("cpu"), ledger, chunk=1, window=1)
    stream = offloader.stream(key)
    with saved_storages({x.untyped_storage().data_ptr()}, holders, key, stream.add) as saved:
        h = torch.tanh(x * table)  # saves table, then tanh's output
        y = (h * table).sum()  # saves h and table again, after table's chunk has landed
    ledger.add(key, sum(saved.values()), hosted=stream.end_forward())
    groups = [g for c in stream.chunks for g in c.groups]
    assert len(groups) == 2 == len(saved)  # table once, h once
    assert sum(g.nbytes for g in groups) == sum(saved.values()) == ledger.host["stash"]
    table_group = next(g for g in groups if len(g.holders) == 2)
    assert all(holder.tensor is None for holder in table_group.holders)
    offloader.offload(key, holders, "OFFLOAD")
    offloader.reload(key, "RELOAD")
    y.backward()
    x2 = x.detach().clone().requires_grad_()
    (torch.tanh(x2 * table) * table).sum().backward()
    assert torch.equal(x.grad, x2.grad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (side stream, events, pinned memory)")
def test_streamed_offload_on_cuda_is_bitwise_exact():
    """On a GPU the copies run on the side streams: every stash of 1F1B and zb_h1 (pp=2,
    in one process; stages with a saved tensor backward never reads) offloaded whole or
    streamed (each storage its own chunk, windows 1 and 2; 1 MiB chunks), reloaded right
    before its B or one compute earlier; the gradients equal those without offload bit
    for bit, and the ledger ends empty."""
    device = torch.device("cuda")

    def stages():
        torch.manual_seed(0)
        return [torch.nn.Sequential(torch.nn.Linear(1024, 4096), _Unread(), torch.nn.GELU(),
                                    torch.nn.Linear(4096, 1024), torch.nn.GELU()).to(device) for _ in range(2)]

    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(512, 1024, generator=generator).to(device) for _ in range(6)]
    targets = [torch.randn(512, 1024, generator=generator).to(device) for _ in range(6)]

    def run(schedule, **args):
        modules = stages()
        pipeline = InProcessPipeline(schedule, ModuleStages(modules, loss_fn), device=device, **args)
        pipeline.step(inputs, targets)
        pipeline.step(inputs, targets)  # a second step reuses the host pool
        torch.cuda.synchronize()
        assert all(e.ledger.live_total == e.ledger.host_total == 0 for e in pipeline.executors)
        return {f"{s}.{name}": p.grad for s, m in enumerate(modules) for name, p in m.named_parameters()}

    for name in ("1f1b", "zb_h1"):  # zb_h1: split backward, W keeps the linear inputs
        plain = compile_schedule(name, pp=2, microbatches=6)
        expected = run(plain)
        for lead in (0, 1):
            schedule = with_offload(plain, lead=lead)
            for args in ({}, {"offload_chunk": 1, "reload_window": 1}, {"offload_chunk": 1, "reload_window": 2},
                         {"offload_chunk": 2**20}):
                got = run(schedule, **args)
                assert all(torch.equal(got[k], expected[k]) for k in expected), (name, lead, args)


class _SavedUnread(torch.autograd.Function):
    """Saves its input and never reads it back: the stash holds a tensor no unpack touches."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Unread(torch.nn.Module):
    def forward(self, x):
        return _SavedUnread.apply(x)


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_streamed_chunks_nobody_unpacks_return_their_host_buffers():
    """Stage 0 begins with two saved tensors that backward never reads: with one storage
    per chunk and a window of one, the first chunk is never brought back. Its host buffer
    returns at the FREE, so the host pool stops growing after the first step; the ledger
    ends empty every step; no weakref callback fails after the FREE; gradients are exact."""
    def modules():
        chunks = make_chunks(2)
        chunks[0] = torch.nn.Sequential(chunks[0][0], _Unread(), _Unread(), *chunks[0][1:])
        return chunks

    plain = compile_schedule("1f1b", pp=2, microbatches=4)
    expected_modules = modules()
    InProcessPipeline(plain, ModuleStages(expected_modules, loss_fn)).step(*make_data(2, 4))
    got_modules = modules()
    pipeline = InProcessPipeline(with_offload(plain, lead=1, ranks=(0,)), ModuleStages(got_modules, loss_fn),
                                 offload_chunk=1, reload_window=1)
    allocations = []
    for _ in range(3):
        for m in got_modules:
            m.zero_grad(set_to_none=True)
        pipeline.step(*make_data(2, 4))
        offloader = pipeline.executors[0].offloader
        allocations.append(offloader.host_pool.allocations)
        assert pipeline.executors[0].ledger.live_total == pipeline.executors[0].ledger.host_total == 0
        assert not offloader.streams and not offloader.chunks_out and not offloader.chunks_in
    assert allocations[0] > 0 and allocations[1] == allocations[2] == allocations[0]
    expected, got = grads(expected_modules, range(2)), grads(got_modules, range(2))
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_offload_between_b_and_w_of_a_streamed_stash():
    """zb_h1 with every stash of rank 0 streamed out after F and back before B, then
    offloaded again between B and W (what W keeps, moved whole) and back before W."""
    from pipeschedule.compiler.verify import verify

    plain = compile_schedule("zb_h1", pp=2, microbatches=4)
    schedule = with_offload(plain, lead=1, ranks=(0,))
    program = list(schedule.programs[0])
    for i in [i for i in program if i.op is Op.B]:
        program.insert(program.index(i) + 1, Instr(Op.OFFLOAD, i.stage, i.mb, buf="stash"))
        w = program.index(Instr(Op.W, i.stage, i.mb))
        program.insert(w, Instr(Op.RELOAD, i.stage, i.mb, buf="stash"))
    schedule = schedule.replace_programs([program, schedule.programs[1]])
    verify(schedule)

    def run(s, **args):
        chunks = make_chunks(2)
        pipeline = InProcessPipeline(s, ModuleStages(chunks, loss_fn), **args)
        pipeline.step(*make_data(2, 4))
        return pipeline.executors[0], grads(chunks, range(2))

    _, expected = run(plain)
    executor, got = run(schedule, offload_chunk=1)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert executor.ledger.live_total == executor.ledger.host_total == 0
    assert executor.offloader.copied_to_host > sum(executor.ledger.sizes[k] for k in executor.ledger.sizes
                                                   if k[0] == "stash")


# -- copies that land late: the CUDA paths on CPU -------------------------------------------------


class _LateEvent:
    """Stands in for a CUDA event on CPU: the copy was made at once, but the event reports
    it complete only after `after` queries (or a synchronize), so the offloader's
    bookkeeping runs as it does while a side stream is still copying."""

    def __init__(self, after: int):
        self.left = after

    def query(self) -> bool:
        if self.left <= 0:
            return True
        self.left -= 1
        return False

    def synchronize(self) -> None:
        self.left = 0


class _LateOffloader(Offloader):
    """`Offloader` whose copies out land `late[0]` queries late and copies back `late[1]`;
    counts the compute stream's waits."""

    def __init__(self, *args, late: tuple[int, int], **kwargs):
        super().__init__(*args, **kwargs)
        self.late, self.waits = late, 0

    def copy_out(self, groups):
        super().copy_out(groups)
        return _LateEvent(self.late[0])

    def copy_in(self, groups):
        targets, _ = super().copy_in(groups)
        return targets, _LateEvent(self.late[1])

    def compute_waits(self, event) -> None:
        self.waits += 1


@pytest.mark.parametrize("name, kwargs", [("1f1b", {}), ("zb_h1", {}), ("interleaved_1f1b", {"virtual": 2})])
def test_offload_with_copies_landing_late(name, kwargs):
    """Whole and streamed offload (one storage a chunk, windows 1 and 2) with copies that
    land at once, copies back that land 40 queries late (B waits on their events), and
    copies out that land 40 queries late (holders keep their device tensors until then,
    and a RELOAD that comes first keeps them: "kept"); the gradients are exact, the
    ledger and the host pool end as they began."""
    plain = compile_schedule(name, pp=2, microbatches=5, **kwargs)
    schedule = with_offload(plain, lead=1)

    def run(s, late=None, **args):
        chunks = make_chunks(s.num_stages)
        pipeline = InProcessPipeline(s, ModuleStages(chunks, loss_fn), **args)
        if late is not None:
            for e in pipeline.executors:
                e.offloader = _LateOffloader(e.device, e.ledger, args.get("offload_chunk"),
                                             args.get("reload_window", 2), late=late)
        pipeline.step(*make_data(s.num_stages, 5))
        return pipeline.executors, grads(chunks, range(s.num_stages))

    _, expected = run(plain)
    for late in ((0, 0), (0, 40), (40, 0)):
        for args in ({}, {"offload_chunk": 1, "reload_window": 1}, {"offload_chunk": 1, "reload_window": 2}):
            executors, got = run(schedule, late, **args)
            assert all(torch.equal(got[k], expected[k]) for k in expected), (late, args)
            moved = stashed = waits = 0
            for e in executors:
                pool = e.offloader.host_pool
                assert e.ledger.live_total == e.ledger.host_total == 0, (late, args)
                assert sum(len(v) for v in pool.free.values()) == pool.allocations, (late, args)  # all returned
                moved += sum(e.ledger.moved.values())
                stashed += sum(v for k, v in e.ledger.sizes.items() if k[0] == "stash")
                waits += e.offloader.waits
            if late == (0, 40):
                assert waits > 0, args  # B waited on copies back still running
            if late[0] == 0:
                assert moved == stashed, (late, args)  # every copy out landed before its RELOAD
            else:
                assert moved < stashed, (late, args)  # some were reloaded while still being copied out: kept
