"""The split problem: stage costs and rank memory of every contiguous split of a model's
decoder layers over a schedule's stages, simulated splits cached, and the least overflow
when no split fits. `partition.optimal_split` searches over it (split_search.py).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

from pipeschedule.simulate.critical_path import CriticalPath
from pipeschedule.checks import check_number, finite_floats
from pipeschedule.errors import ParameterError
from pipeschedule.compiler.ir import Op, Schedule
from pipeschedule.plan.memo import Memo, plain
from pipeschedule.plan.memory import GiB
from pipeschedule.plan.step_graph import StepGraph
from pipeschedule.simulate import CostModel

# -- the problem -----------------------------------------------------------------------------


def _floats(name: str, values, length: int) -> tuple:
    values = tuple(values)
    if len(values) != length:
        raise ParameterError(f"{name} has {len(values)} entries, expected {length}")
    if finite_floats(values):
        return values
    for i, v in enumerate(values):
        check_number(f"{name}[{i}]", v)
    return values


@dataclass(frozen=True)
class SplitProblem:
    """Putting decoder layers 0..L-1, in order, on the S stages of a schedule.

    layer_forward / layer_backward / layer_weight: time of one layer's F, B and W.
    stage_forward / stage_backward / stage_weight: extra time per stage (the embedding on
    stage 0, the LM head and loss on the last). layer_static / layer_stash: bytes of one
    layer held all step / saved per in-flight microbatch; stage_static / stage_stash: the
    same extras per stage. rank_bytes: bytes per rank that do not depend on the split
    (p2p buffers, transients). budget: bytes per rank, or None for no limit. boundary:
    bytes of a stage's sent activation and gradient (message time = latency +
    boundary / bandwidth). A rank holds sum over its stages of static + k_s * stash, with
    k_s the stage's peak in-flight microbatches under the schedule, plus rank_bytes.
    rank_tail: rank_tail(r, n) is the seconds rank r spends after the pipeline when its
    stages hold n decoder layers together (the data-parallel reduction and the optimizer
    step, [Note: step tail] in dp_step.py: they grow with the rank's parameters, which
    its layer count and which stages it holds decide), never negative; None for none. A
    split's tail is the largest over ranks, and the search minimises the simulated
    pipeline plus the tail ([Note: exact split search]).
    """

    layer_forward: tuple
    layer_backward: tuple
    layer_weight: tuple
    stage_forward: tuple
    stage_backward: tuple
    stage_weight: tuple
    layer_static: tuple
    layer_stash: tuple
    stage_static: tuple
    stage_stash: tuple
    rank_bytes: tuple
    budget: tuple | None
    boundary: tuple
    latency: float = 0.0
    bandwidth: float = math.inf
    rank_tail: Callable[[int, int], float] | None = None

    def __post_init__(self) -> None:
        if self.rank_tail is not None and not callable(self.rank_tail):
            raise ParameterError(f"rank_tail must be a function of (rank, its layers) or None, "
                                 f"got {type(self.rank_tail).__name__}")
        layers, stages = len(self.layer_forward), len(self.stage_forward)
        if layers < 1 or stages < 1:
            raise ParameterError(f"a split needs at least one layer and one stage, "
                                 f"got {layers} layers, {stages} stages")
        if layers < stages:
            raise ParameterError(
                f"{stages} stages but only {layers} decoder layers: every stage needs at least one layer "
                f"(lower pp or virtual)"
            )
        for name in ("layer_forward", "layer_backward", "layer_weight", "layer_static", "layer_stash"):
            object.__setattr__(self, name, _floats(name, getattr(self, name), layers))
        for name in ("stage_forward", "stage_backward", "stage_weight", "stage_static", "stage_stash", "boundary"):
            object.__setattr__(self, name, _floats(name, getattr(self, name), stages))
        object.__setattr__(self, "rank_bytes", _floats("rank_bytes", self.rank_bytes, len(self.rank_bytes)))
        if self.budget is not None:
            object.__setattr__(self, "budget", _floats("budget", self.budget, len(self.rank_bytes)))

    @property
    def num_layers(self) -> int:
        return len(self.layer_forward)

    @property
    def num_stages(self) -> int:
        return len(self.stage_forward)

    @property
    def homogeneous(self) -> bool:
        """All layers alike: a stage's cost and bytes depend on its layer count only."""
        return all(len(set(getattr(self, k))) == 1 for k in ("layer_forward", "layer_backward", "layer_weight",
                                                             "layer_static", "layer_stash"))


def stage_inflight(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most microbatches whose stash is live: whose F has run and whose B
    (W, when the schedule splits the backward) has not."""
    live = [0] * schedule.num_stages
    peak = [0] * schedule.num_stages
    release = Op.W if schedule.split_backward else Op.B
    for program in schedule.programs:
        for instr in program:
            if instr.op is Op.F:
                live[instr.stage] += 1
                peak[instr.stage] = max(peak[instr.stage], live[instr.stage])
            elif instr.op is release:
                live[instr.stage] -= 1
    return tuple(peak)


class Evaluator:
    """Stage costs, bytes and cached simulations of the splits of one problem (`graph`:
    the schedule's StepGraph, built here unless given; `inflight`: its `stage_inflight`,
    likewise; `memo`: where the searches of one schedule keep their memory tables by
    the problem's bytes ([Note: run-wide memos] in memo.py), None for none)."""

    def __init__(self, problem: SplitProblem, schedule: Schedule, graph: StepGraph | None = None,
                 inflight: Sequence[int] | None = None, memo: Memo | None = None) -> None:
        if problem.num_stages != schedule.num_stages or len(problem.rank_bytes) != schedule.pp:
            raise ParameterError(
                f"the split problem has {problem.num_stages} stages and {len(problem.rank_bytes)} ranks; the "
                f"schedule has {schedule.num_stages} stages on {schedule.pp} ranks"
            )
        self.p, self.schedule = problem, schedule
        self.homogeneous = problem.homogeneous
        self.inflight = tuple(inflight) if inflight is not None else stage_inflight(schedule)
        self.rank_of = schedule.placement
        self.stages_of = [[s for s, r in enumerate(schedule.placement) if r == rank] for rank in range(schedule.pp)]
        self.prefix = {k: [0.0, *accumulate(getattr(problem, k))] for k in (
            "layer_forward", "layer_backward", "layer_weight", "layer_static", "layer_stash")}
        budget = problem.budget or (math.inf,) * schedule.pp
        self.cap = [b - x for b, x in zip(budget, problem.rank_bytes)]
        self.cache: dict[tuple, object] = {}
        self.tails: dict[tuple, float] = {}
        self.floors: dict[int, list[float]] = {}
        self.least_floors: list[float] | None = None
        self.least_split_tail: float | None = None
        self.simulations = 0
        # [Note: step graph]: one graph for every split, the simulator's times and chains.
        self.graph = graph if graph is not None else StepGraph(schedule)
        self.messages = self.graph.message_times(problem.boundary, problem.boundary, problem.latency,
                                                 problem.bandwidth)
        self.memo = memo

    def kept(self, what: str, compute: Callable[[], object]):
        """`compute()`, a function of the problem's bytes alone (and the schedule's), kept
        in `memo` by them ([Note: run-wide memos])."""
        p = self.p
        key = (what, p.layer_static, p.layer_stash, p.stage_static, p.stage_stash, p.rank_bytes, p.budget)
        if self.memo is None or not all(plain(part) for part in key[1:] if part is not None):
            return compute()
        return self.memo.get(key, compute)

    def _range(self, key: str, j: int, e: int) -> float:
        return self.prefix[key][e] - self.prefix[key][j]

    def stage_bytes(self, s: int, j: int, e: int) -> float:
        p = self.p
        stash = self._range("layer_stash", j, e) + p.stage_stash[s]
        return self._range("layer_static", j, e) + p.stage_static[s] + self.inflight[s] * stash

    def costs(self, split: Sequence[int]):
        p, bounds = self.p, [0, *accumulate(split)]
        out = []
        for key, extra in (("layer_forward", p.stage_forward), ("layer_backward", p.stage_backward), ("layer_weight",
                                                                                                      p.stage_weight)):
            out.append(tuple(self._range(key, bounds[s], bounds[s + 1]) + extra[s] for s in range(len(split))))
        return out

    def cost_model(self, split: Sequence[int]) -> CostModel:
        forward, backward, weight = self.costs(split)
        p = self.p
        return CostModel(forward, backward, weight, {"act_out": p.boundary, "grad_in": p.boundary},
                         latency=p.latency, bandwidth=p.bandwidth)

    def simulate(self, split: Sequence[int]):
        """(step time, critical path) of a split, cached by its stage costs: what
        `simulate` and `critical_path` give, from the schedule's step graph."""
        forward, backward, weight = self.costs(split)
        key = (forward, backward, weight)
        if key not in self.cache:
            self.simulations += 1
            self.cache[key] = self.graph.step(forward, backward, weight, self.messages)
        return self.cache[key]

    def step_time(self, split: Sequence[int]):
        """(step time, critical path) of a split: the simulated pipeline plus the
        problem's tail; the path bounds the pipeline alone (the tail is never negative,
        so a bound on the pipeline bounds the step)."""
        pipeline, path = self.simulate(split)
        return pipeline + self.tail(split), path

    def tail(self, split: Sequence[int]) -> float:
        """The problem's tail of a split: the largest `rank_tail` (0 without one)."""
        if self.p.rank_tail is None:
            return 0.0
        return max(self.rank_tail(r, sum(split[s] for s in stages)) for r, stages in enumerate(self.stages_of))

    def rank_tail(self, rank: int, layers: int) -> float:
        """`rank_tail` of the problem (0 without one), cached; refused where it is negative
        or not a finite number."""
        if self.p.rank_tail is None:
            return 0.0
        key = (rank, layers)
        if key not in self.tails:
            value = self.p.rank_tail(rank, layers)
            if not finite_floats((value,)):  # the common case, checked without building a message
                check_number(f"the tail of rank {rank} with {layers} layers", value)
            self.tails[key] = float(value)
        return self.tails[key]

    def tail_floor(self, rank: int, layers: int) -> float:
        """The least tail rank r can have once it holds at least `layers` layers: the
        least `rank_tail` from there up to every layer (a bound below for a rank whose
        stages are not all chosen yet; the tail need not grow with the layers)."""
        if self.p.rank_tail is None:
            return 0.0
        if rank not in self.floors:
            L, floor, least = self.p.num_layers, [0.0] * (self.p.num_layers + 2), math.inf
            floor[L + 1] = math.inf
            for n in range(L, -1, -1):
                least = min(least, self.rank_tail(rank, n)) if n >= len(self.stages_of[rank]) else least
                floor[n] = least
            self.floors[rank] = floor
        return self.floors[rank][min(layers, self.p.num_layers + 1)]

    def least_tail(self) -> float:
        """A bound below the tail of every split: the least t such that the ranks can hold
        all the layers with each rank's `tail_floor` at most t (floors do not fall as
        layers grow, so each rank takes every layer up to where its floor passes t)."""
        if self.p.rank_tail is None:
            return 0.0
        if self.least_split_tail is None:
            L, ranks = self.p.num_layers, [r for r, stages in enumerate(self.stages_of) if stages]

            def holds(t: float) -> bool:  # the most layers the ranks take with floors <= t
                total = 0
                for r in ranks:
                    if self.tail_floor(r, len(self.stages_of[r])) > t:
                        return False
                    total += bisect_right(self.floors[r], t) - 1  # the largest n with tail_floor(r, n) <= t
                return total >= L

            values = sorted({self.tail_floor(r, n) for r in ranks for n in range(L + 1)} - {math.inf})
            lo, hi = 0, len(values) - 1
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if holds(values[mid]) else (mid + 1, hi)
            self.least_split_tail = values[lo]
        return self.least_split_tail

    def least_floor(self, layers: int) -> float:
        """The least `tail_floor` of any rank that holds a stage: what some rank's tail is
        at least once it holds `layers` layers, whichever rank it is."""
        if self.p.rank_tail is None:
            return 0.0
        if self.least_floors is None:
            ranks = [r for r, stages in enumerate(self.stages_of) if stages]
            self.least_floors = [min(self.tail_floor(r, n) for r in ranks) for n in range(self.p.num_layers + 2)]
        return self.least_floors[min(layers, self.p.num_layers + 1)]

    def probe(self, forward, backward, weight) -> CriticalPath:
        """The critical path under arbitrary per-stage costs."""
        self.simulations += 1
        return self.graph.step(forward, backward, weight, self.messages)[1]

    def rank_bytes(self, split: Sequence[int]) -> list[float]:
        bounds = [0, *accumulate(split)]
        out = list(self.p.rank_bytes)
        for s in range(len(split)):
            out[self.rank_of[s]] += self.stage_bytes(s, bounds[s], bounds[s + 1])
        return out

    def fits(self, split: Sequence[int]) -> bool:
        budget = self.p.budget
        return budget is None or all(b <= cap for b, cap in zip(self.rank_bytes(split), budget))


# -- infeasible budgets ------------------------------------------------------------------------


class SplitInfeasible(ParameterError):
    """No split fits the memory budget. `overflow` is the least possible excess in bytes
    of the tightest rank, `split` a split that achieves it, `stage` / `rank` where.
    `by_ranks`: every stage fits alone, the totals of ranks with several stages do not."""

    def __init__(self, message: str, *, overflow: float, split, stage: int, rank: int, by_ranks: bool = False) -> None:
        super().__init__(message)
        self.overflow, self.split, self.stage, self.rank = overflow, tuple(split), stage, rank
        self.by_ranks = by_ranks


def least_overflow(ev: Evaluator):
    """A split minimising the largest excess of a rank over its budget: (split, excess,
    stage). Exact for one stage per rank (dynamic programming over stage boundaries) and
    for alike layers on any placement (bisection on the excess); otherwise the per-stage
    answer. Kept by the problem's bytes (`Evaluator.kept`)."""
    return ev.kept("least overflow", lambda: _least_overflow(ev))


def _least_overflow(ev: Evaluator):
    if ev.p.homogeneous and len(set(ev.rank_of)) < ev.p.num_stages:
        return least_overflow_alike(ev)
    L, S, p = ev.p.num_layers, ev.p.num_stages, ev.p
    best = [[math.inf] * (L + 1) for _ in range(S + 1)]
    back = [[0] * (L + 1) for _ in range(S + 1)]
    best[0][0] = -math.inf
    static, stash = ev.prefix["layer_static"], ev.prefix["layer_stash"]
    for s in range(S):
        cap, row, k = ev.cap[ev.rank_of[s]], best[s], ev.inflight[s]
        extra_static, extra_stash = p.stage_static[s], p.stage_stash[s]
        starts = [j for j in range(s, L + 1) if row[j] != math.inf]
        floor = list(accumulate((row[j] for j in reversed(starts)), min))[::-1]  # least row[j] from index i on
        for e in range(s + 1, L - (S - s - 1) + 1):
            def over(j, e=e, cap=cap, k=k, extra_static=extra_static, extra_stash=extra_stash):
                # the bytes of stage s over layers j..e-1, less its rank's budget: ev.stage_bytes term for term
                return (static[e] - static[j]) + extra_static + k * ((stash[e] - stash[j]) + extra_stash) - cap

            value, i = _least_end(row, starts, floor, bisect_left(starts, e), over)
            if i is not None and value < best[s + 1][e]:
                best[s + 1][e], back[s + 1][e] = value, starts[i]
    split, e = [], L
    for s in range(S, 0, -1):
        j = back[s][e]
        split.append(e - j)
        e = j
    return worst_rank(ev, tuple(reversed(split)))


def _least_end(row, starts, floor, n: int, over):
    """(least value, its first index i < n) of max(row[starts[i]], over(starts[i])), or
    (inf, None) where every value is inf: the scan of `least_overflow`, from where the two
    cross outwards. Exact, because `over` never grows with j (layer bytes are never
    negative, so the prefix sums and every rounded step after them are monotone) and
    `floor[i]` is the least row from index i on: leftwards each value is at least
    over(j), rightwards at least floor[i], so the scan stops once either passes the best
    found (where a tie cannot move the answer to an earlier index)."""
    lo, hi = 0, n  # the first index where the row's floor reaches over(j): both are monotone
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if floor[mid] >= over(starts[mid]) else (mid + 1, hi)
    least, found = math.inf, None
    for i in range(min(lo, n - 1), n):
        if floor[i] >= least:
            break
        value = max(row[starts[i]], over(starts[i]))
        if value < least:
            least, found = value, i
    for i in range(min(lo, n - 1) - 1, -1, -1):
        cost = over(starts[i])
        if cost > least:
            break
        value = max(row[starts[i]], cost)
        if value <= least:  # a tie: the earlier index, as a scan from the left keeps
            least, found = value, i
    return least, found


def worst_rank(ev: Evaluator, split: tuple):
    excess = [b - budget for b, budget in zip(ev.rank_bytes(split), ev.p.budget)]
    rank = max(range(len(excess)), key=lambda r: excess[r])
    stage = max(s for s in range(len(split)) if ev.rank_of[s] == rank)
    return split, excess[rank], stage


def least_overflow_alike(ev: Evaluator):
    """Alike layers: rank r holds A_r + sum over its stages of b_s * n_s; for an excess t
    each rank takes as many layers as fit (one per stage, the rest in its cheapest
    stage), and t is bisected until the ranks hold all L layers."""
    L, S, pp = ev.p.num_layers, ev.p.num_stages, len(ev.cap)
    per_layer = [ev.stage_bytes(s, 0, 1) - ev.stage_bytes(s, 0, 0) for s in range(S)]
    stages = [[s for s in range(S) if ev.rank_of[s] == r] for r in range(pp)]
    fixed = [ev.p.rank_bytes[r] + sum(ev.stage_bytes(s, 0, 1) for s in stages[r]) for r in range(pp)]

    def layout(t: float):
        split = [1] * S
        for r in range(pp):
            if not stages[r]:
                continue
            room = ev.p.budget[r] + t - fixed[r]
            cheap = min(stages[r], key=lambda s: per_layer[s])
            if room < 0:
                return None
            more = int(room // per_layer[cheap]) if per_layer[cheap] > 0 else L
            split[cheap] += min(more, L - S)
        return split if sum(split) >= L else None

    lo, hi = -max(ev.p.budget) - 1.0, sum(fixed) + L * max(per_layer) + 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if layout(mid) is not None else (mid, hi)
    split = layout(hi)
    excess = sum(split) - L
    while excess > 0:  # hand back layers from the rank that is most over
        over = [fixed[r] + sum(per_layer[s] * (split[s] - 1) for s in stages[r]) - ev.p.budget[r] for r in range(pp)]
        for s in sorted(range(S), key=lambda s: -over[ev.rank_of[s]]):
            if split[s] > 1:
                split[s] -= 1
                excess -= 1
                break
    return worst_rank(ev, tuple(split))


def raise_infeasible(ev: Evaluator, by_ranks: bool = False) -> None:
    split, overflow, stage = least_overflow(ev)
    rank = ev.rank_of[stage]
    where = f"rank {rank}" + (f" (stage {stage})" if ev.p.num_stages == len(ev.cap) else "")
    raise SplitInfeasible(
        f"no split of {ev.p.num_layers} layers over {ev.p.num_stages} stages fits the memory budget: the split "
        f"that overflows least, {list(split)}, still puts {where} over its budget of "
        f"{ev.p.budget[rank]:.0f} bytes by {overflow:.0f} bytes ({overflow / GiB:.2f} GiB)",
        overflow=overflow, split=split, stage=stage, rank=rank, by_ranks=by_ranks,
    )


__all__ = ["Evaluator", "SplitInfeasible", "SplitProblem", "least_overflow", "raise_infeasible", "stage_inflight"]
