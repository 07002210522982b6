"""Disjoint groups of CPU cores, one per pipeline rank, and pinning a process to its group.

A rank's group is whole physical cores (hyperthread siblings stay together), so no two
ranks share a core's arithmetic units; the process's compute threads are as many as its
group has logical CPUs.
"""

from __future__ import annotations

import os
from pathlib import Path


def _siblings(cpu: int) -> frozenset[int]:
    """The logical CPUs sharing `cpu`'s physical core (itself alone where sysfs says nothing)."""
    path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    try:
        text = path.read_text().strip()
    except OSError:
        return frozenset({cpu})
    found: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        found.update(range(int(low), int(high or low) + 1))
    return frozenset(found)


def physical_cores(cpus: set[int] | None = None) -> list[tuple[int, ...]]:
    """The physical cores among `cpus` (default: those this process may run on), each as its
    logical CPUs that are among `cpus`, in CPU order."""
    cpus = set(os.sched_getaffinity(0)) if cpus is None else set(cpus)
    cores, seen = [], set()
    for cpu in sorted(cpus):
        if cpu in seen:
            continue
        core = tuple(sorted(_siblings(cpu) & cpus)) or (cpu,)
        seen.update(core)
        cores.append(core)
    return cores


def core_groups(ranks: int, per_rank: int | None = None, cpus: set[int] | None = None) -> list[tuple[int, ...]]:
    """`ranks` disjoint groups of `per_rank` physical cores each (default: an equal share of
    all of them), as logical CPU lists; raises ValueError naming the numbers when there are
    too few cores."""
    cores = physical_cores(cpus)
    if per_rank is None:
        per_rank = len(cores) // ranks
    if per_rank < 1 or per_rank * ranks > len(cores):
        raise ValueError(f"{ranks} ranks of {per_rank} physical cores need {ranks * max(per_rank, 1)}; "
                         f"this process may use {len(cores)} ({sum(map(len, cores))} logical CPUs)")
    return [tuple(cpu for core in cores[r * per_rank:(r + 1) * per_rank] for cpu in core) for r in range(ranks)]


def pin(cpus: tuple[int, ...]) -> None:
    """Runs this process (and the threads it starts from now on) on `cpus` only."""
    os.sched_setaffinity(0, cpus)


def spec(groups: list[tuple[int, ...]]) -> str:
    """The groups as one environment value (`0,1;2,3`), read back by `parse_spec`."""
    return ";".join(",".join(map(str, group)) for group in groups)


def parse_spec(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(cpu) for cpu in group.split(",")) for group in text.split(";") if group]
