"""The JSON and text writers write each template once and fill in the mb per instruction
(`ir._written`); here they are held to the per-instruction writing they replaced (kept
below as the reference), on Programs and on plain tuples of instructions, with
communication, FREE, OFFLOAD / RELOAD, split backwards and a stage graph's peer stages."""

from __future__ import annotations

import json

import pytest

from pipeschedule import compile_schedule
from pipeschedule.compiler.ir import Schedule
from pipeschedule.compiler.offload import OffloadPolicy, add_offload

DIAMOND = ((0, 1), (0, 2), (1, 3), (2, 3))


def json_by_instruction(schedule: Schedule) -> str:
    head = {k: v for k, v in schedule.to_dict().items() if k != "programs"}
    lines = [json.dumps(head)[:-1] + ', "programs": [']
    for r, program in enumerate(schedule.programs):
        body = ",\n    ".join(json.dumps(i.to_dict()) for i in program)
        lines.append("  [\n    " + body + "\n  ]" + ("," if r + 1 < schedule.pp else ""))
    lines.append("]}")
    return "\n".join(lines) + "\n"


def text_lines_by_instruction(schedule: Schedule) -> list[str]:
    return [f"rank {r}: " + " ".join(str(i) for i in program) for r, program in enumerate(schedule.programs)]


SCHEDULES = [
    lambda: compile_schedule("1f1b", pp=3, microbatches=5),
    lambda: compile_schedule("capped_1f1b", pp=4, microbatches=12, cap=2),
    lambda: compile_schedule("interleaved_1f1b", pp=4, microbatches=6, virtual=3),
    lambda: compile_schedule("zbv", pp=4, microbatches=8),
    lambda: compile_schedule("zb_h1", pp=1, microbatches=1),
    lambda: compile_schedule("1f1b", pp=4, microbatches=3, edges=DIAMOND),
    lambda: add_offload(compile_schedule("1f1b", pp=4, microbatches=8), OffloadPolicy(fraction=0.5, lead=1)),
    lambda: compile_schedule("afab", pp=2, microbatches=1200),  # mbs of several digits
]


@pytest.mark.parametrize("make", SCHEDULES)
@pytest.mark.parametrize("as_tuples", [False, True])
def test_writers_write_as_instruction_by_instruction(make, as_tuples):
    schedule = make()
    if as_tuples:
        schedule = schedule.replace_programs(tuple(tuple(program) for program in schedule.programs))
    assert schedule.to_json() == json_by_instruction(schedule)
    assert schedule.to_text().splitlines()[-schedule.pp:] == text_lines_by_instruction(schedule)
    assert Schedule.from_json(schedule.to_json()) == schedule
    assert Schedule.from_text(schedule.to_text()) == schedule


# -- the reader: one `Instr.from_dict` per template ------------------------------------------

def read_by_instruction(obj: dict) -> tuple[tuple, ...]:
    from pipeschedule.compiler.instr import Instr

    return tuple(tuple(Instr.from_dict(i) for i in program) for program in obj["programs"])


@pytest.mark.parametrize("make", SCHEDULES)
def test_the_reader_reads_as_instruction_by_instruction(make):
    schedule = make()
    obj = json.loads(schedule.to_json())
    loaded = Schedule.from_dict(obj)
    assert loaded.programs == read_by_instruction(obj)
    assert loaded == schedule


@pytest.mark.parametrize("change", [
    {"mb": -1}, {"mb": "3"}, {"mb": True}, {"mb": 2.0}, {"mb": None}, {"stage": True}, {"stage": 0.0},
    {"peer": [1]}, {"peer": True}, {"extra": 1}, {"buf": "stash"}, {"op": "X"}, {"peer_stage": 3},
])
def test_a_bad_later_instruction_of_a_known_template_is_refused_as_before(change):
    """The last instruction of rank 1 repeats a template read earlier, but for `change`:
    the message is the one `Instr.from_dict` gives it."""
    from pipeschedule.compiler.instr import Instr
    from pipeschedule.errors import FormatError

    obj = json.loads(compile_schedule("1f1b", pp=2, microbatches=3).to_json())
    bad = dict(obj["programs"][1][0]) | change
    obj["programs"][1].append(bad)
    with pytest.raises(FormatError) as expected:
        Instr.from_dict(bad)
    with pytest.raises(FormatError) as got:
        Schedule.from_dict(obj)
    assert str(got.value) == str(expected.value)
