"""The memory ledger: live bytes one rank holds in its buffer table, per buffer kind.

[Note: what the ledger counts] One number per buffer (kind, stage, mb), added at the
instruction that produces the buffer and removed at its FREE, so that replaying the
program with these sizes (what the simulator does) gives the same curve exactly:

    act_in    nbytes of the received tensor (allocated when its RECV_F is posted), of the
              local hand-off (at F of the previous stage), or of the tensors in the
              data-loader input (at F of stage 0)
    act_out   nbytes of the stage output that will be sent (at F)
    stash     the storages autograd saved during F (seen through
              `torch.autograd.graph.saved_tensors_hooks`), each storage once (by its
              data_ptr) at its full size, leaving out storages that live anyway: the
              act_in, the target, and the stage's parameters and buffers
              (`Stages.parameters`). A saved view of a parameter (`weight.t()` in a
              Linear) shares the parameter's storage, so it is left out too. A stage output
              that autograd saves (e.g. by sigmoid) is counted in stash as well as in
              act_out, since it outlives the send.
    grad_out  nbytes of the received (at RECV_B) or locally handed-off (at B) gradient
    grad_in   nbytes of the input gradient produced at B

In a split-backward schedule the stash lives from F to W. At B its count changes
(`resize`) to what W still needs ([Note: split backward]): the storages of the deferred
matmuls' inputs and of their output gradients, parameters left out; an input that is
the act_in is counted here too, since act_in is freed right after B while W keeps it.
`sizes` keeps the size at F, `resized` the size from B on.

Parameters, their gradients and optimizer state are not counted: the baseline between
steps is 0. Saved tensors that the stage itself packs with its own saved-tensors hooks
(activation checkpointing, offloading) are not seen and count as 0.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from pipeschedule.ir import BUFFERS, Instr

Key = tuple  # (kind, stage, mb)


class Ledger:
    """Live bytes per buffer kind, their high-water marks and a per-instruction trace.

    `trace`, `sizes` and the high-water marks cover the current step (`begin_step`
    resets them); `live` must be back to 0 at the end of every step.
    """

    def __init__(self) -> None:
        self.live = dict.fromkeys(BUFFERS, 0)
        self._held: dict[Key, int] = {}
        self.begin_step()

    def begin_step(self) -> None:
        self.high = dict.fromkeys(BUFFERS, 0)
        self.high_total = 0
        self.sizes: dict[Key, int] = {}  # every buffer produced this step, by (kind, stage, mb)
        self.resized: dict[Key, int] = {}  # buffers whose count changed while held (split stash from B)
        self.trace: list[tuple[int, Instr, dict[str, int]]] = []  # (pc, instr, live bytes per kind) after it ran

    @property
    def live_total(self) -> int:
        return sum(self.live.values())

    def add(self, key: Key, nbytes: int) -> None:
        kind = key[0]
        self._held[key] = nbytes
        self.sizes[key] = nbytes
        self.live[kind] += nbytes
        self.high[kind] = max(self.high[kind], self.live[kind])
        self.high_total = max(self.high_total, self.live_total)

    def resize(self, key: Key, nbytes: int) -> None:
        kind = key[0]
        self.live[kind] += nbytes - self._held[key]
        self._held[key] = self.resized[key] = nbytes
        self.high[kind] = max(self.high[kind], self.live[kind])
        self.high_total = max(self.high_total, self.live_total)

    def release(self, key: Key) -> None:
        self.live[key[0]] -= self._held.pop(key)

    def record(self, pc: int, instr: Instr) -> None:
        self.trace.append((pc, instr, dict(self.live)))


def nbytes(value) -> int:
    """Bytes of a tensor, or of the tensors inside a list, tuple or dict (data-loader inputs)."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    return 0


def storage_ptrs(values) -> set[int]:
    """data_ptrs of the storages of the tensors in `values` (nested lists, tuples, dicts)."""
    out: set[int] = set()
    stack = list(values)
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            out.add(value.untyped_storage().data_ptr())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
    return out


@contextmanager
def saved_storages(exclude: set[int]) -> Iterator[dict[int, int]]:
    """Collects {storage data_ptr: storage nbytes} of what autograd saves in the block,
    leaving out storages in `exclude` ([Note: what the ledger counts])."""
    found: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in exclude:
            found[ptr] = storage.nbytes()
        # A detached alias, not the tensor itself: when the saved tensor is the stage
        # output, the executor later empties that output's `.data` ([Note: executor
        # semantics]); the alias keeps the storage autograd needs.
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
        yield found


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
