"""Nothing of a step outlives it: nanotron's trainer over many steps keeps the same tensors
alive after each, under nanotron's 1F1B and under every family of ours.

A microbatch's call state (`StageCall`) is held by nanotron's receive node in the stage's
autograd graph until B; a tensor of the forward kept on it closed a cycle through
autograd's C++ nodes that Python's collector cannot free ([Note: no cycle through
autograd] in integration/nanotron/pipeline/stage_call.py). On the last stage that kept every
microbatch's fp32 logits, step after step. Here each rank counts, after every step and a
full collection, the `StageCall` objects alive and the bytes of every tensor storage alive.
"""

from __future__ import annotations

import gc

import pytest
import torch

from integration.nanotron.example import TrainerConfig
from pipeschedule.runtime.launch import spawn
from tests.nanotron.trainer_jobs import write_configs

pytestmark = pytest.mark.spawn

ENGINES = ("1f1b", "ps_1f1b", "capped_1f1b:cap=1", "zb_h1", "interleaved_1f1b:virtual=2", "zbv",
           "ps_1f1b:recompute=full", "zb_h1:recompute=1", "capped_1f1b:cap=1,offload=1")
STEPS = 4


def _alive() -> tuple[int, int]:
    """(StageCall objects, bytes of the distinct tensor storages) alive after a full collection."""
    from integration.nanotron.pipeline.stage_call import StageCall

    gc.collect()
    calls, storages = 0, {}
    for obj in gc.get_objects():
        if isinstance(obj, StageCall):
            calls += 1
        elif isinstance(obj, torch.Tensor) and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[storage.data_ptr() or id(storage)] = storage.nbytes()
    return calls, sum(storages.values())


def _child(rank: int, world: int, store, paths: list[str]) -> list[list[tuple[int, int]]]:
    from integration.nanotron import train

    train.prepare("gloo")
    out = []
    for path in paths:
        trainer = train.make_trainer(path)
        step, seen = trainer.training_step, []

        def counted(*args, _step=step, _seen=seen, **kwargs):
            result = _step(*args, **kwargs)
            _seen.append(_alive())
            return result

        trainer.training_step = counted
        trainer.train(train.synthetic_batches(trainer))
        out.append(seen)
        del trainer, step, counted
    return out


def test_every_engine_keeps_the_same_tensors_alive_step_after_step(tmp_path):
    configs = [TrainerConfig(engine=engine, pp=2, layers=4, hidden=32, ffn=64, vocab=256, seq=32, microbatches=4,
                             steps=STEPS, dtype="bfloat16", fp32_accumulation=True) for engine in ENGINES]
    per_rank = spawn(_child, 2, args=(write_configs(configs, tmp_path),), timeout=300)
    for rank, runs in enumerate(per_rank):
        for engine, seen in zip(ENGINES, runs, strict=True):
            assert len(seen) == STEPS, (engine, rank, seen)
            calls = [c for c, _ in seen]
            assert calls == [0] * STEPS, f"{engine}, rank {rank}: StageCall objects alive after each step {calls}"
            grown = [b - seen[1][1] for _, b in seen[1:]]
            assert grown == [0] * (STEPS - 1), f"{engine}, rank {rank}: tensor bytes alive after steps 3.. grow {grown}"
