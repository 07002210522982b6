"""The one place where a broken nanotron release is repaired at import time.

[Note: nanotron 0.4 import cycle] The PyPI wheel nanotron==0.4 does not import as
shipped. `nanotron/logging.py` (a module there; a package upstream) runs

    from nanotron.config.config import LoggingArgs      # used in one annotation only

and `nanotron.config` imports, through `utils_config`, the pipeline engine, whose first
lines import `nanotron.logging` again. Whichever of the two is imported first, the other
is found half-initialised and an ImportError ends the import. Upstream fixed it the day
after the release by importing `LoggingArgs` under `TYPE_CHECKING` only.

The repair, without touching any installed file:

1. put a stand-in module under the name `nanotron.config.config` in `sys.modules`,
   holding a placeholder class `LoggingArgs` (the one name `nanotron.logging` imports);
2. import `nanotron.logging`: its `from nanotron.config.config import ...` finds the
   stand-in and does not start the real `nanotron.config`, so the cycle never closes;
3. remove the stand-in, import the real `nanotron.config` (which now finds a complete
   `nanotron.logging`), and rebind `nanotron.logging.LoggingArgs` (and the annotation
   that captured the placeholder) to the real class.

[Note: nanotron 0.4 with NumPy 2] nanotron writes a checkpoint's tensor metadata with
`str()` of its slice bounds and shapes, which are NumPy integers where they were computed
with NumPy; under NumPy 2 `str(np.int64(64))` is "np.int64(64)", which nanotron's own
loader cannot parse back (`int("np.int64(64)")`), so a checkpoint nanotron 0.4 saves
cannot be loaded (resuming, `init_method: {path: ...}`). `TensorMetadata.to_str_dict`
is wrapped to write plain integers, as under NumPy 1; a checkpoint already written with
NumPy's spelling still needs to be saved again.

It is applied only when the installed `nanotron.logging` is the cyclic 0.4 module:
`nanotron.__version__ == "0.4"` *and* `nanotron/logging.py` is a plain module whose
source contains the import above. GitHub main also says version 0.4 but ships
`nanotron/logging/` as a package without the cycle, so there `import_nanotron()` only
imports nanotron. Call it before anything else imports nanotron; importing
`integration.nanotron` does.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
import types

from pipeschedule.errors import PipescheduleError


class AdapterImportError(PipescheduleError, ImportError):
    """Something the adapter imports cannot be set up: nanotron's repair, the flash-attn
    stand-in, an engine's class path. (Defined here, the first module the adapter loads,
    which imports nothing of the adapter; `integration.nanotron.errors` re-exports it.)"""

BROKEN_VERSION = "0.4"
CYCLIC_IMPORT = "from nanotron.config.config import LoggingArgs"
_STAND_IN = "nanotron.config.config"


class _LoggingArgsStandIn:
    """Placeholder for `nanotron.config.config.LoggingArgs` while `nanotron.logging` loads.

    Replaced by the real class as soon as `nanotron.config` has loaded; see
    [Note: nanotron 0.4 import cycle].
    """


def needs_logging_repair() -> bool:
    """True when the installed nanotron has the 0.4 import cycle and it is not yet resolved."""
    if "nanotron.logging" in sys.modules:
        return False  # already imported: either repaired earlier or not broken
    try:
        nanotron = importlib.import_module("nanotron")  # its __init__ only sets __version__
    except ImportError:
        return False
    if getattr(nanotron, "__version__", None) != BROKEN_VERSION:
        return False
    spec = importlib.util.find_spec("nanotron.logging")
    if spec is None or spec.origin is None or spec.submodule_search_locations is not None:
        return False  # missing, or a package (upstream layout after the fix)
    try:
        with open(spec.origin, encoding="utf-8") as handle:
            source = handle.read()
    except OSError:
        return False
    return any(line.strip() == CYCLIC_IMPORT for line in source.splitlines())


def import_nanotron() -> types.ModuleType:
    """Import nanotron, repairing the 0.4 wheel's import cycle if (and only if) present.

    Idempotent. Returns the `nanotron` package. After it returns, `nanotron.logging` and
    `nanotron.config` import normally in any order.
    """
    if needs_logging_repair():
        _repair_logging_cycle()
    nanotron = importlib.import_module("nanotron")
    _repair_metadata_integers()
    return nanotron


def _repair_metadata_integers() -> None:
    """[Note: nanotron 0.4 with NumPy 2]: checkpoint metadata written with plain ints."""
    try:
        metadata = importlib.import_module("nanotron.serialize.metadata")
        parameters = importlib.import_module("nanotron.parallel.parameters")
    except ImportError:
        return  # a nanotron without this module: nothing to repair
    original = getattr(metadata.TensorMetadata, "to_str_dict", None)
    if original is None or hasattr(original, "__pipeschedule_original__"):
        return

    def plain(bound):
        return None if bound is None else int(bound)

    def plain_slices(slices):
        return tuple(slice(plain(s.start), plain(s.stop), plain(s.step)) for s in slices)

    def to_str_dict(self):
        pairs = tuple(parameters.SlicesPair(plain_slices(p.local_slices), plain_slices(p.global_slices))
                      for p in self.local_global_slices_pairs)
        return original(dataclasses.replace(self, local_global_slices_pairs=pairs,
                                            unsharded_shape=tuple(int(n) for n in self.unsharded_shape)))

    to_str_dict.__pipeschedule_original__ = original
    metadata.TensorMetadata.to_str_dict = to_str_dict


def _repair_logging_cycle() -> None:
    """Steps 1-3 of [Note: nanotron 0.4 import cycle]."""
    if _STAND_IN in sys.modules:
        raise AdapterImportError(
            f"cannot repair nanotron {BROKEN_VERSION}'s import cycle: {_STAND_IN} is already in sys.modules "
            "but nanotron.logging is not; import integration.nanotron before anything imports nanotron"
        )
    stand_in = types.ModuleType(_STAND_IN, "stand-in while nanotron.logging imports (integration.nanotron._compat)")
    stand_in.LoggingArgs = _LoggingArgsStandIn
    sys.modules[_STAND_IN] = stand_in
    try:
        logging_module = importlib.import_module("nanotron.logging")
    finally:
        if sys.modules.get(_STAND_IN) is stand_in:
            del sys.modules[_STAND_IN]
    real_config = importlib.import_module("nanotron.config.config")
    real = real_config.LoggingArgs
    logging_module.LoggingArgs = real
    for value in vars(logging_module).values():
        annotations = getattr(value, "__annotations__", None)
        if isinstance(annotations, dict) and isinstance(value, types.FunctionType):
            for key, annotation in list(annotations.items()):
                if annotation is _LoggingArgsStandIn:
                    annotations[key] = real
