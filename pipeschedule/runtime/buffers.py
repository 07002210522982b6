"""The buffer table: every buffer one rank holds, keyed by (buf, stage, mb), and for a
buffer of an edge that skips a stage (buf, stage, mb, peer stage) ([Note: peer stage] in
pipeschedule.compiler.instr).

A buffer ([Note: buffers] in pipeschedule.compiler.instr) is added by the instruction that produces
it and dropped at its FREE and nowhere else; the ledger follows both. Using a missing
buffer, producing one twice, a FREE of a missing buffer, and a buffer still held at the
end of a step are errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pipeschedule.compiler.ir import Instr
from pipeschedule.errors import RuntimeScheduleError
from pipeschedule.runtime.ledger import Ledger
from pipeschedule.runtime.shapes import TensorMeta

if TYPE_CHECKING:
    from pipeschedule.runtime.split_backward import WeightGrads

Key = tuple  # (buf, stage, mb) or (buf, stage, mb, peer stage)


def buffer_key(buf: str, stage: int, mb: int, other: int | None = None) -> Key:
    """The key of a buffer: `other` is its peer stage as an instruction writes it (None:
    the neighbour's, or none)."""
    return (buf, stage, mb) if other is None else (buf, stage, mb, other)


def describe_key(key: Key) -> str:
    """'act_in of (stage 3, mb 0)', '... from stage 1' for a buffer of an edge."""
    text = f"{key[0]} of (stage {key[1]}, mb {key[2]})"
    if len(key) > 3:
        text += f" {'for' if key[3] > key[1] else 'from'} stage {key[3]}"
    return text


@dataclass
class Stash:
    """What B of a (stage, mb) needs beyond its act_in and grad_out: the tensor backward
    starts from (the stage output, or loss / m on the last stage) and the output's meta
    (the shape a received gradient has). In a split-backward schedule, `weights` is the
    W part: the weight-gradient work B deferred ([Note: split backward]). On a rank that
    offloads, `holders` are weak references to the `SavedTensor`s F packed
    ([Note: host offload])."""

    root: torch.Tensor
    out_meta: TensorMeta | None
    weights: WeightGrads | None = None
    holders: list | None = None


class BufferTable:
    """`held` maps (buf, stage, mb) to the buffer: a tensor, the data-loader input, or
    the stash record."""

    def __init__(self, ledger: Ledger):
        self.held: dict[Key, Any] = {}
        self.ledger = ledger

    def __len__(self) -> int:
        return len(self.held)

    def need(self, buf: str, i: Instr, other: int | None = None):
        """The buffer `buf` of i's (stage, mb) (of the edge to peer stage `other`, as
        `buffer_key` takes it), which instruction i uses."""
        key = (buf, i.stage, i.mb) if other is None else (buf, i.stage, i.mb, other)  # `buffer_key`, inlined
        try:
            return self.held[key]
        except KeyError:
            raise RuntimeScheduleError(
                f"{i} needs {describe_key(key)}, which is not held (never produced, or already freed)"
            ) from None

    def add(self, key: Key, value, nbytes: int, hosted: int = 0) -> None:
        if key in self.held:
            raise RuntimeScheduleError(f"{describe_key(key)} produced twice")
        self.held[key] = value
        self.ledger.add(key, nbytes, hosted)

    def resize(self, key: Key, nbytes: int) -> None:
        """A held buffer now holds `nbytes` (the stash after B of a split backward)."""
        if key not in self.held:
            raise RuntimeScheduleError(f"{describe_key(key)} resized but not held")
        self.ledger.resize(key, nbytes)

    def drop(self, key: Key):
        """Removes the buffer at its FREE and returns it."""
        if key not in self.held:
            raise RuntimeScheduleError(
                f"FREE of {describe_key(key)}, which is not held (never produced, or freed twice)"
            )
        self.ledger.release(key)
        return self.held.pop(key)

    def check_empty(self) -> None:
        if self.held:
            def order(key):
                return key[:3] + ((-1,) if len(key) == 3 else key[3:])
            left = ", ".join(f"{k[0]}({k[1]}, {k[2]}{'' if len(k) == 3 else f', peer stage {k[3]}'})"
                             for k in sorted(self.held, key=order))
            raise RuntimeScheduleError(f"buffers still held at the end of the step (never freed): {left}")
