"""Real text through nanotron's own data path, checked against the model before the trainer is built.

[Note: nanotron's data path] nanotron 0.4's `run_train.py` (not in the wheel; the
repository's at the v0.4 tag) feeds `DistributedTrainer.train` from a Hugging Face
dataset in four calls of `nanotron.dataloader`, all under `main_rank_first(world_pg)` so
that world rank 0 tokenizes and caches first and the others read its cache:

    get_datasets(hf_dataset_or_datasets, splits)["train"]   a hub name, a local folder
                                                            (JSON lines, CSV, Parquet,
                                                            text), or a {name: fraction} mix
    AutoTokenizer.from_pretrained(tokenizer_name_or_path)   pad = eos, padding on the left
    clm_process(raw, tokenizer, text_column_name, ...)      the texts concatenated and cut
                                                            into samples of seq + 1 tokens
    get_train_dataloader(..., consumed_train_samples, seed) each data-parallel replica
                                                            reads its own shard (torch's
                                                            DistributedSampler over the
                                                            dp group, shuffled by
                                                            `data.seed`); inputs on the
                                                            model's input rank, labels on
                                                            its output rank, TensorPointers
                                                            elsewhere

`load` and `train_dataloader` are those four calls, split in two: `load` (the raw
dataset and the tokenizer) runs before the trainer is built, so that what cannot work
is refused in one line before any GPU memory is touched: a dataset folder that does not
exist, a text column the dataset lacks, a tokenizer with more tokens than the model's
`vocab_size`, a `sequence_length` over `max_position_embeddings`. `train_dataloader`
runs once the trainer exists (it needs the model's input and output ranks and the
trainer's `consumed_train_samples`).

Resumption: a trainer started from a checkpoint (`checkpoints.resume_checkpoint_path`)
has read `consumed_train_samples` from it; nanotron's sampler skips that many samples
(each replica its share), so the data continues where the checkpointed run stopped.
One epoch is all nanotron's loader gives: `train_dataloader` refuses, in one line, a
run whose remaining steps need more samples than are left.

[Note: transformers 5 and nanotron 0.4] nanotron 0.4's `clm_process` tokenizes with
`tokenizer.batch_encode_plus`, which transformers 5 removed (calling the tokenizer
does the same); `_EncodePlus` gives a tokenizer without it that one method.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

from integration.nanotron.pipeline.errors import DataError

from nanotron.config import PretrainDatasetsArgs

PACKAGES = ("datasets", "transformers")  # the `data` extra (pyproject.toml); `tokenizers` comes with transformers
DATA_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".txt", ".arrow")


@dataclass(frozen=True)
class TextData:
    """The raw training split and the tokenizer of a config, loaded and checked against
    its model (`load`); what `train_dataloader` turns into nanotron's dataloader."""

    raw: Any  # datasets.Dataset
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    source: str  # the dataset as the config names it, for messages


def load(config) -> TextData | None:
    """The checked dataset and tokenizer of a nanotron `Config`; None where it asks for
    synthetic data (`data.dataset: null`). Raises `DataError` naming the value."""
    dataset = config.data.dataset if config.data is not None else None
    if dataset is None:
        return None
    if not isinstance(dataset, PretrainDatasetsArgs):
        raise DataError(f"data.dataset is a {type(dataset).__name__}; this launcher reads nanotron 0.4's "
                        "PretrainDatasetsArgs (hf_dataset_or_datasets, text_column_name, ...)")
    _check_packages()
    _quiet_progress_bars()
    _check_sequence(config)
    _check_sources(dataset.hf_dataset_or_datasets)
    tokenizer = load_tokenizer(config.tokenizer.tokenizer_name_or_path)
    _check_vocabulary(tokenizer, config)
    raw = load_raw(dataset)
    _check_column(raw, dataset)
    return TextData(raw=raw, tokenizer=tokenizer, source=_shown(dataset.hf_dataset_or_datasets))


def train_dataloader(trainer, text: TextData):
    """nanotron's training dataloader of `text` for this rank, as run_train.py builds it
    ([Note: nanotron's data path]), continuing at the trainer's consumed samples."""
    from nanotron.dataloader import clm_process, get_train_dataloader
    from nanotron.parallel.pipeline_parallel.utils import get_input_output_pp_ranks
    from nanotron.utils import main_rank_first

    import torch

    config, context = trainer.config, trainer.parallel_context
    args = config.data.dataset
    input_pp_rank, output_pp_rank = get_input_output_pp_ranks(model=trainer.model)
    with main_rank_first(context.world_pg):
        samples = clm_process(
            raw_dataset=text.raw, tokenizer=_EncodePlus.around(text.tokenizer), text_column_name=args.text_column_name,
            dataset_processing_num_proc_per_process=args.dataset_processing_num_proc_per_process,
            dataset_overwrite_cache=args.dataset_overwrite_cache, sequence_length=trainer.sequence_length)
        dataloader = get_train_dataloader(
            train_dataset=samples, sequence_length=trainer.sequence_length, parallel_context=context,
            input_pp_rank=input_pp_rank, output_pp_rank=output_pp_rank, micro_batch_size=trainer.micro_batch_size,
            consumed_train_samples=trainer.consumed_train_samples,
            dataloader_num_workers=config.data.num_loading_workers, seed_worker=config.data.seed,
            dataloader_drop_last=True)
    if not torch.cuda.is_available():
        dataloader.pin_memory = False  # (torch warns on every rank that there is nothing to pin for)
    check_enough(len(samples), dp=context.dp_pg.size(), micro_batch_size=trainer.micro_batch_size,
                 microbatches=trainer.n_micro_batches_per_batch, consumed=trainer.consumed_train_samples,
                 start_step=trainer.start_iteration_step, train_steps=config.tokens.train_steps, source=text.source)
    return dataloader


def check_enough(samples: int, *, dp: int, micro_batch_size: int, microbatches: int, consumed: int,
                 start_step: int, train_steps: int, source: str) -> None:
    """Refuse a run whose steps `start_step + 1 .. train_steps` need more microbatches than
    one epoch of `samples` has left for each data-parallel replica after the `consumed`
    samples. nanotron's sampler gives each replica floor(samples / dp) of them (a torch
    DistributedSampler with drop_last), skips consumed / dp of those, and its DataLoader
    drops a last partial microbatch."""
    left = samples // dp - consumed // dp
    steps_left = train_steps - start_step
    if max(left, 0) // micro_batch_size >= steps_left * microbatches:
        return
    possible = start_step + max(left, 0) // micro_batch_size // microbatches
    raise DataError(
        f"the dataset {source} gives {samples} samples; steps {start_step + 1}..{train_steps} need {steps_left} x "
        f"{micro_batch_size * microbatches * dp} (micro_batch_size {micro_batch_size} x batch_accumulation_per_replica "
        f"{microbatches} x dp {dp}) but after the {consumed} consumed one epoch has {max(left, 0)} per replica left: "
        f"set tokens.train_steps <= {possible} or give more text")


# -- what load checks, each before the trainer exists ------------------------------------------------


def _check_packages() -> None:
    missing = [name for name in PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise DataError(f"data.dataset is set, which needs the package(s) {', '.join(missing)}: "
                        "pip install 'pipeschedule[data]' (in a checkout: pip install -e '.[data]')")


def _quiet_progress_bars() -> None:
    """datasets' progress bars (building the split, tokenizing) on world rank 0 only: the
    other ranks do the same work, or read rank 0's cache."""
    if os.environ.get("RANK", "0") != "0":
        import datasets

        datasets.disable_progress_bars()


def _check_sequence(config) -> None:
    seq = config.tokens.sequence_length
    limit = getattr(config.model.model_config, "max_position_embeddings", None)
    if limit is not None and seq > limit:
        raise DataError(f"tokens.sequence_length {seq} is over the model's max_position_embeddings {limit}: "
                        f"set sequence_length <= {limit} or raise max_position_embeddings")


def _check_sources(sources) -> None:
    """Each dataset named (a string, or the keys of a {name: fraction} mix) that is meant
    as a local path must be a folder that exists ([Note: local or hub])."""
    names = list(sources) if isinstance(sources, (dict, list)) else [sources]
    for name in names:
        if not isinstance(name, str) or not name:
            raise DataError(f"data.dataset.hf_dataset_or_datasets names {_shown(name)}; accepted: a Hugging Face "
                            "dataset name, a local folder, or a mapping of those to fractions")
        path = os.path.expanduser(name)
        if os.path.isfile(path):
            raise DataError(f"data.dataset.hf_dataset_or_datasets {name!r} is a file; nanotron's get_datasets "
                            "loads a folder (of .jsonl, .json, .csv, .parquet or .txt files) or a hub name: put the "
                            "file in a folder and name the folder")
        if not os.path.exists(path) and _is_local(name):
            raise DataError(f"data.dataset.hf_dataset_or_datasets: no such folder {name!r} (accepted: a local folder "
                            "of .jsonl, .json, .csv, .parquet or .txt files, or a Hugging Face dataset name such as "
                            "'org/name')")


def _is_local(name: str) -> bool:
    """[Note: local or hub] A name that does not exist on disk is a hub name (`org/name`,
    or `name`) unless it can only be a path: absolute, starting with `.` or `~`, more than
    one `/`, or ending in a data file's suffix."""
    return (os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1
            or name.lower().endswith(DATA_SUFFIXES))


def load_tokenizer(name: str | None):
    """`AutoTokenizer.from_pretrained(name)` as run_train.py uses it (pad token = eos,
    padding on the left); refused in one line when `name` is unset or cannot be loaded."""
    if not name:
        raise DataError("data.dataset is set but tokenizer.tokenizer_name_or_path is not: name the tokenizer (a "
                        "Hugging Face name, or a folder written by save_pretrained)")
    path = os.path.expanduser(name)
    if not os.path.exists(path) and _is_local(name):
        raise DataError(f"tokenizer.tokenizer_name_or_path: no such folder {name!r} (accepted: a folder written by "
                        "a tokenizer's save_pretrained, or a Hugging Face name)")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as err:  # noqa: BLE001  (OSError, ValueError, hub errors: each says what is wrong)
        raise DataError(f"cannot load the tokenizer {name!r} (tokenizer.tokenizer_name_or_path): "
                        f"{type(err).__name__}: {_one_line(err)}") from None
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def _check_vocabulary(tokenizer, config) -> None:
    tokens, vocab = len(tokenizer), config.model.model_config.vocab_size
    if tokens > vocab:
        name = config.tokenizer.tokenizer_name_or_path
        raise DataError(f"the tokenizer {name!r} has {tokens} tokens but model.model_config.vocab_size is {vocab}: "
                        f"token ids up to {tokens - 1} need an embedding row; set vocab_size >= {tokens}")


def load_raw(dataset: PretrainDatasetsArgs):
    """The training split, by nanotron's `get_datasets`; refused in one line when it
    cannot be loaded or the splits leave out "train" (run_train.py trains on it)."""
    from nanotron.dataloader import get_datasets

    splits = dataset.hf_dataset_splits
    listed = [splits] if isinstance(splits, str) else list(splits)
    if "train" not in listed:
        raise DataError(f"data.dataset.hf_dataset_splits is {_shown(splits)}; nanotron's run_train.py trains on the "
                        "'train' split: list it")
    try:
        return get_datasets(hf_dataset_or_datasets=dataset.hf_dataset_or_datasets, splits=splits)["train"]
    except Exception as err:  # noqa: BLE001  (datasets' and the hub's errors: each says what is wrong)
        raise DataError(f"cannot load the dataset {_shown(dataset.hf_dataset_or_datasets)} "
                        f"(data.dataset.hf_dataset_or_datasets): {type(err).__name__}: {_one_line(err)}") from None


def _check_column(raw, dataset: PretrainDatasetsArgs) -> None:
    column = dataset.text_column_name
    if column not in raw.column_names:
        raise DataError(f"data.dataset.text_column_name {column!r} is not a column of the dataset "
                        f"{_shown(dataset.hf_dataset_or_datasets)} (its columns: {', '.join(raw.column_names)})")


class _EncodePlus:
    """A tokenizer with `batch_encode_plus` ([Note: transformers 5 and nanotron 0.4])."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def around(cls, tokenizer):
        return tokenizer if hasattr(tokenizer, "batch_encode_plus") else cls(tokenizer)

    def batch_encode_plus(self, texts, **kwargs):
        return self.tokenizer(texts, **kwargs)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or "(no message)"


def _shown(value) -> str:
    return repr(value) if isinstance(value, str) else str(value)


__all__ = ["TextData", "check_enough", "load", "load_raw", "load_tokenizer", "train_dataloader"]
