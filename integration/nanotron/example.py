"""A complete nanotron YAML config for nanotron's own Llama, written from a few knobs.

    python -m integration.nanotron.example --pp 4 --engine capped_1f1b:cap=2 > config.yaml
    torchrun --nproc-per-node 4 -m integration.nanotron.train --config-file config.yaml

`TrainerConfig(...).yaml(checkpoints)` is a nanotron 0.4 config for `LlamaForTraining`:
synthetic data (`data.dataset: null`, which `integration.nanotron.train` feeds) or, with
`dataset` and `tokenizer`, text through nanotron's data path (a Hugging Face dataset name
or a local folder, e.g. of JSON-lines files; `integration/nanotron/data.py`), nanotron's
default logging (`info` on every rank: its per-step lines come from the rank of the
loss), AdamW with warmup and cosine decay, checkpoints under `checkpoints` (every
`checkpoint_interval` steps and at `save_initial_state`; `resume_from` resumes another
run's). The demo, the tests and the benchmarks write their configs with it; a user can
start from its output and edit it.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, fields

import yaml

from integration.nanotron.pipeline.engine_spec import parse_engine
from integration.nanotron.pipeline.errors import ParameterError
from pipeschedule.checks import check_int


@dataclass(frozen=True)
class TrainerConfig:
    """The knobs these tests turn; everything else is a small fixed nanotron config."""

    engine: str = "1f1b"
    pp: int = 2
    dp: int = 1
    tp: int = 1
    tp_mode: str = "ALL_REDUCE"  # or REDUCE_SCATTER (sequence parallel)
    tp_async: bool = False  # tp_linear_async_communication
    layers: int = 4
    microbatches: int = 4
    steps: int = 2
    zero_stage: int = 0
    fp32_accumulation: bool = False
    tie_embeddings: bool = False
    dtype: str = "float32"
    clip_grad: float | None = 1.0
    hidden: int = 32
    ffn: int | None = None  # MLP width; None: 2 * hidden
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 128
    seq: int = 16
    micro_batch_size: int = 2
    seed: int = 42
    save_initial_state: bool = False
    init_from: str | None = None  # a checkpoint folder to load the initial weights from
    dataset: str | None = None  # hf_dataset_or_datasets: a hub name or a local folder; None: synthetic data
    text_column: str = "text"
    tokenizer: str | None = None  # tokenizer_name_or_path (needed with a dataset)
    loading_workers: int = 1  # data.num_loading_workers (nanotron's default)
    log_level: str = "info"  # logging.log_level and log_level_replica
    checkpoint_interval: int = 10**6  # save a checkpoint every this many steps
    resume_from: str | None = None  # checkpoints_path of a run to resume (its latest.txt step)
    lr_decay_steps: int | None = None  # None: nanotron's default, train_steps - 1 (changes with train_steps)

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp", "layers", "microbatches", "steps", "hidden", "heads", "kv_heads", "vocab",
                     "seq", "micro_batch_size", "checkpoint_interval"):
            check_int(name, getattr(self, name))
        if self.tp_mode not in ("ALL_REDUCE", "REDUCE_SCATTER"):
            raise ParameterError(f"tp_mode must be ALL_REDUCE or REDUCE_SCATTER, got {self.tp_mode!r}")
        if self.zero_stage not in (0, 1):
            raise ParameterError(f"zero_stage must be 0 or 1 (nanotron 0.4), got {self.zero_stage!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ParameterError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.fp32_accumulation and self.dtype == "float32":
            raise ParameterError("fp32_accumulation needs a half-precision dtype (nanotron keeps fp32 copies of "
                             "bfloat16 / float16 weights), got dtype float32")
        if not isinstance(self.loading_workers, int) or self.loading_workers < 0:
            raise ParameterError(f"loading_workers must be an integer >= 0, got {self.loading_workers!r}")
        if self.dataset is not None and self.tokenizer is None:
            raise ParameterError(f"dataset {self.dataset!r} needs a tokenizer (a folder or a Hugging Face name)")
        if self.log_level not in ("debug", "info", "warning", "error", "critical"):
            raise ParameterError(f"log_level must be debug, info, warning, error or critical, got {self.log_level!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads or (self.hidden // self.heads) % 2:
            raise ParameterError(f"hidden {self.hidden} must divide into heads {self.heads} of even size, and heads "
                             f"into kv_heads {self.kv_heads}")

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    def yaml(self, checkpoints: str) -> str:
        """The config as nanotron's YAML (pp_engine written plain, as users write it)."""
        config = {
            "general": {"project": "pipeschedule-test", "run": "trainer", "seed": self.seed,
                        "ignore_sanity_checks": True},
            "checkpoints": {"checkpoints_path": checkpoints, "checkpoint_interval": self.checkpoint_interval,
                            "save_initial_state": self.save_initial_state, "resume_checkpoint_path": self.resume_from},
            "parallelism": {"dp": self.dp, "pp": self.pp, "tp": self.tp, "pp_engine": self.engine,
                            "tp_mode": self.tp_mode, "tp_linear_async_communication": self.tp_async},
            "model": {
                "dtype": self.dtype, "make_vocab_size_divisible_by": 1,
                "init_method": {"path": self.init_from} if self.init_from else {"std": 0.02},
                "model_config": {
                    "hidden_size": self.hidden, "intermediate_size": self.ffn or 2 * self.hidden,
                    "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
                    "num_hidden_layers": self.layers, "vocab_size": self.vocab,
                    "max_position_embeddings": self.seq, "tie_word_embeddings": self.tie_embeddings,
                },
            },
            "tokenizer": {"tokenizer_name_or_path": self.tokenizer},
            "tokens": {"sequence_length": self.seq, "train_steps": self.steps,
                       "micro_batch_size": self.micro_batch_size,
                       "batch_accumulation_per_replica": self.microbatches},
            "optimizer": {
                "zero_stage": self.zero_stage, "weight_decay": 0.01, "clip_grad": self.clip_grad,
                "accumulate_grad_in_fp32": self.fp32_accumulation, "adam_eps": 1e-8, "adam_beta1": 0.9,
                "adam_beta2": 0.95, "torch_adam_is_fused": False,
                "learning_rate_scheduler": {"learning_rate": 1e-3, "lr_warmup_steps": 1, "lr_warmup_style": "linear",
                                            "lr_decay_style": "cosine", "min_decay_lr": 1e-4,
                                            "lr_decay_steps": self.lr_decay_steps},
            },
            "logging": {"log_level": self.log_level, "log_level_replica": self.log_level,
                        "iteration_step_info_interval": 1},
            "data": {"dataset": self._dataset(), "seed": 1234, "num_loading_workers": self.loading_workers},
        }
        text = yaml.safe_dump(config, sort_keys=False)
        # pp_engine is written plain (its ':' is not followed by a space: one YAML scalar)
        return text.replace(f"pp_engine: '{self.engine}'", f"pp_engine: {self.engine}")

    def _dataset(self) -> dict | None:
        """nanotron's `PretrainDatasetsArgs` of `dataset` (None: synthetic data)."""
        if self.dataset is None:
            return None
        return {"hf_dataset_or_datasets": self.dataset, "hf_dataset_splits": "train",
                "text_column_name": self.text_column, "dataset_processing_num_proc_per_process": 1,
                "dataset_overwrite_cache": False}


HELP = {  # what each option of `main` sets, in nanotron's words
    "engine": "parallelism.pp_engine: nanotron's 1f1b or afab, or one of pipeschedule's (capped_1f1b:cap=2, zbv, ...)",
    "pp": "parallelism.pp: pipeline stages", "dp": "parallelism.dp: data-parallel replicas",
    "tp": "parallelism.tp: tensor-parallel ranks", "tp_mode": "parallelism.tp_mode: ALL_REDUCE or REDUCE_SCATTER",
    "tp_async": "parallelism.tp_linear_async_communication (true or false)",
    "layers": "model_config.num_hidden_layers: decoder layers",
    "microbatches": "tokens.batch_accumulation_per_replica: microbatches per step",
    "steps": "tokens.train_steps", "zero_stage": "optimizer.zero_stage: 0 or 1",
    "fp32_accumulation": "optimizer.accumulate_grad_in_fp32 (true or false; needs a half-precision dtype)",
    "tie_embeddings": "model_config.tie_word_embeddings (true or false)",
    "dtype": "model.dtype: float32, bfloat16 or float16", "clip_grad": "optimizer.clip_grad",
    "hidden": "model_config.hidden_size", "ffn": "model_config.intermediate_size (default 2 * hidden)",
    "heads": "model_config.num_attention_heads", "kv_heads": "model_config.num_key_value_heads",
    "vocab": "model_config.vocab_size", "seq": "tokens.sequence_length (and max_position_embeddings)",
    "micro_batch_size": "tokens.micro_batch_size: sequences per microbatch", "seed": "general.seed",
    "dataset": "data.dataset.hf_dataset_or_datasets: a local folder or a Hugging Face name (default: synthetic data)",
    "text_column": "data.dataset.text_column_name", "tokenizer": "tokenizer.tokenizer_name_or_path (needed with a "
    "dataset: a folder written by save_pretrained, or a Hugging Face name)",
    "loading_workers": "data.num_loading_workers", "log_level": "logging.log_level and log_level_replica",
    "checkpoint_interval": "checkpoints.checkpoint_interval: steps between checkpoints",
    "resume_from": "checkpoints.resume_checkpoint_path: a run's checkpoints to resume",
    "lr_decay_steps": "optimizer.learning_rate_scheduler.lr_decay_steps (default: nanotron's)",
}


def main(argv=None) -> int:
    """Print a config (the fields of `TrainerConfig` as options) to standard output; a bad
    value (an engine nanotron would refuse at load included) is one line, exit 2."""
    parser = argparse.ArgumentParser(prog="python -m integration.nanotron.example",
                                     description="Print a complete nanotron YAML config for nanotron's own Llama, "
                                                 "from a few knobs (a small model on synthetic data by default). "
                                                 "`pipeschedule plan --write` writes one for a planned model.")
    parser.add_argument("--checkpoints", default="checkpoints", help="checkpoints.checkpoints_path (default: "
                                                                    "checkpoints)")
    for field in fields(TrainerConfig):
        if field.name in ("save_initial_state", "init_from"):
            continue
        kind = {"bool": _boolean, "int": int, "float": float, "str": str}.get(str(field.type).split(" |")[0], str)
        parser.add_argument("--" + field.name.replace("_", "-"), type=kind, default=field.default,
                            help=f"{HELP[field.name]} (default: {field.default})")
    args = vars(parser.parse_args(argv))
    checkpoints = args.pop("checkpoints")
    try:
        parse_engine(args["engine"])  # the value nanotron's loader will read (a typo was written into the YAML)
        config = TrainerConfig(**args)
    except (TypeError, ParameterError) as err:
        print(f"integration.nanotron.example: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    sys.stdout.write(config.yaml(checkpoints))
    return 0


def _boolean(text: str) -> bool:
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


__all__ = ["HELP", "TrainerConfig", "main"]


if __name__ == "__main__":
    sys.exit(main())
