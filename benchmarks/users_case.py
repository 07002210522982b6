"""The users' case: Llama3-70B, pp=4, tp=4 with sequence parallel and async TP linears,
seq 8192, micro-batch 1, GH200 96 GiB (2 GiB reserve), 128 microbatches, dp = 1..16.

    python -m benchmarks.users_case            # the tables of docs/users_case.md
    python -m benchmarks.users_case --quick    # dp 1 and 2 only
    python -m benchmarks.users_case --time 5 --against ../old-checkout
        # the README's `pipeschedule plan` command (dp=2, reserve 4) timed in turn with the
        # same command of another checkout, pair by pair (process CPU of each child);
        # writes benchmarks/results/plan_users_case_time.{md,json}

Prints, per dp, nanotron's default (1F1B, its split 21/20/20/19) under each reading of
the users' setup, and the planner's recommendation over every lever (`plan_levers`: ZeRO
stage, recompute none/selective/full and partial, schedule, cap, split, virtual stages,
host offload over GH200's 450 GB/s link) with nanotron's fp32 gradient accumulation, its
YAML, its margin and what it keeps on the host; then the same with offload's host memory
bounded (HOST_BOUND). Pure arithmetic, a few minutes on two cores.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common import git_commit, machine, write_results
from pipeschedule.plan import PlanConfig
from pipeschedule.plan.levers import plan_levers, tail_text, yaml_lines
from pipeschedule.plan.memory import GiB, TrainingSetup
from pipeschedule.plan.planner import ScheduleCache, nanotron_default
from pipeschedule.plan.fitting import OffloadCandidate
from pipeschedule.plan.presets import HOST_LINKS, MODELS

MODEL = MODELS["llama3-70b"]
SPLIT = (21, 20, 20, 19)
DPS = (1, 2, 4, 8, 16)
RESERVES = (2, 4)  # GiB kept back: the planner's default, and that plus the model's error at this size (2%)
HOST_BOUND = 64  # GiB of host memory per GPU offload may take in the bounded table: half of a 128 GB Grace
READINGS = {
    "A: fp32 accumulation, full recompute": {"fp32_grad_accum": True, "recompute": "full"},
    "B: bf16 gradients and Adam, no recompute": {"fp32_grad_accum": False, "recompute": "none"},
    "C: bf16 gradients and Adam, full recompute": {"fp32_grad_accum": False, "recompute": "full"},
}


def config(dp: int, microbatches: int = 128, reserve: float = 2, host: float | None = None, **setup) -> PlanConfig:
    st = TrainingSetup(tp=4, dp=dp, seq=8192, micro_batch=1, sequence_parallel=True, tp_async=True, **setup)
    return PlanConfig(MODEL, st, pp=4, microbatches=microbatches, gpu_memory=96 * GiB, reserve=reserve * GiB,
                      gpu_name="gh200", host_bandwidth=HOST_LINKS["gh200"] * 1e9,
                      host_memory=None if host is None else host * GiB)


def default(dp: int, zero: int, **setup):
    cfg = config(dp, zero_stage=zero, **setup)
    return nanotron_default(cfg, ScheduleCache(cfg.pp, cfg.microbatches), SPLIT)


def stages(cand) -> str:
    return " / ".join(f"{r.total / GiB:.1f}" for r in cand.memory)


def main() -> None:
    global DPS, RESERVES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="dp 1 and 2, reserve 2 GiB only (a smoke run)")
    parser.add_argument("--time", type=int, metavar="PAIRS", help="time the README's plan command, PAIRS pairs")
    parser.add_argument("--against", metavar="CHECKOUT", help="with --time: the checkout to pair against")
    args = parser.parse_args()
    if args.time:
        return time_command(args.time, args.against)
    if args.quick:
        DPS, RESERVES = (1, 2), (2,)
    base = default(1, 0, **READINGS["A: fp32 accumulation, full recompute"])
    print("## nanotron's default per reading (peak GiB per stage, budget 94.0)\n")
    print("| reading | dp | ZeRO | stage 0 / 1 / 2 / 3 | fits | stage 0 margin GiB | step s |")
    print("|---|---|---|---|---|---|---|")
    for name, setup in READINGS.items():
        for dp in DPS:
            for zero in (0, 1) if dp > 1 else (0,):
                cand = default(dp, zero, **setup)
                print(f"| {name} | {dp} | {zero} | {stages(cand)} | {'yes' if cand.fits else 'no'} "
                      f"| {-cand.memory[0].overflow / GiB:.1f} | {cand.step_time:.2f} |")
    for reserve in RESERVES:
        recommend(base, reserve)
    recommend(base, RESERVES[-1], HOST_BOUND)


def host_text(cand) -> str:
    if not isinstance(cand, OffloadCandidate):
        return "-"
    return " / ".join(f"{b / GiB:.1f}" for b in cand.host_bytes)


def recommend(base, reserve: float, host: float | None = None) -> None:
    bound = "" if host is None else f", offload at most {host:g} GiB on the host per GPU"
    print(f"\n## The recommendation, reserve {reserve:g} GiB{bound} (budget {96 - reserve:g} GiB; fp32 accumulation; "
          f"x against reading A's default at dp=1, {base.step_time:.2f} s per step)\n")
    print("| dp | pp_engine; optimizer.zero_stage | peak GiB per stage | margin GiB | host GiB per stage | step s "
          "| x per GPU | tail |")
    print("|---|---|---|---|---|---|---|---|")
    yamls = {}
    for dp in DPS:
        levers = plan_levers(config(dp, reserve=reserve, host=host, fp32_grad_accum=True))
        if levers.best is None:
            print(f"| {dp} | nothing fits | | | | | | |")
            continue
        key, cand = levers.best
        yamls[dp] = yaml_lines(key, cand, 4)
        engine = yamls[dp][2].split(": ", 1)[1]
        print(f"| {dp} | `{engine}`; {key[0]} | {stages(cand)} | {-cand.peak.overflow / GiB:.1f} | {host_text(cand)} "
              f"| {cand.step_time:.2f} | {base.step_time / cand.step_time:.3f} | {tail_text(cand)} |")
    for dp, lines in yamls.items():
        print(f"\ndp={dp}, reserve {reserve:g} GiB{bound}:\n\n```yaml\n" + "\n".join(lines) + "\n```")


COMMAND = ("plan --model llama3-70b --pp 4 --tp 4 --dp 2 --microbatches 128 --tp-async --gpu gh200 --reserve 4 "
           "--tables none").split()


def child_cpu(checkout: str) -> float:
    """Process CPU seconds of one run of COMMAND from `checkout` (its package imported)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-m", "pipeschedule.cli", *COMMAND], cwd=checkout, check=True,
                   env=dict(os.environ, PYTHONPATH=checkout), stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def time_command(pairs: int, against: str | None) -> None:
    """COMMAND from this checkout and `against` in turn (one warm-up each), the ratio of
    each pair; prints and writes the median."""
    here = str(Path(__file__).resolve().parents[1])
    runs = {"this": [], "against": []}
    for i in range(pairs + 1):
        for name, path in (("this", here), ("against", against)):
            if path is not None:
                cpu = child_cpu(path)
                if i:  # the first pair warms the caches
                    runs[name].append(cpu)
    ratios = [a / b for a, b in zip(runs["this"], runs["against"])]
    if against is not None:  # named by its commit: no path of this machine goes into the results
        head = subprocess.run(["git", "-C", against, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        against = f"commit {head.stdout.strip()}" if head.returncode == 0 else Path(against).name
    report = {"date": datetime.date.today().isoformat(), "command": "pipeschedule " + " ".join(COMMAND),
              "machine": machine(), "commit": git_commit(), "python": sys.version.split()[0],
              "against": against, "cpu_s": runs,
              "median_cpu_s": {k: statistics.median(v) for k, v in runs.items() if v},
              "median_ratio": statistics.median(ratios) if ratios else None}
    lines = [f"# `pipeschedule plan`, the README's command ({report['date']})", "",
             f"    {report['command']}", "",
             f"Process CPU per run, {pairs} runs after one warm-up, this checkout and {against} in turn.", "",
             "| checkout | CPU s per run | median |", "|---|---|---:|"]
    for name, values in runs.items():
        if values:
            lines.append(f"| {name} | {' '.join(f'{v:.2f}' for v in values)} | {statistics.median(values):.2f} |")
    if ratios:
        lines += ["", f"Ratio this / against, pair by pair: {' '.join(f'{r:.3f}' for r in ratios)}; "
                      f"median {statistics.median(ratios):.3f}."]
    lines += ["", f"commit {report['commit']}, python {report['python']}, machine {report['machine']}"]
    write_results("plan_users_case_time", report, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
