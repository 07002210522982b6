"""[Note: plan search budget]: the split searches of one plan run share a budget of nodes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeschedule.checks import PLAN_SEARCH_WORK, check_plan_run
from pipeschedule.errors import ParameterError
from pipeschedule.plan.advice import advise
from pipeschedule.plan.config import PlanConfig
from pipeschedule.plan.levers import plan_levers
from pipeschedule.plan.memory import GiB, TrainingSetup
from pipeschedule.plan.planner import SearchBudget, plan
from pipeschedule.plan.presets import model_preset

L70 = model_preset("llama3-70b")


def config(**setup) -> PlanConfig:
    """Llama3-70B, pp=4 tp=4 dp=2 ZeRO-1, m=16: its searches visit some 60,000 nodes."""
    st = TrainingSetup(**{"tp": 4, "seq": 8192, "tp_async": True, "dp": 2, "zero_stage": 1, **setup})
    return PlanConfig(L70, st, pp=4, microbatches=16, gpu_memory=96 * GiB)


def test_a_budget_that_binds_stops_searches_unproven_and_holds_the_nodes():
    """Full recompute: unbounded, 9 of the 10 searches are proven in some 28,000 nodes;
    within 3,000 nodes in all, a search the budget stops says so and is not proven."""
    free = plan(config(recompute="full"), budget=SearchBudget(config(), total=10**9))
    assert free.stats["search_nodes"] > 20_000, free.stats
    budget = SearchBudget(config(), total=3_000)
    tight = plan(config(recompute="full"), budget=budget)
    assert budget.used == tight.stats["search_nodes"] <= 3_000, (budget.used, tight.stats)
    stopped = [c for c in tight.candidates if "budget of 3000 search nodes" in c.note]
    assert stopped, [c.note for c in tight.candidates]
    for c in stopped:
        assert c.split_kind == "best found" and c.proven is False
    assert tight.stats["proven"] < free.stats["proven"]
    assert tight.recommended is not None and tight.recommended.fits
    # no row is faster than the unbounded search's best: a stopped search only finds less
    assert tight.recommended.step_time >= free.recommended.step_time * (1 - 1e-12)


def _answers(result) -> dict:
    """A plan's figures without the work it took: each row's note (which says what stopped
    a search) and the node count."""
    out = result.to_dict()
    out["stats"] = {k: v for k, v in out["stats"].items() if k != "search_nodes"}
    out["candidates"] = [{k: v for k, v in row.items() if k != "note"} for row in out["candidates"]]
    return out


def test_a_budget_that_does_not_bind_changes_no_answer():
    """The default budget (PLAN_SEARCH_WORK over layers x pp) leaves every search of this
    plan (full recompute: some 69,000 nodes since issue 42's families) its node limit but
    the last one's (looped_bfs v=3, stopped at its node limit unbounded too, with the same
    best split): the plan is the unbounded one figure for figure; and each plan of a lever
    search, which shares one budget (here one that does not bind) and one schedule cache
    with its memos, is the plan alone."""
    full = config(recompute="full")
    assert PLAN_SEARCH_WORK // (L70.layers * 4) > 40_000
    free = plan(full, budget=SearchBudget(full, total=10**9))
    assert free.stats["search_nodes"] > 20_000
    bounded = plan(full)
    assert _answers(bounded) == _answers(free)
    notes = [(a.label, a.note) for a, b in zip(bounded.candidates, free.candidates) if a.note != b.note]
    assert [label for label, _ in notes] == ["looped_bfs v=3"] and "budget" in notes[0][1]
    levers = plan_levers(config(), zero=(0, 1), recompute=("none", "full"), budget=SearchBudget(config(), total=10**9))
    for (zero, mode), together in levers.plans.items():
        at = config(zero_stage=zero, recompute=mode)
        assert together.to_dict() == plan(at, budget=SearchBudget(config(), total=10**9)).to_dict(), mode


def test_a_spent_budget_runs_no_search_and_keeps_a_fitting_seed():
    budget = SearchBudget(config(), total=0)
    spent = plan(replace(config(), node_limit=1000), budget=budget)
    assert budget.used == spent.stats["search_nodes"] == 0
    assert spent.stats["proven"] < spent.stats["searches"]
    assert spent.recommended is not None and spent.recommended.fits



def test_a_run_past_the_plan_work_bound_is_refused_before_any_work():
    """[Note: size limits]: plans x pp x pp x microbatches, checked by advise (all its dp
    sizes) and by a lever search planned alone, before any plan, with the arithmetic and
    what to change."""
    check_plan_run(8, 16, 64)  # 8 plans at pp=16, m=64: 131072, the bound itself
    with pytest.raises(ParameterError, match=r"9 plans .* = 9 \* 16 \* 16 \* 64 = 147456; at most 131072 are "
                                             r"accepted, 8 plans at this size: compare fewer --dp sizes"):
        advise(replace(config(), pp=16, microbatches=64), (1, 2))  # 3 plans at dp=1, 6 at dp=2
    with pytest.raises(ParameterError, match=r"6 plans .* = 6 \* 32 \* 32 \* 32 = 196608; .* 4 plans at this size"):
        plan_levers(replace(config(), pp=32, microbatches=32))  # dp=2: ZeRO-0/1 x 3 recompute modes
