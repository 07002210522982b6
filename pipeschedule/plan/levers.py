"""The levers besides the schedule: ZeRO stage and recompute mode (partial recompute and
offload are pulled inside each plan, plan/fitting.py). `plan_levers` plans every
combination the config leaves open and picks the fastest that fits.

[Note: lever search] For each ZeRO stage (0, and 1 when dp > 1) and each recompute mode
(none, selective, full) the planner runs in full (`planner.plan`: every family, cap,
split, virtual stage count [Note: virtual counts], and on the rows that do not fit,
partial recompute and host offload [Note: partial recompute], [Note: offload lever] in
fitting.py); the answer is the candidate that fits with the least step
time over all of them, step time including the data-parallel reduction and optimizer
step that the ZeRO stage changes ([Note: step tail]). Each combination's nanotron default
(nanotron's 1F1B with its split) is kept for the table; the baseline of "x" columns is
nanotron's default at the user's own ZeRO stage and recompute mode.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeschedule.checks import check_plan_run
from pipeschedule.plan.config import PlanConfig
from pipeschedule.plan.memory import RECOMPUTE_MODES, GiB
from pipeschedule.plan.planner import Plan, plan
from pipeschedule.plan.schedule_cache import ScheduleCache
from pipeschedule.plan.splits import SearchBudget
from pipeschedule.plan.report import offload_lines


@dataclass(frozen=True)
class LeverPlan:
    """Plans per (zero_stage, recompute); `best` the (key, candidate) that fits fastest."""

    config: PlanConfig
    plans: dict
    best: tuple | None

    def to_text(self, tables: str = "none") -> str:
        return levers_text(self, tables)

    @property
    def best_plan(self) -> Plan:
        """The plan of the best combination (the first one when nothing fits)."""
        return self.plans[self.best[0]] if self.best else next(iter(self.plans.values()))

    @property
    def offload_option(self) -> tuple | None:
        """(key, candidate): the fastest of the plans' offload options ([Note: offload
        advice] in config.py) where it beats `best`; else None."""
        options = [(key, p.offload_option) for key, p in self.plans.items() if p.offload_option is not None]
        if not options:
            return None
        key, cand = min(options, key=lambda item: item[1].step_time)
        return (key, cand) if self.best is None or cand.step_time < self.best[1].step_time else None

    def to_dict(self) -> dict:
        out = {"levers": [{"zero_stage": z, "recompute": r, "plan": p.to_dict()} for (z, r), p in self.plans.items()],
               "best": None if self.best is None else {"zero_stage": self.best[0][0], "recompute": self.best[0][1],
                                                        "candidate": self.best[1].to_dict()},
               "offload_option": None if self.offload_option is None else {
                   "zero_stage": self.offload_option[0][0], "recompute": self.offload_option[0][1],
                   "candidate": self.offload_option[1].to_dict()}}
        return out | ({"offload": self.best_plan.offload} if self.best_plan.offload is not None else {})


def plan_levers(config: PlanConfig, zero=None, recompute=None, progress=None,
                schedules: ScheduleCache | None = None, budget: SearchBudget | None = None) -> LeverPlan:
    """Plan every ZeRO stage in `zero` (None: 0, and 1 when dp > 1) and recompute mode in
    `recompute` (None: all three) ([Note: lever search]). `progress(k, n, zero, mode)`, if
    given, is called before the k-th of the n plans (k from 1). `schedules`: a
    ScheduleCache of the config's pp and microbatches to share (None: one of its own).
    `budget`: the search nodes shared with the plans after these ([Note: plan search
    budget] in splits.py; None: one budget for these plans)."""
    zeros = zero if zero is not None else ((0, 1) if config.setup.dp > 1 else (0,))
    modes = recompute if recompute is not None else RECOMPUTE_MODES
    if budget is None:  # planned alone, not within advise's run (which checks all of its plans)
        check_plan_run(len(zeros) * len(modes), config.pp, config.microbatches)
        budget = SearchBudget(config, plans=len(zeros) * len(modes))
    plans = {}
    if schedules is None:  # the setups differ, the schedules do not
        schedules = ScheduleCache(config.pp, config.microbatches)
    for z in zeros:
        for mode in modes:
            if progress is not None:
                progress(len(plans) + 1, len(zeros) * len(modes), z, mode)
            setup = replace(config.setup, zero_stage=z, recompute=mode)
            plans[(z, mode)] = plan(replace(config, setup=setup), schedules=schedules, budget=budget)
    fitting = [(key, p.recommended) for key, p in plans.items() if p.recommended is not None]
    # The fastest; among equals (1e-9) the first planned, i.e. the fewest levers pulled.
    fastest = min((c.step_time for _, c in fitting), default=None)
    best = next((item for item in fitting if item[1].step_time <= fastest * (1 + 1e-9)), None)
    return LeverPlan(config, plans, best)


def yaml_lines(key, candidate, pp: int) -> list[str]:
    """`parallelism.pp_engine` and `optimizer.zero_stage` of a candidate of the lever
    search (benchmarks/users_case.py's table); the whole config that pins it is
    `nanotron_yaml.plan_yaml`'s."""
    zero, _ = key
    return candidate.yaml_lines(pp) + ["optimizer:", f"  zero_stage: {zero}"]


def tail_text(cand) -> str:
    return " + ".join(f"{k} {v:.2f} s" for k, v in cand.tail.items() if k != "rank")


def baseline(result: LeverPlan):
    """(key, candidate): the fastest nanotron default that fits over the levers planned,
    else nanotron's default at the first combination."""
    fitting = [(key, p.default) for key, p in result.plans.items() if p.default.fits]
    if fitting:
        return min(fitting, key=lambda item: item[1].step_time)
    key = next(iter(result.plans))
    return key, result.plans[key].default


def levers_text(result: LeverPlan, tables: str = "none") -> str:
    c = result.config
    base_key, base = baseline(result)
    out = [f"Levers for {c.model.name}, pp={c.pp} tp={c.setup.tp} dp={c.setup.dp}, {c.microbatches} microbatches, "
           f"budget {c.budget / GiB:.1f} GiB; x = step throughput against nanotron's default at ZeRO-{base_key[0]}, "
           f"recompute {base_key[1]} (step {base.step_time:.2f} s)", ""]
    w = max([52] + [len(p.recommended.engine()) for p in result.plans.values() if p.recommended is not None])
    out.append(f"{'ZeRO':>4} {'recompute':<10} {'nanotron default':<28} {'fastest that fits':<{w}} {'peak GiB':>9} "
               f"{'step s':>8} {'x':>6}")
    for (z, mode), p in result.plans.items():
        d = p.default
        default = f"{'fits' if d.fits else 'no'} {d.peak.total / GiB:5.1f} GiB {d.step_time:7.2f} s" if d.peak else "-"
        rec = p.recommended
        if rec is None:
            out.append(f"{z:>4} {mode:<10} {default:<28} {'nothing fits':<{w}}".rstrip())
            continue
        out.append(f"{z:>4} {mode:<10} {default:<28} {rec.engine(rec is d):<{w}} {rec.peak.total / GiB:9.1f} "
                   f"{rec.step_time:8.2f} {base.step_time / rec.step_time:6.3f}")
    out.append("")
    if result.best is None:
        out.append(f"Fastest that fits at dp={c.setup.dp}: nothing fits at any ZeRO stage and recompute mode planned.")
        if result.best_plan.offload is not None:
            out += offload_lines(result.best_plan)
        return "\n".join(out) + "\n"
    key, cand = result.best
    peak = cand.peak
    out.append(f"Fastest that fits at dp={c.setup.dp}: ZeRO-{key[0]}, recompute {key[1]}, {cand.label} split "
               f"{'/'.join(map(str, cand.split))}: {base.step_time / cand.step_time:.3f}x, peak {peak.total / GiB:.1f} "
               f"of {peak.budget / GiB:.1f} GiB (rank {peak.rank}, margin {-peak.overflow / GiB:.1f} GiB); step "
               f"{cand.step_time:.2f} s = pipeline {cand.pipeline_time:.2f} s + " + tail_text(cand))
    out.append(f"  pp_engine: {cand.engine(cand is result.plans[key].default)}")
    if cand.note:
        out.append("  note: " + cand.note)
    if result.best_plan.offload is not None:
        out += offload_lines(result.best_plan)
    if tables != "none":
        out += ["", result.plans[key].to_text(tables=tables)]
    return "\n".join(out) + "\n"


__all__ = ["LeverPlan", "baseline", "levers_text", "plan_levers", "yaml_lines"]
