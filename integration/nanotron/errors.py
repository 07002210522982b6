"""The adapter's error types, in pipeschedule's one hierarchy (`pipeschedule.errors`).

Every refusal the adapter makes on purpose derives from `PipescheduleError`, so a
launcher can print it as one line on every rank and stop.
"""

from __future__ import annotations

from pipeschedule.errors import ParameterError, PipescheduleError


class LayoutError(PipescheduleError, ValueError):
    """The model's blocks are not where the engine's split and placement put them, or
    that split and placement cannot be built for this model."""


class UnsupportedConfigError(PipescheduleError, ValueError):
    """A nanotron setting this engine cannot run with (named in the message)."""


class EngineRuntimeError(PipescheduleError, RuntimeError):
    """The model or data did something during a step the engine cannot follow."""


__all__ = ["EngineRuntimeError", "LayoutError", "ParameterError", "PipescheduleError", "UnsupportedConfigError"]
