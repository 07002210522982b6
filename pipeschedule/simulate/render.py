"""Pictures of a simulated schedule: an ASCII timeline, a Chrome/Perfetto trace, a PNG.

All three read a `SimResult` (see `simulate`); none changes it. matplotlib is an
optional extra (`pipeschedule[plot]`) and is imported only inside `png`.
"""

from __future__ import annotations

import heapq
import math
from typing import Any

from pipeschedule.checks import check_png_size, check_timeline_cells, check_trace_size, shown
from pipeschedule.errors import PipescheduleError
from pipeschedule.compiler.effects import COMPUTE, COPY, EFFECTS, INSTANT
from pipeschedule.compiler.ir import COMPUTE_OPS, SEND_OPS, Schedule
from pipeschedule.simulate import SimResult

# The fill after a block's label shows its chunk (the rank's k-th stage) when virtual > 1.
CHUNK_FILLS = " -=~+:*#"
# What a compute shows ([Note: instruction effects] in compiler/effects.py): its row's label
# before the microbatch ("" F, "b" B, "w" W), the letter of a summary cell, its PNG colour.
LABEL_PREFIX = {op: EFFECTS[op].label for op in COMPUTE_OPS}
LETTER = {op: op.value[0] for op in COMPUTE_OPS}
PALETTE = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")  # by the compute's order
OP_COLORS = {op: PALETTE[(EFFECTS[op].order or 0) % len(PALETTE)] for op in COMPUTE_OPS}


def _label(instr) -> str:
    return f"{LABEL_PREFIX[instr.op]}{instr.mb}"


def _compute_blocks(schedule: Schedule, result: SimResult):
    """Per rank: (start, end, instr, chunk) of every compute that takes time."""
    blocks = []
    for rank in range(schedule.pp):
        chunk_of = {s: c for c, s in enumerate(schedule.stages_of(rank))}
        blocks.append([
            (e.start, e.end, e.instr, chunk_of.get(e.instr.stage, 0))
            for e in result.events.of_rank(rank)
            if e.instr.op in COMPUTE_OPS and e.end > e.start
        ])
    return blocks


def ascii_timeline(schedule: Schedule, result: SimResult, *, width: int | None = None) -> str:
    """One row per rank, one character per cell of time.

    A compute block shows its label and then a fill character: `3` is the forward of
    microbatch 3, `b3` its backward, `w3` its weight-gradient part; `.` is idle
    (including waits for communication). With virtual > 1 the fill shows the chunk
    (see the legend line). The scale gives every block room for its label and one fill
    cell; when that is wider than `width` characters (None: no limit), it shrinks to fit
    and labels are cut where their blocks have become too short. Once the shortest
    block is under one cell, labels cannot be shown at all and each cell shows what
    fills most of its time instead (F, B, W, x for a mix, or idle).
    """
    blocks = _compute_blocks(schedule, result)
    step = result.step_time
    scale = max(  # cells per time unit
        ((len(_label(instr)) + 1) / (end - start) for rank in blocks for start, end, instr, _ in rank), default=1.0)
    name_width = len(str(schedule.pp - 1))
    if width is not None and step > 0:
        scale = min(scale, max(1, width - len(f"rank {schedule.pp - 1} ||")) / step)
    cells = max(1, math.ceil(step * scale - 1e-9))
    check_timeline_cells(schedule.pp, cells)  # [Note: size limits]
    shortest = min((end - start for rank in blocks for start, end, _, _ in rank), default=step)
    summary = shortest * scale < 1
    draw = _summary_row if summary else _label_row
    rows = [f"rank {r:>{name_width}} |" + draw(rank_blocks, scale, cells) + "|" for r, rank_blocks in enumerate(blocks)]
    title = (
        f"{schedule.name}: pp={schedule.pp} virtual={schedule.virtual} microbatches={schedule.microbatches}"
        f"  step {float(step):g}, bubble {float(result.bubble_fraction):.1%}, 1 cell = {1 / scale:.3g} time units"
    )
    if summary:
        legend = ("legend: cells too short for labels; F / B / W = mostly forward / backward / weight gradient, "
                  "x = a mix, . = mostly idle")
    else:
        legend = "legend: 3 = forward of microbatch 3, b3 = backward, w3 = weight gradient, . = idle"
        if schedule.virtual > 1:
            fills = ", ".join(f"'{CHUNK_FILLS[c % len(CHUNK_FILLS)]}' chunk {c}" for c in range(schedule.virtual))
            legend += f"; fill after a label = chunk: {fills}"
    return "\n".join([title, *rows, legend]) + "\n"


def _label_row(blocks, scale: float, cells: int) -> str:
    row = ["."] * cells
    for start, end, instr, chunk in blocks:
        a = min(cells - 1, round(start * scale))
        b = max(a + 1, min(cells, round(end * scale)))
        row[a:b] = _label(instr)[: b - a].ljust(b - a, CHUNK_FILLS[chunk % len(CHUNK_FILLS)])
    return "".join(row)


def _summary_row(blocks, scale: float, cells: int) -> str:
    """Each cell: '.' when idle most of its time, else the op doing at least 3/4 of its
    compute (F, B or W), else 'x' (a mix, as in the steady state of 1F1B)."""
    busy: dict[int, dict[str, float]] = {}  # the cells some block touches (a rank idles through most at large pp)
    for start, end, instr, _ in blocks:
        lo, hi = float(start) * scale, float(end) * scale
        for cell in range(int(lo), min(cells, math.ceil(hi))):
            cover = busy.get(cell)
            if cover is None:
                cover = busy[cell] = dict.fromkeys(LETTER.values(), 0.0)
            cover[LETTER[instr.op]] += min(hi, cell + 1) - max(lo, cell)
    row = ["."] * cells
    for cell, cover in busy.items():
        total = sum(cover.values())
        op = max(cover, key=cover.get)
        row[cell] = "." if total < 0.5 else op if cover[op] >= 0.75 * total else "x"
    return "".join(row)


def _event_name(instr) -> str:
    name = f"{instr.op.value} mb{instr.mb} s{instr.stage}"
    if instr.peer is not None:
        name += f" {'->' if instr.op in SEND_OPS else '<-'} r{instr.peer}"
    return name


def _lanes(spans):
    """Splits (start, end, item) spans into lanes in which no two overlap (a span may
    start where the one before it ended): [(lane, item)], each span in the lane that
    frees first, a new lane when none is free by its start."""
    free: list[tuple[float, int]] = []  # (end of its last span, lane)
    out, lanes = [], 0
    for start, end, item in sorted(spans, key=lambda span: (span[0], span[1])):
        if free and free[0][0] <= start:
            _, lane = heapq.heappop(free)
        else:
            lane, lanes = lanes, lanes + 1
        heapq.heappush(free, (end, lane))
        out.append((lane, item))
    return out


# A rank's tracks: its computes, then its messages and its host copies, each kind in as
# many lanes as its events need.
_TRACKS = (("messages", "comm"), ("copies", "copy"))


def chrome_trace(schedule: Schedule, result: SimResult, *, time_unit_us: float = 1.0) -> dict[str, Any]:
    """Chrome / Perfetto trace-event JSON (load it in ui.perfetto.dev or chrome://tracing).

    One complete ("X") event per compute, communication and copy instruction, on tracks
    of pid 0: per rank, its computes on track "rank r" (tid = rank), which never
    overlap; its sends and receives, each from its batch's post to its message's
    completion (a send's too, although the rank goes on meanwhile), on "rank r
    messages"; its OFFLOAD / RELOAD, from issue to the copy's landing, on "rank r
    copies". Messages and copies overlap computes and each other, and Perfetto draws
    overlapping complete events of one track wrongly, so each of those two is split
    into as many lanes ("rank r copies 2", ...) as needed for no two events of one track
    to overlap. One counter ("C") track of live buffer bytes per rank. Trace timestamps
    are in microseconds: one time unit of the cost model is written as `time_unit_us`
    of them (pass 1e6 when costs are in seconds).
    """
    check_trace_size(schedule.pp, schedule.virtual, schedule.microbatches)  # [Note: size limits]
    us = float(time_unit_us)
    pp = schedule.pp
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": schedule.name}}]
    side: dict[tuple[int, str], list] = {}  # (rank, category) -> spans off the compute track
    tracks: list[int] = []  # tids, in the order Perfetto lists them

    def track(tid: int, name: str) -> None:
        order = len(tracks)
        tracks.append(tid)
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": name}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": tid, "args": {"sort_index": order}})

    def event(e, category: str, tid: int) -> dict[str, Any]:
        return {
            "name": _event_name(e.instr), "cat": category, "ph": "X", "pid": 0, "tid": tid,
            "ts": float(e.start) * us, "dur": float(e.end - e.start) * us,
            "args": {"stage": e.instr.stage, "mb": e.instr.mb, "index": e.index},
        }

    for e in result.events:
        kind = EFFECTS[e.instr.op].kind
        if kind == INSTANT:  # no time (FREE)
            continue
        if kind == COMPUTE:
            events.append(event(e, "compute", e.rank))
        else:
            category = "copy" if kind == COPY else "comm"
            side.setdefault((e.rank, category), []).append((float(e.start), float(e.end), e))
    next_tid = pp
    for rank in range(pp):
        track(rank, f"rank {rank}")
        for label, category in _TRACKS:
            lanes: dict[int, int] = {}  # lane -> tid
            for lane, e in _lanes(side.get((rank, category), ())):
                if lane not in lanes:
                    lanes[lane] = next_tid
                    track(next_tid, f"rank {rank} {label}" + (f" {lane + 1}" if lane else ""))
                    next_tid += 1
                events.append(event(e, category, lanes[lane]))
    for rank, curve in enumerate(result.memory):
        for time, live in curve:
            events.append({"ph": "C", "name": f"live bytes rank {rank}", "pid": 0, "tid": rank,
                           "ts": float(time) * us, "args": {"bytes": float(live)}})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"schedule": schedule.name, **result.to_dict()},
    }


def png(schedule: Schedule, result: SimResult, path) -> None:
    """Write a PNG: the timeline (one bar row per rank, microbatch labels where they fit)
    above the live buffer bytes of every rank. Needs matplotlib."""
    check_png_size(schedule.pp, schedule.virtual, schedule.microbatches)  # [Note: size limits]
    pp, step = schedule.pp, float(result.step_time) or 1.0
    blocks = _compute_blocks(schedule, result)
    fig = new_figure(figsize=(12, 2.5 + 0.45 * min(pp, 40)), dpi=100)
    timeline, memory = fig.subplots(2, 1, sharex=True,
                                    gridspec_kw={"height_ratios": [max(1.5, 0.45 * min(pp, 40)), 2.5]})
    count = sum(len(b) for b in blocks)
    for rank, rank_blocks in enumerate(blocks):
        groups: dict[tuple, list] = {}
        for start, end, instr, chunk in rank_blocks:
            groups.setdefault((instr.op, chunk), []).append((float(start), float(end - start)))
            if count <= 800 and (end - start) / step > 0.012:
                timeline.text(float(start + end) / 2, rank, str(instr.mb), ha="center", va="center", fontsize=7)
        for (op, chunk), spans in groups.items():
            alpha = 1.0 - 0.45 * chunk / max(1, schedule.virtual - 1)
            timeline.broken_barh(spans, (rank - 0.4, 0.8), facecolors=OP_COLORS[op], alpha=alpha,
                                 edgecolor="white", linewidth=0.5)
    timeline.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    timeline.set_ylim(pp - 0.5, -0.5)
    timeline.set_title(
        f"{schedule.name}: pp={pp} virtual={schedule.virtual} microbatches={schedule.microbatches}, "
        f"step {step:g}, bubble {float(result.bubble_fraction):.1%}  (F blue, B orange, W green"
        + (", lighter = later chunk)" if schedule.virtual > 1 else ")")
    )
    for rank, curve in enumerate(result.memory):
        times = [float(t) for t, _ in curve] + [step]
        values = [float(b) for _, b in curve]
        memory.step(times, values + values[-1:], where="post", label=f"rank {rank}")
    memory.set_xlabel("time")
    memory.set_ylabel("live buffer bytes")
    if pp <= 16:
        memory.legend(loc="upper right", fontsize=7, ncol=max(1, pp // 4))
    memory.set_xlim(0, step)
    fig.tight_layout()
    save_png(fig, path)


def new_figure(**kwargs):
    """A matplotlib `Figure` on the Agg canvas (no pyplot, no global state); a clear
    error where matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PipescheduleError(
            "PNG output needs matplotlib, which is not installed: "
            "run `pip install matplotlib` (or install the extra `pipeschedule[plot]`)"
        ) from None
    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def save_png(fig, path) -> None:
    """`fig` as a PNG at exactly `path` (whatever its suffix); a clear error where it
    cannot be written."""
    try:
        fig.savefig(path, format="png")
    except (OSError, ValueError) as err:
        raise PipescheduleError(f"cannot write PNG to {shown(str(path))}: {err}") from None
