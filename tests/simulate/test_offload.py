"""Host offload (issue 9): the verifier's liveness with OFFLOAD / RELOAD, the simulator's
host link, the `add_offload` pass, the `choose_offload` search and the CLI flags."""

import json
import math
from dataclasses import replace
from fractions import Fraction

import pytest
from hypothesis import assume, given, settings, strategies as st

from pipeschedule.cli import main
from pipeschedule.errors import FormatError, ParameterError, ScheduleError
from pipeschedule.compiler.families import FAMILIES, generate
from pipeschedule.compiler.ir import Instr, Op
from pipeschedule.compiler.offload import OffloadPolicy, add_offload, stash_waits
from pipeschedule.compiler.offload_spec import AutoOffload, parse_offload
from pipeschedule.simulate.offload_search import choose_offload
from pipeschedule.compiler.passes import lower
from pipeschedule.simulate import CostModel, simulate
from pipeschedule.compiler.verify import verify
from strategies import examples


def lowered(name, **params):
    return lower(generate(name, **params))


def with_rank(schedule, rank, program):
    programs = list(schedule.programs)
    programs[rank] = tuple(program)
    return schedule.replace_programs(programs)


def insert_after(program, index, *instrs):
    return program[: index + 1] + tuple(instrs) + program[index + 1:]


def find(program, text):
    return next(k for k, i in enumerate(program) if str(i) == text)


def stash_only(schedule, out=float("inf"), into=float("inf")):
    base = CostModel.default(schedule)
    return CostModel(base.forward, base.backward, base.weight, {"stash": 1},
                     offload_bandwidth=out, reload_bandwidth=into)


# -- verifier -------------------------------------------------------------------------------------


def test_offload_and_reload_verify():
    s = lowered("1f1b", pp=2, microbatches=2)
    p = s.programs[0]
    p = insert_after(p, find(p, "0F0"), Instr(Op.OFFLOAD, 0, 0, buf="stash"))
    p = insert_after(p, find(p, "0RECV_B0@1") - 1, Instr(Op.RELOAD, 0, 0, buf="stash"))
    verify(with_rank(s, 0, p))


def test_use_of_an_offloaded_buffer_is_a_missing_reload():
    s = lowered("1f1b", pp=2, microbatches=2)
    p = insert_after(s.programs[0], find(s.programs[0], "0F0"), Instr(Op.OFFLOAD, 0, 0, buf="stash"))
    with pytest.raises(ScheduleError) as info:
        verify(with_rank(s, 0, p))
    err = info.value
    assert (err.rule, err.rank, str(err.instr), err.mb) == ("liveness", 0, "0B0", 0)
    assert "uses stash of (stage 0, mb 0), which is on the host (offloaded at step 1" in str(err)


def test_use_of_an_offloaded_send_buffer():
    s = lowered("1f1b", pp=2, microbatches=1)
    p = insert_after(s.programs[0], find(s.programs[0], "0F0"), Instr(Op.OFFLOAD, 0, 0, buf="act_out"))
    with pytest.raises(ScheduleError, match="rule liveness.*0SEND_F0@1.*act_out.*on the host"):
        verify(with_rank(s, 0, p))


def test_reload_without_offload():
    s = lowered("1f1b", pp=2, microbatches=2)
    p = insert_after(s.programs[0], find(s.programs[0], "0F0"), Instr(Op.RELOAD, 0, 0, buf="stash"))
    with pytest.raises(ScheduleError) as info:
        verify(with_rank(s, 0, p))
    assert info.value.rule == "liveness" and str(info.value.instr) == "0RELOAD0:stash"
    assert "on the device" in str(info.value) and "RELOAD needs an OFFLOAD before it" in str(info.value)


def test_double_offload():
    s = lowered("1f1b", pp=2, microbatches=2)
    off = Instr(Op.OFFLOAD, 0, 0, buf="stash")
    p = insert_after(s.programs[0], find(s.programs[0], "0F0"), off, off)
    with pytest.raises(ScheduleError) as info:
        verify(with_rank(s, 0, p))
    assert (info.value.rule, info.value.index) == ("liveness", 2)
    assert "offloads stash of (stage 0, mb 0), which is already on the host (offloaded at step 1" in str(info.value)


def test_offload_before_production_and_after_free():
    s = lowered("1f1b", pp=2, microbatches=1)
    p = (Instr(Op.OFFLOAD, 0, 0, buf="stash"),) + s.programs[0]
    with pytest.raises(ScheduleError, match="rule liveness.*never produced"):
        verify(with_rank(s, 0, p))
    p = s.programs[0] + (Instr(Op.OFFLOAD, 0, 0, buf="stash"),)
    with pytest.raises(ScheduleError, match="rule liveness.*freed at step"):
        verify(with_rank(s, 0, p))


def test_free_of_a_host_copy_is_allowed_and_a_host_leak_is_named():
    s = lowered("afab", pp=1, microbatches=1)  # F0 B0 and frees
    program = (Instr(Op.F, 0, 0), Instr(Op.B, 0, 0), Instr(Op.OFFLOAD, 0, 0, buf="stash"),
               Instr(Op.FREE, 0, 0, buf="act_in"), Instr(Op.FREE, 0, 0, buf="stash"))
    verify(with_rank(s, 0, program))
    with pytest.raises(ScheduleError, match="stash of \\(stage 0, mb 0\\) is never freed on the host"):
        verify(with_rank(s, 0, program[:-1]))


def test_offload_ends_a_communication_batch_like_free():
    """An OFFLOAD between two communication ops splits their batch (rule 4), as a FREE would."""
    from pipeschedule.compiler.verify import comm_batches

    s = lowered("1f1b", pp=2, microbatches=3)
    p = s.programs[0]
    k = next(k for k in range(len(p) - 1) if p[k].op is Op.SEND_F and p[k + 1].op is Op.RECV_B)
    split = with_rank(s, 0, insert_after(p, k, Instr(Op.OFFLOAD, 0, p[k].mb, buf="act_in"),
                                         Instr(Op.RELOAD, 0, p[k].mb, buf="act_in")))
    assert len(comm_batches(split)[1][0]) == len(comm_batches(s)[1][0]) + 1


# -- the pass -------------------------------------------------------------------------------------


def test_placement_in_1f1b():
    s = add_offload(lowered("1f1b", pp=2, microbatches=3), OffloadPolicy(1.0, ranks=(0,), lead=0))
    text = " ".join(map(str, s.programs[0]))
    assert text.startswith("0F0 0OFFLOAD0:stash 0SEND_F0@1 0FREE0:act_out 0F1 0OFFLOAD1:stash "
                           "0RELOAD0:stash 0SEND_F1@1")
    verify(s)
    assert s.programs[1] == lowered("1f1b", pp=2, microbatches=3).programs[1]


def test_fraction_takes_the_longest_waits_and_skips_short_ones():
    s = lowered("1f1b", pp=4, microbatches=8)
    waits = sorted(stash_waits(s.programs[0]), key=lambda w: (-w[0], w[1]))
    half = add_offload(s, OffloadPolicy(0.5, ranks=(0,), lead=1))
    moved = [i.mb for i in half.programs[0] if i.op is Op.OFFLOAD]
    assert sorted(moved) == sorted(w[4] for w in waits[:4])
    assert not any(i.op is Op.OFFLOAD for i in add_offload(s, OffloadPolicy(1.0, lead=99)).programs[0])
    assert add_offload(s, OffloadPolicy(0.0)).programs == s.programs


def test_bad_policies():
    with pytest.raises(ParameterError, match="fraction.*\\[0, 1\\].*1.5"):
        OffloadPolicy(1.5)
    with pytest.raises(ParameterError, match="lead.*-1"):
        OffloadPolicy(lead=-1)
    with pytest.raises(ParameterError, match="ranks.*distinct"):
        OffloadPolicy(ranks=(0, 0))
    s = lowered("1f1b", pp=2, microbatches=2)
    with pytest.raises(ParameterError, match="ranks \\[5\\].*0..1"):
        add_offload(s, OffloadPolicy(ranks=(5,)))
    with pytest.raises(ParameterError, match="3 entries.*pp=2"):
        add_offload(s, OffloadPolicy((1, 1, 1)))
    with pytest.raises(ParameterError, match="already has OFFLOAD"):
        add_offload(add_offload(s, OffloadPolicy(lead=0)), OffloadPolicy())
    with pytest.raises(ParameterError, match="budget.*-0.1"):
        AutoOffload(budget=-0.1)


@st.composite
def offload_cases(draw):
    family = draw(st.sampled_from(sorted(FAMILIES)))
    pp, m = draw(st.integers(1, 6)), draw(st.integers(1, 16))
    params = {"pp": pp, "microbatches": m}
    if family == "interleaved_1f1b":
        params["virtual"] = draw(st.integers(1, 3))
    if family == "capped_1f1b":
        params["cap"] = draw(st.integers(1, pp))
    fraction = draw(st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(0, 1)))
    ranks = draw(st.one_of(st.none(), st.just((0,))))
    return family, params, OffloadPolicy(fraction, ranks, draw(st.integers(0, 4)))


@settings(max_examples=examples(150), deadline=None)
@given(offload_cases())
def test_add_offload_always_verifies(case):
    family, params, policy = case
    try:
        schedule = lowered(family, **params)
    except ParameterError:
        assume(False)
    moved = add_offload(schedule, policy)
    verify(moved)
    # only OFFLOAD / RELOAD were added, in pairs, and the rest kept its order
    for before, after in zip(schedule.programs, moved.programs):
        assert tuple(i for i in after if i.op not in (Op.OFFLOAD, Op.RELOAD)) == before
        assert sum(i.op is Op.OFFLOAD for i in after) == sum(i.op is Op.RELOAD for i in after)
    # with a free host link nothing gets slower and no peak grows
    cost = stash_only(schedule)
    a, b = simulate(schedule, cost), simulate(moved, cost)
    assert b.step_time == a.step_time
    assert all(y <= x for x, y in zip(a.peak_bytes, b.peak_bytes))


# -- the simulator --------------------------------------------------------------------------------


def test_infinite_bandwidth_costs_nothing_and_frees_exactly_the_offloaded_bytes():
    s = lowered("afab", pp=1, microbatches=4)  # F0..F3 then B0..B3: 4 stashes at once
    moved = add_offload(s, OffloadPolicy(1.0, lead=0))
    cost = stash_only(s)
    a, b = simulate(s, cost), simulate(moved, cost)
    assert a.step_time == b.step_time == 12
    # every stash leaves as soon as its F ends (waits: 3 computes each) and comes back right
    # after the compute before its B, once the previous B freed its own: the peak falls by
    # exactly the three stashes that are on the host when F3 runs
    assert (a.peak_bytes, b.peak_bytes, b.peak_host_bytes) == ((4,), (1,), (4,))
    assert a.peak_host_bytes == (0,)


def test_copies_take_time_and_queue_per_direction():
    s = lowered("afab", pp=1, microbatches=2)  # F0 F1 B0 B1, F=1, B=2
    moved = add_offload(s, OffloadPolicy(0.5, lead=0))  # mb 0 (equal waits: the earlier F)
    assert " ".join(map(str, moved.programs[0])).startswith("0F0 0OFFLOAD0:stash 0F1 0RELOAD0:stash 0B0")
    slow = replace(stash_only(s), offload_bandwidth=0.5, reload_bandwidth=0.25)  # 2 and 4 time units
    result = simulate(moved, slow)
    events = {str(e.instr): e for e in result.events}
    assert (events["0OFFLOAD0:stash"].start, events["0OFFLOAD0:stash"].end) == (1, 3)
    # the reload waits for the offload to land (3), then takes 4; B0 waits for it
    assert (events["0RELOAD0:stash"].start, events["0RELOAD0:stash"].end) == (2, 7)
    assert (events["0B0"].start, events["0B0"].end) == (7, 9) and result.step_time == 11
    # F1's stash, stash 0 still being copied out and stash 0 coming back: 3 at t=2
    assert result.peak_bytes == (3,) and result.peak_host_bytes == (1,)
    assert result.memory[0] == ((0, 1), (1, 2), (2, 3), (3, 2), (9, 2), (9, 1), (11, 1), (11, 0))


def test_slowdown_stretches_compute_during_copies():
    s = lowered("afab", pp=1, microbatches=2)
    moved = add_offload(s, OffloadPolicy(1.0, lead=0))
    cost = replace(stash_only(s), offload_bandwidth=0.5, offload_slowdown=0.5)
    events = {str(e.instr): e for e in simulate(moved, cost).events}
    assert events["0F1"].end - events["0F1"].start == 1.5  # the copy (1..3) covers all of F1


def test_cost_model_host_link_fields_round_trip():
    s = generate("1f1b", pp=2, microbatches=2)
    cost = CostModel.from_dict({"offload_bandwidth": 5, "reload_bandwidth": None, "offload_slowdown": 0.1}, s)
    assert (cost.offload_bandwidth, cost.reload_bandwidth, cost.offload_slowdown) == (5, float("inf"), 0.1)
    assert CostModel.from_dict(cost.to_dict(), s) == cost
    with pytest.raises(ParameterError, match="offload_bandwidth.*0"):
        replace(cost, offload_bandwidth=0)


# -- the claim ----------------------------------------------------------------------------

# [Note: offload figures] Issue 9's measurements on the H200: one Llama-style layer (hidden
# 2048, sequence 4096, bf16, SDPA) runs forward in 1.03 ms and backward in 2.19 ms; pinned
# copies move 55.4 GB/s each way. Its stash per layer, by the memory model's Korthikanti
# formula with flash attention (34 s*b*h bytes), is 285,212,672 bytes. A stage of 8 such
# layers, 1F1B at pp=4 with 16 microbatches, 20 us per pipeline message. (The calibrated
# cost files in benchmarks/results come from the CPU run of a tiny model whose stash moves
# in microseconds; they would not tell the two links apart.) Times in ms, so bandwidths
# in bytes per ms: GB/s * 1e6. GH200's NVLink-C2C: 450 GB/s per direction.
LAYERS, STASH = 8, 34 * 4096 * 2048 * 8


def claim_cost(gbps):
    return CostModel((1.03 * LAYERS,) * 4, (2.19 * LAYERS,) * 4, 0, {"stash": STASH}, latency=0.02,
                     offload_bandwidth=gbps * 1e6, reload_bandwidth=gbps * 1e6)


def test_gh200_halves_stage_0_at_no_cost_and_pcie_cannot():
    schedule = lowered("1f1b", pp=4, microbatches=16)
    gh200 = choose_offload(schedule, claim_cost(450), 0.03)
    verify(gh200.schedule)
    assert gh200.policy == OffloadPolicy((1.0, 1.0, 0.0, 0.0), None, (1, 1, 0, 0))
    assert gh200.counts == ((16, 16), (16, 16), (0, 16), (0, 16))
    assert gh200.peak_before == (4 * STASH, 3 * STASH, 2 * STASH, STASH)
    # Stage 0 holds two microbatches' stash at its peak, not four, at no cost in time. Not
    # one: a stage's stash is one buffer, and while F(i)'s is copied out (5.07 ms) the one
    # the next B needs must already be coming back. Reaching one needs layer-sized buffers.
    assert gh200.peak_after == (2 * STASH, 2 * STASH, 2 * STASH, STASH)
    assert gh200.slowdown == 0.0 and gh200.step_time == pytest.approx(490.14, abs=1e-6)
    assert gh200.peak_host == (4 * STASH, 3 * STASH, 0, 0)
    # Reloading only right before the B (lead 0) gets no lower and costs 11%.
    lead0 = simulate(add_offload(schedule, OffloadPolicy(1.0, (0,), 0)), claim_cost(450))
    assert lead0.peak_bytes[0] == 2 * STASH
    assert lead0.step_time / gh200.base_step_time - 1 == pytest.approx(0.1129, abs=1e-4)

    # On the H200's PCIe link a copy (41.2 ms) outlasts a whole F+B (25.8 ms): no fraction
    # lowers stage 0's peak within 3% (the warmup's four stashes cannot leave in time).
    h200 = choose_offload(schedule, claim_cost(55.4), 0.03)
    assert h200.counts == ((0, 16),) * 4 and h200.peak_after == h200.peak_before
    full = simulate(add_offload(schedule, OffloadPolicy(1.0, (0,), 1)), claim_cost(55.4))
    assert full.peak_bytes[0] == 5 * STASH
    assert full.step_time / h200.base_step_time - 1 == pytest.approx(0.9457, abs=1e-4)


# -- the --offload spec and the CLI ---------------------------------------------------------------


def test_parse_offload():
    assert parse_offload("fraction=0.5") == OffloadPolicy(0.5, None, 1)
    assert parse_offload("fraction=1/0.5,ranks=0/1,lead=2") == OffloadPolicy((1.0, 0.5), (0, 1), 2)
    assert parse_offload("auto") == AutoOffload()
    assert parse_offload("auto,budget=0.05,ranks=0") == AutoOffload(0.05, (0,))
    assert parse_offload(OffloadPolicy((1.0, 0.5), (0, 1), 2).text()) == OffloadPolicy((1.0, 0.5), (0, 1), 2)
    assert parse_offload("fraction=1,stream=256") == OffloadPolicy(1.0, None, 1, 256 * 2**20)
    assert parse_offload("auto,stream=0.5") == AutoOffload(chunk=2**19)
    streamed_policy = OffloadPolicy((1.0, 0.5), None, 0, 64 * 2**20)
    assert parse_offload(streamed_policy.text()) == streamed_policy


@pytest.mark.parametrize("spec,words", [
    ("", ["needs a value"]),
    ("fraction=2", ["'fraction=2'", "[0, 1]", "2.0"]),
    ("fraction=nan", ["not finite"]),
    ("fraction=0.5,lead=x", ["lead='x'", "integer"]),
    ("frac=1", ["cannot read 'frac=1'", "accepted"]),
    ("lead=1", ["fraction= is missing"]),
    ("auto,budget=-1", ["budget", "-1"]),
    ("auto,fraction=1", ["cannot read 'fraction=1'"]),
    ("fraction=1,stream=0", ["stream", "at least one byte", "'0'"]),
    ("auto,stream=x", ["stream='x'", "a number"]),
    ("auto,stream=1/2", ["stream takes one number", "'1/2'"]),
])
def test_bad_offload_specs(spec, words):
    with pytest.raises(ParameterError) as info:
        parse_offload(spec)
    for word in words:
        assert word in str(info.value)


def test_cli_offload(tmp_path, capsys):
    path = tmp_path / "s.json"
    assert main(["compile", "1f1b", "--pp", "4", "-m", "8", "--offload", "fraction=1,ranks=0,lead=1",
                 "--json", str(path)]) == 0
    assert "stashes offloaded per rank 8/8, 0/8, 0/8, 0/8" in capsys.readouterr().out
    assert main(["verify", str(path)]) == 0
    capsys.readouterr()
    assert main(["simulate", "1f1b", "--pp", "4", "-m", "8", "--offload", "auto", "--host-bandwidth", "450"]) == 0
    out = capsys.readouterr().out
    assert "peak host bytes" in out and "offload fraction=" in out


@pytest.mark.parametrize("argv,words", [
    (["simulate", "1f1b", "--pp", "2", "-m", "2", "--offload", "fraction=7"], ["fraction=7", "[0, 1]"]),
    (["simulate", "1f1b", "--pp", "2", "-m", "2", "--offload", "auto", "--host-bandwidth", "0"],
     ["--host-bandwidth", "> 0"]),
    (["compile", "1f1b", "--pp", "2", "-m", "2", "--json", "x", "--offload", "fraction=1,ranks=3"],
     ["ranks [3]", "0..1"]),
    (["plan", "--model", "llama3-8b", "--pp", "2", "--microbatches", "4", "--gpu", "h100", "--offload", "auto"],
     ["--host-bandwidth", "h100"]),
])
def test_cli_bad_offload(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    for word in words:
        assert word in err


def test_plan_reports_offload(capsys):
    argv = ["plan", "--model", "llama3-8b", "--pp", "4", "--microbatches", "8", "--tables", "none"]
    assert main(argv) in (0, 1)
    plain = capsys.readouterr().out
    assert "Offload" not in plain
    assert main(argv + ["--offload", "auto"]) in (0, 1)
    out = capsys.readouterr().out
    assert out.startswith(plain.split("Hint:")[0].split("Recommended:")[0])
    assert "host link 450 GB/s per direction" in out and "(the tightest) at a predicted slowdown of" in out
    assert main(argv + ["--offload", "auto,stream=64", "--json"]) in (0, 1)
    streamed = json.loads(capsys.readouterr().out)["offload"]
    assert streamed["chunk"] == 64 * 2**20 and "stream=64" in streamed["policy"]


# -- streamed offload ([Note: simulated streaming] in simulate/engine.py) -----------------------------------


def test_a_streamed_stash_piece_by_piece():
    """One stash of 300 bytes in 3 pieces through a link of 100 bytes per time unit,
    F and B 3 time units each (1 per piece), window 2: every point worked out by hand."""
    from pipeschedule.simulate.hostlink import GONE, HostLink
    from pipeschedule.simulate.engine import _point

    times, values = [0], [0]
    link = HostLink(100, 100, 0.0, times, values, _point, chunk=100, window=2)
    key = ("stash", 0, 0)
    # F from 0 to 3: piece j counts from j-1, is copied from j (1 unit) and leaves at j+1
    live, peak, spend = link.stream_out(key, 300, 0, 3, 0, 0)
    assert (peak, spend) == (200, 3) and link.peak_host == 300
    live, done = link.offload(key, 300, 3, live)
    assert done == 4  # the OFFLOAD ends when the last piece lands
    live = link.drain(10, live)
    assert live == 0 and (times, values) == ([0, 1, 2, 3, 4], [100, 200, 200, 100, 0])
    # RELOAD at 10: pieces 3 and 2 come back (land at 11 and 12); B from 10 starts on
    # piece 3 at 11 (a 1-unit wait), which issues piece 1 (lands 13, after piece 2)
    live, peak, done = link.reload(key, 300, 10, live, 0)
    assert (live, done) == (200, 12)
    live, peak, end = link.stream_b(key, 10, 3, live, peak, keep=False)
    assert (live, peak, end) == (0, 300, 14)
    assert (times[5:], values[5:]) == ([10, 11, 12, 13, 14], [200, 300, 200, 100, 0])
    assert link.host == 0 and link.free(key, 300, 14, live) == (0, 0)  # B released it all
    assert link.moved == {} and GONE == "gone"


def test_a_streamed_stash_kept_for_w_stays_until_its_free():
    from pipeschedule.simulate.hostlink import HostLink
    from pipeschedule.simulate.engine import _point

    times, values = [0], [0]
    link = HostLink(100, 100, 0.0, times, values, _point, chunk=100, window=1)
    key = ("stash", 0, 0)
    live, peak, _ = link.stream_out(key, 300, 0, 3, 0, 0)
    live, peak, end = link.stream_b(key, 10, 3, link.drain(10, live), peak, keep=True)  # no RELOAD: at the B
    # window 1: piece 3 lands at 11, piece 2 issued then lands 12, piece 1 lands 13
    assert (live, end) == (300, 14)
    assert link.ready((("stash", 0, None),), 0, 12) == 14  # W (which reads the stash) waits for the whole stash
    assert link.free(key, 300, 20, live) == (300, 300)


def stream_cases():
    return offload_cases().flatmap(lambda case: st.tuples(
        st.just(case), st.sampled_from([1, 3, 7]), st.integers(1, 3),
        st.sampled_from([Fraction(1, 2), Fraction(3), None]), st.sampled_from([0, Fraction(1, 2)])))


def fraction_cost(schedule, stash, bandwidth, **extra):
    base = CostModel.default(schedule)
    return CostModel(tuple(map(Fraction, base.forward)), tuple(map(Fraction, base.backward)),
                     tuple(map(Fraction, base.weight)), {"stash": stash, "act_out": 1, "grad_in": 1},
                     latency=Fraction(1, 10),
                     offload_bandwidth=bandwidth or math.inf, reload_bandwidth=bandwidth or math.inf, **extra)


@settings(max_examples=examples(120), deadline=None)
@given(stream_cases())
def test_streaming_in_one_piece_is_the_whole_stash_and_a_free_link_costs_nothing(case):
    (family, params, policy), stash, window, bandwidth, slowdown = case
    try:
        schedule = lowered(family, **params)
    except ParameterError:
        assume(False)
    moved = add_offload(schedule, policy)
    cost = fraction_cost(schedule, stash, bandwidth, offload_slowdown=slowdown)
    whole = simulate(moved, cost)
    one = simulate(moved, replace(cost, offload_chunk=stash, reload_window=window))
    assert (one.step_time, one.peak_bytes, one.busy) == (whole.step_time, whole.peak_bytes, whole.busy)
    # in pieces of one byte: over a free link, no time at all, and never more than whole
    pieces = simulate(moved, replace(cost, offload_chunk=1, reload_window=window))
    if bandwidth is None:
        base = simulate(schedule, cost)
        assert pieces.step_time == base.step_time and pieces.busy == base.busy
        assert all(p <= w for p, w in zip(pieces.peak_bytes, whole.peak_bytes))
    # nothing leaks: every rank ends with nothing on the device or the host
    assert all(curve[-1][1] == 0 for curve in pieces.memory)
    if not slowdown:
        assert pieces.busy == whole.busy  # waits for pieces are not work


def test_a_streamed_f_is_slowed_once_by_the_copies_beside_it():
    """afab pp=1: F0 F1 B0 B1, F=1, both stashes streamed in 2 pieces over a link of 1
    byte per unit (a piece of 1 byte takes 1), slowdown 0.5."""
    s = lowered("afab", pp=1, microbatches=2)
    moved = add_offload(s, OffloadPolicy(1.0, lead=0))
    cost = replace(stash_only(s, out=1, into=1), buffer_bytes={"stash": 2}, offload_slowdown=0.5, offload_chunk=1)
    events = {str(e.instr): e for e in simulate(moved, cost).events}
    # F0 (0..1): its first piece's copy runs 0.5..1.5 beside the second half: 1 + 0.5 * 0.5
    assert (events["0F0"].start, events["0F0"].end) == (0, 1.25)
    # F1 from 1.25: F0's pieces keep the queue busy until 2.5, beside all of F1's unit: 1.5,
    # to 2.75; its first piece (made by 2.0) is copied after them, 2.5..3.5, beside F1's
    # last 0.25, which the first stretch did not count: + 0.125. Counted once each.
    assert (events["0F1"].start, events["0F1"].end) == (1.25, 2.875)


def test_streamed_offload_reaches_the_gh200_target():
    """Issue 9's target, in simulation with GH200's link: stage 0's peak stash at most one
    microbatch's, for at most 3% step time, with a 2% compute slowdown during copies."""
    schedule = lowered("1f1b", pp=4, microbatches=16)
    cost = replace(claim_cost(450), offload_slowdown=0.02)
    choice = choose_offload(schedule, cost, AutoOffload(0.03, chunk=STASH // LAYERS))  # one layer's stash
    verify(choice.schedule)
    assert choice.peak_before[0] == 4 * STASH
    assert choice.peak_after[0] <= STASH and choice.slowdown <= 0.03
    assert choice.peak_after[0] == 3 * STASH // 8 and choice.slowdown == pytest.approx(0.0197, abs=1e-4)
    assert choice.policy.chunk == STASH // LAYERS and "stream=272" in choice.policy.text()
    # whole stashes cannot: two stashes at best within the budget (the test above)
    whole = choose_offload(schedule, cost, 0.03)
    assert whole.peak_after[0] >= 2 * STASH
    # and on the H200's PCIe link streaming does not help either: copies outlast compute
    pcie = choose_offload(schedule, replace(claim_cost(55.4), offload_slowdown=0.02),
                          AutoOffload(0.03, chunk=STASH // LAYERS))
    assert pcie.peak_after == pcie.peak_before


def test_stream_cost_fields_round_trip_and_refuse_bad_values():
    s = generate("1f1b", pp=2, microbatches=2)
    cost = CostModel.from_dict({"offload_chunk": 1024, "reload_window": 3}, s)
    assert (cost.offload_chunk, cost.reload_window) == (1024, 3)
    assert CostModel.from_dict(cost.to_dict(), s) == cost
    assert "offload_chunk" not in CostModel.default(s).to_dict()
    with pytest.raises(ParameterError, match="offload_chunk.*0"):
        replace(cost, offload_chunk=0)
    with pytest.raises(ParameterError, match="reload_window.*0"):
        replace(cost, reload_window=0)
    with pytest.raises(FormatError, match="reload_window.*'2'"):
        CostModel.from_dict({"reload_window": "2"}, s)
    with pytest.raises(ParameterError, match="chunk.*-1"):
        OffloadPolicy(chunk=-1)
