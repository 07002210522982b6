"""Streamed offload: a stash copied to host memory while its F saves it, and back while
its B consumes it, in chunks (`Executor(offload_chunk=bytes)`).

[Note: streamed offload] Moving a stash whole ([Note: host offload] in host_offload)
holds all of it on the device at two moments: until its copy out lands after the F,
and from its RELOAD through its B. On a rank that must hold one stash at most, both
moments matter: 1F1B's first stage runs F(j) while stash j is still in flight and the
one B(i) needs must already be back. Streaming removes both, with the same
instructions (OFFLOAD right after the F, RELOAD before the B) and the same exactness.

    F        every saved tensor the stash counts gets a holder as before; the holder
             also joins the stash's current chunk, grouped by storage. When a chunk's
             storages reach `chunk` bytes (and at the end of the F), the chunk is
             copied to pinned host buffers on the side stream, after an event recorded
             on the compute stream at that point. When its `done` event has completed
             (polled at each pack and each instruction, never waited for), the holders
             drop their device tensors, so the device memory returns as soon as the
             forward itself no longer uses it. A storage saved again (rotary tables,
             masks, a residual saved by several nodes) joins its group: while the
             chunk is in flight by address, once landed only if a weak reference to
             the storage says it is still alive, since a freed storage's address may
             be reused by a new one, which starts a new group. The stash's bytes are
             therefore counted here, as the sum of the groups (the ledger's count by
             address would merge a reused address with the storage it replaced).
    OFFLOAD  marks the stash as offloaded (nothing left to copy but a last chunk).
    RELOAD   issues the copies back of the last `window` chunks (backward consumes what
             forward saved last first): device storages allocated on the compute
             stream, filled on the side stream, holders rebuilt over them at once.
    B        autograd unpacks each saved tensor through its holder. The first unpack of
             a chunk makes the compute stream wait for that chunk's copy (no host wait)
             and issues the copy back of the chunk `window` further down; a chunk not
             issued yet (unpacked out of order) is issued on the spot. The chunks keep
             no reference to the rebuilt tensors, so autograd frees each as soon as the
             node that used it has run. A holder freed before any unpack of its chunk
             (a saved tensor autograd never reads, a branch that died during F) makes
             the compute stream wait for the chunk's copy from its weakref callback,
             before its block returns to the allocator: the block must not be reused
             before the side stream has written it.
    FREE     drops what is left: host buffers return to the pool (those still in flight
             once their copy is done). An OFFLOAD between B and W (split backward)
             moves what W keeps whole, through the whole-stash path.

Copies out run on one side stream (`side_out`), copies back on another (`side_in`), so
that a B's reloads never queue behind an F's copies out (the simulator has one queue
per direction, [Note: host link] in simulate/engine.py).

A chunk whose copy out has not landed when the RELOAD comes keeps its device tensors and
copies nothing back ("kept"; the simulator instead waits for the copy out and copies
back). The ledger moves each chunk's bytes to the host when it lands and back when its
reload is issued, and drops them when the last holder of a reloaded chunk is gone, so
`high_total` counts what the device holds per chunk (a kept chunk stays counted until
the FREE). On CPU the copies are made at once, which is what the tests use for
exactness; the GPU test (tests/runtime/test_runtime_offload.py) drives the events.

A chunk here is whole storages until it reaches `chunk` bytes, so one large storage is
one chunk larger than `chunk`; the simulator cuts a stash into equal pieces of at most
`chunk` bytes. Its predictions assume storages well under a chunk.

In a split-backward schedule the W part's private input leaves keep their storages
through `.data`; their storages move at the OFFLOAD (right after the F), as in the whole
case, and W's saved tensors come back with the rest during B and stay with W's records.
"""

from __future__ import annotations

import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from pipeschedule.errors import RuntimeScheduleError
from pipeschedule.runtime.saved import StorageGroup, completed, storage_bytes


class Chunk:
    """Storages of a streamed stash copied together. state: "filling" (being saved),
    "out" (copy out issued), "host" (landed; device storages dropped), "kept" (reloaded
    before its copy out landed: its device storages stay), "in" (copy back issued)."""

    __slots__ = ("stream", "index", "groups", "nbytes", "state", "out_done", "in_done", "synced", "consumed", "alive")

    def __init__(self, stream: StreamedStash, index: int):
        self.stream, self.index = stream, index
        self.groups: list = []  # saved.StorageGroup
        self.nbytes = 0
        self.state = "filling"
        self.out_done = self.in_done = None  # CUDA events while pending
        self.synced = False  # the compute stream waits for in_done (first unpack, or a holder gone before)
        self.consumed = False  # its first unpack has moved the window on
        self.alive = 0  # rebuilt holders not yet freed by autograd


class StreamedStash:
    """One stash that streams ([Note: streamed offload]): its chunks in save order."""

    def __init__(self, offloader, key: tuple):
        self.offloader, self.key = offloader, key
        self.chunks: list[Chunk] = [Chunk(self, 0)]
        self.in_flight: dict[int, object] = {}  # storage data_ptr -> StorageGroup, while its device storage is held
        self.landed_at: dict[int, tuple] = {}  # data_ptr -> (StorageWeakRef, StorageGroup) of landed groups, during F
        self.forwarding = True
        self.every: dict[int, object] = {}  # data_ptr -> StorageGroup, for the split backward's leaves at OFFLOAD
        self.next = -1  # highest chunk index not yet issued back (-1: none left)
        self.offloaded = self.reloaded = self.in_ledger = False
        self.landed = 0  # bytes landed before the ledger knew the stash (during its F)
        self.where = ""
        self.refs: list = []  # weak references with callbacks to rebuilt holders

    # -- during F ---------------------------------------------------------------------

    def add(self, holder) -> None:
        """The pack hook made `holder` for a tensor of this stash."""
        offloader = self.offloader
        storage = holder.tensor.untyped_storage()
        ptr = storage.data_ptr()
        holder.chunk = None
        group = self.in_flight.get(ptr)
        if group is None and ptr in self.landed_at:
            weak, landed = self.landed_at[ptr]
            if not weak.expired():  # the same storage, still alive: its host copy serves
                holder.drop()
                group = landed
            else:  # freed; a new storage at the same address
                del self.landed_at[ptr]
        if group is not None:
            group.holders.append(holder)
            holder.chunk = group.chunk
        else:
            chunk = self.chunks[-1]
            group = StorageGroup([holder], storage.nbytes(), storage_bytes(storage, offloader.device), None)
            group.chunk = chunk
            holder.chunk = chunk
            chunk.groups.append(group)
            chunk.nbytes += group.nbytes
            self.in_flight[ptr] = self.every[ptr] = group
            if chunk.nbytes >= offloader.chunk:
                self.flush()
        offloader.poll()

    def flush(self) -> None:
        """Copies the filling chunk out (if it has anything) and starts a new one."""
        chunk = self.chunks[-1] if self.chunks else None
        if chunk is None or chunk.state != "filling" or not chunk.groups:
            return
        offloader = self.offloader
        chunk.out_done = offloader.copy_out(chunk.groups)
        chunk.state = "out"
        self.chunks.append(Chunk(self, len(self.chunks)))
        if chunk.out_done is None:
            self.landed_out(chunk)
        else:
            offloader.chunks_out.append(chunk)

    def end_forward(self) -> int:
        """After the F: the last chunk goes. Returns the bytes that landed during the F,
        which the ledger counts on the host from the start (`Ledger.add(hosted=)`)."""
        self.flush()
        if self.chunks and not self.chunks[-1].groups:
            self.chunks.pop()
        self.next = len(self.chunks) - 1
        self.forwarding, self.landed_at = False, {}
        self.in_ledger = True
        landed, self.landed = self.landed, 0
        return landed

    def landed_out(self, chunk: Chunk) -> None:
        """A chunk's copy out has completed."""
        chunk.out_done = None
        if chunk.state == "kept":  # reloaded meanwhile: the holders keep the device storages
            for group in chunk.groups:
                group.device = None
            self._return_host(chunk)
            return
        for group in chunk.groups:
            for holder in group.holders:
                holder.drop()
            ptr = group.device.data_ptr()
            if self.in_flight.get(ptr) is group:
                del self.in_flight[ptr]
                if self.forwarding:  # saved again later in this F: found by its weak reference
                    self.landed_at[ptr] = (StorageWeakRef(group.device.untyped_storage()), group)
            group.device = None
        chunk.state = "host"
        if self.in_ledger:
            self.offloader.ledger.to_host(self.key, chunk.nbytes)
        else:
            self.landed += chunk.nbytes

    def offload(self, where: str, leaves) -> None:
        """OFFLOAD: the split backward's leaves over the stash's storages let go of them."""
        self.offloaded, self.where = True, where
        self.flush()
        for leaf in leaves:
            group = self.every.get(leaf.untyped_storage().data_ptr())
            if group is not None and leaf.layout is torch.strided:
                group.hold_leaf(leaf, self.offloader.device)
        self.every = {}

    # -- RELOAD and B ------------------------------------------------------------------

    def reload(self) -> None:
        """RELOAD: the last `window` chunks start back."""
        self.reloaded = True
        for chunk in self.chunks:
            if chunk.state == "out":  # its copy out is still running: nothing needs to come back
                chunk.state = "kept"
                for group in chunk.groups:
                    group.restore_leaves(group.device.untyped_storage(), self.offloader.device)
                for group in chunk.groups:
                    group.holders = []  # autograd alone keeps them
        issued = 0
        while self.next >= 0 and issued < self.offloader.window:
            issued += self._issue_next()

    def _issue_next(self) -> int:
        chunk = self.chunks[self.next]
        self.next -= 1
        if chunk.state != "host":
            return 0
        self.issue(chunk)
        return 1

    def issue(self, chunk: Chunk) -> None:
        """The copy back of one landed chunk; its holders are rebuilt over the new storages."""
        offloader = self.offloader
        targets, chunk.in_done = offloader.copy_in(chunk.groups)
        chunk.state = "in"
        if self.in_ledger:
            offloader.ledger.to_device(self.key, chunk.nbytes)
        for group, target in zip(chunk.groups, targets):
            for holder in group.holders:
                chunk.alive += 1
                self.refs.append(weakref.ref(holder, self._holder_gone(chunk)))
            group.rebuild(target, offloader.device)
            group.holders = []  # autograd alone keeps the rebuilt tensors alive
        if chunk.in_done is None:
            self._return_host(chunk)
        else:
            offloader.chunks_in.append(chunk)

    def _holder_gone(self, chunk: Chunk):
        """The callback when a rebuilt holder of `chunk` is freed (by autograd, or with
        the graph). Its block returns to the compute stream's pool now, so the compute
        stream must wait for the copy that writes it before anything reuses it; the last
        one gone takes the chunk's bytes off the ledger, if the stash is still held."""
        def gone(_ref, chunk=chunk, stream=self):
            chunk.alive -= 1
            if not chunk.synced and chunk.in_done is not None:
                stream.offloader.compute_waits(chunk.in_done)
                chunk.synced = True
            if chunk.alive == 0 and stream.in_ledger and stream.offloader.streams.get(stream.key) is stream:
                stream.offloader.ledger.drop(stream.key, chunk.nbytes)
        return gone

    def consume(self, chunk: Chunk) -> None:
        """The first unpack of a tensor of `chunk` (during B or W)."""
        if chunk.state == "host":  # unpacked before its turn: fetch it now
            self.issue(chunk)
        if not chunk.synced:
            chunk.synced = True
            if chunk.in_done is not None:
                self.offloader.compute_waits(chunk.in_done)
        chunk.consumed = True
        while self.next >= 0 and self.next >= chunk.index - self.offloader.window:
            self._issue_next()

    def landed_in(self, chunk: Chunk) -> None:
        chunk.in_done = None
        self._return_host(chunk)

    def _return_host(self, chunk: Chunk) -> None:
        for group in chunk.groups:
            if group.host is not None:
                self.offloader.host_pool.give(group.host)
                group.host = None

    def release(self) -> None:
        """FREE (or a whole OFFLOAD after the B): host buffers not in flight go back to
        the pool (those of chunks never brought back too); the others when their copy is
        done (`pending_done`)."""
        for chunk in self.chunks:
            if chunk.out_done is None and chunk.in_done is None:
                self._return_host(chunk)

    def check_reloaded(self, where: str) -> None:
        if self.offloaded and not self.reloaded:
            stage, mb = self.key[1:]
            raise RuntimeScheduleError(
                f"{where} uses the stash of (stage {stage}, mb {mb}), which is offloaded to host memory "
                f"({self.where}) and not reloaded: the schedule needs a RELOAD of it before {where}")


def pending_done(chunk: Chunk, wait: bool) -> bool:
    """Handles a chunk's pending copy if its event has completed (or after waiting)."""
    if chunk.out_done is not None:
        if not completed(chunk.out_done, wait):
            return False
        chunk.stream.landed_out(chunk)
    if chunk.in_done is not None:
        if not completed(chunk.in_done, wait):
            return False
        chunk.stream.landed_in(chunk)
    return True

