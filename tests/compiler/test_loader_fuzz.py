"""Fuzz of the IR loaders: whatever the input, only PipescheduleError escapes.

Covers `Schedule.from_json`, `Schedule.from_dict`, `Schedule.from_text`, `Instr.parse`,
`Instr.from_dict` and `ir.load`, on random JSON values, random text, and valid schedules
mutated field by field (dropped, retyped, huge, negative, nested junk).
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
from contextlib import contextmanager

try:
    import resource
except ImportError:  # not on this platform: only the time limit applies
    resource = None

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeschedule.compiler import ir, passes
from pipeschedule.errors import FormatError, PipescheduleError
from pipeschedule.compiler.families import generate
from strategies import examples

FUZZ = settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Integers Python cannot turn into text or back without raising (more than 4300 digits,
# `sys.get_int_max_str_digits`), and the ones around machine-word limits.
HUGE_DIGITS = "9" * 5000
MARKER = "\u0000HUGE\u0000"  # replaced by HUGE_DIGITS (unquoted) in the JSON text
EDGE_INTS = [0, -1, -(2**63), 2**31, 2**63, 2**64 + 1, 10**100, 10**4000]

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from(EDGE_INTS)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["F", "SEND_F", "FREE", "act_in", "pipeschedule/1", "", MARKER])
)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=20,
)


def json_text(value) -> str:
    """JSON text of `value`, with every MARKER string turned into a 5000-digit number."""
    text = json.dumps(value, allow_nan=True)
    return text.replace(json.dumps(MARKER), HUGE_DIGITS)


@contextmanager
def bounded(seconds: int, memory: int = 2 << 30):
    """Fail (instead of hanging the suite or exhausting the machine's memory) when the
    body runs longer than `seconds` or grows the address space by more than `memory`
    bytes: a loader bug can mean a loop or an allocation sized by a number in the input.
    """

    def expire(signum, frame):
        raise TimeoutError(f"took longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    limits = _limit_address_space(memory)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        if limits is not None:
            resource.setrlimit(resource.RLIMIT_AS, limits)


def _limit_address_space(memory: int):
    """Caps this process's address space at its current size + `memory`; returns the
    limits to restore, or None where that cannot be done (not Linux)."""
    if resource is None or not os.path.exists("/proc/self/statm"):
        return None
    with open("/proc/self/statm") as handle:
        size = int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = size + memory
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    if soft != resource.RLIM_INFINITY and soft <= cap:
        return None
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    return soft, hard


def only_pipeschedule_errors(load, data):
    try:
        with bounded(10):
            return load(data)
    except PipescheduleError:
        return None


@st.composite
def valid_schedule(draw):
    family = draw(st.sampled_from(["afab", "1f1b", "capped_1f1b", "interleaved_1f1b"]))
    pp = draw(st.integers(1, 4))
    microbatches = draw(st.integers(1, 5))
    virtual = draw(st.integers(1, 2)) if family == "interleaved_1f1b" else 1
    schedule = generate(family, pp=pp, microbatches=microbatches, virtual=virtual)
    return passes.lower(schedule) if draw(st.booleans()) else schedule


def _paths(value, prefix=()):
    """Every path (tuple of keys / indices) into a nested JSON value."""
    yield prefix
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _paths(child, prefix + (key,))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _paths(child, prefix + (index,))


@st.composite
def mutated_dict(draw):
    """The JSON object of a valid schedule with 1-3 random mutations at random paths."""
    obj = draw(valid_schedule()).to_dict()
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(obj) if p]
        path = draw(st.sampled_from(paths))
        parent = obj
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        action = draw(st.sampled_from(["replace", "delete", "add", "wrap", "negate"]))
        if action == "replace":
            parent[key] = draw(json_values)
        elif action == "delete":
            del parent[key]
        elif action == "add":
            if isinstance(parent, dict):
                parent[draw(st.sampled_from(["extra", "peer", "buf", "op", "params", "format"]))] = draw(json_values)
            else:
                parent.insert(key, draw(json_values))
        elif action == "wrap":
            parent[key] = draw(st.sampled_from([[parent[key]], {"x": parent[key]}, [[[parent[key]]]]]))
        elif isinstance(parent[key], int) and not isinstance(parent[key], bool):
            parent[key] = -parent[key] - 1
        if not paths:
            break
    return obj


# -- from_json / from_dict -------------------------------------------------------------


@FUZZ
@given(json_values)
def test_from_json_random_values(value):
    only_pipeschedule_errors(ir.Schedule.from_json, json_text(value))


@FUZZ
@given(mutated_dict())
def test_from_json_mutated_schedules(obj):
    loaded = only_pipeschedule_errors(ir.Schedule.from_json, json_text(obj))
    if loaded is not None:  # what loads writes back and loads to the same schedule
        assert ir.Schedule.from_json(loaded.to_json()) == loaded


@FUZZ
@given(mutated_dict())
def test_from_dict_mutated_schedules(obj):
    only_pipeschedule_errors(ir.Schedule.from_dict, obj)


@FUZZ
@given(st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_from_json_random_text(text):
    only_pipeschedule_errors(ir.Schedule.from_json, text)


def test_from_json_deep_nesting():
    only_pipeschedule_errors(ir.Schedule.from_json, "[" * 100_000 + "]" * 100_000)
    head = '{"format": "pipeschedule/1", "name": "x", "pp": 1, "virtual": 1, "microbatches": 1, '
    only_pipeschedule_errors(ir.Schedule.from_json, head + '"params": ' + '{"a": ' * 900 + "1" + "}" * 901)


# -- from_text -------------------------------------------------------------------------


@st.composite
def mutated_text(draw):
    lines = draw(valid_schedule()).to_text().splitlines()
    for _ in range(draw(st.integers(1, 3))):
        index = draw(st.integers(0, len(lines) - 1))
        action = draw(st.sampled_from(["delete", "duplicate", "junk_value", "junk_token", "huge", "insert"]))
        line = lines[index]
        if action == "delete":
            del lines[index]
        elif action == "duplicate":
            lines.insert(index, line)
        elif action == "junk_value":
            key = line.partition(":")[0]
            lines[index] = f"{key}: {json_text(draw(json_values))}"
        elif action == "junk_token":
            tokens = line.split()
            if tokens:
                tokens[draw(st.integers(0, len(tokens) - 1))] = draw(
                    st.sampled_from(["0F", "F0", "0X0", "-1F0", "0F0@", "0FREE0:junk", "0SEND_F0", "0F0@-1",
                                     "\u00b2F0"])
                    | st.text(min_size=1, max_size=6)
                )
            lines[index] = " ".join(tokens)
        elif action == "huge":
            lines[index] = line.replace("0", HUGE_DIGITS, 1)
        else:
            lines.insert(index, draw(st.sampled_from(["rank x: 0F0", "rank -1: 0F0", "rank 7: 0F0", "junk", ":"])
                                     | st.text(max_size=20)))
        if not lines:
            break
    return "\n".join(lines) + "\n"


@FUZZ
@given(mutated_text())
def test_from_text_mutated_schedules(text):
    loaded = only_pipeschedule_errors(ir.Schedule.from_text, text)
    if loaded is not None:
        assert ir.Schedule.from_text(loaded.to_text()) == loaded


@FUZZ
@given(st.text(max_size=200))
def test_from_text_random_text(text):
    only_pipeschedule_errors(ir.Schedule.from_text, text)
    only_pipeschedule_errors(ir.Schedule.from_text, ir.FORMAT + "\n" + text)


@FUZZ
@given(st.text(max_size=30) | st.sampled_from(["1F" + HUGE_DIGITS, HUGE_DIGITS + "F0", "0SEND_F0@" + HUGE_DIGITS]))
def test_instr_parse_random_text(token):
    try:
        instr = ir.Instr.parse(token)
    except PipescheduleError:
        return
    assert ir.Instr.parse(str(instr)) == instr


@FUZZ
@given(json_values)
def test_instr_from_dict_random_values(value):
    only_pipeschedule_errors(ir.Instr.from_dict, value)


# -- load ------------------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=300) | mutated_text().map(str.encode) | mutated_dict().map(lambda o: json_text(o).encode()))
def test_load_random_files(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "schedule.json")
        with open(path, "wb") as handle:
            handle.write(data)
        only_pipeschedule_errors(ir.load, path)


# -- regressions: exact inputs that once escaped as something else ---------------------

_TEXT_HEAD = 'pipeschedule/1\nname: "x"\npp: 1\nvirtual: 1\nmicrobatches: 1\nplacement: [0]\nparams: {}\n'
_JSON_HEAD = '{"format": "pipeschedule/1", "name": "x", "virtual": 1, "microbatches": 1, "placement": [0], '

REGRESSIONS = {
    # json.loads raises a plain ValueError (not JSONDecodeError) past 4300 digits.
    "json_int_over_4300_digits": (ir.Schedule.from_json, _JSON_HEAD + '"programs": [[]], "pp": ' + HUGE_DIGITS + "}"),
    # Each factor fits, but the message f-string formats pp*virtual (5000 digits).
    "json_placement_message_over_4300_digits": (
        ir.Schedule.from_json,
        '{"format": "pipeschedule/1", "name": "x", "pp": 1' + "0" * 3000 + ', "virtual": 1' + "0" * 2000
        + ', "microbatches": 1, "placement": [], "programs": []}',
    ),
    "text_value_over_4300_digits": (ir.Schedule.from_text,
                                    _TEXT_HEAD.replace("pp: 1", "pp: " + HUGE_DIGITS) + "rank 0: 0F0 0B0\n"),
    "text_token_over_4300_digits": (ir.Schedule.from_text, _TEXT_HEAD + "rank 0: " + HUGE_DIGITS + "F0\n"),
    "parse_token_over_4300_digits": (ir.Instr.parse, HUGE_DIGITS + "F0"),
    # str.isdigit accepts superscripts that int() refuses.
    "text_rank_superscript": (ir.Schedule.from_text, _TEXT_HEAD + "rank \u00b2: 0F0\n"),
    # A NUL byte in a path makes open() raise ValueError.
    "load_path_with_nul": (ir.load, "schedule\0.json"),
}


@pytest.mark.parametrize("load, data", list(REGRESSIONS.values()), ids=list(REGRESSIONS))
def test_loader_regressions(load, data):
    with bounded(10):
        with pytest.raises(PipescheduleError):
            load(data)


def test_text_huge_rank_number_is_refused_quickly():
    """`rank 10**12: ...` must be refused, not answered by building 10**12 empty programs."""
    with bounded(2):
        with pytest.raises(FormatError):
            ir.Schedule.from_text(_TEXT_HEAD + "rank 1000000000000: 0F0\n")
