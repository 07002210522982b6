"""Host offload of stashed activations: the pass that inserts OFFLOAD / RELOAD, and the
search that picks how much to offload within a step-time budget.

    add_offload(schedule, policy)          lowered schedule -> + OFFLOAD / RELOAD
    choose_offload(schedule, cost, budget) the largest fraction per rank within budget

[Note: offload placement] On a rank, the stash of (stage, mb) lives from its F to its B
(to its W under a split backward). Between them the rank runs `wait` other computes; the
longest waits are the first stage's (a whole pipeline round trip in 1F1B), which is the
memory worth moving. For each chosen stash:

    ... F(s,mb) OFFLOAD(s,mb) [sends/recvs] ... c_k RELOAD(s,mb) [recvs] c_k+1 .. B(s,mb)
                                                 '---- lead computes ----'

OFFLOAD goes right after the F (the stash is complete when the F ends; nothing is
waited for). RELOAD goes right after the compute `lead + 1` computes before the B (and
after the FREEs that follow that compute, so memory is released before it is taken), so
that `lead` computes (and the receives before the B) overlap the copy back; lead=0
issues it right after the compute just before the B. A RELOAD never goes right after
an F whose stash is offloaded (it moves on to after the next compute, at the latest the
one just before the B): that stash is still on the device while it is copied out, so
the stash coming back would count beside it and beside the next F's (in 1F1B this
happens in the warmup, where every compute before the first B is such a forward, and in
the cooldown after the last F). Both go between a compute and the
run of communication after it, never inside a run (which would split its batch, rule
4). A stash whose wait is at most `lead` is left alone: it would come back before it had
gone. With W, the stash comes back for the B and stays until the W frees it.

The fraction counts a rank's (stage, mb) stashes: floor(fraction * count) of them, the
longest waits first (ties: earlier F first), minus those left alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

from pipeschedule.errors import ParameterError
from pipeschedule.ir import COMPUTE_OPS, Op, Schedule, make_instr
from pipeschedule.limits import parse_int, parse_number, shown

OFFLOAD, RELOAD = Op.OFFLOAD, Op.RELOAD
F, B, W = Op.F, Op.B, Op.W

# Host link bandwidth per direction, GB/s, by GPU preset: GH200's NVLink-C2C (900 GB/s
# both directions together, as the vendor quotes it) and the H200 lent here (pinned
# copies measured at 55.4 GB/s each way, issue 9).
HOST_LINKS = {"gh200": 450.0, "h200": 55.4}
DEFAULT_BUDGET = 0.03
DEFAULT_LEADS = (0, 1, 2, 3, 4)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fraction(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1


@dataclass(frozen=True)
class OffloadPolicy:
    """What `add_offload` moves to the host ([Note: offload placement]).

    fraction: of each chosen rank's stashes, in [0, 1]; one number, or one per rank.
    ranks: the ranks that offload (None: all). lead: computes between a RELOAD and the B
    that needs it, >= 0; one number, or one per rank. chunk: bytes per piece when the
    stashes stream ([Note: streamed offload] in simulate.py; the runtime's
    `offload_chunk`), None: each moves whole. Streaming changes how the copies run, not
    the instructions: `add_offload` places the same OFFLOAD / RELOAD either way.
    """

    fraction: float | tuple[float, ...] = 1.0
    ranks: tuple[int, ...] | None = None
    lead: int | tuple[int, ...] = 1
    chunk: float | None = None

    def __post_init__(self) -> None:
        _check_chunk(self.chunk)
        fraction = tuple(self.fraction) if isinstance(self.fraction, (list, tuple)) else self.fraction
        if not (_fraction(fraction) or (isinstance(fraction, tuple) and fraction and all(map(_fraction, fraction)))):
            raise ParameterError(f"offload fraction must be a number in [0, 1] or one per rank, got {shown(self.fraction)}")
        lead = tuple(self.lead) if isinstance(self.lead, (list, tuple)) else self.lead
        ok = lambda x: _is_int(x) and x >= 0
        if not (ok(lead) or (isinstance(lead, tuple) and lead and all(map(ok, lead)))):
            raise ParameterError(f"offload lead must be an integer >= 0 (computes) or one per rank, got {shown(self.lead)}")
        ranks = self.ranks
        if ranks is not None:
            ranks = tuple(ranks) if isinstance(ranks, (list, tuple)) else ranks
            if not isinstance(ranks, tuple) or not all(_is_int(r) and r >= 0 for r in ranks) or len(set(ranks)) != len(ranks):
                raise ParameterError(f"offload ranks must be distinct integers >= 0, got {shown(self.ranks)}")
        object.__setattr__(self, "fraction", fraction)
        object.__setattr__(self, "lead", lead)
        object.__setattr__(self, "ranks", ranks)

    def _per_rank(self, name: str, pp: int) -> tuple:
        value = getattr(self, name)
        if not isinstance(value, tuple):
            return (value,) * pp
        if len(value) != pp:
            raise ParameterError(f"offload {name} has {len(value)} entries {shown(value)}; the schedule has pp={pp} ranks")
        return value

    def text(self) -> str:
        """The `--offload` spec that gives this policy back (`parse_offload`)."""
        join = lambda v: "/".join(f"{x:g}" for x in v) if isinstance(v, tuple) else f"{v:g}"
        parts = [f"fraction={join(self.fraction)}", f"lead={join(self.lead)}"]
        if self.ranks is not None:
            parts.append("ranks=" + "/".join(map(str, self.ranks)))
        if self.chunk is not None:
            parts.append(f"stream={self.chunk / MIB:.15g}")
        return ",".join(parts)

    def cost(self, cost):
        """`cost` with this policy's streaming (its chunk) in force."""
        return streamed(cost, self.chunk)


MIB = 2**20


def _check_chunk(chunk) -> None:
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, (int, float)) or not 1 <= chunk < math.inf):
        raise ParameterError(f"offload chunk must be a number of bytes >= 1 (None: whole stashes), got {shown(chunk)}")


def streamed(cost, chunk):
    """`cost` with `offload_chunk=chunk` (unchanged when chunk is None)."""
    return cost if chunk is None else replace(cost, offload_chunk=chunk)


@dataclass(frozen=True)
class AutoOffload:
    """`choose_offload`'s request: the step-time budget (a fraction: 0.03 allows 3% over
    the schedule without offload), the ranks it may offload (None: all), the leads tried."""

    budget: float = DEFAULT_BUDGET
    ranks: tuple[int, ...] | None = None
    leads: tuple[int, ...] = DEFAULT_LEADS
    chunk: float | None = None

    def __post_init__(self) -> None:
        _check_chunk(self.chunk)
        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)) or not 0 <= self.budget < math.inf:
            raise ParameterError(f"offload budget must be a finite number >= 0 (0.03 = 3% slower at most), got {shown(self.budget)}")
        OffloadPolicy(ranks=self.ranks)  # same checks
        if not self.leads or not all(_is_int(x) and x >= 0 for x in self.leads):
            raise ParameterError(f"offload leads must be integers >= 0, got {shown(self.leads)}")


# -- the pass -------------------------------------------------------------------------------------


def stash_waits(program: Sequence) -> list[tuple[int, int, int, int, int]]:
    """Per (stage, mb) of a program: (wait, F's compute index, B's compute index, stage, mb),
    wait being the computes run between its F and its B."""
    f_at: dict[tuple[int, int], int] = {}
    out = []
    k = 0
    for i in program:
        op = i.op
        if op is F:
            f_at[i.stage, i.mb] = k
        elif op is B:
            f = f_at.get((i.stage, i.mb))
            if f is not None:
                out.append((k - f - 1, f, k, i.stage, i.mb))
        if op in COMPUTE_OPS:
            k += 1
    return out


def streamed_stashes(program: Sequence) -> frozenset:
    """The (stage, mb) of a program whose stash streams when offload is streamed ([Note:
    streamed offload] in simulate.py): those with an OFFLOAD of the stash before their B."""
    found, done = set(), set()
    for i in program:
        if i.op is B:
            done.add((i.stage, i.mb))
        elif i.op is OFFLOAD and i.buf == "stash" and (i.stage, i.mb) not in done:
            found.add((i.stage, i.mb))
    return frozenset(found)


def add_offload(schedule: Schedule, policy: OffloadPolicy | None = None) -> Schedule:
    """Adds OFFLOAD / RELOAD of the stash for `policy` ([Note: offload placement]).
    Input: a lowered schedule (a compute-only one is lowered first) without OFFLOAD.
    Output: the same programs with OFFLOAD right after chosen F's and RELOAD `lead`
    computes before their B's; every rule the input kept still holds."""
    from pipeschedule.simulate import _is_lowered

    policy = policy or OffloadPolicy()
    if not _is_lowered(schedule):
        from pipeschedule.passes import lower

        schedule = lower(schedule)
    pp = schedule.pp
    fractions, leads = policy._per_rank("fraction", pp), policy._per_rank("lead", pp)
    ranks = range(pp) if policy.ranks is None else policy.ranks
    bad = [r for r in ranks if r >= pp]
    if bad:
        raise ParameterError(f"offload ranks {bad} are not ranks of the schedule (0..{pp - 1})")
    programs = list(schedule.programs)
    for rank in ranks:
        program = programs[rank]
        if any(i.op is OFFLOAD or i.op is RELOAD for i in program):
            raise ParameterError(f"rank {rank} of {shown(schedule.name)} already has OFFLOAD/RELOAD; add_offload takes a schedule without")
        waits = stash_waits(program)
        count = math.floor(fractions[rank] * len(waits) + 1e-9)
        lead = leads[rank]
        chosen = [w for w in sorted(waits, key=lambda w: (-w[0], w[1]))[:count] if w[0] > lead]
        if not chosen:
            continue
        # The slot after each compute: past the FREEs right after it (they release memory
        # before a RELOAD takes some), before the run of communication that follows.
        computes = []
        for pc, i in enumerate(program):
            if i.op in COMPUTE_OPS:
                computes.append(pc)
            elif i.op is Op.FREE and computes and computes[-1] == pc - 1:
                computes[-1] = pc
        after: dict[int, list] = {}  # pc -> instructions that go right after it
        for _, f, b, stage, mb in sorted(chosen, key=lambda w: w[1]):
            after.setdefault(computes[f], []).append(make_instr(OFFLOAD, stage, mb, None, "stash"))
        offloaded_f = {w[1] for w in chosen}
        for _, f, b, stage, mb in sorted(chosen, key=lambda w: w[2]):
            at = b - lead - 1
            while at < b - 1 and at in offloaded_f:  # not beside a copy out: see the Note
                at += 1
            after.setdefault(computes[at], []).append(make_instr(RELOAD, stage, mb, None, "stash"))
        out = []
        for pc, i in enumerate(program):
            out.append(i)
            extra = after.get(pc)
            if extra:
                # OFFLOADs first (computes[f] is never a B's reload point for its own F).
                out += sorted(extra, key=lambda x: x.op is RELOAD)
        programs[rank] = tuple(out)
    return schedule._with_trusted_programs(tuple(programs))


# -- the search -----------------------------------------------------------------------------------


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
        (sum(1 for i in p if i.op is OFFLOAD and i.buf == "stash"), sum(1 for i in p if i.op is F)) for p in schedule.programs
    )


def evaluate_offload(schedule: Schedule, cost, policy: OffloadPolicy, base=None) -> OffloadChoice:
    """Simulates `schedule` without (or with `base`, its SimResult) and with `policy`."""
    from pipeschedule.simulate import simulate

    from pipeschedule.passes import lower
    from pipeschedule.simulate import _is_lowered

    if not _is_lowered(schedule):
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
    from pipeschedule.passes import lower
    from pipeschedule.simulate import CostModel, _is_lowered, simulate

    auto = budget if isinstance(budget, AutoOffload) else AutoOffload(budget=budget)
    if not _is_lowered(schedule):
        schedule = lower(schedule)
    cost = cost or CostModel.default(schedule)
    pp = schedule.pp
    ranks = range(pp) if auto.ranks is None else auto.ranks
    bad = [r for r in ranks if r >= pp]
    if bad:
        raise ParameterError(f"offload ranks {bad} are not ranks of the schedule (0..{pp - 1})")
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
                result = simulate(add_offload(schedule, OffloadPolicy(tuple(trial_f), None, tuple(trial_l))), trial_cost)
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
                raise ParameterError(f"stream takes one number of MiB, at least one byte ({1 / MIB:.3g} MiB: the chunk), "
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
        return OffloadPolicy(fraction[0] if len(fraction) == 1 else fraction, ranks, lead[0] if len(lead) == 1 else lead, chunk)
    except ParameterError as err:
        if str(err).startswith("--offload"):
            raise
        raise ParameterError(f"--offload {shown(text)}: {err}; {accepted}") from None


def host_bandwidth(gpu: str | None, given: float | None) -> float | None:
    """GB/s per direction: `given` (--host-bandwidth) when set, else the GPU preset's
    (HOST_LINKS), else None (unknown)."""
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, (int, float)) or not 0 < given < math.inf:
            raise ParameterError(f"--host-bandwidth must be a number > 0 (GB/s per direction), got {shown(given)}")
        return float(given)
    if gpu:
        key = gpu.lower().replace("-", "").replace(" ", "")
        for name, value in HOST_LINKS.items():
            if key == name or key.startswith(name):
                return value
    return None


__all__ = [
    "AutoOffload", "HOST_LINKS", "OffloadChoice", "OffloadPolicy", "add_offload", "choose_offload",
    "evaluate_offload", "host_bandwidth", "offload_counts", "parse_offload", "stash_waits", "streamed",
    "streamed_stashes",
]
