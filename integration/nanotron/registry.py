"""Which class runs each pipeschedule engine name, resolved lazily from a class path.

The config code (`integration.nanotron.config`) never names an engine class: it looks
the name up here and imports `EngineEntry.engine` ("module:Class") when a config is
loaded. Adding the real engines means changing the `engine` strings below to point into
`integration/nanotron/engine.py`; nothing in the config code changes.

Contract for an engine class: a subclass of nanotron's `PipelineEngine` whose
constructor takes the parsed `EngineSpec` as its only argument and keeps it as
`self.spec` (saving a config writes `engine.spec.to_string()`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from integration.nanotron._compat import import_nanotron
from integration.nanotron.errors import AdapterImportError

import_nanotron()

from nanotron.parallel.pipeline_parallel.engine import PipelineEngine  # noqa: E402

NANOTRON_ENGINES = ("afab", "1f1b")  # nanotron's own; loaded and saved by nanotron's functions


@dataclass(frozen=True)
class EngineEntry:
    """One pipeschedule engine name.

    family    the generator family in `pipeschedule.generators.FAMILIES`
    params    the parameters the name accepts, in canonical order
    required  those of `params` that must be given
    engine    "module:Class" of the engine, imported when a config names it
    usage     how the name is written, for error messages
    """

    family: str
    params: tuple[str, ...]
    required: tuple[str, ...]
    engine: str
    usage: str


# Every pipeschedule engine also takes these: host offload of stashes ([Note: pp_engine
# syntax] in engine_spec.py).
OFFLOAD_PARAMS = ("offload", "lead", "stream")
# ... and layer recompute (integration/nanotron/recompute.py).
COMMON_PARAMS = ("recompute",) + OFFLOAD_PARAMS

ENGINES: dict[str, EngineEntry] = {
    "ps_afab": EngineEntry("afab", ("split",) + COMMON_PARAMS, (), "integration.nanotron.engine:PsAfabEngine",
                           "ps_afab[:split=A/B/...]"),
    "ps_1f1b": EngineEntry("1f1b", ("split",) + COMMON_PARAMS, (), "integration.nanotron.engine:PsOneFOneBEngine",
                           "ps_1f1b[:split=A/B/...]"),
    "capped_1f1b": EngineEntry(
        "capped_1f1b", ("cap", "split") + COMMON_PARAMS, (), "integration.nanotron.engine:CappedOneFOneBEngine",
        "capped_1f1b[:cap=N|N0/N1/...,split=A/B/...]",
    ),
    "interleaved_1f1b": EngineEntry(
        "interleaved_1f1b", ("virtual", "cap", "split") + COMMON_PARAMS, ("virtual",),
        "integration.nanotron.engine:InterleavedOneFOneBEngine", "interleaved_1f1b:virtual=V[,cap=N,split=A/B/...]",
    ),
    "zb_h1": EngineEntry(
        "zb_h1", ("cap", "split") + COMMON_PARAMS, (), "integration.nanotron.engine:ZeroBubbleH1Engine",
        "zb_h1[:cap=N,split=A/B/...]",
    ),
    "zbv": EngineEntry(
        "zbv", ("cap", "split") + COMMON_PARAMS, (), "integration.nanotron.engine:ZeroBubbleVEngine",
        "zbv[:cap=N,split=A/B/...]",
    ),
    "v_half": EngineEntry(
        "v_half", ("cap", "split") + COMMON_PARAMS, (), "integration.nanotron.engine:VHalfEngine",
        "v_half[:cap=N,split=A/B/...]",
    ),
    "v_min": EngineEntry(
        "v_min", ("cap", "split") + COMMON_PARAMS, (), "integration.nanotron.engine:VMinEngine",
        "v_min[:cap=N,split=A/B/...]",
    ),
}


def accepted_summary() -> str:
    """One line listing every accepted pp_engine value, for error messages."""
    ours = "; ".join(entry.usage for entry in ENGINES.values())
    return (
        f"{', '.join(NANOTRON_ENGINES)} (nanotron's own engines, no parameters); {ours} "
        "(pipeschedule, each also taking recompute=full|selective|N|N0/N1.. and "
        "offload=R0/R1..[,lead=L][,stream=MiB]); "
        "or the mapping form {name: capped_1f1b, cap: 2}"
    )


def resolve(class_path: str) -> type:
    """Import "module:Class" and return the class; raises ImportError naming the path."""
    module_name, sep, attr = class_path.partition(":")
    if not sep or not module_name or not attr:
        raise AdapterImportError(f"engine class path {class_path!r} is not of the form 'module:Class'")
    module = importlib.import_module(module_name)
    try:
        cls = getattr(module, attr)
    except AttributeError:
        raise AdapterImportError(f"engine class path {class_path!r}: module {module_name} has no {attr}") from None
    if not (isinstance(cls, type) and issubclass(cls, PipelineEngine)):
        raise AdapterImportError(f"engine class path {class_path!r} does not name a nanotron PipelineEngine subclass")
    return cls


def build_engine(spec) -> PipelineEngine:
    """The engine object for a parsed pipeschedule `EngineSpec` (not for nanotron's own)."""
    cls = resolve(ENGINES[spec.name].engine)
    return cls(spec)
