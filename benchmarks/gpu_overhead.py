"""Executor overhead on one GPU (part 2 of `benchmarks.gpu`).

All four stages of the Llama-style model run in ONE process on the GPU, as plain modules
(`LlamaStages`). One 1F1B step (m microbatches) is timed six ways, the variants
alternating round by round so that drift (clocks, allocator state, neighbours on the
host) hits all of them alike:

    fused      the same blocks, each microbatch's forward through all stages then ONE
               backward from its loss: the least work a step can do, no stage
               boundaries at all (for reference)
    ordered    the same forward and backward calls the executor makes, in an order it
               could make them (`compute_order`: 1F1B's order, ranks visited round-robin
               as `InProcessPipeline` does), from a plain loop: at each boundary the
               output is detached into a leaf that requires grad, and each stage's
               backward is its own autograd call with the received gradient. This is
               the baseline: "the pure compute of the same forward and backward calls"
    ordered_again
               the baseline once more, as its own variant: its paired median against
               `ordered` ("control") is what the method reads when nothing differs, the
               noise floor of the overhead figure
    executor   `InProcessPipeline` running the compiled 1f1b schedule: everything the
               runtime adds (dispatch, buffer table, ledger, buffer pool copies, the
               in-process transport)
    executor_per_step
               the executor on the same stages less their `state` (as stages that give
               none): the stash of the first F of each stage and input signature is
               measured again each step, as before the sizes were kept across steps;
               the difference to `executor` is what keeping them saves
    executor_every
               the executor measuring every F's stash with the ledger's saved-tensor
               hooks (`measure_stash="every"`); the default measures the first F of
               each stage and input signature once while the stage's state (training
               flags, requires_grad, autocast) stays the same, and the difference to
               `executor` is what the hooks would cost on every F

The variants are interleaved step by step (round r runs each variant once, starting
with a different one each round), so that host jitter, which comes and goes over
seconds (other work on the machine's CPUs), falls on all of them alike; at micro-batch
size 1 the model is host-bound on the H200 (the host takes about as long to issue a
step's ~20,000 kernels as the GPU takes to run them), so any hiccup of the host shows
in the step. Overhead = the median over rounds of (executor step - ordered step in the
same round), as a fraction of the executor's median step; the medians and minima of
every variant are reported beside it. For every variant the run also records host time
(until the step call returns, before the final synchronise), the synchronisations the
step makes (CUDA's sync-debug mode), and, from one profiled step, the GPU's busy time
(the union of kernel and copy intervals) and the number of kernels: if the executor's
busy time equals the baseline's while its step is longer, the GPU waited for the host;
if the busy time is longer, the executor added device work.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import MICROBATCH_SIZE, MODEL, PP, SMOKE_MODEL, WARMUP, rotated, versions, write_results
from benchmarks.llama.model import ModelConfig
from benchmarks.llama.reference import microbatch
from benchmarks.llama.stages import LlamaStages
from benchmarks.training import model_split, sync, to_device
from pipeschedule import compile_schedule
from pipeschedule.compiler.ir import Op
from pipeschedule.runtime import InProcessPipeline



def compute_order(schedule) -> list[tuple[str, int, int]]:
    """The schedule's F and B as one sequence a single process can run: ranks visited
    round-robin in rank order, each running its program's compute instructions until the
    next one needs a result not yet computed (F(s, mb) needs F(s-1, mb); B(s, mb) needs
    F(s, mb) and B(s+1, mb)). Every F and B appears once, each rank's in program order."""
    if schedule.split_backward:
        raise ValueError(f"compute_order: {schedule.name} splits the backward (W); "
                         "only F and B schedules are timed here")
    last = schedule.num_stages - 1
    programs = [[(i.op.value, i.stage, i.mb) for i in program if i.op in (Op.F, Op.B)] for program in schedule.programs]
    done: set[tuple[str, int, int]] = set()

    def ready(op: str, s: int, mb: int) -> bool:
        if op == "F":
            return s == 0 or ("F", s - 1, mb) in done
        return ("F", s, mb) in done and (s == last or ("B", s + 1, mb) in done)

    order, pcs = [], [0] * len(programs)
    while len(order) < sum(map(len, programs)):
        moved = False
        for rank, program in enumerate(programs):
            while pcs[rank] < len(program) and ready(*program[pcs[rank]]):
                order.append(program[pcs[rank]])
                done.add(program[pcs[rank]])
                pcs[rank] += 1
                moved = True
        if not moved:
            raise ValueError(f"compute_order: {schedule.name} cannot proceed (its programs wait on each other)")
    return order


def gpu_busy(fn, device) -> dict:
    """One call of `fn` under the profiler: the union of the GPU's kernel and copy
    intervals (busy ms), their sum and their number. {} where the profiler has no GPU
    activity (CPU) or fails."""
    if device.type != "cuda":
        return {}

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception as err:  # the profiler is a diagnostic: its failure must not end the benchmark
        return {"error": f"{type(err).__name__}: {err}"}
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return {"busy_ms": busy / 1e3, "kernel_sum_ms": sum(b - a for a, b in spans) / 1e3, "kernels": len(spans),
            "window_ms": (spans[-1][1] - spans[0][0]) / 1e3 if spans else 0.0}


def syncs(fn, device) -> int | None:
    """How many synchronising CUDA calls one call of `fn` makes (sync-debug mode's
    warnings); None on CPU."""
    if device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize(device)
    return sum("synchroniz" in str(w.message) for w in caught)


# [Note: host CPU overhead] At micro-batch size 1 the step is host-bound, and the
# difference of two steps' wall times carries whatever the host did meanwhile: another
# process on its cores, a page fault, the GPU driver's threads. Those hit the executor and
# the baseline at random, and only ever add time (runs gpu_overhead_run{1,2,3} of
# 2026-12-04: -0.64%, +0.79%, +2.70% from the same code). Three figures read the rounds:
#
#   paired median   median over rounds of (executor - baseline in the same round), with
#                   a bootstrap interval: the headline, as the side-by-side benchmarks use
#   fastest quarter mean of each variant's fastest quarter of steps, compared: the step
#                   as it runs when nothing disturbs the host (disturbances only add)
#   host CPU        the process's CPU time (`time.process_time`, every thread), paired as
#                   the wall time: the host work the executor adds. The calling thread's
#                   time alone (`thread_time`, used first) missed the backward, whose host
#                   work runs on autograd's device thread: on the H200 it saw 245 ms of a
#                   515 ms issue, and its pairs scattered by +-100 ms (2026-12-05).
#
# Each timed call starts after a full collection, so the collector's work during it is the
# call's own (it is not switched off: the executor's garbage is part of its cost).


def timed_rounds(variants: dict, *, warmup: int, rounds: int, before, device) -> dict:
    """Per variant: wall step ("step"), wall until the call returns ("host") and the
    process's CPU time until then ("cpu") of each measured round, the variants
    interleaved (round r starts with the r-th; see the module docstring)."""
    runs = {key: {"step": [], "host": [], "cpu": []} for key in variants}
    for r in range(warmup + rounds):
        for key in rotated(list(variants), r):
            before()
            gc.collect()
            sync(device)
            start, cpu = time.perf_counter(), time.process_time()
            variants[key]()
            issued, cpu = time.perf_counter(), time.process_time() - cpu
            sync(device)
            if r >= warmup:
                runs[key]["step"].append(time.perf_counter() - start)
                runs[key]["host"].append(issued - start)
                runs[key]["cpu"].append(cpu)
    return runs


def paired_median(runs: dict, figure: str, variant: str = "executor", baseline: str = "ordered") -> float:
    """Median over rounds of `variant` minus `baseline` in the same round."""
    return statistics.median(e - o for e, o in zip(runs[variant][figure], runs[baseline][figure]))


def fastest_quarter(steps: list[float]) -> float:
    """Mean of the fastest quarter (at least one) of `steps` ([Note: host CPU overhead])."""
    fast = sorted(steps)[:max(1, len(steps) // 4)]
    return sum(fast) / len(fast)


def _against_baseline(value: dict) -> float:
    """(executor - ordered) / executor of a per-variant figure."""
    return (value["executor"] - value["ordered"]) / value["executor"]


def min_to_min(result: dict) -> float | None:
    """`run_overhead`'s result: the executor's fastest step against the baseline's; None
    where the result holds no minima (reports from before they were kept)."""
    return _against_baseline(result["min_s"]) if result.get("min_s") else None


def quarter_to_quarter(result: dict) -> float | None:
    """`run_overhead`'s result: the executor's `fastest_quarter` against the baseline's,
    from the steps of its rounds; None where it holds no steps."""
    runs = result.get("runs") or {}
    if not all(key in runs for key in REQUIRED):
        return None
    return _against_baseline({key: fastest_quarter(runs[key]["step"]) for key in REQUIRED})


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:+.2%}"


def paired_interval(runs: dict, figure: str, variant: str = "executor", baseline: str = "ordered", *,
                    resamples: int = 2000, level: float = 0.95) -> tuple[float, float]:
    """A bootstrap interval (percentile, `level`) of `paired_median`: the rounds'
    differences resampled with replacement `resamples` times, seeded, so a run gives the
    same interval for the same figures."""
    diffs = [e - o for e, o in zip(runs[variant][figure], runs[baseline][figure])]
    draw = random.Random(0)
    medians = sorted(statistics.median(draw.choices(diffs, k=len(diffs))) for _ in range(resamples))
    tail = (1 - level) / 2
    return medians[int(tail * (resamples - 1))], medians[int((1 - tail) * (resamples - 1))]


class _WithoutState:
    """`stages` less `Stages.state` (executor_per_step in the module docstring)."""

    def __init__(self, stages) -> None:
        self._stages = stages

    def __getattr__(self, name: str):
        if name == "state":
            raise AttributeError(name)
        return getattr(self._stages, name)


VARIANTS = ("fused", "ordered", "ordered_again", "executor", "executor_per_step", "executor_every")
REQUIRED = ("ordered", "executor")  # the overhead's two sides


def check_variants(names) -> tuple[str, ...]:
    """`names` in VARIANTS' order; ValueError naming what is wrong and what is accepted."""
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"variants {unknown}: accepted are {', '.join(VARIANTS)}")
    missing = [n for n in REQUIRED if n not in names]
    if missing:
        raise ValueError(f"variants {list(names)} lack {missing}: the overhead is executor against ordered")
    return tuple(v for v in VARIANTS if v in names)


def make_variants(stages, schedule, inputs, targets, device, *, pp: int, m: int):
    """(every variant of the module docstring as a call running one step, the
    executor variant's `InProcessPipeline`). The other two pipelines are built at their
    first call, so that a run timing fewer variants builds only what it times."""
    pipeline = InProcessPipeline(schedule, stages, device=device)
    built: dict[str, InProcessPipeline] = {}

    def stepping(key: str, build):
        def step():
            if key not in built:
                built[key] = build()
            return built[key].step(inputs, targets)
        return step

    order = compute_order(schedule)
    last = pp - 1

    def fused():
        for i in range(m):
            x = inputs[i]
            for s in range(pp):
                x = stages.forward(s, i, x, targets[i] if s == last else None)
            (x / m).backward()

    def ordered():
        held, grads = {}, {}
        for op, s, mb in order:
            if op == "F":
                x = inputs[mb] if s == 0 else held[s - 1, mb][1].detach().requires_grad_()
                held[s, mb] = (x, stages.forward(s, mb, x, targets[mb] if s == last else None))
                continue
            x, y = held.pop((s, mb))
            if s == last:
                (y / m).backward()
            else:
                torch.autograd.backward(y, grads.pop((s, mb)))
            if s > 0:
                grads[s - 1, mb] = x.grad

    calls = {"fused": fused, "ordered": ordered, "ordered_again": lambda: ordered(),
             "executor": lambda: pipeline.step(inputs, targets),
             "executor_per_step": stepping("per_step", lambda: InProcessPipeline(
                 schedule, _WithoutState(stages), device=device)),
             "executor_every": stepping("every", lambda: InProcessPipeline(
                 schedule, stages, device=device, measure_stash="every"))}
    return calls, pipeline


def build_variants(cfg: ModelConfig, device, dtype, *, split: tuple[int, ...], pp: int, m: int,
                   microbatch_size: int):
    """The benchmark's model in one process (`LlamaStages` over `split`), m microbatches of
    fixed data and 1f1b: (`make_variants`' calls, the executor's pipeline, a call that
    clears every parameter's gradient, as before each timed step)."""
    stages = LlamaStages(cfg, split, device, dtype)
    batches = [to_device(microbatch(cfg, microbatch_size, i, 99), device) for i in range(m)]
    inputs = [{"input_ids": b["input_ids"]} for b in batches]
    targets = [{"label_ids": b["label_ids"], "label_mask": b["label_mask"]} for b in batches]
    params = [p for s in range(pp) for p in stages.parameters(s)]
    calls, pipeline = make_variants(stages, compile_schedule("1f1b", pp=pp, microbatches=m), inputs, targets,
                                    device, pp=pp, m=m)

    def zero_grads():
        for p in params:
            p.grad = None

    return calls, pipeline, zero_grads


def run_overhead(cfg: ModelConfig, device, dtype, *, pp: int, m: int, steps: int, warmup: int,
                 microbatch_size: int, split: tuple[int, ...], variants=VARIANTS) -> dict:
    """`steps` measured rounds after `warmup` (see the module docstring) of `variants`
    (at least ordered and executor); raw and summary figures in a dict (`overhead_lines`
    renders it)."""
    variants = check_variants(variants)
    calls, pipeline, zero_grads = build_variants(cfg, device, dtype, split=split, pp=pp, m=m,
                                                 microbatch_size=microbatch_size)
    schedule = pipeline.schedule
    calls = {key: calls[key] for key in variants}
    runs = timed_rounds(calls, warmup=warmup, rounds=steps, before=zero_grads, device=device)
    host_times = {key: sum(getattr(e.times, key) for e in pipeline.executors)  # before the profiled steps
                  for key in ("compute_s", "transport_s", "wait_s", "total_s")}
    for key, fn in calls.items():
        zero_grads()
        runs[key]["syncs"] = syncs(fn, device)
        zero_grads()
        runs[key]["profile"] = gpu_busy(fn, device)
    zero_grads()
    median = {key: statistics.median(run["step"]) for key, run in runs.items()}
    pipe = median["executor"]
    paired, paired_cpu = paired_median(runs, "step"), paired_median(runs, "cpu")
    out = {
        "schedule": "1f1b", "pp": pp, "microbatches": m, "microbatch_size": microbatch_size,
        "instructions": sum(len(p) for p in schedule.programs),
        "compute_calls": sum(i.op in (Op.F, Op.B) for p in schedule.programs for i in p),
        "steps": steps, "variants": list(variants),
        "median_s": median, "min_s": {key: min(run["step"]) for key, run in runs.items()},
        "pure_compute_s": median["ordered"], "executor_step_s": pipe,
        "overhead_s": paired, "overhead_fraction": paired / pipe,
        "overhead_interval": [x / pipe for x in paired_interval(runs, "step")],
        "overhead_cpu_s": paired_cpu, "overhead_cpu_fraction": paired_cpu / pipe,
        "overhead_cpu_interval": [x / pipe for x in paired_interval(runs, "cpu")],
        "runs": runs, "executor_host_times_last_step": host_times,
    }
    out["overhead_us_per_instruction"] = paired / out["instructions"] * 1e6
    out["fastest_quarter_s"] = {key: fastest_quarter(run["step"]) for key, run in runs.items()}
    out["overhead_fastest_quarter_fraction"] = _against_baseline(out["fastest_quarter_s"])
    if "ordered_again" in runs:
        out["control_s"] = paired_median(runs, "step", "ordered_again")
        out["control_fraction"] = out["control_s"] / pipe
        out["control_interval"] = [x / pipe for x in paired_interval(runs, "step", "ordered_again")]
    if "executor_per_step" in runs:
        out["kept_sizes_save_s"] = paired_median(runs, "step", "executor_per_step", "executor")
        out["kept_sizes_save_cpu_s"] = paired_median(runs, "cpu", "executor_per_step", "executor")
    return out


def overhead_lines(results: list[dict]) -> list[str]:
    """The markdown section of `benchmarks.gpu` for `run_overhead`'s results (one per
    micro-batch size)."""
    lines = [f"## Executor overhead (in-process, one GPU, 1f1b, m={results[0]['microbatches']})", "",
             "Baseline: the same forward and backward calls in the same order from a plain loop (`ordered`); "
             "overhead: the median over rounds of executor minus baseline in the same round, against the "
             "executor's median step; fastest quarter: the means of each variant's fastest quarter of steps "
             "compared; host CPU: the same pairing over the process's CPU time "
             "([Note: host CPU overhead] in benchmarks/gpu_overhead.py).", "",
             "| micro-batch size | baseline ms | through the executor ms | overhead | per instruction us | "
             "min to min | fastest quarter | host CPU overhead | control |", "|---|---|---|---|---|---|---|---|---|"]
    for o in results:
        cpu = (f"{o['overhead_cpu_s'] * 1e3:+.2f} ms ({o['overhead_cpu_fraction']:+.2%}"
               f"{_interval(o.get('overhead_cpu_interval'))})" if "overhead_cpu_s" in o else "-")
        control = (f"{o['control_fraction']:+.2%}{_interval(o.get('control_interval'))}"
                   if "control_fraction" in o else "-")
        lines.append(f"| {o.get('microbatch_size', 1)} | {o['pure_compute_s'] * 1e3:.2f} | "
                     f"{o['executor_step_s'] * 1e3:.2f} | {o['overhead_fraction']:+.2%}"
                     f"{_interval(o.get('overhead_interval'))} | "
                     f"{o['overhead_us_per_instruction']:.1f} | {_percent(min_to_min(o))} | "
                     f"{_percent(quarter_to_quarter(o))} | {cpu} | {control} |")
    if any("overhead_interval" in o for o in results):
        lines += ["", "[a, b]: a 95% bootstrap interval of the paired median (the rounds resampled)."]
    lines.append("")
    for o in results:
        if "median_s" not in o:  # a report from before the variants were split out
            continue
        lines += [f"Micro-batch size {o.get('microbatch_size', 1)}, {o['steps']} rounds, "
                  f"{o['instructions']} instructions and {o['compute_calls']} forward/backward calls per step:", "",
                  "| variant | median ms | min ms | max ms | host ms (median) | host CPU ms (median) | GPU busy ms "
                  "| kernels | syncs |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for key, run in o["runs"].items():
            prof = run.get("profile") or {}
            busy = f"{prof['busy_ms']:.1f}" if "busy_ms" in prof else "-"
            cpu = f"{statistics.median(run['cpu']) * 1e3:.1f}" if run.get("cpu") else "-"
            lines.append(f"| {key} | {o['median_s'][key] * 1e3:.1f} | {min(run['step']) * 1e3:.1f} | "
                         f"{max(run['step']) * 1e3:.1f} | {statistics.median(run['host']) * 1e3:.1f} | {cpu} | "
                         f"{busy} | {prof.get('kernels', '-')} | {run.get('syncs', '-')} |")
        lines.append("")
        if "kept_sizes_save_s" in o:
            lines += [f"Stash sizes kept across steps (executor_per_step - executor, paired medians): "
                      f"{o['kept_sizes_save_s'] * 1e3:+.2f} ms of the step, "
                      f"{o['kept_sizes_save_cpu_s'] * 1e3:+.2f} ms of host CPU.", ""]
    lines += ["GPU busy: one profiled step, the union of kernel and copy intervals; syncs: synchronising CUDA calls "
              "in one step (sync-debug mode). Where the host time comes near the GPU busy time the step is "
              "host-bound: then a hiccup of the host lengthens the step (the max column), and the difference "
              "of two medians carries such hiccups; the paired median removes what neighbouring steps share.", ""]
    return lines


def _interval(bounds) -> str:
    return "" if not bounds else f" [{bounds[0]:+.2%}, {bounds[1]:+.2%}]"


TARGET = 0.005  # issue 19: executor overhead under 0.5% of the step at micro-batch size 1, run after run


def runs_summary(paths: list[Path]) -> str:
    """Markdown: one row per saved run (`--out` JSON of this benchmark), the overhead
    figures side by side, and for each (commit, GPU) whether every run's paired median is
    under TARGET (runs of other code or on another card are not pooled)."""
    lines = ["| run | date | commit | GPU | rounds | variants | baseline ms | executor ms | overhead (paired median) "
             "| min to min | fastest quarter | host CPU | control |", "|" + "---|" * 13]
    groups: dict[tuple, list[float]] = {}
    for path in paths:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
        o, v = report["overhead"], report["versions"]
        commit, gpu = v.get("commit", "-")[:7], v.get("gpus", "-")
        groups.setdefault((commit, gpu), []).append(o["overhead_fraction"])
        cpu = f"{o['overhead_cpu_fraction']:+.2%}" if "overhead_cpu_fraction" in o else "-"
        control = f"{o['control_fraction']:+.2%}" if "control_fraction" in o else "-"
        lines.append(
            f"| {Path(path).name} | {v['date'][:16]} | {commit} | {gpu} | {o['steps']} | "
            f"{', '.join(o.get('variants', o['runs']))} | {o['pure_compute_s'] * 1e3:.1f} | "
            f"{o['executor_step_s'] * 1e3:.1f} | {o['overhead_fraction']:+.2%}{_interval(o.get('overhead_interval'))} "
            f"| {_percent(min_to_min(o))} | {_percent(quarter_to_quarter(o))} | {cpu} | {control} |")
    if groups:
        lines += ["", f"Paired median under {TARGET:.1%} in every run, by commit and GPU:", ""]
        for (commit, gpu), medians in groups.items():
            verdict = "met" if max(medians) < TARGET else "not met"
            lines.append(f"- {commit} on {gpu}: {verdict} in {len(medians)} run(s) (largest {max(medians):+.2%})")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """`python -m benchmarks.gpu_overhead`: this part alone, at `benchmarks.gpu`'s model
    or a variant of it; prints the table and writes JSON to `--out` if given."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_overhead", description=main.__doc__.split(";")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on whatever device is here")
    parser.add_argument("--layers", type=int, default=None, help=f"decoder layers (default {MODEL['layers']})")
    parser.add_argument("--microbatch-size", type=int, default=MICROBATCH_SIZE)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=15, help="measured rounds (each runs every variant once)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, at least ordered and executor (default: all of {', '.join(VARIANTS)})")
    parser.add_argument("--out", type=Path, default=None, help="write gpu_overhead[_LABEL].json here")
    parser.add_argument("--label", default="", help="suffix of the JSON file name")
    parser.add_argument("--commit", default=None, help="the commit measured (recorded in the results)")
    parser.add_argument("--summary", type=Path, nargs="+", metavar="JSON",
                        help="measure nothing: one table of saved runs (their --out JSON files)")
    args = parser.parse_args(argv)
    if args.summary:
        try:
            print(runs_summary(args.summary), end="")
        except (OSError, ValueError, KeyError) as err:
            print(f"benchmarks.gpu_overhead: cannot read the runs: {type(err).__name__}: {err}", file=sys.stderr)
            return 2
        return 0
    for name in ("layers", "microbatch_size", "microbatches", "steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} {value}: must be at least 1")
    try:
        variants = check_variants([v for v in args.variants.split(",") if v])
    except ValueError as err:
        parser.error(f"--variants {args.variants!r}: {err}")
    cfg = ModelConfig(**(SMOKE_MODEL if args.smoke else MODEL))
    if args.layers is not None:
        if args.layers < PP:
            parser.error(f"--layers {args.layers}: at least one layer per stage (pp={PP})")
        cfg = dataclasses.replace(cfg, layers=args.layers)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("benchmarks.gpu_overhead: no CUDA GPU here; --smoke runs on CPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    result = run_overhead(cfg, device, dtype, pp=PP, m=args.microbatches, steps=args.steps,
                          warmup=WARMUP, microbatch_size=args.microbatch_size, split=model_split(cfg, PP),
                          variants=variants)
    report = {"versions": versions(args.commit), "model": dataclasses.asdict(cfg),
              "microbatch_size": args.microbatch_size, "dtype": str(dtype).replace("torch.", ""), "overhead": result}
    print(f"model {cfg}, micro-batch size {args.microbatch_size}\n" + "\n".join(overhead_lines([result])))
    if args.out is not None:
        write_results(f"gpu_overhead{'_' + args.label if args.label else ''}", report, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
