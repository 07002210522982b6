"""The one grammar of `pp_engine` values ([Note: pp_engine syntax] in
pipeschedule/compiler/spec.py): parse and print are inverses over every value the
grammar holds (both forms), a broken value is refused naming what is wrong, defaults
come from the family record, and `compile_spec` is the schedule the value names."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from hypothesis import assume, given, settings, strategies as st

from pipeschedule import compile_schedule
from pipeschedule.compiler.families import FAMILIES
from pipeschedule.compiler.offload import add_offload
from pipeschedule.compiler.spec import (
    AutoSpec, ForeignSpec, ScheduleSpec, accepted_summary, compile_spec, family_params, inflight_peaks,
    inflight_unit, parse_spec, unbound_cap,
)
from pipeschedule.errors import ParameterError
from strategies import examples

counts = st.integers(0, 12)
positive = st.integers(1, 12)


def several(items):
    return st.lists(items, min_size=2, max_size=6).map(tuple)


NAMES = tuple(sorted(FAMILIES))


@st.composite
def specs(draw, families=NAMES):
    """Any value of the grammar: a family, its chunk count where it takes one, and every
    parameter it takes, each present or not, one or several."""
    family = FAMILIES[draw(st.sampled_from(families))]
    values = {}
    if family.takes_virtual:
        values["virtual"] = draw(positive)
    if family.takes_cap and draw(st.booleans()):
        values["cap"] = draw(positive | several(positive))
    if draw(st.booleans()):
        values["split"] = draw(several(counts).filter(lambda s: sum(s) > 0))
    if draw(st.booleans()):
        values["recompute"] = draw(st.sampled_from(["full", "selective"]) | counts | several(counts))
    if draw(st.booleans()):
        values["offload"] = draw(st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True).map(tuple))
        if draw(st.booleans()):
            values["lead"] = draw(counts)
        if draw(st.booleans()):
            values["stream"] = draw(positive)
    return ScheduleSpec(family.name, **values)


@settings(max_examples=examples(200))
@given(specs())
def test_print_and_parse_are_inverses_in_both_forms(spec):
    text = spec.to_string()
    assert parse_spec(text) == spec
    assert parse_spec(spec.to_mapping()) == spec
    assert parse_spec(text).to_string() == text  # canonical: printed again, the same text
    assert text.split(":")[0] == FAMILIES[spec.family].engine and " " not in text


@settings(max_examples=examples(200))
@given(specs(), st.data())
def test_a_broken_value_is_refused_naming_what_is_wrong(spec, data):
    """Each edit of a printed value that leaves the grammar is refused with a reason; an
    edit to another value of the grammar parses to something else (never the same spec)."""
    text = spec.to_string()
    family = FAMILIES[spec.family]
    edits = {
        "unknown key": (text + ("," if ":" in text else ":") + "bogus=1", "unknown parameter 'bogus'"),
        "repeated key": (text + ("," if ":" in text else ":") + "split=1" if spec.split else None,
                         "given twice"),
        "no value": (text + ("," if ":" in text else ":") + "cap", "expected KEY=VALUE"),
        "bad number": (re.sub(r"=(\d+)", "=x", text, count=1) if "=" in text and re.search(r"=\d", text) else None,
                       "must be"),
        "unknown name": ("zz" + text, "unknown engine"),
        "empty tail": (text.split(":")[0] + ":", "nothing after ':'"),
    }
    if family.takes_virtual:
        edits["no virtual"] = (re.sub(r"virtual=\d+,?", "", text).rstrip(":"), "needs virtual")
    if not family.takes_cap:
        edits["cap not taken"] = (text + ("," if ":" in text else ":") + "cap=2", "unknown parameter 'cap'")
    name = data.draw(st.sampled_from(sorted(k for k, (v, _) in edits.items() if v is not None)))
    value, reason = edits[name]
    with pytest.raises(ParameterError, match=re.escape(reason)):
        parse_spec(value)


def test_the_refusals_name_the_value_and_the_rule():
    for value, reason in (
        ("capped_1f1b:cap=0", "cap must be an integer >= 1"),
        ("capped_1f1b:cap=4,3", "a list is joined with '/' (cap=4/3/2/1)"),
        ("interleaved_1f1b", "interleaved_1f1b needs virtual=N"),
        ("zbv:virtual=2", "unknown parameter 'virtual' for zbv"),
        ("ps_1f1b:stream=64", "stream applies to offloaded stashes"),
        ({"name": "capped_1f1b", "cap": "4/3,2"}, "cap joins its integers with one of / and ,"),
        ({"cap": 2}, "the mapping form needs a 'name' key"),
        (3, "expected a string or a mapping"),
    ):
        with pytest.raises(ParameterError, match=re.escape(reason)) as refused:
            parse_spec(value)
        assert str(refused.value).startswith(f"pp_engine {value!r}: ")


def test_a_value_built_in_python_is_held_to_the_same_rules():
    for family, values, reason in (
        ("interleaved_1f1b", {}, "needs virtual"), ("zbv", {"virtual": 2}, "takes no virtual"),
        ("afab", {"cap": 2}, "takes no cap"), ("capped_1f1b", {"cap": (2,)}, "cap must be"),
        ("1f1b", {"split": (0, 0)}, "split must be"), ("1f1b", {"recompute": "most"}, "recompute must be"),
        ("1f1b", {"offload": (0, 0)}, "distinct ranks"), ("1f1b", {"stream": 8}, "give offload too"),
        ("nosuch", {}, "unknown family 'nosuch'"),
    ):
        with pytest.raises(ParameterError, match=reason):
            ScheduleSpec(family, **values)


def test_names_auto_and_the_callers_own():
    assert parse_spec("1f1b") == parse_spec("ps_1f1b") == ScheduleSpec("1f1b")  # a family's own name, or its engine
    assert parse_spec("1f1b").to_string() == "ps_1f1b"  # printed by its engine name: `1f1b` may mean nanotron's
    nanotron = {"foreign": ("afab", "1f1b"), "foreign_words": "nanotron's own"}
    assert parse_spec("1f1b", **nanotron) == ForeignSpec("1f1b") and parse_spec("ps_1f1b", **nanotron).family == "1f1b"
    with pytest.raises(ParameterError, match="nanotron's own '1f1b' takes no parameters .* write ps_1f1b"):
        parse_spec("1f1b:split=1/1", **nanotron)
    assert parse_spec("auto") == AutoSpec() and parse_spec("auto:reserve=4") == AutoSpec(4)
    assert parse_spec(AutoSpec(4).to_string()) == AutoSpec(4)
    summary = accepted_summary(**nanotron)
    for family in FAMILIES.values():
        assert family.engine in summary
    assert summary.startswith("afab, 1f1b (nanotron's own engines")


def test_the_parameters_and_defaults_come_from_the_family_record():
    for family in FAMILIES.values():
        params = family_params(family)
        assert ("virtual" in params) == family.takes_virtual and ("cap" in params) == family.takes_cap
        spec = ScheduleSpec(family.name, virtual=2 if family.takes_virtual else None)
        assert spec.chunks == family.chunks(spec.virtual)
        for pp in (1, 2, 5):
            assert spec.cap_at(pp) == (family.default_cap(pp) if family.default_cap else None)
            assert spec.placement(pp) == list(family.placement(pp, spec.chunks))
    assert ScheduleSpec("capped_1f1b").cap_at(5) == 3 and ScheduleSpec("capped_1f1b", cap=1).cap_at(5) == 1


@settings(max_examples=examples(60))
@given(specs(), st.integers(1, 4), st.integers(1, 6))
def test_compile_spec_is_the_family_schedule_with_its_offload(spec, pp, m):
    spec = replace(spec, split=None, recompute=None)
    assume(not isinstance(spec.cap, tuple) or len(spec.cap) == pp)
    assume(spec.offload is None or max(spec.offload) < pp)
    assume(pp * spec.chunks * m <= 200)
    try:
        plain = compile_schedule(spec.family, pp=pp, microbatches=m, virtual=spec.virtual, cap=spec.cap_at(pp))
    except ParameterError as refused:  # (a cap below the stages of a rank): refused alike
        with pytest.raises(ParameterError, match=re.escape(str(refused))):
            compile_spec(spec, pp=pp, microbatches=m)
        return
    schedule = compile_spec(spec, pp=pp, microbatches=m)
    policy = spec.offload_policy()
    assert schedule == (plain if policy is None else add_offload(plain, policy))


def test_compile_spec_checks_the_run():
    for spec, reason in ((ScheduleSpec("capped_1f1b", cap=(2, 1)), "cap lists 2 ranks but pp = 4"),
                         (ScheduleSpec("1f1b", offload=(4,)), "offload names rank 4 but pp = 4"),
                         (ScheduleSpec("zbv", split=(1, 1, 1, 1)), r"split lists 4 stages but pp \* virtual = 4 \* 2")):
        with pytest.raises(ParameterError, match=reason):
            compile_spec(spec, pp=4, microbatches=4)


def test_a_cap_that_binds_on_no_rank_is_said_in_one_line():
    line = unbound_cap(parse_spec("capped_1f1b:cap=8"), pp=4, microbatches=4)
    assert line.startswith("cap 8 binds on no rank: capped_1f1b at pp=4, m=4 holds at most 4/3/2/1 microbatches")
    assert unbound_cap(parse_spec("capped_1f1b:cap=4"), pp=4, microbatches=4) is not None  # cap = pp: 1F1B
    assert unbound_cap(parse_spec("capped_1f1b:cap=3"), pp=4, microbatches=4) is None
    assert unbound_cap(parse_spec("capped_1f1b:cap=3"), pp=4, microbatches=2) is not None  # m = 2 holds 2
    line = unbound_cap(parse_spec("zbv:cap=8"), pp=4, microbatches=4)
    assert "stage-microbatches (2 stages a rank)" in line
    assert unbound_cap(parse_spec("interleaved_1f1b:virtual=2,cap=4"), pp=4, microbatches=8) is None
    assert unbound_cap(parse_spec("capped_1f1b"), pp=4, microbatches=8) is None  # no cap given: the default binds


@settings(max_examples=examples(60))
@given(specs(families=tuple(n for n, f in FAMILIES.items() if f.takes_cap)), st.integers(1, 4), st.integers(1, 6))
def test_the_unbound_cap_line_agrees_with_the_compiled_schedule(spec, pp, m):
    """The line is said exactly where the capped schedule holds what the uncapped one holds
    on every rank and no rank reaches past its cap."""
    spec = replace(spec, split=None, recompute=None, offload=None, lead=None, stream=None)
    assume(spec.cap is not None and (not isinstance(spec.cap, tuple) or len(spec.cap) == pp))
    assume(pp * spec.chunks * m <= 200)
    free = inflight_peaks(compile_spec(replace(spec, cap=spec.chunks * m), pp=pp, microbatches=m))
    caps = spec.cap if isinstance(spec.cap, tuple) else (spec.cap,) * pp
    said = unbound_cap(spec, pp=pp, microbatches=m) is not None
    assert said == all(f <= c for f, c in zip(free, caps))


def test_inflight_units():
    assert inflight_unit(1) == "microbatches" and inflight_unit(2) == "stage-microbatches (2 stages a rank)"
    assert inflight_peaks(compile_spec(ScheduleSpec("1f1b"), pp=4, microbatches=8)) == [4, 3, 2, 1]
