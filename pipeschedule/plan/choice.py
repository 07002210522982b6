"""A plan's choice among its rows: their tokens/s against nanotron's default (`relative`),
the recommendation and the offload option among them (`chosen`), and what host offload adds
to the recommendation (`offload_report`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pipeschedule.compiler.offload_spec import AutoOffload
from pipeschedule.plan.candidate import Candidate
from pipeschedule.plan.config import PlanConfig
from pipeschedule.plan.fitting import OffloadCandidate, Planner
from pipeschedule.plan.memory import stage_footprints, stash_buffers
from pipeschedule.simulate import simulate
from pipeschedule.simulate.offload_search import choose_offload, evaluate_offload


def relative(candidates: Sequence[Candidate], default: Candidate) -> list[Candidate]:
    """`candidates` with their tokens/s per GPU relative to `default`'s."""
    base = default.tokens_per_gpu
    return [replace(c, relative=c.tokens_per_gpu / base if c.tokens_per_gpu else None) for c in candidates]


def chosen(config: PlanConfig, candidates: Sequence[Candidate]) -> tuple[Candidate | None, Candidate | None]:
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


def offload_report(planner: Planner, candidate: Candidate) -> dict:
    """What host offload ([Note: offload placement] in compiler/offload.py) adds to `candidate`
    under `config.offload`, over a host link of `config.host_bandwidth` per direction:
    the policy (chosen by `choose_offload` for an AutoOffload), the step time with and
    without it (boundary messages and stash copies timed), and per rank the simulated
    peak of saved activations without and with it. `tightest` is the rank with the least
    headroom, where the saving matters."""
    config = planner.config
    schedule = planner.schedule(candidate.family, candidate.cap, candidate.virtual)
    sb = schedule.split_backward
    stash = stash_buffers(stage_footprints(config.model, config.setup, candidate.split))
    link = dict(offload_bandwidth=config.host_bandwidth, reload_bandwidth=config.host_bandwidth)
    timing = planner.cost(candidate.split, split_backward=sb)
    stash_cost = replace(planner.cost(candidate.split, stash, sb), **link)
    both = replace(timing, buffer_bytes=dict(timing.buffer_bytes) | stash, **link)
    if isinstance(config.offload, AutoOffload):
        choice = choose_offload(schedule, both, config.offload)
    else:
        choice = evaluate_offload(schedule, both, config.offload)
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


__all__ = ["chosen", "offload_report", "relative"]
