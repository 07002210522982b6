"""Read and write PyTorch's pipeline schedule CSV (`torch.distributed.pipelining`).

PyTorch writes one row per rank and one action per cell (`_dump_csv`, `_load_csv` in
`torch/distributed/pipelining/schedules.py`), in two forms:

    compute_only    0F0,0F1,,,4F0,4B0,...          F, B (full backward), I, W
    compute_comms   0F0,0SEND_F0,4RECV_F0,...      the same plus SEND_F, RECV_F, SEND_B,
                                                   RECV_B, and its FSDP/DP bookkeeping

A cell is `<stage><type><microbatch>`; the stage is the global stage index, as in our IR.
Communication cells name the stage on the rank that holds them: `1SEND_F0` sends the
output of (1, 0) and `2RECV_F0` receives the input of (2, 0), exactly like our
SEND_F / RECV_F. PyTorch has no FREE and no peer, so:

- the placement is inferred from the row in which each stage's compute appears
  (pp = number of rows, virtual = stages / pp);
- a communication's peer is the rank of the neighbouring stage
  (SEND_F, RECV_B of s: placement[s + 1]; RECV_F, SEND_B of s: placement[s - 1]);
- FREE is added by `passes.add_frees` when a compute_comms file is read, and dropped
  when one is written.

[Note: torch cells] How each kind of cell is read:

    ""                           skipped: PyTorch writes None (an idle step) as an empty cell
    F, SEND_F, RECV_F,           our op of the same name
      SEND_B, RECV_B
    B                            our B; in a schedule that also has W cells, our B then W
                                 (a full backward is the input half followed by the weight
                                 half, which is what PyTorch's `_merge_bw` folds back)
    I (backward input)           our B, in a schedule that has W (split backward)
    W (backward weight)          our W
    (a;b)OVERLAP_F_B             its sub-actions a, b in order (the overlap hint is lost)
    UNSHARD, RESHARD,            skipped: FSDP parameter gathering and the data-parallel
      REDUCE_GRAD                gradient reduction, which PyTorch's lowering adds; they
                                 move no pipeline tensor, and our runtime does DP sync itself

Anything else raises FormatError naming the cell, its rank and column, and the accepted
forms. Row r is rank r (column and row numbers in messages count from 1).

[Note: REDUCE_GRAD] PyTorch's runtime (`_PipelineScheduleRuntime`) scales a stage's
gradients by 1/m (`scale_grads`, on by default) and runs its data-parallel reduction
only at that stage's `<stage>REDUCE_GRAD` action; its backwards accumulate unscaled
gradients. Reading a compute_only file, PyTorch's own lowering adds the action
(`_add_reduce_grad`: after the action that brings the stage's count of B and W cells to
m, i.e. its last full backward, or its last W under a split backward, and after the
sends its `_add_send_recv` then puts right after that action); a compute_comms file is
run as written. So `write_csv(form="compute_comms")` writes it in that same place, after
the run of communication that follows the stage's last backward, and a file without it
trains with gradients m times too large.

[Note: CSV form] PyTorch's files have no header, so the form is read from the content:
a file is compute_comms when it holds a message cell (SEND_F, RECV_F, SEND_B, RECV_B)
or FSDP bookkeeping (UNSHARD, RESHARD), which PyTorch's lowering adds and only its
compute_comms form carries; otherwise it is compute_only (REDUCE_GRAD alone decides
nothing: PyTorch's compute-only 1F1B order has it too). A file that needs no message
(one rank, say) is the same program in both forms: read as compute_only and lowered, or
as compute_comms with FREE added, it gives the same instructions.
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Iterable

from pipeschedule.compiler import passes
from pipeschedule.errors import FormatError
from pipeschedule.compiler.effects import BACKWARD, EFFECTS, covered_ops
from pipeschedule.compiler.ir import COMM_OPS, COMPUTE_OPS, Instr, Op, Schedule
from pipeschedule.checks import MAX_STAGES, check_at_most, check_schedule_size

FORMS = ("compute_only", "compute_comms")

# Our ops by their PyTorch action ([Note: instruction effects] in effects.py: a row's `torch`),
# and PyTorch's name of a backward that leaves the weight gradients to a W (ours: B).
_BY_NAME = {row.torch: op for op, row in EFFECTS.items() if row.torch is not None}
_INPUT_ONLY = {"B": "I"}
_COMPUTE_TYPES = frozenset(name for name, op in _BY_NAME.items() if op in COMPUTE_OPS) | frozenset(
    _INPUT_ONLY.values())
_COMM_TYPES = frozenset(name for name, op in _BY_NAME.items() if op in COMM_OPS)
_PIPELINE_TYPES = tuple(sorted(_COMPUTE_TYPES, key=("F", "B", "I", "W").index)) + tuple(
    name for name in ("SEND_F", "RECV_F", "SEND_B", "RECV_B") if name in _COMM_TYPES)
_SKIPPED_TYPES = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
_LOWERED_ONLY_TYPES = frozenset({"UNSHARD", "RESHARD"})  # [Note: CSV form]

# Matched whole (fullmatch), so `1F` or `1F0x` are refused where PyTorch's own
# `_action_regex.match` would read a prefix.
_CELL = re.compile(
    r"([0-9]+)(SEND_F|RECV_F|SEND_B|RECV_B|REDUCE_GRAD|UNSHARD|RESHARD|F|B|I|W)([0-9]*)"
)
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")
_MAX_DIGITS = 12  # a stage or microbatch index beyond 10**12 is corruption, not a schedule

ACCEPTED = (
    "accepted cells: <stage><type><microbatch> with type in "
    + ", ".join(_PIPELINE_TYPES)
    + " (e.g. 0F1, 1I0, 2RECV_F0); <stage>UNSHARD, <stage>RESHARD, <stage>REDUCE_GRAD"
    " (skipped); (a;b)OVERLAP_F_B (expanded); empty cells (skipped)"
)


# -- reading ---------------------------------------------------------------------------


class _Cell:
    """One pipeline action read from the CSV, with where it came from (for messages)."""

    __slots__ = ("kind", "stage", "mb", "rank", "column", "text")

    def __init__(self, kind: str, stage: int, mb: int | None, rank: int, column: int, text: str):
        self.kind, self.stage, self.mb = kind, stage, mb
        self.rank, self.column, self.text = rank, column, text

    def where(self) -> str:
        return _where(self.text, self.rank, self.column)


def _where(text: str, rank: int, column: int) -> str:
    shown = text if len(text) <= 40 else text[:37] + "..."
    return f"cell {shown!r} at rank {rank} (row {rank + 1}), column {column + 1}"


def _number(digits: str, what: str, cell: str, rank: int, column: int) -> int:
    if len(digits) > _MAX_DIGITS:
        raise FormatError(f"{_where(cell, rank, column)}: {what} {digits[:20]}... has more than {_MAX_DIGITS} digits")
    return int(digits)


def _parse_action(text: str, rank: int, column: int, cell: str) -> _Cell:
    """One action `text` of the cell `cell` (they differ inside OVERLAP_F_B)."""
    match = _CELL.fullmatch(text)
    if match is None:
        raise FormatError(f"{_where(cell, rank, column)}: cannot read {text[:40]!r}; {ACCEPTED}")
    stage_digits, kind, mb_digits = match.groups()
    stage = _number(stage_digits, "stage", cell, rank, column)
    if mb_digits:
        mb = _number(mb_digits, "microbatch", cell, rank, column)
    elif kind in _SKIPPED_TYPES:
        mb = None
    else:
        raise FormatError(
            f"{_where(cell, rank, column)}: {kind} needs a microbatch index (e.g. {stage}{kind}0); {ACCEPTED}"
        )
    return _Cell(kind, stage, mb, rank, column, text)


def _parse_cell(raw: str, rank: int, column: int) -> list[_Cell]:
    """The actions of one cell: none for an empty cell, several for OVERLAP_F_B."""
    text = raw.strip()
    if not text:
        return []
    overlap = _OVERLAP.fullmatch(text)
    if overlap is None:
        return [_parse_action(text, rank, column, text)]
    cells = [_parse_action(part.strip(), rank, column, text) for part in overlap.group(1).split(";")]
    for cell in cells:
        if cell.kind not in _COMPUTE_TYPES:
            raise FormatError(
                f"{_where(text, rank, column)}: OVERLAP_F_B may only hold F, B, I and W actions, got {cell.text!r}"
            )
    return cells


def _read_rows(text: str) -> list[list[str]]:
    if not isinstance(text, str):
        raise FormatError(f"CSV text must be a string, got {type(text).__name__}")
    try:
        rows = list(csv.reader(io.StringIO(text, newline="")))
    except csv.Error as err:
        raise FormatError(f"not a readable CSV: {err}") from None
    # Blank lines at the end are an editor's, not ranks; a rank with no actions is
    # written as `""` (see write_csv) so it survives this.
    while rows and not rows[-1]:
        rows.pop()
    if not rows:
        raise FormatError("the CSV has no rows; expected one row of actions per rank")
    return rows


def _infer_placement(cells: Iterable[_Cell], pp: int) -> tuple[int, ...]:
    """Rank of every stage, from the row where its compute appears."""
    owner: dict[int, _Cell] = {}
    for cell in cells:
        if cell.kind not in _COMPUTE_TYPES:
            continue
        first = owner.setdefault(cell.stage, cell)
        if first.rank != cell.rank:
            raise FormatError(
                f"stage {cell.stage} runs on two ranks: {first.where()} and {cell.where()}"
            )
    if not owner:
        raise FormatError("the CSV holds no compute action (F, B, I or W)")
    num_stages = max(owner) + 1
    check_at_most("stages (1 + the largest stage of a compute cell)", num_stages, MAX_STAGES,
                  FormatError)  # [Note: size limits], before looping over them
    missing = [s for s in range(num_stages) if s not in owner]
    if missing:
        raise FormatError(
            f"stages {missing[:10]} have no compute action, but stage {num_stages - 1} does; "
            f"every stage 0..{num_stages - 1} must appear"
        )
    if num_stages % pp:
        raise FormatError(
            f"{num_stages} stages over {pp} rows (ranks): stages / ranks = {num_stages}/{pp} "
            f"is not an integer number of virtual chunks"
        )
    return tuple(owner[s].rank for s in range(num_stages))


def _peer(cell: _Cell, placement: tuple[int, ...]) -> int:
    """The rank at the other end of a communication cell ([Note: torch cells])."""
    neighbour = cell.stage + 1 if cell.kind in ("SEND_F", "RECV_B") else cell.stage - 1
    if not 0 <= neighbour < len(placement):
        raise FormatError(
            f"{cell.where()}: stage {cell.stage} has no stage {neighbour} to "
            f"{'send to' if cell.kind.startswith('SEND') else 'receive from'}"
        )
    peer = placement[neighbour]
    if peer == cell.rank:
        raise FormatError(
            f"{cell.where()}: stages {cell.stage} and {neighbour} both run on rank {peer}, "
            f"so no communication is needed between them"
        )
    return peer


def _to_instrs(cell: _Cell, split: bool, placement: tuple[int, ...]) -> list[Instr]:
    kind = cell.kind
    if kind == "B" and split:  # a full backward in a split schedule: input half, then weight half
        return [Instr(Op.B, cell.stage, cell.mb), Instr(Op.W, cell.stage, cell.mb)]
    if kind in _INPUT_ONLY.values():  # PyTorch's input half of a backward: our B of a split one
        kind = next(name for name, half in _INPUT_ONLY.items() if half == kind)
    if kind in _COMM_TYPES:
        return [Instr(_BY_NAME[kind], cell.stage, cell.mb, peer=_peer(cell, placement))]
    if kind in _BY_NAME:
        return [Instr(_BY_NAME[kind], cell.stage, cell.mb)]
    return []  # UNSHARD, RESHARD, REDUCE_GRAD: [Note: torch cells]


def read_csv(text: str, *, name: str = "torch_csv", form: str | None = None) -> Schedule:
    """A Schedule from PyTorch's schedule CSV text.

    `form` None detects the form from the content ([Note: CSV form], `form_of`).
    compute_only gives a compute-only schedule (make it runnable with `passes.lower`);
    compute_comms keeps the communication as written and adds FREE (`passes.add_frees`).
    Raises FormatError naming the offending cell, rank and column.
    """
    if form is not None and form not in FORMS:
        raise FormatError(f"form must be one of {', '.join(FORMS)} or None, got {form!r}")
    rows = _read_rows(text)
    pp = len(rows)
    grid = [[c for column, raw in enumerate(row) for c in _parse_cell(raw, rank, column)]
            for rank, row in enumerate(rows)]
    cells = [c for row in grid for c in row]
    placement = _infer_placement(cells, pp)

    for cell in cells:
        if cell.stage >= len(placement):
            raise FormatError(f"{cell.where()}: stage {cell.stage} has no compute anywhere in the file")
        if placement[cell.stage] != cell.rank:
            raise FormatError(
                f"{cell.where()}: stage {cell.stage} runs on rank {placement[cell.stage]} "
                f"(where its compute is), not on rank {cell.rank}"
            )

    kinds = {c.kind for c in cells}
    has_comms = bool(kinds & _COMM_TYPES)
    if form is None:
        form = form_of(kinds)
    if form == "compute_only" and has_comms:
        first = next(c for c in cells if c.kind in _COMM_TYPES)
        raise FormatError(f"{first.where()}: a compute_only CSV holds no communication")
    split = "W" in kinds
    if "I" in kinds and not split:
        first = next(c for c in cells if c.kind == "I")
        raise FormatError(
            f"{first.where()}: I (backward input) needs the W (backward weight) cells of a "
            f"split backward, and this CSV has none; write B for a full backward"
        )

    mbs = {c.mb for c in cells if c.kind not in _SKIPPED_TYPES}
    microbatches = max(mbs) + 1
    check_schedule_size(pp, len(placement) // pp, microbatches, FormatError)  # [Note: size limits]
    if len(mbs) != microbatches:
        missing = sorted(set(range(microbatches)) - mbs)
        raise FormatError(
            f"microbatches {missing[:10]} appear in no cell, but microbatch {microbatches - 1} "
            f"does; every microbatch 0..{microbatches - 1} must appear"
        )

    programs = [[i for c in row for i in _to_instrs(c, split, placement)] for row in grid]
    schedule = Schedule(name, pp, len(placement) // pp, microbatches, placement, programs, {})
    if form == "compute_comms":
        return passes.add_frees(schedule)
    return schedule


def form_of(kinds) -> str:
    """The form of a file whose cells are of these kinds ([Note: CSV form])."""
    return "compute_comms" if set(kinds) & (_COMM_TYPES | _LOWERED_ONLY_TYPES) else "compute_only"


def load_csv(path: str, *, form: str | None = None) -> Schedule:
    """`read_csv` of a file; the schedule is named after the file. Raises FormatError."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as handle:  # a byte-order mark is skipped
            text = handle.read()
    except (OSError, UnicodeDecodeError, ValueError) as err:  # ValueError: NUL in path
        raise FormatError(f"cannot read {path!r}: {err}") from None
    name = os.path.splitext(os.path.basename(str(path)))[0] or "torch_csv"
    return read_csv(text, name=name, form=form)


# -- writing ---------------------------------------------------------------------------


def is_compute_comms(schedule: Schedule) -> bool:
    """Whether the schedule already holds communication instructions."""
    return any(i.op in COMM_OPS for program in schedule.programs for i in program)


def _cell(instr: Instr, split: bool) -> str:
    name = EFFECTS[instr.op].torch
    if split:
        name = _INPUT_ONLY.get(name, name)
    return f"{instr.stage}{name}{instr.mb}"


def write_csv(schedule: Schedule, *, form: str = "compute_only") -> str:
    """PyTorch's CSV text of a schedule: one row per rank, as `csv.writer` writes it.

    compute_only keeps F, B, W (B is written `I` when the schedule has W); compute_comms
    also keeps SEND_F, RECV_F, SEND_B, RECV_B, adding them with
    `passes.add_communication` when the schedule holds compute only, and writes each
    stage's `REDUCE_GRAD` after its last backward ([Note: REDUCE_GRAD]). FREE, OFFLOAD
    and RELOAD are always dropped (PyTorch has no such actions). A schedule whose stage
    graph is not the chain is refused ([Note: stage graph] in graph.py): PyTorch's
    stages talk to their neighbours only.
    """
    if form not in FORMS:
        raise FormatError(f"form must be one of {', '.join(FORMS)}, got {form!r}")
    if not schedule.is_chain:  # a cell names a stage and a microbatch, never the stage at the other end
        raise FormatError(f"PyTorch's CSV has no way to say an edge between stages that are not neighbours; "
                          f"{schedule.name!r} has the stage graph {[list(e) for e in schedule.edges]} (write it as "
                          "pipeschedule JSON or text instead)")
    compute_only = all(i.op in COMPUTE_OPS for program in schedule.programs for i in program)
    if form == "compute_comms" and compute_only:
        schedule = passes.add_communication(schedule)
    comms = form == "compute_comms"
    keep = frozenset(op for op in COMPUTE_OPS | (COMM_OPS if comms else frozenset()) if EFFECTS[op].torch)
    split = schedule.split_backward
    # what PyTorch counts to m ([Note: REDUCE_GRAD]): the last compute of the backward, W or B (none without one)
    reduced = next((op for op in reversed(covered_ops(schedule)) if EFFECTS[op].phase == BACKWARD), None)
    out = io.StringIO()
    writer = csv.writer(out)
    for program in schedule.programs:
        row: list[str] = []
        counts: dict[int, int] = {}
        pending: list[str] = []  # REDUCE_GRAD waiting for the current run of communication to end
        for i in program:
            if i.op not in keep:
                continue
            if pending and i.op not in COMM_OPS:
                row += pending
                pending = []
            row.append(_cell(i, split))
            if comms and i.op is reduced:
                counts[i.stage] = counts.get(i.stage, 0) + 1
                if counts[i.stage] == schedule.microbatches:
                    pending.append(f"{i.stage}REDUCE_GRAD")
        row += pending
        writer.writerow(row or [""])  # `""`, not a blank line: a rank with no actions
    return out.getvalue()


def dump_csv(schedule: Schedule, path: str, *, form: str = "compute_only") -> None:
    """Writes `write_csv(schedule, form=form)` to `path`."""
    text = write_csv(schedule, form=form)
    with open(path, "w", encoding="utf-8", newline="") as handle:
        handle.write(text)

