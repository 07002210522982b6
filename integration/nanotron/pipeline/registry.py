"""The pp_engine names of pipeschedule's engines: one per schedule family, derived from
the family records (`pipeschedule.compiler.families.FAMILIES`: the name is the
family's `engine`, the parameters what the family takes).

    ps_afab, ps_1f1b     afab and 1f1b (nanotron's own engines keep the plain names)
    capped_1f1b, interleaved_1f1b, zb_h1, zbv, v_half, v_min, zb_h2, dualpipev,
    interleaved_zb, looped_bfs                                 the family's own name

Every one of them runs in the one engine class, `engine.PipescheduleEngine`, built by
`engine.build_engine(spec)`; the config code looks names up here.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeschedule.compiler.families import FAMILIES, Family

NANOTRON_ENGINES = ("afab", "1f1b")  # nanotron's own; loaded and saved by nanotron's functions
AUTO_ENGINE = "auto"  # auto[:reserve=GiB]: chosen at the first step ([Note: auto engine] in engine.py)


@dataclass(frozen=True)
class EngineEntry:
    """One pipeschedule engine name.

    family    the schedule family (`pipeschedule.compiler.families.FAMILIES`)
    params    the parameters the name accepts, in canonical order
    required  those of `params` that must be given
    usage     how the name is written, for error messages
    """

    family: str
    params: tuple[str, ...]
    required: tuple[str, ...]
    usage: str


# Every pipeschedule engine also takes these: host offload of stashes
# ([Note: pp_engine syntax] in engine_spec.py) ...
OFFLOAD_PARAMS = ("offload", "lead", "stream")
# ... and layer recompute (integration/nanotron/pipeline/recompute.py).
COMMON_PARAMS = ("recompute",) + OFFLOAD_PARAMS


def _entry(family: Family) -> EngineEntry:
    """A family's engine name: its virtual stages (required where it takes any), its cap
    where it takes one, and a split of decoder layers for every family."""
    syntax = {"virtual": "virtual=V", "cap": "cap=N|N0/N1/...", "split": "split=A/B/..."}
    own = [key for key, taken in (("virtual", family.takes_virtual), ("cap", family.takes_cap), ("split", True))
           if taken]
    required = tuple(key for key in own if key == "virtual")
    optional = ",".join(syntax[key] for key in own if key not in required)
    if required:
        usage = f"{family.engine}:{','.join(syntax[key] for key in required)}[,{optional}]"
    else:
        usage = f"{family.engine}[:{optional}]"
    return EngineEntry(family.name, tuple(own) + COMMON_PARAMS, required, usage)


ENGINES: dict[str, EngineEntry] = {family.engine: _entry(family) for family in FAMILIES.values()}


def accepted_summary() -> str:
    """One line listing every accepted pp_engine value, for error messages."""
    ours = "; ".join(entry.usage for entry in ENGINES.values())
    return (
        f"{', '.join(NANOTRON_ENGINES)} (nanotron's own engines, no parameters); {ours} "
        "(pipeschedule, each also taking recompute=full|selective|N|N0/N1.. and "
        "offload=R0/R1..[,lead=L][,stream=MiB]); "
        "auto[:reserve=GiB] (the fastest of 1F1B, capped 1F1B and 1F1B with host offload that fits, chosen at the "
        "first step); "
        "or the mapping form {name: capped_1f1b, cap: 2}"
    )


__all__ = ["AUTO_ENGINE", "COMMON_PARAMS", "ENGINES", "NANOTRON_ENGINES", "OFFLOAD_PARAMS", "EngineEntry",
           "accepted_summary"]
