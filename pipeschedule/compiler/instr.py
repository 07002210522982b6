"""Instructions: `Instr`, one instruction of a rank's program, with its text form. The
op codes (`Op`) and what each op does are in effects.py ([Note: instruction effects]).

Text form of one instruction (PyTorch style, extended so that it round-trips):

    1F3            forward of stage 1, microbatch 3
    1SEND_F3@2     send the output of (1, 3) to rank 2
    1FREE3:stash   release the stash of (1, 3)
    0SEND_F3@2>2   send the output of (0, 3) to rank 2, for stage 2 (an edge that skips
                   a stage: [Note: stage graph] in graph.py)
    2FREE3<0:act_in  release the act_in of (2, 3) that came from stage 0

[Note: buffers] Each (stage, mb) owns up to five buffers:

    act_in    input activation     produced by RECV_F, by F(s-1) when s-1 runs on the
                                   same rank (local hand-off), or by the data loader at F
                                   on stage 0; used by F and B
    act_out   output activation    produced by F; used by SEND_F. Exists only where the
                                   next stage runs on another rank.
    stash     saved for backward   produced by F; used by B (and W when split)
    grad_out  gradient of output   produced by RECV_B, or by B(s+1) on the same rank;
                                   used by B. Not on the last stage (the loss is there).
    grad_in   gradient of input    produced by B; used by SEND_B. Exists only where the
                                   previous stage runs on another rank.

In a schedule whose stage graph is not the chain ([Note: stage graph] in graph.py),
act_in and grad_in of a stage exist once per producer, act_out and grad_out once per
consumer (act_out and grad_in only where the stage at the other end runs on another
rank), each produced and freed on its own: a buffer of an edge is named by its (stage,
mb) and `peer_stage`, the stage at the other end. Stage 0's act_in (the data loader's)
has none.

[Note: peer stage] `peer_stage` is the stage at the other end of the edge a message or
buffer belongs to: the consumer for SEND_F, RECV_B, act_out and grad_out, the producer
for RECV_F, SEND_B, act_in and grad_in. None stands for the neighbour (stage + 1, or
stage - 1), and the checked constructor writes the neighbour as None, so that there is
one form of each instruction and a chain schedule's instructions are those it always
had. In the text form it follows the peer rank as `>t` (a later stage) or `<s` (an
earlier one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pipeschedule.checks import is_int, shown
from pipeschedule.compiler.effects import (  # noqa: F401  (re-exported: an op and its row live in effects.py)
    BUF_OPS, BUFFERS, COMM_OPS, COMPUTE_OPS, RECV_OPS, SEND_OPS, Op, edge_side,
)
from pipeschedule.errors import FormatError


@dataclass(frozen=True, slots=True)
class Instr:
    """One instruction of a rank's program.

    `peer` is set exactly for communication ops, `buf` exactly for the ops that name a
    buffer (FREE, OFFLOAD, RELOAD: `BUF_OPS`, [Note: instruction effects]);
    `peer_stage` may be set where the instruction belongs to an edge, and is None for the
    neighbour stage ([Note: peer stage]).
    """

    op: Op
    stage: int
    mb: int
    peer: int | None = None
    buf: str | None = None
    peer_stage: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.op, Op):
            try:
                object.__setattr__(self, "op", Op(self.op))
            except ValueError:
                raise FormatError(
                    f"unknown op {shown(self.op)}; accepted: {', '.join(o.value for o in Op)}"
                ) from None
        for name in ("stage", "mb"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise FormatError(f"instruction {name} must be an integer >= 0, got {shown(value)}")
        if self.op in COMM_OPS:
            if not is_int(self.peer) or self.peer < 0:
                raise FormatError(f"{self.op.value} needs a peer rank (integer >= 0), got {shown(self.peer)}")
        elif self.peer is not None:
            raise FormatError(f"{self.op.value} takes no peer, got peer={shown(self.peer)}")
        if self.op in BUF_OPS:
            if self.buf not in BUFFERS:
                raise FormatError(f"{self.op.value} needs buf in {', '.join(BUFFERS)}, got {shown(self.buf)}")
        elif self.buf is not None:
            raise FormatError(f"{self.op.value} takes no buf, got buf={shown(self.buf)}")
        if self.peer_stage is not None:
            self._check_peer_stage()

    def _check_peer_stage(self) -> None:
        """[Note: peer stage]: on the right side of the stage; the neighbour becomes None."""
        side, other = edge_side(self.op, self.buf), self.peer_stage
        what = f"{self.op.value}" + (f" of {self.buf}" if self.buf is not None else "")
        if side == 0:
            raise FormatError(f"{what} belongs to no edge and takes no peer_stage, got peer_stage={shown(other)}")
        if not is_int(other) or other < 0 or (other - self.stage) * side <= 0:
            where = "after" if side > 0 else "before"
            raise FormatError(f"{what} of stage {self.stage} needs a peer_stage {where} it (the stage at the other "
                              f"end of its edge), got {shown(other)}")
        if other == self.stage + side:
            object.__setattr__(self, "peer_stage", None)

    def __str__(self) -> str:
        text = f"{self.stage}{self.op.value}{self.mb}"
        if self.peer is not None:
            text += f"@{self.peer}"
        if self.peer_stage is not None:
            text += f"{'>' if self.peer_stage > self.stage else '<'}{self.peer_stage}"
        if self.buf is not None:
            text += f":{self.buf}"
        return text

    @staticmethod
    def parse(token: str) -> Instr:
        """Inverse of `str()`: `Instr.parse(str(i)) == i`."""
        if not isinstance(token, str):
            raise FormatError(f"instruction token must be a string, got {shown(token)}")
        match = _TOKEN.match(token.strip())
        if match is None:
            raise FormatError(
                f"cannot parse instruction {shown(token)}; expected forms like 1F3, 1SEND_F3@2, 1FREE3:stash, "
                "0SEND_F3@2>2"
            )
        stage, op, mb, peer, arrow, other, buf = match.groups()
        instr = Instr(Op(op), int(stage), int(mb), int(peer) if peer is not None else None, buf,
                      int(other) if other is not None else None)
        if arrow is not None and (arrow == ">") != (int(other) > int(stage)):
            raise FormatError(f"{shown(token)}: '{arrow}{other}' says stage {other} is "
                              f"{'after' if arrow == '>' else 'before'} stage {stage}")
        return instr

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": self.op.value, "stage": self.stage, "mb": self.mb}
        if self.peer is not None:
            out["peer"] = self.peer
        if self.buf is not None:
            out["buf"] = self.buf
        if self.peer_stage is not None:
            out["peer_stage"] = self.peer_stage
        return out

    @staticmethod
    def from_dict(obj: Any) -> Instr:
        if not isinstance(obj, dict):
            raise FormatError(f"instruction must be an object, got {shown(obj)}")
        unknown = set(obj) - {"op", "stage", "mb", "peer", "buf", "peer_stage"}
        if unknown:
            raise FormatError(f"instruction {shown(obj)} has unknown fields {sorted(unknown)}")
        for key in ("op", "stage", "mb"):
            if key not in obj:
                raise FormatError(f"instruction {shown(obj)} lacks field {shown(key)}")
        if not isinstance(obj["op"], str):
            raise FormatError(f"instruction op must be a string, got {shown(obj['op'])}")
        return Instr(obj["op"], obj["stage"], obj["mb"], obj.get("peer"), obj.get("buf"), obj.get("peer_stage"))


class _UncheckedInstr:
    """`make_instr(op, stage, mb, peer=None, buf=None, peer_stage=None)`: an `Instr` built without
    validation, for the compiler's own trusted code paths (about four times faster than
    the checked constructor; loaders use the checked one). Its caller writes a neighbour
    `peer_stage` as None ([Note: peer stage]), as the checked one would.

    An object with Instr's very slots, filled by plain attribute stores, that then
    becomes an Instr by `__class__` assignment (which Python allows between classes of
    the same slot layout; the result is an ordinary Instr). A packed program builds its
    instructions with it (717k at pp=64, v=2, m=512); setting Instr's frozen slots
    through their descriptors took 0.30 us each against 0.21 us this way.
    `make_instr` is the class itself, not a function calling it: one Python call less
    per instruction."""

    __slots__ = Instr.__slots__

    def __init__(self, op, stage, mb, peer=None, buf=None, peer_stage=None) -> None:
        self.op = op
        self.stage = stage
        self.mb = mb
        self.peer = peer
        self.buf = buf
        self.peer_stage = peer_stage
        self.__class__ = Instr


make_instr = _UncheckedInstr


# Every op's code, the longest first (SEND_F before F): an op's text form comes with its member of `Op`.
_OPS = "|".join(sorted((op.value for op in Op), key=len, reverse=True))
_TOKEN = re.compile(
    rf"^([0-9]{{1,18}})({_OPS})([0-9]{{1,18}})(?:@([0-9]{{1,18}}))?(?:([<>])([0-9]{{1,18}}))?(?::([a-z_]+))?$"
)
