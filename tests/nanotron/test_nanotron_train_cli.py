"""`torchrun ... -m integration.nanotron.train --config-file CONFIG`: the users' launch,
run as they run it (torchrun, two CPU processes, gloo), good and bad configs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from trainer_jobs import TrainerConfig

pytestmark = pytest.mark.spawn


def launch(tmp_path, engine: str, *extra: str, layers: int = 4, timeout: float = 180.0, edit=None, nproc: int = 2,
           pp: int = 2):
    """torchrun with `nproc` ranks on a TrainerConfig's YAML (`edit`: text -> text, applied first)."""
    config = tmp_path / "config.yaml"
    text = TrainerConfig(engine=engine, layers=layers, steps=1, pp=pp).yaml(str(tmp_path / "checkpoints"))
    config.write_text(edit(text) if edit else text)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "-m",
               "integration.nanotron.train", "--config-file", str(config), *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


def our_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("integration.nanotron.train rank")]


def test_trains_from_the_yaml_and_records(tmp_path):
    result = launch(tmp_path, "capped_1f1b:cap=1,split=1/3", "--record", str(tmp_path / "record"), "--record-weights")
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / "record" / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["engine"] for r in ranks] == ["capped_1f1b:cap=1,split=1/3"] * 2
    assert ranks[0]["block_ranks"] == [0, 0, 1, 1, 1, 1, 1, 1, 1]  # the split from pp_engine, built by nanotron
    assert ranks[1]["steps"][0]["loss"] > 0 and ranks[0]["steps"][0]["loss"] is None
    first = ranks[0]["first_step"]  # the block's figures, the same on every rank
    assert first == ranks[1]["first_step"] and first["layers_per_stage"] == [1, 3] and first["measured_by"] == "ledger"
    assert all(b > 0 for b in first["measured_stash"] + first["predicted_stash"])
    weights = torch.load(tmp_path / "record" / "rank1-weights.pt")
    assert "model.lm_head.pp_block.weight" in weights


@pytest.mark.parametrize("nproc, pp, engine, expected", [
    (3, 2, "1f1b", "parallelism dp * tp * pp = 1 * 1 * 2 = 2 processes, but torchrun's world size (WORLD_SIZE) is "
                   "3: start 2 (torchrun --nproc-per-node 2 on one node)"),
    (4, 2, "capped_1f1b", "parallelism dp * tp * pp = 1 * 1 * 2 = 2 processes, but torchrun's world size "
                          "(WORLD_SIZE) is 4: start 2 (torchrun --nproc-per-node 2 on one node), or set "
                          "parallelism.dp: 2 to use 4"),
    (2, 2, "caped_1f1b", "pp_engine 'caped_1f1b': unknown engine 'caped_1f1b' (did you mean capped_1f1b?). Accepted: "),
    (4, 4, "interleaved_1f1b:virtual=3", "the model's 4 decoder layers fill at most 6 stages (the embedding on the "
                                         "first, the head on the last, a layer on each between). Give pp_engine: "
                                         "interleaved_1f1b:virtual=1,split=1/1/1/1"),
])
def test_the_launch_checks_the_config_first_and_rank_0_alone_says_what_is_wrong(tmp_path, nproc, pp, engine,
                                                                                 expected):
    """[Note: pre-flight]: a world size torchrun's ranks do not fill (nanotron's
    ParallelContext used to raise an AssertionError on every rank), an unknown engine, a
    layout the engine cannot run: one line, from rank 0, once; every rank ends."""
    result = launch(tmp_path, engine, timeout=120, nproc=nproc, pp=pp)
    assert result.returncode != 0
    lines = our_lines(result)
    assert len(lines) == 1 and lines[0].startswith("integration.nanotron.train rank 0: "), result.stderr[-3000:]
    assert expected in lines[0], lines
    assert "AssertionError" not in result.stderr and "[rank" not in result.stderr, result.stderr[-3000:]
    assert "[INFO" not in result.stdout  # refused before nanotron's trainer was built


@pytest.mark.parametrize("engine, expected", [
    ("capped_1f1b:split=1/1", "split places 1+1 = 2 decoder layers but the model has 4"),
    ("interleaved_1f1b:virtual=8", "leaves stage(s)"),
    ("capped_1f1b:caps=2", "unknown parameter 'caps' for capped_1f1b; capped_1f1b accepts: cap, split"),
    ("zbv:split=1/1/1", "split lists 3 stages but"),
])
def test_bad_pp_engine_is_refused_in_one_line_and_every_rank_ends(tmp_path, engine, expected):
    result = launch(tmp_path, engine, timeout=120)
    assert result.returncode != 0
    lines = our_lines(result)
    # The rank that fails first says why; torchrun then ends the others, which say so in one
    # line where they are in Python when SIGTERM comes (a rank still importing torch, or inside
    # a C++ call, ends with torchrun's own report only). Nobody hangs: launch() has a timeout.
    ranks = [line.split(":")[0] for line in lines]
    assert len(ranks) == len(set(ranks)) and set(ranks) <= {f"integration.nanotron.train rank {r}" for r in (0, 1)}
    refusals = [line for line in lines if expected in line]
    assert refusals, result.stderr[-3000:]
    assert all(line in refusals or "stopped by SIGTERM" in line for line in lines), lines
    assert "Traceback" not in "\n".join(lines)


def _retyped(text: str) -> str:
    assert "  pp: 2\n" in text
    return text.replace("  pp: 2\n", "  pp: two\n")


@pytest.mark.parametrize("edit, expected", [
    (lambda text: text + "  [unclosed\n", "nanotron cannot read the config file {config}: ScannerError: "),
    (_retyped, "nanotron cannot read the config file {config}: WrongTypeError: "),
    ("missing", "cannot read the config file {config}: No such file or directory"),
])
def test_a_config_nanotron_cannot_read_is_refused_in_one_line(tmp_path, edit, expected):
    """Not YAML, a value of the wrong type, no file: one line per rank naming the file, no
    traceback (before: nanotron's loader's traceback from inside the trainer)."""
    if edit == "missing":  # (a second --config-file: argparse keeps the last)
        config = tmp_path / "nowhere.yaml"
        result = launch(tmp_path, "1f1b", "--config-file", str(config), timeout=120)
    else:
        result = launch(tmp_path, "1f1b", edit=edit, timeout=120)
        config = tmp_path / "config.yaml"
    assert result.returncode != 0
    lines = our_lines(result)
    message = expected.format(config=config)
    assert lines and all(message in line or "stopped by SIGTERM" in line for line in lines), result.stderr[-3000:]
    assert any(message in line for line in lines)
    # (torchrun prints its own ChildFailedError traceback for any failed rank; ranks print none)
    assert "Traceback" not in "\n".join(lines) and "get_config_from_file" not in result.stderr, result.stderr[-3000:]


def test_a_rank_ended_by_torchrun_says_so_in_one_line():
    """torchrun ends the other ranks with SIGTERM when one fails: each still leaves a line."""
    code = ("import os, signal\n"
            "from integration.nanotron.train import _say_when_stopped\n"
            "_say_when_stopped('3')\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "signal.pause()\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 128 + 15, result.stderr[-2000:]
    assert our_lines(result) == [
        "integration.nanotron.train rank 3: stopped by SIGTERM "
        "(torchrun ends every rank when one fails; the failing rank printed why)"]
