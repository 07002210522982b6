"""Shapes of the tensors that cross stage boundaries, and their one-time exchange.

[Note: first-use metadata] A receiver allocates each receive before posting it, so it
must know the shape and dtype of every stage output it receives. They are given up
front (`shapes=`), or the sender publishes them at its first F of the stage (through
the transport's store, not the point-to-point channel, so the order in which messages
match is never disturbed) and the receiver looks them up once. Until a shape is known,
the receiver posts the rest of its batch at once: all its sends, and each peer's
receives that come before the first unknown one from that peer; the unknown receive and
the later ones from the same peer (the channel delivers in order) are posted as a
second batch when the shape arrives. Whatever the sender needs from this rank before
its F is thus posted, and the sender runs that F before it can send the tensor, so a
schedule that completes under rule 4 also completes here. Only the first step pays
this (two posts instead of one, one store lookup per stage); `shapes=` removes it.
Every later microbatch must have the same shapes: each send is checked (`check`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from pipeschedule.errors import RuntimeScheduleError
from pipeschedule.runtime.transport import Pending, Transport


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and requires_grad of a boundary tensor (a stage's output)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = True

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorMeta:
        return TensorMeta(tuple(tensor.shape), tensor.dtype, tensor.requires_grad)

    def matches(self, tensor: torch.Tensor) -> bool:
        return tensor.shape == self.shape and tensor.dtype == self.dtype

    def encode(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}|{','.join(map(str, self.shape))}|{int(self.requires_grad)}"

    @staticmethod
    def decode(text: str) -> TensorMeta:
        dtype, shape, grad = text.split("|")
        return TensorMeta(tuple(int(n) for n in shape.split(",") if n), getattr(torch, dtype), grad == "1")

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


def describe(tensor: torch.Tensor) -> str:
    return str(TensorMeta.of(tensor))


class _Published(Pending):
    def __init__(self, transport: Transport, key: str, stage: int):
        self.transport, self.key, self.value = transport, key, None
        self.what = f"the shape of stage {stage}'s output, which its rank publishes at its first F of that stage"

    def ready(self) -> bool:
        self.value = self.value or self.transport.lookup(self.key)
        return self.value is not None


class Shapes:
    """The `TensorMeta` of each stage output this rank sends or receives, by producing
    stage ([Note: first-use metadata]). One per executor: its keys live under a
    namespace the transport hands out in creation order."""

    def __init__(self, transport: Transport, given: Mapping[int, TensorMeta] | None = None):
        self.transport = transport
        self.given: dict[int, TensorMeta] = dict(given or {})  # `shapes=`, which ranks compare at the first step
        self.known: dict[int, TensorMeta] = dict(self.given)
        self.namespace = transport.namespace()

    def __contains__(self, stage: int) -> bool:
        return stage in self.known

    def __getitem__(self, stage: int) -> TensorMeta:
        return self.known[stage]

    def publish(self, stage: int, output: torch.Tensor) -> TensorMeta:
        """At F of a stage whose output leaves the rank: the first one sets the shape.
        Returns the stage's meta."""
        meta = self.known.get(stage)
        if meta is None:
            meta = self.known[stage] = TensorMeta.of(output)
            self.transport.publish(f"{self.namespace}meta/{stage}", meta.encode())
        return meta

    def learn(self, stage: int):
        """Generator: yields a `Pending` until stage's output shape is published, then records it."""
        published = _Published(self.transport, f"{self.namespace}meta/{stage}", stage)
        if not published.ready():
            yield published
        self.known[stage] = TensorMeta.decode(published.value)

    @staticmethod
    def check(instr, tensor: torch.Tensor, expected: TensorMeta | None, receiver: str) -> None:
        """Raises unless `tensor`, sent by `instr`, has the shape its receiver allocates."""
        if expected is not None and not expected.matches(tensor):
            raise RuntimeScheduleError(
                f"{instr} sends {describe(tensor)} for microbatch {instr.mb}, but rank {instr.peer} ({receiver}) "
                f"receives {expected} (from shapes=, or from the first microbatch)"
            )
