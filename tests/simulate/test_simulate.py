"""The simulator: closed forms under unit costs, memory accounting, communication time,
deadlock, cost files, and agreement with a slow reference simulator."""

import json
import math
from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay import replay_high_water
from pipeschedule.errors import FormatError, ParameterError, ScheduleError
from pipeschedule.compiler.families import generate
from pipeschedule.compiler.ir import BUFFERS, COMM_OPS, COMPUTE_OPS, SEND_OPS, Instr, Op, Schedule
from pipeschedule.compiler.passes import lower
from pipeschedule.compiler.offload import OffloadPolicy, add_offload
from pipeschedule.simulate import CostModel, SimResult, load_cost, simulate
from pipeschedule.simulate.engine import EventLog, MemoryCurves, _Run
from strategies import build, examples, schedule_params

MICROBATCHES = (1, 2, 3, 4, 5, 8, 13)


def lowered(name, **params):
    return lower(generate(name, **params))


def exact_default(schedule):
    """CostModel.default with Fractions, so closed forms can be compared exactly."""
    unit = Fraction(1, schedule.virtual)
    stages = schedule.num_stages
    return CostModel((unit,) * stages, (2 * unit,) * stages, (0,) * stages,
                     {k: (1,) * stages for k in BUFFERS}, latency=0)


# -- closed forms under CostModel.default ------------------------------------------------


@pytest.mark.parametrize("pp", range(1, 9))
@pytest.mark.parametrize("m", MICROBATCHES)
def test_1f1b_step_time_and_bubble(pp, m):
    result = simulate(lowered("1f1b", pp=pp, microbatches=m))
    assert result.step_time == (m + pp - 1) * 3
    assert math.isclose(result.bubble_fraction, (pp - 1) / (m + pp - 1), abs_tol=1e-12)
    assert result.busy == (3 * m,) * pp


@pytest.mark.parametrize("pp", range(1, 9))
def test_1f1b_bubble_exact_with_fractions(pp):
    schedule = lowered("1f1b", pp=pp, microbatches=5)
    result = simulate(schedule, exact_default(schedule))
    assert result.bubble_fraction == Fraction(pp - 1, 5 + pp - 1)


def interleaved_cases():
    return [(v, pp, k * pp) for v in (2, 3, 4) for pp in range(1, 9) for k in (1, 2, 3)]


# Interleaved with m a multiple of p: bubble (p-1)/(v*m+p-1), exactly, through the lowered
# program (sends asynchronous; see [Note: message placement] in passes.py).
def test_interleaved_bubble_closed_form():
    wrong = []
    for v, pp, m in interleaved_cases():
        try:
            schedule = lowered("interleaved_1f1b", pp=pp, microbatches=m, virtual=v)
            bubble = simulate(schedule, exact_default(schedule)).bubble_fraction
        except ScheduleError as err:
            wrong.append((v, pp, m, f"deadlock at rank {err.rank}"))
            continue
        if bubble != Fraction(pp - 1, v * m + pp - 1):
            wrong.append((v, pp, m, bubble, (pp - 1) / (v * m + pp - 1)))
    assert not wrong, f"{len(wrong)} of {len(interleaved_cases())} cases: {wrong[:5]}"


@pytest.mark.parametrize("pp", range(1, 9))
@pytest.mark.parametrize("m", (1, 4, 8))
def test_interleaved_busy_and_bounds(pp, m):
    """What holds whatever the lowering: every rank computes 3m units, and the step
    takes at least the closed form's ideal (m + (p-1)/v) * 3."""
    v = 2
    result = simulate(lowered("interleaved_1f1b", pp=pp, microbatches=m, virtual=v))
    assert all(math.isclose(b, 3 * m) for b in result.busy)
    if m % pp == 0:
        assert result.step_time >= (m + (pp - 1) / v) * 3 - 1e-9


@pytest.mark.parametrize("pp", range(1, 9))
@pytest.mark.parametrize("m", MICROBATCHES)
def test_peak_inflight(pp, m):
    assert simulate(lowered("1f1b", pp=pp, microbatches=m)).peak_inflight == tuple(
        min(pp - r, m) for r in range(pp))
    assert simulate(lowered("afab", pp=pp, microbatches=m)).peak_inflight == (m,) * pp
    for cap in range(1, pp + 1):
        result = simulate(lowered("capped_1f1b", pp=pp, microbatches=m, cap=cap))
        assert result.peak_inflight == tuple(min(cap, pp - r, m) for r in range(pp)), cap


# -- memory -------------------------------------------------------------------------------


def test_peak_bytes_1f1b_by_hand():
    """1F1B, pp=2, m=3. Each buffer kind gets its own power of ten, so the peak shows
    which buffers were live. Rank 0 (stage 0: act_in, act_out, stash, grad_out):
        F0 +act_in +act_out +stash = 111; FREE act_out -> 101
        F1 -> 212; the batch after it posts RECV_B0: +grad_out -> 1212   <- peak
        FREE act_out -> 1202; B0 then FREE act_in, stash, grad_out -> 101; ...
    Rank 1 (stage 1, the last: act_in, stash, grad_in):
        RECV_F0 +act_in = 1; F0 +stash -> 101; B0 +grad_in -> 10101   <- peak
        FREE act_in, stash -> 10000; next batch RECV_F1 -> 10001; FREE grad_in -> 1; ...
    Under unit bytes the same trace gives 6 and 3 (2 * min(pp, m) + 2 on rank 0).
    """
    schedule = lowered("1f1b", pp=2, microbatches=3)
    unit = simulate(schedule)
    assert unit.peak_bytes == (6, 3)
    powers = dict(zip(BUFFERS, (1, 10, 100, 1000, 10000)))  # act_in, act_out, stash, grad_out, grad_in
    base = CostModel.default(schedule)
    cost = CostModel(base.forward, base.backward, base.weight, {k: (b, b) for k, b in powers.items()})
    assert simulate(schedule, cost).peak_bytes == (1212, 10101)


@pytest.mark.parametrize("pp", range(2, 7))
@pytest.mark.parametrize("m", (1, 2, 5, 8))
def test_peak_bytes_1f1b_rank0(pp, m):
    # In flight: act_in + stash per microbatch, plus the newest act_out and the grad_out
    # whose receive shares a batch with its send.
    assert simulate(lowered("1f1b", pp=pp, microbatches=m)).peak_bytes[0] == 2 * min(pp, m) + 2


@pytest.mark.parametrize("name,params", [
    ("1f1b", {}), ("afab", {}), ("capped_1f1b", {"cap": 2}), ("interleaved_1f1b", {"virtual": 2}),
    ("interleaved_1f1b", {"virtual": 3}),
])
def test_memory_curve(name, params):
    result = simulate(lowered(name, pp=4, microbatches=6, **params))
    for rank, curve in enumerate(result.memory):
        times = [t for t, _ in curve]
        assert times == sorted(times)
        assert all(times.count(t) <= 2 for t in times)  # the peak at an instant, then the value after
        assert curve[0][0] == 0 and curve[-1][1] == 0, rank
        assert max(b for _, b in curve) == result.peak_bytes[rank]
        assert curve[-1][0] <= result.step_time


# -- communication time -------------------------------------------------------------------


def test_latency_and_bandwidth_two_ranks():
    """pp=2, m=1: F0 on rank 0 (1), message to rank 1 (c1), F0 + B0 there (3), message
    back (c2), B0 on rank 0 (2): 6 + c1 + c2 with c = latency + bytes / bandwidth."""
    schedule = lowered("1f1b", pp=2, microbatches=1)
    base = CostModel.default(schedule)
    buffers = dict(base.buffer_bytes, act_out=(10, 0), grad_in=(0, 20))
    cost = CostModel(base.forward, base.backward, base.weight, buffers, latency=0.5, bandwidth=10)
    assert simulate(schedule, cost).step_time == 6 + (0.5 + 10 / 10) + (0.5 + 20 / 10)
    latency_only = CostModel(base.forward, base.backward, base.weight, buffers, latency=0.25)
    assert simulate(schedule, latency_only).step_time == 6.5
    assert simulate(schedule).step_time == 6


def test_latency_slows_a_longer_pipeline():
    schedule = lowered("1f1b", pp=4, microbatches=8)
    base = CostModel.default(schedule)
    times = [
        simulate(schedule, CostModel(base.forward, base.backward, base.weight, base.buffer_bytes,
                                     latency=latency, bandwidth=bandwidth)).step_time
        for latency, bandwidth in ((0, math.inf), (0.1, math.inf), (0.1, 4), (0.1, 1))
    ]
    assert times == sorted(times) and len(set(times)) == 4
    # Every message of the critical path pays the latency at least once each way.
    assert times[1] >= 33 + 2 * 3 * 0.1 - 1e-9


# -- deadlock -------------------------------------------------------------------------------


def two_ranks(rank0, rank1):
    return Schedule("hand", 2, 1, 1, (0, 1), (tuple(rank0), tuple(rank1)))


def test_deadlock_is_reported():
    # Rank 0 waits for a gradient before sending its activation; rank 1 waits for the
    # activation before sending the gradient.
    schedule = two_ranks(
        [Instr(Op.F, 0, 0), Instr(Op.RECV_B, 0, 0, peer=1), Instr(Op.B, 0, 0), Instr(Op.SEND_F, 0, 0, peer=1),
         Instr(Op.FREE, 0, 0, buf="act_in")],
        [Instr(Op.RECV_F, 1, 0, peer=0), Instr(Op.F, 1, 0), Instr(Op.B, 1, 0), Instr(Op.SEND_B, 1, 0, peer=0),
         Instr(Op.FREE, 1, 0, buf="act_in")],
    )
    with pytest.raises(ScheduleError) as info:
        simulate(schedule)
    err = info.value
    assert err.rule == "deadlock"
    assert (err.rank, err.index, err.instr, err.mb) == (0, 1, Instr(Op.RECV_B, 0, 0, peer=1), 0)
    assert "rank 0 at step 1" in str(err) and "rank 1 at step 0" in str(err)


def test_unmatched_send_is_an_error():
    schedule = two_ranks(
        [Instr(Op.F, 0, 0), Instr(Op.SEND_F, 0, 0, peer=1), Instr(Op.FREE, 0, 0, buf="act_out")],
        [Instr(Op.F, 1, 0), Instr(Op.FREE, 1, 0, buf="act_in")],
    )
    with pytest.raises(ScheduleError, match="is never received") as info:
        simulate(schedule)
    assert (info.value.rule, info.value.rank, info.value.index) == ("matching", 0, 1)


def test_peer_that_is_not_a_rank_deadlocks():
    schedule = two_ranks(
        [Instr(Op.RECV_F, 0, 0, peer=7), Instr(Op.F, 0, 0), Instr(Op.FREE, 0, 0, buf="act_in")],
        [Instr(Op.FREE, 1, 0, buf="act_in")],
    )
    with pytest.raises(ScheduleError, match="no rank 7"):
        simulate(schedule)


def test_batch_partners_in_both_directions_do_not_deadlock():
    # Both ranks send first and receive second in one batch: rule 4 lets that complete.
    schedule = two_ranks(
        [Instr(Op.F, 0, 0), Instr(Op.SEND_F, 0, 0, peer=1), Instr(Op.RECV_B, 0, 0, peer=1), Instr(Op.B, 0, 0)],
        [Instr(Op.SEND_B, 1, 0, peer=0), Instr(Op.RECV_F, 1, 0, peer=0), Instr(Op.F, 1, 0)],
    )
    assert simulate(schedule).step_time == 3


# -- events and results ------------------------------------------------------------------


def test_events_cover_every_instruction():
    schedule = lowered("interleaved_1f1b", pp=3, microbatches=5, virtual=2)
    cost = CostModel.default(schedule)
    result = simulate(schedule, cost)
    events = list(result.events)
    assert len(events) == len(result.events) == sum(len(p) for p in schedule.programs)
    assert events[7] == result.events[7] and events[-1] == result.events[-1]
    assert result.events[2:5] == events[2:5]
    for rank in range(schedule.pp):
        mine = [e for e in events if e.rank == rank]
        assert [e.index for e in mine] == list(range(len(schedule.programs[rank])))
        assert [e.instr for e in mine] == list(schedule.programs[rank])
        clock = 0  # a rank's clock: the latest end so far (a batch ends with its last message)
        for e in mine:
            assert e.start <= e.end
            if e.instr.op in COMPUTE_OPS:
                assert e.start == clock
                spent = {Op.F: cost.forward, Op.B: cost.backward}[e.instr.op][e.instr.stage]
                assert math.isclose(e.end - e.start, spent)
            elif e.instr.op is Op.FREE:
                assert e.start == e.end == clock
            if e.instr.op not in (Op.SEND_F, Op.SEND_B):  # a send does not hold its rank
                clock = max(clock, e.end)
        assert max(e.end for e in mine) <= result.step_time


def test_sends_are_asynchronous_and_receives_wait_for_the_transfer():
    schedule = lowered("1f1b", pp=3, microbatches=4)
    base = CostModel.default(schedule)
    result = simulate(schedule, CostModel(base.forward, base.backward, base.weight, base.buffer_bytes, latency=0.3))
    sends, recvs = {}, {}
    counts = Counter()
    for e in result.events:
        if e.instr.op in COMM_OPS:
            pair = (e.rank, e.instr.peer) if e.instr.op in SEND_OPS else (e.instr.peer, e.rank)
            key = (pair, e.instr.op in SEND_OPS)
            (sends if e.instr.op in SEND_OPS else recvs)[pair, counts[key]] = e
            counts[key] += 1
    assert sends.keys() == recvs.keys()
    for key, send in sends.items():
        recv = recvs[key]
        assert recv.end == max(send.start, recv.start) + 0.3
        assert send.end == recv.end  # a send's event spans its post to its message's completion
    # ... yet posting one costs the sender nothing: the instruction after a batch of sends
    # alone starts at the batch's post
    for rank in range(schedule.pp):
        events = list(result.events.of_rank(rank))
        for k, e in enumerate(events[:-1]):
            if e.instr.op in SEND_OPS and events[k + 1].instr.op not in COMM_OPS:
                batch = [x for x in events[:k + 1] if x.start == e.start and x.instr.op in COMM_OPS]
                if all(x.instr.op in SEND_OPS for x in batch):
                    assert events[k + 1].start == e.start


def test_compute_only_schedule_is_lowered_first():
    compute = generate("1f1b", pp=3, microbatches=4)
    assert simulate(compute).step_time == simulate(lower(compute)).step_time == 18


def test_result_to_dict_is_json():
    result = simulate(lowered("interleaved_1f1b", pp=2, microbatches=3, virtual=2))
    assert isinstance(result, SimResult)
    small = json.loads(json.dumps(result.to_dict()))
    assert set(small) >= {"step_time", "bubble_fraction", "busy", "peak_inflight", "peak_bytes"}
    full = json.loads(json.dumps(result.to_dict(memory=True, events=True)))
    assert len(full["events"]) == len(result.events)
    assert full["memory"][0][-1][1] == 0


# -- cost models -------------------------------------------------------------------------------


def test_default_cost():
    schedule = generate("interleaved_1f1b", pp=2, microbatches=2, virtual=4)
    cost = CostModel.default(schedule)
    assert cost.forward == (0.25,) * 8 and cost.backward == (0.5,) * 8 and cost.weight == (0.0,) * 8
    assert cost.buffer_bytes == {k: (1,) * 8 for k in BUFFERS}
    assert (cost.latency, cost.bandwidth) == (0.0, math.inf)


def test_cost_from_dict_and_back():
    schedule = generate("1f1b", pp=3, microbatches=2)
    cost = CostModel.from_dict({
        "forward": [1, 2, 3], "backward": 4, "buffer_bytes": {"stash": [5, 6, 7]},
        "latency": 0.5, "bandwidth": None,
    }, schedule)
    assert cost.forward == (1, 2, 3) and cost.backward == (4, 4, 4) and cost.weight == (0, 0, 0)
    assert cost.buffer_bytes["stash"] == (5, 6, 7) and cost.buffer_bytes["act_in"] == (1, 1, 1)
    assert cost.bandwidth == math.inf and cost.latency == 0.5
    again = CostModel.from_dict(json.loads(json.dumps(cost.to_dict())), schedule)
    assert again == cost


@pytest.mark.parametrize("obj,words", [
    ({"forwrd": 1}, ["'forwrd'", "forward"]),
    ({"forward": "fast"}, ["'forward'", "'fast'"]),
    ({"forward": [1, 2]}, ["'forward'", "2 entries", "3 stages"]),
    ({"backward": [1, -2, 3]}, ["'backward'", "-2"]),
    ({"buffer_bytes": {"activations": 3}}, ["activations", "act_in"]),
    ({"buffer_bytes": {"stash": [1, True, 1]}}, ["buffer_bytes.stash", "True"]),
    ({"bandwidth": 0}, ["'bandwidth'", "0"]),
    ({"latency": "1ms"}, ["'latency'", "'1ms'"]),
    ([1, 2], ["JSON object"]),
])
def test_bad_cost_dict(obj, words):
    with pytest.raises(FormatError) as info:
        CostModel.from_dict(obj, generate("1f1b", pp=3, microbatches=2))
    for word in words:
        assert word in str(info.value)


def test_load_cost(tmp_path):
    schedule = generate("1f1b", pp=2, microbatches=2)
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"forward": 2, "backward": 3}))
    assert simulate(lower(schedule), load_cost(str(path), schedule)).step_time == (2 + 1) * 5
    path.write_text("{not json")
    with pytest.raises(FormatError, match="cannot read cost model"):
        load_cost(str(path), schedule)
    with pytest.raises(FormatError, match="cannot read cost model"):
        load_cost(str(tmp_path / "missing.json"), schedule)


def test_cost_model_must_fit_the_schedule():
    schedule = lowered("1f1b", pp=2, microbatches=2)
    with pytest.raises(ParameterError, match="3 stages"):
        simulate(schedule, CostModel((1, 1, 1), 2, 0, {}))
    with pytest.raises(ParameterError, match="'backward'"):
        CostModel((1, 1), (1, 2, 3), 0, {})
    with pytest.raises(ParameterError, match="bandwidth"):
        CostModel((1, 1), 2, 0, {}, bandwidth=-1)


# -- agreement with a slow reference --------------------------------------------------------


def reference(schedule, cost):
    """A direct reading of [Note: simulated semantics], kept simple rather than fast:
    sweep the ranks until none moves; a rank posts a batch on arrival and completes it
    once the send of each of its receives has been posted (its own sends never hold it
    up). Returns (finish time per rank) or None on deadlock."""
    costs = {Op.F: cost.forward, Op.B: cost.backward, Op.W: cost.weight}
    pcs, clocks = [0] * schedule.pp, [0] * schedule.pp
    posted, message, counters, batches = {}, {}, Counter(), {}
    moved = True
    while moved:
        moved = False
        for rank, program in enumerate(schedule.programs):
            while pcs[rank] < len(program):
                instr = program[pcs[rank]]
                if instr.op not in COMM_OPS:
                    clocks[rank] += costs[instr.op][instr.stage] if instr.op in costs else 0
                    pcs[rank] += 1
                    moved = True
                    continue
                if rank not in batches:
                    keys, end = [], pcs[rank]
                    while end < len(program) and program[end].op in COMM_OPS:
                        op = program[end]
                        send = op.op in SEND_OPS
                        pair = (rank, op.peer) if send else (op.peer, rank)
                        key = (pair, counters[pair, send])
                        counters[pair, send] += 1
                        posted[key, send] = clocks[rank]
                        if send:
                            size = cost.buffer_bytes["act_out" if op.op is Op.SEND_F else "grad_in"][op.stage]
                            message[key] = cost.latency + size / cost.bandwidth
                        keys.append((key, send))
                        end += 1
                    batches[rank] = keys, end
                    moved = True
                keys, end = batches[rank]
                if not all((key, True) in posted for key, send in keys if not send):
                    break
                clocks[rank] = max([clocks[rank]] + [
                    max(posted[key, True], posted[key, False]) + message[key] for key, send in keys if not send])
                pcs[rank] = end
                del batches[rank]
                moved = True
    if any(pc < len(p) for pc, p in zip(pcs, schedule.programs)):
        return None
    return clocks


@settings(max_examples=examples(80))
@given(schedule_params(max_pp=6, max_m=10, max_v=3), st.data())
def test_matches_reference(family_params, data):
    family, params = family_params
    schedule = build(family, params, check=False)
    stages = schedule.num_stages
    times = st.lists(st.integers(1, 5), min_size=stages, max_size=stages)
    cost = CostModel(
        tuple(data.draw(times)), tuple(data.draw(times)), (0,) * stages,
        {k: tuple(data.draw(times)) for k in BUFFERS},
        latency=data.draw(st.sampled_from([0, 0.5, 2])), bandwidth=data.draw(st.sampled_from([math.inf, 1, 4])),
    )
    expected = reference(schedule, cost)
    if expected is None:
        with pytest.raises(ScheduleError):
            simulate(schedule, cost)
        return
    result = simulate(schedule, cost)
    assert math.isclose(result.step_time, max(expected))
    finish = [max((e.end for e in result.events.of_rank(rank) if e.instr.op not in SEND_OPS), default=0)
              for rank in range(schedule.pp)]  # a send's span does not hold its rank
    assert all(math.isclose(a, b) for a, b in zip(finish, expected))
    assert result.step_time >= max(result.busy)
    assert 0 <= result.bubble_fraction < 1
    for rank, curve in enumerate(result.memory):
        assert curve[-1][1] == 0
        assert max(b for _, b in curve) == result.peak_bytes[rank]


# -- a stash that shrinks at B (weight_stash) ---------------------------------------------------


@pytest.mark.parametrize("name,virtual", [("zb_h1", 1), ("zbv", 2), ("v_half", 2), ("v_min", 2)])
@pytest.mark.parametrize("m", [1, 4, 9])
def test_weight_stash_replays_the_ledgers_resize(name, virtual, m):
    """Stash only: bytes from F's start, down to weight_stash at B's end, gone at the
    FREE after W; every rank's peak equals the runtime tests' replay of a ledger whose
    stashes were resized at B (tests/replay.py)."""
    schedule = lower(generate(name, pp=4, microbatches=m, virtual=virtual))
    n = schedule.num_stages
    whole, kept = tuple(10 * (s + 1) for s in range(n)), tuple(3 * (s + 1) + s % 2 for s in range(n))
    sizes = {(kind, s, mb): (whole[s] if kind == "stash" else 0)
             for kind in BUFFERS for s in range(n) for mb in range(m)}
    resized = {("stash", s, mb): kept[s] for s in range(n) for mb in range(m)}
    unit = ((1.0,) * n, (1.0,) * n, (1.0,) * n)
    result = simulate(schedule, CostModel(*unit, {"stash": whole}, weight_stash=kept))
    assert list(result.peak_bytes) == [replay_high_water(schedule, r, sizes, resized) for r in range(schedule.pp)]
    assert all(curve[-1][1] == 0 for curve in result.memory)
    held_whole = simulate(schedule, CostModel(*unit, {"stash": whole}))
    assert all(a <= b for a, b in zip(result.peak_bytes, held_whole.peak_bytes))
    assert result.step_time == held_whole.step_time  # memory only


def test_weight_stash_changes_nothing_without_w_or_when_it_is_the_whole_stash():
    one = lower(generate("1f1b", pp=4, microbatches=6))
    unit = ((1.0,) * 4, (2.0,) * 4, (0.0,) * 4)
    plain = simulate(one, CostModel(*unit, {"stash": (5,) * 4}))
    assert simulate(one, CostModel(*unit, {"stash": (5,) * 4}, weight_stash=(1,) * 4)).memory == plain.memory
    zb = lower(generate("zb_h1", pp=4, microbatches=6))
    unit = ((1.0,) * 4, (1.0,) * 4, (1.0,) * 4)
    whole = simulate(zb, CostModel(*unit, {"stash": (5,) * 4}))
    same = simulate(zb, CostModel(*unit, {"stash": (5,) * 4}, weight_stash=(5,) * 4))
    assert same.peak_bytes == whole.peak_bytes and same.step_time == whole.step_time


def test_weight_stash_is_checked_and_round_trips():
    schedule = lower(generate("zb_h1", pp=2, microbatches=2))
    with pytest.raises(ParameterError, match=r"'weight_stash'.*>= 0"):
        CostModel((1.0,) * 2, (1.0,) * 2, (1.0,) * 2, {"stash": (8, 8)}, weight_stash=(2, -9))
    with pytest.raises(FormatError, match="weight_stash"):
        CostModel.from_dict({"buffer_bytes": {"stash": 4}, "weight_stash": [1, -1]}, schedule)
    with pytest.raises(FormatError, match="weight_stash"):
        CostModel.from_dict({"buffer_bytes": {"stash": 4}, "weight_stash": [1, 2, 3]}, schedule)
    cost = CostModel.from_dict({"buffer_bytes": {"stash": 4}, "weight_stash": 3}, schedule)
    assert cost.weight_stash == (3, 3)
    assert CostModel.from_dict(json.loads(json.dumps(cost.to_dict())), schedule) == cost
    assert "weight_stash" not in CostModel.default(schedule).to_dict()


def test_a_weight_stash_larger_than_the_stash_raises_the_peak_after_b():
    """W may keep more than F stashed (the act_in, the output gradients): the stash grows
    at B's end, and the peak sees it."""
    schedule = lower(generate("zb_h1", pp=2, microbatches=1))
    unit = ((1.0,) * 2, (1.0,) * 2, (1.0,) * 2)
    result = simulate(schedule, CostModel(*unit, {"stash": (0, 0)}, weight_stash=(7, 5)))
    assert result.peak_bytes == (7, 5)
    assert all(curve[-1][1] == 0 for curve in result.memory)


def test_weight_stash_with_offload_is_refused():
    from pipeschedule.compiler.offload import OffloadPolicy, add_offload

    schedule = add_offload(lower(generate("zb_h1", pp=2, microbatches=4)), OffloadPolicy(fraction=1.0, lead=0))
    cost = CostModel((1.0,) * 2, (1.0,) * 2, (1.0,) * 2, {"stash": (4, 4)}, weight_stash=(1, 1))
    with pytest.raises(ParameterError, match="not modelled together with OFFLOAD"):
        simulate(schedule, cost)


@pytest.mark.parametrize("name,virtual", [("zb_h1", 1), ("zbv", 2)])
def test_weight_stash_with_boundaries_exceeds_the_ledger_by_at_most_one_gradient(name, virtual):
    """The ledger resizes the stash before it adds B's grad_in; the simulator counts
    grad_in from B's start and resizes at B's end ([Note: when bytes count])."""
    schedule = lower(generate(name, pp=2, microbatches=3, virtual=virtual))
    n = schedule.num_stages
    sizes_by_kind = {"stash": 10, "act_in": 3, "act_out": 3, "grad_out": 5, "grad_in": 5}
    sizes = {(kind, s, mb): size for kind, size in sizes_by_kind.items() for s in range(n) for mb in range(3)}
    resized = {("stash", s, mb): 2 for s in range(n) for mb in range(3)}
    unit = ((1.0,) * n, (1.0,) * n, (1.0,) * n)
    result = simulate(schedule, CostModel(*unit, {k: (v,) * n for k, v in sizes_by_kind.items()},
                                          weight_stash=(2,) * n))
    for rank in range(schedule.pp):
        ledger = replay_high_water(schedule, rank, sizes, resized)
        assert ledger <= result.peak_bytes[rank] <= ledger + sizes_by_kind["grad_in"], (rank, ledger, result.peak_bytes)


# -- replayed memory curves ([Note: replayed memory] in engine.py) -------------------------------


def written_curves(schedule, cost):
    """The memory curves of the general loop, which writes every change as it goes."""
    trace = _Run(schedule, cost, general=True).trace()
    assert trace.replay is None
    return MemoryCurves(trace.memory), EventLog(schedule.programs, trace.ends, trace.waits, trace.channels)


@settings(max_examples=examples(120), deadline=None)
@given(schedule_params(max_pp=6, max_m=10, max_v=3), st.data())
def test_replayed_memory_curves_are_the_written_ones(family_params, data):
    family, params = family_params
    schedule = build(family, params)
    stages = schedule.num_stages
    times = st.lists(st.sampled_from([0, 1, 2.5, Fraction(1, 3)]), min_size=stages, max_size=stages)
    cost = CostModel(
        tuple(data.draw(times)), tuple(data.draw(times)), tuple(data.draw(times)),
        {k: tuple(data.draw(times)) for k in BUFFERS if data.draw(st.booleans())},
        latency=data.draw(st.sampled_from([0, 0.5, 2])), bandwidth=data.draw(st.sampled_from([math.inf, 1, 4])),
    )
    if sum(cost.forward) + sum(cost.backward) + sum(cost.weight) == 0:
        return
    result = simulate(schedule, cost)
    assert result.memory._changes is None  # replayed: nothing moves, no stash is resized
    curves, events = written_curves(schedule, cost)
    assert [list(result.memory[r]) for r in range(schedule.pp)] == [list(curves[r]) for r in range(schedule.pp)]
    assert list(result.events) == list(events)
    for rank, curve in enumerate(result.memory):
        assert max(b for _, b in curve) == result.peak_bytes[rank]
    plain, general = _Run(schedule, cost).trace(), _Run(schedule, cost, general=True).trace()
    for field in ("finish", "busy", "peak_inflight", "peak_bytes", "ends", "channels"):  # the two loops agree
        assert getattr(plain, field) == getattr(general, field), field


def test_a_replayed_curve_differs_where_the_bytes_do():
    # The comparison above can fail: the replay reads the same byte tables the run counts.
    schedule = lowered("1f1b", pp=3, microbatches=4)
    cost = CostModel.default(schedule)
    curves, _ = written_curves(schedule, cost)
    replayed = simulate(schedule, cost).memory
    assert replayed == curves
    trace_replay = replayed._replay
    trace_replay.nbytes = [0 if t.op.value == "FREE" and t.buf == "stash" else nbytes  # stashes freed as nothing
                           for t, nbytes in zip(trace_replay.templates, trace_replay.nbytes)]
    replayed._curves.clear()
    assert replayed != curves


def test_offload_and_resized_stashes_write_their_curves():
    schedule = add_offload(lowered("1f1b", pp=3, microbatches=4), OffloadPolicy(fraction=1.0, lead=0))
    cost = CostModel.default(schedule)
    result = simulate(schedule, cost)
    assert result.memory._changes is not None  # the second, writing run
    assert result.memory == written_curves(schedule, cost)[0]
