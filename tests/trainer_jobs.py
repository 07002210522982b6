"""Run nanotron's own `DistributedTrainer` from YAML files, several trainings per process group.

A job is one spawned gloo process group (integration.nanotron.harness.spawn) in which
every rank prepares the gloo mode once (`integration.nanotron.train.prepare`) and then,
for each config file in turn, builds nanotron's trainer from it, trains, and returns
`train.record_of(trainer)`: per-step losses, times and ledger peaks, block ranks and the
final parameters. One spawn per job keeps the tests to seconds per training.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import yaml

from integration.nanotron.harness import spawn


@dataclass(frozen=True)
class TrainerConfig:
    """The knobs these tests turn; everything else is a small fixed nanotron config."""

    engine: str = "1f1b"
    pp: int = 2
    dp: int = 1
    tp: int = 1
    layers: int = 4
    microbatches: int = 4
    steps: int = 2
    zero_stage: int = 0
    fp32_accumulation: bool = False
    tie_embeddings: bool = False
    dtype: str = "float32"
    clip_grad: float | None = 1.0
    hidden: int = 32
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 128
    seq: int = 16
    micro_batch_size: int = 2
    seed: int = 42
    save_initial_state: bool = False
    init_from: str | None = None  # a checkpoint folder to load the initial weights from

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    def yaml(self, checkpoints: str) -> str:
        config = {
            "general": {"project": "pipeschedule-test", "run": "trainer", "seed": self.seed, "ignore_sanity_checks": True},
            "checkpoints": {"checkpoints_path": checkpoints, "checkpoint_interval": 10**6,
                            "save_initial_state": self.save_initial_state},
            "parallelism": {"dp": self.dp, "pp": self.pp, "tp": self.tp, "pp_engine": self.engine,
                            "tp_mode": "ALL_REDUCE", "tp_linear_async_communication": False},
            "model": {
                "dtype": self.dtype, "make_vocab_size_divisible_by": 1,
                "init_method": {"path": self.init_from} if self.init_from else {"std": 0.02},
                "model_config": {
                    "hidden_size": self.hidden, "intermediate_size": 2 * self.hidden,
                    "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
                    "num_hidden_layers": self.layers, "vocab_size": self.vocab,
                    "max_position_embeddings": self.seq, "tie_word_embeddings": self.tie_embeddings,
                },
            },
            "tokenizer": {"tokenizer_name_or_path": None},
            "tokens": {"sequence_length": self.seq, "train_steps": self.steps, "micro_batch_size": self.micro_batch_size,
                       "batch_accumulation_per_replica": self.microbatches},
            "optimizer": {
                "zero_stage": self.zero_stage, "weight_decay": 0.01, "clip_grad": self.clip_grad,
                "accumulate_grad_in_fp32": self.fp32_accumulation, "adam_eps": 1e-8, "adam_beta1": 0.9,
                "adam_beta2": 0.95, "torch_adam_is_fused": False,
                "learning_rate_scheduler": {"learning_rate": 1e-3, "lr_warmup_steps": 1, "lr_warmup_style": "linear",
                                            "lr_decay_style": "cosine", "min_decay_lr": 1e-4},
            },
            "logging": {"log_level": "warning", "log_level_replica": "warning", "iteration_step_info_interval": 1},
            "data": {"dataset": None, "seed": 1234},
        }
        text = yaml.safe_dump(config, sort_keys=False)
        # pp_engine is written plain (its ':' is not followed by a space: one YAML scalar)
        return text.replace(f"pp_engine: '{self.engine}'", f"pp_engine: {self.engine}")


def train_all(configs: list[TrainerConfig], tmp_path, *, timeout: float = 300.0) -> list[dict]:
    """Train each config in turn in one process group; per config, the ranks' records
    merged (`merge`). Every config of a job must have the same world size.

    [Note: same initial weights] nanotron initialises each rank's parameters from one
    seeded stream in the order the rank holds them, so a model laid out differently
    (another split, interleaving, a V shape) starts from other weights. The first config
    therefore saves its initial state (nanotron's `save_initial_state`) and every later
    one loads it (`init_method: {path: ...}`, nanotron's `load_weights`, by parameter
    name, whatever the layout)."""
    first = tmp_path / "checkpoints-0"
    configs = [dataclasses.replace(configs[0], save_initial_state=True)] + [
        dataclasses.replace(c, init_from=str(first / "0")) for c in configs[1:]]
    worlds = {c.world for c in configs}
    if len(worlds) != 1:
        raise ValueError(f"one job runs one world size, got {sorted(worlds)}")
    paths = []
    for index, config in enumerate(configs):
        path = tmp_path / f"config-{index}.yaml"
        path.write_text(config.yaml(str(tmp_path / f"checkpoints-{index}")))
        paths.append(str(path))
    per_rank = spawn(_child, worlds.pop(), (paths,), timeout=timeout)
    return [merge([rank[i] for rank in per_rank]) for i in range(len(configs))]


def _child(rank: int, world: int, paths: list[str]) -> list[dict]:
    from integration.nanotron import train

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
