"""Run nanotron's own `DistributedTrainer` from YAML files, several trainings per process group.

A job is one spawned gloo process group (pipeschedule.runtime.launch.spawn) in which
every rank prepares the gloo mode once (`integration.nanotron.train.prepare`) and then,
for each config file in turn, builds nanotron's trainer from it, trains, and returns
`train.record_of(trainer)`: per-step losses, times and ledger peaks, block ranks and the
final parameters. One spawn per job keeps the tests to seconds per training.
"""

from __future__ import annotations

import os

import torch

from integration.nanotron.example import TrainerConfig
from pipeschedule.runtime.launch import spawn


def train_all(configs: list[TrainerConfig], tmp_path, *, timeout: float = 300.0) -> list[dict]:
    """Train each config in turn in one process group; per config, the ranks' records
    merged (`merge`). Every config of a job must have the same world size.

    Every config starts from its own random initialisation: whatever the engine and
    layout, the same weights for the same seed ([Note: same initial weights] in
    integration/nanotron/initial_weights.py), so no initial state is passed between them."""
    worlds = {c.world for c in configs}
    if len(worlds) != 1:
        raise ValueError(f"one job runs one world size, got {sorted(worlds)}")
    paths = []
    for index, config in enumerate(configs):
        path = tmp_path / f"config-{index}.yaml"
        path.write_text(config.yaml(str(tmp_path / f"checkpoints-{index}")))
        paths.append(str(path))
    per_rank = spawn(_child, worlds.pop(), args=(paths,), timeout=timeout)
    return [merge([rank[i] for rank in per_rank]) for i in range(len(configs))]


def _child(rank: int, world: int, store, paths: list[str]) -> list[dict]:
    from integration.nanotron import train

    # nanotron's asynchronous tensor-parallel linears refuse to run without it (as its docs say)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    train.prepare("gloo")
    return [train.record_of(train.train(path, record=True)) for path in paths]


def merge(records: list[dict]) -> dict:
    """One training's records from every rank: losses per step (from the loss rank of
    data-parallel replica 0), parameters by name (replica 0 and tp rank 0, all pp ranks),
    per pp rank the ledger's stash peaks, block ranks."""
    first = [r for r in records if r["dp_rank"] == 0 and r["tp_rank"] == 0]
    losses = next(([s["loss"] for s in r["steps"]] for r in first if r["steps"][0]["loss"] is not None), None)
    params: dict[str, torch.Tensor] = {}
    for record in first:
        params.update(record["params"])
    stash = {r["pp_rank"]: [s["ledger"]["stash_peak_bytes"] if s["ledger"] else None for s in r["steps"]]
             for r in first}
    replicas = {}
    for record in records:
        replicas.setdefault(record["dp_rank"], {}).update(
            {(name, record["tp_rank"]): p for name, p in record["params"].items()})
    return {"engine": first[0]["engine"], "losses": losses, "params": params, "stash": stash,
            "block_ranks": first[0]["block_ranks"], "replicas": replicas}


__all__ = ["TrainerConfig", "merge", "train_all"]
