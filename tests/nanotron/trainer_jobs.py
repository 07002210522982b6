"""Run nanotron's own `DistributedTrainer` from YAML files, several trainings per process group.

A job is one spawned gloo process group (pipeschedule.runtime.launch.spawn) in which
every rank prepares the gloo mode once (`integration.nanotron.train.prepare`) and then,
for each config file in turn, builds nanotron's trainer from it, trains, and returns
`train.record_of(trainer)`: per-step losses, times and ledger peaks, block ranks and the
final parameters. One spawn per job keeps the tests to seconds per training.
`initial_all` builds the trainers only and returns their initial weights; `resume_states`
the optimizer state a resumed trainer loaded beside the one its checkpoint's run saved.
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
    integration/nanotron/patches/initial_weights.py), so no initial state is passed between them."""
    worlds = {c.world for c in configs}
    if len(worlds) != 1:
        raise ValueError(f"one job runs one world size, got {sorted(worlds)}")
    paths = write_configs(configs, tmp_path)
    per_rank = spawn(_child, worlds.pop(), args=(paths,), timeout=timeout)
    return [merge([rank[i] for rank in per_rank]) for i in range(len(configs))]


def checkpoints_path(tmp_path, index: int):
    """Where config `index` of a job saves its checkpoints (what a later config resumes)."""
    return tmp_path / f"checkpoints-{index}"


def write_configs(configs: list[TrainerConfig], tmp_path) -> list[str]:
    paths = []
    for index, config in enumerate(configs):
        path = tmp_path / f"config-{index}.yaml"
        path.write_text(config.yaml(str(checkpoints_path(tmp_path, index))))
        paths.append(str(path))
    return paths


def _child(rank: int, world: int, store, paths: list[str]) -> list[dict]:
    from integration.nanotron import train

    # nanotron's asynchronous tensor-parallel linears refuse to run without it (as its docs say)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    train.prepare("gloo")
    return [train.record_of(train.train(path, record=True)) for path in paths]


def initial_all(configs: list[TrainerConfig], tmp_path, *, block_numel: int | None = None,
                timeout: float = 300.0) -> list[dict]:
    """Build nanotron's trainer from each config in turn in one process group (no
    training); per config, the full initial weights by name (`ours`: as the trainer
    initialised them; `nanotron`: after nanotron's own `LlamaForTraining.init_model_randomly`
    ran again on the same model, on each rank alone) and the replicas' copies.
    `block_numel` replaces `initial_weights.BLOCK_NUMEL` in the ranks (small blocks make
    a tiny model's parameters span several)."""
    worlds = {c.world for c in configs}
    if len(worlds) != 1:
        raise ValueError(f"one job runs one world size, got {sorted(worlds)}")
    paths = write_configs(configs, tmp_path)
    per_rank = spawn(_initial_child, worlds.pop(), args=(paths, block_numel), timeout=timeout)
    return [{"ours": assemble([rank[i] for rank in per_rank], "ours"),
             "nanotron": assemble([rank[i] for rank in per_rank], "nanotron")} for i in range(len(configs))]


def _initial_child(rank: int, world: int, store, paths: list[str], block_numel: int | None) -> list[dict]:
    from integration.nanotron import train
    from integration.nanotron.patches import initial_weights

    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    train.prepare("gloo")
    if block_numel is not None:
        initial_weights.BLOCK_NUMEL = block_numel
    out = []
    for path in paths:
        trainer = train.make_trainer(path)
        model, context = trainer.unwrapped_model, trainer.parallel_context
        ours = _shards(model)
        type(model).init_model_randomly(model, config=trainer.config)  # nanotron's own, not the instance's
        out.append({"dp_rank": torch.distributed.get_rank(context.dp_pg), "ours": ours, "nanotron": _shards(model)})
    return out


def resume_states(configs: list[TrainerConfig], tmp_path, *, timeout: float = 300.0) -> tuple[list, list]:
    """Train every config but the last in turn, then build the last one's trainer only (it
    resumes a checkpoint of the others); per rank, the optimizer state by parameter name
    and the learning rates of the last config trained and of the one built."""
    worlds = {c.world for c in configs}
    if len(worlds) != 1:
        raise ValueError(f"one job runs one world size, got {sorted(worlds)}")
    per_rank = spawn(_resume_child, worlds.pop(), args=(write_configs(configs, tmp_path),), timeout=timeout)
    return [rank[0] for rank in per_rank], [rank[1] for rank in per_rank]


def _resume_child(rank: int, world: int, store, paths: list[str]) -> tuple[dict, dict]:
    from integration.nanotron import train

    train.prepare("gloo")
    for path in paths[:-1]:
        trained = train.train(path)
    return _optimizer_by_name(trained), _optimizer_by_name(train.make_trainer(paths[-1]))


def _optimizer_by_name(trainer) -> dict:
    state = trainer.optimizer.state_dict()
    return {"dp_rank": torch.distributed.get_rank(trainer.parallel_context.dp_pg),
            "lr": [group["lr"] for group in trainer.optimizer.param_groups],
            "state": {state["names"][i]: {k: v.clone() for k, v in s.items()} for i, s in state["state"].items()},
            "fp32": {k: v.clone() for k, v in state.get("gradient_accumulator", {}).items()}}


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
            "block_ranks": first[0]["block_ranks"], "replicas": replicas, "searched": first[0].get("searched")}


__all__ = ["TrainerConfig", "assemble", "checkpoints_path", "initial_all", "merge", "resume_states", "train_all"]
