"""One error hierarchy: what pipeschedule raises on purpose derives from
`PipescheduleError` (pipeschedule/errors.py), so callers can catch exactly these.

Read from the source (every `raise Name(...)` and `raise Name`), not by running it:
- nowhere in the package a bare ValueError, RuntimeError, NotImplementedError or
  TypeError (a `PipescheduleError` subclass that also derives from the builtin, such as
  `ParameterError(PipescheduleError, ValueError)`, keeps `except ValueError` working);
- in the runtime, every exception class raised by name is a `PipescheduleError`.
The nanotron adapter (integration/) is not covered yet.
"""

from __future__ import annotations

import ast
import builtins
import importlib
from pathlib import Path

from pipeschedule.errors import PipescheduleError

PACKAGE = Path(__file__).resolve().parents[2] / "pipeschedule"
BARE = ("ValueError", "RuntimeError", "NotImplementedError", "TypeError")


def raised_names(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every `raise Name(...)` and `raise Name` in the file; raises of
    attributes (`self.error(...)`) and re-raises are not named."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name):
                out.append((node.lineno, exc.id))
    return out


def _modules(root: Path):
    for path in sorted(root.rglob("*.py")):
        yield path, ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def test_the_walk_finds_raises():
    runtime = PACKAGE / "runtime" / "executor.py"
    assert ("RuntimeScheduleError" in {name for _, name in raised_names(runtime)})


def test_no_bare_builtin_error_is_raised_anywhere_in_the_package():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: raise {name}"
             for path, _ in _modules(PACKAGE) for line, name in raised_names(path) if name in BARE]
    assert not found, "raise a PipescheduleError subclass instead (pipeschedule/errors.py):\n" + "\n".join(found)


def test_the_runtime_raises_only_pipeschedule_errors():
    found = []
    for path, module_name in _modules(PACKAGE / "runtime"):
        module = importlib.import_module(module_name.removesuffix(".__init__"))
        for line, name in raised_names(path):
            raised = getattr(module, name, getattr(builtins, name, None))
            if (isinstance(raised, type) and issubclass(raised, BaseException)
                    and not issubclass(raised, PipescheduleError)):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: raise {name}")
    assert not found, "the runtime raises only PipescheduleError subclasses:\n" + "\n".join(found)


ADAPTER = PACKAGE.parent / "integration" / "nanotron"
SCAFFOLDING = {"demo.py"}  # `pipeschedule demo`'s training part: prints, never raises on purpose


def test_the_nanotron_adapter_raises_only_pipeschedule_errors():
    """What a user imports from integration/nanotron (the test and benchmark helpers live
    in benchmarks/llama/, outside the installed adapter)."""
    import integration.nanotron  # noqa: F401  (repairs nanotron before its modules import)

    found = []
    for path in sorted(ADAPTER.glob("*.py")):
        if path.name in SCAFFOLDING:
            continue
        module = importlib.import_module("integration.nanotron." + path.stem if path.stem != "__init__"
                                         else "integration.nanotron")
        for line, name in raised_names(path):
            raised = getattr(module, name, getattr(builtins, name, None))
            if (isinstance(raised, type) and issubclass(raised, BaseException)
                    and not issubclass(raised, PipescheduleError)):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: raise {name}")
    assert not found, ("raise a PipescheduleError subclass (integration/nanotron/pipeline/errors.py):\n"
                       + "\n".join(found))
