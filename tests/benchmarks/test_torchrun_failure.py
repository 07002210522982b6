"""benchmarks.common.torchrun_failure: the rank that failed first stays in the message."""

import subprocess

from benchmarks.common import torchrun_cause, torchrun_failure


def test_every_rank_keeps_its_last_lines_however_long_the_others_are():
    rank0 = ["[rank0]: Traceback (most recent call last):", "[rank0]: torch.OutOfMemoryError: CUDA out of memory."]
    rank1 = [f"[rank1]:   frame {k}" for k in range(500)] + ["[rank1]: RuntimeError: Connection closed by peer"]
    launcher = [f"launcher line {k}" for k in range(100)]
    result = subprocess.CompletedProcess([], 1, "", "\n".join(rank0 + rank1 + launcher))
    text = torchrun_failure("host-bound", result, lines_per_rank=10)
    lines = text.splitlines()
    assert lines[0] == "host-bound: torchrun exited with 1"
    assert lines[1:3] == rank0  # first, whole
    assert lines[3:13] == rank1[-10:]
    assert lines[13:] == launcher[-10:]
    # the old message, the last 4000 characters of stderr, had lost rank 0
    assert "OutOfMemoryError" not in result.stderr[-4000:]


def test_ranks_are_ordered_by_number_not_text():
    stderr = "\n".join(["[rank10]: ValueError: ten", "[rank2]: ValueError: two"])
    text = torchrun_failure("x", subprocess.CompletedProcess([], 1, "", stderr))
    assert text.index("two") < text.index("ten")


def test_the_cause_is_the_lowest_rank_s_exception_line():
    stderr = "\n".join([
        "W1205 launcher warning",
        "[rank1]: Traceback (most recent call last):",
        "[rank1]:   File \"x.py\", line 3, in f",
        "[rank1]: RuntimeError: Connection closed by peer",
        "[rank0]: Traceback (most recent call last):",
        "[rank0]:     raise MemoryError(\"not this line\")",
        "[rank0]: torch.OutOfMemoryError: CUDA out of memory.",
    ])
    result = subprocess.CompletedProcess([], 1, "", stderr)
    assert torchrun_cause(result) == "[rank0]: torch.OutOfMemoryError: CUDA out of memory."
    assert torchrun_cause(subprocess.CompletedProcess([], 1, "", "\n  launcher says no\n")) == "launcher says no"
    assert torchrun_cause(subprocess.CompletedProcess([], 3, "", "")) == "torchrun exited with 3"
