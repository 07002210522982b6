"""One engine syntax: what nanotron's `pp_engine` takes, the command line takes too.

`--cap 4/3/2/1` (pp_engine's `cap=4/3/2/1`) and `--cap 4,3,2,1` read alike; NAME takes a
family's pp_engine name (`ps_1f1b`); `interleaved_1f1b` needs a chunk count on both
sides. The schedule `pipeschedule compile` writes is the one nanotron's adapter compiles
from the same values in either YAML form, and the planner's pp_engine values are what
the adapter parses and writes back ([Note: list syntax] in pipeschedule/checks.py,
[Note: pp_engine syntax] in pipeschedule/compiler/spec.py).
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import integration.nanotron  # noqa: F401  (the adapter, as a launch script imports it)
from integration.nanotron.pipeline.engine import build_engine
from integration.nanotron.pipeline.engine_spec import parse_engine
from pipeschedule.checks import parse_int_list
from pipeschedule.cli import main
from pipeschedule.cli.main import parse_cap
from pipeschedule.compiler.families import FAMILIES
from pipeschedule.compiler.ir import load
from pipeschedule.compiler.spec import compile_spec, parse_spec
from pipeschedule.errors import ParameterError
from pipeschedule.plan.candidate import Candidate
from pipeschedule.plan.fitting import OffloadCandidate
from pipeschedule.simulate import CostModel, simulate
from strategies import examples, schedule_params

CAPPED = tuple(name for name, f in FAMILIES.items() if f.takes_cap or f.takes_virtual)


def cli_schedule(name: str, params: dict, separator: str, work: Path):
    """The schedule `pipeschedule compile` writes for NAME and the flags of `params`
    (a per-rank cap joined by `separator`), or the one line it refused with."""
    argv = ["compile", name, "--pp", str(params["pp"]), "-m", str(params["microbatches"])]
    if "virtual" in params:
        argv += ["--virtual", str(params["virtual"])]
    cap = params.get("cap")
    if cap is not None:
        argv += ["--cap", separator.join(map(str, cap)) if isinstance(cap, list) else str(cap)]
    path = work / "s.json"
    path.unlink(missing_ok=True)
    code = main(argv + ["--json", str(path)])
    return load(str(path)).to_json() if code == 0 else code


def engine_schedule(value, params: dict):
    """The schedule nanotron's adapter compiles for pp_engine `value` at (pp, m), or 2
    (the CLI's exit code for bad input) where it refuses. (What the adapter runs besides
    is checked at its first step, `engine.check`: it runs no model chunks beside each
    other at pp = 1, which a schedule may have.)"""
    try:
        engine = build_engine(parse_engine(value))
        return engine.compile(pp=params["pp"], microbatches=params["microbatches"]).to_json()
    except ParameterError:
        return 2


def pp_engine_values(family: str, params: dict) -> list:
    """The pp_engine values of `params`: the string form (lists joined by '/') and the
    mapping form with a YAML list and with a string joined by ','."""
    name = FAMILIES[family].engine
    keys = {k: params[k] for k in ("virtual", "cap") if k in params}
    text = ",".join(f"{k}={'/'.join(map(str, v)) if isinstance(v, list) else v}" for k, v in keys.items())
    return [name + (":" + text if text else ""), {"name": name, **keys},
            {"name": name, **{k: ",".join(map(str, v)) if isinstance(v, list) else v for k, v in keys.items()}}]


@settings(max_examples=examples(40))
@given(schedule_params(max_pp=4, max_m=6, max_v=3, families=CAPPED), st.sampled_from("/,"))
def test_the_command_line_and_the_yaml_build_one_schedule(drawn, separator):
    family, params = drawn
    with tempfile.TemporaryDirectory() as work:
        from_cli = cli_schedule(family, params, separator, Path(work))
    for value in pp_engine_values(family, params):
        assert engine_schedule(value, params) == from_cli, (value, params)


def test_the_comparison_sees_a_cap_or_a_chunk_count_that_differs(tmp_path):
    """The equality above is no formality: one cap more, or one chunk more, is another
    schedule on both sides."""
    base = {"pp": 4, "microbatches": 8}
    capped = cli_schedule("capped_1f1b", base | {"cap": [3, 2, 2, 1]}, "/", tmp_path)
    assert capped == engine_schedule("capped_1f1b:cap=3/2/2/1", base)
    assert capped != engine_schedule("capped_1f1b:cap=3/3/2/1", base)
    assert capped != engine_schedule({"name": "capped_1f1b", "cap": "3,2,1,1"}, base)
    two = cli_schedule("interleaved_1f1b", base | {"virtual": 2}, "/", tmp_path)
    assert two == engine_schedule("interleaved_1f1b:virtual=2", base) != engine_schedule("interleaved_1f1b:virtual=3",
                                                                                           base)


def test_lists_read_alike_with_either_separator():
    assert parse_cap("4/3/2/1") == parse_cap("4,3,2,1") == [4, 3, 2, 1] and parse_cap("2") == 2
    assert parse_int_list("1,2,4,8", "--dp") == [1, 2, 4, 8]
    assert parse_engine({"name": "capped_1f1b", "cap": "4,3,2,1"}) == parse_engine("capped_1f1b:cap=4/3/2/1")
    for text in ("4/3,2", "4,,2", "4/x", "", "1_0"):
        with pytest.raises(ParameterError, match="--cap"):
            parse_cap(text)
    # in the string form ',' separates parameters: a list joined by it is named, with the '/' to use
    with pytest.raises(ParameterError, match=re.escape("a list is joined with '/' (cap=4/3/2/1)")):
        parse_engine("capped_1f1b:cap=4,3,2,1")
    with pytest.raises(ParameterError, match="cap joins its integers with one of / and ,"):
        parse_engine({"name": "capped_1f1b", "cap": "4/3,2/1"})


@pytest.mark.parametrize("command", ["compile", "simulate", "show"])
def test_interleaved_without_a_chunk_count_is_refused_as_pp_engine_refuses_it(command, capsys, tmp_path):
    """It was built with one chunk per rank, 1F1B under another name; pp_engine's
    `interleaved_1f1b` without virtual=V is refused at config load."""
    argv = [command, "interleaved_1f1b", "--pp", "4", "-m", "8"] + (["--json", str(tmp_path / "s.json")]
                                                                      if command == "compile" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "interleaved_1f1b needs virtual=N" in err[0], err  # the one grammar's words
    with pytest.raises(ParameterError, match="interleaved_1f1b needs virtual=N"):
        parse_engine("interleaved_1f1b")
    assert main([command, "interleaved_1f1b", "--pp", "4", "-m", "8", "--virtual", "2"]
                + argv[6:]) == 0


def test_a_pp_engine_name_is_a_schedule_name(tmp_path, capsys):
    assert main(["compile", "ps_1f1b", "--pp", "4", "-m", "8", "--json", str(tmp_path / "a.json")]) == 0
    assert main(["compile", "1f1b", "--pp", "4", "-m", "8", "--json", str(tmp_path / "b.json")]) == 0
    assert json.loads((tmp_path / "a.json").read_text()) == json.loads((tmp_path / "b.json").read_text())
    assert main(["compile", "ps_zbv", "--pp", "4", "-m", "8", "--json", str(tmp_path / "c.json")]) == 2
    assert "unknown engine 'ps_zbv'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["compile", "simulate", "show"])
def test_fewer_microbatches_than_ranks_warn_with_the_bubble(command, capsys, tmp_path):
    extra = ["--json", str(tmp_path / "s.json")] if command == "compile" else []
    assert main([command, "1f1b", "--pp", "4", "-m", "2", *extra]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pipeschedule: warning: 2 microbatches < pp=4"), err
    # 1F1B at m=2, pp=4 idles (pp-1)/(m+pp-1) = 3/5 of the step; at m=pp, 3/7
    assert "idle 60% of the step" in err[0] and "1F1B at m=pp: 43%" in err[0]
    assert main([command, "1f1b", "--pp", "4", "-m", "4", *extra]) == 0
    assert capsys.readouterr().err == ""


def test_the_warning_gives_the_schedules_own_bubble(capsys):
    from pipeschedule import compile_schedule

    main(["simulate", "interleaved_1f1b", "--pp", "4", "-m", "3", "--virtual", "2"])
    idle = simulate(compile_schedule("interleaved_1f1b", pp=4, microbatches=3, virtual=2),
                    CostModel.default(compile_schedule("interleaved_1f1b", pp=4, microbatches=3, virtual=2)))
    assert f"idle {idle.bubble_fraction:.0%} of the step" in capsys.readouterr().err


# -- the planner writes what the adapter reads --------------------------------------------------


@st.composite
def candidates(draw):
    """A planner row: any family, its chunks, a cap where it takes one, a split, a
    recompute mode or layers per stage, and host offload."""
    name = draw(st.sampled_from(sorted(FAMILIES)))
    f = FAMILIES[name]
    pp = draw(st.integers(1, 4))
    virtual = draw(st.integers(1, 3)) if f.takes_virtual else f.chunks()
    stages = pp * virtual
    cap = None
    if f.takes_cap and draw(st.booleans()):  # per rank at pp >= 2 (one rank's list is its one integer)
        cap = draw(st.integers(1, 8) | (st.tuples(*[st.integers(1, 8)] * pp) if pp > 1 else st.integers(1, 8)))
    split = tuple(draw(st.lists(st.integers(1, 9), min_size=stages, max_size=stages)))
    kind = draw(st.sampled_from(["nanotron", "optimal", "best found"]))
    recompute = draw(st.sampled_from(["none", "selective", "full"]))
    recomputed = None
    if recompute == "none" and draw(st.booleans()):
        recomputed = tuple(draw(st.integers(0, n)) for n in split)
    row = dict(family=name, cap=cap, virtual=virtual, split=split, split_kind=kind, recompute=recompute,
               recomputed=recomputed)
    if draw(st.booleans()):
        ranks = tuple(sorted(draw(st.sets(st.integers(0, pp - 1), min_size=1))))
        return OffloadCandidate(**row, offload=ranks, stream=draw(st.none() | st.integers(1, 512)))
    return Candidate(**row)


@settings(max_examples=examples(200))
@given(candidates())
def test_the_planners_engine_values_are_what_the_adapter_parses_and_writes(cand):
    value = cand.engine()
    spec = parse_engine(value)
    assert spec.to_string() == value  # the adapter's canonical form: the same text
    assert spec.cap == cand.cap and spec.name == FAMILIES[cand.family].engine
    assert spec.virtual == (cand.virtual if FAMILIES[cand.family].takes_virtual else None)
    assert spec.split == cand.split  # written whatever its kind: the memory counted is this split's
    if cand.recomputed:
        assert spec.recompute == (cand.recomputed if len(cand.recomputed) > 1 else cand.recomputed[0])
    else:
        assert spec.recompute == (None if cand.recompute == "none" else cand.recompute)
    if isinstance(cand, OffloadCandidate):
        assert spec.offload == cand.offload and spec.stream == cand.stream


def test_the_round_trip_rejects_a_value_out_of_the_adapters_order():
    """The planner wrote recompute first (`interleaved_1f1b:recompute=full,virtual=2`),
    which the adapter read but wrote back as `virtual=2,recompute=full`: the round trip
    above fails on that order, and on a number the adapter writes otherwise."""
    for value in ("interleaved_1f1b:recompute=full,virtual=2", "capped_1f1b:split=1/2/3/4,cap=2", "zbv:cap=02",
                  "ps_1f1b:offload=0,recompute=full"):
        assert parse_engine(value).to_string() != value


# -- any pp_engine value names a schedule -------------------------------------------------------


@pytest.mark.parametrize("command", ["simulate", "show"])
def test_a_pp_engine_value_is_a_schedule_with_its_flags_beside_it(command, capsys):
    """`simulate 'capped_1f1b:cap=2'` said `unknown schedule`; the value and the flags it
    stands for print the same, and a parameter given both ways must agree."""
    assert main([command, "capped_1f1b:cap=2", "--pp", "4", "-m", "8"]) == 0
    value = capsys.readouterr()
    assert main([command, "capped_1f1b", "--cap", "2", "--pp", "4", "-m", "8"]) == 0
    assert capsys.readouterr() == value and value.err == ""
    assert main([command, "interleaved_1f1b:virtual=2", "--virtual", "2", "--pp", "4", "-m", "8"]) == 0
    capsys.readouterr()
    assert main([command, "capped_1f1b:cap=2", "--cap", "3", "--pp", "4", "-m", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cap given twice: cap=2 in the value and 3 beside it" in err[0], err
    assert main([command, "auto", "--pp", "4", "-m", "8"]) == 2
    assert "auto is chosen by the engine at its first step" in capsys.readouterr().err


def test_a_cap_that_binds_on_no_rank_is_said_once(capsys, tmp_path):
    for argv in (["compile", "capped_1f1b", "--cap", "9", "--json", str(tmp_path / "s.json")],
                 ["simulate", "capped_1f1b:cap=8"], ["show", "capped_1f1b:cap=8"]):
        assert main(argv + ["--pp", "4", "-m", "4"]) == 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("pipeschedule: warning: cap ") and "binds on no rank" in err[0]
        assert "holds at most 4/3/2/1 microbatches in flight per rank without it" in err[0]
    assert main(["simulate", "capped_1f1b:cap=2", "--pp", "4", "-m", "4"]) == 0
    assert capsys.readouterr().err == ""


def test_every_in_flight_figure_names_its_unit(capsys):
    assert main(["simulate", "zbv", "--pp", "4", "-m", "8"]) == 0
    assert "peak in-flight   [8, 8, 8, 8] stage-microbatches (2 stages a rank)" in capsys.readouterr().out
    assert main(["simulate", "ps_1f1b", "--pp", "4", "-m", "8"]) == 0
    assert "peak in-flight   [4, 3, 2, 1] microbatches\n" in capsys.readouterr().out
    assert main(["simulate", "zbv", "--pp", "4", "-m", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inflight_unit"] == "stage-microbatches (2 stages a rank)"


def test_layout_parameters_are_taken_and_said_to_leave_the_order_alone(capsys):
    assert main(["simulate", "capped_1f1b:cap=2,split=1/2/2/1,recompute=full", "--pp", "4", "-m", "8"]) == 0
    out = capsys.readouterr()
    assert main(["simulate", "capped_1f1b:cap=2", "--pp", "4", "-m", "8"]) == 0
    assert capsys.readouterr().out == out.out
    assert out.err.strip() == ("pipeschedule: note: split and recompute set the model's layout, not the schedule's "
                               "order: the unit costs here do not see them (`pipeschedule plan` prices them)")



def test_an_offload_in_the_value_is_in_the_schedule(tmp_path):
    assert main(["compile", "ps_1f1b:offload=0", "--pp", "2", "-m", "4", "--json", str(tmp_path / "s.json")]) == 0
    written = load(str(tmp_path / "s.json"))
    assert written == compile_spec(parse_spec("ps_1f1b:offload=0"), pp=2, microbatches=4)
    moved = [sum(i.op == "OFFLOAD" for i in p) for p in written.programs]
    assert moved[0] > 0 and moved[1] == 0  # rank 0's stashes (those that wait longer than lead=1), rank 1's none
