"""Where the bf16 gradients live, read from real runs of nanotron's trainer (issue 32), and
what `train_batch_iter` returns under data parallelism (issue 34).

nanotron's own 1F1B folds gradients into the fp32 accumulator after each microbatch's
whole backward, so every parameter of the stage holds its bf16 gradient at once;
pipeschedule's engines fold each one as autograd produces it ([Note: gradient folding]
in integration/nanotron/pipeline/grad_sync.py). A probe hook on every parameter, registered before
the engines', records the bf16 `.grad` bytes alive each time a gradient arrives; the
memory model's terms (`transient_per_param`, `largest_param` in pipeschedule/plan/memory.py)
must equal those maxima on every rank, from the model's sizes and the run's layer split
alone. Every engine must still train bitwise as nanotron's 1F1B (losses, and the fp32
gradients after the data-parallel sync).

Under DDP with the fp32 accumulator, the gradients read right after `train_batch_iter`
returns must already be the data-parallel average, equal on the replicas, for every
schedule ([Note: gradient sync]).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from integration.nanotron.example import TrainerConfig
from pipeschedule.plan.memory import ModelSpec, TrainingSetup, largest_param, stage_params, transient_per_param
from pipeschedule.runtime.launch import spawn

pytestmark = pytest.mark.spawn

# ffn 48: the embedding and the LM head (V*h = 4096 elements) are the largest parameters
# beside a layer's gate_up (2*48*32 = 3072), so the ranks differ in what is largest.
BASE = {"dtype": "bfloat16", "fp32_accumulation": True, "layers": 4, "hidden": 32, "ffn": 48, "vocab": 128,
        "microbatches": 4, "steps": 2}
SAME_LAYOUT = ("ps_1f1b", "ps_afab", "capped_1f1b:cap=1,recompute=full", "zb_h1")  # nanotron's split and placement
OURS = SAME_LAYOUT + ("interleaved_1f1b:virtual=2", "zbv")


def _probe(model) -> dict:
    """Post-accumulate-grad hooks on every parameter of `model` recording, each time a
    gradient arrives, the bf16 `.grad` bytes alive on the rank; the largest is kept."""
    params = [p for p in model.parameters() if p.requires_grad]
    seen = {"max_live_grad_bytes": 0}

    def hook(_param):
        live = sum(p.grad.nbytes for p in params if p.grad is not None)
        seen["max_live_grad_bytes"] = max(seen["max_live_grad_bytes"], live)

    for p in params:
        p.register_post_accumulate_grad_hook(hook)
    return seen


def _child(rank: int, world: int, store, paths: list[str]) -> list[dict]:
    import nanotron.distributed as dist

    from integration.nanotron import train
    from integration.nanotron.pipeline.step import pipeline_blocks

    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    train.prepare("gloo")
    out = []
    for path in paths:
        trainer = train.make_trainer(path)
        seen = _probe(trainer.unwrapped_model)  # before the engine's first step registers its own hooks
        calls = []
        engine = trainer.config.parallelism.pp_engine  # the trainer takes it as pipeline_engine in train()
        original = engine.train_batch_iter

        def measured(*args, original=original, calls=calls, **kwargs):
            outputs = original(*args, **kwargs)
            accumulator = kwargs["grad_accumulator"]
            returned = accumulator._contiguous_fp32_grad_buffer.clone()
            handle = accumulator.fp32_grads_allreduce_handle
            if handle is not None:
                handle.wait()  # what the trainer does next under DDP (trainer.py:334-339)
            losses = [o["loss"] for o in outputs if isinstance(o["loss"], torch.Tensor)]
            calls.append({"returned": returned, "synced": accumulator._contiguous_fp32_grad_buffer.clone(),
                          "loss": float(torch.stack(losses).sum()) if losses else None})
            return outputs

        engine.train_batch_iter = measured
        trainer.train(train.synthetic_batches(trainer))
        context = trainer.parallel_context
        pp_rank, blocks = dist.get_rank(context.pp_pg), [b.rank for b in pipeline_blocks(trainer.unwrapped_model)]
        layer_ranks = blocks[1:-4]  # nanotron's Llama: embedding, the decoder layers, four tail blocks
        out.append({
            "pp_rank": pp_rank, "dp_rank": dist.get_rank(context.dp_pg), "calls": calls,
            "losses": [c["loss"] for c in calls], "max_live_grad_bytes": seen["max_live_grad_bytes"],
            "layers": layer_ranks.count(pp_rank), "first": blocks[0] == pp_rank, "last": blocks[-1] == pp_rank,
        })
    return out


def _run(key: str, engines: tuple[str, ...], tmp_path_factory, **knobs) -> dict[str, list[dict]]:
    folder = tmp_path_factory.mktemp(key)
    configs = [TrainerConfig(engine=e, **{**BASE, **knobs}) for e in engines]
    paths = []
    for index, config in enumerate(configs):
        path = folder / f"config-{index}.yaml"
        path.write_text(config.yaml(str(folder / f"checkpoints-{index}")))
        paths.append(str(path))
    per_rank = spawn(_child, configs[0].world, args=(paths,), timeout=600)
    return {engine: [rank[i] for rank in per_rank] for i, engine in enumerate(engines)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return functools.cache(lambda key: _run(key, ("1f1b",) + OURS, tmp_path_factory, **JOBS[key]))


JOBS = {"pp2": {}, "pp2-dp2": {"dp": 2}}
SPEC = ModelSpec("test", layers=4, hidden=32, heads=4, kv_heads=2, ffn=48, vocab=128)


def test_nanotron_holds_the_stage_gradients_ours_one_parameter(runs):
    """The model's terms, from the sizes and the run's split, equal the measured maxima."""
    result = runs("pp2")
    nanotron, ours = TrainingSetup(tp=1, seq=16, grad_fold="backward"), TrainingSetup(tp=1, seq=16)
    for rank in result["1f1b"]:
        params = stage_params(SPEC, rank["layers"], first=rank["first"], last=rank["last"], tp=1)
        assert rank["max_live_grad_bytes"] == transient_per_param(nanotron) * params
        assert transient_per_param(ours) == 0
    for engine in OURS:
        for rank in result[engine]:
            largest = largest_param(SPEC, 1, rank["layers"], first=rank["first"], last=rank["last"])
            assert rank["max_live_grad_bytes"] == 2 * largest, (engine, rank["pp_rank"])
    # the two measurements differ: nanotron's maximum is the whole stage, over twice ours
    for theirs, mine in zip(result["1f1b"], result["ps_1f1b"]):
        assert theirs["max_live_grad_bytes"] > 2 * mine["max_live_grad_bytes"] > 0


@pytest.mark.parametrize("key", list(JOBS))
def test_engines_of_nanotron_layout_train_as_nanotron_1f1b(runs, key):
    """Folding changes no value: the losses and every step's synced fp32 gradients equal
    nanotron's 1F1B's to the bit (engines whose layout differs start from other weights
    here; tests/nanotron/test_nanotron_trainer.py compares them from the same weights)."""
    result = runs(key)
    ref = result["1f1b"]
    for engine in SAME_LAYOUT:
        for mine, theirs in zip(result[engine], ref):
            assert (mine["pp_rank"], mine["dp_rank"]) == (theirs["pp_rank"], theirs["dp_rank"])
            assert mine["losses"] == theirs["losses"], engine
            assert len(mine["calls"]) == len(theirs["calls"]) == BASE["steps"]
            for step, (a, b) in enumerate(zip(mine["calls"], theirs["calls"])):
                assert a["synced"].equal(b["synced"]), (engine, step)


def test_gradients_are_averaged_when_train_batch_iter_returns(runs):
    """Under DDP with the accumulator: what the call returns with is what the trainer's
    wait gives, and the replicas agree (nanotron's own 1F1B is not held to this)."""
    result = runs("pp2-dp2")
    for engine in OURS:
        by_pp: dict[int, list] = {}
        for rank in result[engine]:
            for call in rank["calls"]:
                assert call["returned"].equal(call["synced"]), engine
            by_pp.setdefault(rank["pp_rank"], []).append(rank["calls"])
        for replicas in by_pp.values():
            for a, b in zip(*replicas):
                assert a["returned"].equal(b["returned"]), engine
                assert not torch.all(a["returned"] == 0)
