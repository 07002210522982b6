"""`pipeschedule check CONFIG [--nproc N] [--gpu NAME ...]` on real nanotron YAML files, read
by nanotron's own loader ([Note: pre-flight] in integration/nanotron/check.py): a config
that would run prints what would run, the assumptions and its memory per rank, and ends
with `would run` (exit 0); each bad input ends in one line naming the value and the fix
(exit 2), and a fix it suggests is accepted when applied."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, strategies as st

import integration.nanotron  # noqa: F401  (registers the engines, as a launch script would)
from integration.nanotron.check import check_world, preflight
from nanotron.config.parallelism_config import ParallelismArgs
from pipeschedule.errors import ParameterError
from pipeschedule.plan.assumptions import Assumptions
from integration.nanotron.example import TrainerConfig
from pipeschedule.cli import main

SMALL = TrainerConfig(pp=2, layers=4, microbatches=4)
# Llama3-70B's sizes in nanotron's config, pp=4: arithmetic only, nothing is allocated
BIG = TrainerConfig(pp=4, layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256, seq=8192,
                    micro_batch_size=1, microbatches=8, dtype="bfloat16", fp32_accumulation=True)


def write(tmp_path, config: TrainerConfig, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(config.yaml(str(tmp_path / "checkpoints")))
    return str(path)


def check(capsys, *argv: str) -> tuple[int, str, list[str]]:
    """`pipeschedule check ARGV`: (exit code, stdout, stderr's lines)."""
    code = main(["check", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err.splitlines()


@pytest.mark.parametrize("engine, placement, layers", [
    ("1f1b", "0/1", "3/1"),  # nanotron's own engine: nanotron's cost split (the LM head weighs on the last rank)
    ("afab", "0/1", "3/1"),
    ("capped_1f1b:cap=1", "0/1", "3/1"),
    ("ps_1f1b:split=2/2", "0/1", "2/2"),
    ("interleaved_1f1b:virtual=2", "0/1/0/1", "2/1/1/0"),  # nanotron's cost split over the 4 stages
    ("zb_h1:split=1/3", "0/1", "1/3"),
    ("zbv", "0/1/1/0", "2/1/1/0"),
    ("v_half:cap=2,recompute=full,split=1/1/1/1", "0/1/1/0", "1/1/1/1"),
    ("capped_1f1b:cap=1,offload=0", "0/1", "3/1"),
    ("auto", "0/1", "3/1"),
])
def test_a_config_that_would_run_prints_what_runs_and_exits_0(tmp_path, capsys, engine, placement, layers):
    path = write(tmp_path, replace(SMALL, engine=engine))
    code, out, err = check(capsys, path, "--nproc", "2", "--gpu", "h100")
    assert code == 0 and err == [], err
    assert out.startswith(f"{path}:\n") and out.count("would run") == 1
    assert out.splitlines()[-1].startswith("would run: every rank within the h100's 78.0 GiB (rank ")
    assert "  world     dp 1 * tp 1 * pp 2 = 2 processes (--nproc 2)" in out
    assert f"placement (rank of each stage) {placement}; decoder layers per stage {layers}" in out
    assert re.search(r"schedule  pp 2, m 4 microbatches a step: \d+ instructions, verified against every rule", out)
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+[01]\s+\d", line)]
    assert [row[0] for row in rows] == ["0", "1"] and all(row[-1] == "yes" for row in rows), out  # fits an H100
    assert "memory    per rank, predicted by pipeschedule's memory model against h100: 78.0 GiB after 2 GiB" in out
    assert "  assumed   GPU: NVIDIA H100 80 GB, 80 GiB, 2 GiB of it kept back" in out


def test_the_memory_follows_the_schedule(tmp_path):
    """Rank 0 keeps 2 microbatches in flight under 1F1B at pp 2 and 1 under cap 1: the
    prediction of its activations halves (the same split, 3/1)."""
    found = {engine: preflight(write(tmp_path, replace(SMALL, engine=engine), f"{i}.yaml"),
                               assumptions=Assumptions(gpu="h100")).memory.memory
             for i, engine in enumerate(("ps_1f1b", "capped_1f1b:cap=1"))}
    assert [r.inflight for r in found["ps_1f1b"]] == [2, 1]
    assert [r.inflight for r in found["capped_1f1b:cap=1"]] == [1, 1]
    full, capped = (found[e][0].terms["activations"] for e in ("ps_1f1b", "capped_1f1b:cap=1"))
    assert capped == pytest.approx(full / 2, rel=0.01)


def test_a_config_over_the_gpu_prints_its_table_then_one_line(tmp_path, capsys):
    path = write(tmp_path, BIG)
    code, out, err = check(capsys, path, "--gpu", "h100")
    assert code == 2 and len(err) == 1, err
    assert " NO" in out and "would run" not in out  # the table says which ranks do not fit; no verdict against it
    assert re.fullmatch(rf"pipeschedule: error: would not run: rank \d needs [\d.]+ GiB \(predicted\), over the "
                        rf"budget of h100, 78.00 GiB \(its memory less 2 GiB kept back\): see what fits with "
                        rf"`pipeschedule plan --model-file {re.escape(path)} --gpu h100`", err[0]), err


@pytest.mark.parametrize("config, argv, expected", [
    (SMALL, ["--nproc", "4"], "parallelism dp * tp * pp = 1 * 1 * 2 = 2 processes, but --nproc is 4: start 2 "
                              "(torchrun --nproc-per-node 2 on one node), or set parallelism.dp: 2 to use 4"),
    (SMALL, ["--nproc", "3"], "parallelism dp * tp * pp = 1 * 1 * 2 = 2 processes, but --nproc is 3: start 2 "
                              "(torchrun --nproc-per-node 2 on one node)"),
    (replace(SMALL, dp=2), ["--nproc", "2"], "dp * tp * pp = 2 * 1 * 2 = 4 processes, but --nproc is 2"),
    (replace(SMALL, engine="caped_1f1b"), [], "unknown engine 'caped_1f1b' (did you mean capped_1f1b?)"),
    (replace(SMALL, engine="capped_1f1b:split=1/1"), [], "split places 1+1 = 2 decoder layers but the model has 4"),
    (replace(SMALL, engine="capped_1f1b:cap=1/1/1"), [], "cap lists 3 ranks but pp = 2"),
    (SMALL, ["--gpu", "a100"], "unknown GPU 'a100'; presets: gh200, h100, h200"),
    (SMALL, ["--reserve", "-1"], "--reserve must be a finite number >= 0"),
])
def test_a_bad_config_is_refused_in_one_line(tmp_path, capsys, config, argv, expected):
    code, out, err = check(capsys, write(tmp_path, config), *argv)
    assert code == 2 and out == "" and len(err) == 1, (out, err)
    assert err[0].startswith("pipeschedule: error: ") and expected in err[0], err


@pytest.mark.parametrize("gib", [0.0006, 0.0009, 0.01, 80])
def test_the_verdict_agrees_with_the_exit_code(tmp_path, capsys, gib):
    """The report said `would run` and then refused: now its last line is the verdict, and
    `would run` is said exactly where the exit code is 0 (rank 0 of SMALL needs ~0.9 MiB)."""
    code, out, err = check(capsys, write(tmp_path, SMALL), "--gpu-memory", str(gib), "--reserve", "0")
    assert ("would run" in out) == (code == 0) and ((err == []) == (code == 0)), (code, out, err)
    if code == 0:
        assert out.splitlines()[-1].startswith("would run: every rank within")
    else:
        assert code == 2 and len(err) == 1 and err[0].startswith("pipeschedule: error: would not run: rank 0 needs")


def test_a_cap_that_binds_on_no_rank_is_a_warning_line(tmp_path, capsys):
    code, out, err = check(capsys, write(tmp_path, replace(SMALL, engine="capped_1f1b:cap=8")))
    assert code == 0 and err == []
    assert ("  warning   cap 8 binds on no rank: capped_1f1b at pp=2, m=4 holds at most 2/1 microbatches in flight "
            "per rank without it") in out
    code, out, err = check(capsys, write(tmp_path, replace(SMALL, engine="capped_1f1b:cap=1")))
    assert code == 0 and "warning" not in out


def test_the_assumptions_are_printed_and_change_the_figures(tmp_path, capsys):
    """The attention assumed is the flag's (default flash-attn, as plan's), not this
    machine's; the report says which, and where this machine differs."""
    path = write(tmp_path, replace(SMALL, seq=256, hidden=64, heads=4))
    _, flash, _ = check(capsys, path)
    _, eager, _ = check(capsys, path, "--attention", "eager", "--activation-formula", "korthikanti")
    assert "  assumed   attention: flash-attn, nanotron's" in flash
    assert "  assumed   attention: eager attention that saves its softmax scores" in eager
    assert "  assumed   activations counted by the korthikanti formula (--activation-formula)" in eager
    activations = [[line.split()[4:6] for line in text.splitlines() if re.match(r"\s+0\s+0\s", line)][0]
                   for text in (flash, eager)]
    assert activations[0] != activations[1]
    no_flash = "note      this machine has no flash-attn" in flash
    assert no_flash == (importlib.util.find_spec("flash_attn") is None)


def parallelism(dp: int, tp: int, pp: int) -> SimpleNamespace:
    """A config as check_world reads it: nanotron's own ParallelismArgs under `parallelism`."""
    return SimpleNamespace(parallelism=ParallelismArgs(dp=dp, tp=tp, pp=pp, pp_engine="1f1b"))


@given(st.integers(1, 8), st.integers(1, 8), st.integers(1, 8), st.integers(1, 600))
def test_every_world_size_fix_is_accepted(dp, tp, pp, nproc):
    """The processes to start, and the dp that fills the processes started, pass the check
    they were suggested by; the check refuses exactly the worlds the config does not fill."""
    try:
        check_world(parallelism(dp, tp, pp), nproc)
    except ParameterError as err:
        message = str(err)
    else:
        assert nproc == dp * tp * pp
        return
    assert nproc != dp * tp * pp and len(message.splitlines()) == 1
    start = int(re.search(r"start (\d+) ", message).group(1))
    check_world(parallelism(dp, tp, pp), start)
    other = re.search(r"set parallelism\.dp: (\d+) to use (\d+)$", message)
    assert (other is not None) == (nproc % (tp * pp) == 0)
    if other:
        assert int(other.group(2)) == nproc
        check_world(parallelism(int(other.group(1)), tp, pp), nproc)


@pytest.mark.parametrize("engine, pp, layers", [
    ("interleaved_1f1b:virtual=3", 4, 4),  # issue 33: the suggestion used to be refused itself
    ("interleaved_1f1b:virtual=8", 2, 4),
    ("capped_1f1b:split=1/1", 2, 4),
    ("zbv", 4, 3),  # 8 stages, 3 layers: no split of pp 4 can fill them; the fix is pp 2
])
def test_too_few_layers_for_the_stages_is_refused_with_a_fix_that_is_accepted(tmp_path, capsys, engine, pp, layers):
    config = replace(SMALL, engine=engine, pp=pp, layers=layers)
    code, out, err = check(capsys, write(tmp_path, config))
    assert code == 2 and len(err) == 1, err
    fix = re.search(r"Give pp_engine: (\S+)(?: with parallelism\.pp: (\d+))?$", err[0])
    assert fix is not None, err
    fixed = replace(config, engine=fix.group(1), pp=int(fix.group(2) or pp))
    code, out, err = check(capsys, write(tmp_path, fixed, "fixed.yaml"))
    assert code == 0 and err == [], (fix.group(0), err)


@pytest.mark.parametrize("engine, pp, layers", [
    ("ps_1f1b:split=0/0/4/0", 4, 4),  # the embedding on stage 0, the head on stage 3: stage 1 passes on
    ("capped_1f1b:cap=4/3/2/1,split=0/0/2/2", 4, 4),
    ("zbv:split=4/0/0/0", 2, 4),
])
def test_a_split_that_leaves_a_later_stage_empty_is_accepted(tmp_path, capsys, engine, pp, layers):
    """[Note: empty stages]: a stage given no layer by split= (and no other block) passes
    its input on; only stage 0, which reads the data loader, must hold a block."""
    code, out, err = check(capsys, write(tmp_path, replace(SMALL, engine=engine, pp=pp, layers=layers)))
    assert code == 0 and err == [], err


def test_a_file_nanotron_cannot_read_is_refused_in_one_line(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text(SMALL.yaml(str(tmp_path)) + "  [unclosed\n")
    code, out, err = check(capsys, str(path))
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"pipeschedule: error: nanotron cannot read the config file {path}: ScannerError: ")
    code, out, err = check(capsys, str(tmp_path / "nowhere.yaml"))
    assert code == 2 and err == [f"pipeschedule: error: cannot read the config file {tmp_path / 'nowhere.yaml'}: "
                                 f"No such file or directory"]


def test_without_nanotron_the_command_says_what_to_install(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "nanotron", None)  # as find_spec sees a package that is not installed
    code, out, err = check(capsys, write(tmp_path, SMALL))
    assert code == 2 and err == ["pipeschedule: error: pipeschedule check reads the config with nanotron's own "
                                 "loader and needs nanotron: pip install torch -e '.[nanotron]' (from the "
                                 "pipeschedule checkout)"]


@pytest.mark.spawn
def test_the_installed_command_refuses_in_one_line_without_a_traceback(tmp_path):
    path = write(tmp_path, replace(SMALL, engine="interleaved_1f1b:virtual=3", pp=4))
    result = subprocess.run(["pipeschedule", "check", path, "--nproc", "4"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2 and result.stdout == "", result.stderr[-2000:]
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "Give pp_engine: interleaved_1f1b:virtual=1,split=1/1/1/1" in result.stderr


# -- the data the run reads ------------------------------------------------------------------------------


@pytest.fixture
def text(tmp_path) -> TrainerConfig:
    from text_corpus import write_corpus, write_tokenizer

    corpus = write_corpus(tmp_path / "corpus", 400)
    tokenizer = write_tokenizer(tmp_path / "tokenizer")
    return replace(SMALL, seq=16, vocab=64, dataset=str(corpus), tokenizer=str(tokenizer), loading_workers=0)


def test_the_data_it_reads_is_checked_and_said(tmp_path, capsys, text):
    code, out, err = check(capsys, write(tmp_path, text))
    assert code == 0 and err == [], err
    assert (f"  note      data: '{tmp_path / 'corpus'}', 40 texts, column 'text'; tokenizer "
            f"'{tmp_path / 'tokenizer'}', 42 tokens within vocab_size 64") in out


@pytest.mark.parametrize("change, expected", [
    ({"dataset": "/nowhere/corpus"}, "data.dataset.hf_dataset_or_datasets: no such folder '/nowhere/corpus'"),
    ({"text_column": "body"}, "data.dataset.text_column_name 'body' is not a column of the dataset"),
    ({"tokenizer": "/nowhere/tokenizer"}, "tokenizer.tokenizer_name_or_path: no such folder '/nowhere/tokenizer'"),
    ({"vocab": 32}, "has 42 tokens but model.model_config.vocab_size is 32"),
    ({"seq": 64}, "tokens.sequence_length 64 is over the model's max_position_embeddings"),
])
def test_data_that_cannot_feed_the_model_is_refused_in_one_line(tmp_path, capsys, text, change, expected):
    """A wrong dataset path passed check and failed at launch; check reads the data as the
    ranks will, before any of them starts."""
    path = write(tmp_path, replace(text, **change))
    if "seq" in change:  # max_position_embeddings follows seq in the writer: set it back below
        path_text = Path(path).read_text().replace("max_position_embeddings: 64", "max_position_embeddings: 16")
        Path(path).write_text(path_text)
    code, out, err = check(capsys, path)
    assert code == 2 and out == "" and len(err) == 1, (out, err)
    assert expected in err[0], err


def test_the_example_writer_describes_its_options_and_refuses_a_bad_engine(capsys):
    from integration.nanotron import example

    with pytest.raises(SystemExit):
        example.main(["--help"])
    text = capsys.readouterr().out
    assert "parallelism.pp_engine: nanotron's 1f1b or afab" in text and "tokens.sequence_length" in text
    assert set(example.HELP) == {f.name for f in dataclasses.fields(TrainerConfig)} - {"save_initial_state",
                                                                                       "init_from"}
    assert example.main(["--engine", "caped_1f1b"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "unknown engine 'caped_1f1b' (did you mean capped_1f1b?)" in err[0]
