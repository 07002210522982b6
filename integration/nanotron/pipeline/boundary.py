"""Several tensors across one stage boundary, packed into the one tensor the runtime sends.

[Note: packed boundary] The runtime's stages protocol ([Note: stages protocol]) carries
exactly one tensor per stage boundary, but a nanotron boundary carries several: blocks
hand over a dict, sorted by name (nanotron's Llama sends `hidden_states` and the bool
`sequence_mask`). `Layout.pack` concatenates them into one flat tensor of the *pack
dtype* (the dtype of the tensors that require grad, which must all share it):

- a tensor that requires grad is flattened into it, differentiably (`cat`), so the
  gradient of the packed tensor, sliced, is each tensor's gradient;
- any other tensor travels as its raw bytes (`view(uint8)`, zero-padded to whole pack
  elements), so integers and bools arrive bit for bit whatever the pack dtype.

`Layout.unpack` inverts it on the receiving rank: a tensor that required grad comes back
as a view of the received tensor (gradients flow into it); the others as fresh tensors
without grad. The layout itself (shapes, dtypes, offsets) is small metadata, exchanged
once per stage through the transport's store (`encode`/`decode`), like the runtime's
own first-use shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from integration.nanotron.pipeline.errors import EngineRuntimeError


@dataclass(frozen=True)
class Entry:
    """One tensor of a boundary: where it sits in the packed tensor (in pack elements)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    offset: int
    length: int  # pack elements it occupies

    @property
    def nbytes(self) -> int:
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * self.dtype.itemsize


@dataclass(frozen=True)
class Layout:
    """The packed form of one boundary: pack dtype and one `Entry` per tensor, in send order."""

    dtype: torch.dtype
    entries: tuple[Entry, ...]

    @property
    def numel(self) -> int:
        return sum(e.length for e in self.entries)

    @staticmethod
    def of(tensors: list[torch.Tensor]) -> Layout:
        grad_dtypes = {t.dtype for t in tensors if t.requires_grad}
        if len(grad_dtypes) > 1:
            raise EngineRuntimeError(
                f"a stage boundary carries tensors requiring grad of several dtypes {sorted(map(str, grad_dtypes))}; "
                "the packed boundary needs one ([Note: packed boundary])"
            )
        floating = [t.dtype for t in tensors if t.is_floating_point()]
        dtype = next(iter(grad_dtypes)) if grad_dtypes else (floating[0] if floating else torch.uint8)
        size = dtype.itemsize
        entries, offset = [], 0
        for t in tensors:
            if t.requires_grad:
                length = t.numel()
            else:
                length = -(-t.numel() * t.element_size() // size)
            entries.append(Entry(tuple(t.shape), t.dtype, t.requires_grad, offset, length))
            offset += length
        return Layout(dtype, tuple(entries))

    def matches(self, tensors: list[torch.Tensor]) -> bool:
        """Whether `tensors` have this layout (`Layout.of(tensors) == self`, without building one)."""
        return len(tensors) == len(self.entries) and all(
            t.dtype == e.dtype and t.requires_grad == e.requires_grad and tuple(t.shape) == e.shape
            for t, e in zip(tensors, self.entries))

    def pack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        if not self.matches(tensors):
            raise EngineRuntimeError(
                f"this microbatch's boundary tensors {Layout.of(tensors).describe()} differ from the first "
                f"microbatch's {self.describe()}; every microbatch must send the same shapes"
            )
        size = self.dtype.itemsize
        parts = []
        for t, e in zip(tensors, self.entries):
            if e.requires_grad:
                parts.append(t.reshape(-1))
            else:
                raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
                padded = torch.zeros(e.length * size, dtype=torch.uint8, device=t.device)
                padded[: raw.numel()] = raw
                parts.append(padded.view(self.dtype))
        return torch.cat(parts)  # a new tensor even for one part: the runtime may empty it after the send

    def unpack(self, packed: torch.Tensor) -> list[torch.Tensor]:
        if packed.dtype != self.dtype or packed.numel() != self.numel:
            raise EngineRuntimeError(f"received {packed.dtype}[{packed.numel()}] for boundary {self.describe()}")
        out = []
        for e in self.entries:
            piece = packed[e.offset: e.offset + e.length]
            if e.requires_grad:
                out.append(piece.view(e.shape))
            else:
                raw = piece.detach().view(torch.uint8)[: e.nbytes].clone()
                out.append(raw.view(e.dtype).view(e.shape))
        return out

    def encode(self) -> str:
        def dt(d):
            return str(d).removeprefix("torch.")
        items = [f"{dt(e.dtype)}|{','.join(map(str, e.shape))}|{int(e.requires_grad)}" for e in self.entries]
        return dt(self.dtype) + ";" + ";".join(items)

    @staticmethod
    def decode(text: str) -> Layout:
        head, *items = text.split(";")
        tensors = []
        for item in items:
            dtype, shape, grad = item.split("|")
            meta = torch.empty(tuple(int(n) for n in shape.split(",") if n), dtype=getattr(torch, dtype), device="meta")
            tensors.append(meta.requires_grad_(grad == "1") if meta.is_floating_point() else meta)
        layout = Layout.of(tensors)
        if layout.dtype != getattr(torch, head):
            raise EngineRuntimeError(f"layout {text!r} decodes to pack dtype {layout.dtype}")
        return layout

    def describe(self) -> str:
        return "[" + ", ".join(f"{str(e.dtype).removeprefix('torch.')}{list(e.shape)}" for e in self.entries) + "]"


__all__ = ["Entry", "Layout"]
