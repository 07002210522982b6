"""The first-step block (integration/nanotron/progress.py): the prediction it prints is the
memory model played through the engine's compiled schedule, and the block is one line per
fact, each prefixed. (The block as a user sees it, beside the measured stash:
test_nanotron_train_data_cli.py.)"""

from __future__ import annotations

import dataclasses

import pytest

import integration.nanotron  # noqa: F401  (first: repairs nanotron)
from integration.nanotron import flash_attn_standin, progress
from integration.nanotron.example import TrainerConfig
from integration.nanotron.progress import EngineView, Measured
from pipeschedule.plan.memory import ModelSpec, TrainingSetup, stage_footprints

PP, M = 4, 8
ATTENTION = "sdpa-standin" if flash_attn_standin.is_installed() else "flash-attn"  # as the launcher says


@pytest.fixture
def config(tmp_path):
    from nanotron.config import get_config_from_file

    path = tmp_path / "config.yaml"
    path.write_text(TrainerConfig(pp=PP, layers=8, microbatches=M).yaml(str(tmp_path / "ck")))
    return get_config_from_file(str(path))


def view(family: str, *, ours: bool = True, cap=None, layers=(2, 2, 2, 2)) -> EngineView:
    return EngineView(family, ours, family, PP, M, 1, cap, tuple(range(PP)), layers)


@pytest.mark.parametrize("family, ours, cap, inflight", [
    ("1f1b", False, None, (4, 3, 2, 1)),  # nanotron's 1F1B: pp - r on rank r
    ("afab", False, None, (M,) * PP),  # every microbatch before the first backward
    ("capped_1f1b", True, 2, (2, 2, 2, 1)),
    ("capped_1f1b", True, 1, (1, 1, 1, 1)),
    ("capped_1f1b", True, (3, 2, 2, 1), (3, 2, 2, 1)),
])
def test_the_prediction_is_the_schedules_in_flight_times_each_stages_stash(config, family, ours, cap, inflight):
    engine = view(family, ours=ours, cap=cap)
    stash, got = progress.predicted_stash(engine, config, config.model.model_config, attention=ATTENTION)
    assert got == inflight
    m = config.model.model_config
    model = ModelSpec("nanotron", layers=8, hidden=m.hidden_size, heads=m.num_attention_heads,
                      kv_heads=m.num_key_value_heads, ffn=m.intermediate_size, vocab=m.vocab_size)
    setup = TrainingSetup(seq=config.tokens.sequence_length, micro_batch=config.tokens.micro_batch_size,
                          sequence_parallel=False, param_bytes=4, act_bytes=4, fp32_grad_accum=False,
                          attention=ATTENTION)
    per_mb = [fp.stash_bytes for fp in stage_footprints(model, setup, engine.layers)]
    assert list(stash) == [n * b for n, b in zip(inflight, per_mb)]  # one stage a rank: in flight x its stash


def test_a_model_the_memory_model_does_not_cover_gets_a_reason(config):
    reason = progress.predicted_stash(view("1f1b", ours=False), config, object(), attention=ATTENTION)
    assert reason == "the memory model covers Llama-style models, not object"
    unknown = dataclasses.replace(view("1f1b", ours=False), family=None, name="MyEngine")
    reason = progress.predicted_stash(unknown, config, config.model.model_config, attention=ATTENTION)
    assert reason == "no schedule model for MyEngine"


def test_the_block_has_a_row_per_rank_and_says_what_is_missing(config):
    engine = view("capped_1f1b", cap=2)
    predicted = progress.predicted_stash(engine, config, config.model.model_config, attention=ATTENTION)
    measured = [Measured(r, 0, 0, 1024.0 * (r + 1), None) for r in range(PP - 1)]  # rank 3 did not report
    lines = progress.block(engine, predicted, measured, step=1).splitlines()
    assert all(line.startswith(progress.PREFIX) for line in lines) and len(lines) == 4 + PP
    assert lines[1] == (f"{progress.PREFIX}  schedule: cap 2; placement (rank of each stage) 0/1/2/3; "
                        "decoder layers per stage 2/2/2/2")
    assert "peak allocated" not in lines[3]  # no CUDA figure anywhere: no column
    rows = [line.split() for line in lines[4:]]
    assert [row[1:5] for row in rows] == [["0", "0", "2", "2"], ["1", "1", "2", "2"], ["2", "2", "2", "2"],
                                         ["3", "3", "2", "1"]]  # rank, stage, layers, in flight
    assert rows[0][-2:] == ["1.0", "KiB"] and rows[-1][-1] == "-"
    with_cuda = [dataclasses.replace(m, allocated=3 * 2**30) for m in measured]
    assert progress.block(engine, predicted, with_cuda, step=1).splitlines()[4].endswith("3.0 GiB")
    no_model = progress.block(engine, "no schedule model for x", measured, step=1).splitlines()
    assert "(predicted: no schedule model for x;" in no_model[2] and no_model[4].split()[4] == "-"
