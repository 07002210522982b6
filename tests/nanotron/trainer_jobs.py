"""Run nanotron's own `DistributedTrainer` from YAML files, several trainings per process group.

A job is one spawned gloo process group (pipeschedule.runtime.launch.spawn) in which
every rank prepares the gloo mode once (`integration.nanotron.train.prepare`) and then,
for each config file in turn, builds nanotron's trainer from it, trains, and returns
`train.record_of(trainer)`: per-step losses, times and ledger peaks, block ranks and the
final parameters. One spawn per job keeps the tests to seconds per training.
`initial_all` builds the trainers only and returns their initial weights.
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


def initial_all(configs: list[TrainerConfig], tmp_path, *, timeout: float = 300.0) -> list[dict]:
    """Build nanotron's trainer from each config in turn in one process group (no
    training); per config, the full initial weights by name (`ours`: as the trainer
    initialised them; `nanotron`: after nanotron's own `LlamaForTraining.init_model_randomly`
    ran again on the same model, on each rank alone) and the replicas' copies."""
    worlds = {c.world for c in configs}
    if len(worlds) != 1:
        raise ValueError(f"one job runs one world size, got {sorted(worlds)}")
    paths = []
    for index, config in enumerate(configs):
        path = tmp_path / f"config-{index}.yaml"
        path.write_text(config.yaml(str(tmp_path / f"checkpoints-{index}")))
        paths.append(str(path))
    per_rank = spawn(_initial_child, worlds.pop(), args=(paths,), timeout=timeout)
    return [{"ours": assemble([rank[i] for rank in per_rank], "ours"),
             "nanotron": assemble([rank[i] for rank in per_rank], "nanotron")} for i in range(len(configs))]


def _initial_child(rank: int, world: int, store, paths: list[str]) -> list[dict]:
    from integration.nanotron import train

    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    train.prepare("gloo")
    out = []
    for path in paths:
        trainer = train.make_trainer(path)
        model, context = trainer.unwrapped_model, trainer.parallel_context
        ours = _shards(model)
        type(model).init_model_randomly(model, config=trainer.config)  # nanotron's own, not the instance's
        out.append({"dp_rank": torch.distributed.get_rank(context.dp_pg), "ours": ours, "nanotron": _shards(model)})
    return out


def _shards(model) -> dict:
    """Per parameter (tied-aware name): this rank's tensor, its (local, global) slices and full shape."""
    out = {}
    for name, param in model.named_parameters():
        if param.is_tied:
            name = param.get_tied_info().get_full_name_from_model(model)
        if param.is_sharded:
            info = param.get_sharded_info()
            pairs = [(p.local_slices, p.global_slices) for p in info.local_global_slices_pairs]
            shape = tuple(info.unsharded_shape)
        else:
            pairs, shape = [(..., ...)], tuple(param.shape)
        out[name] = (param.detach().float().clone(), pairs, shape)
    return out


def assemble(records: list[dict], key: str) -> dict:
    """The full tensors by name from every rank's shards (`key`: ours or nanotron), per dp
    replica: {dp_rank: {name: tensor}}. Of ours, a value two ranks both hold (a tied or
    tp-replicated parameter) must agree; nanotron's own draws a tied parameter on each
    rank separately (its trainer averages them afterwards), so the last rank's is kept."""
    replicas: dict[int, dict[str, torch.Tensor]] = {}
    for record in records:
        full = replicas.setdefault(record["dp_rank"], {})
        for name, (tensor, pairs, shape) in record[key].items():
            target = full.setdefault(name, torch.full(shape, float("nan")))
            for local, global_ in pairs:
                part = target[global_]
                assert key != "ours" or part.isnan().all() or part.equal(tensor[local]), (key, name)
                part.copy_(tensor[local])
    return replicas


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


__all__ = ["TrainerConfig", "assemble", "initial_all", "merge", "train_all"]
