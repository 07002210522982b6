"""Interleaved 1F1B (Megatron-LM style virtual stages), optionally capped.

Rank r runs stages r, r + pp, ..., r + (v-1)*pp (chunk c is stage c*pp + r).
Microbatches go through the chunks in groups (of g = pp unless the count or a cap asks
otherwise): the forward order of every rank is

    group 0: chunk 0 mb 0..g-1, chunk 1 mb 0..g-1, ..., chunk v-1 mb 0..g-1
    group 1: chunk 0 mb g..2g-1, ...

and the backward order is the same with the chunks reversed. pp=2, v=2, m=4, one cell
per chunk-forward:

    rank 0  0F0 0F1 2F0 2F1 .   0F2 2B0 ...
    rank 1  .   1F0 1F1 3F0 3B0 3F1 ...

Rank r runs w_r = 2(pp-r-1) + (v-1)g forwards of warmup (Megatron's count, g the first
group), then pairs (F, B), then the remaining backwards. Where a group makes that order
cyclic, the warmup of the blocked ranks is raised until the order completes (checked by
`asap`).

[Note: interleaved groups] Every m >= 1 is accepted (Megatron refuses m that is not a
multiple of pp; PyTorch takes m when max(1, m // pp) rounds divide it). When m is a
multiple of pp the groups are of pp. Otherwise two groupings are built: groups of pp and
a short last one (the least memory), and PyTorch's rounds, max(1, m // pp) groups of
about m / rounds each (larger first where they differ; exactly PyTorch's order where it
accepts m). A short group leaves the pipeline empty while it drains, a larger one fills
it with more warmup, so the second is faster and holds more (pp=4, v=2, m=6, unit costs:
22.5 with [12, 11, 9, 7] in flight against 27.5 with [11, 9, 7, 5]). Uncapped, the faster
under unit costs is taken (the leaner on a tie); a cap below its peak selects the leaner
grouping, or smaller groups still.

Capped: `cap` bounds the stage-microbatches in flight per rank. The first backward on a
rank needs the forward of its last chunk for the first microbatch, which comes after
(v-1)g forwards, so g is lowered until (v-1)g + 1 fits the cap; caps below v are
refused (one microbatch through every local chunk is the least a rank can hold).
"""

from pipeschedule.errors import ParameterError
from pipeschedule.compiler.generators.common import (
    check_common, compute_templates, interleave_1f1b, make, per_rank_caps, round_robin,
)
from pipeschedule.compiler.timing import asap, finish_time
from pipeschedule.checks import shown


def groups_of(microbatches: int, size: int) -> list[int]:
    """Groups of `size` microbatches, the last one shorter where m is not a multiple."""
    return [min(size, microbatches - start) for start in range(0, microbatches, size)]


def rounds_of(pp: int, microbatches: int) -> list[int]:
    """PyTorch's rounds ([Note: interleaved groups]): max(1, m // pp) groups of about
    m / rounds microbatches each, the larger first."""
    rounds = max(1, microbatches // pp)
    size, extra = divmod(microbatches, rounds)
    return [size + 1] * extra + [size] * (rounds - extra)


def _orders(pp: int, virtual: int, microbatches: int, rank: int, groups):
    """Rank `rank`'s forward and backward orders over microbatch groups of these sizes
    (an int: groups of that size, `groups_of`)."""
    if isinstance(groups, int):
        groups = groups_of(microbatches, groups)
    forwards, backwards = [], []
    start = 0
    for size in groups:
        mbs = range(start, start + size)
        start += size
        forwards += [(c * pp + rank, mb) for c in range(virtual) for mb in mbs]
        backwards += [(c * pp + rank, mb) for c in reversed(range(virtual)) for mb in mbs]
    return forwards, backwards


def _megatron_warmups(pp: int, virtual: int, group: int) -> list[int]:
    if virtual == 1:
        return [pp - r - 1 for r in range(pp)]
    return [2 * (pp - r - 1) + (virtual - 1) * group for r in range(pp)]


# [Note: Megatron's regime] With every group full (m a multiple of pp, g = pp) and
# Megatron's own warmup counts, unclipped, the order is the one Megatron-LM and PyTorch
# run, and it never blocks; `_warmups` then skips the `asap` that would look for blocked
# ranks (0.07 s of generating pp=64, v=2, m=512). tests/compiler/test_generators.py
# checks the claim with asap over pp <= 8, v <= 4 and m up to 4 pp; lowering times the
# order again and would refuse a cyclic one.


def megatron_regime(pp: int, microbatches: int, group, warm, megatron) -> bool:
    """Whether [Note: Megatron's regime] holds: full groups of pp (`group` the size of
    every group, or their list), Megatron's warmups."""
    full = group == pp if isinstance(group, int) else all(g == pp for g in group)
    return full and microbatches % pp == 0 and list(warm) == list(megatron)


def _warmups(pp: int, virtual: int, microbatches: int, group, limits, start):
    """Warmup counts from `start`, clipped to `limits` (the most forwards of warmup
    rank r may run) and to the running minimum along the pipeline, then raised where
    the order would block. `group`: the size of every group, or their list. Returns
    (warmups, programs), or None when a raise would pass a limit."""
    total = virtual * microbatches
    warm = [min(w, total, limit) for w, limit in zip(start, limits)]
    for r in range(1, pp):  # a cap on rank r-1 also bounds rank r ([Note: cap monotonicity])
        warm[r] = min(warm[r], warm[r - 1])
    orders = [_orders(pp, virtual, microbatches, r, group) for r in range(pp)]
    first = group if isinstance(group, int) else group[0]
    table = compute_templates(pp * virtual)
    while True:
        programs = [interleave_1f1b(f, b, w, table) for (f, b), w in zip(orders, warm)]
        if megatron_regime(pp, microbatches, group, warm, _megatron_warmups(pp, virtual, first)):
            return warm, programs  # [Note: Megatron's regime]
        stuck = asap(pp * virtual, programs)[1]
        if not stuck:
            return warm, programs
        raised = False
        for r in stuck:
            if warm[r] < min(total, limits[r]):
                warm[r] += 1
                raised = True
        if not raised:
            return None


def _uncapped(pp: int, virtual: int, microbatches: int):
    """The uncapped order of [Note: interleaved groups]: (warmups, programs, groups) of
    the faster grouping under unit costs, the leaner on a tie."""
    total = virtual * microbatches
    best = None
    for groups in dict.fromkeys((tuple(groups_of(microbatches, pp)), tuple(rounds_of(pp, microbatches)))):
        warm, programs = _warmups(pp, virtual, microbatches, list(groups), [total] * pp,
                                  _megatron_warmups(pp, virtual, groups[0]))
        if best is not None:
            timed = [finish_time(p, asap(pp * virtual, p)) for p in (best[1], programs)]
            if timed[1] >= timed[0]:
                continue
        best = warm, programs, list(groups)
    return best


def interleaved_1f1b(pp: int, microbatches: int, virtual: int = 2, cap=None):
    check_common(pp, microbatches, virtual)
    placement = round_robin(pp, virtual)
    total = virtual * microbatches
    group = min(pp, microbatches)
    uncapped, programs, groups = _uncapped(pp, virtual, microbatches)
    if cap is None:
        return make("interleaved_1f1b", pp, virtual, microbatches, placement, programs, {})

    caps = per_rank_caps(cap, pp)
    smallest = min(caps)
    if smallest < min(virtual, total):
        raise ParameterError(
            f"cap {shown(cap)} is below virtual={virtual}: an interleaved rank holds at least one "
            f"microbatch in each of its {virtual} chunks, so cap must be >= {min(virtual, total)} "
            f"stage-microbatches"
        )
    # The uncapped schedule's peak is the most a cap can mean; clip to it per rank.
    caps = [min(c, w + 1, total) for c, w in zip(caps, uncapped)]
    if caps == [min(w + 1, total) for w in uncapped] and groups != groups_of(microbatches, group):
        params = {"cap": caps, "group": groups[0]}  # a cap at the uncapped peak keeps its order
        return make("capped_interleaved_1f1b", pp, virtual, microbatches, placement, programs, params)
    if virtual > 1:
        group = max(1, min(group, (min(caps) - 1) // (virtual - 1)))
    # Megatron's warmup where the caps allow it, else the least warmup that lets the
    # first backward run ((v-1)g forwards), raised only where the order would block.
    for g in range(group, 0, -1):
        limits = [c - 1 for c in caps]
        found = _warmups(pp, virtual, microbatches, g, limits, _megatron_warmups(pp, virtual, g))
        if found is None:
            found = _warmups(pp, virtual, microbatches, g, limits, [(virtual - 1) * g] * pp)
        if found is not None:
            warm, programs = found
            params = {"cap": caps, "group": g}
            return make("capped_interleaved_1f1b", pp, virtual, microbatches, placement, programs, params)
    raise ParameterError(
        f"no interleaved order with virtual={virtual} keeps within cap {shown(cap)} at pp={pp}, "
        f"microbatches={microbatches}; raise the cap (each rank's uncapped peak: "
        f"{[w + 1 for w in uncapped]})"
    )
