"""Size limits against time: every command at the largest input it accepts, run as a user
runs it (`python -m pipeschedule.cli ...`, one subprocess each), timed against the 10 s
that any accepted input must finish in ([Note: size limits] in pipeschedule/checks.py).

    python -m benchmarks.limits            # every case, writes results/limits.{json,md}
    python -m benchmarks.limits --quick    # the cases under 2 s at small sizes, nothing written
    python -m benchmarks.limits --only compile   # or verify, simulate, trace, png, show, plan, check, demo
    python -m benchmarks.limits --smoke    # one small compile and its refusal: the plumbing, nothing written

The sizes come from the limits themselves (`pipeschedule.checks`: a schedule's pairs and
stages, a Chrome trace's and a PNG's pairs, a timeline's cells, the planner's), so a
changed limit is measured by the next run: "worst accepted" is the largest pp (stages), the largest
microbatch count, and the families, outputs and searches that cost the most per
(stage, microbatch) pair. Each accepted case must exit 0; beside it, the input one past
the limit must be refused (exit 2) in one line naming the value. Files that `verify`,
`simulate --schedule` read are written by an untimed `compile` first.

Wall time is what the limit is about; CPU time (the child's user + system) is shown
beside it because the development machine's 2 cores are shared with other work, which
stretches wall time but not CPU time (the load average is recorded with each case; [Note:
loaded machine]).
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

from benchmarks.common import git_commit, machine, write_results
from pipeschedule.compiler.offload_spec import DEFAULT_LEADS
from pipeschedule.checks import (
    MAX_OFFLOAD_SEARCH,
    MAX_PLAN_DPS,
    MAX_PLAN_LAYER_STAGES,
    MAX_PLAN_STAGE_MICROBATCHES,
    MAX_PLAN_WORK,
    MAX_PNG_RANKS,
    MAX_PNG_STAGE_MICROBATCHES,
    MAX_SEARCH_NODES,
    MAX_SEARCH_PAIRS,
    MAX_SEARCH_STAGES,
    MAX_STAGE_MICROBATCHES,
    MAX_STAGES,
    MAX_TIMELINE_CELLS,
    MAX_TRACE_STAGE_MICROBATCHES,
    PLAN_SEARCH_WORK,
)

LIMIT_S = 10.0
CORES = os.cpu_count() or 1
# [Note: loaded machine] The limits are for a 2-core machine running the command alone, on
# which a command's wall time is about its CPU time (one thread). Where other work holds the
# cores (a 1-minute load average above the core count), wall time is stretched by it and CPU
# time is the better measure of what the command costs: such a row is "ok by CPU (loaded)"
# when its CPU time is within the limit, and its wall time stays in the table.
TIMEOUT_S = 300.0  # a case past it is reported as over (its time ">= TIMEOUT_S")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

P = MAX_STAGE_MICROBATCHES  # (stage, microbatch) pairs of one schedule: compile, verify, simulate, show
S = MAX_STAGES  # stages (pp * virtual) of one schedule
PT = MAX_TRACE_STAGE_MICROBATCHES  # pairs of a Chrome trace
PG = MAX_PNG_STAGE_MICROBATCHES  # pairs of a PNG
ISSUE = (64, 2, 512)  # interleaved 1F1B at pp=64, virtual=2, m=512: accepted by compile, verify, simulate


@dataclass
class Case:
    """One command line (`argv` after `pipeschedule`), with `setup` run first untimed, and
    `refused`: the same command one past a limit, which must exit 2 in one line."""

    command: str
    what: str
    argv: list[str]
    setup: list[list[str]] = field(default_factory=list)
    refused: list[str] | None = None
    prepare: Callable[[], None] | None = None  # writes an input file, untimed
    accepted: tuple[int, ...] = (0,)  # exit codes of a run that did its work (plan: 1 when nothing fits)
    timeout: float | None = None  # seconds before the case is stopped (None: --timeout)


@dataclass(frozen=True)
class _Scale:
    """What the cases of one run share: the pair limits (or the quick run's), the folder
    their files go to, and the two schedules used several times."""

    p: int  # (stage, microbatch) pairs: compile, verify, simulate, show
    s: int  # stages
    pt: int  # pairs of a trace
    pg: int  # pairs of a PNG
    tmp: str
    big: tuple[str, ...]  # the split-backward V: the most instructions per pair
    issue: tuple[str, ...]  # the interleaved schedule the users' issue named
    what: str  # the issue schedule, described

    def f(self, name: str) -> str:
        return os.path.join(self.tmp, name)


def _scale(tmp: str, quick: bool) -> _Scale:
    p, s, pt, pg = (2**12, 2**10, 2**11, 2**11) if quick else (P, S, PT, PG)
    pp, v, m = ISSUE if not quick else (16, 2, 64)
    return _Scale(p, s, pt, pg, tmp, ("zbv", "--pp", "64", "-m", str(p // 128)),
                  ("interleaved_1f1b", "--pp", str(pp), "--virtual", str(v), "-m", str(m)),
                  f"interleaved_1f1b pp={pp}, virtual={v}, m={m} ({pp * v * m} pairs)")


def cases(tmp: str, quick: bool = False) -> list[Case]:
    z = _scale(tmp, quick)
    return [*compile_cases(z), *search_cases(z), *offload_cases(z), *read_cases(z), *draw_cases(z), *plan_cases(),
            *check_cases(z)]

def compile_cases(z: _Scale) -> list[Case]:
    """`compile` of each family at the most stages and microbatches it takes, in each format."""
    return [
        Case("compile", f"1f1b pp={z.s} (most stages), m={z.p // z.s}, JSON",
             ["compile", "1f1b", "--pp", str(z.s), "-m", str(z.p // z.s), "--json", z.f("a.json")],
             refused=["compile", "1f1b", "--pp", str(S + 1), "-m", "1", "--json", z.f("r.json")]),
        Case("compile", f"1f1b pp=4, m={z.p // 4} (most microbatches), JSON",
             ["compile", "1f1b", "--pp", "4", "-m", str(z.p // 4), "--json", z.f("b.json")],
             refused=["compile", "1f1b", "--pp", "4", "-m", str(P // 4 + 1), "--json", z.f("r.json")]),
        Case("compile", f"capped_1f1b pp=64, m={z.p // 64}, cap 2, text",
             ["compile", "capped_1f1b", "--pp", "64", "-m", str(z.p // 64), "--cap", "2", "--text", z.f("c.txt")]),
        Case("compile", f"interleaved_1f1b pp=16, virtual=8, m={z.p // 128}, JSON",
             ["compile", "interleaved_1f1b", "--pp", "16", "--virtual", "8", "-m", str(z.p // 128),
              "--json", z.f("i.json")]),
        Case("compile", f"{z.what}, JSON", ["compile", *z.issue, "--json", z.f("ii.json")],
             refused=["compile", "interleaved_1f1b", "--pp", "64", "--virtual", "2", "-m", str(P // 128 + 1),
                      "--json", z.f("r.json")]),
        Case("compile", f"zb_h1 pp=128, m={z.p // 128}, JSON",
             ["compile", "zb_h1", "--pp", "128", "-m", str(z.p // 128), "--json", z.f("h.json")]),
        Case("compile", f"zbv pp=64 (128 stages), m={z.p // 128}, JSON + text + CSV",
             ["compile", *z.big, "--json", z.f("v.json"), "--text", z.f("v.txt"), "--csv", z.f("v.csv")]),
        Case("compile", f"v_min pp={z.s // 2} (most stages), m={z.p // z.s}, JSON",
             ["compile", "v_min", "--pp", str(z.s // 2), "-m", str(z.p // z.s), "--json", z.f("vm.json")]),
        Case("compile", f"zbv pp=64, m={z.p // 128}, --cost examples/cost_uniform.json",
             ["compile", *z.big, "--cost", "examples/cost_uniform.json", "--json", z.f("vc.json")]),
    ]


def search_cases(z: _Scale) -> list[Case]:
    """`compile searched` at its own bounds (it builds and simulates each of its candidates)."""
    sp, ss = min(z.p, MAX_SEARCH_PAIRS), min(z.s, MAX_SEARCH_STAGES)
    return [
        Case("compile", f"searched pp={ss} (most stages), m={sp // ss}, --cost examples/cost_uniform.json",
             ["compile", "searched", "--pp", str(ss), "-m", str(sp // ss), "--cost", "examples/cost_uniform.json",
              "--json", z.f("s.json")],
             refused=["compile", "searched", "--pp", str(MAX_SEARCH_STAGES + 1), "-m", "1", "--json", z.f("r.json")]),
        Case("compile", f"searched pp=64, m={sp // 64}, cap 8, --cost examples/cost_uniform.json",
             ["compile", "searched", "--pp", "64", "-m", str(sp // 64), "--cap", "8", "--cost",
              "examples/cost_uniform.json", "--json", z.f("s2.json")],
             refused=["compile", "searched", "--pp", "64", "-m", str(MAX_SEARCH_PAIRS // 64 + 1), "--json",
                      z.f("r.json")]),
    ]


def offload_cases(z: _Scale) -> list[Case]:
    """`compile --offload auto`: the offload search simulates ranks x leads x 8 schedules
    (pp * m pairs each, the default leads): the most microbatches it accepts at pp=8, and
    the most ranks at m=1."""
    out = []
    leads = len(DEFAULT_LEADS)
    per_pp = lambda pp: MAX_OFFLOAD_SEARCH // (pp * leads * 8 * pp)  # noqa: E731
    pp_many = max(pp for pp in range(1, 1024) if per_pp(pp) >= 1)
    for pp, m in ((8, min(z.p // 8, per_pp(8))), (pp_many, 1)):
        out.append(Case("compile", f"1f1b pp={pp}, m={m}, --offload auto (the offload search's most pairs)",
                        ["compile", "1f1b", "--pp", str(pp), "-m", str(m), "--offload", "auto", "--json",
                         z.f("o.json")],
                        refused=["compile", "1f1b", "--pp", str(pp), "-m", str(per_pp(pp) + 1), "--offload", "auto",
                                 "--json", z.f("r.json")] if pp == 8 else None))
    return out


def read_cases(z: _Scale) -> list[Case]:
    """`verify` of each format and `simulate` at the most pairs."""
    return [
        Case("verify", f"JSON of zbv pp=64, m={z.p // 128}", ["verify", z.f("vv.json")],
             setup=[["compile", *z.big, "--json", z.f("vv.json")]]),
        Case("verify", f"text of zbv pp=64, m={z.p // 128}", ["verify", z.f("vv.txt")],
             setup=[["compile", *z.big, "--text", z.f("vv.txt")]]),
        Case("verify", f"CSV of zbv pp=64, m={z.p // 128}", ["verify", z.f("vv.csv")],
             setup=[["compile", *z.big, "--csv", z.f("vv.csv")]]),
        Case("verify", f"JSON of 1f1b pp={z.s}, m={z.p // z.s}", ["verify", z.f("va.json")],
             setup=[["compile", "1f1b", "--pp", str(z.s), "-m", str(z.p // z.s), "--json", z.f("va.json")]]),
        Case("verify", f"JSON of {z.what}", ["verify", z.f("vi.json")],
             setup=[["compile", *z.issue, "--json", z.f("vi.json")]]),
        Case("simulate", f"zbv pp=64, m={z.p // 128}, --json", ["simulate", *z.big, "--json"],
             refused=["simulate", "zbv", "--pp", "64", "-m", str(P // 128 + 1)]),
        Case("simulate", f"{z.what}, --json", ["simulate", *z.issue, "--json"]),
        Case("simulate", f"--schedule zbv pp=64, m={z.p // 128} (JSON file)",
             ["simulate", "--schedule", z.f("vs.json")],
             setup=[["compile", *z.big, "--json", z.f("vs.json")]]),
    ]


def draw_cases(z: _Scale) -> list[Case]:
    """What draws (`simulate --trace`, `--png` and `show`) at the most it takes, and `demo`."""
    return [
        Case("trace", f"simulate zbv pp=64, m={z.pt // 128}, --json --trace",
             ["simulate", "zbv", "--pp", "64", "-m", str(z.pt // 128), "--json", "--trace", z.f("t.json")],
             refused=["simulate", "zbv", "--pp", "64", "-m", str(PT // 128 + 1), "--trace", z.f("r.json")]),
        Case("trace", f"simulate 1f1b pp={z.s} (most stages), m={z.pt // z.s}, --trace",
             ["simulate", "1f1b", "--pp", str(z.s), "-m", str(z.pt // z.s), "--trace", z.f("ta.json")]),
        Case("trace", f"simulate v_min pp={z.s // 2} (most stages), m={z.pt // z.s}, --trace",
             ["simulate", "v_min", "--pp", str(z.s // 2), "-m", str(z.pt // z.s), "--trace", z.f("tv.json")]),
        Case("png", f"simulate 1f1b pp={MAX_PNG_RANKS} (most ranks drawn), m={z.pg // MAX_PNG_RANKS}, --png",
             ["simulate", "1f1b", "--pp", str(MAX_PNG_RANKS), "-m", str(z.pg // MAX_PNG_RANKS), "--png", z.f("a.png")],
             refused=["simulate", "1f1b", "--pp", str(MAX_PNG_RANKS + 1), "-m", "1", "--png", z.f("r.png")]),
        Case("png", f"simulate zbv pp=64, m={z.pg // 128}, --png",
             ["simulate", "zbv", "--pp", "64", "-m", str(z.pg // 128), "--png", z.f("v.png")],
             refused=["simulate", "zbv", "--pp", "64", "-m", str(PG // 128 + 1), "--png", z.f("r.png")]),
        Case("show", f"zbv pp=64, m={z.p // 128}", ["show", *z.big]),
        Case("show", f"1f1b pp={z.s}, m={z.p // z.s}, --width {MAX_TIMELINE_CELLS // z.s} (the most cells)",
             ["show", "1f1b", "--pp", str(z.s), "-m", str(z.p // z.s), "--width", str(MAX_TIMELINE_CELLS // z.s)],
             refused=["show", "1f1b", "--pp", str(S), "-m", str(P // S)]),
        Case("show", "1f1b pp=700, m=8 (near the most cells at full scale)",
             ["show", "1f1b", "--pp", "700", "-m", "8"]),
        Case("show", f"1f1b pp=4, m={z.p // 4}, --width {MAX_TIMELINE_CELLS // 4 // 64} (every cell busy)",
             ["show", "1f1b", "--pp", "4", "-m", str(z.p // 4), "--width", str(MAX_TIMELINE_CELLS // 4 // 64)]),
        Case("demo", "(fixed input; trains on CPU where torch and nanotron are installed)", ["demo"]),
    ]


def check_cases(z: _Scale) -> list[Case]:
    """`check` of nanotron YAMLs (where nanotron is installed)."""
    out = []
    if _nanotron():
        m = z.p // 16
        out.append(Case("check", f"nanotron YAML, pp=16, m={m}, 16 layers, capped_1f1b:cap=2",
                        ["check", z.f("big.yaml")],
                        prepare=lambda: _yaml(z.f("big.yaml"), 16, m, 16, "capped_1f1b:cap=2")))
        out.append(Case("check", "nanotron YAML, pp=16, m=64, 256 layers, engine auto (runs the planner)",
                        ["check", z.f("auto.yaml")], prepare=lambda: _yaml(z.f("auto.yaml"), 16, 64, 256, "auto")))
    return out


def plan_cases() -> list[Case]:
    """`plan` at its largest: the most pairs and layers one plan takes, and the most
    plans each shape of a run accepts (MAX_PLAN_WORK)."""
    layers = min(1024, MAX_PLAN_LAYER_STAGES // 16)
    m16 = MAX_PLAN_STAGE_MICROBATCHES // 16
    search = ["--virtual", "16", "--node-limit", str(MAX_SEARCH_NODES)]  # every chunk count, the most nodes

    def at_bound(pp: int, m: int, plans: int) -> str:  # the run's work against MAX_PLAN_WORK
        return f"{plans} plans x pp x pp x m = {plans * pp * pp * m} of {MAX_PLAN_WORK}"

    def dp_list(plans: int) -> str:  # dp=1 is 3 plans, each dp > 1 six
        if plans % 6 == 0:
            return ",".join(str(2**k) for k in range(1, 1 + plans // 6))
        return ",".join(str(2**k) for k in range(1 + (plans - 3) // 6))

    out = [
        Case("plan", f"llama3-70b, pp=16, m={m16}, {layers} layers",
             ["plan", "--model", "llama3-70b", "--pp", "16", "--microbatches", str(m16), "--layers", str(layers)],
             accepted=(0, 1),
             refused=["plan", "--model", "llama3-70b", "--pp", "16", "--microbatches", str(m16 + 1), "--layers",
                      str(layers)]),
        Case("plan", f"llama3-70b, pp=4, m={MAX_PLAN_STAGE_MICROBATCHES // 4}, "
                     f"{min(1024, MAX_PLAN_LAYER_STAGES // 4)} layers",
             ["plan", "--model", "llama3-70b", "--pp", "4", "--microbatches", str(MAX_PLAN_STAGE_MICROBATCHES // 4),
              "--layers", str(min(1024, MAX_PLAN_LAYER_STAGES // 4))], accepted=(0, 1)),
    ]
    # The most plans each shape accepts (MAX_PLAN_WORK), models that fit (the split search
    # runs) and one that does not (least overflow, partial recompute, host offload).
    for model, pp, m, n, plans, extra in (
            ("llama3-8b", 16, m16, layers, 6, search + ["--tables", "all"]),
            ("llama3-70b", 16, m16, 80, 6, []),
            ("llama3-8b", 12, 85, MAX_PLAN_LAYER_STAGES // 12, 9, search),
            ("llama3-8b", 32, 32, 128, 3, search),
            ("llama3-8b", 40, 25, 102, 3, []),
            ("llama3-8b", 8, 128, 256, 15, []),
            ("llama3-8b", 4, 256, 32, 27, []),
            ("llama3-70b", 4, 256, 1024, 27, []),
            ("llama3-8b", 2, 352, 80, 93, [])):
        dps = dp_list(plans)
        refused = None
        if (pp, model) == (16, "llama3-8b"):  # the next plan count is refused (MAX_PLAN_WORK)
            refused = ["plan", "--model", model, "--pp", str(pp), "--microbatches", str(m), "--layers", str(n),
                       "--dp", dp_list(plans + 3)]
        elif pp == 2:  # one dp size more than MAX_PLAN_DPS is refused
            refused = ["plan", "--model", model, "--pp", str(pp), "--microbatches", str(m), "--layers", str(n),
                       "--dp", ",".join(str(2**k) for k in range(MAX_PLAN_DPS + 1))]
        out.append(Case("plan", f"{model}, pp={pp}, m={m}, {n} layers, --dp {dps}: {at_bound(pp, m, plans)}"
                                + (" " + " ".join(extra) if extra else ""),
                        ["plan", "--model", model, "--pp", str(pp), "--microbatches", str(m), "--layers", str(n),
                         "--dp", dps, *extra], accepted=(0, 1), refused=refused))
    return out


def _nanotron() -> bool:
    try:
        import integration.nanotron.example  # noqa: F401, PLC0415  (torch and nanotron: the check cases only)
    except ImportError:
        return False
    return True


def _yaml(path: str, pp: int, microbatches: int, layers: int, engine: str) -> None:
    """A nanotron YAML of Llama3-8B's sizes (arithmetic only: `check` allocates nothing)."""
    from integration.nanotron.example import TrainerConfig  # noqa: PLC0415

    config = TrainerConfig(pp=pp, layers=layers, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                           seq=8192, micro_batch_size=1, microbatches=microbatches, dtype="bfloat16",
                           fp32_accumulation=True, engine=engine)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(config.yaml(os.path.join(os.path.dirname(path), "checkpoints")))


def run(argv: list[str], timeout: float = TIMEOUT_S) -> dict:
    """One `pipeschedule` command as a subprocess: exit code, wall and CPU seconds, the
    last line of stderr."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "pipeschedule.cli", *argv], cwd=REPO, capture_output=True,
                              text=True, timeout=timeout)
        code, err = done.returncode, done.stderr
    except subprocess.TimeoutExpired as expired:
        code, err = None, (expired.stderr or b"").decode(errors="replace") if isinstance(expired.stderr, bytes) \
            else (expired.stderr or "")
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = [line for line in err.splitlines() if line.strip()]
    return {"exit": code, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "stderr_lines": len(lines),
            "last_line": lines[-1] if lines else "", "load_1m": round(os.getloadavg()[0], 2)}


def shown(argv: list[str]) -> list[str]:
    """`argv` as the results record it: the temporary folder's files by their names alone
    (a reader's machine has no such folder)."""
    return [os.path.basename(w) if os.path.isabs(w) else w for w in argv]


def measure(case: Case, timeout: float) -> dict:
    if case.prepare is not None:
        case.prepare()
    for argv in case.setup:
        done = run(argv, timeout)
        if done["exit"] != 0:
            return {"command": case.command, "input": case.what, "setup_failed": done}
    row = {"command": case.command, "input": case.what, "argv": shown(case.argv),
           "accepted_exits": list(case.accepted)} | run(case.argv, case.timeout or timeout)
    if case.refused is not None:
        refusal = run(case.refused, timeout)
        refusal["one_line"] = refusal["exit"] == 2 and refusal["stderr_lines"] == 1
        row["refused"] = {"argv": shown(case.refused)} | refusal
    row["ok"] = verdict(row).startswith("ok")
    return row


def verdict(row: dict) -> str:
    if "setup_failed" in row:
        return "setup failed"
    if row["exit"] is None:
        return "over (timed out)"
    if row["exit"] not in row["accepted_exits"]:
        return f"failed (exit {row['exit']})"
    if row.get("refused") and not row["refused"]["one_line"]:
        return "not refused in one line"
    if row["wall_s"] <= LIMIT_S:
        return "ok"
    if row["cpu_s"] <= LIMIT_S and row["load_1m"] > CORES:  # [Note: loaded machine]
        return "ok by CPU (loaded)"
    return "over"


def table(rows: list[dict]) -> str:
    lines = ["| command | input | wall s | CPU s | limit s | load 1m | verdict |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['command']} | {row['input']} | {row.get('wall_s', '-')} | {row.get('cpu_s', '-')} | "
                     f"{LIMIT_S:g} | {row.get('load_1m', '-')} | {verdict(row)} |")
    return "\n".join(lines)


def refusals(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        if row.get("refused"):
            r = row["refused"]
            lines.append(f"- `pipeschedule {' '.join(r['argv'])}`"
                         f" -> exit {r['exit']} in {r['wall_s']} s: `{r['last_line']}`")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, nothing written")
    parser.add_argument("--only", default=None, help="only the cases of this command")
    parser.add_argument("--smoke", action="store_true", help="the first quick compile case only, nothing written")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S)
    args = parser.parse_args(argv)
    args.quick = args.quick or args.smoke
    args.only = "compile" if args.smoke else args.only
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases(tmp, args.quick):
            if args.only and case.command != args.only or args.smoke and rows:
                continue
            row = measure(case, args.timeout)
            rows.append(row)
            print(f"{row['command']:9} {row.get('wall_s', '-'):>7} s wall {row.get('cpu_s', '-'):>7} s CPU  "
                  f"{verdict(row):24} {row['input']}", flush=True)
    print()
    print(table(rows))
    if args.smoke:
        print(f"smoke: {len(rows)} case, {verdict(rows[0])}, refused one past: {bool(rows[0].get('refused'))}")
        return 0 if verdict(rows[0]) == "ok" else 1
    if args.quick or args.only:
        return 0 if all(verdict(r) == "ok" for r in rows) or args.quick else 1
    info = machine()
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(), "machine": info, "nproc": os.cpu_count(), "limit_s": LIMIT_S,
        "limits": {"MAX_STAGE_MICROBATCHES": P, "MAX_STAGES": S, "MAX_TRACE_STAGE_MICROBATCHES": PT,
                   "MAX_PNG_STAGE_MICROBATCHES": PG, "MAX_PNG_RANKS": MAX_PNG_RANKS,
                   "MAX_TIMELINE_CELLS": MAX_TIMELINE_CELLS,
                   "MAX_PLAN_STAGE_MICROBATCHES": MAX_PLAN_STAGE_MICROBATCHES,
                   "MAX_PLAN_LAYER_STAGES": MAX_PLAN_LAYER_STAGES, "MAX_PLAN_DPS": MAX_PLAN_DPS,
                   "MAX_SEARCH_NODES": MAX_SEARCH_NODES, "MAX_OFFLOAD_SEARCH": MAX_OFFLOAD_SEARCH,
                   "MAX_PLAN_WORK": MAX_PLAN_WORK, "PLAN_SEARCH_WORK": PLAN_SEARCH_WORK,
                   "MAX_SEARCH_PAIRS": MAX_SEARCH_PAIRS, "MAX_SEARCH_STAGES": MAX_SEARCH_STAGES},
        "rows": rows,
    }
    markdown = "\n".join([
        "# Size limits against time",
        "",
        f"`python -m benchmarks.limits`, {report['date']}, commit {report['commit']}.",
        f"Machine: {info['cpu_count']} cores (`nproc`), {info['cpu_model']}, Python {info['python']}, "
        f"torch {info['torch']}.",
        "The 2 cores were shared with other sessions' work while this ran (the load average is in each row): "
        "wall time is stretched by it, CPU time (the child's user + system) much less.",
        "Every command runs as a subprocess at the largest input its limits accept (pipeschedule/checks.py, "
        "[Note: size limits]); each must finish within the limit. A row whose wall time was stretched past it "
        "by a load above the core count, its CPU time within it, reads \"ok by CPU (loaded)\" ([Note: loaded "
        "machine] in benchmarks/limits.py).",
        "",
        table(rows),
        "",
        "One past each limit, refused in one line (exit 2):",
        "",
        refusals(rows),
        "",
    ])
    for path in write_results("limits", report, markdown):
        print(f"wrote {path}")
    return 0 if all(verdict(r) == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
