"""The simulator's model of one rank's host link: OFFLOAD / RELOAD copies and the
device and host bytes they move ([Note: host link] in simulate.py states the semantics).

`simcore.run` keeps one `HostLink` per rank and calls it only for OFFLOAD and RELOAD,
and, while some buffer of the rank is off the plain on-device state (`moved` is not
empty), for the instructions that touch buffers; a schedule without OFFLOAD never calls
it. Device bytes stay in the run loop's `live` counter: every method that changes them
takes and returns (live, peak) and adds the points of the device memory curve.
"""

from __future__ import annotations

import heapq
import math

# State of a moved buffer, entry[0]. OUT: its device-to-host copy is queued or running
# (device and host both hold it); HOST: only the host holds it; IN: its host-to-device
# copy is queued or running (the device copy exists from the RELOAD's issue); BACK: the
# copy has landed and the host copy is released, kept only so that a later use of the
# buffer knows when it became usable.
OUT, HOST, IN, BACK = "out", "host", "in", "back"

# Which buffers of its own (stage, mb) each compute op reads ([Note: buffers] in ir.py).
USES = {"F": ("act_in",), "B": ("act_in", "stash", "grad_out"), "W": ("stash",)}


class HostLink:
    """One rank's copies to and from host memory, queued per direction in program order."""

    __slots__ = ("out_bandwidth", "in_bandwidth", "slowdown", "out_free", "in_free", "pending", "moved",
                 "host", "peak_host", "seq", "mem_t", "mem_v", "point", "waited")

    def __init__(self, out_bandwidth, in_bandwidth, slowdown, mem_t: list, mem_v: list, point) -> None:
        self.out_bandwidth, self.in_bandwidth, self.slowdown = out_bandwidth, in_bandwidth, slowdown
        self.out_free = self.in_free = 0  # when the device->host / host->device queue is next idle
        self.pending: list = []  # heap of (completion time, seq, entry) of copies not yet landed
        self.moved: dict = {}  # (buf, stage, mb) -> [state, time, bytes, cancelled]
        self.host = self.peak_host = 0
        self.seq = 0
        self.mem_t, self.mem_v = mem_t, mem_v  # the rank's device memory curve
        self.point = point  # simcore's _point: adds (t, live) to a curve
        self.waited: dict = {}  # pc -> start of a compute that waited for a RELOAD (for EventLog)

    def _copy_time(self, nbytes, bandwidth):
        return nbytes / bandwidth if bandwidth != math.inf else 0  # exact costs stay exact

    def _push(self, entry) -> None:
        self.seq += 1
        heapq.heappush(self.pending, (entry[1], self.seq, entry))

    def drain(self, t, live):
        """Lands every copy that completes by `t`: an offload releases its device bytes
        (a point of the device curve at its completion), a reload its host bytes."""
        pending = self.pending
        while pending and pending[0][0] <= t:
            done, _, entry = heapq.heappop(pending)
            if entry[3]:  # freed while in flight
                continue
            if entry[0] is OUT:
                entry[0] = HOST
                live -= entry[2]
                self.point(self.mem_t, self.mem_v, done, live)
            else:
                entry[0] = BACK
                self.host -= entry[2]
        return live

    def offload(self, key, nbytes, t, live):
        """OFFLOAD at `t`: the copy starts when the device->host queue is free; the host
        holds the bytes from now, the device until the copy lands."""
        live = self.drain(t, live)
        before = self.moved.get(key)
        landed = before[1] if before is not None and before[0] is IN else t  # a reload still landing
        done = max(t, self.out_free, landed) + self._copy_time(nbytes, self.out_bandwidth)
        self.out_free = done
        self.host += nbytes
        if self.host > self.peak_host:
            self.peak_host = self.host
        entry = [OUT, done, nbytes, False]
        self.moved[key] = entry
        self._push(entry)
        return self.drain(t, live), done

    def reload(self, key, nbytes, t, live, peak):
        """RELOAD at `t`: device bytes are allocated now; the copy starts when the
        host->device queue is free and the offload it undoes has landed."""
        live = self.drain(t, live)
        before = self.moved.get(key)
        landed = before[1] if before is not None and before[0] is OUT else t
        done = max(t, self.in_free, landed) + self._copy_time(nbytes, self.in_bandwidth)
        self.in_free = done
        live += nbytes
        if live > peak:
            peak = live
        self.point(self.mem_t, self.mem_v, t, live)
        entry = [IN, done, nbytes, False]
        self.moved[key] = entry
        self._push(entry)
        return self.drain(t, live), peak, done

    def free(self, key, nbytes, t, live):
        """FREE at `t`: releases whichever copies exist; returns (live after the drain,
        device bytes the FREE itself releases)."""
        live = self.drain(t, live)
        entry = self.moved.pop(key, None)
        if entry is None:
            return live, nbytes
        state = entry[0]
        entry[3] = True
        if state is not BACK:
            self.host -= entry[2]
        return live, (0 if state is HOST else nbytes)

    def ready(self, op, stage, mb, t):
        """When compute `op` of (stage, mb) may start: not before any RELOAD of a buffer
        it reads has landed."""
        moved = self.moved
        for buf in USES[op]:
            entry = moved.get((buf, stage, mb))
            if entry is not None and (entry[0] is IN or entry[0] is BACK) and entry[1] > t:
                t = entry[1]
        return t

    def ready_buffer(self, key, t):
        """When a send may start reading buffer `key` (its RELOAD landed)."""
        entry = self.moved.get(key)
        if entry is not None and (entry[0] is IN or entry[0] is BACK) and entry[1] > t:
            return entry[1]
        return t

    def stretch(self, t, spend):
        """Compute time of an op starting at `t` while copies run: slowed by the factor
        over the part of it before both queues fall idle."""
        if not self.slowdown:
            return spend
        busy = max(self.out_free, self.in_free) - t
        return spend + self.slowdown * min(spend, busy) if busy > 0 else spend

    def finish(self, live):
        """Lands everything still in flight (after the program's end)."""
        return self.drain(math.inf, live)
