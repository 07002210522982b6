"""How much to offload: the search over offload policies within a step-time budget, and
the `--offload` spec that asks for a policy or for the search.

    choose_offload(schedule, cost, budget) the largest fraction per rank within budget
    streamed_device_peak(simulated, stashes) what a planner counts on a streaming rank
    evaluate_offload(schedule, cost, policy) one policy, simulated without and with it
    parse_offload(text)                    `fraction=F[,lead=L]...` or `auto[,budget=B]...`

The pass that places OFFLOAD / RELOAD is `pipeschedule.compiler.offload.add_offload`
([Note: offload placement] there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from pipeschedule.checks import check_number, check_offload_search, is_int, parse_int, parse_number, shown
from pipeschedule.compiler.ir import Op, Schedule
from pipeschedule.compiler.offload import (
    MIB,
    OffloadPolicy,
    add_offload,
    check_chunk,
    stash_waits,
    streamed,
)
from pipeschedule.compiler.passes import is_lowered, lower
from pipeschedule.errors import ParameterError
from pipeschedule.simulate import CostModel, simulate

F, OFFLOAD = Op.F, Op.OFFLOAD
DEFAULT_BUDGET = 0.03
DEFAULT_LEADS = (0, 1, 2, 3, 4)


def streamed_device_peak(simulated: float, stashes: Sequence[float]) -> float:
    """The device bytes a planner counts for the saved activations of a rank that streams
    its stashes to host memory: the simulator's peak, but at least the largest stash of
    one (stage, microbatch) of the rank.

    [Note: streamed offload floor] Measured on the H200 (benchmarks/results/
    auto_engine_offload_rules.md: nanotron's Llama, pp=4 as four ranks on one GPU, 64 MiB
    chunks), the runtime kept 0.45 of stage 0's stash on the device where the simulator
    said 0.15 for the same run (it does not see the chunks that wait for their copy's event
    while others are copied, nor ranks sharing a link). Both the planner and `pp_engine:
    auto` therefore count an offloading rank with one whole stash: an upper bound on what
    was measured, so what they say fits did fit.
    """
    return max(simulated, max(stashes, default=0.0))


MAX_BUDGET = 100.0  # a step-time budget beyond it allows any offload (1e300 printed a 300-digit percentage)


@dataclass(frozen=True)
class AutoOffload:
    """`choose_offload`'s request: the step-time budget (a fraction: 0.03 allows 3% over
    the schedule without offload), the ranks it may offload (None: all), the leads tried."""

    budget: float = DEFAULT_BUDGET
    ranks: tuple[int, ...] | None = None
    leads: tuple[int, ...] = DEFAULT_LEADS
    chunk: float | None = None

    def __post_init__(self) -> None:
        check_chunk(self.chunk)
        check_number("offload budget", self.budget, hint=" (0.03 = 3% slower at most)")
        if self.budget > MAX_BUDGET:
            raise ParameterError(f"offload budget {shown(self.budget)} allows a step {self.budget:.3g} times "
                                 f"slower; at most {MAX_BUDGET:g} (the step {MAX_BUDGET:g}x slower) is accepted")
        OffloadPolicy(ranks=self.ranks)  # same checks
        if not self.leads or not all(is_int(x) and x >= 0 for x in self.leads):
            raise ParameterError(f"offload leads must be integers >= 0, got {shown(self.leads)}")


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


# -- the --offload spec ---------------------------------------------------------------------------


def parse_offload(text: str) -> OffloadPolicy | AutoOffload:
    """`--offload` values: `fraction=F[,lead=L][,ranks=R0/R1..][,stream=MiB]` (F and L may
    be one per rank, F0/F1/..) or `auto[,budget=B][,ranks=..][,stream=MiB]`; stream= sets
    the chunk of streamed stashes in MiB. Raises ParameterError naming the part that is
    wrong and what is accepted."""
    accepted = ("accepted: fraction=F[,lead=L][,ranks=R0/R1..][,stream=MiB] with F in [0, 1] (or F0/F1/.. per rank), "
                "or auto[,budget=B][,ranks=..][,stream=MiB]")
    if not isinstance(text, str) or not text.strip():
        raise ParameterError(f"--offload needs a value, got {shown(text)}; {accepted}")
    parts = [p.strip() for p in text.split(",")]
    auto = parts[0] == "auto"
    if auto:
        parts = parts[1:]
    values: dict[str, str] = {}
    allowed = ("budget", "ranks", "stream") if auto else ("fraction", "lead", "ranks", "stream")
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or key not in allowed or key in values or not value:
            raise ParameterError(f"--offload {shown(text)}: cannot read {shown(part)}; {accepted}")
        values[key] = value

    def numbers(key: str, kind):
        parse = parse_int if kind is int else parse_number  # ASCII digits, finite ([Note: size limits])
        parts = values[key].split("/")
        if kind is float and any(p.strip().lstrip("+-").lower() in ("inf", "infinity", "nan") for p in parts):
            raise ParameterError(f"--offload {shown(text)}: {key}={shown(values[key])} is not finite; {accepted}")
        try:
            return tuple(parse(x, key) for x in parts)
        except ParameterError:
            raise ParameterError(f"--offload {shown(text)}: {key}={shown(values[key])} is not "
                                 f"{'an integer' if kind is int else 'a number'} (or a /-separated list); "
                                 f"{accepted}") from None

    ranks = numbers("ranks", int) if "ranks" in values else None
    try:
        chunk = None
        if "stream" in values:
            mib = numbers("stream", float)
            if len(mib) != 1 or not mib[0] * MIB >= 1:
                raise ParameterError(f"stream takes one number of MiB, at least one byte "
                                     f"({1 / MIB:.3g} MiB: the chunk), "
                                     f"got {shown(values['stream'])}")
            chunk = mib[0] * MIB
        if auto:
            budget = numbers("budget", float) if "budget" in values else (DEFAULT_BUDGET,)
            if len(budget) != 1:
                raise ParameterError(f"budget takes one number, got {shown(values['budget'])}")
            return AutoOffload(budget=budget[0], ranks=ranks, chunk=chunk)
        if "fraction" not in values:
            raise ParameterError("fraction= is missing")
        fraction = numbers("fraction", float)
        lead = numbers("lead", int) if "lead" in values else (1,)
        return OffloadPolicy(fraction[0] if len(fraction) == 1 else fraction, ranks,
                             lead[0] if len(lead) == 1 else lead, chunk)
    except ParameterError as err:
        if str(err).startswith("--offload"):
            raise
        raise ParameterError(f"--offload {shown(text)}: {err}; {accepted}") from None


__all__ = ["AutoOffload", "OffloadChoice", "choose_offload", "evaluate_offload", "offload_counts", "parse_offload"]
