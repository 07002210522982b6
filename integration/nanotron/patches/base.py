"""`Patch`: one change to nanotron's (or torch's) code, guarded, reversible, described
([Note: nanotron patches]); `rebind`: the common kind, a function or class attribute
replaced by name."""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from integration.nanotron.pipeline.errors import PatchError

CHECKED = ("0.4 (PyPI wheel)", "GitHub main (2026-12)")  # the nanotron versions every patch was checked against
EVERY_NANOTRON_MODULE = "every loaded nanotron module"  # `binders` value: rebind wherever the original is bound


def nanotron_version() -> str:
    module = sys.modules.get("nanotron")
    return getattr(module, "__version__", "not imported") if module is not None else "not imported"


@dataclass(eq=False)
class Patch:
    """One change: `check()` returns None where it applies, else what differs from what it
    was written for; `apply()` / `undo()` make and unmake it (`undo` None: not reversible);
    `needed()` False: nothing to change in this process (left off, and said so);
    `original()`, where given, is what it replaces."""

    name: str
    why: str
    check: Callable[[], str | None]
    apply: Callable[[], None]
    undo: Callable[[], None] | None
    needed: Callable[[], bool] = lambda: True
    original: Callable[[], object] | None = None  # what it replaces (a rebind's nanotron function)
    checked: tuple[str, ...] = CHECKED
    state: str = field(default="off", init=False)

    def install(self) -> None:
        """Apply it unless it is on (idempotent); PatchError where its guard fails."""
        if self.state == "on":
            return
        if not self.needed():
            self.state = "not needed here"
            return
        problem = self.check()
        if problem is not None:
            self.state = f"refused: {problem}"
            raise PatchError(
                f"patch {self.name!r} cannot apply to nanotron {nanotron_version()}: {problem} (the patch was "
                f"checked against nanotron {' and '.join(self.checked)}; install nanotron>=0.4,<0.5)")
        self.apply()
        self.state = "on"

    def uninstall(self) -> None:
        if self.state == "on" and self.undo is not None:
            self.undo()
            self.state = "off"

    def describe(self) -> str:
        return f"{self.name}: {self.state}" + ("" if self.undo is not None else " (not reversible)")


def resolve(home: object):
    """`home` as given, or the object a "module" or "module:Class" string names (imported
    when the patch applies, for homes that must not be imported earlier)."""
    if not isinstance(home, str):
        return home
    module_name, _, attr = home.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr) if attr else module


def rebind(home: object, attr: str, replacement, *, why: str, parameters: tuple[str, ...] | None = None,
           binders: tuple[str, ...] | str = (), needed: Callable[[], bool] = lambda: True) -> Patch:
    """A patch replacing `home.attr` by `replacement`, and the same function in `binders`
    (modules that imported it by name; `EVERY_NANOTRON_MODULE`: wherever it is bound).
    Guarded by the attribute being there and, with `parameters`, by its parameter names.
    `replacement.__pipeschedule_original__` is nanotron's function while the patch is on."""
    label = f"{_name_of(home)}.{attr}"
    holder: dict[str, object] = {}

    def original():
        current = getattr(resolve(home), attr)
        return getattr(current, "__pipeschedule_original__", current)

    def modules():
        if binders == EVERY_NANOTRON_MODULE:
            return [m for name, m in list(sys.modules.items())
                    if m is not None and (name == "nanotron" or name.startswith("nanotron."))]
        return [sys.modules[name] for name in binders if sys.modules.get(name) is not None]

    def check():
        target = resolve(home)
        if not hasattr(target, attr):
            return f"{label} is missing"
        if parameters is not None:
            found = tuple(inspect.signature(original()).parameters)
            if found != parameters:
                return f"{label} takes {found}, the patch was written for {parameters}"
        return None

    def apply():
        holder["original"] = first = original()
        _set_original(replacement, first)
        setattr(resolve(home), attr, replacement)
        for module in modules():
            if getattr(module, attr, None) is first:
                setattr(module, attr, replacement)

    def undo():
        first = holder["original"]
        for target in (resolve(home), *modules()):
            if getattr(target, attr, None) is replacement:
                setattr(target, attr, first)

    return Patch(label, why, check, apply, undo, needed, original)


def _name_of(home) -> str:
    if isinstance(home, str):
        return home.replace(":", ".")
    if isinstance(home, type):
        return f"{home.__module__}.{home.__qualname__}"
    return getattr(home, "__name__", repr(home))


def _set_original(replacement, original) -> None:
    try:
        replacement.__pipeschedule_original__ = original
    except (AttributeError, TypeError):  # a class or builtin that takes no attribute: kept by the patch only
        pass


__all__ = ["CHECKED", "EVERY_NANOTRON_MODULE", "Patch", "nanotron_version", "rebind", "resolve"]
