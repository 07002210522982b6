"""Every patch of nanotron's code in one explicit install ([Note: nanotron patches]):
idempotent, reversible, described, guarded."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import integration.nanotron  # noqa: F401  (first: repairs nanotron 0.4's import, installs the patches)
import nanotron
import nanotron.models.base as nanotron_base
from integration.nanotron.patches import patching
from integration.nanotron.pipeline.errors import PatchError
from integration.nanotron.patches import trainer
from integration.nanotron.patches.base import rebind

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_importing_the_adapter_installs_every_patch_and_describe_lists_them():
    text = patching.describe()
    for patch in patching.PATCHES:
        assert patch.state in ("on", "not needed here"), patch.describe()
        assert f"{patch.name}: {patch.state}" in text
        assert any("0.4" in v for v in patch.checked) and any("main" in v for v in patch.checked)
    for patch in patching.GLOO_PATCHES:  # only use_gloo() installs them
        assert f"{patch.name}: off" in text
    assert nanotron_base.build_model is trainer.build_model


def test_install_is_idempotent_and_uninstall_gives_nanotron_its_functions_back():
    ours = {patch.name: patch.original() for patch in trainer.PATCHES}
    patching.install()
    assert nanotron_base.build_model is trainer.build_model
    try:
        patching.uninstall()
        assert nanotron_base.build_model is ours["nanotron.models.base.build_model"]
        assert nanotron_base.build_model is not trainer.build_model
        assert all(patch.state == "off" for patch in trainer.PATCHES)
        assert "nanotron.models.base.build_model: off" in patching.describe()
    finally:
        patching.install()
    assert nanotron_base.build_model is trainer.build_model


def test_a_guard_that_fails_refuses_naming_the_patch_and_the_version():
    def replacement(x):
        return x

    other = rebind(nanotron_base, "build_model", replacement, parameters=("x",), why="a test's")
    with pytest.raises(PatchError) as refused:
        other.install()
    message = str(refused.value)
    assert "patch 'nanotron.models.base.build_model' cannot apply to nanotron " + nanotron.__version__ in message
    assert "takes ('model_builder', 'parallel_context', 'dtype', 'target_pp_ranks', 'device')" in message
    assert "checked against nanotron 0.4" in message
    assert other.state.startswith("refused") and nanotron_base.build_model is trainer.build_model
    missing = rebind(nanotron_base, "no_such_function", replacement, why="a test's")
    with pytest.raises(PatchError, match="nanotron.models.base.no_such_function is missing"):
        missing.install()


@pytest.mark.spawn
def test_the_gloo_patches_install_and_uninstall():
    code = textwrap.dedent("""
        import torch
        import integration.nanotron
        from integration.nanotron import flash_attn_standin
        from integration.nanotron.patches import patching
        flash_attn_standin.install()
        import nanotron.distributed as nanotron_dist
        from nanotron.parallel.context import ParallelContext
        reduce, set_device = nanotron_dist.all_reduce, ParallelContext.set_device
        patching.install(gloo=True)
        patching.install(gloo=True)  # idempotent
        assert nanotron_dist.all_reduce is not reduce and ParallelContext.set_device is not set_device
        assert torch.empty(1, device="cuda").device.type == "cpu"  # the CudaToCpu mode
        patching.uninstall()
        assert nanotron_dist.all_reduce is reduce and ParallelContext.set_device is set_device
        try:
            torch.empty(1, device="cuda")
        except (RuntimeError, AssertionError):
            print("ok")
    """)
    if __import__("torch").cuda.is_available():
        pytest.skip("the CPU-only patches are not needed where torch has a GPU")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_cpu_context_refuses_a_parallel_context_it_was_not_written_for(monkeypatch):
    from nanotron.parallel.context import ParallelContext

    from integration.nanotron.patches import cpu

    cpu._check_parallel_context()  # nanotron's own class: accepted

    def other_init(self, sizes, backend="nccl"):
        pass

    monkeypatch.setattr(ParallelContext, "__init__", other_init)
    with pytest.raises(PatchError, match=r"cpu_parallel_context cannot build nanotron .*'s ParallelContext: its "
                                         r"__init__ takes \('self', 'sizes', 'backend'\)"):
        cpu._check_parallel_context()
