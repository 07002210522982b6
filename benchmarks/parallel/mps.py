"""The CUDA MPS daemon for the benchmarks that run one process per rank on one GPU.

Under MPS (Multi-Process Service) the processes of one user share one GPU context on
the device, so their kernels can run at the same time, and each client process may be
limited to a share of the SMs by `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, read when the
client first touches CUDA. `daemon()` starts a private daemon (its pipe and log folders
in a temporary folder, so it meets no other daemon on the machine) and quits it on exit;
the clients find it through `CUDA_MPS_PIPE_DIRECTORY` in the environment it returns.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

CONTROL = "nvidia-cuda-mps-control"


class MPSUnavailable(RuntimeError):
    """The daemon could not be started here (no control program, or it refused)."""


@contextlib.contextmanager
def daemon() -> Iterator[dict[str, str]]:
    """Starts a private MPS daemon; yields the environment variables a client needs
    (CUDA_MPS_PIPE_DIRECTORY, CUDA_MPS_LOG_DIRECTORY) and quits the daemon on exit.
    Raises MPSUnavailable when it cannot start."""
    control = shutil.which(CONTROL)
    if control is None:
        raise MPSUnavailable(f"{CONTROL} is not on the PATH (the CUDA driver's MPS tools are needed)")
    with tempfile.TemporaryDirectory(prefix="pipeschedule-mps-") as folder:
        env = {"CUDA_MPS_PIPE_DIRECTORY": str(Path(folder) / "pipe"),
               "CUDA_MPS_LOG_DIRECTORY": str(Path(folder) / "log")}
        for path in env.values():
            Path(path).mkdir()
        full = dict(os.environ, **env)
        started = subprocess.run([control, "-d"], env=full, capture_output=True, text=True, timeout=30)
        if started.returncode != 0:
            raise MPSUnavailable(f"{CONTROL} -d: {started.stderr.strip() or f'exit status {started.returncode}'}")
        try:
            yield env
        finally:
            subprocess.run([control], input="quit\n", env=full, capture_output=True, text=True, timeout=30)


def log_tail(env: dict[str, str], chars: int = 600) -> str:
    """The end of the daemon's control log ('' when there is none)."""
    path = Path(env["CUDA_MPS_LOG_DIRECTORY"]) / "control.log"
    return path.read_text()[-chars:] if path.exists() else ""


@contextlib.contextmanager
def clients(env: dict[str, str], percent: int) -> Iterator[None]:
    """Sets, for the processes started inside the block, the daemon's environment and the
    share of SMs each may use (`percent`, 1..100); restores this process's environment after."""
    if not 1 <= percent <= 100:
        raise ValueError(f"an MPS share of {percent}%: a whole percentage 1..100 is accepted")
    saved = {key: os.environ.get(key) for key in (*env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")}
    os.environ.update(env, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(percent))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
