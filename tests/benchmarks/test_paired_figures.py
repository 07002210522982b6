"""The paired figures the GPU benchmarks report (issue 19): offload's round-by-round
slowdown and merged rounds (of its fractions and of its engine part), gpu_overhead's
bootstrap interval, fastest quarter and the summary of saved runs. Pure functions over
made-up rounds, so each figure is checked against what it must be, including where
pairing and unpaired medians disagree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_overhead import check_variants, fastest_quarter, paired_interval, paired_median, runs_summary
from benchmarks.offload import paired_slowdown
from benchmarks.training import merge_rounds

REPO = Path(__file__).resolve().parents[2]


def _round(seconds: float, peak: int) -> dict:
    return {"seconds": seconds, "all_seconds": [seconds], "per_step": [{"seconds": seconds}], "peak_allocated": peak,
            "ledger_peak": peak // 2, "buffer_bytes_mb0": {"stash": {0: 1}}}


def test_merge_rounds_keeps_the_largest_peak_and_every_round():
    merged = merge_rounds([_round(1.0, 10), _round(3.0, 30), _round(2.0, 20)], "per_step")
    assert merged["peak_allocated"] == 30 and merged["ledger_peak"] == 15
    assert merged["all_seconds"] == [1.0, 3.0, 2.0] and merged["seconds"] == 2.0 and merged["rounds"] == 3
    assert len(merged["per_step"]) == 3


def test_paired_slowdown_pairs_rounds_not_medians():
    # the machine slows down in round 2 for both; the case is 10% slower in every round
    base = merge_rounds([_round(1.0, 1), _round(2.0, 1), _round(1.1, 1)], "per_step")
    case = merge_rounds([_round(1.1, 1), _round(2.2, 1), _round(1.21, 1)], "per_step")
    assert paired_slowdown(case, base) == pytest.approx(0.10)
    assert paired_slowdown(base, base) == 0.0
    # unpaired rows (results from before the rounds): the ratio of medians
    assert paired_slowdown({"seconds": 1.5}, {"seconds": 1.0}) == pytest.approx(0.5)
    # rows of different round counts are not paired
    assert paired_slowdown(merge_rounds([_round(3.0, 1)], "per_step"), base) == pytest.approx(3.0 / 1.1 - 1)


def _case_round(seconds: float, peak: int) -> dict:
    """One round's `measure_case` record of one rank (benchmarks/training.py)."""
    return {"case": {"label": "x"}, "seconds": seconds, "all_seconds": [seconds], "steps": [{"seconds": seconds}],
            "peak_allocated": peak, "peak_reserved": peak + 1, "reserved_after": peak, "ledger_peak": None,
            "grad_bytes": 8, "param_bytes": 16}


def test_engine_rounds_merge_and_pair_as_the_fractions_do():
    from benchmarks.offload import render

    base = merge_rounds([_case_round(1.0, 10), _case_round(2.0, 30), _case_round(1.1, 20)], "steps")
    assert base["all_seconds"] == [1.0, 2.0, 1.1] and base["seconds"] == 1.1 and base["rounds"] == 3
    assert base["peak_allocated"] == 30 and base["peak_reserved"] == 31 and base["ledger_peak"] is None
    assert len(base["steps"]) == 3 and base["param_bytes"] == 16
    case = merge_rounds([_case_round(1.2, 5), _case_round(2.4, 5), _case_round(1.0, 5)], "steps")
    assert paired_slowdown(case, base) == pytest.approx(0.2)  # 20% slower in two rounds of three
    assert case["seconds"] / base["seconds"] - 1 == pytest.approx(1.2 / 1.1 - 1)  # what medians alone would say
    report = {"versions": {"date": "d"}, "model": {}, "microbatch_size": 1, "dtype": "bf16", "engine": [
        {"engine": name, "m": 8, "ranks": [row] * 4} for name, row in (("ps_1f1b", base), ("ps_1f1b:offload=0", case))]}
    text = render(report, None)
    assert "| `ps_1f1b:offload=0` | 0.00 | 0.00 | 1.200 | +20.0% |" in text
    assert "the median over 3 rounds of the step against `ps_1f1b`'s step of the same round" in text


def _runs(executor: list[float], ordered: list[float]) -> dict:
    return {"executor": {"step": executor, "cpu": executor}, "ordered": {"step": ordered, "cpu": ordered}}


def test_paired_interval_brackets_the_median_and_is_seeded():
    runs = _runs([1.0 + 0.01 * k for k in range(20)], [1.0] * 20)
    low, high = paired_interval(runs, "step")
    assert low <= paired_median(runs, "step") <= high
    assert (low, high) == paired_interval(runs, "step")
    assert paired_interval(_runs([2.0] * 9, [1.0] * 9), "step") == (1.0, 1.0)


def test_fastest_quarter_ignores_disturbed_steps():
    assert fastest_quarter([1.0, 1.0, 5.0, 9.0, 1.2, 1.1, 7.0, 1.0]) == pytest.approx(1.0)
    assert fastest_quarter([3.0]) == 3.0


def test_check_variants_orders_and_refuses():
    assert check_variants(["executor", "ordered"]) == ("ordered", "executor")
    with pytest.raises(ValueError, match="accepted are"):
        check_variants(["ordered", "executor", "bogus"])
    with pytest.raises(ValueError, match="lack"):
        check_variants(["ordered"])


def _report(fraction: float, commit: str = "abc", gpus: str = "1 x GPU A") -> dict:
    step = {"step": [1.0], "host": [1.0], "cpu": [1.0]}
    slower = {"step": [1.0 + fraction], "host": [1.0], "cpu": [1.0]}
    return {"versions": {"date": "2026-12-05T00:00:00+00:00", "commit": commit, "gpus": gpus},
            "overhead": {"steps": 1, "variants": ["ordered", "executor"], "pure_compute_s": 1.0,
                         "executor_step_s": 1.0 + fraction, "overhead_fraction": fraction,
                         "min_s": {"ordered": 1.0, "executor": 1.0 + fraction},
                         "runs": {"ordered": step, "executor": slower}}}


@pytest.mark.parametrize("fractions, verdict", [((0.001, 0.004), "met"), ((0.001, 0.006), "not met")])
def test_summary_verdict_is_the_largest_run(tmp_path, fractions, verdict):
    paths = []
    for k, f in enumerate(fractions):
        paths.append(tmp_path / f"run{k}.json")
        paths[-1].write_text(json.dumps(_report(f)))
    text = runs_summary(paths)
    assert f"- abc on 1 x GPU A: {verdict} in 2 run(s) (largest {max(fractions):+.2%})" in text
    assert text.count("| run | date") == 1 and all(p.name in text for p in paths)


def test_summary_judges_each_commit_and_gpu_apart(tmp_path):
    runs = [(0.004, "abc", "1 x GPU A"), (0.009, "abc", "1 x GPU B"), (0.002, "def", "1 x GPU A"),
            (0.003, "abc", "1 x GPU A")]
    paths = []
    for k, (f, commit, gpus) in enumerate(runs):
        paths.append(tmp_path / f"run{k}.json")
        paths[-1].write_text(json.dumps(_report(f, commit, gpus)))
    text = runs_summary(paths)
    assert "- abc on 1 x GPU A: met in 2 run(s) (largest +0.40%)" in text
    assert "- abc on 1 x GPU B: not met in 1 run(s) (largest +0.90%)" in text
    assert "- def on 1 x GPU A: met in 1 run(s) (largest +0.20%)" in text


@pytest.mark.spawn
def test_summary_names_an_unreadable_file_without_a_traceback(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_overhead", "--summary", str(tmp_path / "no.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no.json" in done.stderr and "Traceback" not in done.stderr
