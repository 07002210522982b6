"""What `pipeschedule plan` advises: the best plan of each data-parallel size asked, one
recommendation against one baseline named in words, and the nanotron config that pins it.

[Note: plan advice] For each dp asked, the lever search runs ([Note: lever search] in
levers.py; one ScheduleCache for all of them, since schedules depend on pp and m
alone), and its fastest plan that fits is that dp's row (host offload only where it may
be recommended, [Note: offload advice] in config.py). One baseline serves every row:
nanotron's own default, its 1F1B with its own layer split, at the smallest dp asked, at
the ZeRO stage and recompute mode where it fits fastest (where it fits at none, at the
first combination planned, said not to fit). A GPU's tokens per step are m*b*s/(tp*pp)
whatever the dp, so "x", tokens/s per GPU against the baseline, is a ratio of step
times. The recommendation is the row with the most tokens/s per GPU; among equals (1e-9)
the smallest dp. Rows that fit only by offloading over an untrusted link are listed
below the table as options, with the link they assume.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeschedule.checks import check_plan_run
from pipeschedule.plan.candidate import Candidate
from pipeschedule.plan.config import PlanConfig
from pipeschedule.plan.levers import LeverPlan, baseline, levers_text, plan_levers
from pipeschedule.plan.memory import RECOMPUTE_MODES, GiB
from pipeschedule.plan.nanotron_yaml import beyond_yaml, host_link_words, plan_yaml
from pipeschedule.plan.planner import Plan
from pipeschedule.plan.schedule_cache import ScheduleCache
from pipeschedule.plan.splits import SearchBudget
from pipeschedule.plan.report import memory_table, offload_lines

RECOMPUTE_WORDS = {"none": "no recompute", "selective": "selective recompute", "full": "full recompute",
                   "partial": "partial recompute"}


@dataclass(frozen=True)
class Choice:
    """One candidate of one plan of the lever search at one dp: `plan` holds its config
    (dp, ZeRO stage, recompute mode) and nanotron's default beside it."""

    plan: Plan
    candidate: Candidate

    @property
    def config(self) -> PlanConfig:
        return self.plan.config

    @property
    def dp(self) -> int:
        return self.config.setup.dp

    @property
    def recompute(self) -> str:
        """The recompute mode planned, or "partial" where the candidate recomputes some
        layers on top of none ([Note: partial recompute] in fitting.py)."""
        return "partial" if self.candidate.recomputed else self.config.setup.recompute

    @property
    def levers(self) -> str:
        """`dp=2, ZeRO-1, full recompute`."""
        st = self.config.setup
        return f"dp={st.dp}, ZeRO-{st.zero_stage}, {RECOMPUTE_WORDS[self.recompute]}"

    @property
    def is_default(self) -> bool:
        return self.candidate is self.plan.default

    def engine(self) -> str:
        """The pp_engine value: nanotron's own `1f1b` for its default without recompute."""
        return self.candidate.engine(self.is_default)

    def yaml(self) -> list[str]:
        return plan_yaml(self.config, self.candidate, nanotron_default=self.is_default)

    def to_dict(self) -> dict:
        st = self.config.setup
        return {"dp": st.dp, "zero_stage": st.zero_stage, "recompute": self.recompute, "pp_engine": self.engine(),
                "candidate": self.candidate.to_dict()}


@dataclass(frozen=True)
class Advice:
    """The lever search of each dp asked (ascending), the baseline, each dp's best
    (None: nothing fits there), the recommendation (None: nothing fits at any dp), and
    the offload options ([Note: plan advice])."""

    config: PlanConfig
    searches: tuple[LeverPlan, ...]
    baseline: Choice
    best: tuple[Choice | None, ...]
    recommended: Choice | None
    options: tuple[Choice, ...]
    warnings: tuple[str, ...] = ()

    @property
    def dps(self) -> tuple[int, ...]:
        return tuple(s.config.setup.dp for s in self.searches)

    def ratio(self, choice: Choice) -> float:
        """Tokens/s per GPU of `choice` against the baseline's."""
        return self.baseline.candidate.step_time / choice.candidate.step_time

    @property
    def plan_for_png(self) -> Plan:
        """The plan the PNG shows: the recommendation's, else the first dp's best."""
        return self.recommended.plan if self.recommended else self.searches[0].best_plan

    def to_text(self, tables: str = "none") -> str:
        return advice_text(self, tables)

    def to_dict(self) -> dict:
        return advice_dict(self)


def advise(config: PlanConfig, dps, *, zero=None, recompute=None, progress=None) -> Advice:
    """Plan each dp of `dps` under `config` ([Note: plan advice]); `zero` and `recompute`
    as `plan_levers` takes them (None: search), `progress(k, n, dp, zero, mode)` called
    before the k-th of the n plans."""
    dps = tuple(sorted(set(dps)))
    counts = [len(zero if zero is not None else ((0, 1) if dp > 1 else (0,)))
              * len(recompute if recompute is not None else RECOMPUTE_MODES) for dp in dps]
    check_plan_run(sum(counts), config.pp, config.microbatches)  # [Note: size limits], before any work
    schedules = ScheduleCache(config.pp, config.microbatches)
    budget = SearchBudget(config, plans=sum(counts))  # [Note: plan search budget]: one for the whole run
    searches = []
    for i, dp in enumerate(dps):
        at = replace(config, setup=replace(config.setup, dp=dp))
        done = sum(counts[:i])
        step = None if progress is None else (
            lambda k, n, z, mode, dp=dp, done=done: progress(done + k, sum(counts), dp, z, mode))
        searches.append(plan_levers(at, zero=zero, recompute=recompute, progress=step, schedules=schedules,
                                    budget=budget))
    key, _ = baseline(searches[0])
    base = Choice(searches[0].plans[key], searches[0].plans[key].default)
    best = tuple(Choice(s.plans[s.best[0]], s.best[1]) if s.best else None for s in searches)
    fitting = [c for c in best if c is not None]
    recommended = None
    if fitting:
        fastest = min(c.candidate.step_time for c in fitting)
        recommended = next(c for c in fitting if c.candidate.step_time <= fastest * (1 + 1e-9))
    options = tuple(Choice(s.plans[s.offload_option[0]], s.offload_option[1]) for s in searches
                    if s.offload_option is not None)
    return Advice(config, tuple(searches), base, best, recommended, options, pipeline_warnings(config))


def pipeline_warnings(config: PlanConfig) -> tuple[str, ...]:
    """One line per warning about the layout: fewer microbatches than stages."""
    pp, m = config.pp, config.microbatches
    if m >= pp:
        return ()
    return (f"{m} microbatch{'es' if m > 1 else ''} per replica < pp={pp}: the pipeline never fills; under 1F1B with "
            f"equal stages each rank idles (pp-1)/(m+pp-1) = {bubble(pp, m):.0%} of the step, against "
            f"{bubble(pp, pp):.0%} at m=pp (tokens.batch_accumulation_per_replica, --microbatches)",)


def bubble(pp: int, m: int) -> float:
    """The idle fraction of a 1F1B step with equal stages: (pp-1)/(m+pp-1)."""
    return (pp - 1) / (m + pp - 1)


# -- text ------------------------------------------------------------------------------------


def _gib(value: float) -> str:
    v = value / GiB
    return f"{v:.1f}" if v >= 1 else f"{v:.3g}"


def _seconds(value: float) -> str:
    return f"{value:.2f}" if value >= 0.1 else f"{value:.3g}"


def advice_text(advice: Advice, tables: str = "none") -> str:
    c, m, st = advice.config, advice.config.model, advice.config.setup
    out = [f"Plan for {m.name} ({m.layers} layers, {m.total_params() / 1e9:.1f} B parameters): pp={c.pp} tp={st.tp}, "
           f"seq {st.seq}, micro-batch {st.micro_batch}, {c.microbatches} microbatches per replica; {c.gpu_name}, "
           f"{_gib(c.budget)} GiB per GPU for the plan", ""]
    out += table_lines(advice) + [""]
    out += recommended_lines(advice)
    out += option_lines(advice)
    rec = advice.recommended
    asked = rec.plan if rec is not None else advice.searches[0].best_plan
    if asked.offload is not None:  # --offload SPEC: what it adds to the recommendation
        out += offload_lines(asked)
    for warning in advice.warnings:
        out.append("Warning: " + warning)
    if rec is not None:
        out += ["", "nanotron config of the recommendation (--write OUT.yaml merges it into yours, or writes a "
                    "whole one; pp_engine carries what nanotron's YAML has no key for):", ""]
        out += ["  " + line for line in rec.yaml()]
        out += ["", "Assumed by the estimate, with no key in nanotron's config:"]
        out += ["  " + line for line in beyond_yaml(rec.config, rec.candidate)]
        if rec.candidate.note:
            out.append("Note: " + rec.candidate.note)
    if tables in ("top", "all"):
        shown = [advice.baseline] + ([rec] if rec is not None and rec.candidate is not advice.baseline.candidate
                                     else [])
        for choice in shown:
            index = choice.plan.candidates.index(choice.candidate)
            title = "baseline" if choice is advice.baseline else "recommended"
            out += ["", f"{title}, {choice.levers}:"] + memory_table(choice.plan, index, choice.candidate)
    if tables == "all":
        for search in advice.searches:
            out += ["", "-" * 100, ""] + levers_text(search, tables="all").rstrip("\n").split("\n")
    return "\n".join(out) + "\n"


def table_lines(advice: Advice) -> list[str]:
    """One row per dp: its fastest plan that fits, against the baseline."""
    rows = []
    for search, choice in zip(advice.searches, advice.best):
        dp = search.config.setup.dp
        if choice is None:
            rows.append((f"{dp:>3}", nothing_fits(search)))
            continue
        cand = choice.candidate
        st = choice.config.setup
        rows.append((f"{dp:>3}", f"{st.zero_stage:>4}", choice.recompute, choice.engine(),
                     f"{_gib(cand.peak.total)} (r{cand.peak.rank})", _seconds(cand.step_time),
                     f"{cand.tokens_per_gpu:.0f}", f"{advice.ratio(choice):.3f}"))
    full = [r for r in rows if len(r) > 2]
    head = (" dp", "ZeRO", "recompute", "pp_engine", "peak GiB", "step s", "tok/s/GPU", "x")
    widths = [max(len(r[i]) for r in full + [head]) for i in range(len(head))]
    right = (True, True, False, False, False, True, True, True)

    def line(row):
        return "  ".join(cell.rjust(w) if r else cell.ljust(w) for cell, w, r in zip(row, widths, right)).rstrip()

    out = [line(head)]
    for row in rows:
        out.append(line(row) if len(row) > 2 else f"{row[0]}  {row[1]}")
    base = advice.baseline
    verdict = (f"fits, {_gib(base.candidate.peak.total)} GiB" if base.candidate.fits
               else f"does not fit: {_gib(base.candidate.peak.total)} GiB on rank {base.candidate.peak.rank}")
    out.append(f"x: tokens/s per GPU against the baseline, {baseline_words(base)} "
               f"({base.candidate.tokens_per_gpu:.0f} tokens/s per GPU, {verdict})")
    return out


def baseline_words(base: Choice) -> str:
    """The baseline in words ([Note: plan advice])."""
    return f"nanotron's default, 1F1B with its layer split (pp_engine: {base.engine()}), at {base.levers}"


def nothing_fits(search: LeverPlan) -> str:
    """A dp's row when nothing fits there: the levers tried and the least overflow seen."""
    zeros = sorted({z for z, _ in search.plans})
    modes = list(dict.fromkeys(mode for _, mode in search.plans))
    least = min(((p, c) for p in search.plans.values() for c in p.candidates if c.peak is not None),
                key=lambda pc: pc[1].peak.overflow, default=None)
    text = (f"nothing fits at ZeRO {'/'.join(map(str, zeros))} with {' or '.join(RECOMPUTE_WORDS[m] for m in modes)}"
            + (", nor with host offload" if any(p.config.host_bandwidth for p in search.plans.values()) else ""))
    if least is not None:
        p, c = least
        text += (f"; the least over: {c.label} at ZeRO-{p.config.setup.zero_stage}, "
                 f"{RECOMPUTE_WORDS[p.config.setup.recompute]}, rank {c.peak.rank} {_gib(c.peak.total)} of "
                 f"{_gib(c.peak.budget)} GiB")
    return text


def recommended_lines(advice: Advice) -> list[str]:
    rec = advice.recommended
    if rec is None:
        return [f"Recommended: nothing fits at dp {', '.join(map(str, advice.dps))}. Lower the in-flight activations "
                "(recompute, a smaller micro-batch or sequence), shard the optimizer (ZeRO-1 with dp > 1) or use more "
                "GPUs (pp, tp)."]
    cand, peak = rec.candidate, rec.candidate.peak
    split = "/".join(map(str, cand.split))
    return [f"Recommended: {rec.levers}, {cand.label} with split {split}: {advice.ratio(rec):.3f}x the tokens/s per "
            f"GPU of {baseline_words(advice.baseline)}; peak {_gib(peak.total)} of {_gib(peak.budget)} GiB "
            f"(rank {peak.rank}), step {_seconds(cand.step_time)} s."]


def option_lines(advice: Advice) -> list[str]:
    """The offload rows not recommended ([Note: offload advice]): what each would give,
    and the link they assume."""
    if not advice.options:
        return []
    c = advice.options[0].config
    out = [f"Not recommended, with host offload over a {c.host_bandwidth / 1e9:g} GB/s link a direction "
           f"({host_link_words(c)}; --host-memory GiB, what the host may take, or your link's --host-bandwidth lets "
           "the plan recommend offload):"]
    for choice in advice.options:
        host = max(getattr(choice.candidate, "host_bytes", ()) or (0.0,))
        out.append(f"  {choice.levers}: {choice.engine()}, {advice.ratio(choice):.3f}x, {_gib(host)} GiB a GPU on "
                   "the host")
    return out


# -- JSON ------------------------------------------------------------------------------------


def advice_dict(advice: Advice) -> dict:
    """Every plan's detail (one dp: as `plan --json` gave it before, a lever search's or a
    single plan's; several: under "per_dp") and the summary the text shows."""
    detail = [s.plans[next(iter(s.plans))].to_dict() if len(s.plans) == 1 else s.to_dict() for s in advice.searches]
    rec = advice.recommended
    summary = {
        "dp": list(advice.dps),
        "baseline": advice.baseline.to_dict() | {"words": baseline_words(advice.baseline)},
        "best": [None if c is None else c.to_dict() | {"relative_throughput": advice.ratio(c)} for c in advice.best],
        "recommended": None if rec is None else rec.to_dict() | {"relative_throughput": advice.ratio(rec)},
        "yaml": None if rec is None else rec.yaml(),
        "beyond_yaml": None if rec is None else beyond_yaml(rec.config, rec.candidate),
        "offload_options": [c.to_dict() | {"relative_throughput": advice.ratio(c),
                                            "host_link": host_link_words(c.config)} for c in advice.options],
        "warnings": list(advice.warnings),
    }
    out = detail[0] if len(detail) == 1 else {"per_dp": [{"dp": dp} | d for dp, d in zip(advice.dps, detail)]}
    return out | {"summary": summary}


__all__ = ["Advice", "Choice", "advise", "bubble", "pipeline_warnings", "RECOMPUTE_WORDS"]
