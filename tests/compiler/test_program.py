"""`Program`: one rank's instructions packed as template ids and microbatches ([Note:
packed programs] in program.py). It must stand for the tuple of the same instructions
everywhere a tuple went: equal to it, hashed as it, indexed, sliced, added, pickled;
and `packed` must give the same instructions back, whatever it was handed."""

import pickle

import pytest
from hypothesis import given, settings

from pipeschedule import FormatError, Instr, Op, Schedule, compile_schedule
from pipeschedule.compiler.passes import lower
from pipeschedule.compiler.program import Program, Template, Templates, packed
from pipeschedule.compiler.families import generate

from strategies import examples, schedules


def unpacked(templates, ids, mbs):
    return tuple(templates[k].instr(mb) for k, mb in zip(ids, mbs))


def as_program(instrs, table=None):
    table = table or Templates()
    ids, mbs = table.pack(instrs)
    return table.program(ids, mbs)


INSTRS = (Instr(Op.F, 0, 0), Instr(Op.SEND_F, 0, 0, 1), Instr(Op.F, 0, 1), Instr(Op.FREE, 0, 0, buf="act_out"),
          Instr(Op.B, 0, 0))


def test_a_program_is_the_tuple_it_stands_for():
    program = as_program(INSTRS)
    assert program == INSTRS and INSTRS == program and not program != INSTRS
    assert hash(program) == hash(INSTRS)
    assert len(program) == 5 and list(program) == list(INSTRS) and tuple(reversed(program)) == INSTRS[::-1]
    assert program[1] == INSTRS[1] and program[-1] == INSTRS[-1]
    assert program[1:3] == INSTRS[1:3] and type(program[1:3]) is tuple
    assert program.index(INSTRS[2]) == 2 and program.count(INSTRS[0]) == 1 and INSTRS[3] in program
    assert program + (INSTRS[0],) == INSTRS + (INSTRS[0],) and (INSTRS[0],) + program == (INSTRS[0],) + INSTRS
    assert repr(program) == repr(INSTRS)
    with pytest.raises(IndexError):
        program[5]


def test_programs_compare_by_their_instructions_whatever_their_tables():
    one = as_program(INSTRS)
    other_table = Templates([Template(Op.B, 0, None, None), Template(Op.W, 3, None, None)])
    two = as_program(INSTRS, other_table)
    assert one.templates != two.templates and one.ids != two.ids
    assert one == two and hash(one) == hash(two)
    assert one != as_program(INSTRS[:-1]) and one != as_program(INSTRS[:-1] + (Instr(Op.B, 0, 1),))
    assert one != list(INSTRS)  # as a tuple is not equal to a list
    shared = Templates()
    a, b = as_program(INSTRS, shared), as_program(INSTRS[::-1], shared)
    assert a.templates is b.templates and a != b  # the same table: compared by columns


def test_pickled_programs_keep_their_columns():
    program = as_program(INSTRS)
    program[0]  # builds its tuple of instructions
    back = pickle.loads(pickle.dumps(program))
    assert back._instrs is None  # the built tuple does not travel
    assert back.ids == program.ids and back.mbs == program.mbs and back == program


def test_packed_gives_back_what_it_was_handed():
    order = generate("interleaved_1f1b", pp=3, microbatches=5, virtual=2)
    lowered = lower(order)
    assert all(type(p) is Program for p in lowered.programs)
    templates, ids, mbs = packed(lowered.programs)
    assert templates is lowered.programs[0].templates and ids[1] is lowered.programs[1].ids  # its own columns
    mixed = (tuple(lowered.programs[0]),) + lowered.programs[1:]  # a tuple among Programs: packed afresh
    templates, ids, mbs = packed(mixed)
    assert templates is not lowered.programs[0].templates
    assert tuple(unpacked(templates, i, m) for i, m in zip(ids, mbs)) == lowered.programs


def test_a_schedule_of_programs_equals_one_of_tuples():
    lowered = compile_schedule("zb_h1", pp=3, microbatches=4)
    tuples = Schedule(lowered.name, lowered.pp, lowered.virtual, lowered.microbatches, lowered.placement,
                      tuple(tuple(p) for p in lowered.programs), lowered.params)
    assert all(type(p) is Program for p in lowered.programs) and all(type(p) is tuple for p in tuples.programs)
    assert lowered == tuples and hash(lowered) == hash(tuples)
    assert lowered.split_backward and tuples.split_backward
    again = Schedule(lowered.name, lowered.pp, lowered.virtual, lowered.microbatches, lowered.placement,
                     lowered.programs, lowered.params)  # Programs pass construction as they are
    assert all(a is b for a, b in zip(again.programs, lowered.programs)) and again.split_backward
    assert Schedule.from_json(lowered.to_json()) == lowered and Schedule.from_text(lowered.to_text()) == lowered


@settings(max_examples=examples(100), deadline=None)
@given(schedules(max_pp=6, max_m=8))
def test_packing_any_schedule_round_trips(schedule):
    tuples = tuple(tuple(p) for p in schedule.programs)
    templates, ids, mbs = packed(tuples)
    assert len(set(templates)) == len(templates)  # each template once
    assert sorted({k for rank in ids for k in rank}) == list(range(len(templates)))  # each in use
    assert tuple(unpacked(templates, i, m) for i, m in zip(ids, mbs)) == tuples
    table = Templates()
    columns = [table.pack(p) for p in tuples]  # every template first, then the programs
    programs = tuple(table.program(i, m) for i, m in columns)
    assert programs == tuples and packed(programs)[0] is programs[0].templates


def test_templates_are_checked_as_instructions():
    table = Templates()
    k = table.id("F", 0)  # the text of an op is the op
    assert table.list[k].op is Op.F and table.id(Op.F, 0) == k
    with pytest.raises(FormatError, match="needs a peer"):
        table.id(Op.SEND_F, 0)
    with pytest.raises(FormatError, match="needs buf"):
        table.id(Op.FREE, 0, None, "nothing")
    with pytest.raises(FormatError, match="each template once"):
        Templates([Template(Op.F, 0, None, None)] * 2)


@pytest.mark.parametrize("templates,ids,mbs,fragment", [
    ((Template("F", 0, None, None),), (0,), (0,), "not the template of an instruction"),
    ((Template(Op.F, 0, None, None),) * 2, (0,), (0,), "each template once"),
    ((Template(Op.F, 0, None, None),), (1,), (0,), "must index its 1 templates"),
    ((Template(Op.F, 0, None, None),), (0,), (-1,), "integers >= 0"),
    ((Template(Op.F, 0, None, None),), (0,), (0.0,), "integers >= 0"),
    ((Template(Op.F, 0, None, None),), (0, 0), (0,), "of one length"),
    ([Template(Op.F, 0, None, None)], (0,), (0,), "must be a tuple"),
])
def test_a_schedule_checks_the_programs_it_is_given(templates, ids, mbs, fragment):
    with pytest.raises(FormatError, match=fragment):
        Schedule("x", 1, 1, 1, (0,), (Program(templates, ids, mbs),))


def test_one_table_for_many_ranks_keeps_every_pass_linear():
    """At pp=8000 a 1F1B table holds 88k templates, a rank's program uses 11: whatever is
    done per rank must not be done per template of the whole table (it was, for the
    simulator's channels, the objects a Program builds and `packed` of a Program among
    tuples: minutes at this size). One rank's program is a tuple, the rest Programs."""
    import time
    from pipeschedule.compiler.gcpause import gc_paused
    from pipeschedule.compiler.verify import verify
    from pipeschedule.simulate import simulate

    @gc_paused  # the collector's passes over a growing heap are not the passes'
    def seconds(pp):
        low = lower(generate("1f1b", pp=pp, microbatches=1))
        mixed = Schedule(low.name, pp, 1, 1, low.placement, (tuple(low.programs[0]),) + low.programs[1:], low.params)
        t0 = time.process_time()
        verify(mixed)
        simulate(mixed)
        for program in mixed.programs[1:]:
            program[0]  # builds its objects
        return time.process_time() - t0

    small, large = min(seconds(800) for _ in range(3)), seconds(8000)  # 8000: within MAX_STAGES
    assert large < 40 * max(small, 1e-3)  # 10x the ranks: linear ~10x, per rank per template ~100x
