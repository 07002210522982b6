"""Real text through nanotron's own data path (integration/nanotron/data.py): a JSON-lines
corpus and a word-level tokenizer made here (no network), read by nanotron's
`get_datasets`, `clm_process` and `get_train_dataloader`.

In-process: what `data.load` refuses before the trainer exists (one line naming the
value), and `check_enough` against nanotron's own sampler. Spawned (gloo, CPU): nanotron's
Llama at pp=2, dp=2 trained on the corpus under nanotron's `1f1b` and pipeschedule's
`capped_1f1b:cap=1` (equal losses; the replicas read disjoint samples, together every
sample of the epoch once, in the same order under both engines), and resumed from a
checkpoint (the data continues where it stopped).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml
from hypothesis import given
from hypothesis import strategies as st

import integration.nanotron  # noqa: F401  (first: repairs nanotron)
from integration.nanotron import data
from integration.nanotron.pipeline.errors import DataError
from integration.nanotron.example import TrainerConfig
from pipeschedule.runtime.launch import spawn
from text_corpus import samples_from, write_corpus, write_tokenizer

SEQ = 16
TOKENS = 17 * SEQ + 1  # samples_from(TOKENS, SEQ) == 16: two steps of 2 x 2 x dp 2, one epoch


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """No network, and datasets' cache in the test's folder (spawned ranks inherit both)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "corpus", TOKENS), write_tokenizer(tmp_path / "tokenizer")


def config_of(tmp_path, text: str):
    from nanotron.config import get_config_from_file

    path = tmp_path / "config.yaml"
    path.write_text(text)
    return get_config_from_file(str(path))


def data_config(tmp_path, corpus, **knobs) -> TrainerConfig:
    folder, tokenizer = corpus
    return TrainerConfig(**{"dataset": str(folder), "tokenizer": str(tokenizer), "seq": SEQ, "vocab": 64,
                            "loading_workers": 0, **knobs})


# -- refused before the trainer is built ---------------------------------------------------------


def test_load_gives_the_train_split_and_the_tokenizer(tmp_path, corpus):
    text = data.load(config_of(tmp_path, data_config(tmp_path, corpus).yaml(str(tmp_path / "ck"))))
    assert text.raw.column_names == ["text"] and len(text.raw) == TOKENS // 10 + 1
    assert len(text.tokenizer) == 42 and text.tokenizer.pad_token == "</s>"
    assert data.load(config_of(tmp_path, TrainerConfig().yaml(str(tmp_path / "ck")))) is None  # synthetic


@pytest.mark.parametrize("change, expected", [
    (dict(dataset="{tmp}/nowhere"), "data.dataset.hf_dataset_or_datasets: no such folder '{tmp}/nowhere'"),
    (dict(dataset="{tmp}/corpus/part-0.jsonl"), "data.dataset.hf_dataset_or_datasets '{tmp}/corpus/part-0.jsonl' "
                                                "is a file"),
    (dict(text_column="body"), "data.dataset.text_column_name 'body' is not a column of the dataset "
                               "'{tmp}/corpus' (its columns: text)"),
    (dict(vocab=32), "the tokenizer '{tmp}/tokenizer' has 42 tokens but model.model_config.vocab_size is 32: "
                     "token ids up to 41 need an embedding row; set vocab_size >= 42"),
    (dict(tokenizer="{tmp}/no-tokenizer"), "tokenizer.tokenizer_name_or_path: no such folder '{tmp}/no-tokenizer'"),
    (dict(tokenizer="{tmp}/corpus"), "cannot load the tokenizer '{tmp}/corpus' (tokenizer.tokenizer_name_or_path): "),
])
def test_what_cannot_feed_the_model_is_refused_in_one_line(tmp_path, corpus, change, expected):
    change = {key: value.format(tmp=tmp_path) if isinstance(value, str) else value for key, value in change.items()}
    text = data_config(tmp_path, corpus, **change).yaml(str(tmp_path / "ck"))
    with pytest.raises(DataError) as refused:
        data.load(config_of(tmp_path, text))
    message = str(refused.value)
    assert message.startswith(expected.format(tmp=tmp_path)) and "\n" not in message, message


def test_a_sequence_over_the_positions_is_refused(tmp_path, corpus):
    text = data_config(tmp_path, corpus).yaml(str(tmp_path / "ck")).replace(
        f"max_position_embeddings: {SEQ}", f"max_position_embeddings: {SEQ // 2}")
    with pytest.raises(DataError, match=rf"^tokens.sequence_length {SEQ} is over the model's "
                                        rf"max_position_embeddings {SEQ // 2}: set sequence_length <= {SEQ // 2}"):
        data.load(config_of(tmp_path, text))


def test_a_split_list_without_train_is_refused(tmp_path, corpus):
    text = data_config(tmp_path, corpus).yaml(str(tmp_path / "ck")).replace("hf_dataset_splits: train",
                                                                             "hf_dataset_splits: test")
    with pytest.raises(DataError, match="hf_dataset_splits is 'test'; nanotron's run_train.py trains on the 'train'"):
        data.load(config_of(tmp_path, text))


def test_the_corpus_cuts_into_the_samples_counted():
    """`samples_from` (the tests' count) against nanotron's clm_process arithmetic on ids."""
    from nanotron.dataloader import clm_process
    from datasets import Dataset

    class Ids:  # a tokenizer whose ids are the words' numbers (clm_process calls batch_encode_plus)
        def batch_encode_plus(self, texts, **kwargs):
            return {"input_ids": [[int(w) for w in text.split()] for text in texts]}

    for tokens in (SEQ, SEQ + 1, 2 * SEQ, TOKENS, TOKENS + 5):
        raw = Dataset.from_dict({"text": [" ".join(str(i) for i in range(tokens))]})
        cut = clm_process(raw, Ids(), "text", None, True, SEQ)
        assert len(cut) == samples_from(tokens, SEQ), tokens


# -- enough samples: against nanotron's own sampler ------------------------------------------------


def batches_nanotron_gives(samples: int, *, dp: int, micro_batch_size: int, consumed: int) -> int:
    """Microbatches replica 0 reads from nanotron's sampler and a DataLoader as
    `get_train_dataloader` builds them (drop_last), over `samples` items."""
    from nanotron.dataloader import _get_train_sampler

    sampler = _get_train_sampler(dl_ranks_size=dp, dl_rank=0, train_dataset=list(range(samples)), seed=1,
                                 use_loop_to_round_batch_size=False, consumed_train_samples=consumed)
    loader = torch.utils.data.DataLoader(list(range(samples)), batch_size=micro_batch_size, sampler=sampler,
                                         drop_last=True)
    return sum(1 for _ in loader)


@given(samples=st.integers(0, 80), dp=st.integers(1, 4), mbs=st.integers(1, 4), m=st.integers(1, 4),
       done=st.integers(0, 5), more=st.integers(1, 5))
def test_enough_samples_exactly_when_nanotrons_sampler_has_them(samples, dp, mbs, m, done, more):
    consumed = done * mbs * m * dp
    enough = batches_nanotron_gives(samples, dp=dp, micro_batch_size=mbs, consumed=consumed) >= more * m
    kwargs = dict(dp=dp, micro_batch_size=mbs, microbatches=m, consumed=consumed, start_step=done,
                  train_steps=done + more, source="'corpus'")
    if enough:
        data.check_enough(samples, **kwargs)
    else:
        with pytest.raises(DataError, match=rf"^the dataset 'corpus' gives {samples} samples; .* set "
                                            r"tokens.train_steps <= \d+ or give more text$"):
            data.check_enough(samples, **kwargs)


def test_the_steps_the_refusal_suggests_are_accepted():
    """The `train_steps <= N` the refusal names passes the check (and N + 1 does not)."""
    kwargs = dict(dp=2, micro_batch_size=2, microbatches=2, consumed=8, start_step=1, source="'corpus'")
    with pytest.raises(DataError) as refused:
        data.check_enough(16, train_steps=4, **kwargs)
    suggested = int(str(refused.value).split("train_steps <= ")[1].split()[0])
    assert suggested == 2
    data.check_enough(16, train_steps=suggested, **kwargs)
    with pytest.raises(DataError):
        data.check_enough(16, train_steps=suggested + 1, **kwargs)


# -- trained on it: two engines, dp-sharded, resumed -----------------------------------------------


def _child(rank: int, world: int, store, paths: list[str]) -> list[dict]:
    from integration.nanotron import train

    train.prepare("gloo")
    out = []
    for path in paths:
        config = train.read_config(path)
        text = data.load(config)
        trainer = train.make_trainer(path, record=True)
        loader = data.train_dataloader(trainer, text)
        read: list = []

        def tapped(loader=loader, read=read):  # what this rank hands the trainer, microbatch by microbatch
            for batch in loader:
                ids = batch["input_ids"]
                read.append(ids.tolist() if isinstance(ids, torch.Tensor) else None)
                yield batch

        trainer.train(tapped())
        record = train.record_of(trainer, weights=False)
        epoch = [row[:-1].tolist() for row in loader.dataset["input_ids"]] if read and read[0] is not None else None
        out.append({**record, "read": read, "epoch": epoch})
    return out


def _resumed(text: str, *, steps: int, interval: int | None = None, resume: str | None = None) -> str:
    """A config's YAML with train_steps, checkpoint_interval and resume_checkpoint_path set."""
    config = yaml.safe_load(text)
    config["tokens"]["train_steps"] = steps
    if interval is not None:
        config["checkpoints"]["checkpoint_interval"] = interval
    if resume is not None:
        config["checkpoints"]["resume_checkpoint_path"] = resume
    return yaml.safe_dump(config, sort_keys=False)


@pytest.mark.spawn
def test_two_engines_train_on_the_corpus_sharded_over_dp_and_resume_where_they_stopped(tmp_path, corpus):
    base = data_config(tmp_path, corpus, pp=2, dp=2, layers=2, hidden=16, heads=2, kv_heads=1, microbatches=2,
                       micro_batch_size=2, steps=2, log_level="warning")
    assert samples_from(TOKENS, SEQ) == 16 == base.steps * base.micro_batch_size * base.microbatches * base.dp
    texts = [dataclasses.replace(base, engine="1f1b").yaml(str(tmp_path / "ck-1f1b")),
             dataclasses.replace(base, engine="capped_1f1b:cap=1").yaml(str(tmp_path / "ck-capped"))]
    first = _resumed(texts[1], steps=1, interval=1)  # capped, stopped after step 1 with a checkpoint
    texts += [first, _resumed(texts[1], steps=2, resume=str(tmp_path / "ck-capped" / "1"))]
    paths = []
    for index, text in enumerate(texts):
        path = tmp_path / f"config-{index}.yaml"
        path.write_text(text)
        paths.append(str(path))
    per_rank = spawn(_child, base.world, args=(paths,), timeout=600)
    runs = [[rank[i] for rank in per_rank] for i in range(len(paths))]

    def losses(run):
        return next(r["steps"] for r in run if r["dp_rank"] == 0 and r["steps"][0]["loss"] is not None)

    def reads(run):  # dp rank -> microbatches read on the input rank
        return {r["dp_rank"]: r["read"] for r in run if r["read"] and r["read"][0] is not None}

    nanotron, ours, stopped, resumed = runs
    assert [s["loss"] for s in losses(nanotron)] == [s["loss"] for s in losses(ours)]  # bitwise, every step
    assert reads(nanotron) == reads(ours)  # the same samples in the same order whatever the engine
    shards = reads(ours)
    assert sorted(shards) == [0, 1]
    samples = {dp: [row for mb in mbs for row in mb] for dp, mbs in shards.items()}
    epoch = next(r["epoch"] for r in ours if r["epoch"] is not None)
    assert len(epoch) == 16 and all(len(row) == SEQ for row in samples[0] + samples[1])
    assert sorted(samples[0] + samples[1]) == sorted(epoch)  # together: every sample of the epoch, once
    assert not {tuple(r) for r in samples[0]} & {tuple(r) for r in samples[1]}  # the replicas never share one
    # Resumed from the checkpoint of step 1: step 2 reads what the uninterrupted run read in step 2,
    # and trains to its loss.
    per_step = base.microbatches
    assert {dp: mbs[:per_step] for dp, mbs in shards.items()} == reads(stopped)
    assert {dp: mbs[per_step:] for dp, mbs in shards.items()} == reads(resumed)
    assert losses(resumed)[0]["step"] == 2
    assert [s["loss"] for s in losses(stopped) + losses(resumed)] == [s["loss"] for s in losses(ours)]


def test_the_tokenizer_recipe_of_the_docs_makes_one_the_run_accepts(tmp_path, corpus, monkeypatch):
    """docs/training.md's make_tokenizer.py, run as written on the tests' corpus: the
    folder it writes loads as the launcher loads a tokenizer, and a config naming it with
    a vocab_size its tokens fit passes `data.load`; one below them is refused."""
    import re
    import runpy
    import sys
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    script = re.search(r"```python\n(# make_tokenizer\.py.*?)```", page, re.S).group(1)
    (tmp_path / "make_tokenizer.py").write_text(script)
    folder, _ = corpus
    monkeypatch.setattr(sys, "argv", ["make_tokenizer.py", str(folder), str(tmp_path / "mine"), "300"])
    runpy.run_path(str(tmp_path / "make_tokenizer.py"), run_name="__main__")
    tokenizer = data.load_tokenizer(str(tmp_path / "mine"))
    assert 40 < len(tokenizer) <= 300 and tokenizer.eos_token == "</s>"
    assert tokenizer.decode(tokenizer("w3 w17")["input_ids"]) == "w3 w17"  # byte-level BPE round-trips the text
    fits = dataclasses.replace(data_config(tmp_path, corpus, vocab=len(tokenizer)), tokenizer=str(tmp_path / "mine"))
    assert data.load(config_of(tmp_path, fits.yaml(str(tmp_path / "c")))).tokenizer is not None
    short = dataclasses.replace(fits, vocab=len(tokenizer) - 1)
    with pytest.raises(DataError, match=f"has {len(tokenizer)} tokens but model.model_config.vocab_size is"):
        data.load(config_of(tmp_path, short.yaml(str(tmp_path / "c"))))
