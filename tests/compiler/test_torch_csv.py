"""PyTorch schedule CSV: round trips, CSVs written by PyTorch itself, errors, fuzz."""

from __future__ import annotations

import csv
import io
import os
import tempfile
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeschedule.compiler import passes, torch_csv
from pipeschedule.errors import FormatError, PipescheduleError
from pipeschedule.compiler.families import generate
from pipeschedule.compiler.ir import COMPUTE_OPS, Instr, Op, Schedule

from strategies import examples, schedule_params

FAST = settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def generated(draw):
    """A compute-only schedule of any generator family and valid parameters."""
    family, params = draw(schedule_params(max_pp=6, max_m=10, max_v=3))
    return generate(family, **params)


def compute_order(schedule: Schedule):
    return [[i for i in program if i.op in COMPUTE_OPS] for program in schedule.programs]


def without_free(schedule: Schedule):
    return [[i for i in program if i.op is not Op.FREE] for program in schedule.programs]


def same_shape(a: Schedule, b: Schedule) -> None:
    assert (a.pp, a.virtual, a.microbatches, a.placement) == (b.pp, b.virtual, b.microbatches, b.placement)


def with_weight_split(schedule: Schedule) -> Schedule:
    """The schedule with W(s, mb) right after each B(s, mb): a valid split backward."""
    programs = []
    for program in schedule.programs:
        out = []
        for i in program:
            out.append(i)
            if i.op is Op.B:
                out.append(Instr(Op.W, i.stage, i.mb))
        programs.append(out)
    return schedule.replace_programs(programs)


# -- round trips -----------------------------------------------------------------------


@FAST
@given(generated())
def test_compute_only_round_trip(schedule):
    text = torch_csv.write_csv(schedule)
    back = torch_csv.read_csv(text)
    same_shape(back, schedule)
    assert compute_order(back) == compute_order(schedule)
    assert not torch_csv.is_compute_comms(back)
    # Writing a lowered schedule in compute_only form drops its communication and FREE.
    assert torch_csv.write_csv(passes.lower(schedule)) == text


@FAST
@given(generated())
def test_compute_comms_round_trip(schedule):
    lowered = passes.lower(schedule)
    text = torch_csv.write_csv(lowered, form="compute_comms")
    assert "FREE" not in text
    # Without any SEND/RECV cell (pp=1) the text is also a compute_only CSV: say which.
    back = torch_csv.read_csv(text, form="compute_comms")
    assert torch_csv.read_csv(text).programs == (back.programs if schedule.pp > 1 else schedule.programs)
    same_shape(back, lowered)
    assert without_free(back) == without_free(lowered)
    assert back.programs == lowered.programs  # FREE comes back where add_frees puts it
    assert torch_csv.is_compute_comms(back) == (schedule.pp > 1)


@FAST
@given(generated())
def test_compute_comms_of_compute_only_schedule_lowers_first(schedule):
    assert torch_csv.write_csv(schedule, form="compute_comms") == torch_csv.write_csv(
        passes.lower(schedule), form="compute_comms"
    )


@FAST
@given(generated())
def test_split_backward_round_trip(schedule):
    split = with_weight_split(schedule)
    text = torch_csv.write_csv(split)
    assert "W" in text and "B" not in text  # B is written as I when W exists
    back = torch_csv.read_csv(text)
    assert back.split_backward
    assert compute_order(back) == compute_order(split)
    lowered = passes.lower(split)
    text = torch_csv.write_csv(lowered, form="compute_comms")
    assert torch_csv.read_csv(text, form="compute_comms").programs == lowered.programs


@FAST
@given(generated())
def test_compute_comms_reduces_each_stage_once_after_its_last_backward(schedule):
    """[Note: REDUCE_GRAD]: where PyTorch's own lowering of the compute_only form puts it."""
    rows = list(csv.reader(io.StringIO(torch_csv.write_csv(schedule, form="compute_comms"))))
    last = "W" if schedule.split_backward else "B"
    for rank, row in enumerate(rows):
        for stage in schedule.stages_of(rank):
            at = [k for k, cell in enumerate(row) if cell == f"{stage}REDUCE_GRAD"]
            assert len(at) == 1
            backward = max(k for k, cell in enumerate(row) if cell.startswith(f"{stage}{last}"))
            assert backward < at[0]
            # only the run of communication after that backward (and other stages' REDUCE_GRAD) between
            assert all(any(k in cell for k in ("SEND_", "RECV_", "REDUCE_GRAD")) for cell in row[backward + 1:at[0]])


def test_dump_and_load_file(tmp_path):
    schedule = generate("interleaved_1f1b", pp=3, microbatches=5, virtual=2)
    path = tmp_path / "sched.csv"
    torch_csv.dump_csv(schedule, str(path))
    back = torch_csv.load_csv(str(path))
    assert back.name == "sched"
    assert back.params == {}
    assert back.programs == schedule.programs
    torch_csv.dump_csv(passes.lower(schedule), str(path), form="compute_comms")
    assert torch_csv.load_csv(str(path)).programs == passes.lower(schedule).programs


def test_rank_without_actions_survives_round_trip():
    schedule = Schedule("idle", 2, 1, 1, (0, 0), ((Instr(Op.F, 0, 0), Instr(Op.F, 1, 0),
                                                  Instr(Op.B, 1, 0), Instr(Op.B, 0, 0)), ()))
    text = torch_csv.write_csv(schedule)
    assert text == '0F0,1F0,1B0,0B0\r\n""\r\n'
    back = torch_csv.read_csv(text)
    assert back.pp == 2 and back.placement == (0, 0) and back.programs == schedule.programs


# -- reading: the forms PyTorch writes -------------------------------------------------


def test_empty_cells_and_bookkeeping_are_skipped():
    text = "0UNSHARD,0F0,,0F1,0B0,0B1,0REDUCE_GRAD,0RESHARD\n"
    back = torch_csv.read_csv(text)
    assert [str(i) for i in compute_order(back)[0]] == ["0F0", "0F1", "0B0", "0B1"]
    assert (back.pp, back.virtual, back.microbatches) == (1, 1, 2)
    # UNSHARD / RESHARD come only from PyTorch's lowering: compute_comms, FREE added
    assert back == passes.lower(torch_csv.read_csv("0F0,,0F1,0B0,0B1,0REDUCE_GRAD\n"))


def test_trailing_blank_lines_and_whitespace_are_ignored():
    back = torch_csv.read_csv(" 0F0 , 0B0 \r\n 1F0,1B0\r\n\r\n\n")
    assert back.pp == 2 and back.placement == (0, 1)


def test_full_backward_in_split_schedule_becomes_b_then_w():
    back = torch_csv.read_csv("0F0,0F1,0B0,0I1,0W1\n")
    assert [str(i) for i in back.programs[0]] == ["0F0", "0F1", "0B0", "0W0", "0B1", "0W1"]


def test_overlap_f_b_is_expanded():
    text = "0F0,0F1,(0F2;0B0)OVERLAP_F_B,0B1,0B2\n"
    back = torch_csv.read_csv(text)
    assert [str(i) for i in back.programs[0]] == ["0F0", "0F1", "0F2", "0B0", "0B1", "0B2"]


def test_peers_come_from_placement():
    text = "0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n"
    back = torch_csv.read_csv(text)
    comms = [i for program in back.programs for i in program if i.peer is not None]
    assert [(str(i)) for i in comms] == ["0SEND_F0@1", "0RECV_B0@1", "1RECV_F0@0", "1SEND_B0@0"]
    assert torch_csv.is_compute_comms(back)
    assert any(i.op is Op.FREE for i in back.programs[0])  # add_frees ran


def test_explicit_forms():
    comms = "0F0,0SEND_F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n"
    with pytest.raises(FormatError, match="compute_only CSV holds no communication"):
        torch_csv.read_csv(comms, form="compute_only")
    one_rank = torch_csv.read_csv("0F0,0B0\n", form="compute_comms")
    assert [i.op for i in one_rank.programs[0]].count(Op.FREE) == 2  # act_in, stash
    with pytest.raises(FormatError, match="form must be"):
        torch_csv.read_csv("0F0,0B0\n", form="compute_comm")
    with pytest.raises(FormatError, match="form must be"):
        torch_csv.write_csv(one_rank, form="both")


# -- reading: errors -------------------------------------------------------------------

BAD = [
    ("0F0,0X1,0B0\n", r"'0X1' at rank 0 \(row 1\), column 2.*accepted cells"),
    ("0F0,F1\n", r"cannot read 'F1'"),
    ("0F0,0F\n", r"'0F'.*F needs a microbatch index"),
    ("0F0,0SEND_F\n1F0\n", r"SEND_F needs a microbatch index"),
    ("0F0,0B0\n0F1,0B1\n", r"stage 0 runs on two ranks: cell '0F0' at rank 0.*cell '0F1' at rank 1"),
    ("0F0,0B0\n1F0,1B0\n2F0,2B0\n3F0\n", None),  # placement fine, coverage is the verifier's
    ("0F0,2F0\n1F0\n", r"3 stages over 2 rows"),
    ("0F0,2F0,4F0\n1F0,3F0\n", r"5 stages over 2 rows"),
    ("0F0,2F0\n", r"stages \[1\] have no compute action"),
    ("0F0,0F2,0B0,0B2\n", r"microbatches \[1\] appear in no cell"),
    ("0F0,1SEND_F0\n1F0\n", r"'1SEND_F0' at rank 0.*stage 1 runs on rank 1"),
    ("0F0,0B0,0SEND_F0\n", r"stage 0 has no stage 1 to send to"),
    ("0F0,0RECV_F0,0B0\n", r"stage 0 has no stage -1 to receive from"),
    ("0F0,1F0,0SEND_F0,1B0,0B0\n", r"stages 0 and 1 both run on rank 0"),
    ("0F0,5UNSHARD\n", r"'5UNSHARD'.*stage 5 has no compute"),
    ("0F0,0I0\n", r"I \(backward input\) needs the W"),
    ("0F0,(0F1;0SEND_F0)OVERLAP_F_B\n", r"OVERLAP_F_B may only hold F, B, I and W"),
    ("0F0,(0F1)F\n", r"cannot read '\(0F1\)F'"),
    ("0F0,0B" + "9" * 40 + "\n", r"microbatch 9+\.\.\. has more than 12 digits"),
    ("9" * 5000 + "F0\n", r"stage 9+\.\.\. has more than 12 digits"),
    ("", r"no rows"),
    ("\n\n", r"no rows"),
    (",,\n", r"no compute action"),
    ('"0F0\n', None),  # unterminated quote: csv reads it as one cell "0F0\n"
    ("0F0,0B0" + "\x00", r"cannot read"),
]


@pytest.mark.parametrize("text, message", BAD)
def test_bad_csv_is_a_format_error(text, message):
    if message is None:
        torch_csv.read_csv(text)  # accepted: the reader reads; the verifier judges
        return
    with pytest.raises(FormatError, match=message):
        torch_csv.read_csv(text)


def test_field_over_csv_limit_is_a_format_error():
    with pytest.raises(FormatError, match="not a readable CSV"):
        torch_csv.read_csv('"' + "0" * (csv.field_size_limit() + 10) + '"\n')


def test_load_csv_errors(tmp_path):
    with pytest.raises(FormatError, match="cannot read"):
        torch_csv.load_csv(str(tmp_path / "missing.csv"))
    with pytest.raises(FormatError, match="cannot read"):
        torch_csv.load_csv(str(tmp_path))  # a directory
    with pytest.raises(FormatError, match="cannot read"):
        torch_csv.load_csv("bad\0path.csv")
    binary = tmp_path / "binary.csv"
    binary.write_bytes(b"\xff\xfe0F0")
    with pytest.raises(FormatError, match="cannot read"):
        torch_csv.load_csv(str(binary))
    with pytest.raises(FormatError, match="must be a string"):
        torch_csv.read_csv(b"0F0,0B0")


# -- CSVs written by PyTorch itself ----------------------------------------------------
#
# PyTorch's schedule classes need only these attributes of their stages to build the
# order and lower it (no process group, no module): num_stages, group_size, group_rank.
# ScheduleInterleaved1F1B computes `pipeline_order` for every rank and lowers it with
# `_add_send_recv` in its constructor; `_dump_csv` writes either form. Schedule1F1B is a
# single-stage schedule whose informational `_get_pipeline_order` is written with
# PipelineScheduleMulti's writer (plain csv.writer, one row per rank).


def _torch_schedules():
    return pytest.importorskip("torch.distributed.pipelining.schedules")


def _torch_interleaved(pp: int, virtual: int, microbatches: int):
    schedules = _torch_schedules()
    stages = [SimpleNamespace(num_stages=pp * virtual, group_size=pp, group_rank=0) for _ in range(virtual)]
    return schedules.ScheduleInterleaved1F1B(stages, microbatches)


def _torch_csv_text(torch_schedule, form: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "torch.csv")
        torch_schedule._dump_csv(path, format=form)
        with open(path, newline="") as handle:
            return handle.read()


# m a multiple of pp, m < pp, and m > pp where PyTorch's rounds divide it: PyTorch groups
# microbatches exactly as we do ([Note: interleaved groups]).
INTERLEAVED = [(2, 2, 4), (4, 2, 8), (4, 2, 12), (4, 2, 3), (2, 3, 6), (4, 3, 16), (8, 2, 16), (4, 2, 6),
               (4, 2, 10), (3, 2, 5), (4, 3, 7)]


@pytest.mark.parametrize("pp, virtual, microbatches", INTERLEAVED)
def test_reads_pytorch_interleaved_compute_only(pp, virtual, microbatches):
    text = _torch_csv_text(_torch_interleaved(pp, virtual, microbatches), "compute_only")
    assert ",," in text or pp == 1  # PyTorch pads with empty cells (None)
    back = torch_csv.read_csv(text)
    ours = generate("interleaved_1f1b", pp=pp, microbatches=microbatches, virtual=virtual)
    same_shape(back, ours)
    assert back.programs == ours.programs


@pytest.mark.parametrize("pp, virtual, microbatches", INTERLEAVED + [(4, 2, 10), (4, 2, 6)])
def test_reads_pytorch_interleaved_compute_comms(pp, virtual, microbatches):
    torch_schedule = _torch_interleaved(pp, virtual, microbatches)
    text = _torch_csv_text(torch_schedule, "compute_comms")
    assert "UNSHARD" in text and "REDUCE_GRAD" in text  # PyTorch's bookkeeping, skipped
    back = torch_csv.read_csv(text)
    compute = torch_csv.read_csv(_torch_csv_text(torch_schedule, "compute_only"))
    assert compute_order(back) == compute_order(compute)
    assert torch_csv.is_compute_comms(back)
    # Every PyTorch communication cell became one of ours, with the peer of its neighbour.
    ours = [i for program in back.programs for i in program if i.peer is not None]
    assert len(ours) == sum(text.count(k) for k in ("SEND_F", "RECV_F", "SEND_B", "RECV_B"))
    for i in ours:
        neighbour = i.stage + 1 if i.op in (Op.SEND_F, Op.RECV_B) else i.stage - 1
        assert i.peer == back.placement[neighbour]
    verify = pytest.importorskip("pipeschedule.compiler.verify").verify
    verify(back)


@pytest.mark.parametrize("pp, virtual, microbatches", [(4, 2, 8), (2, 3, 5), (3, 1, 4), (4, 2, 10)])
@pytest.mark.parametrize("form", torch_csv.FORMS)
def test_pytorch_reads_our_csv(tmp_path, pp, virtual, microbatches, form):
    """PyTorch's own loader validates our CSV (its `_validate_schedule`) and lowers it."""
    schedules = _torch_schedules()
    ours = passes.lower(generate("interleaved_1f1b", pp=pp, microbatches=microbatches, virtual=virtual))
    path = tmp_path / "ours.csv"
    torch_csv.dump_csv(ours, str(path), form=form)
    stages = [SimpleNamespace(num_stages=pp * virtual, group_size=pp, group_rank=0) for _ in range(virtual)]
    runtime = schedules._PipelineScheduleRuntime(stages, microbatches)
    runtime._load_csv(str(path), format=form)
    if form == "compute_comms":
        assert [[str(a) for a in runtime.pipeline_order_with_comms[r]] for r in range(pp)] == [
            next(csv.reader(io.StringIO(line))) for line in path.read_text().splitlines()
        ]
    else:
        assert [[str(a) for a in runtime.pipeline_order[r]] for r in range(pp)] == [
            [str(i) for i in program] for program in compute_order(ours)
        ]
    # PyTorch's dry run raises on the UNSHARD/RESHARD/REDUCE_GRAD its own lowering adds,
    # so they are left out of what it simulates.
    pipeline = {
        rank: [a for a in actions
               if a.computation_type.value in ("F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B")]
        for rank, actions in runtime.pipeline_order_with_comms.items()
    }
    schedules._simulate_comms_compute(pipeline, lambda s: runtime.stage_index_to_group_rank[s], pp * virtual)


SPLIT_FAMILIES = [
    # (class, pp, microbatches, placement is a V, has OVERLAP_F_B cells)
    ("ScheduleInterleavedZeroBubble", 4, 8, False, False),
    ("ScheduleInterleavedZeroBubble", 3, 6, False, False),
    ("ScheduleZBVZeroBubble", 4, 8, True, False),
    ("ScheduleZBVZeroBubble", 2, 4, True, False),
    ("ScheduleDualPipeV", 4, 8, True, True),
    ("ScheduleDualPipeV", 3, 6, True, True),
]


@pytest.mark.parametrize("cls, pp, microbatches, v_shape, overlap", SPLIT_FAMILIES)
def test_reads_pytorch_split_backward_families(cls, pp, microbatches, v_shape, overlap):
    """Zero-bubble and DualPipeV CSVs: I/W split backward, V placements, OVERLAP_F_B.

    These constructors also check `stage.submod` for torch.compile, hence the module."""
    schedules = _torch_schedules()
    import torch

    stages = [SimpleNamespace(num_stages=2 * pp, group_size=pp, group_rank=0, stage_index=i,
                              submod=torch.nn.Identity()) for i in range(2)]
    torch_schedule = getattr(schedules, cls)(stages, microbatches)
    compute_text = _torch_csv_text(torch_schedule, "compute_only")
    assert ("OVERLAP_F_B" in compute_text) == overlap
    compute = torch_csv.read_csv(compute_text)
    comms = torch_csv.read_csv(_torch_csv_text(torch_schedule, "compute_comms"))
    assert compute.split_backward and comms.split_backward
    forward_ranks = list(range(pp))
    expected = tuple(forward_ranks + (forward_ranks[::-1] if v_shape else forward_ranks))
    assert compute.placement == comms.placement == expected
    assert compute_order(comms) == compute_order(compute)
    verify = pytest.importorskip("pipeschedule.compiler.verify").verify
    verify(passes.lower(compute))
    verify(comms)


DEFERRED = [
    # (class, pp, microbatches, the rule PyTorch's order with defer_pp_recv=True breaks)
    ("ScheduleZBVZeroBubble", 2, 4, "matching"),
    ("ScheduleZBVZeroBubble", 4, 8, "matching"),
    ("ScheduleInterleavedZeroBubble", 2, 4, "matching"),
    ("ScheduleInterleavedZeroBubble", 4, 8, "deadlock"),
]


@pytest.mark.parametrize("cls, pp, microbatches, rule", DEFERRED)
def test_pytorch_deferred_receives_are_rejected_for_zero_bubble(cls, pp, microbatches, rule):
    """docs/pytorch.md: PyTorch's `defer_pp_recv=True` orders for interleaved zero bubble and ZB-V
    send and receive out of order between two ranks; the same schedules without it verify."""
    schedules = _torch_schedules()
    import torch

    from pipeschedule.errors import ScheduleError
    from pipeschedule.compiler.verify import verify

    def read(defer):
        stages = [SimpleNamespace(num_stages=2 * pp, group_size=pp, group_rank=0, stage_index=i,
                                  submod=torch.nn.Identity()) for i in range(2)]
        return torch_csv.read_csv(_torch_csv_text(getattr(schedules, cls)(stages, microbatches, defer_pp_recv=defer),
                                                  "compute_comms"))

    verify(read(False))
    with pytest.raises(ScheduleError) as info:
        verify(read(True))
    assert info.value.rule == rule


@pytest.mark.parametrize("pp, microbatches", [(2, 2), (4, 4), (4, 6), (3, 9)])
def test_reads_pytorch_1f1b(pp, microbatches):
    schedules = _torch_schedules()
    single = schedules.Schedule1F1B(SimpleNamespace(num_stages=pp, group_size=pp, group_rank=0), microbatches)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "1f1b.csv")
        schedules.PipelineScheduleMulti._dump_csv(SimpleNamespace(pipeline_order=single.pipeline_order), path)
        with open(path, newline="") as handle:
            text = handle.read()
    assert "REDUCE_GRAD" in text
    ours = generate("1f1b", pp=pp, microbatches=microbatches)
    # PyTorch's informational 1F1B order numbers the last rank's forwards 1..m instead of
    # 0..m-1 (its steady loop increments the microbatch before the first forward when
    # the rank has no warmup), so we compare that rank's backwards only and read the
    # rest exactly. Reading must not fail either way.
    rows = text.splitlines()
    back = torch_csv.read_csv("\n".join(rows[:-1]) + "\n" + ",".join(str(i) for i in ours.programs[-1]))
    assert back.programs == ours.programs
    last = torch_csv.read_csv(text).programs[-1]
    assert [i for i in last if i.op is Op.B] == [i for i in ours.programs[-1] if i.op is Op.B]
    forwards = [i.mb for i in last if i.op is Op.F]
    assert forwards in (list(range(microbatches)), list(range(1, microbatches + 1)))


# -- fuzz ------------------------------------------------------------------------------

_TYPES = ["F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD",
          "REDUCE_GRAD", "OVERLAP_F_B", "X", "FREE", ""]


@st.composite
def token(draw):
    stage = draw(st.sampled_from(["", "0", "1", "2", "3", "7", "01", "9" * 30]))
    kind = draw(st.sampled_from(_TYPES))
    mb = draw(st.sampled_from(["", "0", "1", "2", "5", "9" * 30]))
    text = stage + kind + mb
    if draw(st.booleans()):
        return text
    return draw(st.sampled_from([" ", "(", ")", ";", '"', "\n", "@1", ":stash"])).join([text, text])


@st.composite
def token_grid(draw):
    rows = draw(st.lists(st.lists(st.one_of(token(), st.just("")), max_size=12), min_size=0, max_size=5))
    out = io.StringIO()
    csv.writer(out).writerows(rows)
    return out.getvalue()


@st.composite
def mutated_csv(draw):
    """A valid CSV from a generator with a few cells replaced, dropped or duplicated."""
    schedule = draw(generated())
    form = draw(st.sampled_from(torch_csv.FORMS))
    rows = [row.split(",") for row in torch_csv.write_csv(schedule, form=form).splitlines()]
    for _ in range(draw(st.integers(1, 4))):
        r = draw(st.integers(0, len(rows) - 1))
        if not rows[r]:
            rows[r].append(draw(token()))
        c = draw(st.integers(0, len(rows[r]) - 1))
        action = draw(st.sampled_from(["replace", "drop", "dup", "swap_rows", "drop_row"]))
        if action == "replace":
            rows[r][c] = draw(token() | st.text(max_size=8))
        elif action == "drop":
            del rows[r][c]
        elif action == "dup":
            rows[r].insert(c, rows[r][c])
        elif action == "swap_rows":
            rows[r], rows[-1] = rows[-1], rows[r]
        elif len(rows) > 1:
            del rows[r]
    out = io.StringIO()
    csv.writer(out).writerows(rows)
    return out.getvalue()


def _read_or_format_error(text):
    try:
        schedule = torch_csv.read_csv(text)
    except PipescheduleError:
        return None
    assert isinstance(schedule, Schedule)
    # Whatever was read writes back and reads again to the same compute order.
    back = torch_csv.read_csv(torch_csv.write_csv(schedule))
    assert back.programs == tuple(tuple(p) for p in compute_order(schedule))
    return schedule


@settings(max_examples=examples(300), deadline=None)
@given(st.text())
def test_fuzz_random_text(text):
    _read_or_format_error(text)


@settings(max_examples=examples(300), deadline=None)
@given(token_grid())
def test_fuzz_random_token_grid(text):
    _read_or_format_error(text)


@settings(max_examples=examples(200), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_csv())
def test_fuzz_mutated_valid_csv(text):
    _read_or_format_error(text)
