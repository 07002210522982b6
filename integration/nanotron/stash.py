"""Measure what a rank keeps for backward, per microbatch, over one training step.

`StashMeter` is attached to a model (`PipelinedLlama.stash_meter`, or `meter.attached(model)`
for any model); `meter.recording()` is open around each forward call, which installs
`torch.autograd.graph.saved_tensors_hooks`. Every tensor autograd saves passes through
`_pack`; the meter counts the bytes of its *storage* once however many ops save views of
it (de-duplicated by storage), attributes it to the microbatch whose forward saved it
first, and notices, through a `weakref.finalize` on the packed handle, when autograd
lets go of it (after that node's backward, or when the graph is dropped). Parameters are
excluded: they are not activations. The model also reports each tensor it hands to a
block on another rank (`track_stage_output`: activations, and tensors without grad such
as the sequence mask), so the meter can tell when a sent tensor is freed. Tensors the
caller itself keeps (a data list) are of course freed late; feed data lazily.

The clock counts events (forward start, save, first unpack of a microbatch = its
backward start, release). Summary fields:

    peak_bytes        most stash bytes alive at once
    peak_microbatches most microbatches with some stash alive at once
    bytes_per_mb      stash bytes of each microbatch (saved during its forward)
    leaked_bytes      stash still alive at `finish()` (should be 0 after a step)
    outputs           per tensor sent to another rank: microbatch, input key, bytes,
                      requires_grad, and whether it was freed only after the last
                      backward of the step released its stash (`held_to_end`) or not at
                      all by `finish()` (`alive_after_step`)
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
import torch


class _Saved:
    """What `_pack` hands to autograd: the tensor and the storage it is counted under."""

    __slots__ = ("tensor", "key", "mb", "__weakref__")

    def __init__(self, tensor: torch.Tensor, key, mb: int):
        self.tensor = tensor
        self.key = key
        self.mb = mb


@dataclass
class _Output:
    mb: int
    name: str
    nbytes: int
    requires_grad: bool
    freed_at: int | None = None


@dataclass
class StashMeter:
    excluded: set = field(default_factory=set)  # storage keys never counted (parameters)

    def __post_init__(self) -> None:
        self.clock = 0
        self.mb = -1  # microbatch whose forward runs (forward calls so far - 1)
        self._live: dict = {}  # storage key -> [bytes, handle count, mb]
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_microbatches = 0
        self.bytes_per_mb: dict[int, int] = {}
        self.backward_started: dict[int, int] = {}  # mb -> clock of its first unpack
        self.released: dict[int, int] = {}  # mb -> clock when its last stash storage went
        self.outputs: list[_Output] = []
        self.finished_at: int | None = None
        self._quiet = False  # inside a call `recording` does not count

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> StashMeter:
        return cls(excluded={_key(p) for p in model.parameters()})

    @contextlib.contextmanager
    def recording(self):
        """Open around one forward call (one microbatch). A call with grad disabled saves
        nothing for backward and is no microbatch's training forward (an evaluation, or
        the engine's masked call that finds the model's block graph, [Note: block graph]):
        it is not counted, nor are the tensors it hands to other ranks."""
        if not torch.is_grad_enabled():
            self._quiet = True
            try:
                yield
            finally:
                self._quiet = False
            return
        self.mb += 1
        self._tick()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    @contextlib.contextmanager
    def attached(self, model: torch.nn.Module):
        """Record around every call of `model` (one microbatch each, as nanotron's engines
        and pipeschedule's call it) while open; for models that do not call `recording`
        themselves, such as nanotron's own Llama."""
        open_calls: list = []

        def before(module, args):
            context = self.recording()
            context.__enter__()
            open_calls.append(context)

        def after(module, args, output):
            open_calls.pop().__exit__(None, None, None)

        handles = [model.register_forward_pre_hook(before), model.register_forward_hook(after)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def track_stage_output(self, tensor: torch.Tensor, name: str = "") -> None:
        """Note a tensor this rank hands to another rank (by `name`, its input key there)."""
        if self._quiet:
            return
        record = _Output(self.mb, name, tensor.untyped_storage().nbytes(), tensor.requires_grad)
        self.outputs.append(record)
        weakref.finalize(tensor, self._output_freed, record)

    def finish(self) -> dict:
        """Call after the step returned; the summary as plain data."""
        self.finished_at = self._tick()
        last_release = max(self.released.values(), default=None)
        all_released = len(self.released) == len(self.bytes_per_mb) and self.live_bytes == 0
        return {
            "peak_bytes": self.peak_bytes,
            "peak_microbatches": self.peak_microbatches,
            "bytes_per_mb": dict(self.bytes_per_mb),
            "leaked_bytes": self.live_bytes,
            "outputs": [
                {
                    "mb": o.mb,
                    "name": o.name,
                    "nbytes": o.nbytes,
                    "requires_grad": o.requires_grad,
                    "held_to_end": o.freed_at is not None and all_released and o.freed_at > last_release,
                    "alive_after_step": o.freed_at is None,
                }
                for o in self.outputs
            ],
        }

    # -- hooks -------------------------------------------------------------------------

    def _pack(self, tensor: torch.Tensor):
        key = _key(tensor)
        if key in self.excluded or tensor.untyped_storage().nbytes() == 0:
            return _Saved(tensor, None, self.mb)
        handle = _Saved(tensor, key, self.mb)
        entry = self._live.get(key)
        if entry is None:
            nbytes = tensor.untyped_storage().nbytes()
            entry = self._live[key] = [nbytes, 0, self.mb]
            self.live_bytes += nbytes
            self.bytes_per_mb[self.mb] = self.bytes_per_mb.get(self.mb, 0) + nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.peak_microbatches = max(self.peak_microbatches, len({e[2] for e in self._live.values()}))
        entry[1] += 1
        weakref.finalize(handle, self._release, key)
        self._tick()
        return handle

    def _unpack(self, handle: _Saved) -> torch.Tensor:
        if handle.key is not None and handle.mb not in self.backward_started:
            self.backward_started[handle.mb] = self._tick()
        return handle.tensor

    def _release(self, key) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[key]
            self.live_bytes -= entry[0]
            mb = entry[2]
            if not any(e[2] == mb for e in self._live.values()):
                self.released[mb] = self._tick()

    def _output_freed(self, record: _Output) -> None:
        record.freed_at = self._tick()

    def _tick(self) -> int:
        self.clock += 1
        return self.clock


def _key(tensor: torch.Tensor):
    storage = tensor.untyped_storage()
    return (storage.device.type, storage.device.index, storage.data_ptr())


def microbatches_worth(summary: dict) -> float:
    """peak_bytes in units of one microbatch's stash (microbatch 0's)."""
    per_mb = summary["bytes_per_mb"].get(0)
    return summary["peak_bytes"] / per_mb if per_mb else 0.0


__all__ = ["StashMeter", "microbatches_worth"]
