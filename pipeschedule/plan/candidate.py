"""A plan's candidates: one way to run the pipeline each, evaluated (planner.py builds and
ranks them), and the per-rank caps that fit a split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeschedule.compiler.families import FAMILIES
from pipeschedule.compiler.spec import ForeignSpec, ScheduleSpec
from pipeschedule.plan.config import PlanConfig
from pipeschedule.plan.memory import stage_footprints
from pipeschedule.plan.memory import RankMemory


@dataclass(frozen=True)
class Candidate:
    """One way to run the pipeline, evaluated.

    family / cap / virtual: the schedule. split: decoder layers per stage; split_kind:
    "nanotron" (nanotron's split), "nanotron=optimal" (the search proved it best),
    "optimal" (found and proven best by `optimal_split`), "no better" (the search proved
    no split of this schedule beats a faster candidate already found; the split shown is
    the best it simulated), "best found" (the search hit its node limit or the run's search budget), "least overflow"
    (no split fits; the one that overflows least, without numbers). step_time (s),
    tokens_per_gpu (tokens/s per GPU), memory (per rank). lower_bound ("best found"): a
    step time no split of the schedule beats, from where the search stopped.
    note: why a candidate is missing numbers (no split fits, too few layers).
    """

    family: str
    cap: int | tuple[int, ...] | None
    virtual: int
    split: tuple[int, ...] | None
    split_kind: str
    step_time: float | None = None
    tokens_per_gpu: float | None = None
    memory: tuple[RankMemory, ...] = ()
    proven: bool | None = None
    note: str = ""
    relative: float | None = field(default=None, compare=False)
    pipeline_time: float | None = None  # the pipeline alone; step_time adds the tail
    tail: dict = field(default_factory=dict, compare=False)  # [Note: step tail], the slowest rank's parts
    recompute: str = "none"  # the setup's recompute mode, written into pp_engine when not none
    recomputed: tuple[int, ...] | None = None  # layers per stage recomputed on top (pp_engine recompute=N0/N1/..)
    lower_bound: float | None = None  # "best found": a step time no split of this schedule beats (the search's bound)
    nanotron_engine: bool = False  # nanotron's own engine (the default): its gradient folding, its pp_engine name

    @property
    def gap(self) -> float | None:
        """"best found": the most any split of this schedule could be faster, as a fraction
        of this step time (from the search's `lower_bound`); None where it is not known."""
        if self.lower_bound is None or not self.step_time:
            return None
        return max(0.0, 1.0 - self.lower_bound / self.step_time)

    @property
    def fits(self) -> bool:
        return bool(self.memory) and all(r.fits for r in self.memory)

    @property
    def peak(self) -> RankMemory | None:
        return max(self.memory, key=lambda r: r.total - r.budget, default=None)

    @property
    def label(self) -> str:
        name = self.family
        if self.virtual > 1 and FAMILIES[self.family].takes_virtual:
            name += f" v={self.virtual}"
        if self.cap is not None:
            name += f" cap={cap_text(self.cap)}"
        if self.recomputed:
            name += " rc=" + "/".join(str(n) for n in self.recomputed)
        return name

    def spec(self, nanotron_default: bool = False) -> ScheduleSpec | ForeignSpec:
        """The `parallelism.pp_engine` value that runs this candidate ([Note: pp_engine
        syntax] in compiler/spec.py): nanotron's own `1f1b` when it is nanotron's default
        without recompute, else pipeschedule's, with virtual, cap, the split (always
        written: the memory counted is that split's, whatever the engine's default) and
        recompute inside the value."""
        if (nanotron_default or self.nanotron_engine) and self.recompute == "none" and not self.recomputed:
            return ForeignSpec("1f1b")
        family = FAMILIES[self.family]
        recompute = _one_or_many(self.recomputed) if self.recomputed else (
            None if self.recompute == "none" else self.recompute)
        return ScheduleSpec(self.family, virtual=self.virtual if family.takes_virtual else None,
                            cap=_one_or_many(self.cap), split=None if self.split is None else tuple(self.split),
                            recompute=recompute)

    def engine(self, nanotron_default: bool = False) -> str:
        """`spec(nanotron_default)` as nanotron's YAML writes it."""
        return self.spec(nanotron_default).to_string()

    def yaml_lines(self, pp: int, nanotron_default: bool = False) -> list[str]:
        return ["parallelism:", f"  pp: {pp}", f"  pp_engine: {self.engine(nanotron_default)}"]

    def to_dict(self) -> dict:
        return {
            "schedule": self.family, "cap": list(self.cap) if isinstance(self.cap, tuple) else self.cap,
            "virtual": self.virtual, "label": self.label,
            "split": list(self.split) if self.split else None, "split_kind": self.split_kind,
            "step_time_s": self.step_time, "pipeline_time_s": self.pipeline_time, "tail_s": self.tail,
            "tokens_per_s_per_gpu": self.tokens_per_gpu,
            "relative_throughput": self.relative, "fits": self.fits, "proven_optimal": self.proven,
            "lower_bound_s": self.lower_bound, "pp_engine": self.engine(), "note": self.note,
            "recompute": self.recompute, "recomputed": list(self.recomputed) if self.recomputed else None,
            "memory": [r.to_dict() for r in self.memory],
        }


def _one_or_many(value):
    """A per-rank or per-stage list as the grammar holds it: one entry as an int, several
    as a tuple (None stays None)."""
    if isinstance(value, (list, tuple)):
        return value[0] if len(value) == 1 else tuple(value)
    return value


def cap_label(cap):
    return tuple(cap) if isinstance(cap, (list, tuple)) else cap


def cap_text(cap) -> str:
    return "/".join(str(c) for c in cap) if isinstance(cap, tuple) else str(cap)


def fitted_caps(config: PlanConfig, split: Sequence[int], p2p: Sequence[float]) -> tuple[int, ...] | None:
    """Per-rank in-flight caps of 1F1B that fit the budget with this split: the most
    microbatches each rank's memory allows (p2p[r]: bytes set aside for its p2p buffers),
    made non-increasing along the pipeline as capped_1f1b needs. None if a rank cannot
    hold one."""
    footprints = stage_footprints(config.model, config.setup, split)
    pp, caps, running = len(split), [], config.microbatches
    for r, fp in enumerate(footprints):
        room = config.budget - fp.static_bytes - fp.grads_transient - fp.working[1] - p2p[r]
        k = int(room // fp.stash_bytes) if fp.stash_bytes > 0 else pp
        running = min(running, k, pp - r)
        if running < 1:
            return None
        caps.append(running)
    return tuple(caps)


__all__ = ["Candidate", "cap_label", "cap_text", "fitted_caps"]
