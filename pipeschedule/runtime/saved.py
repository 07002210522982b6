"""What a stash that may move to host memory is made of: the holders autograd keeps for
its saved tensors, the storages they share, and the pooled host buffers they are copied
into ([Note: host offload] in host_offload.py; streamed: stream_offload.py). Both ways
of moving a stash, whole and streamed, build on these.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from pipeschedule.errors import RuntimeScheduleError

Key = tuple  # ("stash", stage, mb)


class SavedTensor:
    """What the pack hook returns for one saved tensor of a stash that may move: the
    device tensor, or None while offloaded, and how to rebuild it over a new storage."""

    __slots__ = ("tensor", "layout", "key", "chunk", "__weakref__")

    def __init__(self, tensor: torch.Tensor, key: Key | None):
        self.tensor: torch.Tensor | None = tensor
        self.layout = None  # (dtype, storage offset, size, stride) while offloaded
        self.key = key
        self.chunk = None  # its stream_offload.Chunk when the stash streams

    def drop(self) -> None:
        """Lets go of the device tensor, keeping its layout to rebuild it (`tensor_over`)."""
        if self.tensor is not None:
            self.layout, self.tensor = layout_of(self.tensor), None

    def get(self) -> torch.Tensor:
        chunk = self.chunk
        if chunk is not None and not chunk.consumed and chunk.stream.reloaded:
            chunk.stream.consume(chunk)  # [Note: streamed offload]
        if self.tensor is None:
            stage, mb = (self.key or (None, "?", "?"))[1:]
            raise RuntimeScheduleError(
                f"autograd used a saved tensor of the stash of (stage {stage}, mb {mb}) while it is offloaded "
                f"to host memory: the schedule has no RELOAD of it before this use"
            )
        return self.tensor


def unpack(value):
    """The unpack hook: a holder's current device tensor, anything else as packed."""
    return value.get() if type(value) is SavedTensor else value


def layout_of(t: torch.Tensor) -> tuple:
    """(dtype, storage offset, size, stride): what places a tensor over a storage."""
    return t.dtype, t.storage_offset(), tuple(t.shape), t.stride()


def tensor_over(storage: torch.UntypedStorage, layout: tuple, device: torch.device) -> torch.Tensor:
    """A tensor of `layout` (`layout_of`) over `storage`."""
    dtype, offset, size, stride = layout
    return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, size, stride)


def storage_bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over a whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class HostPool:
    """Host buffers (pinned when the device is CUDA) by size in bytes, reused across
    offloads and steps: stash storages have the same sizes every microbatch, so after the
    first step nothing is allocated. `allocations` counts the buffers ever made."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.allocations = 0
        self.allocated_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        if self.free[nbytes]:
            return self.free[nbytes].pop()
        self.allocations += 1
        self.allocated_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def give(self, buffer: torch.Tensor) -> None:
        self.free[buffer.numel()].append(buffer)


class StorageGroup:
    """One storage of a stash on its way: the holders over it, the leaves whose `.data`
    is over it (with their layouts), and its host copy."""

    __slots__ = ("holders", "leaves", "nbytes", "device", "host", "chunk")

    def __init__(self, holders: list[SavedTensor], nbytes: int, device: torch.Tensor, host: torch.Tensor | None):
        self.holders, self.nbytes, self.device, self.host = holders, nbytes, device, host
        self.leaves: list[tuple[torch.Tensor, tuple]] = []
        self.chunk = None  # its Chunk when the stash streams

    def hold_leaf(self, leaf: torch.Tensor, device: torch.device) -> None:
        """Empties `leaf`'s `.data` (a split backward's input leaf over this storage, which
        would keep it alive); `restore_leaves` puts it back over the storage it gets."""
        self.leaves.append((leaf, layout_of(leaf)))
        leaf.data = torch.empty(0, dtype=leaf.dtype, device=device)

    def restore_leaves(self, storage: torch.UntypedStorage, device: torch.device) -> None:
        for leaf, layout in self.leaves:
            leaf.data = tensor_over(storage, layout, device)
        self.leaves = []

    def rebuild(self, storage_bytes: torch.Tensor, device: torch.device) -> None:
        """Every holder (and held leaf) back over `storage_bytes`, a device storage with
        this group's bytes (a reload's, or the one kept alive since the offload)."""
        storage = storage_bytes.untyped_storage()
        for holder in self.holders:
            holder.tensor, holder.layout = tensor_over(storage, holder.layout, device), None
        self.restore_leaves(storage, device)
        self.device = None


def completed(event, wait: bool) -> bool:
    """Whether a copy's event has completed; with `wait`, after waiting for it."""
    if wait:
        event.synchronize()
        return True
    return event.query()
