"""A plan's candidates evaluated: one schedule at one split, its memory per rank and its
step time (`Evaluator.evaluate`), or at every split at once, as the problem the split
search solves (`Evaluator.problem`); and the engines one config names, evaluated alike
(nanotron's default, `engine_memory` for `pipeschedule check`).

[Note: a candidate's evaluation] A rank's activations are the simulated peak of its
stages' stashes together, which live from F to W under a split backward (memory.py); the
step time is the simulated pipeline (pipeschedule.simulate) plus the tail after it
([Note: step tail] in dp_step.py). Both come from each schedule's step graph and program
order ([Note: step graph], [Note: peaks from program order]), built once per schedule
(schedule_cache.py) and equal to what `simulate` gives. `evaluate` works in that order:
the bytes of each stage's buffers (memory.py), their costs and the tail (stage_costs.py),
the simulated peaks and step (schedule_cache.py), then the memory table of each rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pipeschedule.compiler.ir import Schedule
from pipeschedule.errors import ParameterError
from pipeschedule.plan.candidate import Candidate, cap_label
from pipeschedule.plan.config import PlanConfig
from pipeschedule.plan.fitting import offloaded
from pipeschedule.plan.memory import (
    StageFootprint,
    head_stash,
    layer_activation_bytes,
    p2p_buffers,
    rank_memory,
    stage_footprints,
    stage_params,
    stash_buffers,
    static_per_param,
    transient_per_param,
    weight_stash_bytes,
    weight_stash_layer,
)
from pipeschedule.plan.partition import SplitProblem
from pipeschedule.plan.peaks import Peaks
from pipeschedule.plan.schedule_cache import Key, ScheduleCache, schedule_key
from pipeschedule.plan.stage_costs import StageCosts
from pipeschedule.plan.step_graph import StepGraph
from pipeschedule.simulate import CostModel


class Evaluator(StageCosts):
    """Evaluates candidates of one config, taking schedules from `cache` (which plans of the
    same pp and microbatches may share); `used`: the schedules asked for, `stats`: the
    evaluations and the simulations their peaks stand for. What the levers call it by is
    `fitting.Planner`."""

    def __init__(self, config: PlanConfig, schedules: ScheduleCache | None = None) -> None:
        super().__init__(config)
        if schedules is None:
            schedules = ScheduleCache(config.pp, config.microbatches)
        elif (schedules.pp, schedules.microbatches) != (config.pp, config.microbatches):
            raise ParameterError(f"a schedule cache of pp={schedules.pp}, {schedules.microbatches} microbatches "
                                 f"cannot serve a plan of pp={config.pp}, {config.microbatches} microbatches")
        self.cache = schedules
        self.used: set = set()  # the (family, cap, virtual) this plan asked for
        self.stats = {"evaluations": 0, "simulations": 0}

    def use(self, family: str, cap, virtual: int) -> Key:
        """The key of a schedule this plan asks for (counted in `used`)."""
        key = schedule_key(family, cap, virtual)
        self.used.add(key)
        return key

    def schedule(self, family: str, cap, virtual: int) -> Schedule:
        return self.cache.schedule(self.use(family, cap, virtual))

    def graph(self, family: str, cap, virtual: int) -> tuple[StepGraph, Peaks]:
        """The schedule's step graph and peaks ([Note: step graph], [Note: peaks from
        program order]): its simulated step times, chains and peaks under any costs."""
        return self.cache.graph(self.use(family, cap, virtual))

    def step(self, family: str, cap, virtual: int, cost: CostModel) -> float:
        """simulate(schedule, cost).step_time, from the step graph."""
        return self.cache.step(self.use(family, cap, virtual), cost)

    def peaks(self, family: str, cap, virtual: int, cost: CostModel) -> tuple[tuple, tuple]:
        """(peak_bytes, peak_inflight) of simulate(schedule, cost), from program order
        (counted as the simulation it stands for; `step` of the same cost is not counted again)."""
        self.stats["simulations"] += 1
        return self.cache.peaks(self.use(family, cap, virtual), cost)

    def evaluate(self, family: str, cap, virtual: int, split: Sequence[int], kind: str, proven=None,
                 recomputed: Sequence[int] | None = None) -> Candidate:
        """One candidate's memory table and step time ([Note: a candidate's evaluation]);
        recomputed: layers per stage that recompute on top of the setup's mode ([Note:
        partial recompute])."""
        config, key = self.config, self.use(family, cap, virtual)
        self.stats["evaluations"] += 1
        schedule = self.cache.schedule(key)
        sb = schedule.split_backward
        footprints = stage_footprints(config.model, config.setup, split, recomputed)
        stash, p2p = stash_buffers(footprints), p2p_buffers(footprints)
        kept = tuple(weight_stash_bytes(config.model, config.setup, fp.layers, last=fp.last,
                                        recomputed=fp.recomputed) for fp in footprints) if sb else None
        grads_at_backward_end = transient_per_param(config.setup)  # [Note: memory terms]: nanotron's engines
        stash_cost = self.cost(split, stash, sb, recomputed)
        if sb:
            stash_cost = replace(stash_cost, weight_stash=kept)
        # Messages are timed from act_out and grad_in, which p2p_buffers sets to the boundary
        # as the timing cost does: this cost is also the step's timing.
        p2p_cost = self.cost(split, p2p, sb, recomputed)
        tail, parts = self.tail(schedule, split, recomputed)
        shared = self.shared(schedule)
        self.stats["simulations"] += 2  # the two peaks, each counted as the simulation it stands for
        peak_stash, peak_inflight = self.cache.peaks(key, stash_cost)
        peak_p2p = self.cache.peaks(key, p2p_cost)[0]
        pipeline = self.cache.step(key, p2p_cost)
        backward_end = self.cache.at_backward_ends(key, stash_cost) if grads_at_backward_end else None
        memory = rank_memory(footprints, schedule.placement, peak_stash=peak_stash, peak_p2p=peak_p2p,
                             peak_inflight=peak_inflight, budget=config.budget, setup=config.setup,
                             shared=shared, peak_backward_end=backward_end)
        step = pipeline + tail
        return Candidate(family, cap_label(cap), virtual, tuple(split), kind, step,
                         config.tokens_per_gpu / step, tuple(memory), proven, pipeline_time=pipeline,
                         tail=parts, recompute=config.setup.recompute,
                         recomputed=tuple(recomputed) if recomputed and any(recomputed) else None)

    def problem(self, family: str, cap, virtual: int) -> SplitProblem:
        """The split problem of `optimal_split` with this planner's costs and memory: what
        `evaluate` counts, for every split at once."""
        model, setup = self.config.model, self.config.setup
        schedule = self.schedule(family, cap, virtual)
        S, L = schedule.num_stages, model.layers
        per_param = sum(static_per_param(setup).values()) + transient_per_param(setup)
        head = float(sum(head_stash(model, setup).values()))
        layer_stash = float(layer_activation_bytes(model, setup))
        if schedule.split_backward and setup.recompute != "full":
            layer_stash = max(layer_stash, float(weight_stash_layer(model, setup)))  # a bound: W may keep more
        # a stage's own parameters beside its layers: the embedding on the first, the head on the last
        static = [per_param * stage_params(model, 0, first=s == 0, last=s == S - 1, tp=setup.tp) for s in range(S)]
        probe = stage_footprints(model, setup, [1] * S)  # split-free parts: boundaries, working sets
        probe_p2p = p2p_buffers(probe)
        (f, b, w), (hf, hb, hw) = self.compute_costs(schedule.split_backward)
        static[-1] -= per_param * self.shared(schedule)[schedule.placement[-1]]  # a tied head on stage 0's rank
        p2p = self.peaks(family, cap, virtual, self.cost([1] * S, probe_p2p, schedule.split_backward))[0]
        tails = self.rank_tails_of(schedule)
        return SplitProblem(
            layer_forward=(f,) * L, layer_backward=(b,) * L, layer_weight=(w,) * L,
            stage_forward=(0.0,) * (S - 1) + (hf,), stage_backward=(0.0,) * (S - 1) + (hb,),
            stage_weight=(0.0,) * (S - 1) + (hw,),
            layer_static=(per_param * model.layer_params(setup.tp),) * L,
            layer_stash=(layer_stash,) * L,
            stage_static=tuple(static), stage_stash=(0.0,) * (S - 1) + (head,),
            rank_bytes=tuple(p + w for p, w in zip(p2p, _rank_working(probe, schedule))),
            budget=(self.config.budget,) * schedule.pp, boundary=(float(self.boundary),) * S,
            latency=self.config.p2p_latency, bandwidth=self.config.p2p_bandwidth,
            rank_tail=lambda rank, layers: tails[rank](layers),
        )


def _rank_working(probe: Sequence[StageFootprint], schedule: Schedule) -> list[float]:
    """Per rank, the largest working set of its stages with one parameter's gradient beside
    it, as rank_memory adds them (`probe`: the footprints of one layer per stage)."""
    working = [0.0] * schedule.pp
    one_grad = [0] * schedule.pp
    for s, fp in enumerate(probe):
        r = schedule.placement[s]
        working[r] = max(working[r], fp.working[1])
        one_grad[r] = max(one_grad[r], fp.one_grad)
    return [w + g for w, g in zip(working, one_grad)]


def nanotron_default(config: PlanConfig, schedules: ScheduleCache, split: Sequence[int]) -> Candidate:
    """nanotron's own 1F1B engine with `split`: its schedule, and its gradient folding after
    each backward ([Note: memory terms], `grad_fold="backward"`)."""
    nanotron = replace(config, setup=replace(config.setup, grad_fold="backward"))
    return replace(Evaluator(nanotron, schedules).evaluate("1f1b", None, 1, split, "nanotron"), nanotron_engine=True)


def evaluate_engine(evaluator: Evaluator, engine: str, family: str, cap, virtual: int, split: Sequence[int],
                    kind: str = "measured", recomputed: Sequence[int] | None = None) -> Candidate:
    """A candidate as the `pp_engine` named `engine` runs it: nanotron's own engines
    (`1f1b`, `afab`) fold gradients after each backward ([Note: memory terms]), every other
    name is pipeschedule's. recomputed: decoder layers per stage the engine recomputes
    (its `recompute=`). For comparisons with measured runs."""
    if engine in ("1f1b", "afab"):
        nanotron = replace(evaluator.config, setup=replace(evaluator.config.setup, grad_fold="backward"))
        return replace(Evaluator(nanotron, evaluator.cache).evaluate(family, cap, virtual, split, kind, None,
                                                                     recomputed), nanotron_engine=True)
    return evaluator.evaluate(family, cap, virtual, split, kind, None, recomputed)


def engine_memory(config: PlanConfig, engine: str, family: str, cap, virtual: int, split: Sequence[int], *,
                  recomputed: Sequence[int] | None = None, offload: Sequence[int] | None = None,
                  stream: int | None = None) -> Candidate:
    """`evaluate_engine` under `config` alone (an evaluator of its own): the memory per rank
    and the step time of the one engine a config names (`pipeschedule check`), with the
    stashes of `offload`'s ranks on the host as the planner counts them (`fitting.offloaded`,
    streamed in `stream` MiB chunks) where the GPU's host link is known."""
    evaluator = Evaluator(config)
    cand = evaluate_engine(evaluator, engine, family, cap, virtual, split, "given", recomputed)
    if offload and config.host_bandwidth is not None:
        return offloaded(evaluator, cand, tuple(offload), stream)
    return cand


__all__ = ["Evaluator", "engine_memory", "evaluate_engine", "nanotron_default"]
