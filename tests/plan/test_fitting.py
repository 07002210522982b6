"""The levers pulled on rows that do not fit (plan/fitting.py): partial recompute on every
family, host offload as a candidate, the chunk counts of interleaving; and the one
--attention flag."""

from dataclasses import replace

import pytest

from pipeschedule.compiler.offload import MIB, OffloadPolicy, add_offload
from pipeschedule.errors import ParameterError
from pipeschedule.plan import PlanConfig, plan
from pipeschedule.plan.config import virtual_counts
from pipeschedule.plan.fitting import STREAM_MIB, OffloadCandidate, fitted_offload, offloaded
from pipeschedule.plan.memory import ACTIVATIONS, GiB, ModelSpec, TrainingSetup, layer_activation_bytes, \
    stage_footprints, stash_buffers
from pipeschedule.plan.planner import _Planner, offload_report
from pipeschedule.plan.presets import MODELS
from pipeschedule.simulate import simulate

L70 = MODELS["llama3-70b"]
SPLIT = (21, 20, 20, 19)


def users(dp=2, zero=1, microbatches=16, host=450e9, **kw):
    st = TrainingSetup(tp=4, dp=dp, zero_stage=zero, seq=8192, tp_async=True)
    return PlanConfig(L70, st, pp=4, microbatches=microbatches, gpu_memory=96 * GiB, gpu_name="gh200",
                      host_bandwidth=host, **kw)


# -- partial recompute ----------------------------------------------------------------------------


def test_every_layer_recomputed_by_count_is_full_recompute_when_interleaved():
    split = (11, 10, 10, 10, 10, 10, 10, 9)
    counted = _Planner(users()).evaluate("interleaved_1f1b", None, 2, split, "nanotron", recomputed=split)
    full = _Planner(replace(users(), setup=replace(users().setup, recompute="full"))).evaluate(
        "interleaved_1f1b", None, 2, split, "x")
    assert [r.terms[ACTIVATIONS] for r in counted.memory] == [r.terms[ACTIVATIONS] for r in full.memory]
    assert [r.total for r in counted.memory] == pytest.approx([r.total for r in full.memory])
    assert counted.pipeline_time == pytest.approx(full.pipeline_time)
    text = "/".join(map(str, split))
    assert counted.engine() == f"interleaved_1f1b:virtual=2,split={text},recompute={text}"


def test_partial_recompute_spreads_over_a_ranks_chunks_and_saves_what_it_says():
    result = plan(users(host=None, virtual=2))
    row = next(c for c in result.candidates if c.recomputed and c.family == "interleaved_1f1b")
    assert row.fits and len(row.recomputed) == 8
    assert row.recomputed[0] > 0 and row.recomputed[4] > 0  # rank 0 holds stages 0 and 4: both recompute
    plain = _Planner(users()).evaluate("interleaved_1f1b", None, 2, row.split, "x")
    model, setup = L70, users().setup
    per_layer = layer_activation_bytes(model, setup) - layer_activation_bytes(model, setup, recompute="full")
    saved = plain.memory[0].terms[ACTIVATIONS] - row.memory[0].terms[ACTIVATIONS]
    assert 0 < saved <= (row.recomputed[0] + row.recomputed[4]) * per_layer * plain.memory[0].inflight


# -- offload --------------------------------------------------------------------------------------


def test_offload_row_keeps_what_the_offload_pass_leaves_on_rank_0():
    config = users()
    planner = _Planner(config)
    cand = planner.evaluate("1f1b", None, 1, SPLIT, "nanotron")
    assert not cand.fits
    for stream in (None, STREAM_MIB):
        row = offloaded(planner, cand, (0,), stream)
        policy = OffloadPolicy(1.0, (0,), 1, None if stream is None else stream * MIB)
        cost = replace(planner.cost(SPLIT, stash_buffers(stage_footprints(L70, config.setup, SPLIT))),
                       offload_bandwidth=config.host_bandwidth, reload_bandwidth=config.host_bandwidth)
        left = simulate(add_offload(planner.schedule("1f1b", None, 1), policy), policy.cost(cost)).peak_bytes
        stash0 = stash_buffers(stage_footprints(L70, config.setup, SPLIT))["stash"][0]
        counted = left[0] if stream is None else max(left[0], stash0)  # [Note: streamed offload floor]
        assert row.memory[0].terms[ACTIVATIONS] == counted < cand.memory[0].terms[ACTIVATIONS]
        assert [r.terms[ACTIVATIONS] for r in row.memory[1:]] == [r.terms[ACTIVATIONS] for r in cand.memory[1:]]
        report = offload_report(_Planner(replace(config, offload=policy)), cand)
        assert report["activations_offload"][0] == left[0]


def test_offloading_no_rank_is_the_candidate_itself():
    planner = _Planner(users())
    for family, virtual, split in (("1f1b", 1, SPLIT), ("interleaved_1f1b", 2, (11, 10, 10, 10, 10, 10, 10, 9))):
        cand = planner.evaluate(family, None, virtual, split, "nanotron")
        row = offloaded(planner, cand, (), None)
        assert [r.total for r in row.memory] == [r.total for r in cand.memory]
        assert row.step_time == pytest.approx(cand.step_time, rel=1e-12) and row.tail == cand.tail


def test_offload_is_chosen_where_it_fits_fastest_with_its_yaml():
    result = plan(users(virtual=2))
    rec = result.recommended
    assert isinstance(rec, OffloadCandidate) and rec.fits
    split = "/".join(map(str, rec.split))
    assert rec.engine() == f"interleaved_1f1b:virtual=2,split={split},offload=0/1"
    assert f"pp_engine: {rec.engine()}" in result.to_text(tables="none")
    plain = next(c for c in result.candidates if (c.family, c.virtual, c.split) == (rec.family, 2, rec.split)
                 and not isinstance(c, OffloadCandidate))
    assert not plain.fits and rec.step_time >= plain.step_time  # offload never makes a step faster
    # without a host link it is not tried, and the plan says why
    none = plan(users(host=None, virtual=2))
    assert not any(isinstance(c, OffloadCandidate) for c in none.candidates)
    assert any(name == "offload" and "--host-bandwidth" in why for name, why in none.dropped)


def test_a_slow_link_makes_offload_slower_and_a_rank_over_without_activations_rules_it_out():
    fast, slow = _Planner(users()), _Planner(users(host=5e9))
    cand = fast.evaluate("1f1b", None, 1, SPLIT, "nanotron")
    assert offloaded(slow, cand, (0,), None).step_time > offloaded(fast, cand, (0,), None).step_time
    tight = _Planner(users(zero=0, reserve=30 * GiB))
    over = tight.evaluate("1f1b", None, 1, SPLIT, "nanotron")
    row, why = fitted_offload(tight, over)
    assert row is None and "over without any activation" in why and "rank 0" in why


def test_levers_are_tried_only_on_rows_that_could_beat_the_fastest_fit():
    result = plan(users(virtual=2))
    fastest = result.recommended.step_time
    for c in result.candidates:
        if isinstance(c, OffloadCandidate) or c.recomputed:
            base = next(x for x in result.candidates if (x.family, x.cap, x.virtual, x.split) ==
                        (c.family, c.cap, c.virtual, c.split) and not x.recomputed
                        and not isinstance(x, OffloadCandidate))
            assert base.step_time <= c.step_time and base.step_time < max(fastest, c.step_time) + 1e-9
    assert any(name == "partial recompute, offload" and "no faster" in why for name, why in result.dropped)


# -- virtual counts -------------------------------------------------------------------------------


def test_virtual_counts_leaving_a_chunk_without_a_layer_are_named_not_listed():
    assert virtual_counts(users()) == ((2, 3, 4), ())
    small = replace(users(host=None), model=ModelSpec("m", layers=8, hidden=1024, heads=8, kv_heads=8, ffn=4096,
                                                     vocab=1000))
    assert virtual_counts(small) == ((2,), (("interleaved_1f1b v=3", "8 layers over pp*v = 12 chunks leaves a chunk "
                                                                    "without a layer"),
                                            ("interleaved_1f1b v=4", "8 layers over pp*v = 16 chunks leaves a chunk "
                                                                    "without a layer")))
    assert virtual_counts(replace(users(), virtual=1)) == ((), ())
    result = plan(replace(small, microbatches=8))
    assert {c.virtual for c in result.candidates if c.family == "interleaved_1f1b"} == {2}
    assert [name for name, _ in result.dropped if name.startswith("interleaved_1f1b")] == [
        "interleaved_1f1b v=3", "interleaved_1f1b v=4"]


def test_more_chunks_are_tried_while_they_get_faster_and_chosen_where_they_win():
    many = plan(users(microbatches=128))  # at m=128 v=3's extra messages outweigh its smaller bubble
    assert many.stats["virtual_tried"] == [2]
    why = dict(many.dropped)
    assert "no faster than v=2" in why["interleaved_1f1b v=3"] and "not tried past v=3" in why["interleaved_1f1b v=4"]
    assert not any(c.virtual > 2 for c in many.candidates)
    few = plan(model="llama3-70b", pp=4, tp=4, dp=2, microbatches=16, recompute="full")
    assert few.stats["virtual_tried"] == [2, 3]
    assert few.recommended.family == "interleaved_1f1b" and few.recommended.virtual == 3
    assert "interleaving tried at virtual 2, 3" in few.to_text(tables="none")
    assert "no faster than v=3" in dict(few.dropped)["interleaved_1f1b v=4"]


# -- --attention ----------------------------------------------------------------------------------


def test_attention_is_the_one_flag_and_flash_must_agree_with_it():
    model = ModelSpec("m", layers=2, hidden=1024, heads=8, kv_heads=8, ffn=4096, vocab=1000)
    eager = TrainingSetup(attention="eager", activation_formula="korthikanti", sequence_parallel=False)
    flash = TrainingSetup(activation_formula="korthikanti", sequence_parallel=False)
    assert eager.scores_materialised and not flash.scores_materialised
    assert layer_activation_bytes(model, eager) > layer_activation_bytes(model, flash)
    assert TrainingSetup(flash=True).attention == "flash-attn"  # the older spelling, where it agrees
    with pytest.raises(ParameterError, match="contradicts"):
        TrainingSetup(flash=False)
    with pytest.raises(ParameterError, match="nanotron's Llama runs flash-attn"):
        TrainingSetup(attention="eager")


@pytest.mark.parametrize("argv, words", [
    (["--no-flash"], ("--no-flash", "--attention", "eager")),
    (["--flash"], ("--flash", "--attention")),
    (["--attention", "xformers"], ("xformers", "flash-attn", "sdpa-standin", "eager")),
    (["--attention", "eager"], ("eager", "korthikanti", "flash-attn")),
])
def test_attention_errors_are_one_line(capsys, argv, words):
    from pipeschedule.cli import main

    code = main(["plan", "--model", "llama3-70b", "--pp", "4", "--microbatches", "8", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and all(w in err for w in words), err


def test_eager_attention_costs_selective_recompute_its_scores(capsys):
    from pipeschedule.cli import main

    argv = ["plan", "--model", "llama3-8b", "--pp", "2", "--microbatches", "4", "--zero", "0", "--json",
            "--activation-formula", "korthikanti", "--tables", "none"]
    import json

    steps = {}
    for attention in ("flash-attn", "eager"):
        main(argv + ["--attention", attention, "--recompute", "selective"])
        obj = json.loads(capsys.readouterr().out)
        steps[attention] = obj["candidates"][obj["default"]]["pipeline_time_s"]
        assert obj["layout"]["attention"] == attention and obj["layout"]["flash"] == (attention != "eager")
    assert steps["eager"] > steps["flash-attn"]


def test_host_memory_bounds_what_offload_may_keep_on_the_host(capsys):
    free = plan(users(virtual=2))
    host = max(free.recommended.host_bytes)
    bounded = plan(users(virtual=2, host_memory=host - GiB))
    assert all(max(c.host_bytes) <= host - GiB for c in bounded.candidates if isinstance(c, OffloadCandidate))
    assert any(name == "offload" and "--host-memory" in why for name, why in bounded.dropped)
    from pipeschedule.cli import main

    code = main(["plan", "--model", "llama3-70b", "--pp", "4", "--microbatches", "8", "--host-memory", "-1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--host-memory" in err and "-1" in err


def test_partial_recompute_reaches_split_backward_and_v_shapes():
    st = TrainingSetup(tp=4, seq=8192, tp_async=False)  # sync TP linears: the split backward defers
    result = plan(PlanConfig(L70, st, pp=4, microbatches=16, gpu_memory=96 * GiB, virtual=2))
    fitted = {c.family: c for c in result.candidates if c.recomputed}
    assert {"zb_h1", "zbv", "v_half", "interleaved_1f1b", "1f1b"} <= set(fitted) and all(
        c.fits for c in fitted.values())
    assert result.recommended.recomputed  # nothing fits without it: the lever is chosen
    zbv = fitted["zbv"]
    plain = _Planner(result.config).evaluate("zbv", None, 2, zbv.split, "nanotron")
    # recomputed layers compute their weight gradients at B: W keeps less, B does more
    assert zbv.memory[0].terms[ACTIVATIONS] < plain.memory[0].terms[ACTIVATIONS]
    assert zbv.engine().startswith("zbv:split=") and ",recompute=" in zbv.engine() and len(zbv.recomputed) == 8


def test_the_planner_is_what_the_levers_say_they_need():
    """fitting.Planner, the typed interface the levers call the planner through: every
    member it names is the planner's, with the same parameters."""
    import inspect

    from pipeschedule.plan import fitting
    from pipeschedule.plan.planner import _Planner

    members = [name for name, value in vars(fitting.Planner).items() if inspect.isfunction(value)
               and not name.startswith("__")]
    assert set(members) == {"schedule", "evaluate", "cost", "step", "tail", "shared"}
    for name in members:
        ours = inspect.signature(getattr(fitting.Planner, name)).parameters
        assert list(ours) == list(inspect.signature(getattr(_Planner, name)).parameters), name
    planner = _Planner(users())
    assert isinstance(planner.config, PlanConfig) and hasattr(planner.cache, "offload_memo")
