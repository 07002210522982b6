"""nanotron's own trainer (`DistributedTrainer.train`) on nanotron's own `LlamaForTraining`,
built from a YAML file, with pipeschedule's engines against nanotron's 1F1B.

Every training runs two optimizer steps (AdamW, gradient clipping, warmup and cosine
schedule) on the same synthetic data; the losses of each step and every parameter after
the last step must be bitwise equal to nanotron's 1F1B under the same optimizer config.
Equal parameters after a step mean equal gradients (the optimizer is the same code on
the same values). Runs on CPU over gloo ([Note: nanotron over gloo]), flash-attn replaced
by the pure-torch stand-in.
"""

from __future__ import annotations

import functools

import pytest

from trainer_jobs import TrainerConfig, train_all

pytestmark = pytest.mark.spawn

SPLIT_BACKWARD = ("zb_h1", "zbv", "v_half", "v_min", "zb_h2", "dualpipev", "interleaved_zb:virtual=2")
PP2 = ("ps_1f1b", "ps_afab", "capped_1f1b:cap=1", "capped_1f1b:cap=1,split=1/3", "interleaved_1f1b:virtual=2",
       "capped_1f1b:cap=1,recompute=full", "capped_1f1b:cap=1,recompute=selective", "zb_h1:recompute=1",
       "v_min:recompute=full", "looped_bfs:virtual=2", "dualpipev:cap=3,recompute=full",
       "interleaved_zb:virtual=2,offload=0", "searched:cap=1") + SPLIT_BACKWARD


def assert_same(ours: dict, ref: dict) -> None:
    assert ours["losses"] == ref["losses"], (ours["engine"], ours["losses"], ref["losses"])
    assert ours["params"].keys() == ref["params"].keys()
    for name, value in ref["params"].items():
        assert ours["params"][name].equal(value), (ours["engine"], name, (ours["params"][name] - value).abs().max())


def assert_replicas_agree(result: dict) -> None:
    replicas = list(result["replicas"].values())
    for other in replicas[1:]:
        assert other.keys() == replicas[0].keys()
        assert all(other[key].equal(value) for key, value in replicas[0].items())


def _job(key, tmp_path_factory):
    base, engines = JOBS[key]
    configs = [TrainerConfig(engine="1f1b", **base)] + [TrainerConfig(engine=e, **base) for e in engines]
    results = train_all(configs, tmp_path_factory.mktemp(key), timeout=600)
    return results[0], dict(zip(engines, results[1:]))


JOBS = {
    "pp2": ({}, PP2),
    "pp2-tied": ({"tie_embeddings": True}, ("ps_1f1b", "interleaved_1f1b:virtual=2", "looped_bfs:virtual=2")
                 + SPLIT_BACKWARD),
    "pp2-tied-fp32acc": ({"tie_embeddings": True, "dtype": "bfloat16", "fp32_accumulation": True},
                         ("ps_1f1b", "interleaved_1f1b:virtual=2") + SPLIT_BACKWARD),
    "pp4": ({"pp": 4, "layers": 8, "microbatches": 8},
            ("ps_1f1b", "capped_1f1b:cap=2", "interleaved_1f1b:virtual=2", "zb_h1", "zbv", "v_min", "zb_h2",
             "dualpipev", "interleaved_zb:virtual=2", "looped_bfs:virtual=2", "searched:cap=2",
             "ps_1f1b:split=3/0/3/2", "zbv:split=1/1/1/0/1/1/1/2")),  # empty stages ([Note: empty stages])
    "pp2-dp2-zero1": ({"dp": 2, "zero_stage": 1, "dtype": "bfloat16", "fp32_accumulation": True},
                      ("capped_1f1b:cap=1", "interleaved_1f1b:virtual=2", "zb_h1", "zbv", "dualpipev",
                       "interleaved_zb:virtual=2", "searched:cap=1")),
    "pp2-dp2-ddp-fp32acc": ({"dp": 2, "dtype": "bfloat16", "fp32_accumulation": True},
                            ("capped_1f1b:cap=1", "interleaved_1f1b:virtual=2", "v_half")),
    "pp2-dp2-ddp": ({"dp": 2}, ("ps_1f1b", "interleaved_1f1b:virtual=2", "zb_h1")),
    "pp2-tp2": ({"tp": 2}, ("capped_1f1b:cap=1", "interleaved_1f1b:virtual=2", "zbv", "zb_h2", "dualpipev",
                            "looped_bfs:virtual=2", "searched")),
    "pp2-tp2-sequence-parallel": ({"tp": 2, "tp_mode": "REDUCE_SCATTER", "tp_async": True},
                                  ("capped_1f1b:cap=1", "interleaved_1f1b:virtual=2,recompute=1", "zb_h1")),
}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return functools.cache(lambda key: _job(key, tmp_path_factory))


@pytest.mark.parametrize("key", list(JOBS))
def test_every_engine_trains_as_nanotron_1f1b(job, key):
    ref, ours = job(key)
    assert ref["losses"] is not None and len(ref["losses"]) == 2
    assert_replicas_agree(ref)
    for result in ours.values():
        assert_same(result, ref)
        assert_replicas_agree(result)


def test_searched_runs_the_order_searched_for_its_first_steps_times(job):
    """[Note: searched engine]: the first step measured F, B and W of every stage, and the
    second ran the order searched for them (same losses and weights above)."""
    _, ours = job("pp4")
    searched = ours["searched:cap=2"]["searched"]
    assert searched is not None and len(searched["cost"]) == 4
    assert all(f > 0 and b > 0 and w >= 0 for f, b, w in searched["cost"])
    assert searched["seed"] is not None


def test_split_and_placement_from_the_yaml_are_applied(job):
    """`split=1/3` moves three of four layers to stage 1; interleaving puts 4 stages on
    ranks 0,1,0,1 and the V shapes on 0,1,1,0 (embedding ... loss: 1 + 4 + 4 blocks)."""
    ref, ours = job("pp2")
    assert ref["block_ranks"] == [0, 0, 0, 0, 1, 1, 1, 1, 1]  # nanotron's cost split: 3/1
    assert ours["capped_1f1b:cap=1,split=1/3"]["block_ranks"] == [0, 0, 1, 1, 1, 1, 1, 1, 1]
    assert ours["interleaved_1f1b:virtual=2"]["block_ranks"] == [0, 0, 0, 1, 0, 1, 1, 1, 1]
    assert ours["zbv"]["block_ranks"] == [0, 0, 0, 1, 1, 0, 0, 0, 0]


def test_stage_zero_stash_is_cap_over_pp(job):
    ref, ours = job("pp4")
    uncapped, capped = ours["ps_1f1b"]["stash"], ours["capped_1f1b:cap=2"]["stash"]
    assert capped[0][-1] * 4 == uncapped[0][-1] * 2  # stage 0: cap / pp of 1F1B, exactly
    assert capped[3][-1] == uncapped[3][-1]  # the last stage holds one microbatch either way


def test_recompute_keeps_less_and_trains_the_same(job):
    """recompute=full keeps each decoder layer's input only; selective drops the attention
    core's saved tensors (both bitwise equal to nanotron's 1F1B above)."""
    _, ours = job("pp2")
    plain = ours["capped_1f1b:cap=1"]["stash"]
    full = ours["capped_1f1b:cap=1,recompute=full"]["stash"]
    selective = ours["capped_1f1b:cap=1,recompute=selective"]["stash"]
    for rank in (0, 1):
        assert full[rank][-1] < selective[rank][-1] < plain[rank][-1], (full, selective, plain)


@pytest.mark.parametrize("key", ["pp2", "pp4"])
def test_pipeschedule_check_predicts_the_blocks_the_trainer_built(job, key, tmp_path):
    """`pipeschedule check` lays the model out from numbers alone ([Note: pre-flight] in
    integration/nanotron/check.py); nanotron's trainer built it, through its build_model
    (our hook under our engines, nanotron's cost split under its own): every block on the
    rank the check said."""
    from integration.nanotron.check import preflight

    base, engines = JOBS[key]
    ref, ours = job(key)
    for engine, result in [("1f1b", ref), *ours.items()]:
        path = tmp_path / "config.yaml"
        path.write_text(TrainerConfig(engine=engine, **base).yaml(str(tmp_path / "checkpoints")))
        assert list(preflight(str(path), memory=False).block_ranks) == result["block_ranks"], engine
