"""The parallel benchmarks' pieces (benchmarks/parallel): core groups and pinning, stage
costs from measured spans, the prediction, the comparisons and the loss check."""

from __future__ import annotations

import math
import os

import pytest

from benchmarks.parallel import pinning, report
from benchmarks.parallel.predict import cost_model, measured_bubble, predict, stage_costs
from pipeschedule import compile_schedule
from pipeschedule.simulate import simulate


def test_core_groups_are_disjoint_whole_cores_and_refuse_too_many():
    cpus = set(os.sched_getaffinity(0))
    cores = pinning.physical_cores(cpus)
    assert sorted(cpu for core in cores for cpu in core) == sorted(cpus)
    groups = pinning.core_groups(len(cores), 1, cpus)
    assert len(groups) == len(cores) and len({cpu for g in groups for cpu in g}) == sum(map(len, groups))
    assert pinning.parse_spec(pinning.spec(groups)) == groups
    with pytest.raises(ValueError, match=f"{len(cores) + 1} ranks of 1 physical cores need {len(cores) + 1}"):
        pinning.core_groups(len(cores) + 1, 1, cpus)


def test_pin_moves_this_process_and_back():
    before = os.sched_getaffinity(0)
    first = pinning.core_groups(1, 1)[0]
    try:
        pinning.pin(first)
        assert os.sched_getaffinity(0) == set(first)
    finally:
        os.sched_setaffinity(0, before)


def _spans(schedule, f=1.0, b=2.0):
    """One step's spans per rank, as the timeline writes them, each compute taking its unit
    cost, laid end to end on each rank."""
    out = []
    for program in schedule.programs:
        clock, rows = 0.0, []
        for instr in program:
            if instr.op.value in ("F", "B", "W"):
                length = f if instr.op.value == "F" else b
                rows.append((instr.op.value, instr.stage, instr.mb, clock, clock + length))
                clock += length
        out.append(rows)
    return out


def test_stage_costs_are_medians_and_the_prediction_is_the_simulators():
    schedule = compile_schedule("1f1b", pp=3, microbatches=5)
    costs = stage_costs([_spans(schedule), _spans(schedule, 3.0, 4.0), _spans(schedule, 1.0, 2.0)], 3)
    assert costs == {"forward": [1.0] * 3, "backward": [2.0] * 3, "weight": [0.0] * 3}
    cost = cost_model(costs, boundary_bytes=8, latency_s=0.0, bandwidth=math.inf)
    assert predict(schedule, cost)["step_s"] == simulate(schedule, cost).step_time == (5 + 2) * 3
    with pytest.raises(ValueError, match="no measured span"):
        stage_costs([[[] for _ in range(3)]], 3)


def test_measured_bubble_is_the_idle_share_of_each_rank():
    spans = [[("F", 0, 0, 0.0, 1.0), ("B", 0, 0, 2.0, 4.0)], [("F", 1, 0, 1.0, 2.0)]]
    assert measured_bubble(4.0, spans) == [0.25, 0.75]


def _row(name, m, group, seconds, loss=1.0, predicted=None):
    row = {"engine": name, "m": m, "group": group, "seconds": seconds, "median_s": sorted(seconds)[len(seconds) // 2],
           "losses": [loss] * len(seconds)}
    if predicted is not None:
        row["predicted"] = {"step_s": predicted}
    return row


def test_compare_pairs_rounds_in_one_group_and_says_how_much_gain_was_realised():
    rows = [_row("ps_1f1b", 8, "a", [10.0, 12.0], predicted=10.0),
            _row("zb_h1", 8, "a", [9.0, 10.2], predicted=8.0),
            _row("interleaved_1f1b:virtual=2", 8, "b", [9.5, 9.5], predicted=9.0)]
    report.compare(rows)
    zb, inter = rows[1]["vs_ps_1f1b"], rows[2]["vs_ps_1f1b"]
    assert zb["paired"] and zb["measured"] == pytest.approx((0.9 + 0.85) / 2)
    assert zb["predicted"] == pytest.approx(0.8) and zb["realised"] == pytest.approx((1 - 0.875) / 0.2)
    assert not inter["paired"] and inter["measured"] == pytest.approx(9.5 / 12.0)
    assert "quartiles" not in zb and "quartiles" not in inter  # two rounds, and unpaired: none


def test_compare_gives_the_quartiles_of_four_or_more_paired_rounds():
    rows = [_row("ps_1f1b", 8, "a", [10.0] * 5, predicted=10.0),
            _row("zb_h1", 8, "a", [8.0, 9.0, 10.0, 11.0, 12.0], predicted=8.0)]
    report.compare(rows)
    entry = rows[1]["vs_ps_1f1b"]
    assert entry["measured"] == pytest.approx(1.0) and entry["quartiles"] == pytest.approx([0.9, 1.1])
    assert report._vs(entry) == "1.000 [0.900-1.100] (0.800, 0%)"  # noqa: SLF001  (the table cell)


def test_loss_check_names_an_engine_whose_loss_differs():
    rows = [_row("1f1b", 4, "a", [1.0], loss=2.5), _row("ps_1f1b", 4, "a", [1.0], loss=2.5)]
    assert report.losses_equal(rows, "1f1b")[4]["differ"] == []
    rows.append(_row("zbv", 4, "b", [1.0], loss=2.5 + 1e-7))
    found = report.losses_equal(rows, "1f1b")[4]
    assert found["differ"] == ["zbv"] and found["largest_difference"] == pytest.approx(1e-7)


def test_host_pacing_counts_only_the_idle_time_the_host_left():
    """Rank 0: F from 0 to 10 ms; B enqueued at 15 ms, after F ended, and run from 15.2 ms:
    5 ms waiting for the host. Rank 1 begins 2 ms into the step: its F enqueued at once and
    run from 12 ms (waiting for its data, not the host: nothing counted)."""
    ms = 1e-3
    rounds = [{"seconds": 40 * ms, "enqueue_s": 16 * ms,
               "spans": [[("F", 0, 0, 0.0, 10 * ms), ("B", 0, 0, 15.2 * ms, 30 * ms)],
                         [("F", 1, 0, 10 * ms, 20 * ms)]],
               "host": [[(0.0, 1 * ms), (15 * ms, 16 * ms)], [(0.0, 0.5 * ms)]],
               "offset_s": [0.0, 2 * ms]}]
    host = report.host_pacing(rounds)
    assert host["host_wait_s"] == pytest.approx([5 * ms, 0.0])
    assert host["idle_s"] == pytest.approx([15.2 * ms, 30 * ms])
    assert host["enqueue_ms"] == pytest.approx({"F": 0.75, "B": 1.0})
    # rank 1's F enqueued at 11.8 ms (9.8 after its origin), run from 12 ms: 11.8 ms waiting for the host
    late = dict(rounds[0], host=[rounds[0]["host"][0], [(9.8 * ms, 10 * ms)]])
    assert report.host_pacing([late])["host_wait_s"] == pytest.approx([5 * ms, 11.8 * ms])
    lines = report.host_table([{"engine": "ps_1f1b", "m": 1, "median_s": 0.04, "host": host}])
    assert lines[2] == "| `ps_1f1b` | 1 | 0.040 s | 0.016 s | 15/30 | 5/0 | 0.75 / 1.00 / - |"
    assert report.host_table([{"engine": "ps_1f1b", "m": 1, "median_s": 0.04}]) == []


def test_gpu_partitions_refuses_a_micro_batch_below_one(capsys):
    from benchmarks.parallel import gpu_partitions

    with pytest.raises(SystemExit) as caught:
        gpu_partitions.main(["--smoke", "--micro-batch", "0"])
    assert caught.value.code == 2
    assert "--micro-batch 0: a whole number >= 1 is accepted" in capsys.readouterr().err


def test_write_puts_the_results_and_a_trace_per_row_under_the_stem(tmp_path):
    import json

    row = {"engine": "zb_h1", "m": 4, "trace_spans": [[("F", 0, 0, 0.0, 0.001)], [("B", 1, 0, 0.001, 0.003)]]}
    summary = {"rows": [row, {"engine": "ps_afab", "m": 4}], "not_run": [{"engine": "x", "m": 4, "why": "oom"}]}
    report.write("stem", summary, "# table\n", tmp_path)
    assert json.loads((tmp_path / "stem.json").read_text())["rows"][0]["engine"] == "zb_h1"
    assert (tmp_path / "stem.md").read_text() == "# table\n"
    traces = sorted(p.name for p in (tmp_path / "stem_traces").iterdir())
    assert traces == ["zb_h1_m4.json"]  # a row without spans has none
    events = json.loads((tmp_path / "stem_traces" / "zb_h1_m4.json").read_text())["traceEvents"]
    assert [e["name"] for e in events if e["ph"] == "X"] == ["F mb0 s0", "B mb0 s1"]
    assert report.not_run_lines(summary) == ["Not run: `x` m=4: oom."]


@pytest.mark.parametrize("flags, named", [(["--engines", "zbv@threads"], "--engines: zbv@threads: use --host"),
                                          (["--engines", "zbv;nope:x=1"], "--engines: nope:x=1: not a family"),
                                          (["--pp", "1"], "--pp 1: a pipeline of at least 2 ranks")])
def test_gpu_partitions_names_a_bad_case_argument(capsys, flags, named):
    from benchmarks.parallel import gpu_partitions

    with pytest.raises(SystemExit) as stop:
        gpu_partitions.main(["--smoke", *flags])
    assert stop.value.code == 2 and named in capsys.readouterr().err


def test_late_split_puts_a_wait_in_the_gaps_and_a_slow_block_in_the_blocks():
    from benchmarks.parallel.predict import late_split
    from pipeschedule.compiler.ir import Op

    schedule = compile_schedule("zb_h1", pp=3, microbatches=4)
    cost = cost_model({"forward": [1.0] * 3, "backward": [1.5] * 3, "weight": [0.5] * 3}, boundary_bytes=8,
                      latency_s=0.25, bandwidth=math.inf)
    spans, simulated = [[] for _ in range(3)], simulate(schedule, cost)
    for ev in simulated.events:
        if ev.instr.op in (Op.F, Op.B, Op.W):
            spans[ev.rank].append((ev.instr.op.value, ev.instr.stage, ev.instr.mb, ev.start, ev.end))
    assert late_split(simulated, spans) == {"blocks_s": [0.0] * 3, "gaps_s": [0.0] * 3}  # the simulated step
    # rank 1 waits 0.5 more before its third block (everything after moves); rank 0's second block runs 0.25 longer
    spans[1] = [(o, s, mb, a + 0.5 * (k >= 2), b + 0.5 * (k >= 2)) for k, (o, s, mb, a, b) in enumerate(spans[1])]
    spans[0] = [(o, s, mb, a + 0.25 * (k >= 2), b + 0.25 * (k >= 1)) for k, (o, s, mb, a, b) in enumerate(spans[0])]
    late = late_split(simulated, spans)
    assert late["blocks_s"] == pytest.approx([0.25, 0.0, 0.0]) and late["gaps_s"] == pytest.approx([0.0, 0.5, 0.0])
    rows = [{"engine": "zb_h1", "m": 4, "error": 0.1, "late": late}, {"engine": "1f1b", "m": 4}]
    assert report.late_table(rows)[-1] == "| `zb_h1` | 4 | +10.0% | +250/+0/+0 | +0/+500/+0 |"
    assert report.late_table(rows[1:]) == []


@pytest.mark.spawn
def test_trainer_groups_pairs_every_layout_in_one_launch_and_stops_at_its_budget(capsys):
    """Two layouts (1F1B's and interleaved v=2's) in one torchrun: every ratio paired by
    round ([Note: every layout in one launch]); a budget already spent after the first measured round stops
    the launch with that round, of the three asked for."""
    from benchmarks.parallel import trainer_groups

    assert trainer_groups.main(["--smoke", "--pp", "2", "--no-pin", "--rounds", "3", "--budget", "0.001",
                                "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 layout group(s), 1 measured round(s)" in out and "1 compute threads a rank" in out
    rows = [line for line in out.splitlines() if line.startswith("| `")]
    assert [line.split("`")[1] for line in rows] and {line.split("`")[1] for line in rows} == set(
        trainer_groups.SMOKE_ENGINES)
    interleaved = next(line for line in rows if "interleaved" in line)
    assert "unpaired" not in out and interleaved.split("|")[7].strip()  # its ratio to ps_1f1b, paired
    assert "every engine bitwise equal" in out


@pytest.mark.parametrize("flags, named", [(["--microbatches", "0"], "'0': accepted positive integers"),
                                          (["--microbatches", "8,x"], "'8,x': accepted positive integers"),
                                          (["--pp", "1"], "--pp 1: accepted 2 or more"),
                                          (["--rounds", "0"], "--rounds 0: accepted 1 or more"),
                                          (["--warmup", "0"], "--warmup 0: accepted 1 or more"),
                                          (["--threads", "0"], "--threads 0: accepted 1 or more")])
def test_trainer_groups_names_a_bad_argument(capsys, flags, named):
    from benchmarks.parallel import trainer_groups

    with pytest.raises(SystemExit) as exit_:
        trainer_groups.main(flags)
    assert exit_.value.code == 2 and named in capsys.readouterr().err
