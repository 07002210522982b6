"""The adapter's error types, in pipeschedule's one hierarchy (`pipeschedule.errors`).

Every refusal the adapter makes on purpose derives from `PipescheduleError`, so a
launcher can print it as one line on every rank and stop.
"""

from __future__ import annotations

from pipeschedule.errors import ParameterError, PipescheduleError


class AdapterImportError(PipescheduleError, ImportError):
    """Something the adapter imports cannot be set up: a patch of nanotron, the flash-attn
    stand-in, an engine's class path. (nanotron 0.4's import-cycle repair, which runs before
    any of the adapter, raises its own `ImportCycleError`, in patches/import_cycle.py.)"""


class LayoutError(PipescheduleError, ValueError):
    """The model's blocks are not where the engine's split and placement put them, or
    that split and placement cannot be built for this model."""


class ConfigError(PipescheduleError, ValueError):
    """A nanotron config whose keys cannot be read as given (named in the message)."""


class UnsupportedConfigError(PipescheduleError, ValueError):
    """A nanotron setting this engine cannot run with (named in the message)."""


class StandInError(PipescheduleError, ValueError):
    """An argument the flash-attn stand-in refuses (flash-attn itself raises ValueError)."""


class StandInUnsupported(PipescheduleError, NotImplementedError):
    """A flash-attn feature the stand-in does not reproduce."""


class DataError(PipescheduleError, ValueError):
    """The config's data cannot feed its model: a dataset or tokenizer that cannot be
    loaded, a missing text column, a vocabulary or sequence the model cannot take, too
    few samples for the steps asked (integration/nanotron/data.py)."""


class PatchError(AdapterImportError):
    """A patch of nanotron's code cannot apply to the installed nanotron: the message names
    the patch, the version and what differs ([Note: nanotron patches])."""


class EngineRuntimeError(PipescheduleError, RuntimeError):
    """The model or data did something during a step the engine cannot follow."""


__all__ = ["AdapterImportError", "ConfigError", "DataError", "EngineRuntimeError", "LayoutError", "ParameterError",
           "PatchError", "PipescheduleError", "StandInError", "StandInUnsupported", "UnsupportedConfigError"]
