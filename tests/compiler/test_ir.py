import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeschedule import FormatError, Instr, Op, Schedule, compile_schedule, dump, load
from pipeschedule.compiler.ir import BUF_OPS, BUFFERS, COMM_OPS, make_instr

from strategies import build, examples, schedule_params


@st.composite
def instrs(draw):
    op = draw(st.sampled_from(list(Op)))
    peer = draw(st.integers(0, 99)) if op in COMM_OPS else None
    buf = draw(st.sampled_from(BUFFERS)) if op in BUF_OPS else None
    return Instr(op, draw(st.integers(0, 10_000)), draw(st.integers(0, 10_000)), peer, buf)


@given(instrs())
def test_str_and_parse_are_inverses(instr):
    assert Instr.parse(str(instr)) == instr
    assert Instr.from_dict(instr.to_dict()) == instr


def test_text_tokens_look_like_pytorch():
    assert str(Instr(Op.F, 1, 3)) == "1F3"
    assert str(Instr(Op.SEND_F, 1, 3, peer=2)) == "1SEND_F3@2"
    assert str(Instr(Op.FREE, 1, 3, buf="act_out")) == "1FREE3:act_out"
    assert Instr(Op.F, 1, 3).to_dict() == {"op": "F", "stage": 1, "mb": 3}
    assert Instr(Op.SEND_F, 1, 3, peer=2).to_dict() == {"op": "SEND_F", "stage": 1, "mb": 3, "peer": 2}


def test_instructions_are_frozen_slotted_and_hashable():
    i = Instr(Op.B, 0, 1)
    with pytest.raises(AttributeError):
        i.mb = 2
    assert not hasattr(i, "__dict__")
    assert {i, Instr(Op.B, 0, 1)} == {i}
    assert make_instr(Op.B, 0, 1) == i and hash(make_instr(Op.B, 0, 1)) == hash(i)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(op="X", stage=0, mb=0), "unknown op 'X'"),
        (dict(op=Op.F, stage=-1, mb=0), "stage must be an integer >= 0, got -1"),
        (dict(op=Op.F, stage=0, mb=True), "mb must be an integer >= 0, got True"),
        (dict(op=Op.SEND_F, stage=0, mb=0), "SEND_F needs a peer"),
        (dict(op=Op.F, stage=0, mb=0, peer=1), "F takes no peer"),
        (dict(op=Op.FREE, stage=0, mb=0, buf="weights"), "FREE needs buf in"),
    ],
)
def test_bad_instructions_name_the_value(kwargs, fragment):
    with pytest.raises(FormatError, match=fragment.replace("(", r"\(")):
        Instr(**kwargs)


@settings(max_examples=examples(40))
@given(schedule_params(max_pp=6, max_m=10))
def test_json_and_text_round_trip(case):
    schedule = build(*case)
    assert Schedule.from_json(schedule.to_json()) == schedule
    assert Schedule.from_json(schedule.to_json(indent=2)) == schedule
    assert Schedule.from_text(schedule.to_text()) == schedule
    assert Schedule.from_text(schedule.to_text()).params == schedule.params


def test_json_form_is_the_documented_one(tmp_path):
    schedule = compile_schedule("capped_1f1b", pp=2, microbatches=2, cap=1)
    obj = json.loads(schedule.to_json())
    assert obj["format"] == "pipeschedule/1"
    assert {k: obj[k] for k in ("name", "pp", "virtual", "microbatches", "placement")} == {
        "name": "capped_1f1b", "pp": 2, "virtual": 1, "microbatches": 2, "placement": [0, 1]}
    assert obj["params"] == {"cap": [1, 1]}
    assert obj["programs"][0][:3] == [
        {"op": "F", "stage": 0, "mb": 0},
        {"op": "SEND_F", "stage": 0, "mb": 0, "peer": 1},
        {"op": "RECV_B", "stage": 0, "mb": 0, "peer": 1},
    ]
    path = tmp_path / "s.json"
    dump(schedule, str(path))
    assert load(str(path)) == schedule
    dump(schedule, str(tmp_path / "s.txt"))
    assert load(str(tmp_path / "s.txt")) == schedule


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda o: o.pop("programs"), "lacks fields ['programs']"),
        (lambda o: o.update(format="x"), "format must be 'pipeschedule/1'"),
        (lambda o: o.update(pp=0), "pp must be an integer >= 1, got 0"),
        (lambda o: o.update(placement=[0]), "placement has 1 entries"),
        (lambda o: o.update(placement=[0, 5]), "placement[1] = 5"),
        (lambda o: o["programs"][0].append({"op": "F", "stage": 0}), "lacks field 'mb'"),
        (lambda o: o["programs"][0].append({"op": "F", "stage": 0, "mb": 0, "x": 1}), "unknown fields"),
        (lambda o: o.update(params={"cap": "two"}), "params.cap must be"),
        (lambda o: o.update(extra=1), "unknown fields"),
    ],
)
def test_bad_json_is_a_format_error(mutate, fragment):
    obj = compile_schedule("1f1b", pp=2, microbatches=2).to_dict()
    mutate(obj)
    with pytest.raises(FormatError, match=re.escape(fragment)):
        Schedule.from_json(json.dumps(obj))


def test_unreadable_files_are_format_errors(tmp_path):
    with pytest.raises(FormatError, match="cannot read"):
        load(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(FormatError, match="not valid JSON"):
        load(str(tmp_path / "bad.json"))
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(FormatError):
        load(str(tmp_path / "bin.json"))


@pytest.mark.parametrize("doubled, fragment", [
    ("rank 0:", "rank 0 has two lines"),
    ("microbatches:", "'microbatches' is given twice"),
    ("name:", "'name' is given twice"),
])
def test_a_text_line_given_twice_is_refused(doubled, fragment):
    """The later line used to replace the earlier one without a word (a rank's program lost, and verified)."""
    lines = compile_schedule("1f1b", pp=2, microbatches=2).to_text().splitlines()
    line = next(line for line in lines if line.startswith(doubled))
    with pytest.raises(FormatError, match=fragment):
        Schedule.from_text("\n".join(lines + [line]))


def test_the_size_limits_accept_interleaved_pp64_v2_m512():
    """65,536 (stage, microbatch) pairs: compile, verify and simulate take it ([Note: size
    limits]; timed by benchmarks.limits), a Chrome trace or a PNG of it is refused."""
    from pipeschedule.checks import check_png_size, check_schedule_size, check_trace_size
    from pipeschedule.compiler.families import generate
    from pipeschedule.errors import ParameterError

    check_schedule_size(64, 2, 512)
    assert generate("interleaved_1f1b", pp=64, virtual=2, microbatches=512).num_stages == 128
    for check in (check_trace_size, check_png_size):
        with pytest.raises(ParameterError, match="65536 .* at most 49152"):
            check(64, 2, 512)
