"""The split searches of a plan: each candidate's layer split found by `optimal_split`
(partition.py) on its evaluator's split problem, within a share of the run's search
budget, and turned into a row (`SplitSearches.row`); a plan's rows as they are found, with
the step time the searches prune by (`Rows`); the rows of each family at nanotron's
split and at the split its search finds (`family_rows`), and of the per-rank caps that fit
the splits found (`capped_rows`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipeschedule.checks import PLAN_SEARCH_WORK
from pipeschedule.errors import ParameterError
from pipeschedule.plan.candidate import Candidate, cap_label, fitted_caps
from pipeschedule.plan.config import PlanConfig
from pipeschedule.plan.evaluation import Evaluator
from pipeschedule.plan.memory import GiB
from pipeschedule.plan.partition import SplitInfeasible, SplitResult, nanotron_split, optimal_split

NO_BETTER = "no split of this schedule beats the best candidate before it"


@dataclass
class Rows:
    """A plan's candidates as they are found, and the step time of the fastest that fits
    (the cutoff the searches prune by: they time the step, tail included)."""

    candidates: list
    best: float

    @classmethod
    def first(cls, default: Candidate, ours_1f1b: Candidate) -> Rows:
        """The rows a plan starts from: nanotron's default, and pipeschedule's 1F1B with
        nanotron's split where it is another row (it folds gradients differently)."""
        return cls([default] if ours_1f1b is default else [default, ours_1f1b],
                   default.step_time if default.fits else math.inf)

    def add(self, row: Candidate) -> None:
        self.candidates.append(row)
        if row.fits:
            self.best = min(self.best, row.step_time)


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


class SplitSearches:
    """The split searches of one plan, on `evaluator`'s candidates within `budget`;
    `stats`: how many, how many proven, their nodes and simulations."""

    def __init__(self, evaluator: Evaluator, budget: SearchBudget) -> None:
        self.evaluator, self.budget = evaluator, budget
        self.stats = {"searches": 0, "proven": 0, "search_nodes": 0, "search_simulations": 0}

    def row(self, family: str, cap, virtual: int, seeds, cutoff: float, left: tuple[int, int] = (1, 1)) -> Candidate:
        """The split search of one candidate and its row; `left`: (searches still to come
        in this plan, this one included; searches per plan after it), for the budget's share."""
        ev, limit = self.evaluator, self.budget.allowance(self.evaluator.config.node_limit, *left)
        key = ev.use(family, cap, virtual)
        self.stats["searches"] += 1
        try:
            found = optimal_split(ev.problem(family, cap, virtual), ev.cache.schedule(key), seeds=seeds,
                                  node_limit=limit, cutoff=cutoff, graph=ev.cache.graph(key)[0],
                                  inflight=ev.cache.inflight(key), memo=ev.cache.memo(key))
        except SplitInfeasible as err:
            return self._refused(family, cap, virtual, err, cutoff)
        self.budget.spend(found.nodes)
        for stat, value in (("proven", found.proven), ("search_nodes", found.nodes),
                            ("search_simulations", found.simulations)):
            self.stats[stat] += value
        kind, note = _found_kind(found, cutoff, limit, self.evaluator.config.node_limit, self.budget.total)
        return replace(ev.evaluate(family, cap, virtual, found.split, kind, found.proven), note=note,
                       lower_bound=None if found.proven else found.lower_bound)

    def _refused(self, family: str, cap, virtual: int, err: SplitInfeasible, cutoff: float) -> Candidate:
        """The row of a search that found no split within its bounds (`err`)."""
        ev = self.evaluator
        if err.overflow <= 0:  # the per-stage bound refused, the rank totals fit: evaluate it
            row = ev.evaluate(family, cap, virtual, err.split, "best found")
            return replace(row, note="the search's per-stage bound admits no split; this one fits its rank totals")
        self.stats["proven"] += 1
        if err.by_ranks and cutoff < math.inf:
            # The split problem's bytes are bounds: with a time to beat, the search shows the
            # split that overflows them least, as it did when it ran out of splits.
            row = ev.evaluate(family, cap, virtual, err.split, "no better", True)
            if row.fits:
                if row.step_time >= cutoff:
                    return replace(row, note=NO_BETTER)
                return replace(row, split_kind="optimal")
        return Candidate(family, cap_label(cap), virtual, err.split, "least overflow",
                         note=f"no split fits: the best still overflows rank {err.rank} "
                              f"by {err.overflow / GiB:.1f} GiB")


def _found_kind(found: SplitResult, cutoff: float, limit: int, node_limit: int, total: int) -> tuple[str, str]:
    """(split_kind, note) of the split a search found: proven optimal, proven no better
    than `cutoff`, or the best found within `limit` nodes (of `node_limit`, the budget of
    `total` nodes in all leaving it fewer)."""
    if found.proven and found.step_time >= cutoff:
        return "no better", NO_BETTER
    if found.proven:
        return "optimal", ""
    note = f"best split found in {found.nodes} search nodes (not proven optimal)"
    if limit < node_limit:  # [Note: plan search budget]
        note = note[:-1] + f"; the plan's budget of {total} search nodes in all left it {limit} of its {node_limit})"
    if found.lower_bound is not None:
        note = note[:-1] + f"; no split of this schedule is faster than {found.lower_bound:.3f} s)"
    return "best found", note


def family_rows(searches: SplitSearches, rows: Rows, families: Sequence[tuple], ours_1f1b: Candidate) -> None:
    """Per (family, cap, virtual): the row at nanotron's split (where one exists) and the
    split search's row, one row where the search kept nanotron's split."""
    ev = searches.evaluator
    for i, (family, cap, virtual) in enumerate(families):
        try:
            nanotron = nanotron_split(ev.config.model, ev.config.pp * virtual)
        except ParameterError:
            nanotron = None
        same = None  # the row with nanotron's split, which the search may confirm
        if nanotron is not None:
            if (family, virtual) == ("1f1b", 1):
                same = ours_1f1b
            else:
                same = ev.evaluate(family, cap, virtual, nanotron, "nanotron")
                rows.candidates.append(same)
            if same.fits:
                rows.best = min(rows.best, same.step_time)
        seeds = [nanotron] if nanotron else []
        row = searches.row(family, cap, virtual, seeds, cutoff=rows.best, left=(len(families) - i, len(families)))
        if same is not None and row.split == same.split and row.memory and row.split_kind != "best found":
            # The search kept nanotron's split (or proved nothing beats the rows before): one row.
            kind = ("nanotron" if same is rows.candidates[0]
                    else "nanotron=optimal" if row.split_kind == "optimal" else same.split_kind)
            rows.candidates[rows.candidates.index(same)] = replace(same, split_kind=kind, proven=row.proven)
            continue
        rows.add(row)


def capped_rows(searches: SplitSearches, rows: Rows, p2p: Sequence[float], families: int) -> None:
    """Per-rank caps: for each one-stage-per-rank split found so far, the least capping
    that fits it (`p2p`: each rank's p2p buffers as 1F1B has them, the most a capped
    schedule holds), searched where no uniform cap or row already has it."""
    config = searches.evaluator.config
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
        rows.add(searches.row("capped_1f1b", caps, 1, [split], cutoff=rows.best, left=(len(splits) - i, families)))


__all__ = ["Rows", "SearchBudget", "SplitSearches", "capped_rows", "family_rows"]
