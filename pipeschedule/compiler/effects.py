"""The ops of instructions and what each one does: one row per op (`EFFECTS`), which every
interpreter reads ([Note: instruction effects], [Note: interpreters]).

[Note: instruction effects] An op is its member of `Op` and its row in `EFFECTS`:
- `kind`: COMPUTE runs its stage and takes its time; SEND and RECV are the two sides of
  a message, and a maximal run of them on a rank is one batch (rule 4); COPY moves its
  buffer between device and host asynchronously; INSTANT takes no time and is no
  message (FREE).
- the buffers it makes, reads and frees, and the one it moves (`moves_to` says where),
  each written as a role that `keys_of` resolves for one instruction of a schedule:
  * a buffer kind of [Note: buffers] in instr.py (`BUFFERS`). For a message it is the
    buffer of the message's own edge. For any other op it is one buffer per edge of the
    stage on the kind's side (`SIDE`: act_in and grad_in per producer, act_out and
    grad_out per consumer, the stash none); a kind that is sent (`HANDED`: act_out,
    grad_in) toward a stage on the same rank is that stage's receive buffer instead
    (act_in, grad_out: the local hand-off), and a stage with no producer has one act_in,
    the data loader's (`LOADED`);
  * NAMED: the buffer the instruction names (`Instr.buf`; the op then needs one);
  * LOADER: the data loader's act_in, made by F on a stage with no producer.
  An instruction makes its buffers, then reads, then frees (the order the rules check
  them in; errors name the first that fails). Reading needs the buffer live on the
  device; a FREE takes either copy; a move to the host needs it on the device, one to
  the device needs it on the host ([Note: offload liveness] in verify.py).
- `phase`: forward or backward (a forward-only schedule holds no backward op), or None.
- `order` and `needed`: a compute with an order runs once per (stage, mb), in increasing
  order, F before B before W (rule coverage), where the schedule needs it ("always",
  "training": not in a forward-only schedule, "split": where the schedule has W).
- `inflight`: what it adds to its rank's (stage, mb) in flight (rule cap): +1 F, -1 B.
- `time`: the `CostModel` field its time is read from (compute). A message takes the
  time of its bytes (those of the buffer it sends), a copy that of its buffer over the
  host link, an INSTANT op none.
- `releases_stash`: autograd frees the stash's saved tensors as it runs (B): a streamed
  stash comes back piece by piece during it, and in a split backward what W still needs
  is all the stash holds after it (`CostModel.weight_stash`).
- `label`: its mark on the ASCII timeline; `torch`: its action in PyTorch's CSV (None: not
  written there).

Adding an op is its member of `Op`, its row here, one handler in the executor
(`runtime/executor.py`) and, for an op that takes time of its own, a cost rule
(`simulate/cost.py`); every other interpreter reads the row
(tests/compiler/test_effects.py adds a toy op that way, to a copy of the package, and
runs it through verify, simulate and the executor).

[Note: interpreters] What reads a program, and what each computes from the rows:
- compiler/verify.py: the six rules, one at a time, each naming its first error: the
  rows' coverage (order, needed, phase), the buffers each compute waits for (dependency),
  messages by kind (matching, deadlock), every buffer made, read, freed and moved
  (liveness), the in-flight steps (cap).
- compiler/walk.py: the same six rules in one walk over packed programs (the fast path
  `verify` runs first; tests/compiler/test_verify_walk.py pins it to the rules): the
  same facts, resolved once per template.
- compiler/passes.py: lowering; the FREE of each buffer goes right after its last reader
  (`last_readers`), the messages each compute sends (its sent buffers across ranks).
- compiler/timing.py: `asap`, when each compute can start: its time (`time`), the
  computes it waits for (`waits`: the makers of the buffers it reads, and the compute of
  the order before it).
- compiler/ir.py: the buffers a (stage, mb) owns (`Schedule.buffer_keys`); the
  instruction checks and text form (instr.py: which ops take a peer or a buffer).
- compiler/torch_csv.py: which ops PyTorch's CSV has, and their names.
- simulate/engine.py (with hostlink.py): one step in time under a cost model: bytes
  made at the start of an instruction and freed at its FREE, compute and message times,
  batches, copies, what a compute waits on the host link for; simulate/cost.py the
  times (`time`); critical_path.py the longest chain (computes by `time`, messages);
  render.py the pictures (computes, messages, copies, labels).
- plan/step_graph.py: step time and critical path of one schedule under many costs;
  plan/peaks.py: peak bytes and in-flight from program order (the simulator's bytes).
- runtime/executor.py: runs one rank's program, one handler per op, messages batched by
  kind; runtime/pool.py: the boundary buffers (those made or read across ranks) and the
  most of each kind live at once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple


class Op(str, enum.Enum):
    """Instruction kinds; the value is the short code used in the text form."""

    F = "F"
    B = "B"
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    FREE = "FREE"
    OFFLOAD = "OFFLOAD"
    RELOAD = "RELOAD"

    def __str__(self) -> str:
        return self.value

    # Enum's own __hash__ is written in Python; instructions are hashed millions of times
    # by the passes and the verifier, and a str enum hashes like its value anyway.
    __hash__ = str.__hash__


COMPUTE, SEND, RECV, COPY, INSTANT = "compute", "send", "recv", "copy", "instant"
FORWARD, BACKWARD = "forward", "backward"
NAMED, LOADER = "buf", "loader"  # roles: the buffer the instruction names; the data loader's act_in

BUFFERS = ("act_in", "act_out", "stash", "grad_out", "grad_in")
# The side of the edge a buffer of each kind belongs to: -1 a producer's, +1 a consumer's.
SIDE = {"act_in": -1, "act_out": 1, "stash": 0, "grad_out": 1, "grad_in": -1}
# A kind that a message sends -> the kind its other end receives it as (and a local hand-off makes).
HANDED = {"act_out": "act_in", "grad_in": "grad_out"}
LOADED = frozenset({"act_in"})  # kinds a stage without edges on their side still has one of


@dataclass(frozen=True)
class Effects:
    """One op's row ([Note: instruction effects])."""

    kind: str
    text: str
    makes: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    frees: tuple[str, ...] = ()
    moves_to: str | None = None  # COPY: "host" or "device", where its named buffer goes
    phase: str | None = None
    order: int | None = None
    needed: str | None = None
    inflight: int = 0
    time: str | None = None
    releases_stash: bool = False
    label: str = ""
    torch: str | None = None
    # Found from the fields above on construction (the passes read them per template):
    message: bool = field(init=False, repr=False)  # a send or a receive
    named: bool = field(init=False, repr=False)  # its instructions name a buffer (`buf`)
    buffer: str | None = field(init=False, repr=False)  # a message's: the one a send reads, a receive makes
    direct: bool = field(init=False, repr=False)  # every role is its own edge's or its named buffer

    def __post_init__(self) -> None:
        message = self.kind == SEND or self.kind == RECV
        roles = self.makes + self.reads + self.frees
        object.__setattr__(self, "message", message)
        object.__setattr__(self, "named", NAMED in roles or self.moves_to is not None)
        object.__setattr__(self, "buffer", (self.reads[0] if self.kind == SEND else self.makes[0]) if message else None)
        object.__setattr__(self, "direct", message or all(role == NAMED for role in roles))


EFFECTS: dict[Op, Effects] = {
    Op.F: Effects(COMPUTE, "forward of (stage, mb)", makes=("stash", LOADER, "act_out"), reads=("act_in",),
                  phase=FORWARD, order=0, needed="always", inflight=1, time="forward", torch="F"),
    Op.B: Effects(COMPUTE, "backward of (stage, mb): input and weight gradients (input only where a W follows)",
                  makes=("grad_in",), reads=("act_in", "stash", "grad_out"), phase=BACKWARD, order=1,
                  needed="training", inflight=-1, time="backward", releases_stash=True, label="b", torch="B"),
    Op.W: Effects(COMPUTE, "weight gradients of (stage, mb) that its B deferred", reads=("stash",),
                  phase=BACKWARD, order=2, needed="split", time="weight", label="w", torch="W"),
    Op.SEND_F: Effects(SEND, "send the output of (stage, mb) to the consumer's rank", reads=("act_out",),
                       phase=FORWARD, torch="SEND_F"),
    Op.RECV_F: Effects(RECV, "receive the input of (stage, mb) from the producer's rank", makes=("act_in",),
                       phase=FORWARD, torch="RECV_F"),
    Op.SEND_B: Effects(SEND, "send the input gradient of (stage, mb) to the producer's rank", reads=("grad_in",),
                       phase=BACKWARD, torch="SEND_B"),
    Op.RECV_B: Effects(RECV, "receive the output gradient of (stage, mb) from the consumer's rank",
                       makes=("grad_out",), phase=BACKWARD, torch="RECV_B"),
    Op.FREE: Effects(INSTANT, "release one buffer of (stage, mb), either copy", frees=(NAMED,)),
    Op.OFFLOAD: Effects(COPY, "start moving a buffer of (stage, mb) to host memory", moves_to="host"),
    Op.RELOAD: Effects(COPY, "start moving a buffer of (stage, mb) back to the device", moves_to="device"),
}

_missing = [op.value for op in Op if op not in EFFECTS]
if _missing:  # every op is defined by its row: one without is a mistake made once, here
    raise ImportError(f"ops without a row in EFFECTS: {', '.join(_missing)} ([Note: instruction effects])")


def ops_where(test) -> frozenset[Op]:
    """The ops whose row passes `test`."""
    return frozenset(op for op, row in EFFECTS.items() if test(row))


COMPUTE_OPS = ops_where(lambda row: row.kind == COMPUTE)
SEND_OPS = ops_where(lambda row: row.kind == SEND)
RECV_OPS = ops_where(lambda row: row.kind == RECV)
COMM_OPS = SEND_OPS | RECV_OPS
COPY_OPS = ops_where(lambda row: row.kind == COPY)
BUF_OPS = ops_where(lambda row: row.named)  # ops that name one buffer of (stage, mb)
BACKWARD_OPS = ops_where(lambda row: row.phase == BACKWARD)
# The computes that run once per (stage, mb), in their order (rule coverage).
COVERED = tuple(sorted((op for op, row in EFFECTS.items() if row.order is not None), key=lambda op: EFFECTS[op].order))


def edge_side(op: Op, buf: str | None) -> int:
    """+1 where the instruction's peer stage comes after its stage, -1 before, 0 where it
    names no edge (compute, the stash) ([Note: peer stage] in instr.py)."""
    row = EFFECTS[op]
    kind = row.buffer if row.message else buf if row.named else None
    return SIDE.get(kind, 0) if kind is not None else 0


def covered_ops(schedule) -> tuple[Op, ...]:
    """The computes each (stage, mb) of `schedule` runs once, in their order (rule
    coverage): F; B unless forward-only; W where the schedule splits the backward."""
    wanted = {"always": True, "training": not schedule.forward_only,
              "split": schedule.split_backward and not schedule.forward_only}
    return tuple(op for op in COVERED if wanted[EFFECTS[op].needed])


def allowed(schedule, op: Op) -> bool:
    """Whether `schedule` may hold `op` at all: no backward op in a forward-only one."""
    return not (schedule.forward_only and EFFECTS[op].phase == BACKWARD)


Key = tuple  # (buffer kind, stage, peer stage as an instruction writes it: None for the neighbour)


class Resolved(NamedTuple):
    """The buffers one instruction (less its mb) makes, reads, frees and moves, each a Key."""

    makes: tuple[Key, ...]
    reads: tuple[Key, ...]
    frees: tuple[Key, ...]
    moves: tuple[Key, ...]


def keys_of(schedule, op: Op, stage: int, peer_stage: int | None = None, buf: str | None = None) -> Resolved:
    """What an instruction of `op` at `stage` (with its `peer_stage` and `buf`, where it has
    them) does to buffers in `schedule`, its roles resolved ([Note: instruction effects]).
    `stage` must be one of the schedule's."""
    row = EFFECTS[op]
    if row.direct:  # a message's buffer, or the one named: (kind, stage, peer stage)
        return Resolved(*(tuple((buf if role == NAMED else role, stage, peer_stage) for role in roles)
                          for roles in (row.makes, row.reads, row.frees)),
                        ((buf, stage, peer_stage),) if row.moves_to is not None else ())
    graph, placement = schedule.graph, schedule.placement
    sides = (graph.producers[stage], graph.consumers[stage])  # the stages at the other end, per side (-1, +1)
    rank = placement[stage]
    return Resolved(*(_roles(roles, stage, sides, placement, rank, peer_stage, buf) if roles else ()
                      for roles in (row.makes, row.reads, row.frees)),
                    ((buf, stage, peer_stage),) if row.moves_to is not None else ())


def _roles(roles, s: int, sides, placement, rank: int, peer_stage, buf) -> tuple[Key, ...]:
    """The keys of `roles` for an instruction of a compute (or any op but a message) at
    stage s ([Note: instruction effects]): one per edge on each role's side, a sent kind
    toward a stage on the same rank as that stage's receive buffer (the hand-off); the
    peer stage of each as an instruction writes it (None for a neighbour)."""
    out: list[Key] = []
    for role in roles:
        if role == NAMED:
            out.append((buf, s, peer_stage))
            continue
        if role == LOADER:
            if not sides[0]:
                out.append(("act_in", s, None))
            continue
        side = SIDE[role]
        if side == 0:
            out.append((role, s, None))
            continue
        others = sides[side > 0]
        if not others:
            if role in LOADED:
                out.append((role, s, None))
            continue
        handed = HANDED.get(role)
        for o in others:
            if handed is not None and placement[o] == rank:
                out.append((handed, o, None if o - s == 1 or s - o == 1 else s))
            else:
                out.append((role, s, None if o - s == 1 or s - o == 1 else o))
    return tuple(out)


def _edge_end(stage: int, other: int) -> int | None:
    """`other` as an instruction's peer_stage writes it: None for a neighbour."""
    return None if other == stage + 1 or other == stage - 1 else other


def bytes_of(table, keys) -> float:
    """The bytes of the buffers `keys` ((kind, stage, peer stage) each) under `table` (kind
    -> bytes per stage, as a cost model's `buffer_bytes`), added in their order."""
    total = 0
    for kind, stage, _ in keys:
        total += table[kind][stage]
    return total


def boundary_keys(schedule) -> frozenset[Key]:
    """Every buffer a message of `schedule` sends or receives, as (kind, stage, peer stage):
    per edge between ranks, the buffer of each message op the schedule may hold on that
    edge's side (act_out and grad_out per remote consumer, act_in and grad_in per remote
    producer; the runtime's pool serves exactly these)."""
    out = set()
    sides = {EFFECTS[op].buffer: SIDE[EFFECTS[op].buffer] for op in EFFECTS if EFFECTS[op].message
             and allowed(schedule, op)}
    for s in range(schedule.num_stages):
        for kind, side in sides.items():
            others = schedule.remote_producers(s) if side < 0 else schedule.remote_consumers(s)
            out.update((kind, s, _edge_end(s, o)) for o in others)
    return frozenset(out)


def received_by(kind: str) -> Op | None:
    """The op that receives a buffer of `kind` by message (act_in: RECV_F), or None."""
    return next((op for op, row in EFFECTS.items() if row.kind == RECV and row.buffer == kind), None)


def handed_by(kind: str) -> Op | None:
    """The compute that makes a buffer of `kind` for a stage on its own rank (act_in: F of
    the producer, grad_out: B of the consumer), or None."""
    sent = next((k for k, v in HANDED.items() if v == kind), None)
    return next((op for op in COVERED if sent in EFFECTS[op].makes), None) if sent is not None else None


def first_reader(op: Op, role: str, ops) -> bool:
    """Whether `op` is the first of `ops` (in their order) that reads `role`."""
    return next((o for o in ops if role in EFFECTS[o].reads), None) is op


def maker_of(role: str, ops) -> Op | None:
    """The first of the computes `ops` that makes `role` on its own stage (the stash: F)."""
    return next((o for o in ops if role in EFFECTS[o].makes), None)


def waits(op: Op, ops) -> tuple[tuple[Op, int], ...]:
    """The computes whose end compute `op` waits for, among the covered computes `ops` (in
    their order), each as (op, side): side 0 its own stage, -1 each producer, +1 each
    consumer. For each buffer it reads, the compute that makes it: the stash's maker on
    its own stage; for a kind that arrives over an edge and that `op` reads first, the
    compute at the other end that hands it over (F of each producer for act_in, B of each
    consumer for grad_out); and the compute before it in order (W after its B). Of its
    own stage's, only the latest in order (it ended after the others): F waits for F of
    each producer, B for F and for B of each consumer, W for B."""
    out, own = [], []
    row = EFFECTS[op]
    for role in row.reads:
        if SIDE.get(role, 0) == 0:
            maker = maker_of(role, ops)
            if maker is not None and maker is not op:
                own.append(maker)
        elif first_reader(op, role, ops):
            maker = handed_by(role)
            if maker is not None and maker in ops:
                out.append((maker, SIDE[role]))
    if op in ops and ops.index(op) > 0:
        own.append(ops[ops.index(op) - 1])
    if own:
        out.insert(0, (max(own, key=ops.index), 0))
    return tuple(out)


def last_readers(schedule) -> dict[str, Op]:
    """Per buffer kind, the last of `schedule`'s covered computes (in their order) that
    reads it through its edges: where add_frees puts its FREE (act_in, stash, grad_out:
    B, or W for the stash where the backward is split, F in a forward-only schedule). A
    sent kind is read by its send alone: freed after the send's batch."""
    out: dict[str, Op] = {}
    for op in covered_ops(schedule):
        for role in EFFECTS[op].reads:
            out[role] = op
    return out


__all__ = [
    "BACKWARD", "BACKWARD_OPS", "BUFFERS", "BUF_OPS", "COMM_OPS", "COMPUTE", "COMPUTE_OPS", "COPY", "COPY_OPS",
    "COVERED", "EFFECTS", "Effects", "FORWARD", "HANDED", "INSTANT", "Key", "LOADED", "LOADER", "NAMED", "Op", "RECV",
    "RECV_OPS", "Resolved", "SEND", "SEND_OPS", "SIDE", "allowed", "boundary_keys", "bytes_of", "covered_ops",
    "edge_side", "first_reader", "handed_by", "keys_of", "last_readers", "maker_of", "ops_where", "received_by",
    "waits",
]
