"""The step tail ([Note: step tail]), the candidates dropped under async TP linears, partial
recompute and the lever search ([Note: lever search])."""

import pytest

from pipeschedule.plan import PlanConfig, plan
from pipeschedule.plan.dp_step import rank_tail
from pipeschedule.plan.levers import plan_levers
from pipeschedule.errors import ParameterError
from pipeschedule.plan.memory import GiB, TrainingSetup, builds_ddp
from pipeschedule.plan.planner import _Planner
from pipeschedule.plan.presets import MODELS

L70 = MODELS["llama3-70b"]


def test_step_tail_closed_forms():
    P, bw, hbm = 10**9, 25e9, 4e12
    alone = rank_tail(TrainingSetup(dp=1), P, 1.0, dp_bandwidth=bw, hbm_bandwidth=hbm)
    assert alone == {"optimizer step": 30 * P / hbm}
    zero1 = rank_tail(TrainingSetup(dp=4, zero_stage=1), P, 1.0, dp_bandwidth=bw, hbm_bandwidth=hbm)
    assert zero1 == {"DP all-reduce (after the pipeline)": 2 * 3 / 4 * 4 * P / bw,
                     "ZeRO-1 all-gather": 3 / 4 * 2 * P / bw, "optimizer step": 30 * P / 4 / hbm}
    ddp = rank_tail(TrainingSetup(dp=2), P, 0.1, dp_bandwidth=bw, hbm_bandwidth=hbm)
    assert ddp["DP all-reduce (exposed)"] == pytest.approx(2 * 1 / 2 * 4 * P / bw - 0.1)
    hidden = rank_tail(TrainingSetup(dp=2), P, 100.0, dp_bandwidth=bw, hbm_bandwidth=hbm)
    assert hidden["DP all-reduce (exposed)"] == 0.0  # overlapped with the last backward


def test_ddp_only_where_nanotron_builds_it():
    assert not builds_ddp(TrainingSetup(dp=1))
    assert builds_ddp(TrainingSetup(dp=2))
    assert not builds_ddp(TrainingSetup(dp=2, zero_stage=1))
    assert builds_ddp(TrainingSetup(dp=2, zero_stage=1, fp32_grad_accum=False))


def config(**setup):
    st = TrainingSetup(**{"tp": 4, "seq": 8192, "tp_async": True, **setup})
    return PlanConfig(L70, st, pp=4, microbatches=16, gpu_memory=96 * GiB)


def test_split_backward_is_not_listed_under_async_tp_and_says_why():
    result = plan(config(recompute="full"))
    assert {c.family for c in result.candidates}.isdisjoint({"zb_h1", "zbv", "v_half", "v_min"})
    split = [(name, why) for name, why in result.dropped if name in ("zb_h1", "zbv", "v_half", "v_min")]
    assert [name for name, _ in split] == ["zb_h1", "zbv", "v_half", "v_min"]
    assert all("defers nothing" in why for _, why in split)
    assert "not listed: zb_h1" in result.to_text(tables="none")
    sync = plan(config(recompute="full", tp_async=False))
    assert not [d for d in sync.dropped if d[0] == "zb_h1"] and "zb_h1" in {c.family for c in sync.candidates}


def test_partial_recompute_fits_what_no_recompute_does_not():
    planner = _Planner(config())
    default = planner.evaluate("1f1b", None, 1, (21, 20, 20, 19), "nanotron")
    assert not default.fits
    result = plan(config())
    partial = [c for c in result.candidates if c.recomputed]
    assert partial and all(c.fits for c in partial)
    assert {c.family for c in partial} >= {"1f1b", "interleaved_1f1b"}  # every family, not only 1F1B
    cand = next(c for c in partial if c.family == "1f1b")
    assert cand.engine().startswith("ps_1f1b:split=21/20/20/19,recompute=")
    assert cand.recomputed[0] >= cand.recomputed[-1]
    full = planner.evaluate("1f1b", None, 1, (21, 20, 20, 19), "x", recomputed=(21, 20, 20, 19))
    everything = _Planner(config(recompute="full")).evaluate("1f1b", None, 1, (21, 20, 20, 19), "x")
    # recomputing every layer by count is full recompute: the same stash and time
    assert [r.terms["activations"] for r in full.memory] == pytest.approx(
        [r.terms["activations"] for r in everything.memory])
    assert full.pipeline_time == pytest.approx(everything.pipeline_time)


def test_lever_search_fits_at_dp1_and_prefers_zero1_without_recompute_at_dp2():
    one = plan_levers(config())
    assert one.best is not None and set(one.plans) == {(0, "none"), (0, "selective"), (0, "full")}
    two = plan_levers(PlanConfig(L70, TrainingSetup(tp=4, seq=8192, tp_async=True, dp=2), pp=4, microbatches=16,
                                 gpu_memory=96 * GiB))
    (zero, mode), cand = two.best
    assert (zero, mode) == (1, "none") and cand.fits
    assert cand.step_time < min(p.default.step_time for p in two.plans.values() if p.default.fits)
    text = two.to_text()
    assert f"Fastest that fits at dp=2: ZeRO-1, recompute none, {cand.label}" in text
    assert f"  pp_engine: {cand.engine()}" in text


def test_cli_default_searches_the_levers_and_finds_a_fit_at_dp1(capsys):
    from pipeschedule.cli import main

    code = main(["plan", "--model", "llama3-70b", "--pp", "4", "--tp", "4", "--microbatches", "16", "--tp-async"])
    out = capsys.readouterr().out
    assert code == 0 and "Recommended: dp=1, ZeRO-0" in out and "nothing fits" not in out.split("Recommended")[1]


def test_bad_lever_input_is_one_line(capsys):
    from pipeschedule.cli import main

    for argv in (["--zero", "2"], ["--dp-bandwidth", "0"], ["--attention", "xformers"]):
        code = main(["plan", "--model", "llama3-70b", "--pp", "4", "--microbatches", "16", *argv])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and argv[0] in err, err


def test_optimizer_step_transient_closed_form():
    """[Note: the optimizer step's transient]: unfused, torch's single-tensor Adam holds the
    previous tensor's `denom` beside the square root and quotient of the current one;
    ZeRO-1's all-gather comes after it (the larger counts), with gloo's device copy of
    the gathered output under dp_backend "gloo"."""
    from pipeschedule.plan.memory import optimizer_step_transient

    sizes = [10, 300, 100, 400]  # the peak is at 400 after 100: 100 + 2 * 400
    P = sum(sizes)
    assert optimizer_step_transient(TrainingSetup(adam_fused=False), sizes) == 4 * 900
    assert optimizer_step_transient(TrainingSetup(), sizes) == 0  # fused Adam allocates nothing
    assert optimizer_step_transient(TrainingSetup(fp32_grad_accum=False, adam_fused=False), sizes) == 2 * 900
    assert optimizer_step_transient(TrainingSetup(optimizer="none", adam_fused=False), sizes) == 0
    zero1 = TrainingSetup(dp=4, zero_stage=1, adam_fused=False)  # slices of 3, 75, 25, 100: Adam's 4 * 225
    assert optimizer_step_transient(zero1, sizes) == 2 * (P + P / 4)
    gloo = TrainingSetup(dp=4, zero_stage=1, adam_fused=False, dp_backend="gloo")
    assert optimizer_step_transient(gloo, sizes) == 2 * (P + P / 4) + 2 * P
    big = [10, 4000]  # dp=2: Adam above the gather, 4 * (5 + 2 * 2000) against 2 * (4010 + 2005)
    assert optimizer_step_transient(TrainingSetup(dp=2, zero_stage=1, adam_fused=False), big) == 4 * 4005
    with pytest.raises(ParameterError, match="dp_backend must be one of nccl, gloo, got 'mpi'"):
        TrainingSetup(dp_backend="mpi")


def test_the_lever_search_shares_schedules_and_answers_as_plans_alone():
    """The lever search's plans share one ScheduleCache (schedules, step graphs, peaks, in
    flight: what depends on the schedule alone): each plan is the one `plan` makes alone,
    figure for figure, with one cache for all, and a cache of another pp or m is refused.
    (Budgets that do not bind: a shared one could leave a plan fewer search nodes.)"""
    from dataclasses import replace

    from pipeschedule.errors import ParameterError
    from pipeschedule.plan.planner import ScheduleCache, SearchBudget

    base = config(dp=2)
    free = lambda: SearchBudget(base, total=10**9)  # noqa: E731
    shared = plan_levers(base, zero=(1,), recompute=("none", "full"), budget=free())
    assert len(shared.plans) == 2
    schedules = ScheduleCache(base.pp, base.microbatches)
    for (zero, mode), together in shared.plans.items():
        at = replace(base, setup=replace(base.setup, zero_stage=zero, recompute=mode))
        alone = plan(at, budget=free())
        assert together.to_dict() == alone.to_dict(), (zero, mode)
        again = plan(at, schedules=schedules, budget=free())
        assert again.to_dict() == alone.to_dict(), (zero, mode)
    assert len(schedules.schedules) >= max(p.stats["schedules"] for p in shared.plans.values())
    with pytest.raises(ParameterError, match="a schedule cache of pp=4, 8 microbatches cannot serve a plan of pp=4, "
                                             "16 microbatches"):
        plan(base, schedules=ScheduleCache(4, 8))
