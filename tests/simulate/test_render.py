"""ASCII timeline, Chrome trace and PNG of a simulated schedule."""

import json
import math
import re
import sys

import pytest

from pipeschedule import compile_schedule
from pipeschedule.errors import PipescheduleError
from pipeschedule.compiler.families import generate
from pipeschedule.compiler.ir import COMM_OPS, COMPUTE_OPS
from pipeschedule.compiler.passes import lower
from pipeschedule.simulate.render import ascii_timeline, chrome_trace, png
from pipeschedule.simulate import CostModel, simulate

CASES = [
    ("1f1b", {}), ("afab", {}), ("capped_1f1b", {"cap": 2}),
    ("interleaved_1f1b", {"virtual": 2}), ("interleaved_1f1b", {"virtual": 3}),
]


def simulated(name, pp=4, m=8, **params):
    schedule = lower(generate(name, pp=pp, microbatches=m, **params))
    return schedule, simulate(schedule)


def rank_rows(text, pp):
    rows = [line for line in text.splitlines() if line.startswith("rank ")]
    assert len(rows) == pp
    return [row.split("|", 1)[1] for row in rows]


@pytest.mark.parametrize("name,params", CASES)
@pytest.mark.parametrize("m", (3, 8, 12))
def test_ascii_shows_every_microbatch_on_every_rank(name, params, m):
    schedule, result = simulated(name, m=m, **params)
    text = ascii_timeline(schedule, result)
    for row in rank_rows(text, schedule.pp):
        forwards = {int(x) for x in re.findall(r"(?<![bw\d])(\d+)", row)}
        backwards = {int(x) for x in re.findall(r"b(\d+)", row)}
        assert forwards == backwards == set(range(m)), row
    assert "legend" in text.splitlines()[-1]


def test_ascii_1f1b_picture():
    schedule, result = simulated("1f1b", pp=4, m=8)
    text = ascii_timeline(schedule, result)
    rows = rank_rows(text, 4)
    # One cell = half a time unit: F = 2 cells ("3 "), B = 4 cells ("b3  ").
    assert rows[3].startswith("......0 b0  1 b1  2 ")
    assert rows[0].startswith("0 1 2 3 ............b0  4 b1  5 ")
    assert max(len(line) for line in text.splitlines()[1:-1]) <= 100


def test_ascii_scales_down_to_width():
    schedule, result = simulated("interleaved_1f1b", pp=4, m=8, virtual=2)
    wide = ascii_timeline(schedule, result)
    assert "chunk 1" in wide.splitlines()[-1]
    narrow = ascii_timeline(schedule, result, width=80)
    assert all(len(line) <= 80 for line in rank_rows(narrow, 4))
    assert all(len("rank 0 |" + row) <= 80 for row in rank_rows(narrow, 4))
    assert max(len(row) for row in rank_rows(wide, 4)) > 80


def test_chrome_trace():
    schedule, result = simulated("interleaved_1f1b", pp=3, m=4, virtual=2)
    trace = json.loads(json.dumps(chrome_trace(schedule, result)))
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    compute = [i for p in schedule.programs for i in p if i.op in COMPUTE_OPS]
    comm = [i for p in schedule.programs for i in p if i.op in COMM_OPS]
    assert len([e for e in complete if e["cat"] == "compute"]) == len(compute)
    assert len([e for e in complete if e["cat"] == "comm"]) == len(comm)
    assert {e["tid"] for e in complete if e["cat"] == "compute"} == set(range(schedule.pp))
    assert all(e["pid"] == 0 and e["dur"] >= 0 for e in complete)
    assert any(e["name"] == "F mb3 s1" for e in complete)
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert {e["name"] for e in counters} == {f"live bytes rank {r}" for r in range(schedule.pp)}
    assert len(counters) == sum(len(curve) for curve in result.memory)


def test_chrome_trace_time_unit():
    schedule, result = simulated("1f1b", pp=2, m=2)
    events = chrome_trace(schedule, result, time_unit_us=1000)["traceEvents"]
    last = max(e["ts"] + e.get("dur", 0) for e in events if e["ph"] == "X")
    assert last == result.step_time * 1000


def tracks_of(trace):
    """tid -> (track name, its complete events)."""
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    out = {tid: (name, []) for tid, name in names.items()}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            out[e["tid"]][1].append(e)
    return out


@pytest.mark.parametrize("name,params", [("1f1b", {}), ("zbv", {}), ("interleaved_1f1b", {"virtual": 2}), ("afab", {})])
def test_chrome_trace_tracks_never_overlap(name, params):
    """Perfetto draws overlapping complete events of one track wrongly: computes have a
    track per rank, messages (post to completion, sends too) and host copies tracks of
    their own, split in lanes."""
    from dataclasses import replace

    from pipeschedule.compiler.offload import OffloadPolicy, add_offload

    schedule = add_offload(lower(generate(name, pp=3, microbatches=6, **params)), OffloadPolicy(1.0, None, 0))
    cost = replace(CostModel.default(schedule), latency=0.3, offload_bandwidth=0.4, reload_bandwidth=0.4)
    result = simulate(schedule, cost)
    tracks = tracks_of(json.loads(json.dumps(chrome_trace(schedule, result))))
    kinds = {"compute": 0, "comm": 0, "copy": 0}
    for track, events in tracks.values():
        events.sort(key=lambda e: (e["ts"], e["dur"]))
        for a, b in zip(events, events[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-9, (track, a["name"], b["name"])
        categories = {e["cat"] for e in events}
        assert len(categories) == 1, (track, categories)
        category = categories.pop()
        kinds[category] += len(events)
        rank = int(track.split()[1])
        assert track == f"rank {rank}" if category == "compute" else track.startswith(
            f"rank {rank} {'messages' if category == 'comm' else 'copies'}")
    programs = [i for p in schedule.programs for i in p]
    assert kinds == {"compute": sum(i.op in COMPUTE_OPS for i in programs),
                     "comm": sum(i.op in COMM_OPS for i in programs),
                     "copy": sum(i.op.value in ("OFFLOAD", "RELOAD") for i in programs)}
    assert kinds["copy"] > 0
    # a send spans its post to its message's completion, the matching receive's end
    sends = {}
    for _, events in tracks.values():
        for e in events:
            if e["name"].startswith("SEND"):
                sends[e["name"]] = e
    assert sends and all(e["dur"] >= 0.3 - 1e-9 for e in sends.values())


@pytest.mark.parametrize("name,params", CASES[:1] + CASES[3:4])
def test_png(tmp_path, name, params):
    pytest.importorskip("matplotlib")
    schedule, result = simulated(name, **params)
    path = tmp_path / "timeline.png"
    png(schedule, result, str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_png_large_schedule_skips_labels(tmp_path):
    pytest.importorskip("matplotlib")
    schedule = lower(generate("1f1b", pp=8, microbatches=64))
    base = CostModel.default(schedule)
    result = simulate(schedule, CostModel(base.forward, base.backward, base.weight, base.buffer_bytes, latency=0.1))
    png(schedule, result, tmp_path / "big.png")
    assert (tmp_path / "big.png").read_bytes()[:4] == b"\x89PNG"


def test_png_without_matplotlib(tmp_path, monkeypatch):
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib...` fail
    schedule, result = simulated("1f1b", pp=2, m=2)
    with pytest.raises(PipescheduleError, match=r"pip install matplotlib.*pipeschedule\[plot\]"):
        png(schedule, result, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_png_unwritable_path(tmp_path):
    pytest.importorskip("matplotlib")
    schedule, result = simulated("1f1b", pp=2, m=2)
    with pytest.raises(PipescheduleError, match="cannot write PNG"):
        png(schedule, result, tmp_path / "no" / "such" / "dir.png")


def _summary_row_cell_by_cell(blocks, scale, cells):
    """The summary row as it was drawn before it skipped idle cells: every cell's cover."""
    busy = [dict.fromkeys("FBW", 0.0) for _ in range(cells)]
    for start, end, instr, _ in blocks:
        lo, hi = float(start) * scale, float(end) * scale
        for cell in range(int(lo), min(cells, math.ceil(hi))):
            busy[cell][instr.op.value] += min(hi, cell + 1) - max(lo, cell)
    row = []
    for cover in busy:
        total = sum(cover.values())
        op = max(cover, key=cover.get)
        row.append("." if total < 0.5 else op if cover[op] >= 0.75 * total else "x")
    return "".join(row)


@pytest.mark.parametrize("name, kwargs, width", [
    ("zbv", dict(pp=8, microbatches=64), 50),
    ("1f1b", dict(pp=64, microbatches=2), 40),  # mostly idle: the cells skipped
    ("interleaved_1f1b", dict(pp=4, microbatches=16, virtual=2), 30),
    ("zb_h1", dict(pp=4, microbatches=32), 37),
])
def test_the_summary_row_draws_as_cell_by_cell(monkeypatch, name, kwargs, width):
    from pipeschedule.simulate import render

    schedule = compile_schedule(name, **kwargs)
    result = simulate(schedule, CostModel.default(schedule))
    drawn = render.ascii_timeline(schedule, result, width=width)
    assert "cells too short for labels" in drawn
    monkeypatch.setattr(render, "_summary_row", _summary_row_cell_by_cell)
    assert drawn == render.ascii_timeline(schedule, result, width=width)
