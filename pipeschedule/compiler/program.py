"""Programs stored packed: one rank's instructions as two columns of ints.

[Note: packed programs] A lowered schedule at pp=64, v=2, m=512 holds 717k instructions,
and the passes that build, check and simulate it ran mostly on making and reading `Instr`
objects. Yet an instruction is fixed by its op, stage, peer and buf but for its
microbatch, and a schedule has few such combinations (under 1,500 there, each used once
per microbatch). A `Program` stores each combination once, as a `Template`, in a table
shared by every rank of the schedule, and each instruction as two ints: the index of its
template (`ids`) and its microbatch (`mbs`). The passes that run once per instruction
(lowering, the verifier's walk, the simulator) read the columns and look up, by template,
what they worked out once per template: where its stage runs, which buffers it makes,
what it costs. Nothing else needs to know: a `Program` is a sequence of `Instr` that
compares equal to, and hashes as, the tuple of the same instructions, which it builds on
the first use of an element and keeps. `packed` gives any schedule's programs as one
table and columns, packing tuples of `Instr` where it has to.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple, Sequence

from pipeschedule.checks import shown
from pipeschedule.compiler.gcpause import gc_paused
from pipeschedule.compiler.instr import Instr, Op, make_instr
from pipeschedule.errors import FormatError, ScheduleError


class Template(NamedTuple):
    """An instruction less its microbatch: `Template(op, stage, peer, buf, peer_stage).instr(mb)`."""

    op: Op
    stage: int
    peer: int | None
    buf: str | None
    peer_stage: int | None = None  # [Note: peer stage] in instr.py

    def instr(self, mb: int) -> Instr:
        return make_instr(self.op, self.stage, mb, self.peer, self.buf, self.peer_stage)


class Program(Sequence):
    """One rank's instructions, packed ([Note: packed programs]): instruction k is
    `templates[ids[k]].instr(mbs[k])`.

    Built by the compiler's own passes from templates of checked instructions, as
    `make_instr` is (`Templates.program` builds one; nothing is checked here). `ids` and
    `mbs` are tuples of ints of one length, every id an index of `templates`, each
    template once in `templates`; a `Schedule` given Programs checks all of that
    (`check_programs`).
    """

    __slots__ = ("templates", "ids", "mbs", "_instrs", "_used")

    def __init__(self, templates: tuple[Template, ...], ids: tuple[int, ...], mbs: tuple[int, ...]) -> None:
        self.templates, self.ids, self.mbs = templates, ids, mbs
        self._instrs: tuple[Instr, ...] | None = None
        self._used: frozenset[int] | None = None

    @property
    def used(self) -> frozenset[int]:
        """The ids of the templates this program uses (found once, on first use): the
        verifier and the simulator look at each once per rank."""
        if self._used is None:
            self._used = frozenset(self.ids)
        return self._used

    @property
    def ops(self) -> frozenset[Op]:
        """The ops of its instructions (from the templates in use)."""
        return frozenset(self.templates[k].op for k in self.used)

    @property
    def instrs(self) -> tuple[Instr, ...]:
        """The instructions as a tuple (built once, on first use)."""
        if self._instrs is None:
            self._instrs = _built(self.templates, self.used, self.ids, self.mbs)
        return self._instrs

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index):
        return self.instrs[index]  # a slice gives a tuple, as a tuple's slice does

    def __iter__(self) -> Iterator[Instr]:
        return iter(self.instrs)

    def __contains__(self, instr) -> bool:
        return instr in self.instrs

    def __eq__(self, other) -> bool:
        if isinstance(other, Program):
            if other.templates is self.templates:
                return self.ids == other.ids and self.mbs == other.mbs
            return self.instrs == other.instrs
        if isinstance(other, tuple):
            return self.instrs == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.instrs)

    def __add__(self, other):  # as the tuple would: a tuple
        return self.instrs + tuple(other) if isinstance(other, (tuple, Program)) else NotImplemented

    def __radd__(self, other):
        return other + self.instrs if isinstance(other, tuple) else NotImplemented

    def __repr__(self) -> str:
        return repr(self.instrs)

    def __reduce__(self):
        return Program, (self.templates, self.ids, self.mbs)


@gc_paused  # many objects, none in a cycle (gcpause.py): half the time with the collector running
def _built(templates, used, ids, mbs) -> tuple[Instr, ...]:
    """`templates[ids[k]].instr(mbs[k])` for every k, as a tuple. `used`: the ids in `ids`
    (a table may be far larger than what one program uses: pp=20000 has 220k templates)."""
    rows = {k: tuple(templates[k]) for k in used}  # a plain tuple unpacks faster than a NamedTuple's fields read
    out = []
    add = out.append
    for k, mb in zip(ids, mbs):
        op, stage, peer, buf, other = rows[k]
        add(make_instr(op, stage, mb, peer, buf, other))
    return tuple(out)


class Templates:
    """A template table being built: `id(op, stage, peer, buf, peer_stage)` numbers each distinct
    template in the order first asked for; `program(ids, mbs)` packs columns against the
    table as it stands (`frozen()`), so build every template first."""

    def __init__(self, templates: Sequence[Template] = ()) -> None:
        """`templates`: a table to extend, of checked templates (a Program's)."""
        self.list: list[Template] = list(templates)
        self._index: dict[tuple, int] = {t: k for k, t in enumerate(self.list)}
        self._frozen: tuple[Template, ...] | None = None
        if len(self._index) != len(self.list):
            raise FormatError("a template table holds each template once")

    def id(self, op: Op, stage: int, peer: int | None = None, buf: str | None = None,
           peer_stage: int | None = None) -> int:
        """The id of the template; `peer_stage` as [Note: peer stage] writes it (None for
        the neighbour), so that an instruction has one template."""
        key = (op, stage, peer, buf, peer_stage)  # hashes and compares as the Template it stands for
        found = self._index.get(key)
        if found is None:
            checked = Instr(op, stage, 0, peer, buf, peer_stage)  # an instruction less its mb: checked as one
            if checked.peer_stage != peer_stage:
                raise FormatError(f"peer_stage {peer_stage} of {checked} is the neighbour, written None")
            found = self._index[key] = len(self.list)
            self.list.append(Template(checked.op, stage, peer, buf, peer_stage))
            self._frozen = None
        return found

    def frozen(self) -> tuple[Template, ...]:
        """The table as a tuple: the same object until a new template is added."""
        if self._frozen is None:
            self._frozen = tuple(self.list)
        return self._frozen

    def program(self, ids, mbs) -> Program:
        return Program(self.frozen(), tuple(ids), tuple(mbs))

    def pack(self, program: Sequence[Instr]) -> tuple[list[int], list[int]]:
        """(ids, mbs) of `program`, a Program (of any table) or a sequence of `Instr`."""
        if type(program) is Program:  # its templates in use, not its whole table (which may serve many ranks)
            remap = {k: self.id(*program.templates[k]) for k in sorted(program.used)}
            return [remap[k] for k in program.ids], list(program.mbs)
        index, ids, mbs = self._index, [], []
        for i in program:
            key = (i.op, i.stage, i.peer, i.buf, i.peer_stage)
            found = index.get(key)
            ids.append(self.id(*key) if found is None else found)
            mbs.append(i.mb)
        return ids, mbs


def check_programs(programs: Sequence[Program]) -> None:
    """Raises FormatError unless every Program here is one a pass could have built: each
    table's templates those of instructions (checked as `Instr`s are), each once; ids
    that index the table; microbatches integers >= 0, one per id."""
    tables = {}
    for program in programs:
        tables[id(program.templates)] = program.templates
    for templates in tables.values():
        if not isinstance(templates, tuple) or len(set(templates)) != len(templates):
            raise FormatError("a Program's templates must be a tuple holding each template once")
        for t in templates:
            if type(t) is not Template or not _checked(t):
                raise FormatError(f"{shown(t)} is not the template of an instruction (op an Op, as Templates.id "
                                  "makes them)")
    for program in programs:
        ids, mbs = program.ids, program.mbs
        if type(ids) is not tuple or type(mbs) is not tuple or len(ids) != len(mbs):
            raise FormatError(f"a Program's ids and mbs must be tuples of one length, got {len(ids)} and {len(mbs)}")
        count = len(program.templates)
        if ids and (set(map(type, ids)) != {int} or not 0 <= min(program.used) <= max(program.used) < count):
            raise FormatError(f"a Program's ids must index its {count} templates")
        if mbs and (set(map(type, mbs)) != {int} or min(mbs) < 0):
            raise FormatError("a Program's microbatches must be integers >= 0")


def _checked(t: Template) -> bool:
    """Whether `t` is written as `Templates.id` writes it: checked as an `Instr`, its op an
    `Op`, a neighbour peer_stage None ([Note: peer stage])."""
    instr = Instr(t.op, t.stage, 0, t.peer, t.buf, t.peer_stage)
    return instr.op is t.op and instr.peer_stage == t.peer_stage


def check_stages(num_stages: int, templates, ids_by_rank, mbs_by_rank) -> None:
    """Raises ScheduleError (rule coverage) for an instruction of a stage outside
    0..num_stages-1, the first in rank and program order, with its own rank, step and mb.
    A table may hold templates no program uses: those are never reported."""
    beyond = {k for k, t in enumerate(templates) if t.stage >= num_stages}
    for rank, ids in enumerate(ids_by_rank):
        if beyond.isdisjoint(ids):
            continue
        index = next(index for index, k in enumerate(ids) if k in beyond)
        instr = templates[ids[index]].instr(mbs_by_rank[rank][index])
        raise ScheduleError(f"rule coverage: rank {rank}, step {index}, instruction {instr}: stage {instr.stage} "
                            f"belongs to no rank (there are {num_stages} stages)",
                            rule="coverage", rank=rank, index=index, instr=instr, mb=instr.mb)


def used_ids(programs: Sequence[Sequence[Instr]], ids_by_rank) -> list:
    """Per rank, the template ids of `packed(programs)`'s columns `ids_by_rank` that its
    program uses: a Program's own set where those are its own columns, else found."""
    return [p.used if type(p) is Program and p.ids is ids else set(ids) for p, ids in zip(programs, ids_by_rank)]


def instructions(program: Sequence[Instr]) -> tuple[Instr, ...]:
    """A program's instructions as a tuple (a `Program`'s own, built once), for code that
    indexes a program many times: a tuple's index is a C call, a Program's a Python one."""
    return program.instrs if type(program) is Program else tuple(program)


def packed(programs: Sequence[Sequence[Instr]]) -> tuple[tuple[Template, ...], list, list]:
    """`programs` as (one template table, each program's ids, each program's mbs): the
    programs' own columns when all are `Program`s of one table, else packed afresh."""
    first = programs[0] if programs else None
    if type(first) is Program and all(type(p) is Program and p.templates is first.templates for p in programs):
        return first.templates, [p.ids for p in programs], [p.mbs for p in programs]
    table = Templates()
    columns = [table.pack(p) for p in programs]
    return table.frozen(), [ids for ids, _ in columns], [mbs for _, mbs in columns]
