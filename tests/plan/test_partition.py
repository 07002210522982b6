"""The layer split: nanotron's arithmetic reproduced, and the exact search checked against
brute force over every split, with the simulator as the judge."""

import itertools
import math

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pipeschedule.simulate.critical_path import critical_path
from pipeschedule.errors import ParameterError
from pipeschedule.compiler.families import generate
from pipeschedule.plan.memory import ModelSpec
from pipeschedule.plan.partition import (
    SplitInfeasible,
    SplitProblem,
    llama_block_costs,
    nanotron_assignment,
    nanotron_split,
    optimal_split,
)
from pipeschedule.compiler.passes import lower
from pipeschedule.plan.presets import MODELS
from pipeschedule.simulate import CostModel, simulate
from pipeschedule.plan.split_problem import Evaluator
from strategies import examples

# -- nanotron's split -------------------------------------------------------------------------


def test_nanotron_split_of_llama3_70b_at_pp4():
    """nanotron's build_model on get_block_compute_costs: embedding + 21, 20, 20, 19 + head."""
    assert nanotron_split(MODELS["llama3-70b"], 4) == (21, 20, 20, 19)
    ranks = nanotron_assignment(llama_block_costs(MODELS["llama3-70b"]), 4)
    assert ranks[0] == 0  # embedding
    assert ranks[-4:] == [3, 3, 3, 3]  # final norm, LM head, fp32 cast, loss


def test_nanotron_costs_ignore_gqa():
    m = MODELS["llama3-70b"]
    assert llama_block_costs(m)[1] == 4 * 64 * 128 * 8192 + 3 * 28672 * 8192
    assert llama_block_costs(m)[-3] == 128256 * 8192


def test_nanotron_threshold_is_strict():
    """The block whose cumulative cost crosses a threshold stays on the earlier rank, and
    reaching a threshold exactly does not move on: earlier ranks come out heavier."""
    assert nanotron_assignment([1, 1, 1, 1], 2) == [0, 0, 0, 1]
    assert nanotron_assignment([1] * 6, 3) == [0, 0, 0, 1, 1, 2]


def test_nanotron_split_other_sizes():
    # 8B: a layer weighs 243.3M, the head 525.3M (2.16 layers); thresholds at 8.54, 17.08
    # and 25.62 layer-equivalents are crossed by layers 9, 18 and 26.
    assert nanotron_split(MODELS["llama3-8b"], 4) == (9, 9, 8, 6)
    assert sum(nanotron_split(MODELS["llama3-405b"], 16)) == 126


def test_nanotron_split_rejects_a_head_before_the_last_stage():
    tiny = ModelSpec("tiny", layers=4, hidden=64, heads=4, kv_heads=4, ffn=128, vocab=100_000)
    with pytest.raises(ParameterError, match="pp=4 gives layers .* LM head on stage 0: the stages after it hold "
                                             "nothing"):
        nanotron_split(tiny, 4)
    # and says where nanotron's split does work: the largest pp at or below the one asked for
    with pytest.raises(ParameterError, match="the largest pp up to 16 where its split works for this model is 15"):
        nanotron_split(MODELS["llama3-8b"], 16)
    assert len(nanotron_split(MODELS["llama3-8b"], 15)) == 15


def test_nanotron_split_keeps_a_last_stage_of_the_lm_head_alone():
    """nanotron trains a last stage that holds the LM head and no decoder layer (the
    README's example config: 4 layers at pp=4, integration/nanotron/example.py), so the
    planner plans it as nanotron builds it; before, it refused the config."""
    assert nanotron_split(MODELS["llama3-8b"], 15)[-1] == 0
    small = ModelSpec("example", layers=4, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=128)
    assert nanotron_split(small, 4) == (2, 1, 1, 0)


# -- problems ---------------------------------------------------------------------------------


def make_problem(layers_f, stage_extra, static, stash, budget, pp, S, boundary=0.0, latency=0.0, rank_tail=None):
    L = len(layers_f)
    return SplitProblem(
        layer_forward=tuple(layers_f), layer_backward=tuple(2 * x for x in layers_f), layer_weight=(0,) * L,
        stage_forward=tuple(stage_extra), stage_backward=tuple(2 * x for x in stage_extra), stage_weight=(0,) * S,
        layer_static=tuple(static), layer_stash=tuple(stash), stage_static=(0,) * S, stage_stash=(0,) * S,
        rank_bytes=(0,) * pp, budget=None if budget is None else (budget,) * pp, boundary=(boundary,) * S,
        latency=latency, rank_tail=rank_tail,
    )


def weighted_tail(weights, dip=None):
    """A rank tail of weights[r] * the layers of rank r: like a data-parallel reduction
    that grows with a rank's parameters, but pulling toward its own split, unlike the
    pipeline's. dip: (layers, seconds less) for a tail that is not monotone in the
    layers (as an exposed DDP all-reduce need not be)."""
    def tail(rank, layers):
        value = weights[rank] * layers
        if dip is not None and layers == dip[0]:
            value = max(0.0, value - dip[1])
        return value
    return tail


def all_splits(L, S):
    for cuts in itertools.combinations(range(1, L), S - 1):
        bounds = (0, *cuts, L)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(S))


def tail_of(problem, schedule, split):
    """The step's tail of a split, from the problem's rank tail by hand: the largest over
    ranks, each given its stages' layers in stage order."""
    if problem.rank_tail is None:
        return 0.0
    return max(problem.rank_tail(r, sum(n for s, n in enumerate(split) if schedule.placement[s] == r))
               for r in range(schedule.pp))


def brute_force(problem, schedule):
    ev = Evaluator(problem, schedule)
    best = None
    for split in all_splits(problem.num_layers, problem.num_stages):
        if not ev.fits(split):
            continue
        time = simulate(schedule, ev.cost_model(split)).step_time + tail_of(problem, schedule, split)
        if best is None or time < best[0]:
            best = (time, split)
    return best, ev


SCHEDULES = [("1f1b", None, 1), ("capped_1f1b", 1, 1), ("capped_1f1b", 2, 1), ("afab", None, 1),
             ("interleaved_1f1b", None, 2)]


@st.composite
def cases(draw):
    family, cap, v = draw(st.sampled_from(SCHEDULES))
    pp = draw(st.integers(1, 4 if v == 1 else 3))
    S = pp * v
    m = draw(st.integers(1, 6))
    L = draw(st.integers(S, S + 6))
    alike = draw(st.booleans())
    cost = st.integers(1, 6)
    layers_f = [draw(cost)] * L if alike else draw(st.lists(cost, min_size=L, max_size=L))
    static = [draw(st.integers(0, 4))] * L if alike else draw(st.lists(st.integers(0, 4), min_size=L, max_size=L))
    stash = [draw(st.integers(0, 3))] * L if alike else draw(st.lists(st.integers(0, 3), min_size=L, max_size=L))
    extra = draw(st.lists(st.integers(0, 5), min_size=S, max_size=S))
    budget = draw(st.none() | st.integers(3, 40))
    latency = draw(st.sampled_from([0.0, 0.5]))
    weights = draw(st.none() | st.lists(st.integers(0, 12), min_size=pp, max_size=pp))
    dip = draw(st.none() | st.tuples(st.integers(1, L), st.integers(1, 30)))
    tail = None if weights is None else weighted_tail(weights, dip)
    schedule = lower(generate(family, pp=pp, microbatches=m, virtual=v, cap=cap))
    return make_problem(layers_f, extra, static, stash, budget, pp, S, boundary=1.0, latency=latency,
                        rank_tail=tail), schedule


@settings(max_examples=examples(400))
@given(cases())
def test_optimal_split_matches_brute_force(case):
    """Over layer costs, memory, budgets and tails: the search's split has the least step
    time (simulated pipeline plus tail) of every split that fits, and when none fits it
    says by how much the tightest rank overflows, the least overflow any split achieves
    (one stage per rank)."""
    problem, schedule = case
    best, ev = brute_force(problem, schedule)
    event("infeasible" if best is None else "feasible")
    event(f"{schedule.name}")
    event("with a tail" if problem.rank_tail else "no tail")
    if best is None:
        with pytest.raises(SplitInfeasible) as info:
            optimal_split(problem, schedule)
        err = info.value
        assert f"by {err.overflow:.0f} bytes" in str(err)
        assert err.overflow > 0
        if schedule.virtual == 1:
            least = min(max(b - c for b, c in zip(ev.rank_bytes(s), problem.budget))
                        for s in all_splits(problem.num_layers, problem.num_stages))
            assert err.overflow == pytest.approx(least)
        return
    found = optimal_split(problem, schedule)
    assert found.proven
    assert ev.fits(found.split)
    assert found.step_time == pytest.approx(best[0], rel=1e-9)
    tail = tail_of(problem, schedule, found.split)
    assert simulate(schedule, ev.cost_model(found.split)).step_time + tail == pytest.approx(found.step_time)


@settings(max_examples=examples(400))
@given(cases(), st.integers(1, 40), st.floats(0.0, 0.5))
def test_a_search_stopped_early_bounds_every_split(case, node_limit, above):
    """Stopped at its node limit, the search still says what no split beats (its lower
    bound, shown as a "best found" row's gap): never above the brute-force optimum, nor
    above the split it returns; a proven search gives none. A cutoff above the optimum
    (as a planner passes the best time so far) keeps the search from holding the optimum
    itself, which would hide a bound set too high."""
    problem, schedule = case
    best, ev = brute_force(problem, schedule)
    if best is None:
        return
    cutoff = best[0] * (1 + above) if above > 0 else math.inf
    found = optimal_split(problem, schedule, node_limit=node_limit, cutoff=cutoff)
    if found.proven:
        event("proven")
        assert found.lower_bound is None
        return
    event("stopped, bound known" if found.lower_bound is not None else "stopped, no bound")
    if found.lower_bound is not None:
        event("the bound is what a too-high one would break" if found.lower_bound >= best[0] * (1 - 1e-9)
              else "the bound is below the optimum")
        assert found.lower_bound <= best[0] * (1 + 1e-9), (found.lower_bound, best)
        if ev.fits(found.split):  # (stopped before any leaf: the least-overflow split, which need not fit)
            assert found.lower_bound <= found.step_time * (1 + 1e-9)


def test_the_tail_moves_the_optimum():
    """A tail that grows with stage 0's layers: without it the search puts the most
    layers on stage 0 (it has no head), with it fewer; each answer is the brute force's."""
    problem = make_problem([1.0] * 12, [0.0, 0.0, 3.0], [0] * 12, [0] * 12, None, 3, 3)
    schedule = lower(generate("1f1b", pp=3, microbatches=6))
    plain = optimal_split(problem, schedule)
    tailed_problem = make_problem([1.0] * 12, [0.0, 0.0, 3.0], [0] * 12, [0] * 12, None, 3, 3,
                                  rank_tail=weighted_tail([20.0, 0.0, 0.0]))
    tailed = optimal_split(tailed_problem, schedule)
    assert plain.proven and tailed.proven
    assert tailed.split[0] < plain.split[0]
    assert (tailed.step_time, tailed.split) == brute_force(tailed_problem, schedule)[0]
    assert (plain.step_time, plain.split) == brute_force(problem, schedule)[0]


def test_a_bad_tail_is_refused():
    """A rank tail that is not a function, or gives a negative or non-finite time, is named."""
    with pytest.raises(ParameterError, match=r"rank_tail must be a function of \(rank, its layers\) or None, "
                                             r"got float"):
        make_problem([1.0] * 4, [0.0] * 2, [0] * 4, [0] * 4, None, 2, 2, rank_tail=1.5)
    schedule = lower(generate("1f1b", pp=2, microbatches=2))
    for value, shown in ((-1.0, "-1.0"), (math.nan, "nan")):
        problem = make_problem([1.0] * 4, [0.0] * 2, [0] * 4, [0] * 4, None, 2, 2,
                               rank_tail=lambda rank, layers, v=value: v)
        with pytest.raises(ParameterError, match=rf"the tail of rank \d with \d+ layers must be a finite number "
                                                 rf">= 0, got {shown}"):
            optimal_split(problem, schedule)


def test_large_alike_problem_is_proven_quickly():
    """126 alike layers on 16 stages, 64 microbatches: 1F1B's best split is the balanced
    one, proven without enumerating."""
    L, S = 126, 16
    problem = make_problem([1.0] * L, [0.0] * (S - 1) + [1.05], [4.0] * L, [1.0] * L, None, S, S, boundary=0.01)
    found = optimal_split(problem, lower(generate("1f1b", pp=S, microbatches=64)))
    assert found.proven
    assert max(found.split) == 8 and sorted(found.split)[:2] == [6, 8]


def test_cutoff_proves_a_schedule_cannot_win():
    problem = make_problem([1.0] * 12, [0.0] * 4, [0] * 12, [0] * 12, None, 4, 4)
    schedule = lower(generate("capped_1f1b", pp=4, microbatches=8, cap=1))
    free = optimal_split(problem, schedule)
    capped = optimal_split(problem, schedule, cutoff=free.step_time / 2)
    assert capped.proven and capped.step_time >= capped.cutoff


def test_infeasible_message_names_the_overflow():
    problem = make_problem([1.0] * 8, [0.0] * 2, [10] * 8, [0] * 8, 35, 2, 2)
    with pytest.raises(SplitInfeasible, match=r"rank \d \(stage \d\) over its budget of 35 bytes by 5 bytes"):
        optimal_split(problem, lower(generate("1f1b", pp=2, microbatches=2)))


def test_bad_inputs_are_rejected_with_the_value():
    with pytest.raises(ParameterError, match=r"layer_forward\[1\] must be a finite number >= 0, got -1"):
        make_problem([1, -1, 1], [0, 0], [0] * 3, [0] * 3, None, 2, 2)
    with pytest.raises(ParameterError, match="4 stages but only 3 decoder layers"):
        make_problem([1] * 3, [0] * 4, [0] * 3, [0] * 3, None, 4, 4)
    problem = make_problem([1] * 4, [0] * 2, [0] * 4, [0] * 4, None, 2, 2)
    with pytest.raises(ParameterError, match="2 stages and 2 ranks; the schedule has 3 stages"):
        optimal_split(problem, lower(generate("1f1b", pp=3, microbatches=2)))


@settings(max_examples=examples(60))
@given(st.sampled_from(SCHEDULES), st.integers(1, 4), st.integers(1, 6), st.data())
def test_critical_path_is_exact_and_a_lower_bound(schedule_params, pp, m, data):
    family, cap, v = schedule_params
    schedule = lower(generate(family, pp=pp, microbatches=m, virtual=v, cap=cap))
    S = schedule.num_stages
    costs = st.lists(st.floats(0.1, 5), min_size=S, max_size=S)
    f, b, f2, b2 = (tuple(data.draw(costs)) for _ in range(4))
    sizes = {"act_out": tuple(data.draw(costs)), "grad_in": tuple(data.draw(costs))}
    cost = CostModel(f, b, (0.0,) * S, sizes, latency=0.2, bandwidth=3.0)
    result = simulate(schedule, cost)
    path = critical_path(schedule, result, cost)
    assert path.length(f, b, (0,) * S) == pytest.approx(result.step_time)
    other = simulate(schedule, CostModel(f2, b2, (0.0,) * S, sizes, latency=0.2, bandwidth=3.0))
    assert path.length(f2, b2, (0,) * S) <= other.step_time * (1 + 1e-12)
    assert math.isfinite(path.messages)
