"""The IR: schedules, with their JSON and text forms; instructions (instr.py) and
programs (program.py) are re-exported from here.

A schedule has `pp` ranks, `virtual` chunks per rank, `S = pp * virtual` stages and `m`
microbatches. `placement[s]` is the rank that runs stage s. Each rank has a program: a
sequence of `Instr` (a tuple, or a `Program`, which stores the same instructions packed:
[Note: packed programs] in program.py). Stages are numbered globally (0 .. S-1); an
instruction on rank r always names a stage that rank r runs ("local" stage).
Communication instructions also name the peer rank. The buffers each (stage, mb) owns
are in [Note: buffers] (instr.py). A schedule's stage graph (`edges`) says which stage
consumes which stage's output: the chain unless given ([Note: stage graph] in graph.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from pipeschedule.checks import check_schedule_size, is_int, shown
from pipeschedule.compiler.effects import covered_ops, keys_of
from pipeschedule.compiler.instr import (
    BUF_OPS, BUFFERS, COMM_OPS, COMPUTE_OPS, RECV_OPS, SEND_OPS, Instr, Op, make_instr,
)
from pipeschedule.compiler.graph import StageGraph
from pipeschedule.compiler.program import Program, Template, Templates, check_programs, packed
from pipeschedule.errors import FormatError

FORMAT = "pipeschedule/1"



@dataclass(frozen=True)
class Schedule:
    """A whole pipeline schedule: one program per rank plus the facts they share.

    `params` holds the generator's parameters (for example `{"cap": [2, 2, 2, 1]}`);
    it is informational except `cap`, which the verifier enforces (rule 6).

    `forward_only` marks an evaluation schedule: forwards only, no B or W, nothing kept
    for a backward (`passes.forward_only` builds one; [Note: forward-only schedules] in
    verify.py says which rules apply). It is part of the value: written in the JSON and
    text forms (only when true), compared by ==.

    `edges` is the stage graph ([Note: stage graph] in graph.py): (producer stage,
    consumer stage) pairs, None for the chain. It is stored sorted, as given or as the
    chain's, so that a chain given explicitly is the same value as the default; the
    JSON and text forms write it only when it is not the chain.

    `split_backward` and `graph` are not given: `split_backward` is found from the
    programs on construction (True when some rank runs a W), `graph` from `edges`, so
    both are the same for every equal schedule. Nothing else is ever stored on a
    schedule: whatever a function needs beyond these fields (the cost a lowering times
    the order with, say) is one of its arguments.
    """

    name: str
    pp: int
    virtual: int
    microbatches: int
    placement: tuple[int, ...]
    programs: tuple[Sequence[Instr], ...]  # each a tuple of Instr or a Program
    params: Mapping[str, Any] = field(default_factory=dict, hash=False)
    forward_only: bool = False
    edges: tuple[tuple[int, int], ...] | None = None
    split_backward: bool = field(init=False, repr=False, compare=False)
    graph: StageGraph = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise FormatError(f"name must be a string, got {shown(self.name)}")
        for key in ("pp", "virtual", "microbatches"):
            value = getattr(self, key)
            if not is_int(value) or value < 1:
                raise FormatError(f"{key} must be an integer >= 1, got {shown(value)}")
        check_schedule_size(self.pp, self.virtual, self.microbatches, FormatError)  # [Note: size limits]
        placement = tuple(self.placement)
        if len(placement) != self.pp * self.virtual:
            raise FormatError(
                f"placement has {len(placement)} entries; pp*virtual = {self.pp}*{self.virtual} = "
                f"{self.pp * self.virtual} are needed"
            )
        for s, rank in enumerate(placement):
            if not is_int(rank) or not 0 <= rank < self.pp:
                raise FormatError(f"placement[{s}] = {shown(rank)} is not a rank in 0..{self.pp - 1}")
        programs = tuple(p if type(p) is Program else tuple(p) for p in self.programs)
        if len(programs) != self.pp:
            raise FormatError(f"schedule has {len(programs)} programs; pp = {self.pp} are needed")
        split = False
        W = Op.W  # a local: Op.W costs about 80 ns per instruction here
        check_programs([p for p in programs if type(p) is Program])
        for rank, program in enumerate(programs):
            if type(program) is Program:  # checked above, a template for many instructions
                split = split or W in program.ops
                continue
            for instr in program:
                if type(instr) is not Instr and not isinstance(instr, Instr):
                    raise FormatError(f"rank {rank}: {shown(instr)} is not an instruction")
                if instr.op is W:
                    split = True
        if not isinstance(self.params, Mapping):
            raise FormatError(f"params must be an object, got {shown(self.params)}")
        if not isinstance(self.forward_only, bool):
            raise FormatError(f"forward_only must be true or false, got {shown(self.forward_only)}")
        graph = StageGraph.of(self.pp * self.virtual, self.edges)
        # The declared fields, normalised (a frozen dataclass sets them this way).
        object.__setattr__(self, "placement", placement)
        object.__setattr__(self, "programs", programs)
        object.__setattr__(self, "params", dict(self.params))
        object.__setattr__(self, "edges", graph.edges)
        object.__setattr__(self, "split_backward", split)
        object.__setattr__(self, "graph", graph)

    # -- structure ---------------------------------------------------------------------

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual

    def stages_of(self, rank: int) -> list[int]:
        """The stages rank `rank` runs, in increasing order."""
        return [s for s, r in enumerate(self.placement) if r == rank]

    @property
    def is_chain(self) -> bool:
        """Whether the stage graph is the chain (s, s+1) ([Note: stage graph])."""
        return self.graph.chain

    def remote_consumers(self, stage: int) -> tuple[int, ...]:
        """The stages that consume stage's output on another rank (one SEND_F each)."""
        return self.graph.consumers_on_other_ranks(stage, self.placement)

    def remote_producers(self, stage: int) -> tuple[int, ...]:
        """The stages whose output stage consumes from another rank (one RECV_F each)."""
        return self.graph.producers_on_other_ranks(stage, self.placement)

    def sends_forward(self, stage: int) -> bool:
        """Whether some of stage's output travels to another rank (so it has an `act_out`)."""
        return bool(self.remote_consumers(stage))

    def recvs_forward(self, stage: int) -> bool:
        return bool(self.remote_producers(stage))

    def sends_backward(self, stage: int) -> bool:
        """Whether some of stage's input gradient travels to another rank (so it has a `grad_in`)."""
        return self.recvs_forward(stage)

    def recvs_backward(self, stage: int) -> bool:
        return self.sends_forward(stage)

    def buffers(self, stage: int) -> tuple[str, ...]:
        """The kinds of buffer a (stage, mb) owns, each once; see [Note: buffers]. A
        forward-only schedule has no gradients. `buffer_keys` names each one."""
        return tuple(dict.fromkeys(buf for buf, _ in self.buffer_keys(stage)))

    def buffer_keys(self, stage: int) -> tuple[tuple[str, int | None], ...]:
        """Every buffer a (stage, mb) owns as (buf, peer_stage), peer_stage as an
        instruction writes it ([Note: peer stage]: None for the neighbour, and for stage
        0's act_in), in the order of [Note: buffers]: act_in per producer, act_out per
        remote consumer, stash, grad_out per consumer, grad_in per remote producer. They
        are the buffers of this stage that its computes make or read ([Note: instruction
        effects] in effects.py)."""
        found: dict = {}
        for op in covered_ops(self):
            made, read, _, _ = keys_of(self, op, stage)
            found.update((key, None) for key in made + read if key[1] == stage)
        order = {buf: k for k, buf in enumerate(BUFFERS)}
        return tuple((buf, other) for buf, _, other in sorted(found, key=lambda key: order[key[0]]))

    def caps(self) -> list[int] | None:
        """Per-rank in-flight caps from params, or None when uncapped."""
        cap = self.params.get("cap")
        if cap is None:
            return None
        if is_int(cap):
            return [cap] * self.pp
        if isinstance(cap, (list, tuple)) and len(cap) == self.pp and all(is_int(c) for c in cap):
            return list(cap)
        raise FormatError(f"params.cap must be an integer or a list of {self.pp} integers, got {shown(cap)}")

    def replace_programs(self, programs: Iterable[Sequence[Instr]]) -> Schedule:
        return Schedule(
            self.name, self.pp, self.virtual, self.microbatches, self.placement,
            tuple(programs), dict(self.params), self.forward_only, self.edges,
        )

    def with_edges(self, edges) -> Schedule:
        """The same programs on the stage graph `edges` (None: the chain)."""
        return Schedule(
            self.name, self.pp, self.virtual, self.microbatches, self.placement,
            self.programs, dict(self.params), self.forward_only, edges,
        )

    def _with_trusted_programs(self, programs: tuple[Sequence[Instr], ...]) -> Schedule:
        """`replace_programs` without the checks of construction, for the lowering passes.

        Only for programs that hold `self`'s own (already checked) instructions plus
        instructions a pass built itself (with `make_instr`, or as `Program`s of templates
        of checked instructions), each a tuple or a `Program`, and no new W (so
        `split_backward` carries over). Checking every instruction again cost
        about 0.08 s per pass at pp=64, v=2, m=512. It sets exactly the declared fields.
        """
        twin = object.__new__(Schedule)
        twin.__dict__.update(
            name=self.name, pp=self.pp, virtual=self.virtual, microbatches=self.microbatches,
            placement=self.placement, programs=programs, params=dict(self.params),
            forward_only=self.forward_only, edges=self.edges, split_backward=self.split_backward,
            graph=self.graph,
        )
        return twin

    # -- JSON form ---------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "name": self.name,
            "pp": self.pp,
            "virtual": self.virtual,
            "microbatches": self.microbatches,
            "params": dict(self.params),
            **({"forward_only": True} if self.forward_only else {}),
            "placement": list(self.placement),
            **({} if self.is_chain else {"edges": [list(e) for e in self.edges]}),
            "programs": [[i.to_dict() for i in program] for program in self.programs],
        }

    def to_json(self, indent: int | None = None) -> str:
        if indent is None:
            # One instruction per line keeps files diffable without being huge.
            head = {k: v for k, v in self.to_dict().items() if k != "programs"}
            lines = [json.dumps(head)[:-1] + ', "programs": [']
            for r, body in enumerate(_written(self.programs, lambda i: json.dumps(i.to_dict()), ",\n    ")):
                lines.append("  [\n    " + body + "\n  ]" + ("," if r + 1 < self.pp else ""))
            lines.append("]}")
            return "\n".join(lines) + "\n"
        return json.dumps(self.to_dict(), indent=indent)

    @staticmethod
    def from_dict(obj: Any) -> Schedule:
        if not isinstance(obj, dict):
            raise FormatError(f"a schedule must be a JSON object, got {type(obj).__name__}")
        if obj.get("format") != FORMAT:
            raise FormatError(f"format must be {shown(FORMAT)}, got {shown(obj.get('format'))}")
        required = ("name", "pp", "virtual", "microbatches", "placement", "programs")
        missing = [k for k in required if k not in obj]
        if missing:
            raise FormatError(f"schedule lacks fields {missing}")
        unknown = set(obj) - set(required) - {"format", "params", "forward_only", "edges"}
        if unknown:
            raise FormatError(f"schedule has unknown fields {sorted(unknown)}")
        if not isinstance(obj["placement"], list):
            raise FormatError(f"placement must be a list, got {shown(obj['placement'])}")
        if not isinstance(obj["programs"], list) or not all(isinstance(p, list) for p in obj["programs"]):
            raise FormatError("programs must be a list (one per rank) of lists of instructions")
        params = obj.get("params", {})
        if not isinstance(params, dict):
            raise FormatError(f"params must be an object, got {shown(params)}")
        schedule = Schedule(
            obj["name"], obj["pp"], obj["virtual"], obj["microbatches"], tuple(obj["placement"]),
            _read_programs(obj["programs"]), params,
            obj.get("forward_only", False), _edges_of(obj.get("edges")),
        )
        schedule.caps()  # validates the cap's shape early
        return schedule

    @staticmethod
    def from_json(text: str) -> Schedule:
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError) as err:  # ValueError: also ints over 4300 digits
            raise FormatError(f"not valid JSON: {err}") from None
        return Schedule.from_dict(obj)

    # -- text form ---------------------------------------------------------------------

    def to_text(self) -> str:
        lines = [
            FORMAT,
            f"name: {json.dumps(self.name)}",
            f"pp: {self.pp}",
            f"virtual: {self.virtual}",
            f"microbatches: {self.microbatches}",
            f"placement: {json.dumps(list(self.placement))}",
            f"params: {json.dumps(dict(self.params), sort_keys=True)}",
        ] + (["forward_only: true"] if self.forward_only else []) + (
            [] if self.is_chain else [f"edges: {json.dumps([list(e) for e in self.edges])}"])
        for r, body in enumerate(_written(self.programs, str, " ")):
            lines.append(f"rank {r}: " + body)
        return "\n".join(lines) + "\n"

    @staticmethod
    def from_text(text: str) -> Schedule:
        if not isinstance(text, str):
            raise FormatError("schedule text must be a string")
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines or lines[0].strip() != FORMAT:
            raise FormatError(f"schedule text must start with the line {shown(FORMAT)}")
        head: dict[str, Any] = {"format": FORMAT}
        programs: dict[int, list[dict]] = {}
        for line in lines[1:]:
            key, sep, value = line.partition(":")
            if not sep:
                raise FormatError(f"cannot read line {shown(line)}; expected 'key: value' or 'rank N: ...'")
            key = key.strip()
            if key.startswith("rank "):
                index = key[5:].strip()
                if not re.fullmatch(r"[0-9]{1,9}", index) or int(index) >= len(lines):
                    raise FormatError(f"bad rank number in {line[:60]!r}: ranks count from 0, one line each")
                if int(index) in programs:
                    raise FormatError(f"rank {int(index)} has two lines; each rank's program is one line")
                programs[int(index)] = [Instr.parse(t).to_dict() for t in value.split()]
            elif key in ("name", "pp", "virtual", "microbatches", "placement", "params", "forward_only", "edges"):
                if key in head:
                    raise FormatError(f"{shown(key)} is given twice; each key once")
                try:
                    head[key] = json.loads(value)
                except (ValueError, RecursionError) as err:
                    raise FormatError(f"bad value for {shown(key)}: {err}") from None
            else:
                raise FormatError(f"unknown key {shown(key)} in schedule text")
        head["programs"] = [programs.get(r, []) for r in range(max(programs, default=-1) + 1)]
        return Schedule.from_dict(head)


# An mb no schedule reaches (past MAX_DIGITS digits' worth of stages and peers too), put
# where the mb goes and replaced: what each template's text is cut at.
_MB_MARK = 987654321987654321987


def _written(programs, text, sep: str) -> list[str]:
    """Each program's instructions as `text(instr)` gives them, joined by `sep`, written
    once per template ([Note: packed programs]) and per instruction only the mb filled
    in: `text` of an instruction is its template's text around the decimal mb (which is
    how `Instr.to_dict` with `json.dumps`, and `str`, write it)."""
    templates, ids_by_rank, mbs_by_rank = packed(programs)
    used = set().union(*map(set, ids_by_rank)) if ids_by_rank else set()
    forms = {}
    for k in used:
        head, mark, tail = text(templates[k].instr(_MB_MARK)).partition(str(_MB_MARK))
        forms[k] = (head.replace("%", "%%") + "%d" + tail.replace("%", "%%")) if mark else None
    if any(form is None for form in forms.values()):  # a text that does not write the mb as decimal digits
        return [sep.join(text(i) for i in program) for program in programs]
    return [sep.join([forms[k] % mb for k, mb in zip(ids, mbs)]) for ids, mbs in zip(ids_by_rank, mbs_by_rank)]


_FIELDS = frozenset({"op", "stage", "mb", "peer", "buf", "peer_stage"})


def _read_programs(programs: list) -> tuple[Program, ...]:
    """The JSON form's programs (lists of instruction objects) as `Program`s of one table
    ([Note: packed programs]). Each instruction is read as `Instr.from_dict` reads it, and
    refused with its message, once per template: an object whose fields but its mb are
    those of one read before (the same values of the same types, no other field) and
    whose mb is an integer >= 0 takes that one's template without being read again."""
    table, known, columns = Templates(), {}, []
    for program in programs:
        ids, mbs = [], []
        for obj in program:
            try:
                peer, peer_stage = obj.get("peer"), obj.get("peer_stage")
                key = (obj["op"], obj["stage"], peer, obj.get("buf"), peer_stage, type(obj["stage"]), type(peer),
                       type(peer_stage))
                found, mb = known.get(key), obj["mb"]
            except (AttributeError, KeyError, TypeError):  # not an object, a field missing, a value unhashable
                key = found = None
            if found is None or type(mb) is not int or mb < 0 or not obj.keys() <= _FIELDS:
                instr = Instr.from_dict(obj)
                found, mb = table.id(instr.op, instr.stage, instr.peer, instr.buf, instr.peer_stage), instr.mb
                if key is not None:
                    known[key] = found
            ids.append(found)
            mbs.append(mb)
        columns.append((ids, mbs))
    return tuple(table.program(ids, mbs) for ids, mbs in columns)


def edge_end(stage: int, other: int) -> int | None:
    """`other`, the stage at the other end of an edge of `stage`, as an instruction's
    `peer_stage` writes it: None for a neighbour ([Note: peer stage])."""
    return None if other == stage + 1 or other == stage - 1 else other


def _edges_of(value):
    """The JSON value of "edges" as Schedule takes it (None when absent: the chain)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise FormatError(f"edges must be a list of [producer stage, consumer stage] pairs, got {shown(value)}")
    return value


def load(path: str) -> Schedule:
    """Read a schedule from a JSON (`.json`) or text file; raises FormatError."""
    try:
        with open(path, encoding="utf-8-sig") as handle:  # a byte-order mark is skipped
            text = handle.read()
    except (OSError, ValueError) as err:  # ValueError: undecodable bytes, NUL in the path
        raise FormatError(f"cannot read {shown(path)}: {err}") from None
    if text.lstrip().startswith("{"):
        return Schedule.from_json(text)
    return Schedule.from_text(text)


def dump(schedule: Schedule, path: str) -> None:
    """Write a schedule as JSON (or the text form when the path ends in `.txt`)."""
    text = schedule.to_text() if str(path).endswith(".txt") else schedule.to_json()
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


__all__ = [
    "BUF_OPS", "BUFFERS", "COMM_OPS", "COMPUTE_OPS", "FORMAT", "RECV_OPS", "SEND_OPS", "Instr", "Op", "Program",
    "Schedule", "StageGraph", "Template", "dump", "edge_end", "load", "make_instr",
]
