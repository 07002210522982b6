"""What stage 0 holds at its peak, with and without offload (a diagnostic for issue 9).

    python -m benchmarks.diagnostics.offload_anatomy [--fractions 0,0.25] [--out DIR]

`benchmarks.offload` measured stage 0's peak allocated memory rising by about one stash
when it offloaded a quarter or three quarters of its stashes (H200, 1f1b, m=8, lead 1).
This runs the same setup (four processes on one GPU, `Executor` over
`HostStagedTransport`, `benchmarks.offload.worker`'s stages) and, on rank 0, records the
caching allocator's history for one step after a warm-up step
(`torch.cuda.memory._record_memory_history`). From the trace it rebuilds the set of live
blocks at the step's peak and groups them by the innermost frame in this repository's
code, so the offloaded and the plain run can be compared block by block. It also records
the ledger's per-instruction trace with host timestamps, to say at which instruction the
peak fell. CUDA only.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.common import MODEL, PP, SMOKE_MODEL, write_results
from benchmarks.llama.model import ModelConfig
from benchmarks.offload import LEAD, OFFLOAD_M, RankStages, offload_schedule, stage_data
from benchmarks.training import model_split, sync

OURS = ("pipeschedule/", "integration/", "benchmarks/")


def _site(frames: list[dict]) -> str:
    """The innermost frame in this repository's code, else the innermost Python frame."""
    for frame in frames:
        name = frame.get("filename", "")
        if any(part in name for part in OURS):
            short = name[max(name.find(p) for p in OURS if p in name):]
            return f"{short}:{frame.get('line')} {frame.get('name')}"
    for frame in frames:
        if frame.get("filename", "").endswith(".py"):
            return f"{frame['filename'].rsplit('/', 1)[-1]}:{frame.get('line')} {frame.get('name')}"
    return "(no Python frame)"


def peak_blocks(snapshot: dict, device: int = 0) -> dict:
    """The live allocations at the highest point of the recorded trace, grouped by site."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    peak_time = None
    for entry in snapshot["device_traces"][device]:
        action = entry["action"]
        if action == "alloc":
            live[entry["addr"]] = (entry["size"], _site(entry.get("frames", [])))
            total += entry["size"]
            if total > peak:
                peak, at_peak, peak_time = total, dict(live), entry.get("time_us")
        elif action == "free_completed":
            block = live.pop(entry["addr"], None)
            if block is not None:
                total -= block[0]
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, site in at_peak.values():
        groups[site][0] += size
        groups[site][1] += 1
    return {"peak_bytes_in_trace": peak, "peak_time_us": peak_time,
            "sites": sorted(([site, b, n] for site, (b, n) in groups.items()), key=lambda g: -g[1])}


def worker(rank: int, world: int, store, cfg, fractions: list[float]) -> list[dict]:
    from pipeschedule import compile_schedule
    from pipeschedule.runtime import Executor, HostStagedTransport

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    stages = RankStages(cfg, model_split(cfg, world), device, torch.bfloat16, [rank])
    transport = HostStagedTransport(store, prefix="offload-anatomy/")
    base = compile_schedule("1f1b", pp=world, microbatches=OFFLOAD_M)
    out = []
    for fraction in fractions:
        schedule = offload_schedule(base, fraction) if fraction > 0 else base
        executor = Executor(schedule, rank, stages, transport, device=device, timeout=600)
        params = [p for s in schedule.stages_of(rank) for p in stages.parameters(s)]
        row = {"fraction": fraction, "rank": rank}
        for step in range(2):
            inputs, targets = stage_data(cfg, OFFLOAD_M, 99 + step, device)
            for p in params:
                p.grad = None
            sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            record = step == 1 and rank == 0
            if record:
                torch.cuda.memory._record_memory_history(max_entries=200_000)
            times = []
            original = executor._ran

            def ran(pc, instr, original=original, times=times):
                original(pc, instr)
                times.append((pc, str(instr), time.perf_counter(), torch.cuda.memory_allocated(device)))

            executor._ran = ran
            start = time.perf_counter()
            executor.step(inputs if rank == 0 else None, targets if rank == world - 1 else None)
            sync(device)
            executor._ran = original
            if record:
                snapshot = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                row.update(peak_blocks(snapshot))
                row["instructions"] = [(pc, text, round((t - start) * 1e3, 3), alloc) for pc, text, t, alloc in times]
            row["peak_allocated"] = torch.cuda.max_memory_allocated(device)
            row["ledger_stash_peak"] = executor.ledger.high["stash"]
            row["moved"] = sum(executor.ledger.moved.values())
        out.append(row)
        del executor
        gc.collect()
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.diagnostics.offload_anatomy",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--fractions", default="0,0.25", help="comma-separated offload fractions of rank 0")
    parser.add_argument("--out", type=Path, default=None, help="write offload_anatomy.json here")
    parser.add_argument("--smoke", action="store_true", help="tiny model (still needs a GPU)")
    args = parser.parse_args(argv)
    try:
        fractions = [float(f) for f in args.fractions.split(",")]
    except ValueError:
        parser.error(f"--fractions {args.fractions!r}: comma-separated numbers in [0, 1]")
    if not all(0 <= f <= 1 for f in fractions):
        parser.error(f"--fractions {args.fractions!r}: each must be in [0, 1]")
    if not torch.cuda.is_available():
        print("benchmarks.diagnostics.offload_anatomy: needs a CUDA GPU (the allocator's history)", file=sys.stderr)
        return 2
    from pipeschedule.runtime.launch import spawn

    ranks = spawn(worker, PP, timeout=600, args=(ModelConfig(**(SMOKE_MODEL if args.smoke else MODEL)), fractions))
    rows = [r for r in ranks[0]]
    for row in rows:
        print(f"\nfraction {row['fraction']} (lead {LEAD}): peak allocated {row['peak_allocated'] / 2**20:.0f} MiB, "
              f"ledger stash peak {row['ledger_stash_peak'] / 2**20:.0f} MiB, moved {row['moved'] / 2**20:.0f} MiB")
        if "sites" in row:
            instrs = row["instructions"]
            top = max(instrs, key=lambda i: i[3])
            print(f"  highest allocated after an instruction: {top[3] / 2**20:.0f} MiB after pc {top[0]} {top[1]} "
                  f"at {top[2]:.1f} ms")
            print(f"  live blocks at the trace's peak ({row['peak_bytes_in_trace'] / 2**20:.0f} MiB):")
            for site, nbytes, count in row["sites"][:15]:
                print(f"    {nbytes / 2**20:10.1f} MiB  {count:5d}  {site}")
            print("  allocated MiB after each instruction: " + ", ".join(
                f"{pc}:{text}={alloc / 2**20:.0f}" for pc, text, _, alloc in instrs))
    if args.out is not None:
        write_results("offload_anatomy", rows, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
