"""Layer split: which decoder layers each pipeline stage runs.

- `nanotron_split(model, pp)` reproduces the split nanotron's `build_model` computes.
- `optimal_split(problem, schedule)` finds the contiguous split with the least simulated
  step time among those where every rank fits its memory budget; exact
  ([Note: exact split search]).

[Note: nanotron's split] `get_block_compute_costs` weighs each pipeline block: a decoder
layer 4*a*d*h + 3*f*h (the q/k/v/o and SwiGLU matmuls as if k/v had all a heads: GQA is
ignored), the LM head V*h, everything else (embedding, final norm, fp32 cast, loss) 0.
`build_model` takes the cumulative cost c_i of blocks 0..i and thresholds
T_s = total * (s + 1) / S for its S stages. Walking the blocks in order with a stage
index k starting at 0, block i goes to stage k, and then k += 1 if c_i > T_k (strictly).
So a stage keeps blocks until it has *passed* its share, which is why earlier stages
come out heavier (Llama3-70B at pp=4: 21, 20, 20, 19 layers, the embedding on stage 0,
the head on stage 3), and k moves at most one stage per block. Blocks of cost 0 after
the last costly block stay on its stage; if that block crosses T_k with k < S - 1, they
move to stage k + 1, alone. With a heavy LM head or few layers, trailing stages can stay
empty (pp=4, 3 layers, vocab 4096: every block on stages 0 and 1), and then a rank holds
no parameters at all (integration/nanotron/pipeline/split.py: `nanotron_output_pp_rank`).

[Note: exact split search] The simulated step time of a split is a max over the paths of
a fixed graph ([Note: critical path bound]), so every simulated split hands back its
critical path: a linear lower bound on the step time of EVERY split. The search is one
branch and bound over stage boundaries (where stage 0 ends, then stage 1, ...). Its cuts
(bounds): each rank's busy time (m * its F+B+W), the critical paths of the seeds
(nanotron's split, a balanced split) and, when a short first pass does not settle it,
those of probes (the schedule with one stage made heavier) and, for alike layers, of
Kelley's method on the relaxation to real layer counts ([Note: split relaxation],
split_relax.py), with the relaxation's combined cut. Every step time and chain comes
from the schedule's step graph ([Note: step graph]), equal to the simulator's. A node's
bound is the largest cut over the stages fixed so far plus a bound for the rest (alike
layers: the cheapest stages filled first, up to the per-stage caps the cuts and the
memory imply). A leaf that survives is simulated once and its critical path joins the
cuts. A leaf's value is its step time: the simulated pipeline plus the problem's tail
(the data-parallel reduction and the optimizer step after the pipeline, which grow with
a rank's parameters: the largest over ranks of each rank's). The cuts bound the
pipeline alone; a node adds the largest tail of the ranks whose stages it has all
chosen, which the step's tail cannot be below. When the search finishes, no split that
fits beats the best one: optimal for the simulator and the tail, not for a proxy. It
stops at `node_limit` nodes (0: at once, the seeds alone; the columns it builds and the
simulations it runs count as nodes too, `Search.work`) and then says so
(`proven=False`); a `cutoff` (the best time a planner already has) prunes harder. A
planner's searches share one budget of nodes ([Note: plan search budget] in
splits.py). Memory is exact: rank bytes are additive over a rank's stages and no split
that overflows is accepted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from pipeschedule.checks import check_int
from pipeschedule.errors import ParameterError
from pipeschedule.compiler.ir import Schedule
from pipeschedule.plan.memo import Memo
from pipeschedule.plan.memory import ModelSpec
from pipeschedule.plan.split_problem import (
    Evaluator,
    SplitInfeasible,
    SplitProblem,
    least_overflow,
    raise_infeasible,
    stage_inflight,
)
from pipeschedule.plan.step_graph import StepGraph
from pipeschedule.plan.split_search import Cut, Search, balanced_seed, boundary_tables, relax

# -- nanotron's split ------------------------------------------------------------------------


def nanotron_layer_cost(*, hidden: int, heads: int, ffn: int) -> int:
    """nanotron's `get_block_compute_costs` for one decoder layer: its matmul sizes, with
    k and v priced as full heads (GQA ignored)."""
    return 4 * heads * (hidden // heads) * hidden + 3 * ffn * hidden


def llama_block_costs(model: ModelSpec) -> list[int]:
    """nanotron's cost of each pipeline block of LlamaForTraining, in module order:
    embedding, decoder layers, final norm, LM head, fp32 cast, loss ([Note: nanotron's split])."""
    layer = nanotron_layer_cost(hidden=model.hidden, heads=model.heads, ffn=model.ffn)
    return [0] + [layer] * model.layers + [0, model.vocab * model.hidden, 0, 0]


def nanotron_assignment(block_costs: Sequence[float], pp: int) -> list[int]:
    """The pipeline rank nanotron's `build_model` gives each block."""
    if not block_costs:
        raise ParameterError("nanotron_assignment needs at least one block")
    cumulative = list(accumulate(block_costs))
    thresholds = [cumulative[-1] * ((rank + 1) / pp) for rank in range(pp)]
    rank, out = 0, []
    for cost in cumulative:
        out.append(rank)
        if cost > thresholds[rank]:
            rank += 1
    return out


def nanotron_split(model: ModelSpec, pp: int) -> tuple[int, ...]:
    """Decoder layers per stage under nanotron's split. A stage may hold none where a
    block of its own still runs there (the LM head alone on the last stage, say: nanotron
    trains that, integration/nanotron/example.py's README config at pp=4 with 4 layers is
    one). Raises ParameterError where the LM head lands before the last stage: the ranks
    after it would hold nothing, no pipeline of `pp` working stages."""
    check_int("pp", pp)
    layers, head = nanotron_stages(model, pp)
    if not _working(layers, head):
        below = next(q for q in range(min(pp, model.layers), 0, -1) if _working(*nanotron_stages(model, q)))
        raise ParameterError(
            f"nanotron's split of {model.name} ({model.layers} layers) at pp={pp} gives layers {layers} "
            f"with the LM head on stage {head}: the stages after it hold nothing, and the plan starts from "
            f"nanotron's own 1F1B; the largest pp up to {pp} where its split works for this model is {below}"
        )
    return tuple(layers)


def nanotron_stages(model: ModelSpec, pp: int) -> tuple[list[int], int]:
    """(decoder layers per stage, the LM head's stage) under nanotron's split."""
    ranks = nanotron_assignment(llama_block_costs(model), pp)
    layers = [0] * pp
    for rank in ranks[1:1 + model.layers]:
        layers[rank] += 1
    return layers, ranks[1 + model.layers + 1]


def _working(layers: list[int], head: int) -> bool:
    """The LM head is on the last stage. (nanotron's walk moves at most one stage per
    block, so every stage before the head's holds a block: a decoder layer, or the final
    norm alone.)"""
    return head == len(layers) - 1


# -- the exact search ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SplitResult:
    """The best split found: layers per stage and its simulated step time.

    proven: the search finished, so no fitting split is faster than `step_time` (or,
    when `step_time >= cutoff`, none is faster than `cutoff`). lower_bound: where it did
    not finish, a time no fitting split beats (`Search.lower_bound`; None when it stopped
    before its first choice). simulations / cuts / nodes: the work done ([Note: exact
    split search]; nodes: `Search.work`, columns built and simulations counted as nodes).
    """

    split: tuple[int, ...]
    step_time: float
    proven: bool
    simulations: int
    cuts: int
    nodes: int
    cutoff: float = math.inf
    lower_bound: float | None = None  # not proven: no split that fits is faster than this (None: unknown)


def optimal_split(problem: SplitProblem, schedule: Schedule, *, seeds: Sequence[Sequence[int]] = (),
                  node_limit: int = 200_000, cutoff: float = math.inf, graph: StepGraph | None = None,
                  inflight: Sequence[int] | None = None, memo: Memo | None = None) -> SplitResult:
    """The split with the least simulated step time among those that fit
    ([Note: exact split search]). `seeds`: splits to try first (for example nanotron's).
    `cutoff`: only splits faster than this are of interest (a planner passes the best
    time it already has), which prunes harder. Raises SplitInfeasible when none fits. If
    the search visits more than `node_limit` nodes it stops with the best split found and
    `proven=False`. `graph`, `inflight`: the schedule's StepGraph and `stage_inflight`
    when the caller has them; `memo`: where searches of this schedule keep their memory
    tables ([Note: run-wide memos] in memo.py).
    """
    ev = Evaluator(problem, schedule, graph, inflight, memo)
    L, S, m = problem.num_layers, problem.num_stages, schedule.microbatches
    maxe, feasible = boundary_tables(ev)
    if not feasible[0][0]:
        raise_infeasible(ev)
    if problem.budget is not None and ev.homogeneous and len(set(ev.rank_of)) < S and least_overflow(ev)[1] > 1.0:
        # Ranks of several stages whose stages fit alone but not together (a V shape): for
        # alike layers least_overflow is exact, so no split fits and no search finds one.
        raise_infeasible(ev, by_ranks=True)
    search = Search(ev, maxe, feasible, node_limit)
    search.best_time = cutoff
    for r in range(schedule.pp):  # each rank's busy time
        mine = [m if ev.rank_of[s] == r else 0 for s in range(S)]
        search.add_cut(Cut(ev, mine, mine, mine, 0.0))
    candidates = [tuple(s) for s in seeds]
    seed = balanced_seed(ev, maxe, feasible)
    if seed is not None:
        candidates.append(seed)
    for split in candidates:
        if len(split) == S and sum(split) == L and min(split) >= 1 and ev.fits(split):
            search.evaluate(split)
    search.seeded = ev.simulations  # what the search does from here counts as its work
    # A first, short search with the cuts at hand often settles it; if not, probes: the
    # schedule with one stage made heavier yields the chain through that stage's busy
    # period (a chain is a valid cut whatever costs found it), then for alike layers the
    # relaxation's chains and combined cut, and the search goes on.
    search.node_limit = min(node_limit, 500)
    proven = search.run() if node_limit > 0 else False  # 0: a budget with nothing left (planner.SearchBudget)
    if not proven and node_limit > search.node_limit and search.work < node_limit:
        search.node_limit = node_limit
        base = ev.costs(search.fallback[0] or tuple([L // S] * (S - 1) + [L - (L // S) * (S - 1)]))
        for heavy in range(S):
            forward, backward, weight = ([c * (1.5 if t == heavy else 1.0) for t, c in enumerate(k)] for k in base)
            search.add_path(ev.probe(forward, backward, weight))
        if problem.homogeneous:  # [Note: split relaxation]
            relax(search, rounds=2 * S + 10)
        proven = search.run()
    work = search.work  # the search's own: the row's split below is simulated whatever it did
    split, time = (search.best_split, search.best_time) if search.best_split else search.fallback
    if split is None:  # nothing simulated: no seed fitted and the search found no leaf
        if proven and cutoff < math.inf:
            split = balanced_seed(ev, maxe, feasible) or least_overflow(ev)[0]
            time = ev.step_time(split)[0]
        elif proven:
            raise_infeasible(ev)
        else:  # stopped before its first leaf: no proof that nothing fits; the split that overflows least
            split = least_overflow(ev)[0]
            time = ev.step_time(split)[0]
    return SplitResult(split, time, proven, ev.simulations, len(search.cuts), work, cutoff,
                       None if proven else search.lower_bound())


__all__ = [
    "SplitInfeasible", "SplitProblem", "SplitResult", "llama_block_costs", "nanotron_assignment",
    "nanotron_split", "nanotron_stages", "optimal_split", "stage_inflight",
]
