"""The memory ledger: live bytes one rank holds in its buffer table, per buffer kind.

[Note: what the ledger counts] One number per buffer (kind, stage, mb), added at the
instruction that produces the buffer and removed at its FREE, so that replaying the
program with these sizes (what the simulator does) gives the same curve exactly:

    act_in    nbytes of the received tensor (allocated when its RECV_F is posted), of the
              local hand-off (at F of the previous stage), or of the tensors in the
              data-loader input (at F of stage 0)
    act_out   nbytes of the stage output that will be sent (at F; with the buffer pool, of
              the pooled send buffer it is copied into, the same size)
    stash     the storages autograd saved during F (seen through
              `torch.autograd.graph.saved_tensors_hooks`), each storage once (by its
              data_ptr) at its full size, leaving out storages that live anyway: the
              act_in, the target, and the stage's parameters and buffers
              (`Stages.parameters`). A saved view of a parameter (`weight.t()` in a
              Linear) shares the parameter's storage, so it is left out too. A stage output
              that autograd saves (e.g. by sigmoid) is counted in stash as well as in
              act_out, since it outlives the send. The hooks cost a few microseconds of
              host time per saved tensor, so by default (`Executor(measure_stash=
              "first")`) only the first F of each stage and input signature
              (`signature_of`: shapes, dtypes, grad mode) runs under them; the other F
              of that stage and signature are charged the same bytes. The sizes last
              one step, or, where the stages give `Stages.state` (training flags,
              requires_grad, autocast: `module_state`), as long as the stage's state
              is the same: in steady training no F runs under the hooks. Exact
              unless what a stage saves depends on the values of its inputs (e.g. routing
              in a mixture of experts): then `measure_stash="every"`.
    grad_out  nbytes of the received (at RECV_B) or locally handed-off (at B) gradient
    grad_in   nbytes of the input gradient produced at B

In a split-backward schedule the stash lives from F to W. At B its count changes
(`resize`) to what W still needs ([Note: split backward]): the storages of the deferred
matmuls' inputs and of their output gradients, parameters left out; an input that is
the act_in is counted here too, since act_in is freed right after B while W keeps it.
`sizes` keeps the size at F, `resized` the size from B on.

[Note: device and host bytes] A stash that the schedule offloads (OFFLOAD,
[Note: host offload] in host_offload) moves from `live` (device) to `host` when its copy to host
memory has completed (`to_host`, with the bytes actually moved: the storages the stash's
saved tensors hold, the same storages the stash count is made of), and back at its
RELOAD (`to_device`). Each side has its own high-water marks (`high` / `high_total`,
`high_host` / `high_host_total`); `trace` records device bytes after each instruction
and `host_trace` (same length, same order) host bytes. A FREE releases both sides.

Parameters, their gradients and optimizer state are not counted: the baseline between
steps is 0. Saved tensors that the stage itself packs with its own saved-tensors hooks
(activation checkpointing, offloading) are not seen and count as 0.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Iterator

import torch

from pipeschedule.compiler.ir import BUFFERS, Instr
from pipeschedule.runtime.saved import SavedTensor, unpack

Key = tuple  # (kind, stage, mb)


class Ledger:
    """Live bytes per buffer kind on the device (`live`) and on the host (`host`), their
    high-water marks and a per-instruction trace of both.

    `trace`, `host_trace`, `sizes`, `moved` and the high-water marks cover the current
    step (`begin_step` resets them); `live` and `host` must be back to 0 at the end of
    every step.
    """

    def __init__(self) -> None:
        self.live = dict.fromkeys(BUFFERS, 0)
        self.host = dict.fromkeys(BUFFERS, 0)
        self._held: dict[Key, int] = {}  # device bytes per held buffer
        self._hosted: dict[Key, int] = {}  # host bytes per offloaded buffer
        self.begin_step()

    def begin_step(self) -> None:
        self.high = dict.fromkeys(BUFFERS, 0)
        self.high_total = 0
        self.high_host = dict.fromkeys(BUFFERS, 0)
        self.high_host_total = 0
        self.sizes: dict[Key, int] = {}  # every buffer produced this step, by (kind, stage, mb)
        self.resized: dict[Key, int] = {}  # buffers whose count changed while held (split stash from B)
        self.moved: dict[Key, int] = {}  # bytes each offloaded buffer moved to the host this step
        # after each instruction: its pc, itself, and the bytes per kind (BUFFERS' order, flat) on the device
        # and on the host; kept flat (no container per instruction), read through `trace` and `host_trace`
        self._pcs: list[int] = []
        self._instrs: list[Instr] = []
        self._levels: list[int] = []
        self._host_levels: list[int] = []

    @property
    def live_total(self) -> int:
        return sum(self.live.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    def add(self, key: Key, nbytes: int, hosted: int = 0) -> None:
        """A buffer of `nbytes` produced; `hosted` of them already in host memory (a
        streamed stash whose chunks landed during its F)."""
        kind = key[0]
        hosted = min(hosted, nbytes)
        self._held[key] = nbytes - hosted
        self.sizes[key] = nbytes
        self.live[kind] += nbytes - hosted
        self.high[kind] = max(self.high[kind], self.live[kind])
        self.high_total = max(self.high_total, self.live_total)
        if hosted:
            self._count_on_host(key, hosted)

    def resize(self, key: Key, nbytes: int) -> None:
        kind = key[0]
        self.live[kind] += nbytes - self._held[key]
        self._held[key] = self.resized[key] = nbytes
        self.high[kind] = max(self.high[kind], self.live[kind])
        self.high_total = max(self.high_total, self.live_total)

    def release(self, key: Key) -> None:
        self.live[key[0]] -= self._held.pop(key)
        self.host[key[0]] -= self._hosted.pop(key, 0)

    def to_host(self, key: Key, nbytes: int) -> None:
        """`nbytes` of a held buffer now live in host memory (its offload completed)."""
        self._held[key] -= nbytes
        self.live[key[0]] -= nbytes
        self._count_on_host(key, nbytes)

    def _count_on_host(self, key: Key, nbytes: int) -> None:
        kind = key[0]
        self._hosted[key] = self._hosted.get(key, 0) + nbytes
        self.moved[key] = self.moved.get(key, 0) + nbytes
        self.host[kind] += nbytes
        self.high_host[kind] = max(self.high_host[kind], self.host[kind])
        self.high_host_total = max(self.high_host_total, self.host_total)

    def to_device(self, key: Key, nbytes: int | None = None) -> None:
        """What `to_host` moved of a buffer is on the device again (its RELOAD), or
        `nbytes` of it (a chunk of a streamed stash)."""
        kind = key[0]
        if nbytes is None or nbytes >= self._hosted.get(key, 0):
            nbytes = self._hosted.pop(key, 0)
        else:
            self._hosted[key] -= nbytes
        self.host[kind] -= nbytes
        self._held[key] += nbytes
        self.live[kind] += nbytes
        self.high[kind] = max(self.high[kind], self.live[kind])
        self.high_total = max(self.high_total, self.live_total)

    def drop(self, key: Key, nbytes: int) -> None:
        """`nbytes` of a held buffer left the device before its FREE (a consumed chunk
        of a streamed stash)."""
        nbytes = min(nbytes, self._held[key])
        self._held[key] -= nbytes
        self.live[key[0]] -= nbytes

    def record(self, pc: int, instr: Instr) -> None:
        self._pcs.append(pc)
        self._instrs.append(instr)
        self._levels.extend(self.live.values())
        self._host_levels.extend(self.host.values())

    @property
    def trace(self) -> list[tuple[int, Instr, dict[str, int]]]:
        """(pc, instr, device bytes per kind after it ran) for each instruction run this step."""
        return [(pc, instr, levels) for pc, instr, levels in zip(self._pcs, self._instrs, _rows(self._levels))]

    @property
    def host_trace(self) -> list[dict[str, int]]:
        """Host bytes per kind after each instruction of `trace`, in the same order."""
        return _rows(self._host_levels)


def _rows(flat: list[int]) -> list[dict[str, int]]:
    """`flat` (len(BUFFERS) numbers per instruction) as one dict per instruction."""
    n = len(BUFFERS)
    return [dict(zip(BUFFERS, flat[k:k + n])) for k in range(0, len(flat), n)]


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


def signature_of(values) -> tuple:
    """What the tensors a stage saves can depend on, apart from the values: shape, strides,
    dtype, layout, device and requires_grad of each tensor in `values` (nested lists,
    tuples, dicts, in order), other leaves as themselves (by type where unhashable), and
    grad mode. Raises RuntimeError for a tensor without strides (a nested tensor)."""
    out: list = [torch.is_grad_enabled()]
    stack = [values]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            out.append((tuple(value.shape), value.stride(), value.dtype, value.layout, value.device,
                        value.requires_grad))
        elif isinstance(value, (list, tuple)):
            out.append(len(value))
            stack.extend(reversed(value))
        elif isinstance(value, dict):
            out.append(tuple(value))
            stack.extend(reversed(list(value.values())))
        else:
            try:
                hash(value)
                out.append(value)
            except TypeError:
                out.append(type(value))
    return tuple(out)


@contextmanager
def saved_storages(exclude: set[int], holders: list | None = None, key=None, on_pack=None) -> Iterator[dict[int, int]]:
    """Collects {storage data_ptr: storage nbytes} of what autograd saves in the block,
    leaving out storages in `exclude` ([Note: what the ledger counts]). With `holders`
    (a list), each saved tensor that is counted is packed in a `SavedTensor` holder for
    `key`, and a weak reference to it is appended to `holders` ([Note: host offload])."""
    found: dict[int, int] = {}

    def pack(tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        counted = ptr not in exclude
        if counted:
            found[ptr] = storage.nbytes()
        # A detached alias, not the tensor itself: when the saved tensor is the stage
        # output, the executor later empties that output's `.data`
        # ([Note: executor semantics]); the alias keeps the storage autograd needs.
        alias = tensor.detach()
        if holders is not None and counted and alias.layout is torch.strided and ptr != 0:
            holder = SavedTensor(alias, key)
            holders.append(weakref.ref(holder))
            if on_pack is not None:
                on_pack(holder)  # a streamed stash ([Note: streamed offload])
            return holder
        return alias

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield found
