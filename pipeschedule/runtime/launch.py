"""Starting one process per rank, for tests and benchmarks.

`spawn(fn, world_size)` starts `world_size` processes (torch.multiprocessing, "spawn"),
each joining a process group (`backend`, gloo by default) through a TCPStore served by
the parent, and calls `fn(rank, world_size, store, *args)` there. It returns the ranks'
return values in rank order, or raises `LaunchError` carrying every rank's failure.
The store stays alive in the parent when ranks die, so the abort key of
[Note: every rank stops] is always readable. A rank that fails reports and exits at
once (`os._exit`), without waiting for communication it can no longer complete; the
parent waits at most `timeout` seconds in all and kills what is left, so nothing hangs.
"""

from __future__ import annotations

import os
import pickle
import queue
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, NamedTuple

import torch.distributed as dist
import torch.multiprocessing as mp

from pipeschedule.errors import LaunchError


class RankFailure(NamedTuple):
    """How a rank failed: exception type name ("Died", "Timeout" when it never reported),
    message, traceback text, and the wall-clock time (time.time()) it failed at."""

    kind: str
    message: str
    traceback: str
    at: float


def spawn(fn: Callable[..., Any], world_size: int, *, backend: str = "gloo", timeout: float = 120.0, args: tuple = ()) -> list:
    """Runs `fn(rank, world_size, store, *args)` on `world_size` new processes; `fn` and
    `args` must be picklable (module-level). Return values travel back pickled."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    context = mp.get_context("spawn")
    reports = context.Queue()
    processes = [
        context.Process(target=_rank_main, args=(rank, world_size, store.port, backend, timeout, fn, args, reports), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    results: dict[int, Any] = {}
    failures: dict[int, RankFailure] = {}
    deadline = time.monotonic() + timeout
    dead_since: dict[int, float] = {}
    try:
        while len(results) + len(failures) < world_size:
            try:
                rank, ok, payload = reports.get(timeout=0.1)
            except queue.Empty:
                if time.monotonic() > deadline:
                    break
                for rank, process in enumerate(processes):  # dead for a second and still silent
                    if rank not in results and rank not in failures and process.exitcode is not None:
                        if time.monotonic() - dead_since.setdefault(rank, time.monotonic()) > 1.0:
                            message = f"exited with code {process.exitcode} without reporting"
                            failures[rank] = RankFailure("Died", message, "", time.time())
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failures[rank] = RankFailure(*payload)
    finally:
        for process in processes:
            process.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    for rank in range(world_size):
        if rank not in results and rank not in failures:
            failures[rank] = RankFailure("Timeout", f"did not finish within {timeout:g} s (killed)", "", time.time())
    if failures:
        lines = [f"rank {rank}: {failure.kind}: {failure.message}" for rank, failure in sorted(failures.items())]
        raise LaunchError(f"{len(failures)} of {world_size} ranks failed:\n" + "\n".join(lines), failures)
    return [results[rank] for rank in range(world_size)]


def _rank_main(rank, world_size, port, backend, timeout, fn, args, reports) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timedelta(seconds=timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
        payload = pickle.dumps(fn(rank, world_size, store, *args))  # plain pickle: tensors travel by value
        dist.destroy_process_group()
    except BaseException as err:
        reports.put((rank, False, (type(err).__name__, str(err), traceback.format_exc(), time.time())))
        reports.close()
        reports.join_thread()
        os._exit(1)  # pending communication may never complete; do not wait for it
    reports.put((rank, True, payload))
    reports.close()
    reports.join_thread()
