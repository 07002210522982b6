"""Schedule families. Each returns the compute order (F, B, W) of every rank.

`generate(name, pp=, microbatches=, virtual=, cap=)` validates the parameters against
what the family accepts and calls it.
"""

from __future__ import annotations

from pipeschedule.gcpause import gc_paused

from pipeschedule.errors import ParameterError
from pipeschedule.generators.afab import afab
from pipeschedule.generators.common import check_common, per_rank_caps
from pipeschedule.generators.interleaved import interleaved_1f1b
from pipeschedule.generators.one_f_one_b import capped_1f1b, default_cap, one_f_one_b

# name -> (function, takes virtual, takes cap)
FAMILIES = {
    "afab": (afab, False, False),
    "1f1b": (one_f_one_b, False, False),
    "capped_1f1b": (capped_1f1b, False, True),
    "interleaved_1f1b": (interleaved_1f1b, True, True),
}


@gc_paused
def generate(name: str, *, pp: int, microbatches: int, virtual: int = 1, cap=None):
    """The compute-only schedule of family `name`; raises ParameterError on bad input."""
    if name not in FAMILIES:
        raise ParameterError(f"unknown schedule {name!r}; accepted: {', '.join(FAMILIES)}")
    function, takes_virtual, takes_cap = FAMILIES[name]
    check_common(pp, microbatches, virtual)
    if cap is not None:
        per_rank_caps(cap, pp)
        if not takes_cap:
            raise ParameterError(f"{name} takes no cap (got cap={cap!r}); use capped_1f1b or interleaved_1f1b")
    if takes_virtual:
        return function(pp, microbatches, virtual=virtual, cap=cap)
    if virtual != 1:
        raise ParameterError(f"{name} takes no virtual stages (got virtual={virtual}); use interleaved_1f1b")
    if takes_cap:
        return function(pp, microbatches, cap=cap)
    return function(pp, microbatches)


__all__ = ["FAMILIES", "generate", "default_cap"]
