"""A checkpoint saved under one engine, resumed under another whose layout differs
([Note: checkpoints across layouts] in integration/nanotron/patches/checkpoint.py).

Each job trains, in one process group, nanotron's trainer from YAML files: once
uninterrupted for 6 steps under nanotron's `1f1b`, then in three legs of 2 steps, each
saving a checkpoint that the next resumes (`checkpoints.resume_checkpoint_path`):
`1f1b` (nanotron's cost split, 3 layers on rank 0) -> `interleaved_1f1b:virtual=2`
(round-robin chunks) -> `zbv` (V shape: the LM head and loss on rank 0). Weights,
optimizer state (Adam moments and steps, fp32 master weights, ZeRO-1 slices), the
learning-rate schedule and the data position carry over: the legs' losses are the
uninterrupted run's, bit for bit, and so are the final weights. The learning-rate decay
is given in steps (`lr_decay_steps`), as nanotron's default follows each run's own
`train_steps`.
"""

from __future__ import annotations

import functools

import pytest
import torch

from integration.nanotron.patches import checkpoint
from integration.nanotron.pipeline.errors import UnsupportedConfigError
from trainer_jobs import TrainerConfig, checkpoints_path, resume_states, train_all

LAYOUTS = ("1f1b", "interleaved_1f1b:virtual=2", "zbv")
LEG = 2  # steps per leg
TOTAL = LEG * len(LAYOUTS)
BLOCK_RANKS = {  # embedding, 4 decoder layers, final norm, LM head, cast, loss
    "1f1b": [0, 0, 0, 0, 1, 1, 1, 1, 1],
    "interleaved_1f1b:virtual=2": [0, 0, 0, 1, 0, 1, 1, 1, 1],
    "zbv": [0, 0, 0, 1, 1, 0, 0, 0, 0],
}

JOBS = {  # the base config, the engine of each leg
    "pp2": ({}, LAYOUTS),
    # the tied weight's state: on two ranks, then on rank 0 only (zbv)
    "pp2-tied": ({"tie_embeddings": True}, LAYOUTS),
    "pp2-dp2-zero1-fp32acc": ({"dp": 2, "zero_stage": 1, "dtype": "bfloat16", "fp32_accumulation": True}, LAYOUTS),
    "pp2-tp2": ({"tp": 2}, LAYOUTS),  # each tp rank reads its own shards' state
    # one layout: nanotron's own optimizer loading (and the learning rate at resumption)
    "pp2-one-engine": ({}, ("1f1b",) * len(LAYOUTS)),
}


def configs(base: dict, chain: tuple[str, ...], tmp_path) -> list[TrainerConfig]:
    """The uninterrupted run (config 0), then the legs; leg i resumes config i's checkpoints."""
    common = dict(lr_decay_steps=TOTAL - 1, checkpoint_interval=LEG, **base)
    legs = [TrainerConfig(engine=engine, steps=LEG * (i + 1),
                          resume_from=str(checkpoints_path(tmp_path, i)) if i else None, **common)
            for i, engine in enumerate(chain)]
    return [TrainerConfig(engine="1f1b", steps=TOTAL, **common), *legs]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    def run(key):
        tmp_path = tmp_path_factory.mktemp(key)
        full, *legs = train_all(configs(*JOBS[key], tmp_path), tmp_path, timeout=600)
        return full, legs, tmp_path

    return functools.cache(run)


@pytest.mark.spawn
@pytest.mark.parametrize("key", list(JOBS))
def test_resumed_under_other_layouts_continues_as_uninterrupted(job, key):
    full, legs, _ = job(key)
    chain = JOBS[key][1]
    assert len(full["losses"]) == TOTAL
    assert [leg["block_ranks"] for leg in legs] == [BLOCK_RANKS[engine] for engine in chain]
    for i, leg in enumerate(legs):
        assert leg["losses"] == full["losses"][LEG * i:LEG * (i + 1)], (key, chain[i], leg["losses"], full["losses"])
    last = legs[-1]
    assert last["params"].keys() == full["params"].keys()
    for name, value in full["params"].items():
        assert last["params"][name].equal(value), (key, name)
    for replica in last["replicas"].values():
        assert all(replica[k].equal(v) for k, v in last["replicas"][0].items())


@pytest.mark.spawn
def test_each_leg_saved_where_the_next_resumed(job):
    _, _, tmp_path = job("pp2")
    for i in range(len(LAYOUTS)):
        assert (checkpoints_path(tmp_path, i + 1) / "latest.txt").read_text() == str(LEG * (i + 1))


@pytest.mark.spawn
def test_optimizer_state_follows_the_names_across_a_pp_size_change(tmp_path):
    """zbv at pp=2 saves; the same world resumes at pp=1, dp=2 (nanotron's own engine):
    every rank loads, by name, the state the pp=2 run ended with, at its learning rate.
    (Losses are not compared: the gradient norm sums over other ranks in another order.)"""
    saving = TrainerConfig(engine="zbv", steps=LEG, checkpoint_interval=LEG)
    resuming = TrainerConfig(engine="1f1b", pp=1, dp=2, steps=2 * LEG, resume_from=str(checkpoints_path(tmp_path, 0)))
    saved_ranks, loaded_ranks = resume_states([saving, resuming], tmp_path)
    saved = {name: state for rank in saved_ranks for name, state in rank["state"].items()}
    assert len(saved) == 3 + 4 * 6
    for rank in loaded_ranks:
        assert rank["state"].keys() == saved.keys()
        for name, state in rank["state"].items():
            assert state.keys() == saved[name].keys() == {"step", "exp_avg", "exp_avg_sq"}
            assert all(value.equal(saved[name][key]) for key, value in state.items()), name
        assert rank["lr"] == saved_ranks[0]["lr"] != [0.0]


# -- the pieces on their own ----------------------------------------------------------------


def test_shard_files_read_nanotrons_names(tmp_path):
    """Both of nanotron 0.4's file names (`optimizer_filename`): plain, saved by dp rank 0,
    and ZeRO-1, per dp rank; anything else in the folder is not a shard."""
    folder = tmp_path / "optimizer"
    folder.mkdir()
    for name in ("optimizer_pp-1-of-2_tp-0-of-2_exp-0-of-1.pt", "optimizer_pp-0-of-2_dp-1-of-2_tp-1-of-2_exp-0-of-1.pt",
                 "optimizer_config.json", "optimizer_pp-x-of-2_tp-0-of-1_exp-0-of-1.pt"):
        (folder / name).write_bytes(b"")
    plain, zero = sorted(checkpoint.shard_files(tmp_path), key=lambda f: f.dp is not None)
    assert (plain.pp, plain.pp_size, plain.dp, plain.tp, plain.tp_size) == (1, 2, None, 0, 2)
    assert (zero.pp, zero.dp, zero.dp_size, zero.tp) == (0, 1, 2, 1)


def test_state_is_taken_by_name_and_a_parameter_no_file_holds_is_named(tmp_path):
    """Positions follow this rank's order, hyperparameters come from the file; a name
    no file holds is refused, naming it."""
    saved = {"names": {0: "a.weight", 1: "b.weight"}, "param_groups": [{"lr": 1.0, "params": [0, 1]}],
             "state": {0: {"step": torch.tensor(2.0)}, 1: {"step": torch.tensor(3.0)}}}
    template = {"state": {}, "param_groups": [{"lr": 0.0, "params": [0, 1]}]}
    loaded = checkpoint.state_by_name(template, ["b.weight", "a.weight"], [(None, saved)], tmp_path)
    assert loaded["names"] == {0: "b.weight", 1: "a.weight"}
    assert loaded["state"][0]["step"] == 3.0 and loaded["state"][1]["step"] == 2.0
    assert loaded["param_groups"] == [{"lr": 1.0, "params": [0, 1]}]
    with pytest.raises(UnsupportedConfigError, match=r"no optimizer state for 1 parameter\(s\) of this rank \(c.w"):
        checkpoint.state_by_name(template, ["a.weight", "c.weight"], [(None, saved)], tmp_path)
