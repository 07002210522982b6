"""[Note: plan search budget]: the split searches of one plan run share a budget of nodes."""

from __future__ import annotations

from dataclasses import replace

from pipeschedule.checks import PLAN_SEARCH_WORK
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


def test_a_budget_that_does_not_bind_changes_no_answer():
    """The default budget (PLAN_SEARCH_WORK over layers x pp) leaves every search of this
    plan its node limit: the plan is the unbounded one figure for figure, and so is each
    plan of a lever search, which shares one budget."""
    assert PLAN_SEARCH_WORK // (L70.layers * 4) > 60_000
    free = plan(config(), budget=SearchBudget(config(), total=10**9))
    assert plan(config()).to_dict() == free.to_dict()
    levers = plan_levers(config(), zero=(1,), recompute=("none", "full"))
    for (zero, mode), together in levers.plans.items():
        at = config(zero_stage=zero, recompute=mode)
        assert together.to_dict() == plan(at, budget=SearchBudget(config(), total=10**9)).to_dict(), mode


def test_a_spent_budget_runs_no_search_and_keeps_a_fitting_seed():
    budget = SearchBudget(config(), total=0)
    spent = plan(replace(config(), node_limit=1000), budget=budget)
    assert budget.used == spent.stats["search_nodes"] == 0
    assert spent.stats["proven"] < spent.stats["searches"]
    assert spent.recommended is not None and spent.recommended.fits
