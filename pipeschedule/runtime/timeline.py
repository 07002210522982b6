"""When each compute instruction of a rank ran: measured spans of F, B and W.

[Note: measured timeline] An executor whose `timeline` is set records, for every F, B and
W it runs, when the work began and ended, relative to the start of the step:

- on CPU with the host's clock (`time.perf_counter`): there the host runs the arithmetic,
  so the span is the compute itself;
- on a CUDA device with a pair of timing events recorded on the current stream around the
  instruction's work, read after the step (`spans()` waits for them): the span is when
  the device ran it, whatever the host was doing. A stream's timing events cost about a
  microsecond each and do not synchronise the host.

From the spans come each rank's busy time (their sum) and so its bubble (the rest of
the step), the per-stage costs that the simulator's prediction uses, and a trace of the
step. Nothing else of the executor changes when a timeline is set.

On a CUDA device the host's clock is read too, around the enqueueing of each span's work
(`host_spans`, from the host's reading at `begin_step`, `host_origin`): where a block's
enqueue began after its rank's previous block had ended on the device, the rank's
partition waited for the host, not for its data (the host's part of a bubble).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, NamedTuple

import torch

from pipeschedule.compiler.ir import Instr


class Span(NamedTuple):
    """One compute instruction: `instr` ran from `start` to `end` seconds after the step began."""

    instr: Instr
    start: float
    end: float


class Timeline:
    """The spans of one rank's last step ([Note: measured timeline]); `device` says whether
    they are timed by the host's clock or by CUDA events on the current stream."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._origin: float | torch.cuda.Event = 0.0
        self._raw: list[tuple[Instr, object, object]] = []
        self.host_origin = 0.0  # the host's clock at `begin_step`
        self._host: list[tuple[float, float]] = []

    def begin_step(self) -> None:
        """Forgets the last step; times from now on count from here."""
        self._raw, self._host = [], []
        if self.cuda:
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()
        else:
            self._origin = time.perf_counter()
        self.host_origin = time.perf_counter()

    @contextlib.contextmanager
    def span(self, instr: Instr) -> Iterator[None]:
        """Times the work issued inside the block as `instr`'s."""
        host_start = time.perf_counter()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
        else:
            start = host_start
            yield
            end = time.perf_counter()
        self._raw.append((instr, start, end))
        self._host.append((host_start - self.host_origin, time.perf_counter() - self.host_origin))

    def spans(self) -> list[Span]:
        """The last step's spans in the order they ran, in seconds from its start (on CUDA
        this waits for the step's recorded events)."""
        if not self.cuda:
            origin = self._origin
            return [Span(i, start - origin, end - origin) for i, start, end in self._raw]
        out = []
        for instr, start, end in self._raw:
            end.synchronize()
            out.append(Span(instr, self._origin.elapsed_time(start) / 1e3, self._origin.elapsed_time(end) / 1e3))
        return out

    def host_spans(self) -> list[tuple[float, float]]:
        """(start, end) of the host's enqueueing of each span's work, in seconds from
        `host_origin`, in the order of `spans()` (on CPU the spans' own times)."""
        return list(self._host)


def busy_seconds(spans: list[Span]) -> float:
    """The time a rank computed: the sum of its spans (they never overlap on one rank)."""
    return sum(span.end - span.start for span in spans)
