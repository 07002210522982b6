"""`searched`: the compute order with the least simulated step time that the search finds
for given per-stage F, B and W times and a per-rank cap, never slower than any fixed
family under the same cap.

[Note: searched schedule] Given stage times (a `CostModel`, whose latency, bandwidth and
buffer bytes also time the messages, or (F, B, W) per stage; None: unit costs F = B =
W = 1) and a cap (one int or one per rank: the stage-microbatches a rank holds from an F
to its W, its stashes, as zb_h1's cap counts them, which bounds rule 6's count, F to B,
too; None: no cap), `searched`
  1. takes the seeds: the compute order of every fixed family on the same placement
     (its caller's `seeds`, families.py: on one chunk per rank afab, 1f1b, capped_1f1b,
     interleaved_1f1b, zb_h1, ..., under the cap where they take one), each generated
     with the cost it reads (the unsplit families with B + W as their backward), and
     keeps those within the cap on every rank;
  2. adds four list schedules of the search model (search.py `list_order`: B or F
     first, W deferred or right after its B) under the same cap;
  3. anneals from the best three ([Note: local search] in search.py) within a work
     budget (`budget`, instructions timed; SEARCH_WORK by default);
  4. lowers every seed, list schedule and annealed order with the cost and simulates it
     (`pipeschedule.simulate`; where messages are free, the search model's time is the
     simulated one: [Note: free messages]), an unsplit seed in its split form (each W
     right after its B), and returns the one with the least simulated step time (the
     earliest on a tie: seeds first).
Every candidate is in split form (B input gradients, W weight gradients), so the result
always splits the backward, and the cost is read as a split-backward schedule reads it.
Since every seed is a candidate, the result is never slower in simulation than the split
form of any fixed family's order within the cap; tests/compiler/test_searched.py checks
that it is never slower than the family's own schedule either (splitting an unsplit
order's B runs each W where the whole backward ran, and its messages leave no later).

Why the cap counts stashes, not rule 6's F to B: a stash whose B has run and whose W
has not still holds its weight-gradient part (`CostModel.weight_stash`), and a search
free to defer W trades memory for time without bound: under unit costs at pp=4, m=16 a
cap of 3 in flight came with 9 stashes held on rank 0, more than 1F1B's 4. With
`uncounted_w=True` (the Python API) the cap bounds rule 6's count only: at pp=4, m=8,
cap 2 under the H200 costs, 308.0 ms against 327.1 with the cap on stashes and
capped_1f1b's 351.1, rank 0 holding 4 stashes (6.0 GiB against 3.7;
benchmarks/results/searched_schedule.md). Why a cap c below pp costs time at all: each
of stage 0's c slots is held from an F to its W, the pipeline's whole F and B chain
long, so a step takes at least m / c such round trips (at pp=4, m=8, cap 2 under those
costs: 4 x 72.3 ms after the first F, 298 ms, if no two microbatches ever met in a
queue); the split backward shortens each round trip by the W of every stage but the
first, and the search chooses which of two ready instructions a rank runs first. No two
microbatches can avoid meeting there: the least time of any order within rank 0's
memory at capped_1f1b's peak (2 stashes held from F to W, since a third F with two
stashes shrunk to their W's part would exceed it) and rule 6's 2 on every rank, even
with the other ranks' Ws free to wait, is 326.5 ms in the search model, proven by an
exact program (benchmarks/searched_bound.py), 7.0% below capped_1f1b; the search finds
that order (327.1 ms simulated), and the issue's 10% is out of reach at that memory.

Cost: one simulation per candidate (about ten) and the annealing's budget; the size is
bounded by MAX_SEARCH_PAIRS and MAX_SEARCH_STAGES ([Note: size limits] in checks.py;
benchmarks/limits.py times the largest accepted).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Sequence

from pipeschedule.checks import MAX_SEARCH_PAIRS, MAX_SEARCH_STAGES, SEARCH_WORK, check_int, shown
from pipeschedule.compiler.generators.common import check_common, make, per_rank_caps
from pipeschedule.compiler.generators.search import (
    B, F, W, Problem, better, finish, improve, list_order, split_after, within_limits,
)
from pipeschedule.compiler.ir import BUFFERS, Op, Schedule, make_instr
from pipeschedule.compiler.passes import lower
from pipeschedule.compiler.timing import stage_times
from pipeschedule.errors import ParameterError
from pipeschedule.simulate import simulate
from pipeschedule.simulate.cost import CostModel

_OP = {Op.F: F, Op.B: B, Op.W: W}
_INSTR = {F: Op.F, B: Op.B, W: Op.W}
IMPROVED = 3  # the best candidates the local search starts from
SMALL = 2**9  # instructions of an order up to which each start gets SEARCH_WORK ([Note: search budget])

# [Note: search budget] The annealing times at most `budget` instructions in all, shared by
# its starts: by default SEARCH_WORK (checks.py), or SEARCH_WORK for each start where an
# order has at most SMALL instructions (pp * m * 3 <= 512: pp=4, m=8 on two chunks a rank).
# Small problems are where the annealing finds the most and costs little (a start makes
# at most MAX_TRIES swaps: about 0.1 s): on the V at pp=4, m=8, cap 2 under the H200 costs
# it reaches 464 ms with SEARCH_WORK in all and 417 with SEARCH_WORK a start. Large ones
# cost a swap's timing per instruction, and the planner searches two of them at pp=40,
# m=25 (benchmarks/limits.py).


# seeds(pp, m, cap, split cost, whole cost) -> (family name, its compute-only schedule) of each fixed family
Seeds = Callable[[int, int, object, CostModel, CostModel], Sequence[tuple[str, Schedule]]]


def cost_models(cost, placement: Sequence[int]) -> tuple[CostModel, CostModel]:
    """(split, whole): the cost as a split-backward schedule reads it (B the input
    gradient, W the weight gradient) and as an unsplit one does (B + W as the backward,
    W 0). A `CostModel` keeps its messages and bytes; times alone (or None: unit costs)
    get free messages and 1 byte per buffer."""
    stages = len(placement)
    times = stage_times(cost, stages)  # checked before any work
    if isinstance(cost, CostModel):
        split = cost
    elif cost is None:
        split = CostModel((1,) * stages, (1,) * stages, (1,) * stages, {k: (1,) * stages for k in BUFFERS})
    else:
        split = CostModel(times.forward, times.backward, times.weight, {k: (1,) * stages for k in BUFFERS})
    whole = replace(split, backward=tuple(b + w for b, w in zip(split.backward, split.weight)),
                    weight=(0,) * stages, weight_stash=None)
    return split, whole


def problem_of(placement: Sequence[int], microbatches: int, limits: Sequence[int], stash_limits: Sequence[int],
               cost: CostModel) -> Problem:
    """The search's `Problem` for a split-backward cost ([Note: search model])."""
    S = len(placement)

    def delay(nbytes: float) -> float:
        return float(cost.latency) + (0.0 if cost.bandwidth == math.inf else float(nbytes) / float(cost.bandwidth))

    out_bytes, grad_bytes = cost.buffer_bytes["act_out"], cost.buffer_bytes["grad_in"]
    send_f = tuple(delay(out_bytes[s]) if s + 1 < S and placement[s] != placement[s + 1] else 0.0
                   for s in range(S))
    send_b = tuple(delay(grad_bytes[s]) if s and placement[s] != placement[s - 1] else 0.0 for s in range(S))
    floats = [tuple(map(float, column)) for column in (cost.forward, cost.backward, cost.weight, send_f, send_b)]
    return Problem(tuple(placement), microbatches, tuple(limits), tuple(stash_limits), *floats)


def stage_limits(cap, placement: Sequence[int], pp: int, microbatches: int) -> list[int]:
    """Per-rank limits of held stage-microbatches: the cap (None: none), at most all the
    rank's stage-microbatches; a cap below a rank's stage count is refused (one
    microbatch through the rank's stages is the least it can hold)."""
    local = [placement.count(r) for r in range(pp)]
    if cap is None:
        return [n * microbatches for n in local]
    caps = per_rank_caps(cap, pp)
    for r, (c, n) in enumerate(zip(caps, local)):
        if c < n:
            raise ParameterError(f"searched: cap {shown(cap)} gives rank {r} a cap of {c}, below its {n} stages: a "
                                 f"rank holds one microbatch in each of its stages between their F and B, so cap must "
                                 f"be >= {n} there")
    return [min(c, n * microbatches) for c, n in zip(caps, local)]


def order_of(schedule: Schedule) -> list[list[tuple[int, int, int]]]:
    """A schedule's compute instructions (F, B, W) as the search's orders."""
    return [[(_OP[i.op], i.stage, i.mb) for i in program if i.op in _OP] for program in schedule.programs]


def searched(pp: int, microbatches: int, cap=None, cost=None, *, placement: Sequence[int] | None = None,
             seeds: Seeds | None = None, budget: int | None = None, uncounted_w: bool = False) -> Schedule:
    """The `searched` family's compute order ([Note: searched schedule]) on `placement`
    (None: one stage per rank), seeded with `seeds(pp, m, cap, split_cost, whole_cost)`:
    (name, compute-only schedule) of the fixed families to beat. `cap` bounds the
    stage-microbatches a rank holds from F to W (and so rule 6's count, F to B); with
    `uncounted_w` it bounds rule 6's count only, and a stash whose W is pending is not
    counted. `budget`: instructions the local search may time (None: [Note: search budget])."""
    placement = list(range(pp)) if placement is None else list(placement)
    virtual = max(1, len(placement) // pp)
    check_common(pp, microbatches, virtual)
    if sorted(set(placement)) != list(range(pp)) or len(placement) != pp * virtual:
        raise ParameterError(f"searched: placement {shown(placement)} must give each of the {pp} ranks "
                             f"{virtual} stage(s)")
    if len(placement) > MAX_SEARCH_STAGES:
        raise ParameterError(f"searched: {len(placement)} stages; at most {MAX_SEARCH_STAGES} are accepted (its seeds, "
                             f"every fixed family's order, are built stage by stage)")
    pairs = len(placement) * microbatches
    if pairs > MAX_SEARCH_PAIRS:
        raise ParameterError(f"searched: pp * virtual * microbatches = {len(placement)} * {microbatches} = {pairs} "
                             f"(stage, microbatch) pairs; at most {MAX_SEARCH_PAIRS} are accepted (the search "
                             f"simulates each of its candidates)")
    if budget is None:  # [Note: search budget]
        budget = SEARCH_WORK * (IMPROVED if 3 * len(placement) * microbatches <= SMALL else 1)
    check_int("budget", budget, 0)
    split_cost, whole_cost = cost_models(cost, placement)
    limits = stage_limits(cap, placement, pp, microbatches)
    stash_limits = stage_limits(None, placement, pp, microbatches) if uncounted_w else limits
    problem = problem_of(placement, microbatches, limits, stash_limits, split_cost)
    candidates = []  # (origin, split order), seeds first
    for name, schedule in (seeds(pp, microbatches, cap, split_cost, whole_cost) if seeds else ()):
        if list(schedule.placement) != placement:
            continue
        order = order_of(schedule)
        if not schedule.split_backward:
            order = split_after(order)
        if within_limits(problem, order):
            candidates.append((name, order))
    for prefer_b in (True, False):
        for eager_w in (False, True):
            order = list_order(problem, prefer_b=prefer_b, eager_w=eager_w)
            if order is not None:
                candidates.append(("list", order))
    timed = [(key, origin, order) for origin, order in candidates if (key := finish(problem, order)) is not None]
    starts = sorted(timed, key=lambda item: item[0])[:IMPROVED]
    improved = []
    for n, (key, origin, order) in enumerate(starts):
        share = budget // (len(starts) - n)  # what is left, shared by the starts still to go
        found, order, left = improve(problem, order, share, seed=n)
        budget -= share - left
        if better(found, key):
            improved.append((f"{origin}+search", order))
    free = split_cost.latency == 0 and split_cost.bandwidth == math.inf  # [Note: free messages]
    best = None
    for origin, order in candidates + improved:
        schedule = _schedule(pp, virtual, microbatches, placement, order, limits if cap is not None else None, origin)
        if free:
            step = finish(problem, order)[0]
        else:
            step = simulate(lower(schedule, split_cost), split_cost).step_time
        if best is None or step < best[0] - 1e-9 * max(1.0, abs(best[0])):
            best = (step, schedule)
    return best[1]


# [Note: free messages] Where messages cost nothing (latency 0, infinite bandwidth: unit
# costs, or times without a cost model's link), the simulated step time of a lowered
# order is the search model's `finish` exactly: every message completes when both ends
# have posted it, and lowering posts each receive before the first compute that can wait
# for it ([Note: message placement] in passes.py). So the candidates are compared by
# `finish` there, without lowering and simulating each (a third of a unit-cost
# search's time at pp=16, m=64). tests/compiler/test_searched.py pins the two equal on
# seeds, list schedules and annealed orders.


def _schedule(pp: int, virtual: int, microbatches: int, placement, order, caps, origin: str) -> Schedule:
    programs = [[make_instr(_INSTR[op], s, mb) for op, s, mb in program] for program in order]
    params = {"seed": origin} | ({} if caps is None else {"cap": list(caps)})
    return make("searched", pp, virtual, microbatches, placement, programs, params)


__all__ = ["cost_models", "order_of", "problem_of", "searched", "stage_limits"]
