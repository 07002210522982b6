"""Host offload of stashes: OFFLOAD moves a stash's saved tensors to host memory, RELOAD
brings them back before the B (or W) that needs them.

[Note: host offload] What moves is what the ledger counts as the stash
([Note: what the ledger counts]): every tensor autograd saves during F, except storages that live
anyway (the act_in, the target, the stage's parameters and buffers, and views of
them). On a rank whose program has an OFFLOAD, the executor runs F with pack hooks
that wrap each such tensor in a `SavedTensor` holder; autograd keeps the holder, and
its unpack hook returns the holder's current device tensor. The stash keeps weak
references to its holders, so a holder whose graph was freed (after B) is simply gone.

    OFFLOAD   the live holders' storages, each once (views share it), are copied whole to
              host buffers taken from a `HostPool`. On CUDA: the side stream (`side_out`;
              copies back run on a second one, `side_in`) waits on an
              event recorded on the compute stream (so the copy follows the compute that
              produced the tensors), copies with non_blocking into pinned buffers, and
              records `done`. The holders drop their device tensors at once (a use now
              raises); the offload keeps the device storages alive until `done` has
              completed (`poll`, at every instruction), then drops them, which is when the
              memory returns to the caching allocator and the ledger moves the bytes from
              device to host. Keeping the references, rather than `record_stream`, keeps
              the allocator's rule simple: a block is freed only once no stream uses it.
    RELOAD    fresh device storages are allocated on the compute stream (their blocks
              belong to it), the side stream waits on an event recorded after the
              allocation, copies the host bytes in and records `done`; each holder gets a
              tensor of its old dtype, offset, size and stride over the new storage. The
              host buffers go back to the pool once `done` has completed. A RELOAD that
              comes before its OFFLOAD's copy has completed reuses the device storages
              still kept alive (the data never changed) and copies nothing.
    B / W     `ready` makes the compute stream wait on the reload's `done` (no host
              wait); a stash that is offloaded and not reloaded raises a
              RuntimeScheduleError naming the instruction, before autograd runs.

On CPU there are no streams: the copies are real copies into other CPU tensors, made at
once, so the semantics (holders, pool, ledger moves, errors) and exactness are the same
and are what the tests exercise. The bytes are copied unchanged, so gradients are
bitwise those of a run without offload.

Split backward ([Note: split backward]): the W part's deferred linears keep their
inputs through the private graphs' saved tensors, which go through the same hooks, so
the linear inputs W needs are part of the stash: an OFFLOAD before B moves them too,
and the RELOAD before B brings them back with the rest. An OFFLOAD between B and W
moves the holders still alive then (those linear inputs); the output gradients the W
part keeps (`_Record.grad`) stay on the device (TODO: a holder for them would let an
OFFLOAD between B and W move them as well).

A storage that a stash shares with another live buffer (a stage output that autograd
saved and that is not yet sent, a local hand-off) is copied and counted as moved, but
its device memory returns only once that other buffer is freed too.
"""

from __future__ import annotations

import math

import torch

from pipeschedule.checks import is_finite, is_int
from pipeschedule.errors import ParameterError, RuntimeScheduleError
from pipeschedule.runtime.saved import HostPool, Key, SavedTensor, StorageGroup, completed, storage_bytes
from pipeschedule.runtime.stream_offload import StreamedStash, pending_done


class _Moving:
    """One offloaded stash: its groups, the offload's and the reload's `done` events
    (None on CPU, and once handled), and where it stands."""

    __slots__ = ("key", "groups", "offload_done", "reload_done", "on_host", "reloaded", "where")

    def __init__(self, key: Key, groups: list[StorageGroup], offload_done, where: str):
        self.key, self.groups, self.offload_done, self.where = key, groups, offload_done, where
        self.reload_done = None
        self.on_host = False  # the offload completed: device storages dropped, ledger moved
        self.reloaded = False


class Offloader:
    """OFFLOAD / RELOAD of stashes for one executor ([Note: host offload])."""

    def __init__(self, device: torch.device, ledger, chunk: int | None = None, window: int = 2):
        if chunk is not None:
            if not (is_finite(chunk) and chunk >= 1):
                raise ParameterError(f"offload_chunk={chunk!r}: give a number of bytes >= 1, "
                                     "or None to move stashes whole")
            chunk = math.ceil(chunk)
        if not (is_int(window) and window >= 1):
            raise ParameterError(f"reload_window={window!r}: give a number of chunks >= 1")
        self.device, self.ledger = device, ledger
        self.chunk, self.window = chunk, window  # streamed offload ([Note: streamed offload])
        self.cuda = device.type == "cuda"
        self.host_pool = HostPool(pinned=self.cuda)
        self._side_out = self._side_in = None  # the side streams, made at first use
        self.moving: dict[Key, _Moving] = {}
        self._pending: list[_Moving] = []  # offloads or reloads whose `done` has not been seen
        self.streams: dict[Key, StreamedStash] = {}  # stashes that stream, from their F to their FREE
        self.chunks_out: list = []  # their chunks with a copy out in flight, in side_out's order
        self.chunks_in: list = []  # and with a copy back in flight, in side_in's order
        self.copied_to_host = self.copied_to_device = 0  # bytes, over the executor's life

    @property
    def side_out(self) -> torch.cuda.Stream:
        """The side stream of copies to the host (made at the first offload)."""
        if self._side_out is None:
            self._side_out = torch.cuda.Stream(device=self.device)
        return self._side_out

    @property
    def side_in(self) -> torch.cuda.Stream:
        """The side stream of copies back to the device: a second stream, so that a copy
        in never queues behind copies out (the link carries both directions at once)."""
        if self._side_in is None:
            self._side_in = torch.cuda.Stream(device=self.device)
        return self._side_in

    # -- the instructions -------------------------------------------------------------

    def offload(self, key: Key, holders, where: str, leaves=()) -> None:
        """OFFLOAD of the stash `key`, whose holders are `holders` (weak references).
        `leaves` are tensors whose own reference would keep a moved storage alive (the
        split backward's private input leaves): their `.data` is emptied and restored."""
        stream = self.streams.get(key)
        if stream is not None:
            if stream.offloaded and not stream.reloaded:
                raise RuntimeScheduleError(f"{where}: the stash of (stage {key[1]}, mb {key[2]}) is already offloaded")
            if not stream.offloaded:
                stream.offload(where, leaves)
                return
            # back for its B and offloaded again (between B and W): what W keeps moves whole
            self.streams.pop(key).release()
        earlier = self.moving.get(key)
        if earlier is not None and not earlier.reloaded:
            raise RuntimeScheduleError(f"{where}: the stash of (stage {key[1]}, mb {key[2]}) is already offloaded")
        by_storage: dict[int, tuple[torch.UntypedStorage, list[SavedTensor]]] = {}
        for ref in holders:
            holder = ref()
            if holder is not None and holder.tensor is not None:
                storage = holder.tensor.untyped_storage()
                by_storage.setdefault(storage.data_ptr(), (storage, []))[1].append(holder)
        groups = [StorageGroup(group_holders, storage.nbytes(), storage_bytes(storage, self.device), None)
                  for storage, group_holders in by_storage.values()]
        done = self.copy_out(groups)
        for group in groups:
            for holder in group.holders:
                holder.drop()
        by_ptr = {group.device.data_ptr(): group for group in groups}
        for leaf in leaves:
            group = by_ptr.get(leaf.untyped_storage().data_ptr())
            if group is not None and leaf.layout is torch.strided:
                group.hold_leaf(leaf, self.device)
        moving = _Moving(key, groups, done, where)
        self.moving[key] = moving
        if done is None:
            self._offloaded(moving)
        else:
            self._pending.append(moving)

    def reload(self, key: Key, where: str) -> None:
        """RELOAD of the stash `key`."""
        stream = self.streams.get(key)
        if stream is not None and stream.offloaded and not stream.reloaded:
            self.poll()
            stream.reload()
            return
        moving = self.moving.get(key)
        if moving is None or moving.reloaded:
            state = "already reloaded" if moving is not None else "not offloaded"
            raise RuntimeScheduleError(f"{where}: RELOAD of the stash of (stage {key[1]}, mb {key[2]}), "
                                       f"which is {state}")
        self.poll()
        moving.reloaded = True
        if not moving.on_host:  # the offload's copy is still running: its device storages never went
            for group in moving.groups:
                group.rebuild(group.device, self.device)
            return  # the host buffers return when the offload's `done` is seen (poll)
        targets, moving.reload_done = self.copy_in(moving.groups)
        for group, target in zip(moving.groups, targets):
            group.rebuild(target, self.device)
        self.ledger.to_device(key)
        if moving.reload_done is None:
            self._return_host(moving)
        else:
            self._pending.append(moving)

    def ready(self, key: Key, where: str) -> None:
        """Before B or W of `key`: raises if its stash is offloaded and not reloaded;
        otherwise makes the compute stream wait for the reload's copy."""
        stream = self.streams.get(key)
        if stream is not None:
            stream.check_reloaded(where)  # its chunks are waited for one by one, at their first unpack
            return
        moving = self.moving.get(key)
        if moving is None:
            return
        if not moving.reloaded:
            raise RuntimeScheduleError(
                f"{where} uses the stash of (stage {key[1]}, mb {key[2]}), which is offloaded to host memory "
                f"({moving.where}) and not reloaded: the schedule needs a RELOAD of it before {where}"
            )
        if moving.reload_done is not None:
            self.compute_waits(moving.reload_done)

    def forget(self, key: Key) -> None:
        """At the stash's FREE: drops what is left of its offload (the ledger releases
        both sides itself). Host buffers still being copied return once done."""
        stream = self.streams.pop(key, None)
        if stream is not None:
            stream.release()
        moving = self.moving.pop(key, None)
        if moving is not None and not self._is_pending(moving):
            self._return_host(moving)

    # -- the copies (both paths) ---------------------------------------------------------

    def copy_out(self, groups: list) -> torch.cuda.Event | None:
        """Copies each group's device storage into a host buffer from the pool: on CUDA on
        `side_out`, after what the compute stream has queued so far (returns the copies'
        `done` event); on CPU at once (returns None)."""
        for group in groups:
            group.host = self.host_pool.take(group.nbytes)
            self.copied_to_host += group.nbytes
        if not self.cuda:
            for group in groups:
                group.host.copy_(group.device)
            return None
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.device))
        self.side_out.wait_event(produced)
        with torch.cuda.stream(self.side_out):
            for group in groups:
                group.host.copy_(group.device, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.side_out)
        return done

    def compute_waits(self, event) -> None:
        """The compute stream (the current one of the calling thread) waits for `event`;
        the host does not."""
        torch.cuda.current_stream(self.device).wait_event(event)

    def copy_in(self, groups: list) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """New device storages for the groups, filled from their host copies: (storages,
        `done` event, None on CPU). The blocks are allocated on the compute stream (they
        belong to it); on CUDA `side_in` writes them after that point."""
        targets = [torch.empty(group.nbytes, dtype=torch.uint8, device=self.device) for group in groups]
        self.copied_to_device += sum(group.nbytes for group in groups)
        if not self.cuda:
            for group, target in zip(groups, targets):
                target.copy_(group.host)
            return targets, None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self.side_in.wait_event(ready)
        with torch.cuda.stream(self.side_in):
            for group, target in zip(groups, targets):
                target.copy_(group.host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.side_in)
        return targets, done

    def stream(self, key: Key) -> StreamedStash:
        """The streamed stash `key`, made at its F ([Note: streamed offload])."""
        if key in self.streams:
            raise RuntimeScheduleError(f"the stash of (stage {key[1]}, mb {key[2]}) is produced twice in one step")
        stream = self.streams[key] = StreamedStash(self, key)
        return stream

    # -- completion --------------------------------------------------------------------

    def poll(self) -> None:
        """Handles every copy whose `done` event has completed (never waits)."""
        for chunks in (self.chunks_out, self.chunks_in):
            while chunks and pending_done(chunks[0], wait=False):  # each side stream runs its copies in order
                chunks.pop(0)
        if not self._pending:
            return
        still = []
        for moving in self._pending:
            if not self._complete(moving, wait=False):
                still.append(moving)
        self._pending = still

    def finish(self) -> None:
        """Waits for every copy in flight (the end of a step) and handles it."""
        for chunk in self.chunks_out + self.chunks_in:
            pending_done(chunk, wait=True)
        self.chunks_out, self.chunks_in = [], []
        for stream in self.streams.values():  # normally none: each FREE forgets its stash
            stream.release()
        self.streams.clear()
        for moving in self._pending:
            self._complete(moving, wait=True)
        self._pending = []
        self.moving.clear()

    def _complete(self, moving: _Moving, *, wait: bool) -> bool:
        for name in ("offload_done", "reload_done"):
            event = getattr(moving, name)
            if event is None:
                continue
            if not completed(event, wait):
                return False
            setattr(moving, name, None)
            if name == "offload_done":
                if moving.reloaded:  # reloaded before the copy finished: it kept its device storages
                    for group in moving.groups:
                        group.device = None
                    self._return_host(moving)
                elif self.moving.get(moving.key) is moving:
                    self._offloaded(moving)
                else:  # freed meanwhile
                    self._return_host(moving)
            else:
                self._return_host(moving)
        return True

    def _offloaded(self, moving: _Moving) -> None:
        """The offload's copies are complete: the device storages go, the bytes move."""
        moved = 0
        for group in moving.groups:
            group.device = None
            moved += group.nbytes
        moving.on_host = True
        self.ledger.to_host(moving.key, moved)

    def _return_host(self, moving: _Moving) -> None:
        for group in moving.groups:
            if group.host is not None:
                self.host_pool.give(group.host)
                group.host = None

    def _is_pending(self, moving: _Moving) -> bool:
        return any(entry is moving for entry in self._pending)
