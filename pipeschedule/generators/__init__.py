"""Schedule families. Each returns the compute order (F, B, W) of every rank.

`generate(name, pp=, microbatches=, virtual=, cap=, cost=)` validates the parameters
against what the family accepts and calls it.
"""

from __future__ import annotations

from pipeschedule.gcpause import gc_paused

from pipeschedule.errors import ParameterError
from pipeschedule.generators.afab import afab
from pipeschedule.generators.common import check_common, check_positive, per_rank_caps, stage_times
from pipeschedule.generators.interleaved import interleaved_1f1b
from pipeschedule.generators.one_f_one_b import capped_1f1b, default_cap, one_f_one_b
from pipeschedule.generators.v_shape import v_half, v_min, zbv
from pipeschedule.generators.zero_bubble import zb_h1
from pipeschedule.limits import shown

# name -> (function, takes virtual, takes cap)
FAMILIES = {
    "afab": (afab, False, False),
    "1f1b": (one_f_one_b, False, False),
    "capped_1f1b": (capped_1f1b, False, True),
    "interleaved_1f1b": (interleaved_1f1b, True, True),
    "zb_h1": (zb_h1, False, True),
    "zbv": (zbv, False, True),
    "v_half": (v_half, False, True),
    "v_min": (v_min, False, True),
}

# Families whose placement fixes the chunks per rank: `virtual` may be omitted or must
# equal this.
FIXED_VIRTUAL = {"zbv": 2, "v_half": 2, "v_min": 2}

# Families whose order is found by list scheduling, timed under `cost` where one is given
# ([Note: cost-aware timing]); the others' order does not depend on it.
COST_AWARE = frozenset({"capped_1f1b", "zb_h1", "zbv", "v_half", "v_min"})

# Families that split the backward in B and W.
SPLIT_BACKWARD = frozenset({"zb_h1", "zbv", "v_half", "v_min"})


def family_virtual(name: str, virtual: int | None = None) -> int:
    """The chunks per rank family `name` runs with: `virtual` as given, or the family's
    default when None (1, or the fixed value of a V-shape family)."""
    fixed = FIXED_VIRTUAL.get(name)
    if virtual is None:
        return fixed or 1
    return virtual


@gc_paused
def generate(name: str, *, pp: int, microbatches: int, virtual: int | None = None, cap=None, cost=None):
    """The compute-only schedule of family `name`; raises ParameterError on bad input.
    `virtual` None means the family's default (1; 2 for the V-shape families).

    `cost`: None (unit costs), a `CostModel`, or one (forward, backward, weight) time
    tuple per stage (B the input-gradient part for a split-backward family). The families
    of `COST_AWARE` time their list schedule with it; for every family, lowering places
    messages by it when given the same cost (`lower(schedule, cost)`; [Note: cost-aware
    timing]). The result is the compute order alone: nothing else is kept on it."""
    return _generate(name, pp, microbatches, virtual, cap, cost)


def _generate(name: str, pp: int, microbatches: int, virtual: int | None, cap, cost):
    if name not in FAMILIES:
        raise ParameterError(f"unknown schedule {shown(name)}; accepted: {', '.join(FAMILIES)}")
    function, takes_virtual, takes_cap = FAMILIES[name]
    fixed = FIXED_VIRTUAL.get(name)
    if virtual is not None:
        check_positive("virtual", virtual)
        if fixed is not None and virtual != fixed:
            raise ParameterError(
                f"{name} places exactly {fixed} stages on each rank (a V shape): virtual must be {fixed} "
                f"or left out, got virtual={virtual}"
            )
    virtual = family_virtual(name, virtual)
    check_common(pp, microbatches, virtual)
    times = stage_times(cost, pp * virtual)  # checked before any work
    if cap is not None:
        per_rank_caps(cap, pp)
        if not takes_cap:
            raise ParameterError(f"{name} takes no cap (got cap={shown(cap)}); use capped_1f1b or interleaved_1f1b")
    if takes_virtual:
        return function(pp, microbatches, virtual=virtual, cap=cap)
    if virtual != (fixed or 1):
        raise ParameterError(f"{name} takes no virtual stages (got virtual={virtual}); use interleaved_1f1b")
    if takes_cap:
        if name in COST_AWARE:
            return function(pp, microbatches, cap=cap, cost=times)
        return function(pp, microbatches, cap=cap)
    return function(pp, microbatches)


__all__ = ["COST_AWARE", "FAMILIES", "FIXED_VIRTUAL", "SPLIT_BACKWARD", "family_virtual", "generate", "default_cap"]
