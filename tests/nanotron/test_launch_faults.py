"""`pipeschedule train CONFIG --nproc N` ([Note: one launch] in integration/nanotron/launch.py):
a refused config is one line before any rank starts; a rank that raises, or is killed
mid-step, ends every rank with one line naming it, once; relaunched from the last
checkpoint, the run goes on with losses bitwise equal to one never interrupted. Real
processes: the command, torchrun, nanotron's trainer over gloo on CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from integration.nanotron.example import TrainerConfig
from integration.nanotron.launch import REPORT_ENV, first_failure, fixed_nodes, torchrun_args
from pipeschedule.errors import ParameterError

ROOT = Path(__file__).resolve().parents[2]
TINY = TrainerConfig(pp=2, layers=4, microbatches=4, steps=4, checkpoint_interval=2)

# Test code, outside the package: imported first by every Python process of the test (a
# sitecustomize module on PYTHONPATH), it makes rank FAULT_RANK raise at step FAULT_STEP
# once nanotron's trainer module is imported.
FAULT = '''
import importlib.machinery, os, sys

class _Fault:
    def find_spec(self, name, path, target=None):
        if name != "nanotron.trainer" or os.environ.get("RANK") != os.environ.get("FAULT_RANK"):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        load = spec.loader.exec_module
        def exec_module(module):
            load(module)
            step = module.DistributedTrainer.training_step
            def failing(self, *args, **kwargs):
                if self.iteration_step == int(os.environ["FAULT_STEP"]):
                    raise RuntimeError(f"injected at step {self.iteration_step}")
                return step(self, *args, **kwargs)
            module.DistributedTrainer.training_step = failing
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _Fault())
'''


def write(tmp_path, config: TrainerConfig, name: str, checkpoints: str = "checkpoints") -> Path:
    path = tmp_path / name
    path.write_text(config.yaml(str(tmp_path / checkpoints)))
    return path


def env(tmp_path, **extra) -> dict:
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(FAULT)
    return {**os.environ, "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}", **extra}


def train(tmp_path, config_path: Path, *argv, timeout: float = 240, **extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipeschedule.cli", "train", str(config_path), "--nproc", "2",
                             *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env=env(tmp_path, **extra))


def finished(process: subprocess.Popen, timeout: float = 240) -> tuple[int, str, list[str]]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err.splitlines()


def losses(record: Path) -> dict[int, float]:
    """step -> loss, from the --record of the loss rank (the last pipeline rank)."""
    steps = json.loads((record / "rank1.json").read_text())["steps"]
    return {s["step"]: s["loss"] for s in steps}


def ranks_of(launcher: int) -> dict[int, int]:
    """global rank -> pid of the rank processes the launcher started."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if parent == launcher and any(v.startswith(REPORT_ENV.encode()) for v in environ):
            rank = next((int(v.split(b"=")[1]) for v in environ if v.startswith(b"RANK=")), None)
            if rank is not None:
                found[rank] = int(entry.name)
    return found


@pytest.mark.spawn
@pytest.mark.parametrize("config, argv, expected", [
    (TINY, ["--nnodes", "2"], "parallelism dp * tp * pp = 1 * 1 * 2 = 2 processes, but --nproc * --nnodes = 2 * 2 "
                              "is 4"),
    (replace(TINY, engine="caped_1f1b"), [], "unknown engine 'caped_1f1b' (did you mean capped_1f1b?)"),
    (replace(TINY, dataset=str(Path("/nowhere/corpus")), tokenizer="gpt2"), [],
     "no such folder '/nowhere/corpus'"),
    (TINY, ["--max-restarts", "x"], "pipeschedule train: torchrun cannot read its options"),
])
def test_a_refused_config_is_one_line_before_any_rank_starts(tmp_path, config, argv, expected):
    code, out, err = finished(train(tmp_path, write(tmp_path, config, "bad.yaml"), *argv))
    assert code == 2 and out == "" and len(err) == 1, (out, err)
    assert err[0].startswith("pipeschedule: error: ") and expected in err[0], err
    assert not (tmp_path / "checkpoints").exists()  # no rank started


@pytest.mark.spawn
def test_a_rank_that_raises_ends_every_rank_and_is_said_once(tmp_path):
    start = time.monotonic()
    code, out, err = finished(train(tmp_path, write(tmp_path, TINY, "c.yaml"), FAULT_RANK="1", FAULT_STEP="2"))
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("pipeschedule train: rank 1: RuntimeError: injected at step 2 (its traceback: "), err
    trace = Path(err[0].split("(its traceback: ", 1)[1].split(")", 1)[0])
    assert err[0].endswith(f" (each rank's stderr: {trace.parent})")
    assert "RuntimeError: injected at step 2" in trace.read_text()  # the traceback, kept in a file
    assert "Traceback" not in out and "ChildFailedError" not in out
    assert time.monotonic() - start < 120


@pytest.mark.spawn
def test_a_rank_killed_mid_step_ends_every_rank_and_the_relaunch_goes_on_bitwise(tmp_path):
    whole = write(tmp_path, TINY, "whole.yaml", "whole")
    code, _, err = finished(train(tmp_path, whole, "--record", str(tmp_path / "whole-record")))
    assert code == 0 and not any("Traceback" in line or "rror" in line for line in err), err  # (tqdm's bars)
    reference = losses(tmp_path / "whole-record")
    assert sorted(reference) == [1, 2, 3, 4]

    cut = write(tmp_path, TINY, "cut.yaml", "cut")
    process = train(tmp_path, cut)
    latest = tmp_path / "cut" / "latest.txt"
    while not latest.exists():  # the checkpoint of step 2: the ranks are in step 3 or saving
        assert process.poll() is None, process.communicate()
        time.sleep(0.01)
    ranks = ranks_of(process.pid)
    assert sorted(ranks) == [0, 1], ranks
    os.kill(ranks[1], signal.SIGKILL)
    killed = time.monotonic()
    code, out, err = finished(process)
    assert time.monotonic() - killed < 30  # every rank ended
    assert code == 1 and len(err) == 1, err  # (the ranks' stderr, the save's bars and gloo's warnings, in files)
    assert err[0].startswith("pipeschedule train: rank 1 was killed by SIGKILL (it could say nothing: killed "
                             "from outside, or out of host memory); every rank was stopped (each rank's stderr: "), err
    for pid in ranks.values():
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]

    step = int(latest.read_text())
    assert step == 2  # (killed as the checkpoint of step 2 appeared: the relaunch has steps 3 and 4 to go)
    resumed = write(tmp_path, replace(TINY, resume_from=str(tmp_path / "cut")), "resumed.yaml", "resumed")
    code, _, err = finished(train(tmp_path, resumed, "--record", str(tmp_path / "resumed-record")))
    assert code == 0 and not any("Traceback" in line or "rror" in line for line in err), err
    after = losses(tmp_path / "resumed-record")
    assert sorted(after) == [3, 4]
    assert after == {s: reference[s] for s in after}  # bitwise: the same floats


# -- the launcher's pieces, in this process -----------------------------------------------------------


class Failure:
    def __init__(self, exitcode: int, timestamp: int = 0) -> None:
        self.exitcode, self.timestamp = exitcode, timestamp


def test_the_first_failure_is_the_killed_rank_then_the_first_to_speak(tmp_path):
    (tmp_path / "rank0.json").write_text(json.dumps({"time": 2.0, "line": "the transfer with rank 1 failed"}))
    (tmp_path / "rank2.json").write_text(json.dumps({"time": 1.0, "line": "ValueError: first"}))
    assert first_failure({0: Failure(1), 1: Failure(-9)}, str(tmp_path)).startswith("rank 1 was killed by SIGKILL")
    assert first_failure({0: Failure(1), 2: Failure(1)}, str(tmp_path)) == "rank 2: ValueError: first"
    assert first_failure({3: Failure(1, 5), 4: Failure(7, 4)}, str(tmp_path)) == (
        "rank 4 ended with exit code 7 without saying why")
    # SIGTERM is how torchrun stops the other ranks once one failed (and it lists them among
    # the failures): the rank that failed by itself is named, whether it spoke or not
    assert first_failure({5: Failure(-15), 2: Failure(1)}, str(tmp_path)) == "rank 2: ValueError: first"
    assert first_failure({5: Failure(-15), 3: Failure(7)}, str(tmp_path)) == (
        "rank 3 ended with exit code 7 without saying why")
    assert first_failure({5: Failure(-15), 1: Failure(-9), 2: Failure(1)}, str(tmp_path)).startswith(
        "rank 1 was killed by SIGKILL")
    assert first_failure({5: Failure(-15), 4: Failure(-15)}, str(tmp_path)).startswith(  # nobody failed by itself
        "rank 4 was killed by SIGTERM")


def test_torchrun_options_pass_and_train_s_own_are_refused():
    args = torchrun_args(["--master-port", "29511", "--max-restarts", "0"], 2, "c.yaml", "gloo", None)
    assert args.nproc_per_node == "2" and args.master_port == 29511 and args.module
    assert args.training_script == "integration.nanotron.train"
    assert args.training_script_args == ["--config-file", "c.yaml", "--checked", "--backend", "gloo"]
    with pytest.raises(ParameterError, match="--nproc-per-node is set by train itself"):
        torchrun_args(["--nproc-per-node", "4"], 2, "c.yaml", "auto", None)
    with pytest.raises(ParameterError, match="--bogus is no option of torchrun's"):
        torchrun_args(["--bogus"], 2, "c.yaml", "auto", None)
    assert fixed_nodes("2") == 2 and fixed_nodes("3:3") == 3 and fixed_nodes("1:4") is None


@pytest.mark.spawn
def test_the_launcher_stopped_by_a_signal_ends_every_rank_in_one_line(tmp_path):
    process = train(tmp_path, write(tmp_path, replace(TINY, steps=10**4, checkpoint_interval=10**6), "long.yaml"))
    deadline = time.monotonic() + 120
    while len(ranks_of(process.pid)) < 2:
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    ranks = ranks_of(process.pid)
    time.sleep(2)  # into training
    process.send_signal(signal.SIGTERM)
    code, out, err = finished(process, timeout=60)
    assert code == 128 + signal.SIGTERM and err[-1:] == ["pipeschedule train: stopped by SIGTERM; every rank was "
                                                         "ended"], err[-5:]
    assert not any("Traceback" in line for line in err)
    for pid in ranks.values():
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


@pytest.mark.spawn
def test_a_cap_that_binds_on_no_rank_is_said_before_the_ranks_start(tmp_path):
    code, out, err = finished(train(tmp_path, write(tmp_path, replace(TINY, engine="capped_1f1b:cap=8", steps=1),
                                                    "c.yaml")))
    assert code == 0 and err[0].startswith("pipeschedule train: warning: cap 8 binds on no rank: capped_1f1b at pp=2, "
                                           "m=4 holds at most 2/1 microbatches"), err[:3]
