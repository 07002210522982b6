"""`parallelism.pp_engine` with pipeschedule's engines, through nanotron's own loader and saver.

A minimal valid nanotron 0.4 config needs: general.project, parallelism.{dp, pp, tp},
model.model_config (any LlamaConfig fields), model.init_method.std, and a tokenizer
section (all its fields are optional, `{}` will do). Everything goes through nanotron's
`get_config_from_file` (dacite, strict=True) and `Config.save_as_yaml` (which re-reads
what it wrote).
"""

from __future__ import annotations

import sys

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

import integration.nanotron  # noqa: F401  (registers the engines, as a launch script would)
from integration.nanotron.patches import patching
from integration.nanotron.patches import engine_names
from integration.nanotron.pipeline.engine import check_spec
from integration.nanotron.pipeline.engine_spec import ForeignSpec, ScheduleSpec, parse_engine
from integration.nanotron.pipeline.errors import ConfigError
from nanotron.config import get_config_from_file
from nanotron.config.parallelism_config import ParallelismArgs
from nanotron.parallel.pipeline_parallel.engine import (
    AllForwardAllBackwardPipelineEngine,
    OneForwardOneBackwardPipelineEngine,
)
from pipeschedule.errors import ParameterError
from pipeschedule.compiler.families import FAMILIES

MINIMAL = {
    "general": {"project": "pipeschedule-test"},
    "parallelism": {"dp": 1, "pp": 4, "tp": 1},
    "model": {"model_config": {"hidden_size": 64, "num_hidden_layers": 80}, "init_method": {"std": 0.02}},
    "tokenizer": {},
}

STRINGS = {
    "capped_1f1b": ScheduleSpec("capped_1f1b"),
    "capped_1f1b:cap=2": ScheduleSpec("capped_1f1b", cap=2),
    "capped_1f1b:cap=4/3/2/1": ScheduleSpec("capped_1f1b", cap=(4, 3, 2, 1)),
    "capped_1f1b:cap=2,split=19/21/21/19": ScheduleSpec("capped_1f1b", cap=2, split=(19, 21, 21, 19)),
    "interleaved_1f1b:virtual=2": ScheduleSpec("interleaved_1f1b", virtual=2),
    "interleaved_1f1b:virtual=2,cap=4": ScheduleSpec("interleaved_1f1b", cap=4, virtual=2),
    "interleaved_1f1b:cap=4,virtual=2,split=10/10/10/10/10/10/10/10":
        ScheduleSpec("interleaved_1f1b", cap=4, virtual=2, split=(10,) * 8),
    "ps_1f1b": ScheduleSpec("1f1b"),
    "ps_afab:split=20/20/20/20": ScheduleSpec("afab", split=(20, 20, 20, 20)),
    "1f1b": ForeignSpec("1f1b"),
    "afab": ForeignSpec("afab"),
    "capped_1f1b:cap=2,offload=0,stream=256": ScheduleSpec("capped_1f1b", cap=2, offload=(0,), stream=256),
    "ps_1f1b:stream=64,lead=0,offload=0/1": ScheduleSpec("1f1b", offload=(0, 1), lead=0, stream=64),
    "zb_h1:recompute=full": ScheduleSpec("zb_h1", recompute="full"),
    "capped_1f1b:cap=2,recompute=2": ScheduleSpec("capped_1f1b", cap=2, recompute=2),
    "v_half:recompute=1/0/0/1": ScheduleSpec("v_half", recompute=(1, 0, 0, 1)),
    "ps_1f1b:recompute=selective": ScheduleSpec("1f1b", recompute="selective"),
}

MAPPINGS = [
    ({"name": "capped_1f1b", "cap": 2}, ScheduleSpec("capped_1f1b", cap=2)),
    ({"name": "capped_1f1b", "cap": [4, 3, 2, 1]}, ScheduleSpec("capped_1f1b", cap=(4, 3, 2, 1))),
    ({"name": "capped_1f1b", "cap": 2, "split": [19, 21, 21, 19]},
     ScheduleSpec("capped_1f1b", cap=2, split=(19, 21, 21, 19))),
    ({"name": "capped_1f1b", "split": "19/21/21/19"}, ScheduleSpec("capped_1f1b", split=(19, 21, 21, 19))),
    ({"name": "interleaved_1f1b", "virtual": 2, "cap": 4}, ScheduleSpec("interleaved_1f1b", cap=4, virtual=2)),
    ({"name": "1f1b"}, ForeignSpec("1f1b")),
    ({"name": "zbv", "offload": [0], "stream": 128}, ScheduleSpec("zbv", offload=(0,), stream=128)),
    ({"name": "capped_1f1b", "recompute": [2, 1]}, ScheduleSpec("capped_1f1b", recompute=(2, 1))),
]

BAD = [
    ("capped_1f1b:cap=0", "cap must be an integer >= 1"),
    ({"name": "capped_1f1b", "cap": 0}, "cap must be an integer >= 1"),
    ("capped_1f1b:cap=two", "cap must be an integer"),
    # 19 digits: the digit limit is named (it said "must be an integer"), as text or as a YAML integer
    ("capped_1f1b:cap=1234567890123456789", "cap has 19 digits, got '1234567890123456789'; at most 18 are accepted"),
    ({"name": "capped_1f1b", "cap": 10 ** 30}, "cap has more than 18 digits"),
    ("capped_1f1b:split=40/1234567890123456789", "split has 19 digits"),
    ("zero_bubble", "unknown engine 'zero_bubble'"),
    ("capped_1f1b:capp=2", "unknown parameter 'capp' for capped_1f1b; capped_1f1b accepts: cap, split"),
    ("capped_1f1b:virtual=2", "unknown parameter 'virtual' for capped_1f1b"),
    ("interleaved_1f1b:cap=2", "interleaved_1f1b needs virtual=N"),
    ("interleaved_1f1b:virtual=0", "virtual must be an integer in 1..1024"),
    ("interleaved_1f1b:virtual=1000000", "1..1024 (each chunk holds a decoder layer), got '1000000'"),  # was 30 MB
    ("1f1b:cap=2", "nanotron's own '1f1b' takes no parameters"),
    ("capped_1f1b:cap=2,cap=3", "parameter 'cap' given twice"),
    ("capped_1f1b:split=20/-1", "split must list decoder layers per stage"),
    ("capped_1f1b:", "nothing after ':'"),
    ("capped_1f1b:cap", "expected KEY=VALUE"),
    ({"cap": 2}, "needs a 'name' key"),
    ("ps_1f1b:stream=64", "stream applies to offloaded stashes: give offload=RANKS too"),
    ("ps_1f1b:offload=0/0", "offload must list distinct ranks >= 0"),
    ("ps_1f1b:offload=0,stream=0", "stream must be an integer >= 1 (MiB per chunk), got '0'"),
    ("ps_1f1b:offload=0,lead=-1", "lead must be an integer >= 0"),
    ("1f1b:offload=0", "nanotron's own '1f1b' takes no parameters"),
    ("capped_1f1b:recompute=some", "recompute must be full, selective, or decoder layers per stage"),
    ("capped_1f1b:recompute=-1", "recompute must be full, selective, or decoder layers per stage"),
    # the digit limit is named for recompute too (it said "must be full, selective, or ...")
    ("ps_1f1b:recompute=1234567890123456789",
     "recompute has 19 digits, got '1234567890123456789'; at most 18 are accepted"),
    ("ps_1f1b:recompute=2/1234567890123456789", "recompute has 19 digits"),
    ({"name": "ps_1f1b", "recompute": 10 ** 30}, "recompute has more than 18 digits"),
    ({"name": "ps_1f1b", "recompute": [2, 10 ** 30]}, "recompute has more than 18 digits"),
    ({"name": "ps_1f1b", "recompute": "1234567890123456789"}, "recompute has 19 digits"),
    ("ps_1f1b:recompute=1234567890123456789x", "recompute must be full, selective, or decoder layers per stage"),
]


def write(path, pp_engine, *, raw_line: str | None = None) -> str:
    data = {**MINIMAL, "parallelism": {**MINIMAL["parallelism"], "pp_engine": pp_engine}}
    text = yaml.safe_dump(data)
    if raw_line is not None:  # the value exactly as a person would type it, unquoted
        text = text.replace(f"pp_engine: {yaml.safe_dump(pp_engine).strip()}", raw_line)
        assert raw_line in text
    path.write_text(text)
    return str(path)


def spec_of(engine):
    if hasattr(engine, "spec"):  # ours keep the spec they were built from
        return engine.spec
    if isinstance(engine, AllForwardAllBackwardPipelineEngine):
        return ForeignSpec("afab")
    assert isinstance(engine, OneForwardOneBackwardPipelineEngine), engine
    return ForeignSpec("1f1b")


def round_trip(tmp_path, pp_engine, raw_line=None):
    first = get_config_from_file(write(tmp_path / "in.yaml", pp_engine, raw_line=raw_line))
    first.save_as_yaml(str(tmp_path / "saved.yaml"))  # nanotron re-reads it inside
    saved_text = (tmp_path / "saved.yaml").read_text()
    second = get_config_from_file(str(tmp_path / "saved.yaml"))
    return first.parallelism.pp_engine, second.parallelism.pp_engine, saved_text


# -- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("value", list(STRINGS))
def test_string_form_round_trips(tmp_path, value):
    loaded, reloaded, saved = round_trip(tmp_path, value, raw_line=f"pp_engine: {value}")
    assert spec_of(loaded) == STRINGS[value] == spec_of(reloaded)
    assert type(loaded) is type(reloaded)
    assert yaml.safe_load(saved)["parallelism"]["pp_engine"] == STRINGS[value].to_string()


@pytest.mark.parametrize("value, expected", MAPPINGS, ids=[str(v) for v, _ in MAPPINGS])
def test_mapping_form_round_trips(tmp_path, value, expected):
    loaded, reloaded, saved = round_trip(tmp_path, value)
    assert spec_of(loaded) == expected == spec_of(reloaded)
    assert yaml.safe_load(saved)["parallelism"]["pp_engine"] == expected.to_string()


def test_nanotron_engines_keep_nanotron_classes(tmp_path):
    for name, cls in (("1f1b", OneForwardOneBackwardPipelineEngine), ("afab", AllForwardAllBackwardPipelineEngine)):
        loaded, reloaded, _ = round_trip(tmp_path, name)
        assert type(loaded) is cls and type(reloaded) is cls


def test_python_construction_uses_the_same_parser():
    args = ParallelismArgs(dp=1, pp=4, tp=1, pp_engine="capped_1f1b:cap=2")
    assert args.pp_engine.spec == ScheduleSpec("capped_1f1b", cap=2)


def test_python_mapping_form_builds_the_engine_and_saves(tmp_path):
    """nanotron converts only a string given from Python; the hook converts the mapping
    form too, so a config built in Python saves and loads back ([Note: nanotron hooks])."""
    args = ParallelismArgs(dp=1, pp=4, tp=1, pp_engine={"name": "capped_1f1b", "cap": 3, "recompute": "full"})
    assert args.pp_engine.spec == ScheduleSpec("capped_1f1b", cap=3, recompute="full")
    config = get_config_from_file(write(tmp_path / "in.yaml", "1f1b"))
    config.parallelism = args
    config.save_as_yaml(str(tmp_path / "saved.yaml"))
    assert "pp_engine: capped_1f1b:cap=3,recompute=full" in (tmp_path / "saved.yaml").read_text()
    assert get_config_from_file(str(tmp_path / "saved.yaml")).parallelism.pp_engine.spec == args.pp_engine.spec


# -- parallelism.pipeline_engine: the design's name for pp_engine -------------------------


def write_key(path, **engine_keys) -> str:
    path.write_text(yaml.safe_dump({**MINIMAL, "parallelism": {**MINIMAL["parallelism"], **engine_keys}}))
    return str(path)


@pytest.mark.parametrize("value, expected", [("capped_1f1b:cap=2", ScheduleSpec("capped_1f1b", cap=2)),
                                             ({"name": "zbv", "cap": 3}, ScheduleSpec("zbv", cap=3)),
                                             ("1f1b", ForeignSpec("1f1b"))])
def test_pipeline_engine_key_loads_and_saves_as_pp_engine(tmp_path, value, expected):
    """[Note: pipeline_engine key]: the same engine as under pp_engine; saved under pp_engine only."""
    loaded = get_config_from_file(write_key(tmp_path / "in.yaml", pipeline_engine=value))
    assert spec_of(loaded.parallelism.pp_engine) == expected
    loaded.save_as_yaml(str(tmp_path / "saved.yaml"))
    saved = yaml.safe_load((tmp_path / "saved.yaml").read_text())["parallelism"]
    assert saved["pp_engine"] == expected.to_string() and "pipeline_engine" not in saved


@pytest.mark.parametrize("ours", ["1f1b", "capped_1f1b:cap=2"])
def test_pipeline_engine_and_pp_engine_together_are_refused_naming_both(tmp_path, ours):
    with pytest.raises(ConfigError) as caught:
        get_config_from_file(write_key(tmp_path / "both.yaml", pp_engine="1f1b", pipeline_engine=ours))
    message = str(caught.value)
    assert "\n" not in message
    assert "pp_engine ('1f1b')" in message and f"pipeline_engine ({ours!r})" in message
    assert "give one of them" in message


def test_other_keys_are_left_to_nanotron(tmp_path):
    """Only pipeline_engine is renamed: another unknown key is still dacite's to refuse."""
    with pytest.raises(Exception, match="can not match \"pipline_engine\""):
        get_config_from_file(write_key(tmp_path / "typo.yaml", pipline_engine="1f1b"))


# -- errors at load -----------------------------------------------------------------------


@pytest.mark.parametrize("value, reason", BAD, ids=[str(v) for v, _ in BAD])
def test_bad_values_fail_at_load_naming_value_and_choices(tmp_path, value, reason):
    with pytest.raises(ValueError) as caught:
        get_config_from_file(write(tmp_path / "bad.yaml", value))
    message = str(caught.value)
    assert isinstance(caught.value, ParameterError)
    assert repr(yaml.safe_load(yaml.safe_dump(value))) in message  # the value as nanotron read it
    assert reason in message
    if any(word in reason for word in ("unknown engine", "'name' key", "nothing after")):  # the name or the form
        for accepted in ("afab", "1f1b", "ps_1f1b", "capped_1f1b", "interleaved_1f1b:virtual=V", "mapping form"):
            assert accepted in message
    else:  # a parameter's refusal names its own rule, not every engine
        assert "Accepted:" not in message


# -- the engines behind the names ---------------------------------------------------------


def test_every_family_is_an_engine_name_with_its_own_parameters():
    for family in FAMILIES.values():
        required = "virtual=2" if family.takes_virtual else ""
        spec = parse_engine(family.engine + (":" + required if required else ""))
        assert spec.family == family.name and spec.name == family.engine
        assert spec.to_string() == family.engine + (":" + required if required else "")


def parse_and_build(value):
    return sys.modules["nanotron.config.config"].cast_str_to_pipeline_engine(value)


# -- the engine-name patches ---------------------------------------------------------------


def bindings():
    return {
        (name, attr): getattr(module, attr)
        for name, module in list(sys.modules.items()) if module is not None and name.startswith("nanotron")
        for attr in ("cast_str_to_pipeline_engine", "cast_pipeline_engine_to_str", "get_config_from_dict")
        if attr in vars(module)
    }


def test_the_patches_are_idempotent_and_reversible(tmp_path):
    before = bindings()
    assert all(patch.state == "on" for patch in engine_names.PATCHES)
    assert set(before.values()) == {engine_names.cast_str_to_pipeline_engine, engine_names.cast_pipeline_engine_to_str,
                                    engine_names.get_config_from_dict}
    patching.install()
    assert bindings() == before
    try:
        patching.uninstall()
        assert all(patch.state == "off" for patch in engine_names.PATCHES)
        assert not set(bindings().values()) & set(before.values())
        with pytest.raises(ValueError, match="pp_engine should be a string selected in"):
            parse_and_build("capped_1f1b")  # nanotron's own message
        with pytest.raises(Exception, match="can not match \"pipeline_engine\" to any data class field"):
            get_config_from_file(write_key(tmp_path / "key.yaml", pipeline_engine="1f1b"))  # dacite's own
    finally:
        patching.install()
    assert bindings() == before


# -- the spec on its own ------------------------------------------------------------------

positive = st.integers(1, 64)
specs = st.one_of(
    st.builds(ScheduleSpec, st.just("1f1b"), split=st.none() | st.lists(st.integers(0, 9), min_size=2, max_size=8)
              .filter(lambda s: sum(s) > 0).map(tuple)),
    st.builds(ScheduleSpec, st.just("capped_1f1b"),
              cap=st.none() | positive | st.lists(positive, min_size=2, max_size=8).map(tuple)),
    st.builds(ScheduleSpec, st.just("interleaved_1f1b"), virtual=positive, cap=st.none() | positive),
)


@given(specs)
def test_canonical_string_parses_back(spec):
    assert parse_engine(spec.to_string()) == spec
    mapping = {"name": spec.name, **{k: list(v) if isinstance(v, tuple) else v for k, v in spec.params().items()}}
    assert parse_engine(mapping) == spec
    assert yaml.safe_load(yaml.safe_dump({"pp_engine": spec.to_string()}))["pp_engine"] == spec.to_string()


def test_check_against_the_run():
    parse_engine("capped_1f1b:cap=4/3/2/1,split=19/21/21/19").check_against(pp=4, num_layers=80)
    parse_engine("interleaved_1f1b:virtual=2,split=1/1/1/1").check_against(pp=2, num_layers=4)
    parse_engine("ps_1f1b").check_against(pp=1, num_layers=4)
    for value, pp, layers, reason in (
        ("capped_1f1b:cap=4/3/2/1", 2, None, "cap lists 4 ranks but pp = 2"),
        ("capped_1f1b:split=40/40", 4, 80, "split lists 2 stages but pp * virtual = 4 * 1 = 4"),
        ("capped_1f1b:split=19/21/21/18", 4, 80, "19+21+21+18 = 79 decoder layers but the model has 80"),
        ("ps_1f1b:offload=0/4", 4, None, "offload names rank 4 but pp = 4"),
        ("zbv", 1, None, "runs 2 model chunks per rank, which this adapter does not run at pp = 1"),
        ("interleaved_1f1b:virtual=3", 1, None, "runs 3 model chunks per rank"),
    ):
        with pytest.raises(ParameterError, match=reason.replace("+", r"\+").replace("*", r"\*")):
            check_spec(parse_engine(value), pp=pp, num_layers=layers)


@pytest.mark.parametrize("value", ["auto", "auto:reserve=4"])
def test_auto_saves_as_auto(tmp_path, value):
    """A saved config (and the config.yaml nanotron writes into each checkpoint) keeps the
    user's `auto`: it wrote the engine auto runs first (capped_1f1b:cap=1), so a resumed run
    ran cap 1 for good."""
    from integration.nanotron.pipeline.engine import AutoEngine

    loaded, reloaded, saved = round_trip(tmp_path, value, raw_line=f"pp_engine: {value}")
    assert yaml.safe_load(saved)["parallelism"]["pp_engine"] == parse_engine(value).to_string()
    assert isinstance(loaded, AutoEngine) and isinstance(reloaded, AutoEngine)
    assert loaded.auto == reloaded.auto == parse_engine(value)
