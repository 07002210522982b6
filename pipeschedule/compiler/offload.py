"""Host offload of stashed activations: the pass that inserts OFFLOAD / RELOAD.

    add_offload(schedule, policy)          lowered schedule -> + OFFLOAD / RELOAD

How much to offload within a step-time budget is searched in the planner
(`pipeschedule.simulate.offload_search.choose_offload`); the `--offload` spec is read by
`offload_spec.parse_offload`.

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
from dataclasses import dataclass, replace
from typing import Sequence

from pipeschedule.checks import is_finite, is_int, is_number, shown
from pipeschedule.compiler.ir import COMPUTE_OPS, Op, Schedule, make_instr
from pipeschedule.compiler.passes import is_lowered, lower
from pipeschedule.errors import ParameterError

OFFLOAD, RELOAD = Op.OFFLOAD, Op.RELOAD
F, B, W = Op.F, Op.B, Op.W
MIB = 2**20


def _fraction(value) -> bool:
    return is_number(value) and 0 <= value <= 1


def _count(x) -> bool:
    """Whether x is an integer >= 0 (a lead)."""
    return is_int(x) and x >= 0


def _joined(value) -> str:
    """One number, or one per rank joined by '/', as `--offload` writes them."""
    return "/".join(f"{x:g}" for x in value) if isinstance(value, tuple) else f"{value:g}"


@dataclass(frozen=True)
class OffloadPolicy:
    """What `add_offload` moves to the host ([Note: offload placement]).

    fraction: of each chosen rank's stashes, in [0, 1]; one number, or one per rank.
    ranks: the ranks that offload (None: all). lead: computes between a RELOAD and the B
    that needs it, >= 0; one number, or one per rank. chunk: bytes per piece when the
    stashes stream ([Note: simulated streaming] in simulate/engine.py; the runtime's
    `offload_chunk`), None: each moves whole. Streaming changes how the copies run, not
    the instructions: `add_offload` places the same OFFLOAD / RELOAD either way.
    """

    fraction: float | tuple[float, ...] = 1.0
    ranks: tuple[int, ...] | None = None
    lead: int | tuple[int, ...] = 1
    chunk: float | None = None

    def __post_init__(self) -> None:
        check_chunk(self.chunk)
        fraction = tuple(self.fraction) if isinstance(self.fraction, (list, tuple)) else self.fraction
        if not (_fraction(fraction) or (isinstance(fraction, tuple) and fraction and all(map(_fraction, fraction)))):
            raise ParameterError(f"offload fraction must be a number in [0, 1] or one per rank, "
                                 f"got {shown(self.fraction)}")
        lead = tuple(self.lead) if isinstance(self.lead, (list, tuple)) else self.lead
        if not (_count(lead) or (isinstance(lead, tuple) and lead and all(map(_count, lead)))):
            raise ParameterError(f"offload lead must be an integer >= 0 (computes) or one per rank, "
                                 f"got {shown(self.lead)}")
        ranks = self.ranks
        if ranks is not None:
            ranks = tuple(ranks) if isinstance(ranks, (list, tuple)) else ranks
            if (not isinstance(ranks, tuple) or not all(is_int(r) and r >= 0 for r in ranks)
                    or len(set(ranks)) != len(ranks)):
                raise ParameterError(f"offload ranks must be distinct integers >= 0, got {shown(self.ranks)}")
        object.__setattr__(self, "fraction", fraction)
        object.__setattr__(self, "lead", lead)
        object.__setattr__(self, "ranks", ranks)

    def _per_rank(self, name: str, pp: int) -> tuple:
        value = getattr(self, name)
        if not isinstance(value, tuple):
            return (value,) * pp
        if len(value) != pp:
            raise ParameterError(f"offload {name} has {len(value)} entries {shown(value)}; "
                                 f"the schedule has pp={pp} ranks")
        return value

    def text(self) -> str:
        """The `--offload` spec that gives this policy back (`parse_offload`)."""
        parts = [f"fraction={_joined(self.fraction)}", f"lead={_joined(self.lead)}"]
        if self.ranks is not None:
            parts.append("ranks=" + "/".join(map(str, self.ranks)))
        if self.chunk is not None:
            parts.append(f"stream={self.chunk / MIB:.15g}")
        return ",".join(parts)

    def cost(self, cost):
        """`cost` with this policy's streaming (its chunk) in force."""
        return streamed(cost, self.chunk)



def check_chunk(chunk) -> None:
    if chunk is not None and not (is_finite(chunk) and chunk >= 1):
        raise ParameterError(f"offload chunk must be a number of bytes >= 1 (None: whole stashes), got {shown(chunk)}")


def streamed(cost, chunk):
    """`cost` with `offload_chunk=chunk` (unchanged when chunk is None)."""
    return cost if chunk is None else replace(cost, offload_chunk=chunk)



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
    """The (stage, mb) of a program whose stash streams when offload is streamed
    ([Note: simulated streaming] in simulate/engine.py): those with an OFFLOAD of the stash before their B."""
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
    policy = policy or OffloadPolicy()
    if not is_lowered(schedule):
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
            raise ParameterError(f"rank {rank} of {shown(schedule.name)} already has OFFLOAD/RELOAD; "
                                 "add_offload takes a schedule without")
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
        for _, f, _b, stage, mb in sorted(chosen, key=lambda w: w[1]):
            after.setdefault(computes[f], []).append(make_instr(OFFLOAD, stage, mb, None, "stash"))
        offloaded_f = {w[1] for w in chosen}
        for _, _f, b, stage, mb in sorted(chosen, key=lambda w: w[2]):
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


__all__ = ["MIB", "OffloadPolicy", "add_offload", "check_chunk", "stash_waits", "streamed", "streamed_stashes"]
