"""The planner: which schedule, in-flight cap and layer split fit a GPU, and how fast.

`plan(config)` evaluates nanotron's default (1F1B with nanotron's split) and the
alternatives: 1F1B, capped 1F1B at every cap 1..pp-1, interleaved 1F1B (at the chunk
counts of [Note: virtual counts]) uncapped and capped, the split-backward schedules
(ZB-H1; ZB-V, V-Half and V-Min with their V-shape placement, two stages per rank, when
every stage gets a layer) and AFAB, each with nanotron's split and with the split `partition.optimal_split`
finds for it. Every candidate gets a per-rank memory table (memory.py: a rank's
activations are the simulated peak of its stages' stash together, which lives from F to
W under a split backward), a simulated step time (pipeschedule.simulate) and the nanotron config
line that selects it. Step times and peaks come from each schedule's step graph and
program order ([Note: step graph], [Note: peaks from program order]), built once per
schedule and equal to what `simulate` gives. The rows that do not fit get partial
recompute and host offload fitted where that could beat the fastest fit
(plan/fitting.py). The recommendation is the candidate that fits with the least
simulated step time, host offload only over a link trusted for it ([Note: offload
advice] in config.py: otherwise the fastest offload is `offload_option`).

Costs follow [Note: compute costs] and the config, candidates and their nanotron config
lines live in config.py and candidate.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from pipeschedule.checks import PLAN_SEARCH_WORK
from pipeschedule.errors import ParameterError
from pipeschedule.compiler.families import FAMILIES, generate
from pipeschedule.compiler.gcpause import gc_paused
from pipeschedule.plan.memory import (
    GiB,
    boundary_bytes,
    head_stash,
    layer_activation_bytes,
    stage_footprints,
    shared_params,
    stage_params,
    static_per_param,
    transient_per_param,
    weight_stash_bytes,
    weight_stash_layer,
)
from pipeschedule.plan.partition import (
    SplitInfeasible,
    SplitProblem,
    nanotron_split,
    optimal_split,
    stage_inflight,
)
from pipeschedule.compiler.ir import Schedule
from pipeschedule.compiler.offload_spec import AutoOffload
from pipeschedule.compiler.passes import lower
from pipeschedule.plan.candidate import Candidate, cap_label, fitted_caps
from pipeschedule.plan.dp_step import rank_tail, step_tail
from pipeschedule.plan.config import PlanConfig, build_config, head_seconds, layer_seconds, weight_seconds
from pipeschedule.plan.memory import p2p_buffers, rank_memory, stash_buffers
from pipeschedule.plan.report import plan_to_dict, plan_to_text
from pipeschedule.plan.fitting import OffloadCandidate, lever_rows, offloaded, virtual_tried
from pipeschedule.plan.peaks import Peaks
from pipeschedule.plan.memo import Memo
from pipeschedule.plan.step_graph import MEMO_CELLS, StepGraph
from pipeschedule.simulate import CostModel, simulate
from pipeschedule.simulate.offload_search import choose_offload, evaluate_offload


class ScheduleCache:
    """What depends on the schedule alone, for one (pp, microbatches), by (family, cap,
    virtual): the lowered schedules, their step graphs and peaks ([Note: step graph],
    [Note: peaks from program order]) and each stage's most microbatches in flight. The
    plans of a lever search differ in their setup only, so they share one
    (`plan(..., schedules=)`): a third of the work for the three recompute modes. The
    graphs, peaks and split searches also keep what they computed, by its arguments
    ([Note: run-wide memos] in memo.py)."""

    def __init__(self, pp: int, microbatches: int) -> None:
        self.pp, self.microbatches = pp, microbatches
        self.schedules: dict = {}
        self.graphs: dict = {}
        self.inflights: dict = {}
        self.tables: dict = {}  # per schedule: the split searches' memory tables
        # the offload lever's simulations (fitting.offloaded), by schedule, policy and costs:
        # the planner's own costs, floats; a few numbers per rank kept for each
        self.offload_memo = Memo(MEMO_CELLS, lambda key, value: 16 * len(key[2].forward) + 3 * self.pp + 1)

    def memo(self, key: tuple) -> Memo:
        """Where the split searches of a schedule keep their memory tables."""
        if key not in self.tables:
            self.tables[key] = Memo(MEMO_CELLS, _table_cells)
        return self.tables[key]

    def schedule(self, key: tuple):
        if key not in self.schedules:
            family, cap, virtual = key
            self.schedules[key] = lower(generate(family, pp=self.pp, microbatches=self.microbatches,
                                                 virtual=virtual, cap=cap))
        return self.schedules[key]

    def graph(self, key: tuple) -> tuple[StepGraph, Peaks]:
        if key not in self.graphs:
            schedule = self.schedule(key)
            self.graphs[key] = (StepGraph(schedule), Peaks(schedule))
        return self.graphs[key]

    def inflight(self, key: tuple) -> tuple[int, ...]:
        if key not in self.inflights:
            self.inflights[key] = stage_inflight(self.schedule(key))
        return self.inflights[key]


def _table_cells(key: tuple, value) -> int:
    """The numbers of a memory table kept (split_problem.Evaluator.kept): its key's
    tuples and the value's lists (or the least overflow's split)."""
    cells = sum(len(part) for part in key[1:] if part is not None)
    if isinstance(value[0], list):  # the boundary tables: two tables of stages x boundaries
        return cells + sum(len(row) for table in value for row in table)
    return cells + len(value[0]) + 2


class SearchBudget:
    """[Note: plan search budget] The split searches of one `pipeschedule plan` run (every
    candidate, recompute mode, ZeRO stage and dp size) share one budget of search nodes,
    so that the run's work is bounded whatever --node-limit, --virtual and --dp ask, and
    the same input gets the same answer on any machine (nodes, not seconds). A node scans
    up to one boundary per layer, each against cuts that grow with the stages, so the
    budget is PLAN_SEARCH_WORK (checks.py, measured: benchmarks/results/limits.md) over
    the model's layers times pp; building one cut's columns for a run counts as the nodes
    that scan as many numbers (`Search.column_work`: stages / pp, rounded up), and a
    simulation the search adds (a leaf, a probe) as the nodes that scan as many as its
    walk of the step graph (`Search.simulation_work`), so a search the budget leaves a few
    nodes does not build columns or run simulations it cannot use. A search may take up to its
    node limit (`PlanConfig.node_limit`) while what remains keeps `floor` nodes for each
    search still to come (the rest of this plan's candidates, and as many for each plan
    after it); `floor` is a quarter of the budget over the searches the run expects at its first
    search. A search the budget stops early is a "best found" row like one stopped at its
    node limit (not proven optimal; its note says the budget stopped it). Where no search
    reaches its share the answers are those without a budget. A search visits at most
    its limit plus the one node that finds it reached, which the share leaves room for,
    so `used` stays within `total`."""

    def __init__(self, config: PlanConfig, plans: int = 1, total: int | None = None) -> None:
        """`plans`: how many plans of `config`'s layers and pp share it; `total`: the nodes
        (None: PLAN_SEARCH_WORK // (layers * pp))."""
        self.total = PLAN_SEARCH_WORK // (config.model.layers * config.pp) if total is None else total
        self.used, self.plans_left = 0, plans
        self.floor: int | None = None

    def allowance(self, node_limit: int, left_here: int, per_plan: int) -> int:
        """Nodes the next search may visit: `left_here` searches (this one included) are
        still to come in this plan, `per_plan` in each plan after it."""
        left = max(1, left_here) + (self.plans_left - 1) * per_plan
        if self.floor is None:
            self.floor = self.total // (4 * left)
        room = self.total - self.used - self.floor * (left - 1) - 1
        return max(0, min(node_limit, room))

    def spend(self, nodes: int) -> None:
        self.used += nodes

    def plan_done(self) -> None:
        self.plans_left = max(1, self.plans_left - 1)


class _Planner:
    """Evaluates candidates of one config, caching schedules (in `schedules`, which
    plans of the same pp and microbatches may share) and simulations."""

    def __init__(self, config: PlanConfig, schedules: ScheduleCache | None = None,
                 budget: SearchBudget | None = None) -> None:
        self.config = config
        self.budget = budget if budget is not None else SearchBudget(config)
        if schedules is None:
            schedules = ScheduleCache(config.pp, config.microbatches)
        elif (schedules.pp, schedules.microbatches) != (config.pp, config.microbatches):
            raise ParameterError(f"a schedule cache of pp={schedules.pp}, {schedules.microbatches} microbatches "
                                 f"cannot serve a plan of pp={config.pp}, {config.microbatches} microbatches")
        self.cache = schedules
        self.used: set = set()  # the (family, cap, virtual) this plan asked for
        self.layer = layer_seconds(config)
        self.head = head_seconds(config)
        self.weight = weight_seconds(config)  # (layer, head): W of split-backward schedules
        self.boundary = boundary_bytes(config.model, config.setup)
        self.rank_tails: dict = {}  # `rank_tail`'s seconds by what decides them
        self.stats = {"evaluations": 0, "simulations": 0, "searches": 0, "proven": 0, "search_nodes": 0,
                      "search_simulations": 0}

    @staticmethod
    def _key(family: str, cap, virtual: int) -> tuple:
        return family, tuple(cap) if isinstance(cap, list) else cap, virtual

    def graph(self, family: str, cap, virtual: int) -> tuple[StepGraph, Peaks]:
        """The schedule's step graph and peaks ([Note: step graph], [Note: peaks from
        program order]): its simulated step times, chains and peaks under any costs."""
        key = self._key(family, cap, virtual)
        self.used.add(key)
        return self.cache.graph(key)

    def step(self, family: str, cap, virtual: int, cost: CostModel) -> float:
        """simulate(schedule, cost).step_time, from the step graph."""
        graph = self.graph(family, cap, virtual)[0]
        msgs = graph.message_times(cost.buffer_bytes["act_out"], cost.buffer_bytes["grad_in"], cost.latency,
                                   cost.bandwidth)
        return graph.step(cost.forward, cost.backward, cost.weight, msgs)[0]

    def peaks(self, family: str, cap, virtual: int, cost: CostModel) -> tuple[tuple, tuple]:
        """(peak_bytes, peak_inflight) of simulate(schedule, cost), from program order
        (counted as the simulation it stands for; `step` of the same cost is not counted again)."""
        self.stats["simulations"] += 1
        return self.graph(family, cap, virtual)[1].of(cost)

    def schedule(self, family: str, cap, virtual: int):
        key = self._key(family, cap, virtual)
        self.used.add(key)
        return self.cache.schedule(key)

    def compute_costs(self, split_backward: bool):
        """((layer F, B, W), (head F, B, W)) seconds; W is 0 unless the backward is split."""
        (f, b), (hf, hb) = self.layer, self.head
        if not split_backward:
            return (f, b, 0.0), (hf, hb, 0.0)
        w, hw = self.weight
        return (f, b - w, w), (hf, hb - hw, hw)

    def stage_seconds(self, costs, layers: int, head: bool, recomputed: int = 0) -> tuple[float, float, float]:
        """(F, B, W) seconds of one microbatch through a stage of `layers` layers (with the
        LM head and loss when `head`), `recomputed` of them rerunning their forward in B;
        costs: `compute_costs`. What `cost` and the tails time a stage by."""
        (f, b, w), (hf, hb, hw) = costs
        return (layers * f + (hf if head else 0),
                layers * b + recomputed * (self.layer[0] + w) + (hb if head else 0),
                (layers - recomputed) * w + (hw if head else 0))

    def cost(self, split: Sequence[int], buffers=None, split_backward: bool = False,
             recomputed: Sequence[int] | None = None) -> CostModel:
        """Per-stage costs; recomputed[s] layers of stage s rerun their forward in B (and,
        under a split backward, compute their weight gradients there: W has none of them)."""
        costs, last = self.compute_costs(split_backward), len(split) - 1
        r = recomputed or (0,) * len(split)
        forward, backward, weight = zip(*(self.stage_seconds(costs, n, s == last, r[s]) for s, n in enumerate(split)))
        bytes_ = buffers or {"act_out": (self.boundary,) * len(split), "grad_in": (self.boundary,) * len(split)}
        return CostModel(forward, backward, weight, bytes_,
                         latency=self.config.p2p_latency, bandwidth=self.config.p2p_bandwidth)

    def evaluate(self, family: str, cap, virtual: int, split: Sequence[int], kind: str, proven=None,
                 recomputed: Sequence[int] | None = None) -> Candidate:
        """One candidate's memory table and step time; recomputed: layers per stage that
        recompute on top of the setup's mode ([Note: partial recompute])."""
        config = self.config
        self.stats["evaluations"] += 1
        schedule = self.schedule(family, cap, virtual)
        footprints = stage_footprints(config.model, config.setup, split, recomputed)
        sb = schedule.split_backward
        stash_cost = self.cost(split, stash_buffers(footprints), sb, recomputed)
        if sb:
            kept = tuple(weight_stash_bytes(config.model, config.setup, fp.layers, last=fp.last,
                                            recomputed=fp.recomputed) for fp in footprints)
            stash_cost = replace(stash_cost, weight_stash=kept)
        peak_stash, peak_inflight = self.peaks(family, cap, virtual, stash_cost)
        # Messages are timed from act_out and grad_in, which p2p_buffers sets to the boundary
        # as the timing cost does: this cost is also the step's timing.
        p2p_cost = self.cost(split, p2p_buffers(footprints), sb, recomputed)
        peak_p2p = self.peaks(family, cap, virtual, p2p_cost)[0]
        pipeline = self.step(family, cap, virtual, p2p_cost)
        backward_end = None  # [Note: memory terms]: where nanotron's engines hold every bf16 gradient
        if transient_per_param(config.setup):
            backward_end = self.graph(family, cap, virtual)[1].at_backward_ends(stash_cost)
        memory = rank_memory(footprints, schedule.placement, peak_stash=peak_stash, peak_p2p=peak_p2p,
                             peak_inflight=peak_inflight, budget=config.budget, setup=config.setup,
                             shared=self.shared(schedule), peak_backward_end=backward_end)
        tail, parts = self.tail(schedule, split, recomputed)
        step = pipeline + tail
        return Candidate(family, cap_label(cap), virtual, tuple(split), kind, step,
                         config.tokens_per_gpu / step, tuple(memory), proven, pipeline_time=pipeline,
                         tail=parts, recompute=config.setup.recompute,
                         recomputed=tuple(recomputed) if recomputed and any(recomputed) else None)

    def tail(self, schedule: Schedule, split: Sequence[int],
             recomputed: Sequence[int] | None = None) -> tuple[float, dict]:
        """(seconds, the slowest rank's parts) after the pipeline of `split` under
        `schedule` ([Note: step tail]): what `evaluate` adds to the pipeline. The split
        search adds the same per rank (`rank_tail`, to rounding)."""
        config, last = self.config, len(split) - 1
        costs = self.compute_costs(schedule.split_backward)
        r = recomputed or (0,) * len(split)
        params = [stage_params(config.model, n, first=s == 0, last=s == last, tp=config.setup.tp)
                  for s, n in enumerate(split)]
        backward = [b + w for _, b, w in (self.stage_seconds(costs, n, s == last, r[s]) for s, n in enumerate(split))]
        return step_tail(config.setup, params, schedule.placement, backward, shared=self.shared(schedule),
                         dp_bandwidth=config.dp_bandwidth, hbm_bandwidth=config.hbm_bandwidth)

    def shared(self, schedule: Schedule) -> tuple[int, ...]:
        """Per rank, parameters its stages count twice (memory.shared_params)."""
        return shared_params(self.config.model, schedule.placement, self.config.setup.tp)

    def rank_tails_of(self, schedule: Schedule) -> list:
        """Per rank of `schedule`, the seconds of its tail as a function of the decoder
        layers its stages hold together, none recomputed (the split problem's
        `rank_tail`): `tail`'s terms for one rank, its stages' layers timed as one count
        (equal to `tail`'s to rounding). What decides it (the split backward, whether the
        rank holds the first and the last stage, the parameters it holds once: `shared`)
        is worked out once per rank, and the seconds are cached by it and the count, so a
        split search's thousands of calls are lookups."""
        last, shared = schedule.num_stages - 1, self.shared(schedule)
        out = []
        for rank in range(schedule.pp):
            stages = tuple(s for s, p in enumerate(schedule.placement) if p == rank)
            decided = (schedule.split_backward, 0 in stages, last in stages, shared[rank])
            out.append(lambda layers, stages=stages, decided=decided: self._rank_tail(stages, decided, layers))
        return out

    def _rank_tail(self, stages: tuple, decided: tuple, layers: int) -> float:
        key = (layers, *decided)
        if key not in self.rank_tails:
            config, (split_backward, _, holds_last, shared) = self.config, decided
            model, tp = config.model, config.setup.tp
            last = max(stages) if holds_last else -1
            params = (layers * model.layer_params(tp) - shared
                      + sum(stage_params(model, 0, first=s == 0, last=s == last, tp=tp) for s in stages))
            _, b, w = self.stage_seconds(self.compute_costs(split_backward), layers, holds_last)
            parts = rank_tail(config.setup, params, b + w, dp_bandwidth=config.dp_bandwidth,
                              hbm_bandwidth=config.hbm_bandwidth)
            self.rank_tails[key] = sum(parts.values())
        return self.rank_tails[key]

    def problem(self, family: str, cap, virtual: int) -> SplitProblem:
        """The split problem of `optimal_split` with this planner's costs and memory."""
        config, model, setup = self.config, self.config.model, self.config.setup
        schedule = self.schedule(family, cap, virtual)
        S, L = schedule.num_stages, model.layers
        per_param = sum(static_per_param(setup).values()) + transient_per_param(setup)
        (f, b, w), (hf, hb, hw) = self.compute_costs(schedule.split_backward)
        head = float(sum(head_stash(model, setup).values()))
        layer_stash = float(layer_activation_bytes(model, setup))
        if schedule.split_backward and setup.recompute != "full":
            layer_stash = max(layer_stash, float(weight_stash_layer(model, setup)))  # a bound: W may keep more
        # a stage's own parameters beside its layers: the embedding on the first, the head on the last
        static = [per_param * stage_params(model, 0, first=s == 0, last=s == S - 1, tp=setup.tp) for s in range(S)]
        static[-1] -= per_param * self.shared(schedule)[schedule.placement[-1]]  # a tied head on stage 0's rank
        probe = stage_footprints(model, setup, [1] * S)  # split-free parts: boundaries, working sets
        p2p = self.peaks(family, cap, virtual, self.cost([1] * S, p2p_buffers(probe), schedule.split_backward))[0]
        working = [0.0] * schedule.pp  # with one parameter's gradient beside it, as rank_memory adds them
        one_grad = [0] * schedule.pp
        for s, fp in enumerate(probe):
            r = schedule.placement[s]
            working[r] = max(working[r], fp.working[1])
            one_grad[r] = max(one_grad[r], fp.one_grad)
        working = [w + g for w, g in zip(working, one_grad)]
        tails = self.rank_tails_of(schedule)
        return SplitProblem(
            layer_forward=(f,) * L, layer_backward=(b,) * L, layer_weight=(w,) * L,
            stage_forward=(0.0,) * (S - 1) + (hf,), stage_backward=(0.0,) * (S - 1) + (hb,),
            stage_weight=(0.0,) * (S - 1) + (hw,),
            layer_static=(per_param * model.layer_params(setup.tp),) * L,
            layer_stash=(layer_stash,) * L,
            stage_static=tuple(static), stage_stash=(0.0,) * (S - 1) + (head,),
            rank_bytes=tuple(p + w for p, w in zip(p2p, working)),
            budget=(config.budget,) * schedule.pp, boundary=(float(self.boundary),) * S,
            latency=config.p2p_latency, bandwidth=config.p2p_bandwidth,
            rank_tail=lambda rank, layers: tails[rank](layers),
        )

    def optimise(self, family: str, cap, virtual: int, seeds, cutoff: float,
                 left: tuple[int, int] = (1, 1)) -> Candidate:
        """The split search of one candidate; `left`: (searches still to come in this
        plan, this one included; searches per plan after it), for the budget's share."""
        schedule = self.schedule(family, cap, virtual)
        self.stats["searches"] += 1
        limit = self.budget.allowance(self.config.node_limit, *left)
        try:
            found = optimal_split(self.problem(family, cap, virtual), schedule, seeds=seeds,
                                  node_limit=limit, cutoff=cutoff,
                                  graph=self.graph(family, cap, virtual)[0],
                                  inflight=self.cache.inflight(self._key(family, cap, virtual)),
                                  memo=self.cache.memo(self._key(family, cap, virtual)))
        except SplitInfeasible as err:
            if err.overflow <= 0:  # the per-stage bound refused, the rank totals fit: evaluate it
                row = self.evaluate(family, cap, virtual, err.split, "best found")
                return replace(row, note="the search's per-stage bound admits no split; this one fits its rank totals")
            self.stats["proven"] += 1
            if err.by_ranks and cutoff < math.inf:
                # The split problem's bytes are bounds: with a time to beat, the search shows the
                # split that overflows them least, as it did when it ran out of splits.
                row = self.evaluate(family, cap, virtual, err.split, "no better", True)
                if row.fits:
                    if row.step_time >= cutoff:
                        return replace(row, note="no split of this schedule beats the best candidate before it")
                    return replace(row, split_kind="optimal")
            return Candidate(family, cap_label(cap), virtual, err.split, "least overflow",
                             note=f"no split fits: the best still overflows rank {err.rank} "
                                  f"by {err.overflow / GiB:.1f} GiB")
        self.budget.spend(found.nodes)
        self.stats["proven"] += found.proven
        self.stats["search_nodes"] += found.nodes
        self.stats["search_simulations"] += found.simulations
        if found.proven and found.step_time >= cutoff:
            kind, note = "no better", "no split of this schedule beats the best candidate before it"
        elif found.proven:
            kind, note = "optimal", ""
        else:
            kind, note = "best found", f"best split found in {found.nodes} search nodes (not proven optimal)"
            if limit < self.config.node_limit:  # [Note: plan search budget]
                note = note[:-1] + (f"; the plan's budget of {self.budget.total} search nodes in all left it "
                                    f"{limit} of its {self.config.node_limit})")
            if found.lower_bound is not None:
                note = note[:-1] + f"; no split of this schedule is faster than {found.lower_bound:.3f} s)"
        return replace(self.evaluate(family, cap, virtual, found.split, kind, found.proven), note=note,
                       lower_bound=None if found.proven else found.lower_bound)


# -- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """The evaluated candidates of a config; `default` is nanotron's 1F1B with its own
    split, `recommended` the fitting candidate with the least step time (None: nothing
    fits), offload only where its link is trusted ([Note: offload advice])."""

    config: PlanConfig
    default: Candidate
    candidates: tuple[Candidate, ...]
    recommended: Candidate | None
    zero1_default: Candidate | None = None  # nanotron's default again with ZeRO-1, when dp > 1 without it
    stats: dict = field(default_factory=dict, compare=False)  # work done: simulations, searches, nodes
    offload: dict | None = field(default=None, compare=False)  # what offload adds to `recommended` (config.offload)
    dropped: tuple = ()  # (family, why) not listed: the engines cannot run them under this config
    # The fastest candidate that fits only with host offload over a link not trusted for a
    # recommendation ([Note: offload advice]), where it beats `recommended`; else None.
    offload_option: Candidate | None = None

    def to_dict(self) -> dict:
        return plan_to_dict(self)

    def to_text(self, tables: str = "all") -> str:
        return plan_to_text(self, tables=tables)


# The order the alternatives are tried in: the fastest-looking first, so that the best
# time so far prunes the split searches of the slower ones (and among equally fast ones
# that fit, the earliest, the simplest change, is recommended). Split backward comes
# early: it is often the fastest. Then every family's caps, then the slow ones. A family
# of FAMILIES named in neither list is tried after FAST.
FAST = ("1f1b", "zb_h1", "zbv", "v_half", "interleaved_1f1b")
SLOW = ("v_min", "looped_bfs", "afab")  # v_min: the least memory, looped_bfs the most; rarely the fastest
SEARCHED = "searched"  # tried at caps of its own: searched_caps
SEARCHED_PLAN_PAIRS = 2**11  # (stage, microbatch) pairs of the capped `searched` schedules of one plan run


def _families(config: PlanConfig, planner: _Planner, virtuals: tuple[int, ...]):
    """(family, cap, virtual) of every alternative, in the order of FAST and SLOW, each
    as its `Family` record says: at its own chunks per rank (each count of `virtuals`,
    `fitting.virtual_tried`'s, where it takes any), where every stage gets a decoder layer;
    uncapped, except a family with a default cap (its uncapped form is 1F1B), which is
    tried at every cap below pp; `searched` at `searched_caps`; the caps of the
    others that take one and do not split the backward, in stage-microbatches below their
    uncapped peak (at the fewest chunks per rank only)."""
    pp, L = config.pp, config.model.layers
    usable = {}
    for name, f in FAMILIES.items():
        vs = virtuals if f.takes_virtual else (f.chunks(),)
        vs = tuple(v for v in vs if not (pp == 1 and (v > 1 or f.split_backward)) and L >= pp * v)
        if not vs:
            continue  # the same as another candidate, nothing to gain at pp=1, or a stage without a layer
        if f.split_backward and config.setup.tp_async and config.setup.tp > 1:
            continue  # [Note: dropped candidates]
        usable[name] = (f, vs)
    order = [n for n in FAST if n in usable] + [n for n in usable if n not in FAST and n not in SLOW]
    out = [(name, None, v) for name in order if usable[name][0].default_cap is None and name != SEARCHED
           for v in usable[name][1]]
    for name in order:
        f, vs = usable[name]
        if f.default_cap is not None:
            out += [(name, c, v) for v in vs for c in range(pp - 1, 0, -1)]
        elif name == SEARCHED:
            out += [(name, c, v) for v in vs for c in searched_caps(pp, config.microbatches)]
    for name in order:
        f, vs = usable[name]
        if f.takes_cap and f.default_cap is None and not f.split_backward:
            # Caps in stage-microbatches: v*k holds about as much as k microbatches of 1F1B.
            # Past pp=8 a spread of k is tried rather than every one.
            ks = range(1, pp) if pp <= 8 else sorted({1, 2, 3, 4, pp // 4, pp // 2, 3 * pp // 4, pp - 1})
            for v in vs[:1]:  # [Note: virtual counts]: caps at the fewest chunks only
                schedule = planner.schedule(name, None, v)
                peak = max(planner.peaks(name, None, v, CostModel.default(schedule))[1])
                out += [(name, v * k, v) for k in sorted(ks, reverse=True) if v * k < peak]
    out += [(name, None, v) for name in SLOW if name in usable for v in usable[name][1]]
    return out


def searched_caps(pp: int, microbatches: int) -> list[int]:
    """[Note: searched candidates] The caps below pp at which the planner tries `searched`,
    beside capped_1f1b at each (uncapped, under the unit costs the planner generates its
    schedules with, the search keeps zb_h1's order, already a candidate). Each is a search
    of its own (seeds, annealing: up to about 0.5 s at the plan's largest sizes, shared by
    the run's plans like every schedule), and each adds a candidate to every plan, so a
    run searches at most SEARCHED_PLAN_PAIRS (stage, microbatch) pairs in all: every cap
    where that allows, else as many as it allows, evenly spread: k of them at pp * i / (k
    + 1) rounded, i = 1..k (one: pp / 2, about capped_1f1b's default; none where pp * m
    alone is more).
    benchmarks/limits.py times the largest plans with them."""
    count, caps = min(pp - 1, SEARCHED_PLAN_PAIRS // (pp * microbatches)), pp - 1
    if count <= 0:
        return []
    if count == caps:
        return list(range(caps, 0, -1))
    return sorted({max(1, min(caps, round((k + 1) * pp / (count + 1)))) for k in range(count)}, reverse=True)


def dropped(config: PlanConfig) -> tuple[tuple[str, str], ...]:
    """[Note: dropped candidates] (family, why) of the families the planner does not list
    because the engines cannot run them as planned under this config: with
    `tp_linear_async_communication: true` at tp > 1 nanotron's linears are autograd
    functions that compute the weight gradient inside their own backward
    (nanotron/parallel/tensor_parallel/functional.py:119-160, 362-400), so a split backward
    defers nothing and W is empty: zb_h1 and the V shapes would run as their 1F1B-like
    order with B = the whole backward."""
    if not (config.setup.tp_async and config.setup.tp > 1):
        return ()
    why = ("tp_linear_async_communication: true: nanotron's async TP linears compute weight gradients "
           "in their own backward, so the split backward defers nothing")
    return tuple((name, why) for name, f in FAMILIES.items() if f.split_backward)


@gc_paused  # thousands of cuts, columns and graphs, none in a cycle (compiler/gcpause.py)
def plan(config: PlanConfig | None = None, *, schedules: ScheduleCache | None = None,
         budget: SearchBudget | None = None, **options) -> Plan:
    """Evaluate nanotron's default and every alternative; see the module docstring.

    Give a PlanConfig, or the command line's options as keywords (`config.build_config`):
    `plan(model="llama3-70b", pp=4, tp=4, dp=2, microbatches=16, recompute="full")`.
    `schedules`: a ScheduleCache of the same pp and microbatches to take schedules from
    and add to (plans of other setups share them). `budget`: the search nodes this plan
    shares with the plans after it ([Note: plan search budget]; None: a budget of its own).
    """
    if config is None:
        config = build_config(options.pop("model"), **options) if "model" in options else build_config(None, **options)
    elif options:
        raise ParameterError(f"give a PlanConfig or keyword options, not both (got {sorted(options)})")
    planner = _Planner(config, schedules, budget)
    base_split = nanotron_split(config.model, config.pp)
    default = nanotron_default(config, planner.cache, base_split)
    planner.used.add(planner._key("1f1b", None, 1))
    # pipeschedule's 1F1B with nanotron's split: the default's schedule, ours where it folds gradients
    # differently ([Note: memory terms]); the same row where the fold changes nothing
    ours_1f1b = planner.evaluate("1f1b", None, 1, base_split, "nanotron")
    if ours_1f1b.memory == default.memory:
        ours_1f1b = default
    rows = _Rows([default] if ours_1f1b is default else [default, ours_1f1b],
                 default.step_time if default.fits else math.inf)
    virtuals, virtual_dropped = virtual_tried(planner)
    families = _families(config, planner, virtuals)
    _family_rows(planner, rows, families, ours_1f1b)
    _capped_rows(planner, rows, [r.terms["p2p buffers"] for r in default.memory], len(families))
    levered, lever_dropped = lever_rows(planner, rows.candidates)  # partial recompute and offload (plan/fitting.py)
    base = default.tokens_per_gpu
    candidates = [replace(c, relative=c.tokens_per_gpu / base if c.tokens_per_gpu else None)
                  for c in rows.candidates + levered]
    recommended, option = _chosen(config, candidates)
    zero1 = None
    if config.setup.dp > 1 and config.setup.zero_stage == 0:
        zero1 = nanotron_default(replace(config, setup=replace(config.setup, zero_stage=1)), planner.cache, base_split)
    planner.budget.plan_done()
    stats = dict(planner.stats, candidates=len(candidates), schedules=len(planner.used),
                 virtual_tried=list(virtuals))
    # Offload is reported for the recommendation, or for nanotron's default when nothing fits.
    offload = offload_report(planner, recommended or candidates[0]) if config.offload is not None else None
    return Plan(config, candidates[0], tuple(candidates), recommended, zero1, stats, offload,
                dropped(config) + virtual_dropped + tuple(lever_dropped), offload_option=option)


@dataclass
class _Rows:
    """A plan's candidates as they are found, and the step time of the fastest that fits
    (the cutoff the searches prune by: they time the step, tail included)."""

    candidates: list
    best: float

    def add(self, row: Candidate) -> None:
        self.candidates.append(row)
        if row.fits:
            self.best = min(self.best, row.step_time)


def _family_rows(planner: _Planner, rows: _Rows, families, ours_1f1b: Candidate) -> None:
    """Per (family, cap, virtual): the row at nanotron's split (where one exists) and the
    split search's row, one row where the search kept nanotron's split."""
    config = planner.config
    for i, (family, cap, virtual) in enumerate(families):
        try:
            nanotron = nanotron_split(config.model, config.pp * virtual)
        except ParameterError:
            nanotron = None
        same = None  # the row with nanotron's split, which the search may confirm
        if nanotron is not None:
            if (family, virtual) == ("1f1b", 1):
                same = ours_1f1b
            else:
                same = planner.evaluate(family, cap, virtual, nanotron, "nanotron")
                rows.candidates.append(same)
            if same.fits:
                rows.best = min(rows.best, same.step_time)
        seeds = [nanotron] if nanotron else []
        row = planner.optimise(family, cap, virtual, seeds, cutoff=rows.best, left=(len(families) - i, len(families)))
        if same is not None and row.split == same.split and row.memory and row.split_kind != "best found":
            # The search kept nanotron's split (or proved nothing beats the rows before): one row.
            kind = ("nanotron" if same is rows.candidates[0]
                    else "nanotron=optimal" if row.split_kind == "optimal" else same.split_kind)
            rows.candidates[rows.candidates.index(same)] = replace(same, split_kind=kind, proven=row.proven)
            continue
        rows.add(row)


def _capped_rows(planner: _Planner, rows: _Rows, p2p: Sequence[float], families: int) -> None:
    """Per-rank caps: for each one-stage-per-rank split found so far, the least capping
    that fits it (`p2p`: each rank's p2p buffers as 1F1B has them, the most a capped
    schedule holds), searched where no uniform cap or row already has it."""
    config = planner.config
    tried = {(c.family, c.cap) for c in rows.candidates if c.virtual == 1}
    splits = list(dict.fromkeys(c.split for c in list(rows.candidates) if c.virtual == 1 and c.split))
    for i, split in enumerate(splits):
        caps = fitted_caps(config, split, p2p)
        if caps is None or caps == tuple(min(config.pp - r, config.microbatches) for r in range(config.pp)):
            continue
        uniform = [c for c in range(1, config.pp) if caps == tuple(min(c, config.pp - r) for r in range(config.pp))]
        if uniform or ("capped_1f1b", caps) in tried:
            continue
        tried.add(("capped_1f1b", caps))
        rows.add(planner.optimise("capped_1f1b", caps, 1, [split], cutoff=rows.best, left=(len(splits) - i, families)))


def _chosen(config: PlanConfig, candidates: Sequence[Candidate]) -> tuple[Candidate | None, Candidate | None]:
    """(the recommendation, the offload option): the fastest that fits, among equals (1e-9)
    the earliest, i.e. the simplest change; offload only where its link is trusted,
    otherwise the fastest offload that beats the recommendation is an option ([Note:
    offload advice] in config.py)."""
    trusted = config.offload_recommendable
    recommended = _fastest([c for c in candidates if c.fits and (trusted or not isinstance(c, OffloadCandidate))])
    option = None if trusted else _fastest([c for c in candidates if c.fits and isinstance(c, OffloadCandidate)])
    if option is not None and recommended is not None and option.step_time >= recommended.step_time:
        option = None  # no faster than what is recommended: nothing to offer
    return recommended, option


def _fastest(candidates: Sequence[Candidate]) -> Candidate | None:
    """The candidate of least step time; among equals (1e-9) the earliest."""
    if not candidates:
        return None
    fastest = min(c.step_time for c in candidates)
    return next(c for c in candidates if c.step_time <= fastest * (1 + 1e-9))


def nanotron_default(config: PlanConfig, schedules: ScheduleCache, split: Sequence[int]) -> Candidate:
    """nanotron's own 1F1B engine with `split`: its schedule, and its gradient folding after
    each backward ([Note: memory terms], `grad_fold="backward"`)."""
    nanotron = replace(config, setup=replace(config.setup, grad_fold="backward"))
    return replace(_Planner(nanotron, schedules).evaluate("1f1b", None, 1, split, "nanotron"), nanotron_engine=True)


def evaluate_engine(planner: _Planner, engine: str, family: str, cap, virtual: int, split: Sequence[int],
                    kind: str = "measured", recomputed: Sequence[int] | None = None) -> Candidate:
    """A candidate as the `pp_engine` named `engine` runs it: nanotron's own engines
    (`1f1b`, `afab`) fold gradients after each backward ([Note: memory terms]), every other
    name is pipeschedule's. recomputed: decoder layers per stage the engine recomputes
    (its `recompute=`). For comparisons with measured runs."""
    if engine in ("1f1b", "afab"):
        nanotron = replace(planner.config, setup=replace(planner.config.setup, grad_fold="backward"))
        return replace(_Planner(nanotron, planner.cache).evaluate(family, cap, virtual, split, kind, None, recomputed),
                       nanotron_engine=True)
    return planner.evaluate(family, cap, virtual, split, kind, None, recomputed)


def engine_memory(config: PlanConfig, engine: str, family: str, cap, virtual: int, split: Sequence[int], *,
                  recomputed: Sequence[int] | None = None, offload: Sequence[int] | None = None,
                  stream: int | None = None) -> Candidate:
    """`evaluate_engine` under `config` alone (a planner of its own): the memory per rank
    and the step time of the one engine a config names (`pipeschedule check`), with the
    stashes of `offload`'s ranks on the host as the planner counts them (`fitting.offloaded`,
    streamed in `stream` MiB chunks) where the GPU's host link is known."""
    planner = _Planner(config)
    cand = evaluate_engine(planner, engine, family, cap, virtual, split, "given", recomputed)
    if offload and config.host_bandwidth is not None:
        return offloaded(planner, cand, tuple(offload), stream)
    return cand


def offload_report(planner: _Planner, candidate: Candidate) -> dict:
    """What host offload ([Note: offload placement] in compiler/offload.py) adds to `candidate`
    under `config.offload`, over a host link of `config.host_bandwidth` per direction:
    the policy (chosen by `choose_offload` for an AutoOffload), the step time with and
    without it (boundary messages and stash copies timed), and per rank the simulated
    peak of saved activations without and with it. `tightest` is the rank with the least
    headroom, where the saving matters."""
    config = planner.config
    schedule = planner.schedule(candidate.family, candidate.cap, candidate.virtual)
    sb = schedule.split_backward
    footprints = stage_footprints(config.model, config.setup, candidate.split)
    stash = stash_buffers(footprints)
    timing = planner.cost(candidate.split, split_backward=sb)
    both = replace(timing, buffer_bytes=dict(timing.buffer_bytes) | stash,
                   offload_bandwidth=config.host_bandwidth, reload_bandwidth=config.host_bandwidth)
    if isinstance(config.offload, AutoOffload):
        choice = choose_offload(schedule, both, config.offload)
    else:
        choice = evaluate_offload(schedule, both, config.offload)
    stash_cost = replace(planner.cost(candidate.split, stash, sb), offload_bandwidth=config.host_bandwidth,
                         reload_bandwidth=config.host_bandwidth)
    before, after = simulate(schedule, stash_cost), simulate(choice.schedule, choice.policy.cost(stash_cost))
    tightest = candidate.peak.rank
    return {
        "policy": choice.policy.text(), "offloaded": [list(c) for c in choice.counts],
        "host_bandwidth": config.host_bandwidth, "auto": isinstance(config.offload, AutoOffload),
        "budget": config.offload.budget if isinstance(config.offload, AutoOffload) else None,
        "step_time_s": choice.base_step_time, "step_time_offload_s": choice.step_time, "slowdown": choice.slowdown,
        "activations": [float(x) for x in before.peak_bytes],
        "activations_offload": [float(x) for x in after.peak_bytes],
        "host_bytes": [float(x) for x in after.peak_host_bytes], "tightest_rank": tightest,
        "saved_on_tightest": float(before.peak_bytes[tightest] - after.peak_bytes[tightest]),
        "simulations": choice.simulations, "chunk": choice.policy.chunk,
    }


__all__ = ["Plan", "ScheduleCache", "SearchBudget", "engine_memory", "evaluate_engine", "nanotron_default",
           "offload_report", "plan"]
