"""Every schedule family, one `Family` record each, and `generate`, which builds one.

The record is the one place a family is described: what its generator takes (virtual
stages, a cap, a cost), where its stages run, whether it splits the backward, its
default cap and the name of its nanotron engine. Everything else derives from `FAMILIES`:
`generate` and the command line (names and checks), the nanotron adapter's config names
and its engine (the pp_engine grammar, compiler/spec.py), the planner's candidates
and their config lines (plan/), and the tests' Hypothesis strategies. Adding a family
is its generator module plus one entry below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeschedule.checks import check_int, shown
from pipeschedule.compiler.gcpause import gc_paused
from pipeschedule.compiler.generators.afab import afab
from pipeschedule.compiler.generators.common import check_common, per_rank_caps, round_robin
from pipeschedule.compiler.generators.dualpipe import dualpipev
from pipeschedule.compiler.generators.interleaved import interleaved_1f1b
from pipeschedule.compiler.generators.interleaved_zb import interleaved_zb
from pipeschedule.compiler.generators.looped_bfs import looped_bfs
from pipeschedule.compiler.generators.one_f_one_b import capped_1f1b, default_cap, one_f_one_b
from pipeschedule.compiler.generators.searched import searched
from pipeschedule.compiler.generators.v_shape import v_half, v_min, v_placement, zbv
from pipeschedule.compiler.generators.zb_h2 import zb_h2
from pipeschedule.compiler.generators.zero_bubble import zb_h1
from pipeschedule.compiler.graph import StageGraph
from pipeschedule.compiler.timing import stage_times
from pipeschedule.errors import FormatError, ParameterError


def _round_robin(pp: int, virtual: int) -> list[int]:
    return round_robin(pp, virtual)


def _v_shape(pp: int, virtual: int) -> list[int]:
    return v_placement(pp)


@dataclass(frozen=True)
class Family:
    """One schedule family.

    name            what users write (`generate(name, ...)`, `pipeschedule compile NAME`)
    generator       its compute order: `generator(pp, microbatches, [virtual=], [cap=],
                    [cost=])`, each keyword only where the family takes it (below)
    placement       (pp, virtual) -> the rank of each of the pp * virtual stages
    virtual         its chunks per rank: a fixed number (1; 2 for the V shapes), or None
                    when it takes any virtual >= 1 (interleaved; 1 when left out)
    takes_cap       whether it takes a cap (one int, or one per rank)
    default_cap     pp -> the cap it keeps to when none is given (None: uncapped)
    split_backward  whether B computes input gradients only and W the weight gradients
    cost_aware      whether its order is found by list scheduling timed under a given
                    cost ([Note: cost-aware timing] in timing.py); the others' order
                    does not depend on it
    engine          its name in nanotron's `parallelism.pp_engine` (`ps_` where nanotron
                    has an engine of its own under the family's name)
    """

    name: str
    generator: Callable
    placement: Callable[[int, int], list[int]] = _round_robin
    virtual: int | None = 1
    takes_cap: bool = False
    default_cap: Callable[[int], int] | None = None
    split_backward: bool = False
    cost_aware: bool = False
    engine: str = ""

    @property
    def takes_virtual(self) -> bool:
        """Whether `virtual` is a parameter (not fixed by the family)."""
        return self.virtual is None

    def chunks(self, virtual: int | None = None) -> int:
        """The chunks per rank it runs with: `virtual` as given, else its own (1 where it
        takes any)."""
        return virtual if virtual is not None else (self.virtual or 1)


def _searched(pp: int, microbatches: int, cap=None, cost=None):
    """`searched` on one stage per rank, seeded with every other family that runs there
    ([Note: searched schedule] in generators/searched.py)."""
    return searched(pp, microbatches, cap=cap, cost=cost, seeds=_fixed_orders)


def _fixed_orders(pp: int, microbatches: int, cap, split_cost, whole_cost):
    """(name, compute order) of every family but `searched` on one stage per rank, under
    `cap` where it takes one, timed with the cost it reads (B + W as the backward of the
    unsplit ones); a family that refuses the cap is left out."""
    out = []
    for name, f in FAMILIES.items():
        if name == "searched" or f.chunks() != 1 or f.placement is not _round_robin:
            continue
        options = {"cap": cap} if f.takes_cap and cap is not None else {}
        try:
            out.append((name, generate(name, pp=pp, microbatches=microbatches,
                                       cost=split_cost if f.split_backward else whole_cost, **options)))
        except ParameterError:
            continue
    return out


_SPLIT = dict(takes_cap=True, split_backward=True, cost_aware=True)
_V_SHAPE = dict(_SPLIT, placement=_v_shape, virtual=2)

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("afab", afab, engine="ps_afab"),
    Family("1f1b", one_f_one_b, engine="ps_1f1b"),
    Family("capped_1f1b", capped_1f1b, takes_cap=True, default_cap=default_cap, cost_aware=True, engine="capped_1f1b"),
    Family("interleaved_1f1b", interleaved_1f1b, virtual=None, takes_cap=True, engine="interleaved_1f1b"),
    Family("zb_h1", zb_h1, engine="zb_h1", **_SPLIT),
    Family("zbv", zbv, engine="zbv", **_V_SHAPE),
    Family("v_half", v_half, engine="v_half", **_V_SHAPE),
    Family("v_min", v_min, engine="v_min", **_V_SHAPE),
    Family("zb_h2", zb_h2, engine="zb_h2", **_SPLIT),
    Family("dualpipev", dualpipev, engine="dualpipev", **_V_SHAPE),
    Family("interleaved_zb", interleaved_zb, virtual=None, engine="interleaved_zb", **_SPLIT),
    Family("looped_bfs", looped_bfs, virtual=None, engine="looped_bfs"),
    Family("searched", _searched, engine="searched", **_SPLIT),
)}


def family(name: str) -> Family:
    """The family called `name`; raises ParameterError naming the accepted ones."""
    found = FAMILIES.get(name) if isinstance(name, str) else None
    if found is None:
        raise ParameterError(f"unknown schedule {shown(name)}; accepted: {', '.join(FAMILIES)}")
    return found


def family_virtual(name: str, virtual: int | None = None) -> int:
    """The chunks per rank family `name` runs with: `virtual` as given, or the family's
    default when None (1, or the fixed value of a V-shape family)."""
    return family(name).chunks(virtual)


@gc_paused
def generate(name: str, *, pp: int, microbatches: int, virtual: int | None = None, cap=None, cost=None,
             edges=None):
    """The compute-only schedule of family `name`; raises ParameterError on bad input.
    `virtual` None means the family's default (1; 2 for the V-shape families).

    `edges`: the stage graph, (producer stage, consumer stage) pairs over the pp *
    virtual stages (None: the chain; [Note: stage graph] in graph.py). Every family's
    order is valid on any graph of forward edges (the Note says why), so the order is
    the family's own and the graph is what lowering reads.

    `cost`: None (unit costs), a `CostModel`, or one (forward, backward, weight) time
    tuple per stage (B the input-gradient part for a split-backward family). The
    cost-aware families time their list schedule with it; for every family, lowering
    places messages by it when given the same cost (`lower(schedule, cost)`;
    [Note: cost-aware timing]). The result is the compute order alone: nothing else is kept on it."""
    chosen = family(name)
    if virtual is not None:
        check_int("virtual", virtual)
        if chosen.virtual not in (None, 1) and virtual != chosen.virtual:
            raise ParameterError(
                f"{name} places exactly {chosen.virtual} stages on each rank (a V shape): virtual must be "
                f"{chosen.virtual} or left out, got virtual={virtual}"
            )
    virtual = chosen.chunks(virtual)
    check_common(pp, microbatches, virtual)
    stage_times(cost, pp * virtual)  # checked before any work
    if cap is not None:
        per_rank_caps(cap, pp)
        if not chosen.takes_cap:
            raise ParameterError(f"{name} takes no cap (got cap={shown(cap)}); use capped_1f1b or interleaved_1f1b")
    if not chosen.takes_virtual and virtual != chosen.chunks():
        raise ParameterError(f"{name} takes no virtual stages (got virtual={virtual}); use interleaved_1f1b")
    options = {}
    if chosen.takes_virtual:
        options["virtual"] = virtual
    if chosen.takes_cap:
        options["cap"] = cap
    if chosen.cost_aware:
        options["cost"] = cost  # the generator reads it through `stage_times`; `searched` also its messages
    if edges is not None:
        try:
            StageGraph.of(pp * virtual, edges)  # checked before any work
        except FormatError as err:
            raise ParameterError(f"edges: {err}") from None
    order = chosen.generator(pp, microbatches, **options)
    return order if edges is None else order.with_edges(edges)


__all__ = ["FAMILIES", "Family", "family", "family_virtual", "generate"]
