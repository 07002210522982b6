"""The split-backward engines (zb_h1, zbv, v_half, v_min, zb_h2, dualpipev, interleaved_zb at
virtual=2: every family of FAMILIES with a split backward) on nanotron, for real: gloo on
CPU, nanotron's PipelineBlocks and config loader, compared with the pp=1 "loop"
reference (for each microbatch, `(model(**mb)["loss"] / m).backward()`).

Parity is bitwise ([Note: split backward] in pipeschedule.runtime.split_backward): every
linear layer of the model (nn.Linear and the LM head's F.linear) defers its weight
gradient to W, each stage runs its W in microbatch order, and the deferred halves are
autograd's own derivatives of the same matmuls.
"""

from __future__ import annotations

import functools

import pytest
import yaml

import integration.nanotron  # noqa: F401  (first: repairs nanotron, registers the engine names)
from integration.nanotron.pipeline.engine import PipescheduleEngine, build_engine
from integration.nanotron.pipeline.engine_spec import ScheduleSpec
from benchmarks.llama.reference import Job, Run, run_nanotron
from benchmarks.llama.model import ModelConfig
from pipeschedule.errors import ParameterError
from pipeschedule.compiler.families import FAMILIES

SMALL = ModelConfig(hidden=32, layers=4, heads=4, kv_heads=2, ffn=64, vocab=128, seq=16)
EIGHT = ModelConfig(hidden=32, layers=8, heads=4, kv_heads=2, ffn=64, vocab=128, seq=16)
SPLIT = {family.engine + (":virtual=2" if family.takes_virtual else ""): family
         for family in FAMILIES.values() if family.split_backward}
ENGINES = tuple(SPLIT)
COUNTS = {2: (1, 2, 5), 4: (3, 9)}  # microbatches per pp
CAPPED = {2: ("zb_h1:cap=1", "v_min:cap=2", "v_half:split=1/1/1/1", "zb_h2:cap=2", "dualpipev:cap=3"),
          4: ("zbv:cap=4", "interleaved_zb:virtual=2,cap=4,split=1/1/1/1/1/1/1/1")}


def runs_for(pp: int) -> tuple[Run, ...]:
    runs = [Run(engine, m) for m in COUNTS[pp] for engine in ENGINES]
    runs += [Run(engine, COUNTS[pp][-1]) for engine in CAPPED[pp]]
    if pp == 2:  # a model built round robin cannot run on a V
        runs.append(Run("v_half", 2, split=(1, 1, 1, 1), placement=(0, 1, 0, 1)))
    return tuple(runs)


@functools.cache
def group(pp: int):
    model = SMALL if pp == 2 else EIGHT
    pipelined = run_nanotron(Job(model, pp=pp, runs=runs_for(pp), timeout=150))
    reference = run_nanotron(Job(model, pp=1, runs=tuple(Run("loop", m) for m in COUNTS[pp])))
    return {(r.run.engine, r.run.microbatches, r.run.placement): r for r in pipelined.runs}, {
        r.run.microbatches: r for r in reference.runs
    }


def assert_same(ours, ref):
    assert ours.error is None, ours.error
    assert ref.error is None, ref.error
    assert ours.losses.equal(ref.losses), (ours.run.engine, ours.losses, ref.losses)
    assert ours.grads.keys() == ref.grads.keys()
    for name, grad in ref.grads.items():
        assert ours.grads[name].equal(grad), (ours.run.engine, name, (ours.grads[name] - grad).abs().max())


@pytest.mark.spawn
@pytest.mark.parametrize("pp", [2, 4])
def test_split_engines_match_the_loop_reference(pp):
    runs, reference = group(pp)
    v = list(range(pp)) + list(reversed(range(pp)))
    for m in COUNTS[pp]:
        for engine in ENGINES:
            ours = runs[engine, m, None]
            assert_same(ours, reference[m])
            family = SPLIT[engine]
            stages = pp * family.chunks(2 if family.takes_virtual else None)
            assert ours.split_modes == dict.fromkeys(range(stages), "split"), (engine, ours.split_modes)
            if family.placement(pp, 2) == v:  # built on the V: the embedding and the loss on rank 0
                assert ours.block_ranks[0] == ours.block_ranks[-1] == 0
                assert sorted(set(ours.block_ranks)) == sorted(set(v))
        assert not any(r.leftover_state for r in runs.values())


@pytest.mark.spawn
@pytest.mark.parametrize("pp", [2, 4])
def test_capped_and_explicitly_split_engines_match(pp):
    runs, reference = group(pp)
    m = COUNTS[pp][-1]
    for engine in CAPPED[pp]:
        assert_same(runs[engine, m, None], reference[m])


@pytest.mark.spawn
def test_a_model_not_built_on_the_v_is_refused():
    runs, _ = group(2)
    error = runs["v_half", 2, (0, 1, 0, 1)].error
    assert error is not None and "stages on ranks [0, 1, 1, 0]" in error and "integration.nanotron.train" in error


@pytest.mark.spawn
def test_data_parallel_split_engines_match_nanotron():
    runs = (Run("1f1b", 4), Run("zb_h1", 4), Run("v_half", 4))
    result = run_nanotron(Job(SMALL, pp=2, dp=2, runs=runs, timeout=150)).runs
    for ours in result[1:]:
        assert_same(ours, result[0])
        assert ours.dp_grad_gap == 0.0


# -- config ------------------------------------------------------------------------------


MINIMAL = {
    "general": {"project": "pipeschedule-test"},
    "parallelism": {"dp": 1, "pp": 4, "tp": 1, "pp_engine": "PLACE"},
    "model": {"model_config": {"hidden_size": 64, "num_hidden_layers": 8}, "init_method": {"std": 0.02}},
    "tokenizer": {},
}

ROUND_TRIPS = {
    "zb_h1": ScheduleSpec("zb_h1"),
    "zb_h1:cap=2": ScheduleSpec("zb_h1", cap=2),
    "zbv": ScheduleSpec("zbv"),
    "v_half": ScheduleSpec("v_half"),
    "v_min:cap=4": ScheduleSpec("v_min", cap=4),
    "v_half:cap=6/5/4/4,split=1/1/1/1/1/1/1/1": ScheduleSpec("v_half", cap=(6, 5, 4, 4), split=(1,) * 8),
    "zb_h2:cap=5": ScheduleSpec("zb_h2", cap=5),
    "dualpipev": ScheduleSpec("dualpipev"),
    "interleaved_zb:virtual=2,cap=4": ScheduleSpec("interleaved_zb", cap=4, virtual=2),
}


def write(path, value: str) -> str:
    path.write_text(yaml.safe_dump(MINIMAL).replace("pp_engine: PLACE", f"pp_engine: {value}"))
    return str(path)


@pytest.mark.parametrize("value", list(ROUND_TRIPS))
def test_config_round_trip_selects_the_engine(tmp_path, value):
    from nanotron.config import get_config_from_file

    spec = ROUND_TRIPS[value]
    config = get_config_from_file(write(tmp_path / "in.yaml", value))
    engine = config.parallelism.pp_engine
    assert type(engine) is PipescheduleEngine and engine.spec == spec
    config.save_as_yaml(str(tmp_path / "saved.yaml"))  # nanotron re-reads what it wrote
    assert yaml.safe_load((tmp_path / "saved.yaml").read_text())["parallelism"]["pp_engine"] == spec.to_string()
    again = get_config_from_file(str(tmp_path / "saved.yaml")).parallelism.pp_engine
    assert type(again) is PipescheduleEngine and again.spec == spec
    engine.check(pp=4, num_layers=8)
    schedule = engine.compile(pp=4, microbatches=8)
    assert schedule.split_backward and list(schedule.placement) == engine.placement(4)


@pytest.mark.parametrize("value, reason", [
    ("v_half:virtual=2", "unknown parameter 'virtual' for v_half; v_half accepts: cap, split"),
    ("zbv:cap=0", "cap must be an integer >= 1"),
    ("zb_h1:cap=two", "cap must be an integer"),
    ("v_halff", "unknown engine 'v_halff'"),
    ("zb_h1:cap=2,cap=3", "parameter 'cap' given twice"),
    ("looped_bfs:virtual=2,cap=2", "unknown parameter 'cap' for looped_bfs; looped_bfs accepts: virtual, split"),
    ("dualpipev:virtual=3", "unknown parameter 'virtual' for dualpipev; dualpipev accepts: cap, split"),
    ("interleaved_zb:cap=4", "interleaved_zb needs virtual=N"),
])
def test_bad_values_are_rejected_naming_the_value(tmp_path, value, reason):
    from nanotron.config import get_config_from_file

    with pytest.raises(ParameterError) as caught:
        get_config_from_file(write(tmp_path / "bad.yaml", value))
    message = str(caught.value)
    assert repr(value) in message and reason in message
    if "unknown engine" in reason:  # the list of names where the name is at fault
        for accepted in ("zb_h1", "zbv", "v_half", "v_min"):
            assert accepted in message


def test_v_engines_count_two_stages_per_rank():
    build_engine("v_half:split=1/1/1/1").check(pp=2, num_layers=4)
    assert build_engine("zbv").placement(3) == [0, 1, 2, 2, 1, 0]
    assert build_engine("zb_h1").placement(3) == [0, 1, 2]
    assert build_engine("dualpipev").placement(3) == [0, 1, 2, 2, 1, 0]
    assert build_engine("interleaved_zb:virtual=2").placement(3) == [0, 1, 2, 0, 1, 2]
    with pytest.raises(ParameterError, match=r"split lists 2 stages but pp \* virtual = 2 \* 2 = 4"):
        build_engine("v_min:split=1/3").check(pp=2, num_layers=4)
    with pytest.raises(ParameterError, match=r"split lists 5 stages but pp \* virtual = 4 \* 1 = 4"):
        build_engine("zb_h1:split=1/1/1/1/1").check(pp=4, num_layers=5)
