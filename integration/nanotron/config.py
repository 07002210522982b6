"""Teach nanotron's config loader and saver the pipeschedule engine names.

nanotron turns `parallelism.pp_engine` into an engine object with
`cast_str_to_pipeline_engine` and back into text with `cast_pipeline_engine_to_str`,
both defined in `nanotron.config.utils_config`. They are *bound by name* elsewhere:

    nanotron.config.config            `from ...utils_config import cast_str_to_pipeline_engine`,
                                      used as dacite's type hook, looked up at each load
    nanotron.config.parallelism_config  same import; `ParallelismArgs.__post_init__`
                                      converts a string given from Python
    nanotron.config (package)         `from .utils_config import *` re-exports both
    nanotron.config.utils_config      the definitions; `serialize` calls the saver

`register()` rebinds both names, in each of those modules and in any other loaded
nanotron module holding the original function, to the wrappers below; the wrappers
handle pipeschedule's names and pass nanotron's own (`afab`, `1f1b`) to the originals.
It is idempotent, and `unregister()` restores the originals. `import integration.nanotron`
calls `register()`, so a nanotron launch script needs one extra line, placed before any
other nanotron import (see `integration.nanotron._compat` for why first):

    import integration.nanotron  # noqa: F401  (pipeschedule engines in pp_engine)

Why wrapping and not subclassing: dacite is called with `strict=True` and a fixed type
hook for `PipelineEngine`, and the saver raises for unknown classes and writes any
subclass of nanotron's 1F1B engine back as "1f1b", so neither side can be extended from
outside. Syntax of the values: [Note: pp_engine syntax] in `engine_spec`.
"""

from __future__ import annotations

import functools
import importlib
import sys

from integration.nanotron._compat import import_nanotron

import_nanotron()

from nanotron.parallel.pipeline_parallel.engine import PipelineEngine  # noqa: E402

from integration.nanotron.engine import build_engine  # noqa: E402
from integration.nanotron.engine_spec import EngineSpec, parse_engine  # noqa: E402

LOAD = "cast_str_to_pipeline_engine"
SAVE = "cast_pipeline_engine_to_str"
BINDING_MODULES = (
    "nanotron.config.utils_config",
    "nanotron.config.parallelism_config",
    "nanotron.config.config",
    "nanotron.config",
)


def register() -> None:
    """Rebind nanotron's pp_engine loader and saver to the pipeschedule-aware wrappers."""
    import_nanotron()
    for name in BINDING_MODULES:
        importlib.import_module(name)
    originals = _originals()
    wrappers = _wrappers(originals)
    for module in _nanotron_modules():
        for attr, original in originals.items():
            current = getattr(module, attr, None)
            if current is original:
                setattr(module, attr, wrappers[attr])
            elif current is not None and getattr(current, "__pipeschedule_original__", None) is original:
                setattr(module, attr, wrappers[attr])  # already ours: keep every binding on one wrapper


def unregister() -> None:
    """Undo `register()`: every binding of a wrapper goes back to nanotron's function."""
    for module in _nanotron_modules():
        for attr in (LOAD, SAVE):
            current = getattr(module, attr, None)
            original = getattr(current, "__pipeschedule_original__", None)
            if original is not None:
                setattr(module, attr, original)


def is_registered() -> bool:
    """True when every module in BINDING_MODULES holds the wrappers."""
    for name in BINDING_MODULES:
        module = sys.modules.get(name)
        if module is None:
            return False
        for attr in (LOAD, SAVE):
            if attr in vars(module) and not hasattr(getattr(module, attr), "__pipeschedule_original__"):
                return False
    return True


# -- the wrappers ------------------------------------------------------------------------


def _make_loader(original):
    @functools.wraps(original)
    def cast_str_to_pipeline_engine(str_pp_engine):
        """nanotron's loader, extended: pipeschedule names and the mapping form build our engines."""
        if isinstance(str_pp_engine, PipelineEngine):
            return str_pp_engine
        spec = parse_engine(str_pp_engine)
        if spec.is_nanotron_builtin:
            return original(spec.name)
        return build_engine(spec)

    cast_str_to_pipeline_engine.__pipeschedule_original__ = original
    return cast_str_to_pipeline_engine


def _make_saver(original):
    @functools.wraps(original)
    def cast_pipeline_engine_to_str(pp_engine):
        """nanotron's saver, extended: an engine carrying an `EngineSpec` writes its canonical
        string (`saved_spec` where it has one: `auto` saves as auto, not as what it chose)."""
        spec = getattr(pp_engine, "saved_spec", getattr(pp_engine, "spec", None))
        if isinstance(spec, EngineSpec) and not spec.is_nanotron_builtin:
            return spec.to_string()
        return original(pp_engine)

    cast_pipeline_engine_to_str.__pipeschedule_original__ = original
    return cast_pipeline_engine_to_str


_WRAPPERS: dict = {}  # id(original) -> wrapper, so repeated register() calls bind one object


def _wrappers(originals: dict) -> dict:
    makers = {LOAD: _make_loader, SAVE: _make_saver}
    out = {}
    for attr, original in originals.items():
        wrapper = _WRAPPERS.get(id(original))
        if wrapper is None or wrapper.__pipeschedule_original__ is not original:
            wrapper = _WRAPPERS[id(original)] = makers[attr](original)
        out[attr] = wrapper
    return out


def _originals() -> dict:
    utils_config = sys.modules["nanotron.config.utils_config"]
    out = {}
    for attr in (LOAD, SAVE):
        current = getattr(utils_config, attr)
        out[attr] = getattr(current, "__pipeschedule_original__", current)
    return out


def _nanotron_modules():
    return [
        module for name, module in list(sys.modules.items())
        if module is not None and (name == "nanotron" or name.startswith("nanotron."))
    ]
