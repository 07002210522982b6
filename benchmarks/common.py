"""What the benchmarks share: the model they measure and its sizes, where results go and
how they are written, and the record of what ran them (versions, machine, commit).

Pure Python: the compile-speed, planner and simulation benchmarks import it without
torch; `versions` looks torch and nanotron up only when called.

    MODEL, SMOKE_MODEL   the 16-layer, hidden-2048 Llama every GPU benchmark measures, and
                         the tiny one their --smoke / --dry-run modes run on CPU (sizes as a
                         dict: `benchmarks.llama.model.ModelConfig(**MODEL)`, or a nanotron
                         YAML's with `micro_batch_size`)
    PP, MICROBATCH_SIZE  pp=4 (four ranks, on one GPU or four), one sequence per microbatch
    WARMUP               steps before the measured ones
    RESULTS              benchmarks/results/, where every script writes
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PP = 4
MICROBATCH_SIZE = 1
WARMUP = 1  # steps (or rounds) of the GPU benchmarks before the measured ones
MODEL = dict(hidden=2048, layers=16, heads=16, kv_heads=8, ffn=5632, vocab=32000, seq=4096)
SMOKE_MODEL = dict(hidden=64, layers=8, heads=4, kv_heads=2, ffn=128, vocab=256, seq=32)
# What a rank's process holds on its GPU beyond the memory model's allocated peak (fit checks
# only), measured on an H100 with torch 2.11 (benchmarks/results/zero1_step.md): its CUDA
# context (524-527 MiB a process, alone or four at once) and the caching allocator's reserve
# above its allocated peak (0.55 and 1.11 GiB on the ranks of one ZeRO-1 step; the larger, rounded up).
CONTEXT_BYTES = 530 * 2**20
ALLOCATOR_SLACK_BYTES = int(1.15 * 2**30)
RANK_OVERHEAD_BYTES = CONTEXT_BYTES + ALLOCATOR_SLACK_BYTES
FIT_SHARE = 0.95  # a case is run where its predicted peak is at most this share of the GPU's memory
# The smaller model of the trainer benchmarks' --smoke (a nanotron YAML: micro_batch_size too).
SMOKE_TRAINER = dict(hidden=32, heads=4, kv_heads=2, layers=8, vocab=128, seq=16, micro_batch_size=2)


def rotated(items: list, r: int) -> list:
    """`items` starting at the r-th (modulo their number): round r's order, so that each
    variant or case of an interleaved benchmark comes first in turn."""
    k = r % len(items)
    return items[k:] + items[:k]


def git_commit(short: bool = False) -> str | None:
    """HEAD of this checkout, marked when the tree has uncommitted changes; None without git."""
    here = Path(__file__).parent
    try:
        head = subprocess.run(["git", "rev-parse", *(["--short"] if short else []), "HEAD"], capture_output=True,
                              text=True, check=True, timeout=10, cwd=here).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, check=True,
                               timeout=10, cwd=here).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + (" (with uncommitted changes)" if dirty and not short else "")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def torch_version() -> str | None:
    try:
        import torch  # an optional dependency here: the pure-Python benchmarks run without it
    except ImportError:
        return None
    return torch.__version__


def machine() -> dict:
    """The CPU side of a result: processor, platform, cores, Python, torch, and how busy
    the machine was (other processes on the same cores slow every side)."""
    return {
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch_version(),
        "load_average_1m_at_end": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def versions(commit: str | None = None) -> dict:
    """Date, machine and software versions for a results file of a torch benchmark.
    `commit` overrides git's answer (the device machine's copy of the tree may not carry
    the current HEAD)."""
    import nanotron  # noqa: PLC0415  (torch and nanotron: only the benchmarks that measure them call this)
    import torch

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "nanotron": getattr(nanotron, "__version__", None), "cpus": os.cpu_count(),
    }
    if torch.cuda.is_available():
        info["gpus"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.split()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            info["driver"] = None
    info["commit"] = commit if commit is not None else git_commit(short=True)
    return info


def torchrun(nproc: int, args: list[str], *, timeout: float) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --standalone --nproc-per-node nproc` with `args`
    (e.g. `["-m", "module", ...]`), unbuffered; the finished process, output captured.
    `--standalone`: the rendezvous binds a free local port itself (a port probed here and
    passed on could be taken by another launch before torchrun binds it)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


_RANK_LINE = re.compile(r"\[rank(\d+)\]:")  # how torch prefixes a rank's traceback lines under torchrun
_ERROR_LINE = re.compile(r"\s*[\w.]*(Error|Exception|Interrupt)\w*\b")  # "RuntimeError: ...", after the prefix


def _split_by_rank(stderr: str) -> tuple[dict[int, list[str]], list[str]]:
    """(rank -> its `[rankN]:` lines in order, the other lines)."""
    by_rank: dict[int, list[str]] = {}
    rest = []
    for line in stderr.splitlines():
        match = _RANK_LINE.match(line)
        (by_rank.setdefault(int(match.group(1)), []) if match else rest).append(line)
    return dict(sorted(by_rank.items())), rest


def torchrun_failure(what: str, result: subprocess.CompletedProcess, lines_per_rank: int = 15) -> str:
    """A message for a failed `torchrun`: every rank's last `lines_per_rank` lines of its
    own traceback (torch prefixes them `[rankN]:`), then the launcher's last lines, so the
    rank that failed first is not cut off by its neighbours' longer output."""
    by_rank, rest = _split_by_rank(result.stderr)
    parts = [f"{what}: torchrun exited with {result.returncode}"]
    for lines in by_rank.values():
        parts += lines[-lines_per_rank:]
    parts += rest[-lines_per_rank:]
    return "\n".join(parts)


def torchrun_cause(result: subprocess.CompletedProcess) -> str:
    """The lowest-numbered rank's exception line (`[rank0]: RuntimeError: ...`), or the
    first line of stderr where no rank printed one: a failure in one line."""
    by_rank, rest = _split_by_rank(result.stderr)
    for lines in by_rank.values():
        for line in lines:
            if _ERROR_LINE.match(line, _RANK_LINE.match(line).end()):
                return line.strip()
    return next((line.strip() for line in rest if line.strip()), f"torchrun exited with {result.returncode}")


def write_results(stem: str, report: dict, markdown: str | None = None, out: Path | None = None) -> list[Path]:
    """`report` as `out/stem.json` and `markdown` as `out/stem.md` (out: RESULTS);
    returns the paths written."""
    out = RESULTS if out is None else Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.json"]
    paths[0].write_text(json.dumps(report, indent=1, default=str) + "\n")
    if markdown is not None:
        paths.append(out / f"{stem}.md")
        paths[-1].write_text(markdown)
    return paths


__all__ = [
    "ALLOCATOR_SLACK_BYTES", "CONTEXT_BYTES", "FIT_SHARE", "RANK_OVERHEAD_BYTES",
    "MICROBATCH_SIZE", "MODEL", "PP", "WARMUP", "RESULTS", "SMOKE_MODEL", "SMOKE_TRAINER",
    "cpu_model", "git_commit", "machine", "torchrun", "torchrun_cause", "torchrun_failure",
    "torch_version", "versions", "write_results",
]
