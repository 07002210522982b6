"""How much to offload: the search over offload policies within a step-time budget, by
simulation.

    choose_offload(schedule, cost, budget) the largest fraction per rank within budget
    evaluate_offload(schedule, cost, policy) one policy, simulated without and with it
    offload_counts(schedule)               stashes offloaded per rank

The pass that places OFFLOAD / RELOAD is `pipeschedule.compiler.offload.add_offload`
([Note: offload placement] there); the `--offload` spec that asks for a policy or for
this search is read by `pipeschedule.compiler.offload_spec.parse_offload`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pipeschedule.checks import check_offload_search
from pipeschedule.compiler.ir import Op, Schedule
from pipeschedule.compiler.offload import OffloadPolicy, add_offload, stash_waits, streamed
from pipeschedule.compiler.offload_spec import DEFAULT_BUDGET, AutoOffload
from pipeschedule.compiler.passes import is_lowered, lower
from pipeschedule.errors import ParameterError
from pipeschedule.simulate import CostModel, simulate

F, OFFLOAD = Op.F, Op.OFFLOAD


@dataclass(frozen=True)
class OffloadChoice:
    """What `choose_offload` found. policy / schedule: the choice and the schedule with it.
    base_step_time / step_time: simulated without and with offload; slowdown: their
    ratio - 1. peak_before / peak_after / peak_host: per-rank device peak bytes without and
    with offload, and host peak bytes with it (under the cost model given). counts: per
    rank, (stashes offloaded, stashes of the rank)."""

    policy: OffloadPolicy
    schedule: Schedule = field(repr=False)
    base_step_time: float
    step_time: float
    peak_before: tuple[float, ...]
    peak_after: tuple[float, ...]
    peak_host: tuple[float, ...]
    counts: tuple[tuple[int, int], ...]
    simulations: int = 0

    @property
    def slowdown(self) -> float:
        """step_time / base_step_time - 1; a rounding residue (|x| < 1e-12) reads 0."""
        value = self.step_time / self.base_step_time - 1 if self.base_step_time else 0.0
        return 0.0 if abs(value) < 1e-12 else value

    def to_dict(self) -> dict:
        return {
            "policy": self.policy.text(), "fraction": list(_as_tuple(self.policy.fraction, len(self.counts))),
            "lead": list(_as_tuple(self.policy.lead, len(self.counts))), "offloaded": [list(c) for c in self.counts],
            "base_step_time": float(self.base_step_time), "step_time": float(self.step_time),
            "slowdown": float(self.slowdown), "peak_bytes_before": [float(x) for x in self.peak_before],
            "peak_bytes_after": [float(x) for x in self.peak_after],
            "peak_host_bytes": [float(x) for x in self.peak_host],
        }


def _as_tuple(value, n: int) -> tuple:
    return value if isinstance(value, tuple) else (value,) * n


def offload_counts(schedule: Schedule) -> tuple[tuple[int, int], ...]:
    """Per rank: (stashes it offloads, (stage, mb) stashes it has)."""
    return tuple(
        (sum(1 for i in p if i.op is OFFLOAD and i.buf == "stash"),
         sum(1 for i in p if i.op is F)) for p in schedule.programs
    )


def evaluate_offload(schedule: Schedule, cost, policy: OffloadPolicy, base=None) -> OffloadChoice:
    """Simulates `schedule` without (or with `base`, its SimResult) and with `policy`."""
    if not is_lowered(schedule):
        schedule = lower(schedule)
    base = base or simulate(schedule, cost)
    moved = add_offload(schedule, policy)
    result = simulate(moved, policy.cost(cost))
    return OffloadChoice(policy, moved, base.step_time, result.step_time, base.peak_bytes, result.peak_bytes,
                         result.peak_host_bytes, offload_counts(moved), 2)


def choose_offload(schedule: Schedule, cost=None, budget: float | AutoOffload = DEFAULT_BUDGET) -> OffloadChoice:
    """Per rank, the offload that lowers its simulated device peak the most while the step
    time stays within `budget` of the schedule's without offload (0.03: at most 3% slower).

    [Note: offload search] Ranks are taken in turn from rank 0 (the ranks before keep
    their choice). For each, fractions k/8 of its stashes (every count when it has fewer
    than 8) are tried with each lead of `AutoOffload.leads`, smallest first, stopping a
    lead at the first count over budget (more offload is never faster). The winner has
    the least device peak on the rank, then the least step time, then the largest
    fraction, then the smallest lead; a rank whose peak no choice lowers offloads nothing. The peak, not the
    fraction, is what is wanted: a stash reloaded too early can raise it.
    Input: a schedule (lowered or not) without offload.
    """
    auto = budget if isinstance(budget, AutoOffload) else AutoOffload(budget=budget)
    if not is_lowered(schedule):
        schedule = lower(schedule)
    cost = cost or CostModel.default(schedule)
    pp = schedule.pp
    ranks = range(pp) if auto.ranks is None else auto.ranks
    bad = [r for r in ranks if r >= pp]
    if bad:
        raise ParameterError(f"offload ranks {bad} are not ranks of the schedule (0..{pp - 1})")
    check_offload_search(len(ranks), len(auto.leads), schedule.num_stages * schedule.microbatches)
    base = simulate(schedule, cost)
    limit = base.step_time * (1 + auto.budget)
    trial_cost = streamed(cost, auto.chunk)
    sizes = [len(stash_waits(p)) for p in schedule.programs]
    fractions, leads = [0.0] * pp, [0] * pp
    runs = 1
    for rank in ranks:
        n = sizes[rank]
        counts = sorted({n * k // 8 for k in range(1, 9)} - {0}) if n >= 8 else list(range(1, n + 1))
        best = (base.peak_bytes[rank], base.step_time, 0, 0)  # (peak, step time, -count, lead): least is best
        for lead in sorted(auto.leads):
            for count in counts:
                trial_f, trial_l = list(fractions), list(leads)
                trial_f[rank], trial_l[rank] = count / n, lead
                result = simulate(add_offload(schedule, OffloadPolicy(tuple(trial_f), None, tuple(trial_l))),
                                  trial_cost)
                runs += 1
                if result.step_time > limit:
                    break
                if result.peak_bytes[rank] < base.peak_bytes[rank]:
                    best = min(best, (result.peak_bytes[rank], result.step_time, -count, lead))
        if best[2]:
            fractions[rank], leads[rank] = -best[2] / n, best[3]
    policy = OffloadPolicy(tuple(fractions), None, tuple(leads), auto.chunk)
    choice = evaluate_offload(schedule, cost, policy, base)
    return replace(choice, simulations=runs + 1)


__all__ = ["OffloadChoice", "choose_offload", "evaluate_offload", "offload_counts"]
