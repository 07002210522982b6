"""The `pipeschedule` command on files: PyTorch CSVs in either form ([Note: CSV form] in
torch_csv.py) are verified, simulated and shown as the program that would run."""

import pytest

from pipeschedule import compile_schedule
from pipeschedule.cli import main
from pipeschedule.compiler.torch_csv import dump_csv


@pytest.mark.parametrize("name,kwargs", [("1f1b", {}), ("interleaved_1f1b", {"virtual": 2}), ("zbv", {})])
@pytest.mark.parametrize("form", ["compute_only", "compute_comms"])
def test_verify_simulate_and_show_take_either_csv_form(tmp_path, capsys, name, kwargs, form):
    path = tmp_path / f"{name}.csv"
    dump_csv(compile_schedule(name, pp=2, microbatches=4, **kwargs), str(path), form=form)
    assert main(["verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert ": valid (" in out and (", lowered from its compute order" in out) == (form == "compute_only")
    assert main(["simulate", "--schedule", str(path)]) == 0
    assert "step time" in capsys.readouterr().out
    assert main(["show", "--schedule", str(path)]) == 0
    assert "rank 1 |" in capsys.readouterr().out


@pytest.mark.parametrize("text", [
    "0F0,0F1,0B0,0B1,0REDUCE_GRAD\n",  # ours, one rank, compute_comms
    "0UNSHARD,0F0,0F1,0B0,0B1,0REDUCE_GRAD,0RESHARD\n",  # PyTorch's compute_comms at pp=1
    "0F0,0F1,0B0,0B1\n",  # compute_only
    "0F0,1F0,1B0,0B0\n",  # one rank, two stages
])
def test_one_rank_csv_is_valid_in_either_form(tmp_path, capsys, text):
    path = tmp_path / "one.csv"
    path.write_text(text)
    assert main(["verify", str(path)]) == 0, capsys.readouterr().err


def test_a_compute_only_json_is_lowered_too(tmp_path, capsys):
    from pipeschedule import generate
    path = tmp_path / "order.json"
    path.write_text(generate("v_half", pp=3, microbatches=5).to_json())
    assert main(["verify", str(path)]) == 0
    assert "lowered from its compute order" in capsys.readouterr().out


def test_a_broken_csv_is_still_invalid(tmp_path, capsys):
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0B0,0F1,0B1\n1F0,1B0\n")  # rank 1 never runs mb 1
    assert main(["verify", str(path)]) == 1
    assert "rule coverage" in capsys.readouterr().err


def test_a_csv_says_what_it_leaves_out(tmp_path, capsys):
    """PyTorch's CSV has no OFFLOAD or RELOAD: compile says so instead of dropping them quietly."""
    path = tmp_path / "moved.csv"
    assert main(["compile", "1f1b", "--pp", "4", "-m", "8", "--offload", "fraction=1", "--csv", str(path)]) == 0
    assert "leaves out the schedule's 44" in capsys.readouterr().err
    assert main(["compile", "1f1b", "--pp", "4", "-m", "8", "--csv", str(path)]) == 0
    assert capsys.readouterr().err == ""


def test_plan_writes_its_png_when_nothing_fits(tmp_path, capsys):
    """Under the ZeRO/recompute search it used to write nothing and say nothing; a single plan wrote it."""
    path = tmp_path / "plan.png"
    argv = ["plan", "--model", "llama3-8b", "--pp", "2", "--microbatches", "4", "--micro-batch", "64", "--tables",
            "none", "--png", str(path)]
    assert main(argv) == 1  # nothing fits
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.spawn
def test_plan_shows_its_progress_on_a_terminal_only(tmp_path):
    """The lever search's plans can take a minute together: on a terminal stderr says which
    one is being made, on one line cleared at the end; piped, stderr stays empty."""
    import os
    import pty
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    argv = [sys.executable, "-m", "pipeschedule.cli", "plan", "--model", "llama3-8b", "--pp", "2", "--microbatches",
            "4", "--zero", "0", "--tables", "none"]
    env = dict(os.environ, PYTHONPATH=str(repo))
    leader, follower = pty.openpty()
    try:
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=follower, env=env, timeout=300)
        os.close(follower)
        follower = None
        shown = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal's other side is closed: all read
                break
            if not chunk:
                break
            shown += chunk
    finally:
        if follower is not None:
            os.close(follower)
        os.close(leader)
    assert done.returncode == 0 and b"Recommended" in done.stdout
    text = shown.decode()
    for k, mode in enumerate(("none", "selective", "full"), start=1):
        assert f"\rplan: ZeRO-0, recompute {mode} ({k} of 3)..." in text, text
    assert text.endswith("\r\x1b[K"), text  # the line cleared
    piped = subprocess.run(argv, capture_output=True, env=env, timeout=300)
    assert piped.returncode == 0 and piped.stderr == b""
