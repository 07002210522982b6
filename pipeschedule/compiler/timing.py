"""When each compute instruction of an order can start: `asap` under unit costs or given
per-stage times, and the costs themselves ([Note: cost-aware timing]).

The list-scheduled generators order instructions by these times, and lowering places
every message by them ([Note: message placement] in passes.py); a compute order whose
`asap` leaves a rank stuck has a dependency cycle.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

from pipeschedule.checks import is_finite, shown
from pipeschedule.compiler.effects import COVERED, EFFECTS, waits
from pipeschedule.compiler.graph import StageGraph
from pipeschedule.compiler.ir import Instr, Op
from pipeschedule.compiler.program import Program, check_stages, packed
from pipeschedule.errors import ParameterError

UNIT_COST = {Op.F: 1, Op.B: 2, Op.W: 1}  # B is the whole backward
SPLIT_UNIT_COST = {Op.F: 1, Op.B: 1, Op.W: 1}  # the backward's 2 split in B (input) and W (weights)


def unit_cost(programs: Sequence[Sequence[Instr]]) -> dict:
    """The unit costs of a compute order: `SPLIT_UNIT_COST` when it splits the backward
    (its first non-empty program has a W), else `UNIT_COST`."""
    for program in programs:
        if program:
            W = Op.W
            if type(program) is Program:  # its templates in use ([Note: packed programs])
                split = W in program.ops
            else:
                split = any(i.op is W for i in program)
            return SPLIT_UNIT_COST if split else UNIT_COST
    return UNIT_COST


class StageTimes(NamedTuple):
    """Per-stage durations of F, B and W (indexed by global stage) that the list
    schedulers and `asap` time a compute order with instead of unit costs
    ([Note: cost-aware timing]). B is the whole backward, or its input-gradient part when
    the schedule splits the backward (then W is the rest), as in `CostModel`."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...]


# [Note: cost-aware timing] Generators order instructions by simulating time: the list
# schedulers pick, whenever a rank is free, the best instruction that is ready, and
# `asap` times an order so that lowering can place the messages. Without a cost both use
# unit costs (F = 1, B = 2, or F = B = W = 1 with a split backward), which is what the
# closed forms in the tests assume. With a `cost` (a `CostModel`, or one (F, B, W)
# tuple per stage) they use the given per-stage times, so that the order fits the
# machine it will run on: with real block times the backward is not twice the forward,
# W is far smaller than B, and the stages need not weigh the same. Only the order (and
# the place of each message) depends on the cost; every rule is checked as before.
# A time of 0 (a stage with no weight gradient, say) is timed as a tiny positive one
# (`MIN_TIME` of the largest), so that two instructions of one rank never start at the
# same instant, which the message placement's argument relies on.
MIN_TIME = 1e-6


def stage_times(cost, num_stages: int) -> StageTimes | None:
    """`cost` as `StageTimes` for `num_stages` stages, or None for None (unit costs).

    `cost` is a `CostModel` (anything with per-stage `forward`, `backward` and `weight`
    sequences), a `StageTimes`, or a sequence of one (F, B, W) tuple per stage; times
    are finite numbers >= 0, not all 0. Raises ParameterError otherwise. The times come
    back scaled by one power of two (only their ratios matter), the largest in [0.5, 1)."""
    if cost is None:
        return None
    if all(hasattr(cost, key) for key in ("forward", "backward", "weight")):
        columns = [cost.forward, cost.backward, cost.weight]
    elif isinstance(cost, (list, tuple)) and all(isinstance(t, (list, tuple)) and len(t) == 3 for t in cost):
        columns = [[t[k] for t in cost] for k in range(3)]
    else:
        raise ParameterError(
            f"cost must be a CostModel or one (forward, backward, weight) tuple per stage, got {shown(cost)}"
        )
    for name, column in zip(("forward", "backward", "weight"), columns):
        if len(column) != num_stages:
            raise ParameterError(f"cost has {len(column)} {name} times, but the schedule has {num_stages} stages: "
                                 f"{shown(list(column))}")
        for s, x in enumerate(column):
            if not (is_finite(x) and x >= 0):
                raise ParameterError(f"cost {name} time of stage {s} must be a finite number >= 0, got {shown(x)}")
    top = max(max(column) for column in columns)
    if top <= 0:
        raise ParameterError(f"cost times are all 0: {shown(cost)}")
    # scaled by a power of two so that the largest time is in [0.5, 1): exact (the same
    # order, the same ties), and sums over any schedule's instructions stay finite
    scale = math.ldexp(1.0, -math.frexp(top)[1])
    low = MIN_TIME * top * scale
    return StageTimes(*(tuple(max(x * scale, low) for x in column) for column in columns))


def unit_stage_times(programs: Sequence[Sequence[Instr]], num_stages: int) -> StageTimes:
    """`unit_cost(programs)` as `StageTimes`."""
    cost = unit_cost(programs)
    return StageTimes(*((cost[op],) * num_stages for op in (Op.F, Op.B, Op.W)))


# [Note: asap keys] (stage, mb) is packed into one int, stage * span + mb, with span
# above every mb in the programs: distinct for every stage, and it indexes flat lists
# (the ends of F and B, the ranks parked on each) where dicts of tuples cost twice as
# much in this loop, which runs once per compute instruction. Only the ends of F and B
# are ever waited for, so only those are kept. Programs whose mb values lie far apart
# (not a schedule's: a valid one has every mb below m) are renumbered densely first, so
# that the lists stay as long as the programs.
#
# [Note: asap worklist] A start depends only on the end of the rank's previous
# instruction and on the end it waits for, never on the order in which ranks are
# visited; so each rank runs as far as it can, and a rank that needs an end not yet
# known is parked on that end (in f_parked / b_parked) and put back on the worklist when
# it is produced. Every instruction is timed once and every rank parks at most once per
# instruction: O(instructions), where sweeping all ranks until none moves took O(pp)
# sweeps (minutes at pp=100000).


def asap(num_stages: int, programs: Sequence[Sequence[Instr]], cost=None, graph=None):
    """Start time of every compute instruction when each runs as soon as its rank is
    free and its inputs exist, under integer unit costs (`unit_cost(programs)`) unless
    `cost` (`StageTimes`, or an {op: time} dict for every stage) is given
    ([Note: cost-aware timing]); communication takes no time. Every stage is one of
    0..num_stages-1.

    F(s, mb) waits for F(s-1, mb); B(s, mb) for F(s, mb) and B(s+1, mb); W(s, mb) for
    B(s, mb). On a stage graph (`graph`, a `StageGraph`; None: the chain), F(t, mb) waits
    for F(s, mb) of every producer s, and B(s, mb) for B(t, mb) of every consumer t
    ([Note: stage graph] in graph.py). Returns (starts, stuck): starts[r][k] is the start of rank r's k-th
    instruction (None where it never runs); stuck lists the ranks that cannot finish
    (empty when the compute order is free of dependency cycles).

    Linear in the instructions: a rank runs until it needs an end not yet known, then
    waits on that one end and is resumed when it is produced ([Note: asap worklist]).
    """
    return asap_packed(num_stages, *packed(programs), _per_stage(programs, num_stages, cost), graph)


# [Note: asap waits] What a compute waits for is its row's (`effects.waits`: the makers of
# the buffers it reads, the compute before it in order); its time is its row's `time`.
# `_asap_general` reads both per template. The chain's loop below is its fast path, written
# for the waits F, B and W have: taken where the order holds nothing else and the graph is
# the chain (tests/compiler/test_graph.py pins the two together on chain graphs).
_CHAIN_WAITS = {Op.F: ((Op.F, -1),), Op.B: ((Op.F, 0), (Op.B, 1)), Op.W: ((Op.B, 0),)}
_CHAIN_FAST = all(waits(op, COVERED) == _CHAIN_WAITS.get(op) for op in COVERED) and set(COVERED) == set(_CHAIN_WAITS)


def _durations(durations: StageTimes, templates, num_stages: int) -> list:
    """Per template, its compute's time at its stage (its row's `time`: forward, backward
    or weight), None for a stage past the last (a template no program uses)."""
    return [getattr(durations, EFFECTS[t.op].time)[t.stage] if t.stage < num_stages else None for t in templates]


def asap_packed(num_stages: int, templates, ids_by_rank, mbs_by_rank, durations: StageTimes, graph=None):
    """`asap` of a compute order given as `packed` columns ([Note: packed programs]),
    timed with per-stage `durations`, on `graph` (None: the chain)."""
    if not (graph is None or graph.chain) or not _CHAIN_FAST or any(t.op not in _CHAIN_WAITS for t in templates):
        return _asap_general(num_stages, templates, ids_by_rank, mbs_by_rank, durations, graph)
    F, B = Op.F, Op.B
    check_stages(num_stages, templates, ids_by_rank, mbs_by_rank)
    mbs_by_rank, span = _dense(mbs_by_rank)
    # per template: its op, its key without the mb (stage * span: [Note: asap keys]) and its
    # duration (None for a stage past the last: a template no program uses, `check_stages`)
    ops = [t.op for t in templates]
    base = [t.stage * span for t in templates]
    spend = _durations(durations, templates, num_stages)
    f_end, b_end = [None] * ((num_stages + 1) * span), [None] * ((num_stages + 1) * span)  # [Note: asap keys]
    f_parked, b_parked = [None] * len(f_end), [None] * len(b_end)  # ranks waiting for that end
    pp = len(ids_by_rank)
    pcs, free_at = [0] * pp, [0] * pp
    starts = [[None] * len(ids) for ids in ids_by_rank]
    last = (num_stages - 1) * span  # keys at or past it are of the last stage
    worklist = list(range(pp - 1, -1, -1))  # popped from the end: rank 0 first
    while worklist:
        r = worklist.pop()
        ids, mbs, pc, t_free, rank_starts = ids_by_rank[r], mbs_by_rank[r], pcs[r], free_at[r], starts[r]
        n = len(ids)
        while pc < n:
            k = ids[pc]
            op, key = ops[k], base[k] + mbs[pc]
            if op is F:
                ready = f_end[key - span] if key >= span else 0  # F(s - 1, mb)
                if ready is None:
                    _park(f_parked, key - span, r)
                    break
                start = ready if ready > t_free else t_free
                t_free = f_end[key] = start + spend[k]
                if f_parked[key] is not None:
                    worklist += f_parked[key]
                    f_parked[key] = None
            elif op is B:
                ready = f_end[key]
                if ready is None:
                    _park(f_parked, key, r)
                    break
                if key < last:
                    after = b_end[key + span]  # B(s + 1, mb)
                    if after is None:
                        _park(b_parked, key + span, r)
                        break
                    if after > ready:
                        ready = after
                start = ready if ready > t_free else t_free
                t_free = b_end[key] = start + spend[k]
                if b_parked[key] is not None:
                    worklist += b_parked[key]
                    b_parked[key] = None
            else:
                ready = b_end[key]
                if ready is None:
                    _park(b_parked, key, r)
                    break
                start = ready if ready > t_free else t_free
                t_free = start + spend[k]
            rank_starts[pc] = start
            pc += 1
        pcs[r], free_at[r] = pc, t_free
    stuck = [r for r, ids in enumerate(ids_by_rank) if pcs[r] < len(ids)]
    return starts, stuck


def _asap_general(num_stages: int, templates, ids_by_rank, mbs_by_rank, durations: StageTimes, graph=None):
    """`asap_packed` on any stage graph (None: the chain), for any computes: each waits for
    the ends its row names ([Note: asap waits]), parked on the first not yet known
    ([Note: asap worklist]). tests/compiler/test_graph.py pins it to the chain's loop on
    chain graphs."""
    if graph is None:
        graph = StageGraph.of(num_stages)
    check_stages(num_stages, templates, ids_by_rank, mbs_by_rank)
    for t in templates:
        if EFFECTS[t.op].time is None or EFFECTS[t.op].order is None:
            raise ParameterError(f"asap times a compute order: {t.op.value} is not a compute that runs once per "
                                 f"(stage, mb) ([Note: instruction effects])")
    mbs_by_rank, span = _dense(mbs_by_rank)
    ops = tuple(op for op in COVERED if any(t.op is op for t in templates))
    table = {op: k for k, op in enumerate(COVERED)}  # each compute's ends: one flat list ([Note: asap keys])
    base = [t.stage * span for t in templates]
    spend = _durations(durations, templates, num_stages)
    # per template: the (end list, key offset) of each end it waits for, in its row's order
    waited = [_waited(t, ops, graph, span, table) if t.stage < num_stages else () for t in templates]
    writes = [table[t.op] for t in templates]
    ends = [[None] * ((num_stages + 1) * span) for _ in COVERED]
    parked = [[None] * ((num_stages + 1) * span) for _ in COVERED]
    pp = len(ids_by_rank)
    pcs, free_at = [0] * pp, [0] * pp
    starts = [[None] * len(ids) for ids in ids_by_rank]
    worklist = list(range(pp - 1, -1, -1))
    while worklist:
        r = worklist.pop()
        ids, mbs, pc, t_free, rank_starts = ids_by_rank[r], mbs_by_rank[r], pcs[r], free_at[r], starts[r]
        n = len(ids)
        while pc < n:
            k = ids[pc]
            key = base[k] + mbs[pc]
            ready = 0
            for which, offset in waited[k]:
                end = ends[which][key + offset]
                if end is None:
                    _park(parked[which], key + offset, r)
                    break
                if end > ready:
                    ready = end
            else:
                start = ready if ready > t_free else t_free
                t_free = start + spend[k]
                w = writes[k]
                ends[w][key] = t_free
                if parked[w][key] is not None:
                    worklist += parked[w][key]
                    parked[w][key] = None
                rank_starts[pc] = start
                pc += 1
                continue
            break
        pcs[r], free_at[r] = pc, t_free
    stuck = [r for r, ids in enumerate(ids_by_rank) if pcs[r] < len(ids)]
    return starts, stuck


def _waited(t, ops, graph, span: int, table: dict) -> tuple:
    """(end list, key offset) of each end a compute of template `t` waits for ([Note: asap
    waits]): (op, 0) its own stage's, (op, -1) each producer's, (op, +1) each consumer's."""
    out = []
    for op, side in waits(t.op, ops):
        others = (t.stage,) if side == 0 else graph.producers[t.stage] if side < 0 else graph.consumers[t.stage]
        out += [(table[op], (other - t.stage) * span) for other in others]
    return tuple(out)


def _park(parked: list, key: int, rank: int) -> None:
    """Rank `rank` waits for the end at `key` ([Note: asap worklist])."""
    if parked[key] is None:
        parked[key] = [rank]
    else:
        parked[key].append(rank)


def _per_stage(programs, num_stages: int, cost) -> StageTimes:
    """asap's (forward, backward, weight) durations, each indexed by stage."""
    if cost is None:
        cost = unit_cost(programs)
    if isinstance(cost, StageTimes):
        return cost
    return StageTimes(*((cost[op],) * num_stages for op in (Op.F, Op.B, Op.W)))


def _dense(mbs_by_rank):
    """(mbs, span) for [Note: asap keys]: the microbatches as given when they are below a
    bound about the programs' length, else renumbered densely (in increasing order;
    asap only compares them)."""
    count = sum(map(len, mbs_by_rank))
    span = 1 + max((max(mbs) for mbs in mbs_by_rank if mbs), default=0)
    if span <= 2 * count + 64:
        return mbs_by_rank, span
    dense = {mb: k for k, mb in enumerate(sorted({mb for mbs in mbs_by_rank for mb in mbs}))}
    return [[dense[mb] for mb in mbs] for mbs in mbs_by_rank], len(dense)


def durations_of(programs: Sequence[Sequence[Instr]], num_stages: int, times: StageTimes | None) -> StageTimes:
    """The per-stage F, B and W durations `asap` times `programs` with: `times`
    ([Note: cost-aware timing]), or the unit costs of `unit_cost(programs)` for None."""
    return times if times is not None else unit_stage_times(programs, num_stages)


def finish_time(programs: Sequence[Sequence[Instr]], timing, cost: StageTimes | None = None):
    """The step time of `timing` (an `asap` result for `programs` under `cost`; None: the
    unit costs of `unit_cost(programs)`): the latest end of any rank's last compute."""
    starts, _ = timing
    if cost is None:
        cost = unit_stage_times(programs, 1 + max((i.stage for p in programs for i in p), default=0))
    return max(
        (rank_starts[-1] + getattr(cost, EFFECTS[program[-1].op].time)[program[-1].stage]
         for program, rank_starts in zip(programs, starts) if program),
        default=0,
    )


def stuck_ranks(num_stages: int, programs: Sequence[Sequence[Instr]], graph=None) -> list[int]:
    """Ranks that cannot finish when compute order alone is followed (see `asap`)."""
    return asap(num_stages, programs, graph=graph)[1]


__all__ = [
    "MIN_TIME", "SPLIT_UNIT_COST", "UNIT_COST", "StageTimes", "asap", "durations_of", "finish_time", "stage_times",
    "stuck_ranks", "unit_cost", "unit_stage_times",
]
