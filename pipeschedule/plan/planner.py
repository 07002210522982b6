"""The planner: which schedule, in-flight cap and layer split fit a GPU, and how fast.

`plan(config)` evaluates nanotron's default (1F1B with nanotron's split) and the
alternatives (alternatives.py): 1F1B, capped 1F1B at every cap 1..pp-1, interleaved 1F1B
(at the chunk counts of [Note: virtual counts]) uncapped and capped, the split-backward
schedules (ZB-H1; ZB-V, V-Half and V-Min with their V-shape placement, two stages per
rank, when every stage gets a layer) and AFAB, each with nanotron's split and with the
split `partition.optimal_split` finds for it (splits.py). Every candidate gets a per-rank
memory table, a simulated step time and the nanotron config line that selects it
([Note: a candidate's evaluation] in evaluation.py). The rows that do not fit get partial
recompute and host offload fitted where that could beat the fastest fit (fitting.py).
The recommendation is the candidate that fits with the least simulated step time, host
offload only over a link trusted for it (choice.py; [Note: offload advice] in config.py:
otherwise the fastest offload is `offload_option`).

The parts, each through a typed interface: `ScheduleCache` (schedule_cache.py: what
depends on the schedule alone), `StageCosts` (stage_costs.py: the config's times),
`Evaluator` (evaluation.py: one candidate's memory and step time; `fitting.Planner` is
what the levers need of it), `SplitSearches` within a `SearchBudget` and `Rows` (splits.py:
the rows found and the cutoff the searches prune by), `chosen` (choice.py). Costs follow [Note:
compute costs] and the config, candidates and their nanotron config lines live in
config.py and candidate.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pipeschedule.compiler.gcpause import gc_paused
from pipeschedule.errors import ParameterError
from pipeschedule.plan.alternatives import alternatives, dropped, searched_caps
from pipeschedule.plan.candidate import Candidate
from pipeschedule.plan.choice import chosen, offload_report, relative
from pipeschedule.plan.config import PlanConfig, build_config
from pipeschedule.plan.evaluation import Evaluator, engine_memory, evaluate_engine, nanotron_default
from pipeschedule.plan.fitting import lever_rows, virtual_tried
from pipeschedule.plan.partition import nanotron_split
from pipeschedule.plan.report import plan_to_dict, plan_to_text
from pipeschedule.plan.schedule_cache import ScheduleCache
from pipeschedule.plan.splits import Rows, SearchBudget, SplitSearches, capped_rows, family_rows
from pipeschedule.plan.step_graph import MEMO_CELLS as MEMO_CELLS  # what the memos hold (0: nothing)

_Planner = Evaluator  # the name tests and measurements of one candidate know it by


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
    config = _config_of(config, options)
    evaluator = Evaluator(config, schedules)
    searches = SplitSearches(evaluator, budget if budget is not None else SearchBudget(config))
    base_split = nanotron_split(config.model, config.pp)
    default = nanotron_default(config, evaluator.cache, base_split)
    zero1 = None  # nanotron's default again with ZeRO-1, beside a dp > 1 without it
    if config.setup.dp > 1 and config.setup.zero_stage == 0:
        zero1 = nanotron_default(replace(config, setup=replace(config.setup, zero_stage=1)), evaluator.cache,
                                 base_split)
    rows, virtuals, virtual_dropped = _searched_rows(searches, default, base_split)
    levered, lever_dropped = lever_rows(evaluator, rows.candidates)  # partial recompute and offload (fitting.py)
    candidates = relative(rows.candidates + levered, default)
    recommended, option = chosen(config, candidates)
    searches.budget.plan_done()
    stats = dict(evaluator.stats, **searches.stats, candidates=len(candidates), schedules=len(evaluator.used),
                 virtual_tried=list(virtuals))
    # Offload is reported for the recommendation, or for nanotron's default when nothing fits.
    offload = offload_report(evaluator, recommended or candidates[0]) if config.offload is not None else None
    return Plan(config, candidates[0], tuple(candidates), recommended, zero1, stats, offload,
                dropped(config) + virtual_dropped + tuple(lever_dropped), offload_option=option)


def _config_of(config: PlanConfig | None, options: dict) -> PlanConfig:
    """`config`, or the PlanConfig of the command line's options; not both."""
    if config is None:
        return build_config(options.pop("model"), **options) if "model" in options else build_config(None, **options)
    if options:
        raise ParameterError(f"give a PlanConfig or keyword options, not both (got {sorted(options)})")
    return config


def _searched_rows(searches: SplitSearches, default: Candidate, base_split) -> tuple[Rows, tuple, tuple]:
    """(the rows of every alternative at nanotron's split and at its searched split, and of
    the per-rank caps that fit them; the chunk counts interleaving is tried at; the counts
    left out, with why)."""
    evaluator = searches.evaluator
    evaluator.use("1f1b", None, 1)
    # pipeschedule's 1F1B with nanotron's split: the default's schedule, ours where it folds gradients
    # differently ([Note: memory terms]); the same row where the fold changes nothing
    ours_1f1b = evaluator.evaluate("1f1b", None, 1, base_split, "nanotron")
    if ours_1f1b.memory == default.memory:
        ours_1f1b = default
    rows = Rows.first(default, ours_1f1b)
    virtuals, virtual_dropped = virtual_tried(evaluator)
    families = alternatives(evaluator.config, evaluator, virtuals)
    family_rows(searches, rows, families, ours_1f1b)
    capped_rows(searches, rows, [r.terms["p2p buffers"] for r in default.memory], len(families))
    return rows, virtuals, virtual_dropped


# The names outside code knows the planner's parts by, beside `plan` and `Plan`.
__all__ = ["MEMO_CELLS", "Plan", "ScheduleCache", "SearchBudget", "engine_memory", "evaluate_engine",
           "nanotron_default", "offload_report", "plan", "searched_caps"]
