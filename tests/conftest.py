"""Hypothesis profiles, and the `spawn` marker kept honest.

Tests are in folders by layer (compiler, simulate, plan, runtime, nanotron, cli,
benchmarks, package). Every test that starts a process (spawned ranks, torchrun, a
subprocess) carries `@pytest.mark.spawn`; a test that starts one without the mark
fails, naming itself (the guard below wraps process creation while each test and its
fixtures run). `python -m pytest -m "not spawn"` is the inner loop: no process is
started, and the property tests draw a tenth of their examples (Hypothesis profile
"inner", `strategies.examples`); the whole suite (`python -m pytest`, `.ci/run`) draws
all of them.
"""

import multiprocessing.process
import os
import subprocess

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile("ci", parent=settings.get_profile("default"), derandomize=True)
settings.register_profile("inner", parent=settings.get_profile("default"), max_examples=10)
settings.load_profile("ci" if os.environ.get("CI") else "default")


def pytest_configure(config):
    if (config.option.markexpr or "").replace(" ", "") == "notspawn":
        settings.load_profile("inner")

_running = {"test": None, "spawn": True}  # the test being set up or run, and whether it may start processes


def _guarded(start):
    def guarded(*args, **kwargs):
        if not _running["spawn"]:
            pytest.fail(f"{_running['test']} starts a process: mark it @pytest.mark.spawn", pytrace=False)
        return start(*args, **kwargs)

    return guarded


multiprocessing.process.BaseProcess.start = _guarded(multiprocessing.process.BaseProcess.start)
subprocess.Popen.__init__ = _guarded(subprocess.Popen.__init__)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _running.update(test=item.nodeid, spawn=item.get_closest_marker("spawn") is not None)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    _running.update(test=None, spawn=True)
