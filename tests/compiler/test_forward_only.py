"""Forward-only (evaluation) schedules: `passes.forward_only` and the verifier's
forward-only mode ([Note: forward-only schedules] in verify.py)."""

import dataclasses

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pipeschedule import Instr, Op, Schedule, ScheduleError, compile_schedule, verify
from pipeschedule.compiler.passes import forward_only
from pipeschedule.simulate import simulate

from strategies import examples, schedules

FORWARD_OPS = {Op.F, Op.SEND_F, Op.RECV_F, Op.FREE}


@settings(max_examples=examples(150), deadline=None)
@given(schedules(max_pp=8, max_m=16))
def test_the_forward_half_of_every_schedule_passes_every_rule(schedule):
    evaluation = forward_only(schedule)
    verify(evaluation)
    assert evaluation.forward_only and evaluation.placement == schedule.placement
    for program, source in zip(evaluation.programs, schedule.programs):
        assert {i.op for i in program} <= FORWARD_OPS
        # each rank's F in the order the schedule had them
        assert [i for i in program if i.op is Op.F] == [i for i in source if i.op is Op.F]
        # nothing is kept for a backward: act_in and stash go right after their F
        for k, i in enumerate(program):
            if i.op is Op.F:
                assert program[k + 1:k + 3] == (Instr(Op.FREE, i.stage, i.mb, buf="act_in"),
                                                 Instr(Op.FREE, i.stage, i.mb, buf="stash"))
    # runs to the end; nothing is held for a backward, as rule 6 reads it (it used to report m per rank)
    assert simulate(evaluation).peak_inflight == (0,) * schedule.pp


def test_forward_only_of_a_compute_order_equals_that_of_its_lowering():
    from pipeschedule import generate
    order = generate("interleaved_1f1b", pp=3, microbatches=5, virtual=2)
    assert forward_only(order) == forward_only(compile_schedule("interleaved_1f1b", pp=3, microbatches=5, virtual=2))


def test_the_form_round_trips_and_equal_values_verify_alike():
    evaluation = forward_only(compile_schedule("zbv", pp=2, microbatches=3))
    for twin in (Schedule.from_json(evaluation.to_json()), Schedule.from_text(evaluation.to_text())):
        assert twin == evaluation and twin.forward_only
        verify(twin)
    # the same programs declared as a training schedule are not one
    training = dataclasses.replace(evaluation, forward_only=False)
    assert training != evaluation
    with pytest.raises(ScheduleError, match=r"rule coverage: .*no B for \(stage 0, mb 0\)"):
        verify(training)


def test_a_training_schedule_declared_forward_only_is_refused():
    schedule = compile_schedule("1f1b", pp=2, microbatches=2)
    with pytest.raises(ScheduleError) as info:
        verify(dataclasses.replace(schedule, forward_only=True))
    assert info.value.rule == "coverage" and "in a forward-only schedule, which runs no backward" in str(info.value)


def test_caps_do_not_apply():
    # rule 6 counts F to B; an evaluation holds nothing for a backward
    evaluation = forward_only(compile_schedule("capped_1f1b", pp=4, microbatches=8, cap=1))
    assert evaluation.caps() == [1, 1, 1, 1]
    verify(evaluation)


# -- the verifier rejects broken forward-only schedules ------------------------------------

@st.composite
def evaluations(draw, min_pp=1):
    schedule = draw(schedules(max_pp=6, max_m=8))
    assume(schedule.pp >= min_pp)
    return forward_only(schedule)


def mutated(schedule, rank, program):
    programs = list(schedule.programs)
    programs[rank] = tuple(program)
    return dataclasses.replace(schedule, programs=tuple(programs))


def where(schedule, predicate):
    return [(r, k) for r, p in enumerate(schedule.programs) for k, i in enumerate(p) if predicate(i)]


def rule_of(schedule):
    with pytest.raises(ScheduleError) as info:
        verify(schedule)
    assert "<-- ERROR HERE" in str(info.value)
    return info.value


@settings(max_examples=examples(40), deadline=None)
@given(evaluations(), st.data())
def test_a_dropped_free_is_a_leak(schedule, data):
    rank, k = data.draw(st.sampled_from(where(schedule, lambda i: i.op is Op.FREE)))
    program = list(schedule.programs[rank])
    free = program.pop(k)
    err = rule_of(mutated(schedule, rank, program))
    assert err.rule == "liveness" and f"{free.buf} of (stage {free.stage}, mb {free.mb}) is never freed" in str(err)


@settings(max_examples=examples(40), deadline=None)
@given(evaluations(), st.data())
def test_a_stash_freed_before_its_f_exists_is_caught(schedule, data):
    rank, k = data.draw(st.sampled_from(where(schedule, lambda i: i.op is Op.FREE and i.buf == "stash")))
    program = list(schedule.programs[rank])
    free = program.pop(k)
    program.insert(k - 2, free)  # before its F
    err = rule_of(mutated(schedule, rank, program))
    assert err.rule == "liveness" and "never produced" in str(err)


@settings(max_examples=examples(40), deadline=None)
@given(evaluations(), st.data())
def test_an_added_b_breaks_coverage(schedule, data):
    rank, k = data.draw(st.sampled_from(where(schedule, lambda i: i.op is Op.F)))
    program = list(schedule.programs[rank])
    f = program[k]
    program.insert(k + 1, Instr(Op.B, f.stage, f.mb))
    err = rule_of(mutated(schedule, rank, program))
    assert err.rule == "coverage" and "runs no backward" in str(err)


@settings(max_examples=examples(40), deadline=None)
@given(evaluations(), st.data())
def test_a_dropped_f_breaks_coverage(schedule, data):
    rank, k = data.draw(st.sampled_from(where(schedule, lambda i: i.op is Op.F)))
    program = list(schedule.programs[rank])
    f = program.pop(k)
    err = rule_of(mutated(schedule, rank, program))
    assert err.rule == "coverage" and f"no F for (stage {f.stage}, mb {f.mb})" in str(err)


@settings(max_examples=examples(40), deadline=None)
@given(evaluations(min_pp=2), st.data())
def test_a_dropped_receive_breaks_a_dependency(schedule, data):
    rank, k = data.draw(st.sampled_from(where(schedule, lambda i: i.op is Op.RECV_F)))
    program = list(schedule.programs[rank])
    recv = program.pop(k)
    err = rule_of(mutated(schedule, rank, program))
    assert err.rule == "dependency" and f"no RECV_F of (stage {recv.stage}, mb {recv.mb})" in str(err)


@settings(max_examples=examples(40), deadline=None)
@given(evaluations(min_pp=2), st.data())
def test_a_dropped_send_breaks_a_dependency_or_matching(schedule, data):
    rank, k = data.draw(st.sampled_from(where(schedule, lambda i: i.op is Op.SEND_F)))
    program = list(schedule.programs[rank])
    program.pop(k)
    err = rule_of(mutated(schedule, rank, program))
    assert err.rule in ("dependency", "matching")


@settings(max_examples=examples(40), deadline=None)
@given(evaluations(min_pp=2), st.data())
def test_two_swapped_sends_break_matching(schedule, data):
    sends = where(schedule, lambda i: i.op is Op.SEND_F)
    pairs = [(a, b) for a in sends for b in sends if a[0] == b[0] and a[1] < b[1]
             and schedule.programs[a[0]][a[1]].peer == schedule.programs[b[0]][b[1]].peer]
    assume(pairs)
    (rank, i), (_, j) = data.draw(st.sampled_from(pairs))
    program = list(schedule.programs[rank])
    program[i], program[j] = program[j], program[i]
    err = rule_of(mutated(schedule, rank, program))
    assert err.rule == "matching"


def test_a_receive_posted_before_its_own_send_deadlocks():
    # Two chunks per rank: rank 0 waits for stage 2's input (from rank 1) before it sends
    # stage 0's output, which rank 1 needs to produce that input: a cycle.
    evaluation = forward_only(compile_schedule("interleaved_1f1b", pp=2, microbatches=1, virtual=2))
    program = list(evaluation.programs[0])
    k = next(k for k, i in enumerate(program) if i.op is Op.RECV_F)
    program.insert(0, program.pop(k))
    err = rule_of(mutated(evaluation, 0, program))
    assert err.rule == "deadlock" and "cannot finish" in str(err)
