"""The import-time repair of the nanotron 0.4 wheel (integration/nanotron/patches/import_cycle.py).

Each case runs in a fresh interpreter: the repair is about the *first* import.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.spawn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def python(code: str, *, path_first: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path_first, ROOT, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


# Load import_cycle.py by path: importing integration.nanotron would already apply the repair
# (and its patches need a real nanotron.config).
LOAD_COMPAT = f"""
import importlib.util
_spec = importlib.util.spec_from_file_location(
    "compat", {os.path.join(ROOT, "integration", "nanotron", "patches", "import_cycle.py")!r}
)
compat = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compat)
"""


def installed_wheel_is_broken() -> bool:
    out = python(LOAD_COMPAT + "print(compat.needs_logging_repair())")
    assert out.returncode == 0, out.stderr
    return out.stdout.strip() == "True"


@pytest.mark.skipif(not installed_wheel_is_broken(), reason="installed nanotron is not the cyclic 0.4 wheel")
def test_the_wheel_does_not_import_as_shipped():
    for first in ("nanotron.logging", "nanotron.config", "nanotron.parallel.pipeline_parallel.engine"):
        out = python(f"import {first}")
        assert out.returncode != 0 and "circular import" in out.stderr, (first, out.stderr[-500:])


def test_repair_makes_every_entry_point_import():
    out = python("""
        from integration.nanotron.patches.import_cycle import import_nanotron, needs_logging_repair
        import_nanotron()
        import sys
        import nanotron.logging, nanotron.config, nanotron.config.config as real
        from nanotron.parallel.pipeline_parallel.engine import OneForwardOneBackwardPipelineEngine
        from nanotron.models.base import build_model
        assert hasattr(real, "Config") and sys.modules["nanotron.config.config"] is real
        assert nanotron.logging.LoggingArgs is real.LoggingArgs
        ann = nanotron.logging.set_ranks_logging_level.__annotations__["logging_config"]
        assert ann is real.LoggingArgs, ann
        assert not needs_logging_repair()
        import_nanotron()  # idempotent
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_importing_the_adapter_is_the_one_extra_line():
    out = python("""
        import integration.nanotron
        from nanotron.config import get_config_from_dict
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def fake_nanotron(root, *, version: str, logging_as_package: bool, cyclic_line: bool) -> str:
    """A stand-in nanotron tree with just the layout the repair inspects."""
    pkg = root / "nanotron"
    (pkg / "config").mkdir(parents=True)
    (pkg / "__init__.py").write_text(f'__version__ = "{version}"\n')
    (pkg / "config" / "__init__.py").write_text("")
    (pkg / "config" / "config.py").write_text("class LoggingArgs: pass\n")
    body = ("from nanotron.config.config import LoggingArgs\n" if cyclic_line else "") + "MARK = 1\n"
    if logging_as_package:
        (pkg / "logging").mkdir()
        (pkg / "logging" / "__init__.py").write_text(body)
    else:
        (pkg / "logging.py").write_text(body)
    return str(root)


@pytest.mark.parametrize("version, logging_as_package, cyclic_line", [
    ("0.4", True, False),    # GitHub main: version 0.4, logging is a package (TYPE_CHECKING import)
    ("0.5", False, True),    # another version, even with the same line
    ("0.4", False, False),   # a 0.4 module without the cyclic import
])
def test_no_op_on_other_layouts(tmp_path, version, logging_as_package, cyclic_line):
    path = fake_nanotron(tmp_path, version=version, logging_as_package=logging_as_package, cyclic_line=cyclic_line)
    out = python(LOAD_COMPAT + """
import sys
assert not compat.needs_logging_repair()
compat.import_nanotron()
assert "nanotron.logging" not in sys.modules and "nanotron.config.config" not in sys.modules
print(sys.modules["nanotron"].__file__)
""", path_first=path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().startswith(str(tmp_path))
