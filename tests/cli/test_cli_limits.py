"""Bad input to the `pipeschedule` command, run as a user runs it: in a subprocess under a
2 GiB address-space limit and a timeout. Every bad input ends with exit code 2 and one
line on stderr naming the value and what is accepted, never a traceback; sizes beyond
[Note: size limits] (pipeschedule/checks.py) are refused before any work."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeschedule import compile_schedule
from pipeschedule.checks import MAX_SHOWN

pytestmark = pytest.mark.spawn

REPO = Path(__file__).resolve().parents[2]
MEMORY = 2 << 30


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def run_cli(argv, cwd, timeout=60):
    """(exit code, stderr lines) of `python -m pipeschedule.cli *argv` in `cwd`, on this
    checkout's package, under the memory limit."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "pipeschedule.cli", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, preexec_fn=_limit_memory)
    return done.returncode, done.stderr.strip().splitlines()


def refused(argv, cwd, *fragments):
    code, err = run_cli(argv, cwd)
    assert code == 2 and len(err) == 1, (code, err[-3:])
    assert "Traceback" not in err[0]
    for fragment in fragments:
        assert fragment in err[0], err[0]
    return err[0]


@pytest.fixture
def files(tmp_path):
    schedule = compile_schedule("1f1b", pp=2, microbatches=2)
    (tmp_path / "stash.json").write_text('{"buffer_bytes": {"stash": 1e12}}')
    model = ("model:\n  num_hidden_layers: {layers}\n  hidden_size: 8192\n  num_attention_heads: 64\n"
             "  num_key_value_heads: 8\n  intermediate_size: 28672\n  vocab_size: 128256\n")
    (tmp_path / "huge.yaml").write_text(model.format(layers=28672))
    (tmp_path / "digits.yaml").write_text(model.format(layers="８０"))
    (tmp_path / "long.yaml").write_text(model.format(layers="9" * 5000))
    (tmp_path / "long.json").write_text('{"num_hidden_layers": ' + "9" * 5000 + "}")
    (tmp_path / "longcost.json").write_text('{"forward": ' + "9" * 5000 + "}")
    (tmp_path / "bigint.json").write_text('{"forward": ' + "9" * 400 + "}")  # parses, but no float holds it
    (tmp_path / "biglatency.json").write_text('{"latency": ' + "9" * 400 + "}")
    (tmp_path / "bigband.json").write_text('{"bandwidth": ' + "9" * 400 + "}")
    (tmp_path / "hugetimes.json").write_text('{"forward": 1e308, "backward": 1e308}')  # finite, sums overflow
    (tmp_path / "one.json").write_text(schedule.to_json())
    (tmp_path / "bom.yaml").write_bytes(b"\xef\xbb\xbf" + model.format(layers=80).encode())
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + schedule.to_json().encode())
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + schedule.to_text().encode())
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbf0F0,0F1,0B0,0B1\n")
    (tmp_path / "bomcost.json").write_bytes(b'\xef\xbb\xbf{"forward": 1}')
    (tmp_path / "far_mb.csv").write_text("0F0,0B0,0F999999999999,0B999999999999\n")
    (tmp_path / "far_stage.csv").write_text("0F0,0B0,999999999999F0\n")
    big = json.loads(schedule.to_json())
    big["microbatches"] = 10**9
    (tmp_path / "big.json").write_text(json.dumps(big))
    past = dict(big, pp=64, virtual=2, microbatches=769, placement=[s % 64 for s in range(128)], programs=[])
    (tmp_path / "past.json").write_text(json.dumps(past))  # one past the limit: refused before its programs
    return tmp_path


LIMIT = "at most 98304 are accepted"
STAGES = "at most 8192 are accepted"


@pytest.mark.parametrize("argv, fragments", [
    (["simulate", "1f1b", "--pp", "2", "-m", "1000000000"], ["2 * 1 * 1000000000", LIMIT]),
    (["simulate", "1f1b", "--pp", "2", "-m", "10000000000"], ["2 * 1 * 10000000000", LIMIT]),
    (["compile", "1f1b", "--pp", "100000", "-m", "3", "--json", "x.json"],
     ["pp * virtual = 100000 * 1 = 100000", STAGES]),
    (["compile", "1f1b", "--pp", "8193", "-m", "1", "--json", "x.json"], ["8193 * 1 = 8193 stages", STAGES]),
    (["compile", "v_min", "--pp", "4097", "-m", "1", "--json", "x.json"], ["4097 * 2 = 8194 stages", STAGES]),
    (["show", "1f1b", "--pp", "8192", "-m", "4"],
     ["8192 ranks x 49170 cells", "at most 4194304", "--width) of at most 512"]),
    (["compile", "1f1b", "--pp", "4", "-m", "24577", "--json", "x.json"],
     ["4 * 1 * 24577 = 98308", LIMIT, "fewer microbatches"]),
    (["simulate", "interleaved_1f1b", "--pp", "64", "--virtual", "2", "-m", "769"], ["64 * 2 * 769 = 98432", LIMIT]),
    (["verify", "past.json"], ["64 * 2 * 769 = 98432", LIMIT]),
    (["simulate", "zbv", "--pp", "64", "-m", "385", "--trace", "x.json"],
     ["--trace writes an event per instruction", "64 * 2 * 385 = 49280", "at most 49152", "leave out --trace"]),
    (["simulate", "zbv", "--pp", "64", "-m", "385", "--png", "x.png"],
     ["--png draws a bar per compute", "64 * 2 * 385 = 49280", "at most 49152", "leave out --png"]),
    (["simulate", "1f1b", "--pp", "257", "-m", "1", "--png", "x.png"], ["pp = 257", "at most 256"]),
    (["compile", "interleaved_1f1b", "--pp", "4", "--virtual", "100000000", "-m", "1", "--json", "x.json"],
     ["virtual must be an integer in 1..1024", "got '100000000'"]),  # the grammar's bound, as pp_engine's
    (["compile", "interleaved_1f1b", "--pp", "16", "--virtual", "1024", "-m", "1", "--json", "x.json"],
     ["16 * 1024 = 16384 stages", STAGES]),
    (["show", "zbv", "--pp", "65536", "-m", "4"], ["65536 * 2 = 131072 stages", STAGES]),
    (["show", "zbv", "--pp", "4096", "-m", "13"], ["4096 * 2 * 13", LIMIT]),  # a V runs 2 stages per rank
    (["simulate", "1f1b", "--pp", "2", "-m", "99999999999999999999"], ["--microbatches has 20 digits", "at most 18"]),
    (["plan", "--model", "llama3-70b", "--pp", "4", "--microbatches", "100000"],
     ["pp * microbatches = 4 * 100000", "at most 1024"]),
    (["plan", "--model", "llama3-70b", "--layers", "1024", "--pp", "16", "--microbatches", "8"],
     ["layers * pp = 1024 * 16", "at most 4096"]),
    (["plan", "--model", "llama3-70b", "--pp", "16", "--microbatches", "64", "--dp", "1,2"],
     ["9 plans", "9 * 16 * 16 * 64 = 147456", "at most 131072", "8 plans at this size", "--zero and --recompute"]),
    (["plan", "--model", "llama3-70b", "--pp", "4", "--microbatches", "256", "--dp", "1,2,4,8,16,32"],
     ["33 plans", "at most 131072", "32 plans at this size"]),
    (["plan", "--model", "llama3-70b", "--pp", "4", "--microbatches", "8", "--node-limit", "1000000000"],
     ["node_limit = 1000000000", "at most 100000"]),
    (["plan", "--model-file", "huge.yaml", "--pp", "4", "--microbatches", "8"], ["model layers", "1..1024", "28672"]),
    (["plan", "--model", "llama3-70b", "--hidden", "99999999999999", "--pp", "4", "--microbatches", "8"],
     ["model hidden", "99999999999999"]),
    (["simulate", "1f1b", "--pp", "2", "-m", "4", "--cost", "stash.json", "--offload", "fraction=1,stream=0.001"],
     ["9.54e+08 pieces", "at most 4096"]),
    (["simulate", "1f1b", "--pp", "2", "-m", "4", "--offload", "fraction=1,stream=1e-320"],
     ["'1e-320'", "at least one byte"]),
    (["plan", "--model", "llama3-70b", "--pp", "4", "--tp", "4", "--microbatches", "8", "--offload",
      "auto,stream=0.001"],
     ["pieces", "at most 4096"]),
    (["compile", "nosuch", "--json", "x.json"], ["unknown engine 'nosuch'", "Accepted: ps_afab"]),
    (["simulate", "nosuch"], ["unknown engine 'nosuch'"]),
    (["compile", "1f1b", "--pp", "１２", "-m", "2", "--json", "x.json"], ["--pp", "'１２'", "ASCII digits"]),
    (["compile", "1f1b", "--pp", "1_0", "-m", "2", "--json", "x.json"], ["--pp", "'1_0'", "ASCII digits"]),
    (["compile", "1f1b", "--pp", "2", "-m", "2", "--cap", "１", "--json", "x.json"], ["--cap", "'１'"]),
    (["simulate", "1f1b", "--pp", "2", "-m", "2", "--offload", "fraction=1,lead=1_0"],
     ["lead='1_0'", "not an integer"]),
    (["simulate", "1f1b", "--pp", "2", "-m", "2", "--offload", "fraction=１"], ["fraction='１'", "not a number"]),
    (["plan", "--model", "llama3-70b", "--pp", "4", "--microbatches", "8", "--seq", "1_0"], ["--seq", "'1_0'"]),
    (["plan", "--model", "llama3-70b", "--pp", "4", "--microbatches", "8", "--mfu", "０.5"], ["--mfu", "'０.5'"]),
    (["plan", "--model-file", "digits.yaml", "--pp", "4", "--microbatches", "8"], ["model layers", "'８０'"]),
    (["plan", "--model-file", "long.yaml", "--pp", "4", "--microbatches", "8"], ["model layers", "..."]),
    (["plan", "--model-file", "long.json", "--pp", "4", "--microbatches", "8"], ["long.json", "4300 digits"]),
    (["simulate", "1f1b", "--pp", "2", "-m", "2", "--cost", "longcost.json"], ["longcost.json", "4300 digits"]),
    (["verify", "far_mb.csv"], ["1 * 1 * 1000000000000", LIMIT]),
    (["verify", "far_stage.csv"], ["1000000000000", "at most 8192"]),
    (["verify", "big.json"], ["2 * 1 * 1000000000", LIMIT]),
    (["simulate", "1f1b", "--pp", "4", "-m", "8", "--cost", "bigint.json"], ["'forward'", "finite", "400 digits"]),
    (["compile", "1f1b", "--pp", "4", "-m", "8", "--cost", "bigint.json", "--json", "x.json"], ["'forward'"]),
    (["simulate", "1f1b", "--pp", "4", "-m", "8", "--cost", "biglatency.json"], ["'latency'", "400 digits"]),
    (["simulate", "1f1b", "--pp", "4", "-m", "8", "--cost", "bigband.json"], ["'bandwidth'", "400 digits"]),
    (["simulate", "1f1b", "--pp", "4", "-m", "8", "--cost", "hugetimes.json", "--json"], ["too large", "overflow"]),
    (["simulate", "1f1b", "--pp", "64", "-m", "64", "--offload", "auto"],
     ["64 ranks * 5 leads * 8 fractions = 2560 simulations of 4096", "at most 262144", "ranks="]),
    (["compile", "1f1b", "--pp", "64", "-m", "64", "--offload", "auto", "--json", "x.json"],
     ["offload auto: 64 ranks"]),
    (["simulate", "zbv", "--schedule", "one.json"], ["--schedule 'one.json'", "NAME would be ignored"]),
    (["show", "--schedule", "one.json", "--pp", "3", "--cap", "1"], ["--pp, --cap would be ignored"]),
    (["simulate", "--schedule", "zbv", "--pp", "3", "-m", "2"],
     ["--schedule takes a schedule file", "'zbv' is a schedule family", "(pipeschedule simulate zbv --pp"]),
    (["show", "--schedule", "1f1b"], ["'1f1b' is a schedule family", "(pipeschedule show 1f1b --pp"]),
    (["simulate", "1f1b", "--pp", "2", "-m", "2", "--png", ""], ["--png needs a file path, got ''"]),
    (["simulate", "1f1b", "--pp", "2", "-m", "2", "--trace", ""], ["--trace needs a file path"]),
    (["compile", "1f1b", "--pp", "2", "-m", "2", "--json", ""], ["--json needs a file path"]),
    (["verify", ""], ["needs a file path"]),
    (["simulate", "1f1b", "--pp", "2", "-m", "2", "--png", "nodir/x.png"], ["cannot write PNG to 'nodir/x.png'"]),
    (["plan", "--model", "llama3-8b", "--pp", "2", "--microbatches", "4", "--zero", "0", "--recompute", "none",
      "--tables", "none", "--png", "nodir/x.png"], ["cannot write PNG to 'nodir/x.png'"]),
    (["plan", "--model", "llama3-8b", "--pp", "2", "--microbatches", "4", "--png", ""], ["--png needs a file path"]),
    (["plan", "--model", "llama3-8b", "--model-file", "bom.yaml", "--pp", "2", "--microbatches", "4"],
     ["--model 'llama3-8b' or --model-file 'bom.yaml', not both"]),
    (["plan", "--model", "llama3-8b", "--pp", "2", "--microbatches", "4", "--gpu", ""], ["unknown GPU ''", "gh200"]),
    (["plan", "--model", "llama3-8b", "--pp", "2", "--microbatches", "4", "--reserve", "1e308"],
     ["--reserve 1e+308 GiB is too large"]),
    (["plan", "--model", "llama3-8b", "--pp", "2", "--microbatches", "4", "--p2p-bandwidth", "1e308"],
     ["--p2p-bandwidth 1e+308 GB/s is too large"]),
    (["plan", "--model", "llama3-8b", "--pp", "2", "--microbatches", "4", "--gpu-tflops", "1e308"],
     ["--gpu-tflops 1e+308 TFLOP/s is too large"]),
])
def test_bad_input_is_refused_in_one_line(files, argv, fragments):
    refused(argv, files, *fragments)


def test_a_schedule_file_named_like_a_family_is_read(files):
    (files / "1f1b").write_text((files / "one.json").read_text())
    code, err = run_cli(["verify", "1f1b"], files)
    assert code == 0 and not err, err
    code, err = run_cli(["show", "--schedule", "1f1b"], files)
    assert code == 0 and not err, err


def test_an_echoed_value_is_cut(files):
    line = refused(["compile", "x" * 5000, "--json", "x.json"], files, "unknown engine", "...")
    assert "x" * MAX_SHOWN not in line  # (the line goes on to list every accepted value)
    line = refused(["compile", "1f1b", "--pp", "2" * 5000, "-m", "2", "--json", "x.json"], files, "--pp", "...")
    assert len(line) < 300
    line = refused(["compile", "1f1b", "--pp", "2", "-m", "2", "--csv-form", "y" * 5000, "--csv", "x.csv"], files,
                   "invalid choice", "...")
    assert len(line) < 300 and "y" * MAX_SHOWN not in line


@pytest.mark.parametrize("argv", [
    ["verify", "bom.json"], ["verify", "bom.txt"], ["verify", "bom.csv"],
    ["simulate", "1f1b", "--pp", "2", "-m", "2", "--cost", "bomcost.json"],
    ["plan", "--model-file", "bom.yaml", "--pp", "4", "--tp", "4", "--microbatches", "8", "--tables", "none"],
])
def test_a_byte_order_mark_is_accepted(files, argv):
    code, err = run_cli(argv, files)
    assert code in (0, 1) and not err, err  # plan: 1 when nothing fits, with no error


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path):
    """`pipeschedule show ... | head -1`: the pipe closes while the timeline is written."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "pipeschedule.cli", "show", "1f1b", "--pp", "64", "-m", "64"]
    with subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        proc.stdout.readline()
        proc.stdout.close()  # as `head -1` does
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == 141
    assert err == "", err


def test_many_ranks_compile_quickly(files):
    """1F1B at pp=8192 (MAX_STAGES): asap used to sweep every rank once per rank (minutes)."""
    code, err = run_cli(["compile", "1f1b", "--pp", "8192", "-m", "1", "--json", "x.json"], files, timeout=60)
    assert code == 0, err


# -- every numeric flag with values it must refuse --------------------------------------

BAD_VALUES = ["0", "-1", "1_0", "１", "1e400", "nan", "inf", "x" * 3000, "9" * 30, ""]
SCHEDULE = ["--pp", "2", "-m", "2"]
PLAN = ["--model", "llama3-70b", "--pp", "4", "--tp", "4", "--microbatches", "8", "--tables", "none"]
FLAGS = (
    [(["compile", "1f1b", *SCHEDULE, "--json", "x.json"], flag) for flag in ("--pp", "-m", "--cap")]
    + [(["compile", "interleaved_1f1b", *SCHEDULE, "--json", "x.json"], "--virtual")]
    + [(["show", "1f1b", *SCHEDULE], "--width")]
    + [(["simulate", "1f1b", *SCHEDULE, "--offload", "auto"], "--host-bandwidth")]
    + [(["plan", *PLAN], flag) for flag in (
        "--pp", "--tp", "--dp", "--microbatches", "--seq", "--micro-batch", "--layers", "--hidden", "--heads",
        "--kv-heads", "--ffn", "--vocab", "--gpu-memory", "--reserve", "--gpu-tflops", "--mfu", "--p2p-bandwidth",
        "--p2p-latency", "--virtual", "--node-limit", "--host-bandwidth")]
)

# One process runs every case through `main` (starting one per case would take minutes):
# it reports each case's exit code, stderr and any exception that escaped `main`.
_BATCH = textwrap.dedent("""
    import contextlib, io, json, sys, time
    from pipeschedule.cli import main
    out = []
    for argv in json.load(sys.stdin):
        err = io.StringIO()
        start = time.monotonic()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                code = main(argv)
            escaped = None
        except BaseException as exc:  # a traceback
            code, escaped = None, f"{type(exc).__name__}: {exc}"[:300]
        out.append([argv[:12], code, err.getvalue().strip().splitlines(), escaped, time.monotonic() - start])
    json.dump(out, sys.stdout)
""")


def test_every_numeric_flag_refuses_bad_values_in_one_line(tmp_path):
    cases = []
    for base, flag in FLAGS:
        for value in BAD_VALUES:
            argv = list(base)
            if flag in argv:
                argv[argv.index(flag) + 1] = value
            else:
                argv += [flag, value]
            cases.append(argv)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", _BATCH], input=json.dumps(cases), cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240, preexec_fn=_limit_memory)
    assert done.returncode == 0, done.stderr[-2000:]
    problems = []
    for argv, code, err, escaped, seconds in json.loads(done.stdout):
        if escaped is not None or code not in (0, 1, 2) or (code == 2 and len(err) != 1) or seconds > 20:
            problems.append((argv, code, err[-2:], escaped, round(seconds, 1)))
        elif code == 2 and (len(err[0]) > 400 or "x" * MAX_SHOWN in err[0]):
            problems.append((argv, "message too long", err[0][:120]))
    assert not problems, problems[:5]
