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

from pipeschedule.compiler.effects import boundary_keys, keys_of
from pipeschedule.compiler.ir import Schedule
from pipeschedule.errors import RuntimeScheduleError
from pipeschedule.runtime.shapes import TensorMeta

POOLED = ("act_in", "grad_out", "act_out", "grad_in")
AUTOGRAD_READS = ("act_in", "grad_out")  # what autograd may read until the stash of its (stage, mb) goes


def capacity(schedule: Schedule, rank: int) -> dict[str, int]:
    """Peak number of pooled buffers of each kind live at once on `rank`
    ([Note: buffer pool]): each boundary buffer (`boundary_keys`) counts from the
    instruction that makes it (RECV_F: act_in, RECV_B: grad_out, F of a stage whose output
    is sent: act_out, B of a stage whose input gradient is sent: grad_in; the rows of
    [Note: instruction effects] in compiler/effects.py) to its FREE, act_in and grad_out not
    before the FREE of their (stage, mb)'s stash."""
    live = dict.fromkeys(POOLED, 0)
    peak = dict(live)
    boundary = boundary_keys(schedule)
    stashes: set[tuple[int, int]] = set()
    parked: dict[tuple[int, int], list[str]] = defaultdict(list)
    resolved: dict = {}  # per (op, stage, peer_stage, buf): what it makes and frees
    for i in schedule.programs[rank]:
        template = (i.op, i.stage, i.peer_stage, i.buf)
        keys = resolved.get(template)
        if keys is None:
            keys = resolved[template] = keys_of(schedule, *template)
        for kind, s, other in keys.makes:
            if kind == "stash":
                stashes.add((s, i.mb))
            elif (kind, s, other) in boundary:
                live[kind] += 1
                peak[kind] = max(peak[kind], live[kind])
        for kind, s, other in keys.frees:
            key = (s, i.mb)
            if kind == "stash":
                stashes.discard(key)
                for held in parked.pop(key, ()):
                    live[held] -= 1
            elif (kind, s, other) in boundary:
                if kind in AUTOGRAD_READS and key in stashes:
                    parked[key].append(kind)
                else:
                    live[kind] -= 1
    return peak


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
