"""The package's layering, read from the source (its imports, not running them): no
import circle among pipeschedule, integration and benchmarks; the compiler, simulator
and planner import no torch and no nanotron (only pipeschedule/runtime and integration/
do); and no file of pipeschedule/ imports anything of integration/, at module level or
inside a function: the adapter's commands are registered by the adapter ([Note:
registered commands] in pipeschedule/cli/command.py), and each entry point it registers
names a module that imports no torch at load. What each command loads when it runs is
tests/cli/test_cli_help.py's.

An edge A -> B is an `import B` / `from B import name` anywhere in A (a name that is a
module of B counts as that module), inside functions too: an import moved into a
function to break a circle still closes it here. Imports inside functions are for
optional or heavy dependencies only (matplotlib, torch where it is optional).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pipeschedule", "integration", "benchmarks")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules that `path` imports, at module level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                     for alias in node.names]
        else:
            continue
        out.update(name for name in names if name in known)
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    known = modules()
    graph = {name: imports(path, known) for name, path in known.items()}
    assert not circles(graph), "modules that import each other in a circle: " + "; ".join(
        " <-> ".join(c) for c in circles(graph))


def imported_names(path: Path) -> list[tuple[str, bool]]:
    """Every module name `path` imports, and whether the import is inside a function."""
    tree = ast.parse(path.read_text())
    inside = {id(node) for function in ast.walk(tree) if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
              for node in ast.walk(function)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in inside) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            out.append((node.module or "", id(node) in inside))
    return out


def compiler_imports(roots: tuple[str, ...]) -> list[str]:
    """`module: name` for each import of a package in `roots` by pipeschedule outside runtime/."""
    found = []
    for name, path in modules().items():
        if not name.startswith("pipeschedule") or name.startswith("pipeschedule.runtime"):
            continue
        found += [f"{name}: {n}" for n, _ in imported_names(path) if n.split(".")[0] in roots]
    return found


def test_the_compiler_simulator_and_planner_import_no_torch_and_no_nanotron():
    assert not compiler_imports(("torch", "nanotron")), compiler_imports(("torch", "nanotron"))


def adapter_imports(names: dict[str, Path]) -> list[tuple[str, str]]:
    """(module, imported name) for each import of integration/ by a module of pipeschedule/."""
    return [(name, n) for name, path in names.items() if name.split(".")[0] == "pipeschedule"
            for n, _ in imported_names(path) if n.split(".")[0] == "integration"]


def test_no_file_of_pipeschedule_imports_the_adapter():
    assert not adapter_imports(modules()), adapter_imports(modules())


def test_the_rule_sees_an_import_of_the_adapter_inside_a_function(tmp_path):
    path = tmp_path / "door.py"
    path.write_text("def run():\n    from integration.nanotron.check import main\n    import integration\n")
    assert adapter_imports({"pipeschedule.cli.door": path}) == [("pipeschedule.cli.door", "integration.nanotron.check"),
                                                               ("pipeschedule.cli.door", "integration")]
    assert adapter_imports({"benchmarks.door": path}) == []


def registered_entry_points() -> dict[str, str]:
    """`name: module:attribute` of every entry point pyproject.toml registers for pipeschedule."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {f"{group}:{name}": value for group, entries in project.get("entry-points", {}).items()
            if group.startswith("pipeschedule.") for name, value in entries.items()}


def test_every_registered_entry_point_names_a_module_that_imports_no_torch_at_load():
    """`pipeschedule -h` loads them all: their modules import neither torch nor nanotron
    at module level, nor a package whose __init__ does (integration.nanotron)."""
    entries = registered_entry_points()
    assert {"pipeschedule.commands:check", "pipeschedule.commands:train", "pipeschedule.demo:nanotron"} <= set(entries)
    known = modules()
    for value in entries.values():
        module = value.split(":")[0]
        assert module in known, value
        heavy = [n for n, inside in imported_names(known[module]) if not inside
                 and (n.split(".")[0] in ("torch", "nanotron") or n.startswith("integration.nanotron"))]
        assert not heavy, (value, heavy)


def test_the_circle_finder_finds_circles():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imported_names_tell_module_level_from_function_imports(tmp_path):
    path = tmp_path / "sample.py"
    path.write_text("import torch\nfrom integration.nanotron import check\n\n\n"
                    "def run():\n    from integration.nanotron.check import main\n    import nanotron.config\n")
    assert imported_names(path) == [("torch", False), ("integration.nanotron", False),
                                    ("integration.nanotron.check", True), ("nanotron.config", True)]
