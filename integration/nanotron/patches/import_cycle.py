"""The repair of the nanotron 0.4 wheel's import cycle, before nanotron is first imported.

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

It is applied only when the installed `nanotron.logging` is the cyclic 0.4 module:
`nanotron.__version__ == "0.4"` *and* `nanotron/logging.py` is a plain module whose
source contains the import above. GitHub main also says version 0.4 but ships
`nanotron/logging/` as a package without the cycle, so there `import_nanotron()` only
imports nanotron. Call it before anything else imports nanotron; importing
`integration.nanotron` does, first of all. This module imports nothing of nanotron or of
the adapter (a test loads it by path, in a fresh interpreter).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

from pipeschedule.errors import PipescheduleError


class ImportCycleError(PipescheduleError, ImportError):
    """nanotron 0.4's import cycle cannot be repaired: something imported part of nanotron
    first. (Defined here: this module imports nothing of the adapter.)"""


BROKEN_VERSION = "0.4"
CYCLIC_IMPORT = "from nanotron.config.config import LoggingArgs"
_STAND_IN = "nanotron.config.config"
_repaired: list[bool] = []  # [True] once this process repaired the cycle


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
        _repaired.append(True)
    return importlib.import_module("nanotron")


def was_repaired() -> bool:
    """True when `import_nanotron()` repaired the cycle in this process."""
    return bool(_repaired)


def _repair_logging_cycle() -> None:
    """Steps 1-3 of [Note: nanotron 0.4 import cycle]."""
    if _STAND_IN in sys.modules:
        raise ImportCycleError(
            f"cannot repair nanotron {BROKEN_VERSION}'s import cycle: {_STAND_IN} is already in sys.modules "
            "but nanotron.logging is not; import integration.nanotron before anything imports nanotron"
        )
    stand_in = types.ModuleType(_STAND_IN, "stand-in while nanotron.logging imports "
                                           "(integration.nanotron.patches.import_cycle)")
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
