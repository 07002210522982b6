"""nanotron's config loader and saver taught the pipeschedule engine names ([Note: nanotron patches]).

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

The three patches below rebind the three names, in each of those modules and in any
other loaded nanotron module holding the original function, to the functions here; they
handle pipeschedule's names and pass nanotron's own (`afab`, `1f1b`) to the originals,
and the reader accepts `parallelism.pipeline_engine` ([Note: pipeline_engine key]).
`patching.install()` applies them (idempotent), `patching.uninstall()` restores the
originals. `import integration.nanotron` installs them, so a nanotron launch script needs
one extra line, placed before any other nanotron import (nanotron 0.4's wheel imports only
once repaired, [Note: nanotron 0.4 import cycle] in patches/import_cycle.py):

    import integration.nanotron  # noqa: F401  (pipeschedule engines in pp_engine)

Why wrapping and not subclassing: dacite is called with `strict=True` and a fixed type
hook for `PipelineEngine`, and the saver raises for unknown classes and writes any
subclass of nanotron's 1F1B engine back as "1f1b", so neither side can be extended from
outside. Syntax of the values: [Note: pp_engine syntax] in pipeschedule/compiler/spec.py.

[Note: pipeline_engine key] The design names the engine key `pipeline_engine`; nanotron's
field is `pp_engine`, and dacite (strict) refuses any other key. The reader wrapper
renames `parallelism.pipeline_engine` to `pp_engine` before nanotron's reader sees the
mapping, so both names load the same engine, and a saved config has `pp_engine` only
(the one field nanotron has). Both given is refused in one line naming both values,
even when they agree: one of them would silently be ignored otherwise.
"""

from __future__ import annotations

import nanotron.config.config as nanotron_config
import nanotron.config.utils_config as nanotron_utils_config
from nanotron.parallel.pipeline_parallel.engine import PipelineEngine

from integration.nanotron.pipeline.engine import build_engine
from integration.nanotron.pipeline.engine_spec import AutoSpec, ScheduleSpec, is_nanotron_builtin, parse_engine
from integration.nanotron.pipeline.errors import ConfigError
from integration.nanotron.patches.base import EVERY_NANOTRON_MODULE, rebind

DESIGN_KEY = "pipeline_engine"  # accepted in `parallelism:` for nanotron's `pp_engine`


def cast_str_to_pipeline_engine(str_pp_engine):
    """nanotron's loader, extended: pipeschedule names and the mapping form build our engines."""
    if isinstance(str_pp_engine, PipelineEngine):
        return str_pp_engine
    spec = parse_engine(str_pp_engine)
    if is_nanotron_builtin(spec):
        return LOADER.original()(spec.name)
    return build_engine(spec)


def cast_pipeline_engine_to_str(pp_engine):
    """nanotron's saver, extended: an engine carrying a spec of ours writes its canonical
    string (`saved_spec` where it has one: `auto` saves as auto, not as what it chose)."""
    spec = getattr(pp_engine, "saved_spec", getattr(pp_engine, "spec", None))
    if isinstance(spec, (ScheduleSpec, AutoSpec)):
        return spec.to_string()
    return SAVER.original()(pp_engine)


def get_config_from_dict(config_dict, *args, **kwargs):
    """nanotron's reader, also accepting `parallelism.pipeline_engine` ([Note: pipeline_engine key])."""
    return READER.original()(canonical_keys(config_dict), *args, **kwargs)


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


LOADER = rebind(nanotron_utils_config, "cast_str_to_pipeline_engine", cast_str_to_pipeline_engine,
                parameters=("str_pp_engine",), binders=EVERY_NANOTRON_MODULE,
                why="pp_engine values name pipeschedule's engines (dacite's type hook, ParallelismArgs)")
SAVER = rebind(nanotron_utils_config, "cast_pipeline_engine_to_str", cast_pipeline_engine_to_str,
               parameters=("pp_engine",), binders=EVERY_NANOTRON_MODULE,
               why="a config holding one of pipeschedule's engines saves its pp_engine value")
READER = rebind(nanotron_config, "get_config_from_dict", get_config_from_dict, binders=EVERY_NANOTRON_MODULE,
                why="parallelism.pipeline_engine read as pp_engine ([Note: pipeline_engine key])")
PATCHES = (LOADER, SAVER, READER)

__all__ = ["DESIGN_KEY", "LOADER", "PATCHES", "READER", "SAVER", "canonical_keys", "cast_pipeline_engine_to_str",
           "cast_str_to_pipeline_engine", "get_config_from_dict"]
