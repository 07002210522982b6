"""Starting one process per rank: the project's one launcher (the demo, tests, benchmarks).

`spawn(fn, world_size)` starts `world_size` processes (torch.multiprocessing, "spawn"),
each joining a process group (`backend`, gloo by default; NCCL with one GPU per rank)
through a TCPStore served by the parent, and calls `fn(rank, world_size, store, *args)`
there, with `threads` intra-op threads and torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE) set, so nanotron's own code finds its rank. It returns the
ranks' return values in rank order, or raises `LaunchError` carrying every rank's
failure (its traceback in the message). The store stays alive in the parent when ranks
die, so the abort key of [Note: every rank stops] is always readable. A rank that fails
reports and exits at once (`os._exit`), without waiting for communication it can no
longer complete. The parent waits at most `timeout` seconds in all, and once a rank has
failed, `grace` seconds more for the others to finish or fail on their own (a rank
blocked on the failed one never would); then it asks the ranks still running for their
Python stacks (faulthandler, SIGUSR1), adds them to the error and kills them, so nothing
hangs. A rank that succeeds leaves only once every rank has joined the group ([Note: leave
after every rank joined]). A script calling it needs the usual `if __name__ ==
"__main__":` guard (spawn re-imports `__main__`).

[Note: leave after every rank joined] gloo connects a pair of ranks by one side
connecting to the other's listening socket and writing a few bytes; the connecting side
is done when they are written, the listening side only when it has accepted and read
them. A rank whose `fn` needs no communication (or none with a slow peer) could so
return, destroy its group and exit while a peer, descheduled on a loaded machine, was
still inside `init_process_group`: that peer then read the closed socket and failed in
gloo's connectFullMesh with "Connection closed by peer" (seen once in CI, in
tests/runtime/test_launch.py's test_results_come_back_in_rank_order: three ranks that
only return their rank). So each rank marks in the store that it has joined, and a rank
whose `fn` returned waits for every rank's mark before it destroys the group and exits.
A rank that fails leaves at once, as before; a rank waiting on a peer that failed before
joining is stopped by the parent `grace` seconds after that failure.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeschedule.errors import LaunchError


_JOINED = "pipeschedule.launch/joined/"  # store keys: rank N has finished init_process_group


class RankFailure(NamedTuple):
    """How a rank failed: exception type name ("Died", "Timeout" when it never reported),
    message, traceback text, and the wall-clock time (time.time()) it failed at."""

    kind: str
    message: str
    traceback: str
    at: float


def spawn(fn: Callable[..., Any], world_size: int, *, args: tuple = (), backend: str = "gloo",
          timeout: float = 120.0, grace: float = 10.0, threads: int | None = 1) -> list:
    """Runs `fn(rank, world_size, store, *args)` on `world_size` new processes; `fn` and
    `args` must be picklable (module-level). Return values travel back pickled. Each rank
    runs `threads` intra-op threads (1 keeps CPU kernels deterministic and small machines
    from oversubscribing; None: torch's default)."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    context = mp.get_context("spawn")
    reports = context.Queue()
    with tempfile.TemporaryDirectory(prefix="pipeschedule-spawn-") as stacks:
        settings = (store.port, backend, timeout, threads, stacks)
        processes = [context.Process(target=_rank_main, args=(rank, world_size, settings, fn, tuple(args), reports),
                                     daemon=True) for rank in range(world_size)]
        for process in processes:
            process.start()
        try:
            results, failures = _collect(processes, reports, timeout, grace)
            hung = [rank for rank in range(world_size) if rank not in results and rank not in failures]
            if hung:
                failures.update(_hung(failures, hung, _stacks(stacks, processes, hung), timeout, grace))
        finally:
            _stop(processes)
    if failures:
        raise LaunchError(_failure_message(failures, world_size), failures)
    return [results[rank] for rank in range(world_size)]


def _collect(processes, reports, timeout: float, grace: float) -> tuple[dict[int, Any], dict[int, RankFailure]]:
    """Every rank's report (a rank dead for a second without one counts as failed) until
    all have reported, the time is up, or `grace` seconds after the first failure."""
    results: dict[int, Any] = {}
    failures: dict[int, RankFailure] = {}
    deadline = time.monotonic() + timeout
    dead_since: dict[int, float] = {}
    while len(results) + len(failures) < len(processes) and time.monotonic() <= deadline:
        try:
            rank, ok, payload = reports.get(timeout=0.1)
        except queue.Empty:
            for rank, process in enumerate(processes):  # dead for a second and still silent
                if rank not in results and rank not in failures and process.exitcode is not None:
                    if time.monotonic() - dead_since.setdefault(rank, time.monotonic()) > 1.0:
                        message = f"exited with code {process.exitcode} without reporting"
                        failures[rank] = RankFailure("Died", message, "", time.time())
                        deadline = min(deadline, time.monotonic() + grace)
            continue
        if ok:
            results[rank] = pickle.loads(payload)
        else:
            failures[rank] = RankFailure(*payload)
            deadline = min(deadline, time.monotonic() + grace)
    return results, failures


def _hung(failures: dict[int, RankFailure], hung: list[int], stacks: dict[int, str], timeout: float,
          grace: float) -> dict[int, RankFailure]:
    """The failures of the ranks still running, killed: "Stopped" when another rank had
    failed `grace` seconds before, else "Timeout"; each with its stacks."""
    if failures:
        first = min(failures, key=lambda rank: failures[rank].at)
        kind, why = "Stopped", f"still running {grace:g} s after rank {first} failed (killed)"
    else:
        kind, why = "Timeout", f"did not finish within {timeout:g} s (killed)"
    return {rank: RankFailure(kind, why, stacks.get(rank, ""), time.time()) for rank in hung}


def _stacks(folder: str, processes, ranks: list[int]) -> dict[int, str]:
    """Asks the hung ranks for their Python stacks (faulthandler) and returns the frames."""
    for rank in ranks:
        if processes[rank].is_alive():
            os.kill(processes[rank].pid, signal.SIGUSR1)
    time.sleep(1.0)
    out = {}
    for rank in ranks:
        path = os.path.join(folder, f"stack-{rank}.txt")
        text = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
        keep = ("File", "Thread", "Current thread")
        out[rank] = "\n".join(line for line in text.splitlines() if line.strip().startswith(keep))
    return out


def _stop(processes) -> None:
    deadline = time.monotonic() + 5.0
    for process in processes:
        process.join(timeout=max(0.1, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()


def _failure_message(failures: dict[int, RankFailure], world_size: int) -> str:
    """One line per failed rank, then each rank's traceback (or, for a hung rank, its
    stacks, innermost first)."""
    lines = [f"{len(failures)} of {world_size} ranks failed:"]
    lines += [f"rank {rank}: {failure.kind}: {failure.message}" for rank, failure in sorted(failures.items())]
    if all(failure.kind == "Timeout" for failure in failures.values()):
        lines.append("No rank reported an error (a hang: look for a send without its receive).")
    for rank, failure in sorted(failures.items()):
        if failure.traceback:
            what = "stacks, per thread, innermost first" if failure.kind in ("Timeout", "Stopped") else "raised"
            lines.append(f"--- rank {rank} {what}:\n{failure.traceback.rstrip()}")
    return "\n".join(lines)


def _rank_main(rank, world_size, settings, fn, args, reports) -> None:
    port, backend, timeout, threads, stacks = settings
    stack_file = open(os.path.join(stacks, f"stack-{rank}.txt"), "w", encoding="utf-8")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)  # the parent's deadline
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timedelta(seconds=timeout))
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())  # one GPU per rank
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        store.set(f"{_JOINED}{rank}", "1")
        payload = pickle.dumps(fn(rank, world_size, store, *args))  # plain pickle: tensors travel by value
        store.wait([f"{_JOINED}{peer}" for peer in range(world_size)])  # [Note: leave after every rank joined]
        dist.destroy_process_group()
    except BaseException as err:
        reports.put((rank, False, (type(err).__name__, str(err), traceback.format_exc(), time.time())))
        reports.close()
        reports.join_thread()
        os._exit(1)  # pending communication may never complete; do not wait for it
    reports.put((rank, True, payload))
    reports.close()
    reports.join_thread()


def leave(code: int = 0) -> None:
    """A launched rank's end once its work is done (a torchrun rank's, or a script's after
    its `main`): the process groups destroyed, then out without the interpreter's shutdown.
    Left to that shutdown, a C++ communication thread still joinable as its owner is
    destroyed can abort a rank whose work is done ("terminate called without an active
    exception", SIGABRT; one rank in about six of the 2-rank smoke runs of
    benchmarks.parallel.trainer_groups, c8964cb), and torchrun reports the run failed."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


__all__ = ["RankFailure", "leave", "spawn"]
