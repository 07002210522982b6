"""The buffer pool: a rank's boundary buffers, allocated once and reused across steps.

[Note: buffer pool] The four buffers that cross a rank boundary ([Note: buffers]) come
from the pool when `Executor(..., pool=True)`:

    act_in    the receive buffer of RECV_F
    grad_out  the receive buffer of RECV_B
    act_out   the send buffer of a stage output: at F the output is copied into it and
              the output's own storage is released at once (its `.data` replaced, as at
              FREE act_out without the pool), so the output's block never outlives F
    grad_in   the send buffer of an input gradient: at B the gradient is copied into it

Each is handed out as a fresh tensor object (`detach()` of the pooled one: no grad, no
hooks, no autograd history carry over) and returns at its FREE, except that an act_in
or grad_out returns only once the stash of its (stage, mb) is freed as well: autograd
may still read them until then (in a split backward, W reads the linear inputs and the
output gradients B kept, and those can be these very storages).

How many of each kind a rank ever needs is known before running: `capacity` walks the
program with exactly these rules and returns the peak number of each kind live at once.
On a stage graph ([Note: stage graph] in compiler/graph.py) they are per edge between
ranks: F of a stage makes one act_out per consumer on another rank, B one grad_in per
producer on another rank.
Buffers are allocated lazily, per (kind, shape, dtype), the first time no free one
fits, so the number of allocations is bounded by the schedule's peak live counts (for
1F1B: independent of the number of microbatches) and is reached in the first step;
later steps allocate nothing and the caching allocator's reserved memory stays flat.
Handing out more of a kind than `capacity` says is an error (the walk and the executor
disagree).

Exactness: copies are bitwise, and a buffer is reused only once nothing reads it.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from pipeschedule.compiler.ir import Op, Schedule
from pipeschedule.errors import RuntimeScheduleError
from pipeschedule.runtime.shapes import TensorMeta

POOLED = ("act_in", "grad_out", "act_out", "grad_in")


def capacity(schedule: Schedule, rank: int) -> dict[str, int]:
    """Peak number of pooled buffers of each kind live at once on `rank`
    ([Note: buffer pool]): produced at RECV_F (act_in), RECV_B (grad_out), F of a stage whose output is
    sent (act_out), B of a stage whose input gradient is sent (grad_in); back at their
    FREE, act_in and grad_out not before the FREE of their (stage, mb)'s stash."""
    live = dict.fromkeys(POOLED, 0)
    peak = dict(live)
    stashes: set[tuple[int, int]] = set()
    parked: dict[tuple[int, int], list[str]] = defaultdict(list)

    def add(kind: str) -> None:
        live[kind] += 1
        peak[kind] = max(peak[kind], live[kind])

    sends = [len(schedule.remote_consumers(s)) for s in range(schedule.num_stages)]
    gradients = [len(schedule.remote_producers(s)) for s in range(schedule.num_stages)]
    for i in schedule.programs[rank]:
        key = (i.stage, i.mb)
        if i.op is Op.RECV_F:
            add("act_in")
        elif i.op is Op.RECV_B:
            add("grad_out")
        elif i.op is Op.F:
            stashes.add(key)
            for _ in range(sends[i.stage]):
                add("act_out")
        elif i.op is Op.B:
            for _ in range(gradients[i.stage]):
                add("grad_in")
        elif i.op is Op.FREE:
            if i.buf == "stash":
                stashes.discard(key)
                for kind in parked.pop(key, ()):
                    live[kind] -= 1
            elif i.buf in ("act_in", "grad_out") and received(schedule, i.buf, i.stage, i.peer_stage):
                if key in stashes:
                    parked[key].append(i.buf)
                else:
                    live[i.buf] -= 1
            elif i.buf == "act_out" or (i.buf == "grad_in"):
                live[i.buf] -= 1
    return peak


def received(schedule: Schedule, buf: str, stage: int, other: int | None) -> bool:
    """Whether act_in or grad_out of `stage` on the edge to peer stage `other` (as an
    instruction writes it: None for the neighbour, or stage 0's data) arrives by message
    (so it is pooled), not by local hand-off or the data loader."""
    step = -1 if buf == "act_in" else 1
    peer = stage + step if other is None else other
    edge = (peer, stage) if step < 0 else (stage, peer)
    placement = schedule.placement
    return edge in schedule.graph.index and placement[peer] != placement[stage]


class BufferPool:
    """Pooled boundary buffers of one executor ([Note: buffer pool])."""

    def __init__(self, schedule: Schedule, rank: int, device: torch.device):
        self.device = device
        self.capacity = capacity(schedule, rank)
        self.free: dict[tuple, list[torch.Tensor]] = defaultdict(list)  # (kind, shape, dtype) -> buffers
        self.out: dict[int, tuple[tuple, torch.Tensor]] = {}  # data_ptr -> (pool key, pooled tensor)
        self.outstanding = dict.fromkeys(POOLED, 0)
        self.high = dict.fromkeys(POOLED, 0)  # outstanding high-water marks, over the pool's life
        self.parked: dict[tuple[int, int], list[int]] = defaultdict(list)  # (stage, mb) -> data_ptrs
        self.allocations = 0
        self.allocated_bytes = 0

    def take(self, kind: str, meta: TensorMeta) -> torch.Tensor:
        """A buffer of `kind` with `meta`'s shape and dtype (its contents are stale)."""
        if self.outstanding[kind] >= self.capacity[kind]:
            raise RuntimeScheduleError(
                f"buffer pool: a {kind} buffer more than the schedule's peak of {self.capacity[kind]} live at once "
                f"(pool.capacity walked the program with other rules than the executor runs)"
            )
        key = (kind, meta.shape, meta.dtype)
        if self.free[key]:
            pooled = self.free[key].pop()
        else:
            pooled = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
            self.allocations += 1
            self.allocated_bytes += pooled.nbytes
        self.out[pooled.data_ptr()] = (key, pooled)
        self.outstanding[kind] += 1
        self.high[kind] = max(self.high[kind], self.outstanding[kind])
        return pooled.detach()

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.data_ptr() in self.out and tensor.numel() > 0

    def give(self, tensor: torch.Tensor, *, after_stash: tuple[int, int] | None = None) -> None:
        """Returns a buffer at its FREE; with `after_stash`, only once that (stage, mb)'s
        stash is freed (`stash_freed`)."""
        if after_stash is not None:
            self.parked[after_stash].append(tensor.data_ptr())
        else:
            self._back(tensor.data_ptr())

    def stash_freed(self, stage: int, mb: int) -> None:
        for ptr in self.parked.pop((stage, mb), ()):
            self._back(ptr)

    def _back(self, ptr: int) -> None:
        key, pooled = self.out.pop(ptr)
        self.outstanding[key[0]] -= 1
        self.free[key].append(pooled)

    def check_idle(self) -> None:
        if self.out:
            held = {kind: n for kind, n in self.outstanding.items() if n}
            raise RuntimeScheduleError(f"buffer pool: buffers not returned at the end of the step: {held}")
