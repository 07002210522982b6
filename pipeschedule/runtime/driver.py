"""Drivers of an executor's step: blocking with a watchdog (one rank per process), and
the pieces both drivers share (step timings, the marker returned off the loss rank).

[Note: watchdog] Each wait gets `timeout` seconds. While waiting, a rank checks at
least every `ABORT_POLL_S` whether another rank has aborted, and stops with an error
quoting it; past the timeout it raises an error naming its rank, program counter, the
batch it waits on and the last instructions it ran, and aborts the others. Both errors
are thrown into the executor's generator at the wait, so the executor records and
reports them like any other failure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pipeschedule.runtime.transport import ABORT_POLL_S, Pending


@dataclass(frozen=True)
class RemoteOutput:
    """Placeholder for a microbatch's output on ranks that do not run the last stage;
    `rank` is the one that holds the loss (nanotron returns a TensorPointer here)."""

    rank: int


@dataclass
class StepTimes:
    """Host seconds of the last step: in stage forward and autograd backward
    (`compute_s`, of which `forward_s` in forwards and `weight_s` in W), posting and finishing batches
    (`transport_s`), blocked in waits (`wait_s`), in all (`total_s`); `instructions`
    counts those run. The executor's own overhead is `total_s - compute_s - transport_s
    - wait_s`; `measured` counts the F whose stash was measured with saved-tensor hooks
    ([Note: what the ledger counts]). On a GPU the compute times are those of launching the work, unless the
    executor's `exact_times` is set (then it synchronises around each F, B and W)."""

    start: float = 0.0
    total_s: float = 0.0
    compute_s: float = 0.0
    forward_s: float = 0.0
    weight_s: float = 0.0
    transport_s: float = 0.0
    wait_s: float = 0.0
    instructions: int = 0
    measured: int = 0

    @property
    def overhead_s(self) -> float:
        return self.total_s - self.compute_s - self.transport_s - self.wait_s


def describe_batch(batch) -> str:
    return "[" + " ".join(str(instr) for _, instr in batch) + "]"


def run_blocking(executor, steps, timeout: float):
    """Runs the generator `steps` of `executor.run(...)` to its end, blocking at each wait
    ([Note: watchdog]); returns what it returns."""
    try:
        pending = next(steps)
        while True:
            problem = _block(executor, pending, timeout)
            pending = steps.send(None) if problem is None else steps.throw(problem)
    except StopIteration as stop:
        return stop.value


def _block(executor, pending: Pending, timeout: float):
    """None once `pending` is ready, else the error to throw into the step."""
    start = time.perf_counter()
    deadline = start + timeout
    try:
        while not pending.wait_for(max(0.0, min(ABORT_POLL_S, deadline - time.perf_counter()))):
            try:
                message = executor.transport.aborted()
            except Exception as err:  # the store's server (often rank 0's process) is gone
                return executor.error(f"cannot reach the store that carries the ranks' abort signal "
                                      f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
                                      f"the process serving it may have exited")
            if message is not None:
                return executor.stopped_by(message)
            if time.perf_counter() >= deadline:
                what = getattr(pending, "what", "its partner ranks to post their matching batches")
                return executor.error(f"timed out after {timeout:g} s waiting for {what}")
        return None
    finally:
        executor.times.wait_s += time.perf_counter() - start
