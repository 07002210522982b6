"""Compile speed: pipeschedule's generate + lower + verify + simulate against PyTorch's
own lowering and dry run, on one CPU core.

    python -m benchmarks.compile_speed            # headline + growth grid, writes results
    python -m benchmarks.compile_speed --quick    # small grid, nothing written
    python -m benchmarks.compile_speed --profile  # adds a cProfile breakdown of ours

Headline: interleaved 1F1B at pp=64, virtual=2, microbatches=512.

    ours     generate("interleaved_1f1b") -> passes.lower -> verify -> simulate
    PyTorch  ScheduleInterleaved1F1B's compute order (`pipeline_order`) ->
             _add_send_recv -> _simulate_comms_compute

PyTorch's order is taken from a ScheduleInterleaved1F1B built on stand-in stage objects
(its constructor reads only num_stages, group_size and group_rank from them, so no
process group is needed); the constructor's own lowering (which also adds FSDP
UNSHARD/RESHARD and REDUCE_GRAD) is not timed. Regenerating the order is timed by calling
its `_calculate_single_rank_operations` for every rank. `_add_send_recv` consumes its
input, so it gets a fresh copy each run (copying is not timed). `_validate_schedule`,
PyTorch's coverage check, is timed and shown but kept out of the total.

Timings are the process's CPU time on its one core (see [Note: clock]; `--wall` for wall
clock), the best of `--repeat` runs with the collector run before each; at the headline
ours and PyTorch's run in turn and the ratio of each pair is kept ([Note: paired runs]).
Only this file imports torch; the compiler never does.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import io
import math
import os
import pstats
import statistics
import sys
import time
from types import SimpleNamespace

from benchmarks.common import git_commit, machine, torch_version, write_results
from pipeschedule.compiler import passes
from pipeschedule.compiler.families import generate
from pipeschedule.simulate import simulate
from pipeschedule.compiler.verify import RULES, verify
from pipeschedule.compiler.program import instructions
from pipeschedule.compiler.walk import passes as walk_passes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout's root

HEADLINE = (64, 2, 512)  # pp, virtual, microbatches
GRID_PP = (8, 16, 32, 64)
GRID_M = (64, 128, 256, 512)
QUICK_PP = (4, 8)
QUICK_M = (16, 32)
SMALL_S = 0.25  # PyTorch's grid cells faster than this are timed as the best of SMALL_REPEAT runs
SMALL_REPEAT = 3
OURS_REPEAT = 3  # ours, every grid cell: the growth fit reads them all (a second or so each at most)
TARGET_OURS_S = 1.5
TARGET_RATIO = 10.0
OUR_PHASES = ("generate", "lower", "verify", "simulate")
TORCH_PHASES = ("order", "add_send_recv", "simulate")


# [Note: clock] The machine this runs on may be shared. With the process pinned to one
# core, its own CPU time (user + system) leaves out the time other processes hold that
# core, which wall-clock time would count; `--wall` measures wall-clock time instead.
_CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
_clock_name = "cpu"


def clock() -> float:
    return _CLOCKS[_clock_name]()


def pin_to_one_core() -> str:
    """Runs this process on CPU 0 alone where the OS allows it; says what happened."""
    if not hasattr(os, "sched_setaffinity"):
        return "not pinned (os.sched_setaffinity unavailable)"
    try:
        os.sched_setaffinity(0, {0})
    except OSError as err:
        return f"not pinned ({err})"
    return f"pinned to CPU {sorted(os.sched_getaffinity(0))}"


def best_of(repeat: int, run):
    """The per-phase times (dict name -> s) of the fastest of `repeat` runs of `run`."""
    best = None
    for _ in range(repeat):
        gc.collect()
        times = run()
        if best is None or sum(times.values()) < sum(best.values()):
            best = times
    return best


# -- ours ------------------------------------------------------------------------------


def run_ours(pp: int, virtual: int, microbatches: int) -> tuple[dict, int]:
    """Times each phase once; returns (phase -> seconds, lowered instruction count)."""
    times = {}
    t0 = clock()
    schedule = generate("interleaved_1f1b", pp=pp, microbatches=microbatches, virtual=virtual)
    t1 = clock()
    lowered = passes.lower(schedule)
    t2 = clock()
    verify(lowered)
    t3 = clock()
    simulate(lowered)
    t4 = clock()
    times.update(generate=t1 - t0, lower=t2 - t1, verify=t3 - t2, simulate=t4 - t3)
    return times, sum(len(p) for p in lowered.programs)


# [Note: walk probe] Where the time per instruction grows with size, the interpreter is
# not doing more per instruction: every phase's tables are flat lists sized up front,
# and the collector is paused in every phase. What can grow is the cost of reaching an
# instruction once the schedule is far past the CPU caches. The passes read a lowered
# schedule's packed columns ([Note: packed programs] in pipeschedule/compiler/program.py);
# the probe times a walk that reads every template id and does nothing else ("packed"),
# the least any of those passes pays per instruction at that size, and beside it a walk
# that reads the op of every `Instr` of the same programs, built once in program order
# ("objects"), what a pass over the objects would pay.


def _read_every_id(programs) -> int:
    n = 0
    for program in programs:
        for k in program.ids:
            if k is None:
                n += 1
    return n


def _read_every_op(programs) -> int:
    n = 0
    for program in programs:
        for instr in program:
            if instr.op is None:
                n += 1
    return n


def walk_probe(pp, virtual, microbatches, repeat: int = 3) -> dict:
    """ns per instruction of a walk over the packed columns ("packed") and over the
    `Instr` objects ("objects") of the lowered programs ([Note: walk probe]), best of
    `repeat` each."""
    lowered = passes.lower(generate("interleaved_1f1b", pp=pp, microbatches=microbatches, virtual=virtual))
    programs = lowered.programs
    for program in programs:  # the objects built first, in program order
        instructions(program)
    count = sum(map(len, programs))
    out = {}
    for name, walk in (("packed", _read_every_id), ("objects", _read_every_op)):
        best = math.inf
        for _ in range(repeat):
            t0 = clock()
            walk(programs)
            best = min(best, clock() - t0)
        out[name] = 1e9 * best / count
    return out


def time_ours(pp, virtual, microbatches, repeat):
    count = {}

    def run():
        times, count["n"] = run_ours(pp, virtual, microbatches)
        return times

    return best_of(repeat, run), count["n"]


def profile_ours(pp, virtual, microbatches, top: int = 12) -> str:
    """cProfile of one run of ours, phase by phase (top functions by own time)."""
    schedule = generate("interleaved_1f1b", pp=pp, microbatches=microbatches, virtual=virtual)
    lowered = passes.lower(schedule)
    steps = [
        ("generate", lambda: generate("interleaved_1f1b", pp=pp, microbatches=microbatches, virtual=virtual)),
        ("lower", lambda: passes.lower(schedule)),
        ("verify", lambda: verify(lowered)),
        ("simulate", lambda: simulate(lowered)),
    ]
    out = io.StringIO()
    for name, step in steps:
        profiler = cProfile.Profile()
        gc.collect()
        profiler.enable()
        step()
        profiler.disable()
        out.write(f"\n### {name}\n")
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats("tottime").print_stats(top)
    out.write("\n### the cyclic garbage collector's share\n")
    with_gc, _ = run_ours(pp, virtual, microbatches)
    gc.collect()
    gc.disable()
    try:
        without_gc, _ = run_ours(pp, virtual, microbatches)
    finally:
        gc.enable()
    for name in OUR_PHASES:
        out.write(f"{name:<10} gc on {with_gc[name]:7.3f} s   gc off {without_gc[name]:7.3f} s\n")
    out.write(f"{'total':<10} gc on {sum(with_gc.values()):7.3f} s   gc off {sum(without_gc.values()):7.3f} s\n")
    out.write("\n### verify: its one walk, and the rules one by one (which it runs only to name an error)\n")
    for check in (walk_passes, *RULES):
        gc.collect()
        t0 = clock()
        check(lowered)
        name = "one walk (walk.passes)" if check is walk_passes else check.__name__
        out.write(f"{name:<24} {clock() - t0:8.3f} s\n")
    # Paths relative to the checkout: the results are committed and read on other machines.
    return out.getvalue().replace(REPO + os.sep, "")


# -- PyTorch ---------------------------------------------------------------------------


def torch_interleaved(pp: int, virtual: int, microbatches: int):
    """PyTorch's ScheduleInterleaved1F1B on stand-in stages (no process group)."""
    from torch.distributed.pipelining import schedules

    stages = [SimpleNamespace(num_stages=pp * virtual, group_size=pp, group_rank=0) for _ in range(virtual)]
    return schedules, schedules.ScheduleInterleaved1F1B(stages, microbatches)


def torch_runner(pp, virtual, microbatches):
    """(run, validate): one timed run of PyTorch's phases (phase -> seconds), and the
    time of its `_validate_schedule`."""
    schedules, built = torch_interleaved(pp, virtual, microbatches)
    order = {rank: list(actions) for rank, actions in built.pipeline_order.items()}
    num_stages = pp * virtual

    def stage_to_rank(stage):
        return built.stage_index_to_group_rank[stage]

    def run():
        t0 = clock()
        for rank in range(pp):
            built._calculate_single_rank_operations(rank)
        t1 = clock()
        fresh = {rank: list(actions) for rank, actions in order.items()}
        t2 = clock()
        comms = schedules._add_send_recv(fresh, stage_to_rank, num_stages)
        t3 = clock()
        schedules._simulate_comms_compute(comms, stage_to_rank, num_stages)
        t4 = clock()
        return {"order": t1 - t0, "add_send_recv": t3 - t2, "simulate": t4 - t3}

    def validate():
        gc.collect()
        t0 = clock()
        schedules._validate_schedule(order, pp, num_stages, microbatches)
        return clock() - t0

    return run, validate


def time_torch(pp, virtual, microbatches, repeat):
    run, validate = torch_runner(pp, virtual, microbatches)
    return best_of(repeat, run), validate()


def time_paired(pp, virtual, microbatches, repeat):
    """Ours and PyTorch's in turn, A B A B ... ([Note: paired runs]): the best run of
    each, ours' instruction count, PyTorch's validate time, and the ratio PyTorch / ours
    of each pair, sorted."""
    run_torch, validate = torch_runner(pp, virtual, microbatches)
    ours_runs, torch_runs = [], []
    for _ in range(repeat):
        gc.collect()
        times, count = run_ours(pp, virtual, microbatches)
        ours_runs.append(times)
        gc.collect()
        torch_runs.append(run_torch())
    ratios = sorted(sum(t.values()) / sum(o.values()) for o, t in zip(ours_runs, torch_runs))

    def best(runs):
        return min(runs, key=lambda t: sum(t.values()))

    return best(ours_runs), count, best(torch_runs), validate(), ratios


# [Note: paired runs] The machine is shared, and its speed drifts over the minutes the
# headline takes: timing seven runs of ours and then seven of PyTorch's compared two
# different stretches of it (ours 1.5 s in one run of this script, 2.0 s in the next).
# The headline runs them in turn and reports, beside the best of each, the ratio of each
# pair; their median is the figure to quote.


# -- growth ----------------------------------------------------------------------------


def fit_power(xs, ys) -> float | None:
    """Least-squares exponent k of y = c * x**k (on logs); None with fewer than 2 points."""
    points = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len(points) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def growth(cells, key) -> dict:
    """Exponents of time against m (per p), against p (per m), and against p*v*m."""
    out = {"vs_m": {}, "vs_p": {}, "vs_size": None}
    for p in sorted({c["pp"] for c in cells}):
        row = [c for c in cells if c["pp"] == p and c.get(key) is not None]
        out["vs_m"][p] = fit_power([c["microbatches"] for c in row], [c[key] for c in row])
    for m in sorted({c["microbatches"] for c in cells}):
        col = [c for c in cells if c["microbatches"] == m and c.get(key) is not None]
        out["vs_p"][m] = fit_power([c["pp"] for c in col], [c[key] for c in col])
    done = [c for c in cells if c.get(key) is not None]
    out["vs_size"] = fit_power([c["pp"] * c["virtual"] * c["microbatches"] for c in done], [c[key] for c in done])
    return out


def run_grid(grid_pp, grid_m, virtual, torch_budget, has_torch, log):
    cells = []
    torch_spent = 0.0
    torch_fit: list[tuple[int, float]] = []
    for p in grid_pp:
        for m in grid_m:
            times, count = time_ours(p, virtual, m, repeat=OURS_REPEAT)  # one run moved the fit by 0.1
            cell = {"pp": p, "virtual": virtual, "microbatches": m, "instructions": count,
                    "ours": times, "ours_total": sum(times.values()),
                    "ours_us_per_instr": 1e6 * sum(times.values()) / count,
                    "walk_ns_per_instr": walk_probe(p, virtual, m),
                    "torch": None, "torch_total": None, "torch_skipped": None}
            if has_torch:
                size = p * virtual * m
                predicted = _predict(torch_fit, size)
                if torch_spent + predicted > torch_budget:
                    cell["torch_skipped"] = (
                        f"skipped: predicted {predicted:.1f} s would pass the {torch_budget:g} s "
                        f"budget ({torch_spent:.1f} s spent)"
                    )
                else:
                    t_times, _ = time_torch(p, virtual, m, repeat=1)
                    total = sum(t_times.values())
                    if total < SMALL_S:
                        t_times, _ = time_torch(p, virtual, m, repeat=SMALL_REPEAT)
                        total += SMALL_REPEAT * sum(t_times.values())  # budget counts every run
                    torch_spent += total
                    best = sum(t_times.values())
                    torch_fit.append((size, best))
                    cell.update(torch=t_times, torch_total=best)
            else:
                cell["torch_skipped"] = "torch not installed"
            cells.append(cell)
            log(_grid_line(cell))
    return cells, torch_spent


def _predict(fit: list[tuple[int, float]], size: int) -> float:
    """PyTorch's time at `size`, extrapolated from the cells run so far (power law)."""
    if not fit:
        return 0.0
    k = fit_power([s for s, _ in fit], [t for _, t in fit])
    s0, t0 = max(fit)
    k = 2.0 if k is None else max(k, 1.0)
    return t0 * (size / s0) ** k


def _grid_line(cell) -> str:
    torch_text = f"{cell['torch_total']:8.3f}" if cell["torch_total"] is not None else "       -"
    ratio = (f"{cell['torch_total'] / cell['ours_total']:6.1f}x"
             if cell["torch_total"] is not None else "      -")
    walk = cell.get("walk_ns_per_instr") or {}
    probe = f"{walk['packed']:5.0f} {walk['objects']:5.0f}" if walk else "    -     -"
    return (f"{cell['pp']:>4} {cell['microbatches']:>5} {cell['instructions']:>9} "
            f"{cell['ours_total']:8.3f} {cell['ours_us_per_instr']:8.2f} {probe} {torch_text} {ratio}")


# -- report ----------------------------------------------------------------------------


def _fmt_exponents(fit: dict) -> list[str]:
    def one(k):
        return "n/a" if k is None else f"{k:.2f}"

    lines = ["  time ~ m^k at fixed p:  " + ", ".join(f"p={p}: k={one(k)}" for p, k in fit["vs_m"].items()),
             "  time ~ p^k at fixed m:  " + ", ".join(f"m={m}: k={one(k)}" for m, k in fit["vs_p"].items()),
             f"  time ~ (p*v*m)^k overall: k={one(fit['vs_size'])}"]
    return lines


def markdown(result: dict) -> str:
    h = result["headline"]
    meta = result["meta"]
    lines = [
        "# Compile speed: pipeschedule vs PyTorch's lowering and dry run",
        "",
        f"Command: `{result['command']}`  ",
        f"Date: {meta['date']}  ",
        f"Machine: {meta['machine']['cpu_model']} ({meta['machine']['processor']}), "
        f"{meta['machine']['cpu_count']} CPUs "
        f"({meta['affinity']}), {meta['machine']['platform']}  ",
        f"Python {meta['machine']['python']}, torch {meta['machine']['torch']}; "
        f"1-minute load average at the start: {meta.get('load_average_1m_at_start')}, at the end: "
        f"{meta['machine']['load_average_1m_at_end']} ({meta['machine']['cpu_count']} CPUs; "
        "other processes share them)  ",
        f"Commit: {meta['commit']}",
        "",
        f"## Headline: interleaved 1F1B, pp={h['pp']}, virtual={h['virtual']}, microbatches={h['microbatches']}",
        "",
        f"Best of {h['repeat']} runs each, ours and PyTorch's in turn, seconds of {result['clock']}.",
        "",
        "| ours | s | PyTorch | s |",
        "|---|---:|---|---:|",
    ]
    ours, theirs = h["ours"], h["torch"] or {}
    names = list(zip(OUR_PHASES, TORCH_PHASES + ("",)))
    for (a, b) in names:
        lines.append(f"| {a} | {ours[a]:.3f} | {b} | {theirs[b]:.3f} |" if b and b in theirs
                     else f"| {a} | {ours[a]:.3f} | | |")
    lines.append(f"| **total** | **{h['ours_total']:.3f}** | **total** | "
                 f"**{h['torch_total']:.3f}** |" if h["torch_total"] is not None
                 else f"| **total** | **{h['ours_total']:.3f}** | | |")
    if h.get("torch_validate") is not None:
        lines.append(f"| | | _validate_schedule (not in total) | {h['torch_validate']:.3f} |")
    lines += [
        "",
        f"Lowered instructions (ours, with FREE): {h['instructions']}; "
        f"{1e6 * h['ours_total'] / h['instructions']:.2f} µs per instruction.",
        "",
        (f"Ratio PyTorch / ours, pair by pair (the two run in turn, [Note: paired runs]): median "
         f"**{h['paired_median']:.1f}x** ({h['paired_ratios'][0]:.1f}x to {h['paired_ratios'][-1]:.1f}x); "
         f"best against best: {h['ratio']:.1f}x") if h["ratio"] else "Ratio: n/a (no torch)",
        "",
        f"Targets: ours <= {TARGET_OURS_S} s: {'met' if h['ours_total'] <= TARGET_OURS_S else 'NOT met'}; "
        f"ratio >= {TARGET_RATIO:.0f}x (paired median): "
        + ("met" if h["paired_median"] and h["paired_median"] >= TARGET_RATIO else "NOT met"),
        "",
    ]
    # The headline is a best of several runs; say how far the grid's cell of the same size
    # (a best of fewer runs, later) was from it, so a narrow margin is visible.
    size = (h["pp"], h["virtual"], h["microbatches"])
    same = [c for c in result["grid"] if (c["pp"], c["virtual"], c["microbatches"]) == size]
    if same:
        lines += [f"The grid's cell of the same size below (best of {OURS_REPEAT}) took {same[0]['ours_total']:.3f} s "
                  f"({100 * (same[0]['ours_total'] / h['ours_total'] - 1):+.0f}% against the best of {h['repeat']}); "
                  "runs on this shared machine vary by that much.", ""]
    lines += _growth_markdown(result)
    if result.get("profile"):
        lines += ["## Profile of ours (headline)", "", "```", result["profile"].strip(), "```", ""]
    return "\n".join(lines)

def _growth_markdown(result: dict) -> list[str]:
    """The growth grid's section of `markdown`: the table, skipped PyTorch cells, fitted exponents."""
    lines = [
        f"## Growth (virtual={result['grid'][0]['virtual']}; ours best of {OURS_REPEAT} per cell, PyTorch one run, "
        f"best of {SMALL_REPEAT} below {SMALL_S} s)",
        "",
        "| pp | m | instructions | ours s | µs/instr | bare walk ns/instr: packed, objects | PyTorch s "
        "| ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in result["grid"]:
        t = f"{c['torch_total']:.3f}" if c["torch_total"] is not None else "—"
        r = f"{c['torch_total'] / c['ours_total']:.1f}x" if c["torch_total"] is not None else "—"
        walk = c.get("walk_ns_per_instr") or {}
        probe = f"{walk['packed']:.0f}, {walk['objects']:.0f}" if walk else "—"
        lines.append(f"| {c['pp']} | {c['microbatches']} | {c['instructions']} | {c['ours_total']:.3f} | "
                     f"{c['ours_us_per_instr']:.2f} | {probe} | {t} | {r} |")
    skipped = [c for c in result["grid"] if c["torch_skipped"]]
    if skipped:
        lines += ["", f"PyTorch cells not run ({len(skipped)}): budget {result['torch_budget_s']:g} s in all; "
                  + "; ".join(f"pp={c['pp']} m={c['microbatches']}: {c['torch_skipped']}" for c in skipped[:3])
                  + (" ..." if len(skipped) > 3 else "")]
    lines += ["", "Fitted exponents (ours):", "", "```", *_fmt_exponents(result["growth"]["ours"]), "```"]
    if result["growth"].get("torch"):
        lines += ["", "Fitted exponents (PyTorch, cells run):", "", "```",
                  *_fmt_exponents(result["growth"]["torch"]), "```"]
    lines += ["", result["growth_summary"], "",
              "Bare walk: the time to read every instruction's template id in the packed columns and nothing "
              "else, best of 3, and every instruction's op over the same programs' `Instr` objects ([Note: walk "
              "probe] in benchmarks/compile_speed.py): the least a pass over the IR pays per instruction at that "
              "size.", ""]
    return lines


def summarize_growth(fit: dict, cells) -> str:
    k = fit["vs_size"]
    if k is None:
        return "Growth: not enough cells to fit."
    per = sorted(cells, key=lambda c: c["instructions"])
    small, large = per[0], per[-1]
    return (
        f"Ours: time ~ (p·v·m)^{k:.2f} over the grid; per lowered instruction "
        f"{small['ours_us_per_instr']:.2f} µs at pp={small['pp']}, m={small['microbatches']} and "
        f"{large['ours_us_per_instr']:.2f} µs at pp={large['pp']}, m={large['microbatches']} "
        f"(a constant would mean O(p·v·m), i.e. linear in the instructions)."
    )


def measure_growth(grid_pp, grid_m, virtual: int, torch_budget: float, has_torch: bool):
    """The growth grid, printed as it runs: its cells, the fitted exponents (ours, and
    PyTorch's over the cells it ran) and the summary line."""
    print(f"\ngrowth (virtual={virtual}); PyTorch budget {torch_budget:g} s")
    print("  pp     m  instrs   ours s  µs/inst walk ns: packed, objects  torch s  ratio")
    cells, spent = run_grid(grid_pp, grid_m, virtual, torch_budget, has_torch, print)
    fits = {"ours": growth(cells, "ours_total")}
    if any(c["torch_total"] is not None for c in cells):
        fits["torch"] = growth(cells, "torch_total")
    print("\nours:")
    print("\n".join(_fmt_exponents(fits["ours"])))
    if "torch" in fits:
        print("PyTorch (cells run):")
        print("\n".join(_fmt_exponents(fits["torch"])))
    skipped = sum(1 for c in cells if c["torch_skipped"])
    if skipped:
        print(f"PyTorch: {skipped} cells skipped to stay within {torch_budget:g} s ({spent:.1f} s used)")
    summary = summarize_growth(fits["ours"], cells)
    print(summary)
    return cells, fits, summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small grid and headline; write nothing")
    parser.add_argument("--repeat", type=int, default=3, help="headline runs (best is kept)")
    parser.add_argument("--torch-budget", type=float, default=60.0, help="seconds for all PyTorch grid cells")
    parser.add_argument("--profile", action="store_true", help="add a cProfile breakdown of ours at the headline")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--wall", action="store_true", help="time with the wall clock, not CPU time ([Note: clock])")
    args = parser.parse_args(argv)
    global _clock_name
    _clock_name = "wall" if args.wall else "cpu"

    load_at_start = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    affinity = pin_to_one_core()
    has_torch = torch_version() is not None
    pp, virtual, microbatches = (8, 2, 64) if args.quick else HEADLINE
    print(f"compile speed: interleaved_1f1b pp={pp} virtual={virtual} microbatches={microbatches}; {affinity}; "
          f"{_clock_name} time")

    if has_torch:
        ours, count, theirs, validate, ratios = time_paired(pp, virtual, microbatches, args.repeat)
    else:
        (ours, count), ratios = time_ours(pp, virtual, microbatches, args.repeat), []
    ours_total = sum(ours.values())
    print("  ours    " + "  ".join(f"{k} {v:.3f}" for k, v in ours.items()) + f"  total {ours_total:.3f} s"
          f"  ({count} instructions, {1e6 * ours_total / count:.2f} µs each)")
    headline = {"pp": pp, "virtual": virtual, "microbatches": microbatches, "repeat": args.repeat,
                "instructions": count, "ours": ours, "ours_total": ours_total,
                "torch": None, "torch_total": None, "torch_validate": None, "ratio": None,
                "paired_ratios": ratios, "paired_median": statistics.median(ratios) if ratios else None}
    if has_torch:
        torch_total = sum(theirs.values())
        headline.update(torch=theirs, torch_total=torch_total, torch_validate=validate,
                        ratio=torch_total / ours_total)
        print("  PyTorch " + "  ".join(f"{k} {v:.3f}" for k, v in theirs.items()) + f"  total {torch_total:.3f} s"
              f"  (+ _validate_schedule {validate:.3f} s, not in total)")
        print(f"  ratio PyTorch / ours: {torch_total / ours_total:.1f}x best against best; pair by pair "
              f"median {headline['paired_median']:.1f}x ({ratios[0]:.1f}x to {ratios[-1]:.1f}x)")
    else:
        print("  PyTorch: torch is not installed; no comparison")
    print(f"  target ours <= {TARGET_OURS_S} s: {'met' if ours_total <= TARGET_OURS_S else 'NOT met'}; "
          f"ratio >= {TARGET_RATIO:.0f}x (paired median): "
          f"{'met' if headline['paired_median'] and headline['paired_median'] >= TARGET_RATIO else 'NOT met'}")

    grid_pp, grid_m = (QUICK_PP, QUICK_M) if args.quick else (GRID_PP, GRID_M)
    cells, fits, summary = measure_growth(grid_pp, grid_m, virtual, args.torch_budget, has_torch)

    profile = profile_ours(pp, virtual, microbatches) if args.profile else None
    if profile:
        print(profile)

    result = {
        "command": "python -m benchmarks.compile_speed" + ("".join(f" {a}" for a in (argv or sys.argv[1:]))),
        "meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "machine": machine(), "affinity": affinity, "commit": git_commit(),
                 "load_average_1m_at_start": load_at_start},
        "clock": "process CPU time (user + system)" if _clock_name == "cpu" else "wall clock",
        "headline": headline, "grid": cells, "torch_budget_s": args.torch_budget,
        "growth": fits, "growth_summary": summary, "profile": profile,
        "targets": {"ours_s": TARGET_OURS_S, "ratio": TARGET_RATIO},
    }
    if not (args.quick or args.no_write):
        paths = write_results("compile_speed", result, markdown(result))
        print(f"\nwrote {' and '.join(map(str, paths))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
