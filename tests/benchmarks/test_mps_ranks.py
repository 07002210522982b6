"""benchmarks.parallel.mps_ranks: a process per rank (real processes, gloo, the runtime's
Executor over HostStagedTransport) computes what one process computes; its rounds are
put on one clock; its command line refuses bad values; the MPS helpers."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.parallel import mps, mps_ranks


def test_combine_puts_every_rank_on_the_common_start():
    rows = [{"start": 10.0, "end": 10.9, "enqueued": 10.5, "origin": 10.001, "loss": None, "ledger_peak": 5,
             "cuda_peak": None, "spans": [("F", 0, 0, 0.0, 0.1)], "host": [(0.0, 0.01)]},
            {"start": 10.002, "end": 11.0, "enqueued": 10.6, "origin": 10.004, "loss": 2.5, "ledger_peak": 7,
             "cuda_peak": None, "spans": [("F", 1, 0, 0.2, 0.3)], "host": [(0.1, 0.11)]}]
    out = mps_ranks.combine(rows)
    assert out["seconds"] == pytest.approx(1.0) and out["enqueue_s"] == pytest.approx(0.6)
    assert out["loss"] == 2.5 and out["ledger_peak_bytes"] == [5, 7] and out["offset_s"] == [0.0, 0.0]
    (f0,), (f1,) = out["spans"]
    assert f0[3:] == pytest.approx((0.001, 0.101)) and f1[3:] == pytest.approx((0.204, 0.304))
    assert out["host"][1][0] == pytest.approx((0.104, 0.114))
    rows[0]["host"] = None  # a rank on CPU keeps no enqueue times: no host figures at all
    assert "host" not in mps_ranks.combine(rows)


@pytest.mark.spawn
def test_ranks_as_processes_compute_what_one_process_computes():
    from benchmarks.llama.model import ModelConfig
    from benchmarks.llama.reference import microbatch
    from benchmarks.llama.stages import LlamaStages
    from benchmarks.parallel.gpu_partitions import SMOKE_MODEL, even_split
    from pipeschedule.runtime import InProcessPipeline

    plan = {"pp": 2, "share": 50, "micro_batch": 1, "microbatches": [3], "engines": ["ps_1f1b", "zbv"],
            "warmup": 0, "rounds": 1, "cuda": False, "model": dict(SMOKE_MODEL)}
    summary = mps_ranks.measure(plan, threads=1, timeout=300)
    rows = {r["engine"]: r for r in summary["rows"]}
    assert sorted(rows) == ["ps_1f1b", "zbv"] and summary["not_run"] == []
    assert summary["link"]["latency_s"] > 0

    cfg = ModelConfig(**SMOKE_MODEL)
    model = LlamaStages(cfg, (cfg.layers,), "cpu", torch.bfloat16)
    batches = [microbatch(cfg, 1, i, 7) for i in range(3)]
    inputs = [{"input_ids": b["input_ids"]} for b in batches]
    targets = [{"label_ids": b["label_ids"], "label_mask": b["label_mask"]} for b in batches]
    for name, row in rows.items():
        schedule = mps_ranks.report.schedule_of(name, 2, 3)
        stages = model.regrouped(even_split(cfg.layers, schedule.num_stages))
        outputs = InProcessPipeline(schedule, stages).step(inputs, targets)
        expected = float(sum(out["loss"].float() for out in outputs[schedule.placement[-1]]))
        assert row["losses"] == [expected], name
        spans = row["trace_spans"]
        computes = [sum(i.op.value in "FBW" for i in program) for program in schedule.programs]
        assert [len(s) for s in spans] == computes
        assert all(0 <= start < end <= row["seconds"][0] for rank in spans for _o, _s, _m, start, end in rank)
        assert row["predicted"]["step_s"] > 0 and len(row["bubble_per_rank"]) == 2


@pytest.mark.parametrize("flags, named", [(["--share", "0"], "--share 0: a whole percentage 1..100"),
                                          (["--share", "101"], "--share 101: a whole percentage 1..100"),
                                          (["--pp", "1"], "--pp 1: a pipeline of at least 2 ranks"),
                                          (["--micro-batch", "0"], "--micro-batch 0: a whole number >= 1"),
                                          (["--microbatches", "8,0"], "--microbatches 8,0: whole numbers >= 1"),
                                          (["--engines", "ps_1f1b;nope"], "--engines: nope: not a family"),
                                          (["--engines", "zbv@threads"], "--engines: zbv@threads: every rank has")])
def test_the_command_line_names_a_bad_value(capsys, flags, named):
    with pytest.raises(SystemExit) as stop:
        mps_ranks.main([*flags, "--smoke"])
    assert stop.value.code == 2
    assert named in capsys.readouterr().err


def test_clients_set_the_share_for_the_block_and_restore_the_environment(monkeypatch):
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "80")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    with mps.clients({"CUDA_MPS_PIPE_DIRECTORY": "/x/pipe"}, 25):
        assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
        assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == "/x/pipe"
    assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "80"
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    for bad in (0, 101):
        with pytest.raises(ValueError, match=f"an MPS share of {bad}%: a whole percentage 1..100"):
            with mps.clients({}, bad):
                pass


def test_daemon_says_when_the_control_program_is_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # a folder without nvidia-cuda-mps-control
    with pytest.raises(mps.MPSUnavailable, match="nvidia-cuda-mps-control is not on the PATH"):
        with mps.daemon():
            pass
