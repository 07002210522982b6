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

and a third, `get_config_from_dict` (defined in `nanotron.config.config`, re-exported by
`nanotron.config`; `get_config_from_file` looks it up there at each call), turns the
YAML's mapping into nanotron's `Config` with dacite.

`register()` rebinds the three names, in each of those modules and in any other loaded
nanotron module holding the original function, to the wrappers below; the wrappers
handle pipeschedule's names and pass nanotron's own (`afab`, `1f1b`) to the originals,
and the reader accepts `parallelism.pipeline_engine` ([Note: pipeline_engine key]).
It is idempotent, and `unregister()` restores the originals. `import integration.nanotron`
calls `register()`, so a nanotron launch script needs one extra line, placed before any
other nanotron import (see `integration.nanotron._compat` for why first):

    import integration.nanotron  # noqa: F401  (pipeschedule engines in pp_engine)

Why wrapping and not subclassing: dacite is called with `strict=True` and a fixed type
hook for `PipelineEngine`, and the saver raises for unknown classes and writes any
subclass of nanotron's 1F1B engine back as "1f1b", so neither side can be extended from
outside. Syntax of the values: [Note: pp_engine syntax] in `engine_spec`.

[Note: pipeline_engine key] The design names the engine key `pipeline_engine`; nanotron's
field is `pp_engine`, and dacite (strict) refuses any other key. The reader wrapper
renames `parallelism.pipeline_engine` to `pp_engine` before nanotron's reader sees the
mapping, so both names load the same engine, and a saved config has `pp_engine` only
(the one field nanotron has). Both given is refused in one line naming both values,
even when they agree: one of them would silently be ignored otherwise.
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
from integration.nanotron.errors import ConfigError  # noqa: E402

LOAD = "cast_str_to_pipeline_engine"
SAVE = "cast_pipeline_engine_to_str"
READ = "get_config_from_dict"
DESIGN_KEY = "pipeline_engine"  # accepted in `parallelism:` for nanotron's `pp_engine`
BINDING_MODULES = (
    "nanotron.config.utils_config",
    "nanotron.config.parallelism_config",
    "nanotron.config.config",
    "nanotron.config",
)


def register() -> None:
    """Rebind nanotron's pp_engine loader and saver, and its config reader, to the
    pipeschedule-aware wrappers."""
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
        for attr in HOMES:
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
        for attr in HOMES:
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


def _make_reader(original):
    @functools.wraps(original)
    def get_config_from_dict(config_dict, *args, **kwargs):
        """nanotron's reader, also accepting `parallelism.pipeline_engine` ([Note: pipeline_engine key])."""
        return original(canonical_keys(config_dict), *args, **kwargs)

    get_config_from_dict.__pipeschedule_original__ = original
    return get_config_from_dict


def canonical_keys(config_dict):
    """`config_dict` with `parallelism.pipeline_engine` renamed `pp_engine` (in place of it,
    the other keys untouched); refused if both are given. Anything else is returned as it
    is, for nanotron's reader to judge."""
    parallelism = config_dict.get("parallelism") if isinstance(config_dict, dict) else None
    if not isinstance(parallelism, dict) or DESIGN_KEY not in parallelism:
        return config_dict
    if "pp_engine" in parallelism:
        raise ConfigError(
            f"parallelism has both pp_engine ({parallelism['pp_engine']!r}) and {DESIGN_KEY} "
            f"({parallelism[DESIGN_KEY]!r}); give one of them ({DESIGN_KEY} is another name for pp_engine)")
    renamed = {("pp_engine" if key == DESIGN_KEY else key): value for key, value in parallelism.items()}
    return {**config_dict, "parallelism": renamed}


_WRAPPERS: dict = {}  # id(original) -> wrapper, so repeated register() calls bind one object
HOMES = {  # each rebound name: the module defining it, the maker of its wrapper
    LOAD: ("nanotron.config.utils_config", _make_loader),
    SAVE: ("nanotron.config.utils_config", _make_saver),
    READ: ("nanotron.config.config", _make_reader),
}


def _wrappers(originals: dict) -> dict:
    makers = {attr: maker for attr, (_, maker) in HOMES.items()}
    out = {}
    for attr, original in originals.items():
        wrapper = _WRAPPERS.get(id(original))
        if wrapper is None or wrapper.__pipeschedule_original__ is not original:
            wrapper = _WRAPPERS[id(original)] = makers[attr](original)
        out[attr] = wrapper
    return out


def _originals() -> dict:
    out = {}
    for attr, (home, _) in HOMES.items():
        current = getattr(sys.modules[home], attr)
        out[attr] = getattr(current, "__pipeschedule_original__", current)
    return out


def _nanotron_modules():
    return [
        module for name, module in list(sys.modules.items())
        if module is not None and (name == "nanotron" or name.startswith("nanotron."))
    ]
