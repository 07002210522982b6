"""The simulator's model of one rank's host link: OFFLOAD / RELOAD copies and the
device and host bytes they move ([Note: host link] in simulate/engine.py states the semantics).

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
# States of a streamed stash ([Note: simulated streaming] in simulate/engine.py), whose entry also
# holds its pieces (entry[4]: each piece's latest copy entry, last saved last) and the
# index of the next piece to reload (entry[5]). STREAMED: its pieces are going out or on
# the host; RELOADING: the RELOAD has issued the window; GONE: its B consumed and
# released every piece (a stash kept for W ends as BACK instead).
STREAMED, RELOADING, GONE = "streamed", "reloading", "gone"


class HostLink:
    """One rank's copies to and from host memory, queued per direction in program order."""

    __slots__ = ("out_bandwidth", "in_bandwidth", "slowdown", "out_free", "in_free", "pending", "moved",
                 "host", "peak_host", "seq", "mem_t", "mem_v", "point", "waited", "chunk", "window")

    def __init__(self, out_bandwidth, in_bandwidth, slowdown, mem_t: list, mem_v: list, point,
                 chunk=None, window: int = 2) -> None:
        self.out_bandwidth, self.in_bandwidth, self.slowdown = out_bandwidth, in_bandwidth, slowdown
        self.chunk, self.window = chunk, window  # streamed offload: bytes per piece, pieces reloaded ahead
        self.out_free = self.in_free = 0  # when the device->host / host->device queue is next idle
        self.pending: list = []  # heap of (completion time, seq, entry) of copies not yet landed
        # (buf, stage, mb[, peer stage]) -> [state, time, bytes, cancelled] (+ [pieces, next] if streamed)
        self.moved: dict = {}
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
        if before is not None and before[0] is STREAMED:  # its pieces left during its F
            return live, before[1]
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
        if before is not None and before[0] is STREAMED:
            return self._reload_window(before, t, live, peak)
        entry, live, peak = self._copy_in(before, nbytes, t, live, peak)
        self.moved[key] = entry
        return self.drain(t, live), peak, entry[1]

    def _copy_in(self, before, nbytes, t, live, peak):
        """A copy back of `nbytes` issued at `t`, as (its entry, live, peak): the device
        bytes count from now; the copy starts when the host->device queue is free and
        the offload it undoes (`before`, if still OUT) has landed."""
        landed = before[1] if before is not None and before[0] is OUT else t
        done = self.in_free = max(t, self.in_free, landed) + self._copy_time(nbytes, self.in_bandwidth)
        entry = [IN, done, nbytes, False]
        self._push(entry)
        live, peak = self._add(t, live, nbytes, peak)
        return entry, live, peak

    def free(self, key, nbytes, t, live):
        """FREE at `t`: releases whichever copies exist; returns (live after the drain,
        device bytes the FREE itself releases)."""
        live = self.drain(t, live)
        entry = self.moved.pop(key, None)
        if entry is None:
            return live, nbytes
        state = entry[0]
        entry[3] = True
        if len(entry) > 4 and state is not BACK:  # streamed: what each piece still holds
            device = 0
            for piece in entry[4]:
                piece[3] = True
                if piece[0] is not BACK and piece[0] is not GONE:
                    self.host -= piece[2]
                if piece[0] is not HOST and piece[0] is not GONE:
                    device += piece[2]
            return live, device
        if state is not BACK:
            self.host -= entry[2]
        return live, (0 if state is HOST else nbytes)

    def ready(self, reads, mb, t):
        """When a compute may start: not before any RELOAD of a buffer it reads has landed
        (of a streamed stash, the piece it consumes first). `reads`: the buffers it reads,
        as (buf, stage, peer stage) less the mb (its row's, [Note: instruction effects] in
        compiler/effects.py), keyed here (buf, stage, mb) or, for an edge that is not the
        neighbour's, (buf, stage, mb, peer stage)."""
        moved = self.moved
        keys = [(buf, stage, mb) if other is None else (buf, stage, mb, other) for buf, stage, other in reads]
        for key in keys:
            entry = moved.get(key)
            if entry is None:
                continue
            if entry[0] is RELOADING:  # streamed: not before the first piece it consumes
                entry = entry[4][-1]
            if (entry[0] is IN or entry[0] is BACK) and entry[1] > t:
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

    # -- streamed stashes ([Note: simulated streaming] in simulate/engine.py) ----------------------------

    def _pieces(self, nbytes) -> list:
        count = max(1, math.ceil(nbytes / self.chunk))
        if isinstance(nbytes, int):
            return [nbytes * (j + 1) // count - nbytes * j // count for j in range(count)]
        return [nbytes / count] * count

    def _add(self, t, live, nbytes, peak):
        live = self.drain(t, live) + nbytes
        self.point(self.mem_t, self.mem_v, t, live)
        return live, (live if live > peak else peak)

    def stream_out(self, key, nbytes, t, spend, live, peak):
        """F of a stash that streams out, starting at `t` for `spend`: piece j of n is
        produced over the j-th n-th of the F, counts on the device from the start of it,
        is copied when it ends and leaves the device when its copy lands. Returns (live,
        peak, the F's time): stretched as any compute by the copies already queued, then
        by its own pieces' copies over the part of the F they run beside and the earlier
        ones do not (the pieces keep the pace of the first stretch)."""
        spend = self.stretch(t, spend)
        lo, hi = max(self.out_free, self.in_free, t), t + spend  # [t, lo]: counted by the stretch
        sizes = self._pieces(nbytes)
        pieces, at, produced, beside = [], t, t, 0
        for size in sizes:
            live, peak = self._add(at, live, size, peak)
            produced += _share(spend, size, nbytes, len(sizes))
            start = max(produced, self.out_free)
            done = self.out_free = start + self._copy_time(size, self.out_bandwidth)
            if min(done, hi) > max(start, lo):  # the queue runs the pieces one after another
                beside += min(done, hi) - max(start, lo)
            self.host += size
            piece = [OUT, done, size, False]
            self._push(piece)
            pieces.append(piece)
            at = produced
        if self.host > self.peak_host:
            self.peak_host = self.host
        self.moved[key] = [STREAMED, self.out_free, nbytes, False, pieces, len(pieces) - 1]
        return live, peak, spend + self.slowdown * beside if beside else spend

    def _reload_one(self, entry, t, live, peak):
        """Issues the copy back of the entry's next piece at `t` (its device bytes count
        from now; the copy waits for the queue and for the piece's own offload)."""
        index = entry[5]
        entry[5] -= 1
        before = entry[4][index]
        entry[4][index], live, peak = self._copy_in(before, before[2], t, live, peak)
        return live, peak, entry[4][index][1]

    def _reload_window(self, entry, t, live, peak):
        """A streamed RELOAD at `t`: the last `window` pieces start back."""
        done = t
        while entry[5] >= 0 and len(entry[4]) - 1 - entry[5] < self.window:
            live, peak, done = self._reload_one(entry, t, live, peak)
        entry[0] = RELOADING
        return self.drain(t, live), peak, done

    def stream_b(self, key, t, spend, live, peak, keep: bool):
        """B of a streamed stash from `t`: it consumes the pieces last saved first, each
        for its share of `spend`, starting on one only once it has landed; starting on a
        piece issues the reload of the piece `window` further down. A consumed piece is
        released when its share ends, unless `keep` (W still needs the stash: it stays
        whole until its FREE). Returns (live, peak, the B's end)."""
        entry = self.moved.get(key)
        if entry is None or len(entry) < 5 or entry[0] is BACK or entry[0] is GONE:  # not streamed (any more)
            return live, peak, t + spend
        if entry[0] is STREAMED:  # no RELOAD before it: the window starts at the B
            live, peak, _ = self._reload_window(entry, t, live, peak)
        pieces, nbytes = entry[4], entry[2]
        clock = t
        for index in range(len(pieces) - 1, -1, -1):
            while entry[5] >= index:  # not issued yet (only when the window cannot cover it)
                live, peak, _ = self._reload_one(entry, clock, live, peak)
            piece = pieces[index]
            start = piece[1] if piece[1] > clock else clock
            while entry[5] >= 0 and entry[5] >= index - self.window:
                live, peak, _ = self._reload_one(entry, start, live, peak)
            clock = start + _share(spend, piece[2], nbytes, len(pieces))
            if not keep:
                live = self.drain(clock, live) - piece[2]
                piece[0] = GONE
                self.point(self.mem_t, self.mem_v, clock, live)
        entry[0], entry[1] = (BACK if keep else GONE), clock
        return self.drain(clock, live), peak, clock

    def finish(self, live):
        """Lands everything still in flight (after the program's end)."""
        return self.drain(math.inf, live)


def _share(spend, size, nbytes, count):
    """The part of a compute's `spend` that works on a piece of `size` of its stash's
    `nbytes` (an equal share of `count` pieces when the stash is empty)."""
    return spend * size / nbytes if nbytes else spend / count
