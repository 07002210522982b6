"""A fixed set of split problems, and the answers of the split search before issue 19's
speed work, to hold the new search to them (tests/plan/test_split_answers.py).

`split_answers.json` was written by `python tests/plan/split_cases.py OUT` run with the
package of commit a153717 (the search before the relaxation and the step graph) first on
PYTHONPATH; it imports only what that commit already had.
"""

from __future__ import annotations

import json
import math
import random
import sys

from pipeschedule.compiler.families import generate
from pipeschedule.compiler.passes import lower
from pipeschedule.plan.partition import SplitInfeasible, SplitProblem, optimal_split

SMALL = [("1f1b", None, 1), ("capped_1f1b", 1, 1), ("capped_1f1b", 2, 1), ("afab", None, 1),
         ("interleaved_1f1b", None, 2), ("zb_h1", None, 1), ("zbv", None, None), ("v_half", None, None)]


def problem(rng: random.Random, L: int, S: int, pp: int, alike: bool, budget) -> SplitProblem:
    def layer(low, high):
        return [rng.uniform(low, high)] * L if alike else [rng.uniform(low, high) for _ in range(L)]

    forward = layer(1.0, 2.0)
    head = rng.choice([0.0, 0.5, 2.5])
    stage_f = [0.0] * (S - 1) + [head]
    return SplitProblem(
        layer_forward=tuple(forward), layer_backward=tuple(2 * f for f in forward),
        layer_weight=tuple(0.6 * f for f in forward), stage_forward=tuple(stage_f),
        stage_backward=tuple(2 * x for x in stage_f), stage_weight=tuple(0.6 * x for x in stage_f),
        layer_static=tuple(layer(1.0, 3.0)), layer_stash=tuple(layer(0.5, 1.5)),
        stage_static=(2.0,) + (0.0,) * (S - 2) + (3.0,) if S > 1 else (5.0,), stage_stash=(0.0,) * S,
        rank_bytes=(1.0,) * pp, budget=None if budget is None else (float(budget),) * pp,
        boundary=(0.25,) * S, latency=rng.choice([0.0, 0.05]), bandwidth=rng.choice([math.inf, 4.0]))


def cases() -> list[dict]:
    """Small cases (every family, pp <= 4, budgets, cutoffs) and larger alike ones that
    need more than the first 500 search nodes."""
    rng, out = random.Random(19), []
    for i in range(150):
        family, cap, v = SMALL[i % len(SMALL)]
        pp = rng.randint(2, 4)
        S = pp * (2 if family in ("interleaved_1f1b", "zbv", "v_half") else 1)
        L = rng.randint(S, S + 8)
        budget = rng.choice([None, None, 4.0 * L / pp + 6.0, 3.0 * L / pp + 4.0])
        out.append(dict(family=family, cap=cap, virtual=v, pp=pp, m=rng.randint(1, 8), L=L, S=S,
                        alike=rng.random() < 0.6, budget=budget, seed=rng.randrange(1 << 30),
                        cutoff=rng.choice([None, None, 0.8, 1.05])))
    for i in range(12):
        family, cap, v = [("1f1b", None, 1), ("zb_h1", None, 1), ("zbv", None, None), ("interleaved_1f1b", None, 2),
                          ("capped_1f1b", 3, 1), ("afab", None, 1)][i % 6]
        pp = 8 if family in ("1f1b", "zb_h1", "capped_1f1b", "afab") else 4
        S = pp * (2 if family in ("interleaved_1f1b", "zbv") else 1)
        out.append(dict(family=family, cap=cap, virtual=v, pp=pp, m=rng.choice([16, 24]), L=rng.randint(6 * S, 8 * S),
                        S=S, alike=True, budget=None, seed=rng.randrange(1 << 30), cutoff=None))
    return out


def build(case: dict):
    """(problem, schedule, cutoff factor or None) of a case."""
    rng = random.Random(case["seed"])
    prob = problem(rng, case["L"], case["S"], case["pp"], case["alike"], case["budget"])
    schedule = lower(generate(case["family"], pp=case["pp"], microbatches=case["m"], virtual=case["virtual"],
                              cap=case["cap"]))
    return prob, schedule, case["cutoff"]


def answer(case: dict, node_limit: int = 20_000) -> dict:
    """What optimal_split answers: a cutoff factor scales the time found without one."""
    prob, schedule, factor = build(case)
    try:
        cutoff = math.inf
        if factor is not None:
            cutoff = optimal_split(prob, schedule, node_limit=node_limit).step_time * factor
        found = optimal_split(prob, schedule, node_limit=node_limit, cutoff=cutoff)
    except SplitInfeasible as err:
        return {"infeasible": True, "split": list(err.split), "overflow": err.overflow}
    return {"split": list(found.split), "step_time": found.step_time, "proven": found.proven,
            "cutoff": None if cutoff == math.inf else cutoff}


if __name__ == "__main__":
    json.dump([answer(case) for case in cases()], open(sys.argv[1], "w"), indent=0)
