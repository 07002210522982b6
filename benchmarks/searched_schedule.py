"""`searched` against the fixed families and the zero-bubble repository's automatic
schedule, on the same costs, simulated.

    python -m benchmarks.searched_schedule                        # writes results/searched_schedule.{md,json}
    python -m benchmarks.searched_schedule --zb-repo DIR          # also runs their heuristic from a checkout
    python -m benchmarks.searched_schedule --smoke                # one case, writes nothing

Costs: the H200 cost files of examples/ (pp=4: `cost_pp4_split.json` for the split
schedules, `cost_pp4.json`, the same times with B + W as the backward, for the unsplit
ones; `cost_pp4_v2_split.json` for the two-chunk placements) and unit costs. Every row is
our simulator's step time of the lowered, verified order (messages timed by the cost's
latency and bandwidth), its peak in-flight count (rule 6: F to B) per rank and its peak
live bytes on rank 0.

Rows per case: `capped_1f1b` under the cap; the best fixed family under the cap (the
fastest one-chunk family whose order keeps rule 6's count within the cap); `searched`
(the cap bounds the stashes a rank holds from F to W, as zb_h1's cap does: the memory
of capped_1f1b); `searched, W pending uncounted` (`uncounted_w=True`: the cap bounds
rule 6's count only, F to B, as the verifier reads it; a stash whose W is pending is
not counted); `searched` on two chunks per rank, round robin and V (its cap in
stage-microbatches, each half a one-chunk stage: cap 2c holds about the activations of
c); and the zero-bubble repository's heuristic (`--zb-repo`).

The zero-bubble repository (sail-sg/zero-bubble-pipeline-parallelism,
megatron/core/pipeline_parallel/zerobubble/scheduler/zb.py) builds its order with a
greedy, `Graph.manual_order`, run under 8 combinations of three switches (bubble before
the first B, B before F, W put in every bubble it fits), keeping the one its own timing
(a per-stage span, one message cost `cost_comm`) finds shortest; its integer program
(pulp) is disabled in the repository (`auto_schedule` calls it only when nnodes < 0). Its
memory limit is in bytes, each F adding `mem_f`, B and W subtracting `mem_b`, `mem_w`.
With `--zb-repo DIR` (a checkout of that repository; nothing of it is copied here) this
script imports their zb.py as it is (a stand-in for `pulp`, which only its ILP and
`create_scheduled_nodes` use, where pulp is not installed) and runs their
`initial_solution` with the cost file's times, mem_f = the stash bytes, mem_b = minus
what B frees (stash - weight_stash), mem_w = minus weight_stash, max_mem = cap x mem_f
(the memory of `cap` whole stashes: the `searched` row's bound), and again with
max_mem = the peak bytes per rank of our `W pending uncounted` row, cost_comm = latency
+ one boundary's bytes / bandwidth. Their per-stage order is then lowered, verified
and simulated by ours like every other row.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import sys
import time
import types
from pathlib import Path

import datetime

from benchmarks.common import RESULTS, git_commit, machine, write_results
from pipeschedule import compile_schedule, generate, lower, verify
from pipeschedule.compiler.families import FAMILIES, _fixed_orders
from pipeschedule.compiler.generators.common import round_robin
from pipeschedule.compiler.generators.search import held_peaks
from pipeschedule.compiler.generators.searched import cost_models, order_of, searched
from pipeschedule.compiler.generators.v_shape import v_placement
from pipeschedule.compiler.ir import Op, Schedule, make_instr
from pipeschedule.simulate import simulate
from pipeschedule.simulate.cost import CostModel

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ONE_CHUNK = [name for name, f in FAMILIES.items() if name != "searched" and f.chunks() == 1]
GIB = 2**30


def cost_file(name: str, stages: int) -> CostModel:
    probe = compile_schedule("1f1b", pp=stages, microbatches=1, check=False)
    return CostModel.from_dict(json.loads((EXAMPLES / name).read_text()), probe)


def row(label: str, schedule: Schedule, cost: CostModel, seconds: float | None = None) -> dict:
    """One row: the schedule lowered with the cost it reads, verified and simulated."""
    lowered = lower(schedule, cost)
    verify(lowered)
    result = simulate(lowered, cost)
    return {"schedule": label, "step": result.step_time, "inflight": list(result.peak_inflight),
            "rank0_gib": result.peak_bytes[0] / GIB, "seconds": seconds}


def best_fixed(pp: int, m: int, cap, split: CostModel, whole: CostModel) -> dict:
    caps = [cap] * pp if isinstance(cap, int) else cap
    best = None
    for name, order in _fixed_orders(pp, m, cap, split, whole):
        cost = split if FAMILIES[name].split_backward else whole
        found = row(name, order, cost)
        if cap is not None and any(p > c for p, c in zip(found["inflight"], caps)):
            continue
        if best is None or found["step"] < best["step"]:
            best = found
    best["schedule"] = f"best fixed: {best['schedule']}"
    return best


def two_chunk_seeds(placement):
    """The fixed families on `placement` (V: zbv, v_half, v_min; round robin:
    interleaved_1f1b with virtual 2) under the cap, as `searched` takes seeds."""
    def seeds(pp, m, cap, split, whole):
        names = ("zbv", "v_half", "v_min") if placement == "v" else ("interleaved_1f1b",)
        out = []
        for name in names:
            f = FAMILIES[name]
            options = {"cap": cap} if cap is not None else {}
            if f.takes_virtual:
                options["virtual"] = 2
            try:
                out.append((name, generate(name, pp=pp, microbatches=m, cost=split if f.split_backward else whole,
                                           **options)))
            except Exception:  # a cap the family refuses: no seed
                continue
        return out
    return seeds


def case(pp: int, m: int, cap, costs: str, zb_repo: Path | None) -> dict:
    if costs == "h200":
        split, whole = cost_file("cost_pp4_split.json", pp), cost_file("cost_pp4.json", pp)
        split2 = cost_file("cost_pp4_v2_split.json", 2 * pp)
    else:
        split, whole = cost_models(None, list(range(pp)))
        split2 = cost_models([(0.5, 0.5, 0.5)] * (2 * pp), list(range(2 * pp)))[0]  # half a rank's share a stage
    rows = []
    rows.append(row("capped_1f1b", generate("capped_1f1b", pp=pp, microbatches=m, cap=cap, cost=whole), whole))
    rows.append(best_fixed(pp, m, cap, split, whole))
    start = time.perf_counter()
    ours = generate("searched", pp=pp, microbatches=m, cap=cap, cost=split)
    rows.append(row(f"searched (seed {ours.params['seed']})", ours, split, time.perf_counter() - start))
    if cap is not None:
        start = time.perf_counter()
        free = searched(pp, m, cap=cap, cost=split, uncounted_w=True, seeds=_fixed_orders)
        rows.append(row(f"searched, W pending uncounted (seed {free.params['seed']})", free, split,
                        time.perf_counter() - start))
        doubled = [2 * c for c in cap] if isinstance(cap, list) else 2 * cap
        for name, placement in (("round robin", round_robin(pp, 2)), ("V", v_placement(pp))):
            start = time.perf_counter()
            two = searched(pp, m, cap=doubled, cost=split2, placement=placement,
                           seeds=two_chunk_seeds("v" if name == "V" else "rr"))
            rows.append(row(f"searched, 2 chunks {name}, cap {doubled} (seed {two.params['seed']})", two, split2,
                            time.perf_counter() - start))
    if zb_repo is not None:
        caps = [cap] * pp if isinstance(cap, int) else (cap or [m] * pp)
        stash = split.buffer_bytes["stash"]
        budgets = [("memory of cap stashes", [c * s for c, s in zip(caps, stash)])]
        if cap is not None:
            if costs == "h200":
                peaks = simulate(lower(free, split), split).peak_bytes
            else:  # unit costs: one byte a buffer, so whole stashes held (F to W) instead
                peaks = [n * s for n, s in zip(held_peaks(None, order_of(free))[1], stash)]
            budgets.append(("the uncounted row's peak memory", list(peaks)))
        for label, budget in budgets:
            start = time.perf_counter()
            theirs = zero_bubble_heuristic(zb_repo, pp, m, budget, split)
            if theirs is not None:
                rows.append(row(f"zero-bubble repo heuristic, their code, {label}", theirs, split,
                                time.perf_counter() - start))
    base = rows[0]["step"]
    for r in rows:
        r["vs_capped"] = 1 - r["step"] / base
    return {"pp": pp, "microbatches": m, "cap": cap, "costs": costs, "rows": rows}


@functools.cache
def _load_zero_bubble(repo: Path):
    """Their zb.py module, imported from a checkout as it is (once)."""
    base = repo / "megatron/core/pipeline_parallel/zerobubble/scheduler"
    if importlib.util.find_spec("pulp") is None:
        sys.modules.setdefault("pulp", types.ModuleType("pulp"))  # only their ILP and create_scheduled_nodes use it
    package = "megatron.core.pipeline_parallel.zerobubble.scheduler"
    for k in range(1, len(package.split(".")) + 1):
        name = ".".join(package.split(".")[:k])
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = []
            sys.modules[name] = module
    modules = {}
    for stem in ("graph", "zb"):
        spec = importlib.util.spec_from_file_location(f"{package}.{stem}", base / f"{stem}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        modules[stem] = module
    return modules


def zero_bubble_heuristic(repo: Path, pp: int, m: int, max_mem: list, cost: CostModel) -> Schedule | None:
    """Their `initial_solution` on our costs under `max_mem` bytes per stage (module
    docstring), as our compute order; None where their greedy raises (it cannot fit the
    memory limit)."""
    zb = _load_zero_bubble(repo)
    stash = [float(x) for x in cost.buffer_bytes["stash"]]
    kept = [float(x) for x in cost.weight_stash] if cost.weight_stash is not None else stash  # None: kept to W
    comm = cost.latency + (0.0 if cost.bandwidth == math.inf else max(cost.buffer_bytes["act_out"]) / cost.bandwidth)
    config = zb["graph"].GraphConfig(
        mem_f=stash, mem_b=[-(s - k) for s, k in zip(stash, kept)], mem_w=[-k for k in kept],
        max_mem=[float(x) for x in max_mem], cost_f=[float(x) for x in cost.forward],
        cost_b=[float(x) for x in cost.backward], cost_w=[float(x) for x in cost.weight], cost_comm=float(comm),
        print_scaling=1, n_stages=pp, n_micro=m)
    graph = zb["zb"].Graph.build_graph(pp, m, config)
    try:
        _, order, _ = zb["zb"].initial_solution(graph, print_result=False)
    except ValueError:
        return None
    programs = []
    for stage in range(pp):
        nodes = [(order[graph.get_id(kind, stage, mb)], kind, mb) for kind in range(3) for mb in range(m)]
        programs.append([make_instr((Op.F, Op.B, Op.W)[kind], stage, mb) for _, kind, mb in sorted(nodes)])
    return Schedule("zero_bubble_repo", pp, 1, m, tuple(range(pp)), tuple(programs), {})


CASES = [(4, 8, 2, "h200"), (4, 8, [2, 3, 2, 1], "h200"), (4, 8, 1, "h200"), (4, 8, 3, "h200"),
         (4, 16, 2, "h200"), (4, 8, None, "h200"), (4, 8, 2, "unit"), (8, 16, 4, "unit")]


def markdown(report: dict) -> str:
    lines = ["# searched against the fixed families and the zero-bubble repository's heuristic", "",
             f"{report['when']}; {report['machine']}; commit {report['commit']}; "
             f"command `{report['command']}`.", "",
             "Simulated step time (ms under the H200 cost files, units under unit costs), lower is better; "
             "'vs capped' is the time saved against capped_1f1b at the same cap; in flight is rule 6's count per "
             "rank; rank 0 GiB the simulator's peak live bytes on rank 0 (H200 files only); seconds what the "
             "search took.", ""]
    for c in report["cases"]:
        lines += [f"## pp={c['pp']}, m={c['microbatches']}, cap={c['cap']}, {c['costs']} costs", "",
                  "| schedule | step | vs capped | in flight | rank 0 GiB | seconds |", "|---|---|---|---|---|---|"]
        for r in c["rows"]:
            seconds = "" if r["seconds"] is None else f"{r['seconds']:.2f}"
            gib = f"{r['rank0_gib']:.2f}" if c["costs"] == "h200" else ""
            lines.append(f"| {r['schedule']} | {r['step']:.2f} | {100 * r['vs_capped']:+.1f}% | "
                         f"{'/'.join(map(str, r['inflight']))} | {gib} | {seconds} |")
        lines.append("")
    lines += report.get("notes", [])
    return "\n".join(lines) + "\n"


def _slower(report: dict) -> str:
    """'k of n': the capped cases where their heuristic, at the memory of cap stashes, is slower than capped_1f1b."""
    capped = [c for c in report["cases"] if c["cap"] is not None]
    name = "zero-bubble repo heuristic, their code, memory of cap stashes"
    slower = sum(1 for c in capped for r in c["rows"] if r["schedule"] == name and r["vs_capped"] < 0)
    return f"{slower} of {len(capped)}"


def _bound_note(ours: dict) -> str:
    """The goal case's exact bound (benchmarks/searched_bound.py), where its results exist."""
    path = RESULTS / "searched_bound.json"
    if not path.exists():
        return "`python -m benchmarks.searched_bound` computes the least time any order can reach there."
    bound = json.loads(path.read_text())
    goal = bound["cases"][0]
    return (f"No order reaches 10%: the least time of any order that keeps rank 0 within capped_1f1b's peak bytes "
            f"and rule 6's count within {goal['cap']} on every rank (the Ws of the other ranks free to wait) is "
            f"{goal['bound']:.2f} ms in the search model, proven by an exact program ({bound['date'][:10]}, "
            "[searched_bound](searched_bound.md)), "
            f"{1 - goal['bound'] / goal['capped']:.1%} below capped_1f1b; `searched` finds that optimum "
            f"({ours['step']:.2f} ms simulated: the messages' posting).")


def notes(report: dict) -> list[str]:
    """What the tables say, in words, from their own figures."""
    goal = next(c for c in report["cases"] if c["costs"] == "h200" and c["cap"] == 2 and c["microbatches"] == 8)
    rows = {r["schedule"].split(" (seed")[0]: r for r in goal["rows"]}
    ours, free = rows["searched"], rows["searched, W pending uncounted"]
    zb_free = rows.get("zero-bubble repo heuristic, their code, the uncounted row's peak memory")
    theirs = report.get("zero_bubble_commit") or "the checkout given"
    return [
        "## Notes", "",
        f"- The issue's goal case (pp=4, m=8, cap 2 on every rank: rank 0 is what binds; the ranks after it hold "
        f"at most 2 too): `searched` with the cap on stashes (F to W, the memory of capped_1f1b) is "
        f"{100 * ours['vs_capped']:.1f}% faster than capped_1f1b, short of the 10% asked; counting rule 6's F to "
        f"B only it is {100 * free['vs_capped']:.1f}% faster, rank 0 holding {free['rank0_gib']:.2f} GiB against "
        f"{rows['capped_1f1b']['rank0_gib']:.2f}. On one stage per rank with 2 stashes on rank 0 each microbatch "
        "holds a slot from its F to its W, about 72.3 ms of F and B chain and messages under these costs, so 8 "
        "microbatches take at least 9 + 4 x 72.3 = 298 ms if no two ever meet in a rank's queue; they must meet. "
        + _bound_note(ours),
    ] + ([] if "zero-bubble repo heuristic, their code, memory of cap stashes" not in rows else [
        "- The zero-bubble repository's heuristic is their code (`Graph.manual_order` under its 8 switch "
        f"combinations, `initial_solution`; {theirs}), run on the same costs, its order lowered, verified and "
        "simulated by ours. Its memory limit is bytes: at the memory of `cap` whole stashes its greedy starts "
        f"fewer microbatches on the later ranks and is slower than capped_1f1b in {_slower(report)} capped "
        f"cases here; in the goal case, at the peak bytes of our uncounted row, it takes {zb_free['step']:.1f} ms "
        f"against that row's {free['step']:.1f} with {zb_free['rank0_gib']:.2f} GiB on rank 0, holding "
        f"{zb_free['inflight'][0]} microbatches in flight there where the cap is 2 (bytes, not counts, bound it).",
    ]) + [
        "- Two chunks per rank (`searched(..., placement=)`, Python only: the family, the planner and nanotron run "
        "one stage per rank) count each half-size stage against the cap, so cap 2c there holds about the "
        "activations of c microbatches of a one-chunk stage (rank 0's bytes in the table: V holds the embedding's "
        "and the head's stages there).",
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zb-repo", type=Path, help="a checkout of the zero-bubble repository, to run its heuristic")
    parser.add_argument("--zb-commit", default=None, help="the commit of that checkout, for the record")
    parser.add_argument("--smoke", action="store_true", help="one case, nothing written")
    args = parser.parse_args(argv)
    cases = CASES[:1] if args.smoke else CASES
    host = machine()
    report = {"when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{host['cpu_model']}, {host['cpu_count']} cores, Python {host['python']}",
              "commit": git_commit(short=True),
              "command": "python -m benchmarks.searched_schedule" + (" --zb-repo DIR" if args.zb_repo else ""),
              "host": host, "cases": [case(pp, m, cap, costs, args.zb_repo) for pp, m, cap, costs in cases],
              "zero_bubble_commit": args.zb_commit}
    report["notes"] = notes(report)
    text = markdown(report)
    print(text)
    if not args.smoke:
        write_results("searched_schedule", report, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
