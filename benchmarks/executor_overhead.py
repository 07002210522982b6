"""Executor overhead: host time the runtime itself spends per instruction, on CPU.

    python -m benchmarks.executor_overhead            # full run, writes results
    python -m benchmarks.executor_overhead --quick    # fewer steps, nothing written

Stages are trivial (a 4-float activation times a one-element parameter), so almost all
the time is the executor's. The executor times itself (`StepTimes`): stage forward and
autograd backward (`compute_s`), posting and finishing batches (`transport_s`) and
blocking waits (`wait_s`); its overhead is what is left of the step:

    in-process   (wall time of the step - all ranks' compute - all ranks' transport)
                 / all ranks' instructions; the round-robin driver counts as overhead
    gloo         per rank: (total_s - compute_s - transport_s - wait_s) / instructions,
                 one process per rank (pp=2, one per core)

Target: at most 20 microseconds of overhead per instruction.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
from torch import nn

from benchmarks.common import RESULTS, git_commit, machine, write_results
from pipeschedule.compiler.families import generate
from pipeschedule.compiler.passes import lower
from pipeschedule.runtime import DistTransport, Executor, InProcessPipeline
from pipeschedule.runtime.launch import spawn

TARGET_US = 20.0
CASES = [  # (transport, family, pp, microbatches, virtual)
    ("in-process", "1f1b", 4, 32, 1),
    ("in-process", "interleaved_1f1b", 4, 32, 2),
    ("gloo", "1f1b", 2, 32, 1),
    ("gloo", "interleaved_1f1b", 2, 32, 2),
]


class TrivialStages:
    """Every stage multiplies by a one-element parameter; the last one sums (the loss)."""

    def __init__(self, num_stages: int):
        self.scales = [nn.Parameter(torch.ones(1)) for _ in range(num_stages)]

    def forward(self, stage, mb, act_in, target):
        out = act_in * self.scales[stage]
        return out.sum() if stage == len(self.scales) - 1 else out

    def parameters(self, stage):
        return [self.scales[stage]]


def _schedule(family, pp, microbatches, virtual):
    return lower(generate(family, pp=pp, microbatches=microbatches, virtual=virtual))


def _inputs(m):
    return [torch.ones(4) for _ in range(m)]


def run_in_process(family, pp, microbatches, virtual, warmup, steps) -> list[float]:
    """Overhead in microseconds per instruction, one figure per measured step."""
    schedule = _schedule(family, pp, microbatches, virtual)
    pipeline = InProcessPipeline(schedule, TrivialStages(schedule.num_stages))
    inputs, out = _inputs(microbatches), []
    for step in range(warmup + steps):
        start = time.perf_counter()
        pipeline.step(inputs)
        wall = time.perf_counter() - start
        times = [executor.times for executor in pipeline.executors]
        spent = sum(t.compute_s + t.transport_s for t in times)
        if step >= warmup:
            out.append(1e6 * (wall - spent) / sum(t.instructions for t in times))
    return out


def gloo_rank(rank, world, store, family, microbatches, virtual, warmup, steps) -> dict:
    torch.set_num_threads(1)
    schedule = _schedule(family, world, microbatches, virtual)
    executor = Executor(schedule, rank, TrivialStages(schedule.num_stages), DistTransport(store), timeout=60)
    inputs, overhead, transport, wait = _inputs(microbatches), [], [], []
    for step in range(warmup + steps):
        executor.step(inputs)
        t = executor.times
        if step >= warmup:
            overhead.append(1e6 * t.overhead_s / t.instructions)
            transport.append(1e6 * t.transport_s / t.instructions)
            wait.append(1e6 * t.wait_s / t.instructions)
    return {"overhead": overhead, "transport": transport, "wait": wait, "instructions": executor.times.instructions}


def measure(warmup: int, steps: int) -> list[dict]:
    rows = []
    for transport, family, pp, m, virtual in CASES:
        row = {"transport": transport, "family": family, "pp": pp, "microbatches": m, "virtual": virtual}
        if transport == "in-process":
            per_step = run_in_process(family, pp, m, virtual, warmup, steps)
            row.update(overhead_us=statistics.median(per_step), transport_us=None, wait_us=None)
        else:
            ranks = spawn(gloo_rank, pp, timeout=300, args=(family, m, virtual, warmup, steps))
            row.update(
                overhead_us=max(statistics.median(r["overhead"]) for r in ranks),
                transport_us=max(statistics.median(r["transport"]) for r in ranks),
                wait_us=max(statistics.median(r["wait"]) for r in ranks),
            )
        row["instructions_per_step"] = sum(len(p) for p in _schedule(family, pp, m, virtual).programs)
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _line(row) -> str:
    def us(value):
        return "      -" if value is None else f"{value:7.2f}"

    name = f"{row['family']} pp={row['pp']} m={row['microbatches']} v={row['virtual']}"
    return (f"{row['transport']:<11} {name:<34} {row['instructions_per_step']:6d} "
            f"{us(row['overhead_us'])} {us(row['transport_us'])} {us(row['wait_us'])}")


HEADER = (f"{'transport':<11} {'schedule':<34} {'instrs':>6} {'overhd':>7} {'post':>7} {'wait':>7}\n"
          f"{'':<11} {'':<34} {'/step':>6} {'us/ins':>7} {'us/ins':>7} {'us/ins':>7}")


def markdown(result) -> str:
    meta = result["meta"]
    lines = [
        "# Executor overhead", "",
        f"Date: {meta['date']}  ",
        f"Machine: {meta['machine']['cpu_model']}, {meta['machine']['cpu_count']} CPUs, "
        f"{meta['machine']['platform']}  ",
        f"Python {meta['machine']['python']}, torch {meta['machine']['torch']}; "
        f"1-minute load average at the end: {meta['machine']['load_average_1m_at_end']}  ",
        f"Commit: {meta['commit']}  ",
        f"Steps: {meta['warmup']} warm-up, median of {meta['steps']} measured", "",
        "Executor overhead per instruction: host time of a step minus stage compute (forward and",
        "autograd backward of trivial stages), minus posting/finishing batches, minus blocking",
        "waits (see the module docstring of `benchmarks/executor_overhead.py`). For gloo the worst",
        "rank is shown; `post` is the transport's host time, `wait` the time blocked on partners.",
        f"Target: <= {TARGET_US:g} us per instruction.", "",
        "| transport | schedule | instructions/step | overhead us/instr | post us/instr | wait us/instr |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        def us(value):
            return "-" if value is None else f"{value:.2f}"
        lines.append(
            f"| {row['transport']} | {row['family']} pp={row['pp']} m={row['microbatches']} v={row['virtual']} "
            f"| {row['instructions_per_step']} | {us(row['overhead_us'])} | {us(row['transport_us'])} "
            f"| {us(row['wait_us'])} |"
        )
    worst = max(row["overhead_us"] for row in result["rows"])
    lines += ["", f"Worst overhead: {worst:.2f} us per instruction "
                  f"({'meets' if worst <= TARGET_US else 'misses'} the target)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps; write nothing")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    steps, warmup = (5, 2) if args.quick else (args.steps, args.warmup)
    torch.set_num_threads(1)
    print(HEADER)
    rows = measure(warmup, steps)
    result = {
        "meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "machine": machine(), "commit": git_commit(), "warmup": warmup, "steps": steps,
                 "target_us_per_instruction": TARGET_US},
        "rows": rows,
    }
    worst = max(row["overhead_us"] for row in rows)
    print(f"\nworst executor overhead: {worst:.2f} us per instruction (target <= {TARGET_US:g})")
    if not args.quick:
        write_results("executor_overhead", result, markdown(result))
        print(f"wrote {RESULTS / 'executor_overhead.md'} and {RESULTS / 'executor_overhead.json'}")


if __name__ == "__main__":
    main()
