"""Shapes of the tensors that cross stage boundaries, and their one-time exchange.

[Note: first-use metadata] A receiver allocates each receive before posting it, so it
must know the shape and dtype of every stage output it receives. They are given up
front (`shapes=`), or the sender publishes them at its first F of the stage (through
the transport's store, not the point-to-point channel, so the order in which messages
match is never disturbed) and the receiver looks them up once. Until a shape is known,
the receiver posts the rest of its batch at once: all its sends, and each peer's
receives that come before the first unknown one from that peer; the unknown receive and
the later ones from the same peer (the channel delivers in order) wait, and as soon as
the shape of any peer's first waiting receive arrives, that peer's receives up to its
next unknown one are posted, until none waits. So each receive is posted no later than
its send: the sender runs the F that publishes the shape before it can send the
tensor, and every earlier message of the channel was sent (its shape published) before
it. A batch therefore completes once all its partners are posted, as rule 4 has it,
and a schedule that completes under rule 4 also completes here. (Waiting for every
unknown shape before posting any of them could hang: on a stage graph one batch may
receive from one peer the outputs of two stages, the second of which the peer computes
only after this batch's first receive has met its send.) Only the first step pays
this (a few posts instead of one, one store lookup per boundary); `shapes=` removes it.
Every later microbatch must have the same shapes: each send is checked (`check`).

A boundary is named by its producing stage on a chain, and by its edge (producer stage,
consumer stage) on any other stage graph ([Note: stage graph] in compiler/graph.py),
where a stage sends a tensor of its own to each consumer.
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


def boundary_name(boundary) -> str:
    """A boundary in words: "stage 2's output", "stage 0's output for stage 2"."""
    if isinstance(boundary, tuple):
        return f"stage {boundary[0]}'s output for stage {boundary[1]}"
    return f"stage {boundary}'s output"


def _store_name(boundary) -> str:
    return f"{boundary[0]}-{boundary[1]}" if isinstance(boundary, tuple) else str(boundary)


class _Published(Pending):
    """Ready once the shape of any of `boundaries` is published; `values` holds each
    one found, by boundary."""

    def __init__(self, transport: Transport, keys: dict):
        self.transport, self.keys, self.values = transport, keys, {}
        names = " or ".join(boundary_name(b) for b in keys)
        self.what = f"the shape of {names}, which its rank publishes at its first F of that stage"

    def ready(self) -> bool:
        for boundary, key in self.keys.items():
            if boundary not in self.values:
                value = self.transport.lookup(key)
                if value is not None:
                    self.values[boundary] = value
        return bool(self.values)


class Shapes:
    """The `TensorMeta` of each boundary tensor this rank sends or receives, by boundary:
    its producing stage, or its edge on a stage graph ([Note: first-use metadata]). One
    per executor: its keys live under a namespace the transport hands out in creation
    order."""

    def __init__(self, transport: Transport, given: Mapping | None = None):
        self.transport = transport
        self.given: dict = dict(given or {})  # `shapes=`, which ranks compare at the first step
        self.known: dict = dict(self.given)
        self.namespace = transport.namespace()

    def __contains__(self, boundary) -> bool:
        return boundary in self.known

    def __getitem__(self, boundary) -> TensorMeta:
        return self.known[boundary]

    def publish(self, boundary, output: torch.Tensor) -> TensorMeta:
        """At F of a stage whose output leaves the rank: the first one sets the shape.
        Returns the boundary's meta."""
        meta = self.known.get(boundary)
        if meta is None:
            meta = self.known[boundary] = TensorMeta.of(output)
            self.transport.publish(f"{self.namespace}meta/{_store_name(boundary)}", meta.encode())
        return meta

    def learn(self, *boundaries):
        """Generator: yields a `Pending` until the shape of at least one of `boundaries` is
        published, then records each one that is."""
        published = _Published(self.transport, {b: f"{self.namespace}meta/{_store_name(b)}" for b in boundaries})
        if not published.ready():
            yield published
        for boundary, value in published.values.items():
            self.known[boundary] = TensorMeta.decode(value)

    @staticmethod
    def check(instr, tensor: torch.Tensor, expected: TensorMeta | None, receiver: str) -> None:
        """Raises unless `tensor`, sent by `instr`, has the shape its receiver allocates."""
        if expected is not None and not expected.matches(tensor):
            raise RuntimeScheduleError(
                f"{instr} sends {describe(tensor)} for microbatch {instr.mb}, but rank {instr.peer} ({receiver}) "
                f"receives {expected} (from shapes=, or from the first microbatch)"
            )
