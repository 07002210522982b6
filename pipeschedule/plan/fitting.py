"""Rows that fit only with a lever pulled on top of a candidate: partial recompute (the
fewest layers per stage to recompute) and host offload (whole ranks' stashes, moved whole
or streamed). `lever_rows(planner, candidates)` adds both to a plan's candidates;
`virtual_tried(planner)` says at which chunk counts interleaving is tried.

[Note: partial recompute] The engine's `recompute=N0/N1/..` reruns the first N_s decoder
layers of stage s in B. Each recomputed layer keeps only its input, saving
(stash - input) per microbatch in flight on its stage; its rerun adds one layer's stash
to the working set and one layer forward to B (under a split backward also its weight
gradients, which then leave W). `fitted_recompute` raises the counts rank by rank, over
the rank's stages in turn (interleaved and V shapes hold several), until every rank fits
or every layer recomputes. It applies to every family and split the planner lists, when
the setup itself recomputes nothing.

[Note: offload lever] The engine's `offload=RANKS[,stream=MiB]` moves every stash of the
listed ranks to host memory after its F and back before its B (fraction 1, lead 1,
[Note: pp_engine syntax] in compiler/spec.py). For a row that does not fit, the ranks that
overflow are offloaded, once with stashes moved whole and once streamed in chunks of
STREAM_MIB; the device peak of saved activations is the simulator's with the OFFLOAD /
RELOAD instructions in place (streamed: at least one stash, [Note: streamed offload floor]
in plan/offload.py) and the step time its run with the stash copies timed over
the GPU's host link ([Note: simulated streaming] in simulate/engine.py). The faster of
the two that fits is listed. `config.host_memory`, when given, bounds the simulated
peak each rank keeps on the host. Before simulating, `least_offloaded` counts each
offloading rank with its largest stash on the device (each F's stash is there until its
copy lands): where that is over the budget neither way fits, and the row is dropped with
that floor as its reason, two simulations spared.

[Note: lever bound] Neither lever makes a step faster: recompute adds a forward to B and
offload adds copies the compute may wait for. So a row is tried only when its own step
time, without the lever, beats the fastest row that already fits; the others are counted
in the plan's `dropped` with that reason.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from pipeschedule.compiler.offload import MIB, OffloadPolicy, add_offload
from pipeschedule.compiler.spec import ScheduleSpec
from pipeschedule.errors import ParameterError
from pipeschedule.compiler.ir import Schedule
from pipeschedule.plan.candidate import Candidate
from pipeschedule.plan.config import PlanConfig, virtual_counts
from pipeschedule.plan.memory import (
    ACTIVATIONS,
    P2P,
    GiB,
    layer_activation_bytes,
    p2p_buffers,
    rank_memory,
    stage_footprints,
    stash_buffers,
)
from pipeschedule.plan.offload import streamed_device_peak
from pipeschedule.plan.partition import nanotron_split
from pipeschedule.plan.schedule_cache import ScheduleCache
from pipeschedule.simulate import CostModel, simulate

STREAM_MIB = 256  # chunk of streamed offload the planner tries: a few per layer stash of a large model


class Planner(Protocol):
    """What the levers need of a plan's planner (`evaluation.Evaluator` is one): its config,
    its schedules and their memo, the candidate evaluation and the costs, step times and
    tails it times them by."""

    config: PlanConfig
    cache: ScheduleCache  # `schedule(key)` and `offload_memo`

    def schedule(self, family: str, cap, virtual: int) -> Schedule: ...

    def evaluate(self, family: str, cap, virtual: int, split: Sequence[int], kind: str, proven=None,
                 recomputed: Sequence[int] | None = None) -> Candidate: ...

    def cost(self, split: Sequence[int], buffers=None, split_backward: bool = False,
             recomputed: Sequence[int] | None = None) -> CostModel: ...

    def step(self, family: str, cap, virtual: int, cost: CostModel) -> float: ...

    def tail(self, schedule: Schedule, split: Sequence[int],
             recomputed: Sequence[int] | None = None) -> tuple[float, dict]: ...

    def shared(self, schedule: Schedule) -> tuple[int, ...]: ...
ROUNDS = 6  # evaluations per fitted_recompute: each raises every overflowing rank's counts


@dataclass(frozen=True)
class OffloadCandidate(Candidate):
    """A candidate run with host offload ([Note: offload lever]): `offload` the ranks whose
    stashes all go to host memory, `stream` the chunk in MiB (None: stashes move whole),
    `host_bytes` the simulated peak per rank of what lies on the host."""

    offload: tuple[int, ...] = ()
    stream: int | None = None
    host_bytes: tuple[float, ...] = ()

    @property
    def label(self) -> str:
        stream = f" s{self.stream}" if self.stream else ""
        return super().label + " off=" + "/".join(map(str, self.offload)) + stream

    def spec(self, nanotron_default: bool = False) -> ScheduleSpec:
        """The candidate's value with its offload (and stream) inside; always pipeschedule's
        engine (nanotron's own has no offload)."""
        return replace(super().spec(False), offload=tuple(self.offload), stream=self.stream or None)

    def to_dict(self) -> dict:
        return super().to_dict() | {"pp_engine": self.engine(), "offload": list(self.offload),
                                    "stream_mib": self.stream, "host_bytes": [float(x) for x in self.host_bytes]}


def fitted_recompute(planner: Planner, cand: Candidate) -> Candidate | None:
    """[Note: partial recompute]: the fewest layers per stage to recompute for `cand` (a row
    of the setup without recompute, evaluated) to fit; None when it cannot fit."""
    config = planner.config
    model, setup = config.model, config.setup
    saving = layer_activation_bytes(model, setup) - layer_activation_bytes(model, setup, recompute="full")
    placement = planner.schedule(cand.family, cand.cap, cand.virtual).placement
    split = cand.split
    counts = [0] * len(split)
    for _ in range(ROUNDS):
        if cand.fits:
            return replace(cand, note="recomputes the first N_s layers of each stage")
        if all(c == n for c, n in zip(counts, split)):
            return None
        for r, mem in enumerate(cand.memory):
            if mem.overflow <= 0:
                continue
            stages = [s for s, rank in enumerate(placement) if rank == r]
            rerun = layer_activation_bytes(model, setup) if not any(counts[s] for s in stages) else 0
            per_layer = saving * max(1.0, mem.inflight / len(stages))  # stage-microbatches in flight per stage
            _raise(counts, split, stages, math.ceil((mem.overflow + rerun) / per_layer))
        cand = planner.evaluate(cand.family, cand.cap, cand.virtual, split, cand.split_kind, cand.proven,
                                recomputed=tuple(counts))
    return replace(cand, note="recomputes the first N_s layers of each stage") if cand.fits else None


def _raise(counts: list, split: Sequence[int], stages: Sequence[int], more: int) -> None:
    """Adds `more` recomputed layers over `stages`, one at a time in turn, none past a
    stage's layers."""
    while more > 0 and any(counts[s] < split[s] for s in stages):
        for s in stages:
            if more > 0 and counts[s] < split[s]:
                counts[s] += 1
                more -= 1


def offloaded(planner: Planner, cand: Candidate, ranks: Sequence[int], stream: int | None) -> OffloadCandidate:
    """`cand` (evaluated, one stage's stash per (stage, mb)) with every stash of `ranks`
    offloaded ([Note: offload lever]); memory and step time as `Evaluator.evaluate` counts
    them, the saved activations and the pipeline time simulated with the offload."""
    config = planner.config
    schedule = planner.schedule(cand.family, cand.cap, cand.virtual)
    policy = OffloadPolicy(1.0, tuple(ranks), 1, None if stream is None else stream * MIB)
    footprints = stage_footprints(config.model, config.setup, cand.split, cand.recomputed)
    link = dict(offload_bandwidth=config.host_bandwidth, reload_bandwidth=config.host_bandwidth)
    stashes = stash_buffers(footprints)
    cost = replace(planner.cost(cand.split, stashes, False, cand.recomputed), **link)
    timing_cost = replace(planner.cost(cand.split, p2p_buffers(footprints) | stashes, False,
                                       cand.recomputed), **link)
    key = (cand.family, cand.cap, cand.virtual)
    stash, step_time = planner.cache.offload_memo.get(
        (key, policy, cost, timing_cost), lambda: _offload_runs(planner.cache.schedule(key), policy, cost, timing_cost))
    peak_stash = list(stash.peak_bytes)
    if stream is not None:  # [Note: streamed offload floor]
        for r in ranks:
            mine = [stashes["stash"][s] for s, owner in enumerate(schedule.placement) if owner == r]
            peak_stash[r] = streamed_device_peak(peak_stash[r], mine)
    memory = rank_memory(footprints, schedule.placement, peak_stash=peak_stash,
                         peak_p2p=[r.terms[P2P] for r in cand.memory], peak_inflight=stash.peak_inflight,
                         budget=config.budget, setup=config.setup, shared=planner.shared(schedule))
    tail, parts = planner.tail(schedule, cand.split, cand.recomputed)
    step = step_time + tail
    slower = step_time / cand.pipeline_time - 1
    note = (f"stashes of rank{'s' if len(ranks) > 1 else ''} {'/'.join(map(str, ranks))} on the host "
            f"({', '.join(f'{b / GiB:.1f}' for b in stash.peak_host_bytes)} GiB per rank), "
            f"{'streamed in ' + str(stream) + ' MiB chunks' if stream else 'moved whole'}: pipeline {slower:+.1%}")
    return OffloadCandidate(cand.family, cand.cap, cand.virtual, cand.split, cand.split_kind, step,
                            config.tokens_per_gpu / step, tuple(memory), cand.proven, note, None,
                            step_time, parts, cand.recompute, cand.recomputed,
                            offload=tuple(ranks), stream=stream, host_bytes=tuple(stash.peak_host_bytes))


@dataclass(frozen=True)
class _StashRun:
    """What `offloaded` reads of the simulation of the saved activations."""

    peak_bytes: tuple
    peak_inflight: tuple
    peak_host_bytes: tuple


def _offload_runs(schedule, policy: OffloadPolicy, cost, timing_cost) -> tuple[_StashRun, float]:
    """The two simulations of `schedule` with `policy`'s offload: the saved activations
    under `cost` and the step time under `timing_cost` ([Note: offload lever]), kept by
    the planner across the plans of a run ([Note: run-wide memos] in memo.py)."""
    moved = add_offload(schedule, policy)
    stash = simulate(moved, policy.cost(cost))
    timing = simulate(moved, policy.cost(timing_cost))
    return _StashRun(stash.peak_bytes, stash.peak_inflight, stash.peak_host_bytes), timing.step_time


def fitted_offload(planner: Planner, cand: Candidate) -> tuple[OffloadCandidate | None, str]:
    """Offload of `cand`'s overflowing ranks that fits ([Note: offload lever]): stashes
    moved whole, else streamed; or None and why not. A rank whose memory without any
    activation is already over the budget rules offload out without a simulation."""
    over = [r for r in cand.memory if not r.fits]
    floor = max(over, key=lambda r: r.total - r.terms.get(ACTIVATIONS, 0.0))
    excess = floor.total - floor.terms.get(ACTIVATIONS, 0.0) - floor.budget
    head = f"{cand.label} split {'/'.join(map(str, cand.split))}"
    if excess > 0:
        return None, f"{head}: rank {floor.rank} is {excess / GiB:.1f} GiB over without any activation"
    ranks = tuple(r.rank for r in over)
    floor = least_offloaded(planner, cand, ranks)
    if floor is not None:
        return None, (f"{head}: with every stash of ranks {'/'.join(map(str, ranks))} on the host, rank "
                      f"{floor.rank} is still at least {floor.overflow / GiB:.1f} GiB over (the largest stash "
                      f"of its stages is on the device until its copy lands)")
    bound = planner.config.host_memory
    for stream in (None, STREAM_MIB):  # streamed holds less on the device and simulates slower
        row = offloaded(planner, cand, ranks, stream)
        if bound is not None and max(row.host_bytes) > bound:
            r = row.host_bytes.index(max(row.host_bytes))
            return None, (f"{head}: rank {r} would keep {max(row.host_bytes) / GiB:.1f} GiB on the host, over "
                          f"--host-memory {bound / GiB:g} GiB")
        if row.fits:
            return row, ""
    return None, (f"{head}: with every stash of ranks {'/'.join(map(str, ranks))} on the host, streamed, rank "
                  f"{row.peak.rank} is still {row.peak.overflow / GiB:.1f} GiB over")


def least_offloaded(planner: Planner, cand: Candidate, ranks: Sequence[int]):
    """The RankMemory of the rank of `ranks` furthest over the budget however its stashes
    go to the host, or None where none need be: each F leaves its stash on the device
    until the copy lands, so an offloading rank holds at least its stages' largest stash
    (moved whole or streamed: [Note: streamed offload floor]), and a rank's total grows
    with its saved activations. Spares `offloaded` two simulations that cannot fit."""
    config = planner.config
    schedule = planner.schedule(cand.family, cand.cap, cand.virtual)
    footprints = stage_footprints(config.model, config.setup, cand.split, cand.recomputed)
    stash = stash_buffers(footprints)["stash"]
    peak = [r.terms[ACTIVATIONS] for r in cand.memory]
    for r in ranks:
        peak[r] = max(stash[s] for s, owner in enumerate(schedule.placement) if owner == r)
    memory = rank_memory(footprints, schedule.placement, peak_stash=peak, peak_p2p=[r.terms[P2P] for r in cand.memory],
                         peak_inflight=[r.inflight for r in cand.memory], budget=config.budget, setup=config.setup,
                         shared=planner.shared(schedule))
    return max((memory[r] for r in ranks if not memory[r].fits), key=lambda m: m.overflow, default=None)


def _unevaluated(planner: Planner, cand: Candidate) -> Candidate | None:
    """`cand` with its memory table: evaluated at its split when the split search left it
    without numbers (no split fits)."""
    if cand.memory:
        return cand
    if cand.split is None:
        return None
    return planner.evaluate(cand.family, cand.cap, cand.virtual, cand.split, cand.split_kind, cand.proven)


def lever_rows(planner: Planner, candidates: Sequence[Candidate]) -> tuple[list[Candidate], list[tuple[str, str]]]:
    """Rows fitted with partial recompute or offload ([Note: partial recompute], [Note:
    offload lever]) for the candidates that do not fit and could beat the fastest that
    does ([Note: lever bound]), the fastest first; and (lever, why) for what was not tried
    or did not fit. Where offload may not be recommended ([Note: offload advice] in
    config.py), an offload row bounds only the offload tried after it: the plan shows the
    fastest as an option."""
    config = planner.config
    fastest = min((c.step_time for c in candidates if c.fits), default=math.inf)
    offered = math.inf  # the fastest offload row that is an option only
    rows, dropped, pruned, seen, unmodelled = [], [], 0, set(), []
    offload_known = config.host_bandwidth is not None
    todo = [c for c in candidates if not c.fits and c.split is not None]
    todo = sorted(filter(None, (_unevaluated(planner, c) for c in todo)), key=lambda c: c.step_time)
    for cand in todo:  # the fastest first: a fit found lowers the bound for the rest
        key = (cand.family, cand.cap, cand.virtual, cand.split)
        if key in seen:
            continue
        seen.add(key)
        if cand.step_time >= fastest:
            pruned += 1
            continue
        fitted = [fitted_recompute(planner, cand)] if config.setup.recompute == "none" else []
        split_backward = planner.schedule(cand.family, cand.cap, cand.virtual).split_backward
        if offload_known and split_backward:
            unmodelled.append(cand.label)
        elif offload_known and cand.step_time < offered:
            row, why = fitted_offload(planner, cand)
            fitted.append(row)
            if row is None:
                dropped.append(("offload", why))
        for row in filter(None, fitted):
            rows.append(row)
            if config.offload_recommendable or not isinstance(row, OffloadCandidate):
                fastest = min(fastest, row.step_time)
            else:
                offered = min(offered, row.step_time)
    if pruned:
        dropped.append(("partial recompute, offload",
                        f"not tried on {pruned} row{'s' if pruned > 1 else ''} that do not fit and are no faster "
                        f"than the fastest row that fits (neither lever makes a step faster)"))
    if not offload_known:
        dropped.append(("offload", f"the host link of {config.gpu_name} is unknown: give --host-bandwidth GB/s"))
    if unmodelled:
        dropped.append(("offload", f"not tried on {', '.join(dict.fromkeys(unmodelled))}: under a split backward the "
                                   "simulator does not model offload together with the stash kept from B to W"))
    return rows, dropped


def virtual_tried(planner: Planner) -> tuple[tuple[int, ...], tuple[tuple[str, str], ...]]:
    """[Note: virtual counts]: the chunk counts per rank the interleaved candidates are
    tried at, and (candidate, why) for the others up to `config.virtual`: the counts that
    give every chunk a layer (`config.virtual_counts`), from the fewest up, stopping at
    the first whose pipeline at nanotron's split, timed with the planner's costs, is no
    faster than the count's before it (more chunks shorten the bubble and add messages;
    past the best count the messages win). A count nanotron cannot split is kept,
    untimed: the split search alone tries it."""
    config = planner.config
    counts, dropped = virtual_counts(config)
    tried, before = [], math.inf
    for i, v in enumerate(counts):
        try:
            split = nanotron_split(config.model, config.pp * v)
        except ParameterError:  # no nanotron split to time it by: the split search alone tries it
            tried.append(v)
            continue
        time = planner.step("interleaved_1f1b", None, v, planner.cost(split))
        if time >= before:
            why = (f"its pipeline at nanotron's split ({time:.2f} s) is no faster than v={tried[-1]}'s "
                   f"({before:.2f} s)")
            dropped += ((f"interleaved_1f1b v={v}", why),) + tuple(
                (f"interleaved_1f1b v={w}", f"not tried past v={v}, which is no faster than v={tried[-1]}")
                for w in counts[i + 1:])
            break
        tried.append(v)
        before = time
    return tuple(tried), dropped


__all__ = ["OffloadCandidate", "STREAM_MIB", "fitted_offload", "fitted_recompute", "least_offloaded", "lever_rows",
           "offloaded", "virtual_tried"]
