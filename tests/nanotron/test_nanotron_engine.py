"""pipeschedule's nanotron engines (integration/nanotron/pipeline/engine.py) against nanotron's own.

Every group is spawned once (gloo, CPU) and performs all its runs in turn, each on a
freshly built model with the same weights and data ([Note: deterministic init]).
Parity is bitwise: per parameter, gradients accumulate over microbatches in the same
order (microbatch 0 first) under every engine here, so no tolerance is needed.
"""

from __future__ import annotations

import functools

import pytest
import torch
import yaml

import integration.nanotron  # noqa: F401  (first: repairs nanotron, registers the engine names)
from integration.nanotron.pipeline.engine import PipescheduleEngine, build_engine
from integration.nanotron.pipeline.engine_spec import ForeignSpec, ScheduleSpec, parse_engine
from benchmarks.llama.reference import Job, Run, run_nanotron
from benchmarks.llama.model import ModelConfig
from integration.nanotron.stash import microbatches_worth
from pipeschedule import compile_schedule
from pipeschedule.compiler.passes import forward_only
from pipeschedule.errors import ParameterError

SMALL = ModelConfig(hidden=32, layers=4, heads=4, kv_heads=2, ffn=64, vocab=128, seq=16)
EIGHT = ModelConfig(hidden=32, layers=8, heads=4, kv_heads=2, ffn=64, vocab=128, seq=16)
OURS = ("ps_1f1b", "ps_afab", "capped_1f1b:cap=1", "capped_1f1b:cap=2",
        # host offload from the YAML: rank 0 streamed (one 1 MiB chunk per stash here), ranks 0 and 1 whole
        "ps_1f1b:offload=0,stream=1", "capped_1f1b:cap=2,offload=0/1,lead=0")


def microbatch_counts(pp: int) -> list[int]:
    return sorted({1, pp - 1, pp, 2 * pp + 1} - {0})


def reference_engine(pp: int, m: int) -> str:
    return "1f1b" if m >= pp - 1 else "afab"  # nanotron's 1F1B refuses m < pp - 1


def runs_for(pp: int, interleaved_split: tuple[int, ...], stash_m: int) -> tuple[Run, ...]:
    runs = []
    for m in microbatch_counts(pp):
        runs.append(Run(reference_engine(pp, m), m))
        runs += [Run(engine, m) for engine in OURS]
        runs.append(Run("interleaved_1f1b:virtual=2", m, split=interleaved_split))
        runs.append(Run("looped_bfs:virtual=2", m, split=interleaved_split))
    runs.append(Run("1f1b", stash_m, measure_stash=True))
    runs.append(Run("capped_1f1b:cap=2", stash_m, measure_stash=True))
    runs.append(Run("ps_1f1b", stash_m, measure_stash=True))
    return tuple(runs)


@functools.cache
def group(pp: int):
    if pp == 2:
        return run_nanotron(Job(SMALL, pp=2, runs=runs_for(2, (1, 1, 1, 1), 6), timeout=150))
    return run_nanotron(Job(EIGHT, pp=4, runs=runs_for(4, (1,) * 8, 8), timeout=150))


def by_key(result):
    return {(r.run.engine, r.run.microbatches, r.run.measure_stash): r for r in result.runs}


def assert_same(ours, ref):
    assert ours.error is None, ours.error
    assert ref.error is None, ref.error
    assert ours.losses.equal(ref.losses), (ours.losses, ref.losses)
    assert ours.grads.keys() == ref.grads.keys()
    for name, grad in ref.grads.items():
        assert ours.grads[name].equal(grad), (ours.run.engine, name, (ours.grads[name] - grad).abs().max())


@pytest.mark.spawn
@pytest.mark.parametrize("pp", [2, 4])
def test_parity_with_nanotron_1f1b(pp):
    runs = by_key(group(pp))
    for m in microbatch_counts(pp):
        ref = runs[reference_engine(pp, m), m, False]
        for engine in OURS:
            assert_same(runs[engine, m, False], ref)
        assert not any(r.leftover_state for r in runs.values())


@pytest.mark.spawn
@pytest.mark.parametrize("pp", [2, 4])
def test_interleaved_matches_non_interleaved(pp):
    """Interleaved 1F1B and looped BFS (round robin, two chunks a rank) against nanotron's
    engine on one chunk a rank: the same bits."""
    runs = by_key(group(pp))
    for m in microbatch_counts(pp):
        for engine in ("interleaved_1f1b:virtual=2", "looped_bfs:virtual=2"):
            assert_same(runs[engine, m, False], runs[reference_engine(pp, m), m, False])


@pytest.mark.spawn
@pytest.mark.parametrize("pp", [2, 4])
def test_stage_zero_stash_is_cap_over_pp_of_nanotron(pp):
    runs = by_key(group(pp))
    m = 6 if pp == 2 else 8
    nanotron = [microbatches_worth(s) for s in runs["1f1b", m, True].stash]
    capped = [microbatches_worth(s) for s in runs["capped_1f1b:cap=2", m, True].stash]
    ours_1f1b = [microbatches_worth(s) for s in runs["ps_1f1b", m, True].stash]
    assert nanotron == pytest.approx([pp - r for r in range(pp)], abs=0.1)
    assert capped == pytest.approx([min(2, pp - r) for r in range(pp)], abs=0.1)
    assert ours_1f1b == pytest.approx(nanotron, abs=0.1)
    peak = [s["peak_bytes"] for s in runs["capped_1f1b:cap=2", m, True].stash]
    ref_peak = [s["peak_bytes"] for s in runs["1f1b", m, True].stash]
    assert peak[0] * pp == ref_peak[0] * 2  # stage 0: cap/pp of nanotron's 1F1B, exactly
    for engine in ("capped_1f1b:cap=2", "ps_1f1b"):
        for summary in runs[engine, m, True].stash:
            assert summary["leaked_bytes"] == 0
            assert not any(o["alive_after_step"] or o["held_to_end"] for o in summary["outputs"] if o["requires_grad"])


@pytest.mark.spawn
def test_data_parallel_with_ddp_matches_nanotron():
    runs = (Run("1f1b", 4), Run("ps_1f1b", 4), Run("capped_1f1b:cap=1", 4), Run("ps_afab", 3))
    result = run_nanotron(Job(SMALL, pp=2, dp=2, runs=runs + (Run("afab", 3),), timeout=150)).runs
    for ours in result[1:3]:
        assert_same(ours, result[0])
        assert ours.dp_grad_gap == 0.0
    assert_same(result[3], result[4])
    assert result[0].dp_grad_gap == 0.0


def test_yaml_config_instantiates_our_engine(tmp_path):
    from nanotron.config import get_config_from_file

    data = {
        "general": {"project": "pipeschedule-test"},
        "parallelism": {"dp": 1, "pp": 4, "tp": 1, "pp_engine": "PLACE"},
        "model": {"model_config": {"hidden_size": 64, "num_hidden_layers": 8}, "init_method": {"std": 0.02}},
        "tokenizer": {},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data).replace("pp_engine: PLACE", "pp_engine: capped_1f1b:cap=2"))
    engine = get_config_from_file(str(path)).parallelism.pp_engine
    assert type(engine) is PipescheduleEngine
    assert engine.spec == ScheduleSpec("capped_1f1b", cap=2)
    assert engine.compile(pp=4, microbatches=8).params["cap"] == [2, 2, 2, 1]
    config = get_config_from_file(str(path))
    config.save_as_yaml(str(tmp_path / "saved.yaml"))  # nanotron re-reads what it wrote
    assert "pp_engine: capped_1f1b:cap=2" in (tmp_path / "saved.yaml").read_text()
    assert get_config_from_file(str(tmp_path / "saved.yaml")).parallelism.pp_engine.spec == engine.spec


def test_engine_parameters_and_checks():
    def build(value):
        return build_engine(parse_engine(value))

    assert build("capped_1f1b").cap(4) == 2 and build("capped_1f1b").cap(5) == 3  # ceil(pp/2)
    with pytest.raises(ParameterError, match="interleaved_1f1b needs virtual"):
        ScheduleSpec("interleaved_1f1b")  # from Python as from text: no default chunk count to disagree with
    assert build("interleaved_1f1b:virtual=3").virtual == 3
    assert build("ps_1f1b").compile(pp=4, microbatches=2).microbatches == 2  # below nanotron's pp-1
    build("ps_afab:split=1/3").check(pp=2, num_layers=4)
    with pytest.raises(ParameterError, match="split lists 2 stages"):
        build("capped_1f1b:split=1/3").check(pp=4, num_layers=4)
    with pytest.raises(ParameterError, match="pp \\* virtual"):
        build_engine(ScheduleSpec("interleaved_1f1b", virtual=2, split=(2, 2))).check(pp=2, num_layers=4)
    with pytest.raises(ValueError, match="runs pipeschedule's engines"):
        PipescheduleEngine(ForeignSpec("1f1b"))  # nanotron's own


def test_offload_from_the_yaml_value():
    """`offload=0,stream=64`: rank 0's program gets OFFLOAD / RELOAD of every stash that
    waits more than `lead` computes, the others none, the runner streams 64 MiB chunks;
    the evaluation schedule drops them."""
    from pipeschedule.compiler.ir import Op

    engine = build_engine("capped_1f1b:cap=4,offload=0,stream=64")
    assert engine.spec.offload_chunk == 64 * 2**20
    schedule = engine.compile(pp=4, microbatches=8)
    counts = [sum(i.op is Op.OFFLOAD for i in program) for program in schedule.programs]
    assert counts == [8, 0, 0, 0]  # every stash of rank 0 waits 3 to 6 computes, more than lead 1
    assert all(sum(i.op is Op.RELOAD for i in p) == c for p, c in zip(schedule.programs, counts))
    assert not any(i.op in (Op.OFFLOAD, Op.RELOAD) for p in forward_only(schedule).programs for i in p)
    with pytest.raises(ParameterError, match="offload names rank 4 but pp = 4"):
        build_engine("ps_1f1b:offload=4").check(pp=4)


def test_forward_only_keeps_the_forward_half():
    schedule = forward_only(compile_schedule("1f1b", pp=2, microbatches=3))
    ops = {i.op.value for program in schedule.programs for i in program}
    assert ops == {"F", "SEND_F", "RECV_F", "FREE"}
    assert all(sum(i.op.value == "F" for i in p) == 3 for p in schedule.programs)


def test_boundary_packing_round_trips_bit_for_bit():
    from integration.nanotron.pipeline.boundary import Layout

    hidden = torch.randn(2, 3, 4, requires_grad=True) * 1
    mask = torch.rand(2, 3) > 0.5
    ids = torch.randint(0, 1 << 40, (5,))
    layout = Layout.of([hidden, mask, ids])
    assert Layout.decode(layout.encode()) == layout
    packed = layout.pack([hidden, mask, ids]).detach().requires_grad_()
    h, m, i = layout.unpack(packed)
    assert h.equal(hidden) and m.equal(mask) and i.equal(ids) and h.requires_grad and not m.requires_grad
    h.sum().backward()
    assert packed.grad[: h.numel()].eq(1).all() and packed.grad[h.numel():].eq(0).all()


@pytest.mark.spawn
def test_evaluation_runs_a_verified_forward_only_schedule():
    """validate_batch_iter: every engine's forwards lowered and verified as an evaluation
    schedule; its losses equal the training step's on the same weights and data (bitwise),
    interleaved and V shapes included."""
    engines = ("ps_1f1b", "capped_1f1b:cap=1", "interleaved_1f1b:virtual=2", "zbv", "ps_afab:offload=0")
    runs = tuple(Run(engine, 3, evaluate=True) for engine in engines)
    result = run_nanotron(Job(SMALL, pp=2, runs=runs, timeout=150)).runs
    for run in result:
        assert run.error is None, run.error
        assert run.eval_losses is not None and run.eval_losses.equal(run.losses), (run.run.engine, run.eval_losses)
