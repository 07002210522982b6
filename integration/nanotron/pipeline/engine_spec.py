"""`parallelism.pp_engine` values in nanotron's config: the core's grammar
(`pipeschedule.compiler.spec`, [Note: pp_engine syntax] there), with nanotron's own
engine names kept nanotron's.

    afab, 1f1b            nanotron's own engines, unchanged; they take no parameters
                          (`ForeignSpec`: nanotron's loader builds them)
    ps_afab, ps_1f1b,     pipeschedule's engines (`ScheduleSpec`), one per schedule family,
    capped_1f1b, ...      named and parametrised as the family record says
    auto[:reserve=GiB]    `AutoSpec`: chosen at the first step ([Note: auto engine] in engine.py)

`1f1b` and `afab` keep meaning nanotron's engines so that every existing config keeps its
meaning; pipeschedule's versions carry the `ps_` prefix. Saving writes the canonical
string form (`to_string()`).
"""

from __future__ import annotations

from typing import Any

from pipeschedule.compiler.spec import AutoSpec, ForeignSpec, ScheduleSpec, accepted_summary as core_summary
from pipeschedule.compiler.spec import parse_spec

NANOTRON_ENGINES = ("afab", "1f1b")  # nanotron's own; loaded and saved by nanotron's functions
NANOTRON_WORDS = "nanotron's own"
AUTO_ENGINE = "auto"

EngineSpec = ScheduleSpec | AutoSpec | ForeignSpec  # what a pp_engine value parses to


def parse_engine(value: Any) -> EngineSpec:
    """Parse a `pp_engine` value (string or mapping form): `parse_spec` with nanotron's own
    names; raises ParameterError (a ValueError) naming the value and what is accepted."""
    return parse_spec(value, foreign=NANOTRON_ENGINES, foreign_words=NANOTRON_WORDS)


def is_nanotron_builtin(spec: EngineSpec) -> bool:
    """Whether `spec` names one of nanotron's own engines."""
    return isinstance(spec, ForeignSpec)


def accepted_summary() -> str:
    """One line listing every accepted pp_engine value, for error messages."""
    return core_summary(NANOTRON_ENGINES, NANOTRON_WORDS)


__all__ = ["AUTO_ENGINE", "NANOTRON_ENGINES", "AutoSpec", "EngineSpec", "ForeignSpec", "ScheduleSpec",
           "accepted_summary", "is_nanotron_builtin", "parse_engine"]
