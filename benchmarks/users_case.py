"""The users' case: Llama3-70B, pp=4, tp=4 with sequence parallel and async TP linears,
seq 8192, micro-batch 1, GH200 96 GiB (2 GiB reserve), their 16 microbatches (and 128).

    python -m benchmarks.users_case            # the tables of docs/users_case.md
    python -m benchmarks.users_case --quick    # dp 1 and 2 only
    python -m benchmarks.users_case --time 5 --against ../old-checkout
        # the README's `pipeschedule plan` command (dp=2, reserve 4) timed in turn with the
        # same command of another checkout, pair by pair (process CPU of each child);
        # writes benchmarks/results/plan_users_case_time.{md,json}

Prints (1) each of the users' observations beside the memory model's prediction under
three readings of their setup, nanotron's own 1F1B engine with its split 21/20/20/19
(which folds the bf16 gradients after each backward, [Note: memory terms]); (2) per dp the
best that nanotron's engines can do alone (nanotron's 1F1B and split; ZeRO stage and
recompute as levers) and the best of pipeschedule's engines (every lever of `plan_levers`
but host offload: schedule, cap, split, virtual stages, ZeRO stage, recompute up to full,
partial recompute), with every memory term of its tightest stage and the YAML; (3) the goal
of issue 32: a plan of ours that fits dp=2 and dp=4 at >= 1.0 of the dp=1 default's
per-GPU throughput. Pure arithmetic, a minute or two on two cores.
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
from pipeschedule.plan.presets import HOST_LINKS, MODELS

MODEL = MODELS["llama3-70b"]
SPLIT = (21, 20, 20, 19)
DPS = (1, 2, 4, 8)
M = 16  # their batch_accumulation_per_replica
RESERVE = 2  # GiB kept back (the planner's default): budget 94 GiB
READINGS = {
    "A: fp32 accumulation, full recompute": {"fp32_grad_accum": True, "recompute": "full"},
    "B: bf16 gradients and Adam, no recompute": {"fp32_grad_accum": False, "recompute": "none"},
    "C: bf16 gradients and Adam, full recompute": {"fp32_grad_accum": False, "recompute": "full"},
}
A = "A: fp32 accumulation, full recompute"


def config(dp: int, microbatches: int = M, reserve: float = RESERVE, host: float | None = None, mfu: float = 0.5,
           **setup) -> PlanConfig:
    st = TrainingSetup(tp=4, dp=dp, seq=8192, micro_batch=1, sequence_parallel=True, tp_async=True, **setup)
    return PlanConfig(MODEL, st, pp=4, microbatches=microbatches, gpu_memory=96 * GiB, reserve=reserve * GiB,
                      gpu_name="gh200", host_bandwidth=HOST_LINKS["gh200"] * 1e9,
                      host_memory=None if host is None else host * GiB, mfu=mfu)


def default(dp: int, zero: int, microbatches: int = M, mfu: float = 0.5, **setup):
    """nanotron's own 1F1B engine with its split."""
    cfg = config(dp, microbatches, zero_stage=zero, mfu=mfu, **setup)
    return nanotron_default(cfg, ScheduleCache(cfg.pp, cfg.microbatches), SPLIT)


MEASURED = 780.0  # tokens/s per GPU the users measured at dp=1, m=16 (their discussion, beside the brief)
SPEED_READINGS = {**READINGS, "D: bf16 gradients and Adam, selective recompute":
                  {"fp32_grad_accum": False, "recompute": "selective"}}


def mfu_for(tokens: float, microbatches: int, setup: dict) -> float:
    """The fraction of peak at which the planner's step of nanotron's dp=1 default gives
    `tokens` tokens/s per GPU (bisection: the step falls as the fraction grows)."""
    low, high = 0.05, 1.0
    for _ in range(40):
        mid = (low + high) / 2
        if default(1, 0, microbatches, mfu=mid, **setup).tokens_per_gpu < tokens:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def throughput() -> list[str]:
    """The planner's tokens/s per GPU of nanotron's dp=1 default beside the one figure the
    users measured, per reading, with the fraction of peak each reading needs to give it;
    and the share of a layer's counted work that is attention (flash-attn's causal kernel
    runs half of it)."""
    out = ["", "## Throughput beside the one measured figure (dp=1, nanotron's 1F1B and split, ZeRO-0; the users "
           f"measured about {MEASURED:.0f} tokens/s per GPU at m=16)", "",
           "| reading | m | step s at 0.5 of 989 TFLOP/s | tokens/s per GPU | against the measured | fraction of peak "
           f"that gives {MEASURED:.0f} |", "|---|---|---|---|---|---|"]
    for name, setup in SPEED_READINGS.items():
        for m in (M, 64):
            cand = default(1, 0, m, **setup)
            against = f"{cand.tokens_per_gpu / MEASURED - 1:+.0%}" if m == M else "(not measured)"
            needed = f"{mfu_for(MEASURED, m, setup):.2f}" if m == M else ""
            out.append(f"| {name} | {m} | {cand.step_time:.2f} | {cand.tokens_per_gpu:.0f} | {against} | {needed} |")
    layer = MODEL.layer_params()
    attention = 4 * 8192 * 8192 * MODEL.hidden  # what the planner counts per layer and sequence (config.layer_seconds)
    share = attention / (2 * layer * 8192 + attention)
    out += ["", f"Attention is {share:.1%} of a layer's counted forward work at seq 8192 (4 s^2 h of "
            f"2 P s + 4 s^2 h); flash-attn's causal kernel computes about half of it, so the count is "
            f"{share / 2:.1%} above the work done."]
    return out


def stages(cand) -> str:
    return " / ".join(f"{r.total / GiB:.1f}" for r in cand.memory)


def verdict(cand) -> str:
    over = [r.rank for r in cand.memory if not r.fits]
    return "fits" if not over else "OOM on stage " + ", ".join(map(str, over))


def observations() -> list[str]:
    """Each observation of the users beside the prediction of each reading."""
    d = {name: {(dp, z, m): default(dp, z, m, **setup) for dp, z, m in
                ((1, 0, M), (2, 0, M), (2, 1, M), (4, 1, M), (8, 1, M), (2, 1, 128), (4, 1, 128), (8, 1, 128))}
         for name, setup in READINGS.items()}
    budget = config(1).budget / GiB
    rows = []

    def row(observed: str, predicted) -> None:
        rows.append(f"| {observed} | " + " | ".join(predicted(d[name]) for name in READINGS) + " |")

    def step(c) -> str:
        t = [r.total / GiB for r in c.memory]
        return " / ".join(f"{a - b:+.1f}" for a, b in zip(t[1:], t))

    row("(1) dp=1 fits, \"just barely\"", lambda x: f"{verdict(x[1, 0, M])}: {stages(x[1, 0, M])} "
        f"({budget - x[1, 0, M].peak.total / GiB:.1f} to spare)")
    row("(2) dp=2 (ZeRO-0) OOM, on the first stage only", lambda x: f"{verdict(x[2, 0, M])}: {stages(x[2, 0, M])}")
    row("(3) each stage ~10 GB less than the one before", lambda x: f"steps {step(x[1, 0, M])} GiB")
    row("(4a) ZeRO-1, acc=16: fits at dp>1", lambda x: "; ".join(
        f"dp={dp} {verdict(x[dp, 1, M])} {x[dp, 1, M].peak.total / GiB:.1f}" for dp in (2, 4, 8)))
    row("(4b) ZeRO-1, acc=128: OOM at dp=2, 4, not 8", lambda x: "; ".join(
        f"dp={dp} {verdict(x[dp, 1, 128])} {x[dp, 1, 128].peak.total / GiB:.1f}" for dp in (2, 4, 8)))
    row("(5) \"max memory 50.2 GB\" at dp=1", lambda x: f"{x[1, 0, M].peak.total / GiB:.1f} GiB "
        f"({x[1, 0, M].peak.total / 1e9:.1f} GB)")
    return ["## The observations beside the model (nanotron's 1F1B, its split 21/20/20/19; GiB per stage 0/1/2/3, "
            f"budget {budget:.0f})", "",
            "| observed | " + " | ".join(READINGS) + " |", "|---|" + "---|" * len(READINGS), *rows]


def slopes() -> list[str]:
    """Which recompute reading gives the ~10 GB fall per stage of observation (3)."""
    out = ["", "## Which recompute gives the ~10 GB fall per stage (dp=1, nanotron's 1F1B; GiB from one stage to the "
           "next)", "", "| gradients, optimizer | recompute none | selective | full |", "|---|---|---|---|"]
    for accum in (True, False):
        cells = []
        for mode in ("none", "selective", "full"):
            t = [r.total / GiB for r in default(1, 0, fp32_grad_accum=accum, recompute=mode).memory]
            cells.append(" / ".join(f"{b - a:+.1f}" for a, b in zip(t, t[1:])) + f" (stage 0 {t[0]:.1f})")
        name = "fp32 accumulation, fp32 Adam" if accum else "bf16 gradients and Adam"
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def terms(cand) -> str:
    """Every memory term of the candidate's tightest stage, GiB."""
    peak = cand.peak
    return f"stage {peak.rank}: " + ", ".join(f"{k} {v / GiB:.2f}" for k, v in peak.terms.items() if v) \
        + f"; total {peak.total / GiB:.2f} of {peak.budget / GiB:.0f}"


def nanotron_alone(dp: int, reserve: float = RESERVE):
    """The fastest that fits of nanotron's own 1F1B and split, over the ZeRO stage and
    recompute none / full (the users' fork recomputes), fp32 accumulation; else the one
    that overflows least."""
    options = []
    for z in (0, 1) if dp > 1 else (0,):
        for mode in ("none", "full"):
            cfg = config(dp, reserve=reserve, zero_stage=z, fp32_grad_accum=True, recompute=mode)
            options.append((z, mode, nanotron_default(cfg, ScheduleCache(cfg.pp, cfg.microbatches), SPLIT)))
    fitting = [o for o in options if o[2].fits]
    if fitting:
        return min(fitting, key=lambda o: o[2].step_time)
    return min(options, key=lambda o: o[2].peak.overflow)


def recommendations(base, reserve: float = RESERVE) -> tuple[list[str], dict]:
    """Per dp: nanotron's engines alone, and ours (no host offload), with the YAML."""
    budget = config(1, reserve=reserve).budget / GiB
    lines = ["", f"## The recommendation per dp, no host offload, reserve {reserve:g} GiB (fp32 accumulation, budget "
             f"{budget:.0f} GiB; x = per-GPU throughput against reading A's default at dp=1, {base.step_time:.2f} s "
             "per step)", "",
             "| dp | engines | pp_engine; ZeRO; recompute | peak GiB per stage | fits | step s | x per GPU |",
             "|---|---|---|---|---|---|---|"]
    ours, details = {}, []
    for dp in DPS:
        z, mode, cand = nanotron_alone(dp, reserve)
        lines.append(f"| {dp} | nanotron's alone | `1f1b`; {z}; {mode} | {stages(cand)} | {verdict(cand)} | "
                     f"{cand.step_time:.2f} | {base.step_time / cand.step_time:.3f} |")
        levers = plan_levers(config(dp, reserve=reserve, host=0, fp32_grad_accum=True))
        if levers.best is None:
            lines.append(f"| {dp} | pipeschedule's | nothing fits | | | | |")
            continue
        key, best = levers.best
        ours[dp] = (key, best)
        engine = yaml_lines(key, best, 4)[2].split(": ", 1)[1]
        lines.append(f"| {dp} | pipeschedule's | `{engine}`; {key[0]}; {key[1]} | {stages(best)} | {verdict(best)} | "
                     f"{best.step_time:.2f} | {base.step_time / best.step_time:.3f} |")
        details += ["", f"dp={dp}, reserve {reserve:g} GiB, pipeschedule's: {terms(best)}; step "
                    f"{best.pipeline_time:.2f} s pipeline + "
                    f"{tail_text(best) or 'no tail'}", "", "```yaml", *yaml_lines(key, best, 4), "```"]
    return lines + details, ours


def goal(base, ours: dict, reserve: float = RESERVE) -> list[str]:
    out = ["", f"## Goal: a plan of ours that fits dp=2 and dp=4 at >= 1.0 of the dp=1 default, no host offload, "
           f"recompute full or less (reserve {reserve:g} GiB)", ""]
    met = True
    for dp in (2, 4):
        if dp not in ours:
            out.append(f"- dp={dp}: nothing fits")
            met = False
            continue
        key, cand = ours[dp]
        x = base.step_time / cand.step_time
        met &= cand.fits and x >= 1.0
        out.append(f"- dp={dp}: `{yaml_lines(key, cand, 4)[2].split(': ', 1)[1]}`, ZeRO-{key[0]}, recompute {key[1]}: "
                   f"{x:.3f}x, peak {cand.peak.total / GiB:.1f} GiB on stage {cand.peak.rank}")
    out += ["", f"Goal {'met' if met else 'NOT met'} (predicted)."]
    return out


def main() -> None:
    global DPS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="dp 1 and 2 only (a smoke run)")
    parser.add_argument("--time", type=int, metavar="PAIRS", help="time the README's plan command, PAIRS pairs")
    parser.add_argument("--against", metavar="CHECKOUT", help="with --time: the checkout to pair against")
    args = parser.parse_args()
    if args.time:
        return time_command(args.time, args.against)
    if args.quick:
        DPS = (1, 2)
    base = default(1, 0, **READINGS[A])
    lines = observations() + slopes() + throughput()
    for reserve in (RESERVE,) if args.quick else (RESERVE, 2 * RESERVE):
        more, ours = recommendations(base, reserve)
        lines += more
        if not args.quick:
            lines += goal(base, ours, reserve)
    print("\n".join(lines))


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
