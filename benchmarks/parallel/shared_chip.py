"""Pipeline steps on SM partitions of one GPU, predicted with the chip's rate shared.

    python -m benchmarks.parallel.shared_chip   # reads benchmarks/results/parallel_gpu_partitions_m8.json

[Note: a shared chip] The simulator gives each (op, stage) one duration. On SM partitions of
one GPU a block's duration depends on how many partitions compute at the same time: they
share the chip's memory bandwidth, cache and power, so four busy partitions each run up to
1.31x slower than one alone (benchmarks/results/parallel_sm_probe.md), and a schedule's
warm-up and cool-down, where few ranks compute, run faster than its steady state
(parallel_gpu_partitions_m8.md). This model runs a schedule as the partitioned runtime
does, rank by rank in program order (a batch of messages posted whole; a message lands
`message_s` after both its send and its receive are posted, the simulator's semantics),
and lets every compute progress at rate 1 / f(k) while k ranks compute, f(k) = 1 +
slope (k - 1). A block's work
(its duration alone) is read from a measured step: its span divided by f of the ranks
computing at its midpoint, the median per (op, stage). With slope 0 it is the simulator's
model fed per-block medians, the check that the two agree.

It models one GPU's partitions only: separate GPUs share nothing, and the simulator's
constant costs are theirs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from benchmarks.common import RESULTS
from benchmarks.parallel.predict import cost_model, predict
from benchmarks.parallel.report import REFERENCE, schedule_of
from pipeschedule.compiler.ir import COMM_OPS, RECV_OPS, SEND_OPS, Op, Schedule
from pipeschedule.simulate.critical_path import message_partners

PROBE_SLOPE = (1.31 - 1.0) / 3  # four busy partitions 1.31x one alone: parallel_sm_probe.md, driver route
COMPUTE = {Op.F: "F", Op.B: "B", Op.W: "W"}


def factor(k: int, slope: float) -> float:
    """How much slower a block runs while k ranks compute (k >= 1)."""
    return 1.0 + slope * (k - 1)


def block_work(spans_per_rank, slope: float) -> dict[tuple[str, int], float]:
    """(op, stage) -> median work of its blocks in one measured step: each span's duration
    over f(ranks computing at its midpoint)."""
    spans = [(r, op, stage, start, end) for r, rows in enumerate(spans_per_rank) for op, stage, _mb, start, end in rows]
    work: dict[tuple[str, int], list[float]] = defaultdict(list)
    for r, op, stage, start, end in spans:
        mid = (start + end) / 2
        k = 1 + sum(1 for q, _o, _s, a, b in spans if q != r and a <= mid <= b)
        work[op, stage].append((end - start) / factor(k, slope))
    return {key: statistics.median(values) for key, values in work.items()}


class _Run:
    """The fluid run: ranks advance in program order; computes share the chip."""

    def __init__(self, schedule: Schedule, work, slope: float, message_s: float):
        self.programs, self.work, self.slope, self.message_s = schedule.programs, work, slope, message_s
        self.partner = message_partners(schedule)  # a receive's (rank, pc) -> its send's
        self.sent: dict[tuple[int, int], float] = {}  # (rank, pc) of a send -> when it was posted
        self.posted: dict[tuple[int, int], float] = {}  # (rank, first pc) of a batch -> when it was posted
        self.pc = [0] * len(self.programs)
        self.left: dict[int, float] = {}  # rank -> work left of its running compute
        self.now = 0.0

    def settle(self, r: int) -> float | None:
        """Runs rank r's non-compute instructions from its pc at `now` until it starts a
        compute (None), ends (None), or waits for a receive: the time its data lands, or
        inf while the send has not been posted."""
        program = self.programs[r]
        while self.pc[r] < len(program):
            instr = program[self.pc[r]]
            if instr.op in COMPUTE:
                self.left[r] = self.work[COMPUTE[instr.op], instr.stage]
                return None
            if instr.op in COMM_OPS:
                end = self.pc[r]
                while end < len(program) and program[end].op in COMM_OPS:
                    end += 1
                posted = self.posted.setdefault((r, self.pc[r]), self.now)
                for pc in range(self.pc[r], end):  # the batch's sends, posted at once
                    if program[pc].op in SEND_OPS:
                        self.sent.setdefault((r, pc), posted)
                lands = max((max(self.sent.get(self.partner.get((r, pc)), float("inf")), posted) + self.message_s
                             for pc in range(self.pc[r], end) if program[pc].op in RECV_OPS), default=0.0)
                if lands > self.now:
                    return lands
                self.pc[r] = end
                continue
            self.pc[r] += 1  # FREE and the like take no time here
        return None

    def settle_all(self, ranks) -> dict[int, float]:
        """Settles every rank that does not compute until none moves (a send one rank posts
        can free another's receive): rank -> the time its data lands, for the waiting."""
        while True:
            before = (list(self.pc), len(self.sent), len(self.left))
            waits = {r: self.settle(r) for r in ranks if r not in self.left and self.pc[r] < len(self.programs[r])}
            if (list(self.pc), len(self.sent), len(self.left)) == before:
                return {r: t for r, t in waits.items() if t is not None}

    def step(self) -> float:
        ranks = range(len(self.programs))
        while True:
            waits = self.settle_all(ranks)
            if not self.left and not waits:
                if all(self.pc[r] == len(self.programs[r]) for r in ranks):
                    return self.now
                raise RuntimeError(f"the schedule stalls at pcs {self.pc}")
            rate = 1.0 / factor(len(self.left), self.slope) if self.left else 0.0
            finish = min((left / rate for left in self.left.values()), default=float("inf"))
            dt = min([finish] + [t - self.now for t in waits.values() if t != float("inf")])
            if dt == float("inf"):
                raise RuntimeError(f"the schedule deadlocks at pcs {self.pc}")
            self.now += dt
            for r in list(self.left):
                self.left[r] -= dt * rate
                if self.left[r] <= 1e-12:
                    del self.left[r]
                    self.pc[r] += 1


def predict_shared(schedule: Schedule, work, slope: float, message_s: float) -> float:
    """Seconds of one step of `schedule` on a shared chip ([Note: a shared chip])."""
    return _Run(schedule, work, slope, message_s).step()


def _stage_costs(work, stages: int) -> dict[str, list[float]]:
    return {name: [work.get((op, s), 0.0) for s in range(stages)]
            for name, op in (("forward", "F"), ("backward", "B"), ("weight", "W"))}


def table(results: dict, slope: float) -> list[dict]:
    """Per row of a gpu_partitions results file: measured, the simulator's prediction (the
    row's), this model's at slope 0 and the simulator's on the same per-block medians (the
    two must agree: the check of this model's semantics), and this model's at `slope`."""
    pp, link = results["pp"], results["link"]
    message_s = link["latency_s"] + link["boundary_bytes"] / link["bandwidth"]
    out = []
    for row in results["rows"]:
        if not row.get("trace_spans") or "predicted" not in row:
            continue  # a row without its own timeline (nanotron's engines) has no blocks to read
        schedule = schedule_of(row["engine"], pp, row["m"])
        flat_work = block_work(row["trace_spans"], 0.0)
        flat = predict_shared(schedule, flat_work, 0.0, message_s)
        same = predict(schedule, cost_model(_stage_costs(flat_work, schedule.num_stages), **link))["step_s"]
        shared = predict_shared(schedule, block_work(row["trace_spans"], slope), slope, message_s)
        out.append({"engine": row["engine"], "m": row["m"], "measured_s": row["median_s"],
                    "simulator_s": row["predicted"]["step_s"], "flat_s": flat, "simulator_same_s": same,
                    "shared_s": shared, "vs_reference": row.get("vs_" + REFERENCE, {}).get("measured")})
    return out


def realised(rows: list[dict]) -> dict[str, dict]:
    """engine -> its measured ratio to ps_1f1b (paired where the run paired it) and, for the
    simulator and this model, the share of the gain it predicts that was realised,
    (1 - measured) / (1 - predicted): None where the model predicts no gain of 1% or more
    (a share of a predicted loss, or of noise, says nothing)."""
    ref = next((r for r in rows if r["engine"] == REFERENCE), None)
    out = {}
    for r in rows:
        if ref is None or r is ref:
            continue
        measured = r.get("vs_reference") or r["measured_s"] / ref["measured_s"]
        entry = {"measured": measured}
        for key in ("simulator_s", "shared_s"):
            predicted = r[key] / ref[key]
            entry[key] = (1 - measured) / (1 - predicted) if predicted <= 0.99 else None
        out[r["engine"]] = entry
    return out


def _relative(row: dict, ref: dict | None):
    """key -> the row's figure over ps_1f1b's, as text ('' without ps_1f1b)."""
    return lambda key: f"{row[key] / ref[key]:.3f}" if ref else ""


def render(rows: list[dict], slope: float, source: str) -> str:
    ref = next((r for r in rows if r["engine"] == REFERENCE), None)
    shares = realised(rows)

    def measured(r: dict) -> str:
        return f"{shares[r['engine']]['measured']:.3f}" if r["engine"] in shares else _relative(r, ref)("measured_s")

    def share(name: str, key: str) -> str:
        value = shares.get(name, {}).get(key)
        return "" if value is None else f"{value:.0%}"

    lines = [f"Shared-chip model over {source}: f(k) = 1 + {slope:.4f} (k - 1).", "",
             "Error: measured over predicted, less 1 (as the benchmark's own table). vs ps_1f1b measured: the "
             "run's paired ratio where it paired one. Gain realised: the share of the gain over `ps_1f1b` that "
             "each model predicts, measured, where the model predicts a gain of 1% or more.", "",
             "| engine | m | measured | simulator | error | shared chip | error | vs ps_1f1b measured | "
             "simulator | shared chip | gain realised: simulator's | shared chip's |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rel = _relative(r, ref)
        lines.append(f"| `{r['engine']}` | {r['m']} | {r['measured_s']:.3f} s | {r['simulator_s']:.3f} s | "
                     f"{100 * (r['measured_s'] / r['simulator_s'] - 1):+.1f}% | {r['shared_s']:.3f} s | "
                     f"{100 * (r['measured_s'] / r['shared_s'] - 1):+.1f}% | {measured(r)} | "
                     f"{rel('simulator_s')} | {rel('shared_s')} | {share(r['engine'], 'simulator_s')} | "
                     f"{share(r['engine'], 'shared_s')} |")
    within = lambda key: sum(abs(r["measured_s"] / r[key] - 1) <= 0.05 for r in rows)  # noqa: E731
    lines += ["", f"Within 5% of the measured step: simulator {within('simulator_s')} of {len(rows)}, shared chip "
                  f"{within('shared_s')} of {len(rows)}. This model at slope 0 against the simulator on the same "
                  "per-block medians: largest difference "
                  f"{max(abs(r['flat_s'] / r['simulator_same_s'] - 1) for r in rows) * 100:.4f}%."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.parallel.shared_chip",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS / "parallel_gpu_partitions_m8.json",
                        help="a benchmarks.parallel.gpu_partitions results file (default: the m=8 run)")
    parser.add_argument("--slope", type=float, default=PROBE_SLOPE,
                        help=f"f(k) = 1 + slope (k - 1) (default {PROBE_SLOPE:.4f}: the probe's 1.31 at four)")
    args = parser.parse_args(argv)
    if not args.results.is_file():
        print(f"benchmarks.parallel.shared_chip: no results file {args.results}", file=sys.stderr)
        return 2
    if not 0.0 <= args.slope <= 1.0:
        print(f"benchmarks.parallel.shared_chip: --slope must be in 0..1, got {args.slope}", file=sys.stderr)
        return 2
    rows = table(json.loads(args.results.read_text()), args.slope)
    print(render(rows, args.slope, args.results.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
