"""Stage graphs ([Note: stage graph] in pipeschedule/compiler/graph.py): the edges a schedule
carries, their instructions ([Note: peer stage]), lowering and every verifier rule over
edges, on random graphs of every family and placement; broken graph schedules refused
with the rule and the edge named; chain schedules unchanged."""

import json
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeschedule import (
    FormatError, Instr, Op, ParameterError, Schedule, ScheduleError, compile_schedule, forward_only, generate,
    on_graph, verify,
)
from pipeschedule.compiler.graph import StageGraph, chain_edges
from pipeschedule.compiler.offload import add_offload, OffloadPolicy
from pipeschedule.compiler.timing import _asap_general, asap
from pipeschedule.compiler.program import packed
from pipeschedule.compiler.timing import unit_stage_times
from pipeschedule.compiler.torch_csv import write_csv

from strategies import FAMILY_NAMES, examples, graph_schedules, schedule_params, stage_graphs

checks = sys.modules["pipeschedule.compiler.verify"]
walk = sys.modules["pipeschedule.compiler.walk"]

DIAMOND = [(0, 1), (0, 2), (1, 3), (2, 3)]  # nanotron's test_pipeline_engine_diamond at pp=4


def rules_pass(schedule):
    """Every rule, run one by one as RULES lists them (each may assume those before it)."""
    for rule in checks.RULES:
        rule(schedule)


# -- the graph -------------------------------------------------------------------------


@pytest.mark.parametrize("edges, fragment", [
    ([(1, 0), (0, 2), (2, 3)], r"edge \(1, 0\) goes backward"),
    ([(0, 1), (1, 1), (1, 2)], r"edge \(1, 1\) goes backward or to itself"),
    ([(0, 1), (1, 2), (2, 4)], r"edge \(2, 4\) names a stage outside 0..3"),
    ([(0, 1), (0, 1), (1, 2), (2, 3)], r"edge \(0, 1\) is given twice"),
    ([(0, 1), (1, 3), (0, 3)], "stage 2 has no producer"),
    ([(0, 1), (0, 2), (0, 3), (2, 3)], "stage 1's output reaches no consumer"),
    ([[0, 1, 2]], r"edge \[0, 1, 2\] is not a pair"),
    ("01", "edges must be a list"),
])
def test_a_bad_graph_is_refused_naming_the_edge(edges, fragment):
    with pytest.raises(FormatError, match=fragment):
        StageGraph.of(4, edges)
    with pytest.raises(ParameterError, match="edges: " + fragment):
        generate("1f1b", pp=4, microbatches=2, edges=edges)


def test_the_graph_lists_producers_and_consumers():
    graph = StageGraph.of(4, [(2, 3), (0, 2), (1, 3), (0, 1)])
    assert graph.edges == tuple(DIAMOND) and not graph.chain
    assert graph.producers == ((), (0,), (0,), (1, 2)) and graph.consumers == ((1, 2), (3,), (3,), ())
    assert StageGraph.of(4).edges == chain_edges(4) and StageGraph.of(4, chain_edges(4)).chain


# -- instructions and the forms of a schedule --------------------------------------------


def test_peer_stage_is_written_only_off_the_neighbour():
    assert Instr(Op.SEND_F, 0, 3, 2, peer_stage=2).to_dict() == {
        "op": "SEND_F", "stage": 0, "mb": 3, "peer": 2, "peer_stage": 2}
    assert str(Instr(Op.SEND_F, 0, 3, 2, peer_stage=2)) == "0SEND_F3@2>2"
    assert str(Instr(Op.FREE, 2, 3, buf="act_in", peer_stage=0)) == "2FREE3<0:act_in"
    assert Instr(Op.RECV_F, 2, 3, 1, peer_stage=1) == Instr(Op.RECV_F, 2, 3, 1)  # the neighbour is None
    assert Instr.parse("2RECV_F3@1<1").peer_stage is None
    for text in ("0SEND_F3@2>2", "3SEND_B1@0<0", "1RECV_B0@3>3", "2FREE3<0:act_in", "0FREE1>2:grad_out"):
        assert str(Instr.parse(text)) == text


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(op=Op.SEND_F, stage=2, mb=0, peer=1, peer_stage=1), "needs a peer_stage after it"),
    (dict(op=Op.RECV_F, stage=2, mb=0, peer=1, peer_stage=3), "needs a peer_stage before it"),
    (dict(op=Op.F, stage=2, mb=0, peer_stage=3), "F belongs to no edge"),
    (dict(op=Op.FREE, stage=2, mb=0, buf="stash", peer_stage=3), "FREE of stash belongs to no edge"),
    (dict(op=Op.FREE, stage=2, mb=0, buf="grad_in", peer_stage=3), "FREE of grad_in of stage 2 needs a peer_stage"),
])
def test_a_peer_stage_on_the_wrong_side_is_refused(kwargs, fragment):
    with pytest.raises(FormatError, match=fragment):
        Instr(**kwargs)


def test_an_arrow_that_contradicts_the_stages_is_refused():
    with pytest.raises(FormatError, match="says stage 0 is after stage 2"):
        Instr.parse("2RECV_F3@1>0")


@settings(max_examples=examples(40), deadline=None)
@given(graph_schedules(max_pp=5, max_m=6))
def test_graph_schedules_round_trip(schedule):
    assert Schedule.from_json(schedule.to_json()) == schedule
    assert Schedule.from_text(schedule.to_text()) == schedule
    assert Schedule.from_json(schedule.to_json()).edges == schedule.edges


def test_a_chain_schedule_is_written_as_it_always_was():
    chain = compile_schedule("1f1b", pp=4, microbatches=3)
    given_chain = compile_schedule("1f1b", pp=4, microbatches=3, edges=chain_edges(4))
    assert given_chain == chain and given_chain.to_json() == chain.to_json()
    assert "edges" not in json.loads(chain.to_json()) and "edges" not in chain.to_text()
    assert all(i.peer_stage is None for program in chain.programs for i in program)
    diamond = compile_schedule("1f1b", pp=4, microbatches=3, edges=DIAMOND)
    assert json.loads(diamond.to_json())["edges"] == [list(e) for e in DIAMOND]
    assert "edges: [[0, 1], [0, 2], [1, 3], [2, 3]]" in diamond.to_text()
    assert diamond != chain


def test_the_csv_refuses_a_graph_in_one_line():
    diamond = compile_schedule("1f1b", pp=4, microbatches=3, edges=DIAMOND)
    with pytest.raises(FormatError, match=r"PyTorch's CSV has no way to say .*\[\[0, 1\], \[0, 2\]") as err:
        write_csv(diamond)
    assert "\n" not in str(err.value)


# -- lowering ----------------------------------------------------------------------------


def test_the_diamond_sends_one_message_per_edge_between_ranks():
    """1F1B on nanotron's diamond: rank 0 sends each microbatch to ranks 1 and 2 (stages 1
    and 2), rank 3 receives from both and sends both gradients back; no message between
    ranks 1 and 2, which share no edge."""
    m = 3
    schedule = compile_schedule("1f1b", pp=4, microbatches=m, edges=DIAMOND)
    sent = {(r, i.peer, i.op.value, i.peer_stage)
            for r, p in enumerate(schedule.programs) for i in p if i.peer is not None}
    assert sent == {
        (0, 1, "SEND_F", None), (0, 2, "SEND_F", 2), (0, 1, "RECV_B", None), (0, 2, "RECV_B", 2),
        (1, 0, "RECV_F", None), (1, 3, "SEND_F", 3), (1, 3, "RECV_B", 3), (1, 0, "SEND_B", None),
        (2, 0, "RECV_F", 0), (2, 3, "SEND_F", None), (2, 3, "RECV_B", None), (2, 0, "SEND_B", 0),
        (3, 1, "RECV_F", 1), (3, 2, "RECV_F", None), (3, 1, "SEND_B", 1), (3, 2, "SEND_B", None),
    }
    for program in schedule.programs:
        counts = {}
        for i in program:
            if i.peer is not None:
                counts[i.op, i.peer_stage] = counts.get((i.op, i.peer_stage), 0) + 1
        assert set(counts.values()) == {m}  # each edge's message once per microbatch


def test_a_local_edge_hands_over_without_a_message():
    """Interleaved at pp=2: stages 0 and 2 run on rank 0, and edge (0, 2) is a local
    hand-off: F(0) makes act_in of stage 2, B(2) makes grad_out of stage 0 for it."""
    schedule = compile_schedule("interleaved_1f1b", pp=2, virtual=2, microbatches=4,
                                edges=[(0, 1), (0, 2), (1, 3), (2, 3)])
    assert not any(i.peer_stage is not None and i.op in (Op.SEND_F, Op.RECV_F) for p in schedule.programs for i in p)
    frees = {(i.stage, i.buf, i.peer_stage) for i in schedule.programs[0] if i.op is Op.FREE}
    assert {(2, "act_in", 0), (0, "grad_out", 2)} <= frees
    assert (1, "act_in", None) not in frees  # stage 1 runs on rank 1


def test_asap_on_a_graph_is_the_chain_loop_on_the_chain():
    for name, virtual in (("1f1b", None), ("interleaved_1f1b", 3), ("zbv", None), ("zb_h1", None)):
        order = generate(name, pp=4, microbatches=6, virtual=virtual)
        S = order.num_stages
        columns = packed(order.programs)
        times = unit_stage_times(order.programs, S)
        assert _asap_general(S, *columns, times, StageGraph.of(S)) == asap(S, order.programs)


def test_asap_on_the_diamond_waits_for_both_producers():
    order = generate("afab", pp=4, microbatches=1, edges=DIAMOND)
    starts, stuck = asap(4, order.programs, graph=order.graph)
    assert not stuck
    assert [s[0] for s in starts] == [0, 1, 1, 2]  # F(1) and F(2) together, F(3) after both
    assert starts[0][1] == 3 + 2 * 2  # B(0) after B(1), B(2), which follow B(3)


# -- every rule over edges, on random graphs --------------------------------------------


@st.composite
def graph_cases(draw):
    family, params = draw(schedule_params(max_pp=6, max_m=8, max_v=3, families=FAMILY_NAMES))
    order = generate(family, **params)
    return family, params, draw(stage_graphs(order.num_stages))


@settings(max_examples=examples(150), deadline=None)
@given(graph_cases())
def test_every_family_compiles_on_every_graph(case):
    """Every family, pp, virtual, m, cap and placement, on a random stage graph: lowered,
    it passes every rule (the walk and each rule on its own), keeps the family's compute
    order, and the graph's messages are those of its edges between ranks."""
    family, params, edges = case
    schedule = compile_schedule(family, edges=edges, **params)
    assert walk.passes(schedule)
    rules_pass(schedule)
    chain = compile_schedule(family, **params)
    computes = lambda s: [[i for i in p if i.op in (Op.F, Op.B, Op.W)] for p in s.programs]  # noqa: E731
    assert computes(schedule) == computes(chain)
    remote = sum(schedule.placement[s] != schedule.placement[t] for s, t in edges)
    messages = sum(i.peer is not None for p in schedule.programs for i in p)
    assert messages == 4 * remote * schedule.microbatches  # SEND_F, RECV_F, SEND_B, RECV_B per edge and mb
    evaluation = forward_only(schedule)
    rules_pass(evaluation)
    assert on_graph(schedule, None) == chain
    assert on_graph(chain, edges) == schedule


@settings(max_examples=examples(60), deadline=None)
@given(graph_schedules(max_pp=6, max_m=8, offload=False))
def test_offload_on_a_graph_passes_every_rule(schedule):
    rules_pass(add_offload(schedule, OffloadPolicy(fraction=1.0, lead=1)))


# -- broken graph schedules --------------------------------------------------------------


def refused(schedule, rules):
    """verify refuses `schedule` under one of `rules`, and the walk does not pass it."""
    assert not walk.passes(schedule)
    with pytest.raises(ScheduleError) as err:
        verify(schedule)
    assert err.value.rule in rules, str(err.value)
    return err.value


def edited(schedule, rank, program):
    programs = list(schedule.programs)
    programs[rank] = tuple(program)
    return Schedule(schedule.name, schedule.pp, schedule.virtual, schedule.microbatches, schedule.placement,
                    tuple(programs), schedule.params, schedule.forward_only, schedule.edges)


def test_a_dropped_edge_message_is_named():
    schedule = compile_schedule("1f1b", pp=4, microbatches=3, edges=DIAMOND)
    program = list(schedule.programs[2])
    k = next(k for k, i in enumerate(program) if i.op is Op.RECV_F)  # 2RECV_F0@0<0: edge (0, 2)
    err = refused(edited(schedule, 2, program[:k] + program[k + 1:]), {"dependency"})
    assert "no RECV_F of (stage 2, mb 0) from stage 0 earlier on rank 2" in str(err)
    program = list(schedule.programs[0])
    k = next(k for k, i in enumerate(program) if i.op is Op.SEND_F and i.peer_stage == 2)
    err = refused(edited(schedule, 0, program[:k] + program[k + 1:]), {"dependency", "liveness"})
    assert "for stage 2" in str(err)


def test_a_message_on_an_edge_the_graph_lacks_is_named():
    schedule = compile_schedule("1f1b", pp=4, microbatches=2, edges=DIAMOND)
    program = list(schedule.programs[1])
    k = next(k for k, i in enumerate(program) if i.op is Op.SEND_F)
    program[k] = Instr(Op.SEND_F, 1, program[k].mb, 2)  # (1, 2): not an edge
    err = refused(edited(schedule, 1, program), {"dependency"})
    assert "travels on edge (1, 2), which the stage graph does not have" in str(err)


def test_swapped_receives_from_one_rank_break_matching():
    """pp=2, v=2: rank 1 receives stage 0's output for stage 1 and for stage 3, both from
    rank 0, in one batch; swapping the two receives makes each expect the other's tensor."""
    schedule = compile_schedule("interleaved_1f1b", pp=2, virtual=2, microbatches=4,
                                edges=[(0, 1), (0, 3), (1, 2), (2, 3)])
    program = list(schedule.programs[1])
    k = program.index(Instr(Op.RECV_F, 1, 0, 0))
    assert program[k + 1] == Instr(Op.RECV_F, 3, 0, 0, peer_stage=0)  # the same batch, the same peer
    program[k], program[k + 1] = program[k + 1], program[k]
    err = refused(edited(schedule, 1, program), {"matching"})
    assert "expects the activation for (stage 3, mb 0) from stage 0" in str(err)


def test_a_free_before_the_last_consumer_is_named():
    """act_in of stage 3 from stage 1 freed between F(3) and B(3), which still reads it."""
    schedule = compile_schedule("1f1b", pp=4, microbatches=2, edges=DIAMOND)
    program = list(schedule.programs[3])
    free = next(i for i in program if i.op is Op.FREE and i.buf == "act_in" and i.peer_stage == 1)
    program.remove(free)
    b = next(k for k, i in enumerate(program) if i.op is Op.B and i.mb == free.mb)
    program.insert(b, free)
    err = refused(edited(schedule, 3, program), {"liveness"})
    assert f"uses act_in of (stage 3, mb {free.mb}) from stage 1, which is freed" in str(err)


def test_a_leaked_edge_buffer_is_named():
    schedule = compile_schedule("1f1b", pp=4, microbatches=2, edges=DIAMOND)
    program = [i for i in schedule.programs[0] if not (i.op is Op.FREE and i.buf == "grad_out" and i.peer_stage == 2
                                                       and i.mb == 1)]
    err = refused(edited(schedule, 0, program), {"liveness"})
    assert "grad_out of (stage 0, mb 1) for stage 2 is never freed" in str(err)


@settings(max_examples=examples(200), deadline=None)
@given(graph_schedules(max_pp=5, max_m=5, offload=False), st.data())
def test_any_dropped_message_of_a_graph_schedule_is_refused(schedule, data):
    messages = [(r, k) for r, p in enumerate(schedule.programs) for k, i in enumerate(p) if i.peer is not None]
    if not messages:
        return
    rank, k = data.draw(st.sampled_from(messages))
    program = list(schedule.programs[rank])
    refused(edited(schedule, rank, program[:k] + program[k + 1:]),
            {"dependency", "matching", "deadlock", "liveness"})


@settings(max_examples=examples(200), deadline=None)
@given(graph_schedules(max_pp=5, max_m=5, offload=False), st.data())
def test_any_free_moved_before_a_use_of_its_buffer_is_refused(schedule, data):
    """A FREE moved to right before the last instruction that reads its buffer (inside a
    run of messages it also splits that batch, which can deadlock first, rule 4)."""
    frees = [(r, k) for r, p in enumerate(schedule.programs) for k, i in enumerate(p) if i.op is Op.FREE]
    rank, k = data.draw(st.sampled_from(frees))
    program = list(schedule.programs[rank])
    free = program.pop(k)
    readers = {"act_in": (Op.F, Op.B), "stash": (Op.B, Op.W), "grad_out": (Op.B,), "act_out": (Op.SEND_F,),
               "grad_in": (Op.SEND_B,)}[free.buf]
    uses = [j for j, i in enumerate(program[:k]) if i.op in readers and (i.stage, i.mb) == (free.stage, free.mb)
            and (i.op not in (Op.SEND_F, Op.SEND_B) or i.peer_stage == free.peer_stage)]
    program.insert(uses[-1], free)
    refused(edited(schedule, rank, program), {"liveness", "deadlock"})


@settings(max_examples=examples(200), deadline=None)
@given(graph_schedules(max_pp=5, max_m=5, offload=False), st.data())
def test_any_two_receives_from_one_rank_swapped_in_their_batch_break_matching(schedule, data):
    """Two receives side by side (one batch) from the same rank, of different tensors:
    swapped, the k-th receive meets the other's send (rule 3), and nothing else changes."""
    pairs = [(r, k) for r, p in enumerate(schedule.programs) for k in range(len(p) - 1)
             if p[k].op in (Op.RECV_F, Op.RECV_B) and p[k + 1].op in (Op.RECV_F, Op.RECV_B)
             and p[k].peer == p[k + 1].peer and p[k] != p[k + 1]]
    if not pairs:
        return
    rank, k = data.draw(st.sampled_from(pairs))
    program = list(schedule.programs[rank])
    program[k], program[k + 1] = program[k + 1], program[k]
    refused(edited(schedule, rank, program), {"matching"})
