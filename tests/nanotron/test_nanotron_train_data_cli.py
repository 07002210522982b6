"""The users' launch on real text, as they run it: `torchrun --nproc-per-node 2 -m
integration.nanotron.train --config-file CONFIG` (two CPU ranks, gloo, pp=2) with
`data.dataset` a local folder of JSON lines and a tokenizer folder, made here offline.
What the user reads: one block from rank 0 after the first step, then nanotron's own
per-step lines; a config whose data cannot feed the model: one line, once."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from integration.nanotron.example import TrainerConfig
from text_corpus import write_corpus, write_tokenizer

pytestmark = pytest.mark.spawn

SEQ = 16


def launch(tmp_path, config: TrainerConfig, *extra: str, timeout: float = 240.0):
    """torchrun with two ranks on `config`'s YAML, offline, datasets' cache in tmp_path."""
    path = tmp_path / "config.yaml"
    path.write_text(config.yaml(str(tmp_path / "checkpoints")))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
               "integration.nanotron.train", "--config-file", str(path), *extra]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf")}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture
def text_config(tmp_path) -> TrainerConfig:
    corpus = write_corpus(tmp_path / "corpus", 40 * SEQ + 1)
    tokenizer = write_tokenizer(tmp_path / "tokenizer")
    return TrainerConfig(engine="capped_1f1b:cap=1", pp=2, steps=3, microbatches=4, micro_batch_size=2, seq=SEQ,
                         vocab=64, dataset=str(corpus), tokenizer=str(tokenizer), loading_workers=0)


def test_trains_on_text_and_shows_one_block_then_nanotrons_lines(tmp_path, text_config):
    result = launch(tmp_path, text_config, "--record", str(tmp_path / "record"))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    block = [i for i, line in enumerate(lines) if "pipeschedule: " in line]
    # one block, logged by world rank 0 in nanotron's format, before nanotron's line of step 1
    assert len(block) == 6 and block == list(range(block[0], block[0] + 6)), "\n".join(lines[-40:])
    assert all("[INFO|DP=0|PP=0|TP=0]: pipeschedule: " in lines[i] for i in block)
    text = "\n".join(lines[i].split("]: ", 1)[1] for i in block)
    assert "pipeschedule: engine capped_1f1b:cap=1 (pipeschedule), family capped_1f1b, pp 2, m 4" in text
    assert "cap 1; placement (rank of each stage) 0/1; decoder layers per stage 3/1" in text
    rows = [re.split(r"\s{2,}", lines[i].split("pipeschedule: ", 1)[1].strip()) for i in block[-2:]]
    assert [row[:4] for row in rows] == [["0", "0", "3", "1"], ["1", "1", "1", "1"]]  # rank, stage, layers, in flight
    steps = [i for i, line in enumerate(lines) if re.search(r"iteration: \d+ / 3 \|", line)]
    assert len(steps) == 3 and block[-1] < steps[0], "\n".join(lines[-40:])  # nanotron's own, after the block
    assert all("lm_loss: " in lines[i] and "tokens_per_sec: " in lines[i] for i in steps)
    record = json.loads((tmp_path / "record" / "rank1.json").read_text())
    assert [s["step"] for s in record["steps"]] == [1, 2, 3] and all(s["loss"] > 0 for s in record["steps"])
    first = record["first_step"]  # the block's figures
    assert first["measured_by"] == "ledger" and first["predicted_inflight"] == [1, 1]
    for predicted, measured in zip(first["predicted_stash"], first["measured_stash"]):
        assert abs(predicted - measured) <= 0.1 * measured, first  # the memory model, within 10% on CPU


def test_a_text_column_the_dataset_lacks_is_refused_once_by_rank_0(tmp_path, text_config):
    result = launch(tmp_path, dataclasses.replace(text_config, text_column="body"), timeout=120)
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("integration.nanotron.train rank")]
    assert ours == [f"integration.nanotron.train rank 0: data.dataset.text_column_name 'body' is not a column of "
                    f"the dataset '{tmp_path / 'corpus'}' (its columns: text)"], result.stderr[-3000:]
    assert "[INFO" not in result.stdout  # refused before the trainer: nothing of nanotron's ran


USER_SCRIPT = '''\
"""A user's own launch script: nanotron imported first, no pipeschedule import line."""
import argparse
import os
import sys

from nanotron import logging  # the nanotron 0.4 wheel alone cannot import this (its import cycle)
from nanotron.trainer import DistributedTrainer

from integration.nanotron import data

parser = argparse.ArgumentParser()
parser.add_argument("--config-file", required=True)
trainer = DistributedTrainer(parser.parse_args().config_file)
engine = trainer.config.parallelism.pp_engine
if os.environ["RANK"] == "0":  # one rank, one write: two ranks' prints share the pipe and may interleave
    sys.stdout.flush()
    print(f"engine: {type(engine).__name__} {engine.spec}", flush=True)
trainer.train(data.train_dataloader(trainer, data.load(trainer.config)))
'''


def test_a_users_own_script_runs_unchanged_with_our_engines(tmp_path, text_config):
    """`-m integration.nanotron.run SCRIPT ARGS`: the script imports nanotron before anything
    of ours, and trains with capped_1f1b, a name only pipeschedule's import teaches nanotron."""
    script = tmp_path / "run_train.py"
    script.write_text(USER_SCRIPT)
    path = tmp_path / "config.yaml"
    path.write_text(dataclasses.replace(text_config, steps=2).yaml(str(tmp_path / "checkpoints")))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
               "integration.nanotron.run", str(script), "--config-file", str(path)]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    engine = "engine: PipescheduleEngine capped_1f1b:cap=1"
    assert engine in result.stdout, result.stdout[-2000:]
    assert len(re.findall(r"iteration: \d / 2 \| .*lm_loss: ", result.stdout)) == 2, result.stdout[-2000:]


DUMMY_SCRIPT = '''\
"""A fork's run_train.py on nanotron's own dummy data (run_train.py's `data: null` path)."""
import argparse

from nanotron.dataloader import dummy_infinite_data_generator
from nanotron.parallel.pipeline_parallel.utils import get_input_output_pp_ranks
from nanotron.trainer import DistributedTrainer

parser = argparse.ArgumentParser()
parser.add_argument("--config-file", required=True)
trainer = DistributedTrainer(parser.parse_args().config_file)
input_pp_rank, output_pp_rank = get_input_output_pp_ranks(model=trainer.model)
trainer.train(dummy_infinite_data_generator(
    micro_batch_size=trainer.micro_batch_size, sequence_length=trainer.sequence_length, input_pp_rank=input_pp_rank,
    output_pp_rank=output_pp_rank, vocab_size=trainer.model_config.vocab_size, seed=trainer.config.data.seed,
    parallel_context=trainer.parallel_context)())
'''


def test_a_forks_script_on_nanotrons_dummy_data_runs_on_cpu_without_gpu_memory_lines(tmp_path):
    """Patches of [Note: a CPU run's output] in patches/cpu_run.py: nanotron's dummy data drew
    from a CUDA generator and failed on CPU; a CPU run printed 'Memory usage: 0.00MiB' lines and
    cuda_memory entries of 0. Neither is printed now."""
    script = tmp_path / "run_train.py"
    script.write_text(DUMMY_SCRIPT)
    path = tmp_path / "config.yaml"
    path.write_text(TrainerConfig(pp=2, layers=4, steps=2).yaml(str(tmp_path / "checkpoints")))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
               "integration.nanotron.run", str(script), "--config-file", str(path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(re.findall(r"iteration: \d / 2 \| .*lm_loss: ", result.stdout)) == 2, result.stdout[-2000:]
    said = result.stdout + result.stderr
    assert "Memory usage" not in said and "cuda_memory" not in said and "Datasets and/or" not in said
