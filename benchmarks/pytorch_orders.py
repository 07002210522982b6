"""Our compiled orders beside PyTorch's own, schedule by schedule (issue 42).

    python -m benchmarks.pytorch_orders            # pp 2..8, m from each minimum to 3pp: results/pytorch_orders.*
                                                   # (the interleaved classes at v=2 and v=3)
    python -m benchmarks.pytorch_orders --smoke    # pp 2..3, printed, nothing written

For every schedule class of PyTorch's `torch.distributed.pipelining.schedules` and the
family of ours that runs the same schedule, at every (pp, m) its constructor accepts, the
class's own `pipeline_order` (built on CPU: the classes need only their stages'
num_stages, group_size, group_rank, stage_index and, for the split-backward ones, a
submodule; no process group) is written as PyTorch's CSV, read into our IR through
pipeschedule.compiler.torch_csv and lowered; ours is `compile_schedule` of the family.
Both are simulated by our simulator under unit costs (CostModel.default: a rank's share
of layers costs F = 1, B = 2, split in B = W = 1 where the backward is split; free
messages): step time and peak in flight per rank ((stage, mb) between F and B). A row says
whether the two compute orders are equal, and where not, what differs.

[Note: PyTorch's 1F1B order] Schedule1F1B's `pipeline_order` is informational (its runtime
steps through its own loop) and numbers the forwards of a rank without warmup 1..m, not
0..m-1 (tests/compiler/test_torch_csv.py shows it). Each stage's forwards are renumbered
in order here, which is the order its runtime runs.

The second part is the issue's goal at pp=4, m=8 under the H200 cost files (examples/README.md):
dualpipev against PyTorch's DualPipeV order and DeepSeek's published bubble
(PP/2 - 1)(F&B + B - 3W) with PP = 2pp stages and F&B = F + B (no overlap in the
simulator); zb_h2 against ZB-H1 and the zero-bubble paper's (pp - 1)(F + B - 2W), B the
input-gradient part. A formula's step time is the busiest rank's work plus that bubble.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

from benchmarks.common import RESULTS, git_commit, machine, write_results
from pipeschedule import compile_schedule, lower
from pipeschedule.compiler import torch_csv
from pipeschedule.compiler.ir import Op, Schedule
from pipeschedule.simulate import simulate
from pipeschedule.simulate.cost import load_cost

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# PyTorch's class, our family, chunks per rank
PAIRS = (
    ("ScheduleGPipe", "afab", 1),
    ("Schedule1F1B", "1f1b", 1),
    ("ScheduleInterleaved1F1B", "interleaved_1f1b", 2),
    ("ScheduleLoopedBFS", "looped_bfs", 2),
    ("ScheduleInterleavedZeroBubble", "interleaved_zb", 2),
    ("ScheduleZBVZeroBubble", "zbv", 2),
    ("ScheduleDualPipeV", "dualpipev", 2),
    ("ScheduleInterleaved1F1B", "interleaved_1f1b", 3),
    ("ScheduleLoopedBFS", "looped_bfs", 3),
    ("ScheduleInterleavedZeroBubble", "interleaved_zb", 3),
)


def torch_schedule(cls: str, pp: int, microbatches: int, virtual: int):
    """PyTorch's schedule object for rank 0 of pp, or None where its constructor refuses m."""
    import torch
    from torch.distributed.pipelining import schedules

    stages = [SimpleNamespace(num_stages=pp * virtual, group_size=pp, group_rank=0, stage_index=i,
                              submod=torch.nn.Identity()) for i in range(virtual)]
    try:
        return getattr(schedules, cls)(stages[0] if virtual == 1 else stages, microbatches)
    except ValueError:
        return None


def renumber_forwards(schedule: Schedule) -> Schedule:
    """Each stage's forwards numbered 0, 1, ... in program order ([Note: PyTorch's 1F1B order])."""
    seen: dict[int, int] = {}
    programs = []
    for program in schedule.programs:
        out = []
        for i in program:
            if i.op is Op.F:
                i = type(i)(Op.F, i.stage, seen.get(i.stage, 0))
                seen[i.stage] = i.mb + 1
            out.append(i)
        programs.append(tuple(out))
    return Schedule(schedule.name, schedule.pp, schedule.virtual, schedule.microbatches, schedule.placement,
                    tuple(programs), schedule.params)


def torch_order(cls: str, pp: int, microbatches: int, virtual: int) -> Schedule | None:
    """PyTorch's compute order in our IR (read from its CSV), or None where it refuses m."""
    from torch.distributed.pipelining import schedules

    made = torch_schedule(cls, pp, microbatches, virtual)
    if made is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "torch.csv")
        if virtual == 1:  # the single-stage classes write with the multi-stage writer
            schedules.PipelineScheduleMulti._dump_csv(SimpleNamespace(pipeline_order=made.pipeline_order), path)
        else:
            made._dump_csv(path, format="compute_only")
        order = torch_csv.load_csv(path)
    return renumber_forwards(order) if cls == "Schedule1F1B" else order


def compute_order(schedule: Schedule) -> list[list[str]]:
    return [[str(i) for i in program if i.op in (Op.F, Op.B, Op.W)] for program in schedule.programs]


def difference(ours: Schedule, theirs: Schedule) -> str:
    """'equal', or where the compute orders first differ."""
    a, b = compute_order(ours), compute_order(theirs)
    if a == b:
        return "equal"
    for rank, (x, y) in enumerate(zip(a, b)):
        if x != y:
            k = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            return f"differs: rank {rank} step {k} ({x[k] if k < len(x) else '-'} vs {y[k] if k < len(y) else '-'})"
    return "differs"


def row(cls: str, family: str, virtual: int, pp: int, microbatches: int) -> dict | None:
    theirs = torch_order(cls, pp, microbatches, virtual)
    if theirs is None:
        return None
    ours = compile_schedule(family, pp=pp, microbatches=microbatches, virtual=virtual if virtual > 1 else None)
    if family in ("afab", "1f1b"):
        ours = compile_schedule(family, pp=pp, microbatches=microbatches)
    mine, yours = simulate(ours), simulate(lower(theirs))
    return {
        "torch": cls, "family": family, "pp": pp, "virtual": virtual, "microbatches": microbatches,
        "ours_step": mine.step_time, "torch_step": yours.step_time,
        "ours_peak": list(mine.peak_inflight), "torch_peak": list(yours.peak_inflight),
        "order": difference(ours, theirs),
    }


def rows(pps, most=lambda pp: 3 * pp):
    for cls, family, virtual in PAIRS:
        for pp in pps:
            for m in range(1, most(pp) + 1):
                found = row(cls, family, virtual, pp, m)
                if found is not None:
                    yield found


def never_slower(r: dict) -> bool:
    """Ours finishes no later, with no rank holding more in flight than PyTorch's."""
    return (r["ours_step"] <= r["torch_step"] + 1e-9
            and all(a <= b for a, b in zip(r["ours_peak"], r["torch_peak"])))


# -- the goal at pp=4, m=8 under the H200 costs ---------------------------------------------


def _formula_step(cost, pp: int, virtual: int, bubble_of) -> float:
    """The busiest rank's work plus the published bubble (stage times averaged)."""
    stages = pp * virtual
    mean = [sum(column) / stages for column in (cost.forward, cost.backward, cost.weight)]
    return bubble_of(*mean)


def goal(pp: int = 4, microbatches: int = 8) -> list[dict]:
    """dualpipev and zb_h2 under the H200 cost files ([this module's docstring])."""
    out = []
    split_v2 = str(EXAMPLES / f"cost_pp{pp}_v2_split.json")
    split_v1 = str(EXAMPLES / f"cost_pp{pp}_split.json")
    theirs = torch_order("ScheduleDualPipeV", pp, microbatches, 2)
    for name, path, other in (("dualpipev", split_v2, ("PyTorch ScheduleDualPipeV", theirs)),
                              ("zb_h2", split_v1, ("zb_h1", None)), ("zbv", split_v2, None)):
        probe = compile_schedule(name, pp=pp, microbatches=microbatches)
        cost = load_cost(path, probe)
        ours = compile_schedule(name, pp=pp, microbatches=microbatches, cost=cost)
        result = simulate(ours, cost)
        work = max(result.busy)
        entry = {"family": name, "cost_file": os.path.relpath(path, EXAMPLES.parent), "pp": pp,
                 "microbatches": microbatches, "ours_step_ms": result.step_time,
                 "ours_peak": list(result.peak_inflight), "busiest_rank_work_ms": work}
        F, B, W = (sum(c) / len(c) for c in (cost.forward, cost.backward, cost.weight))
        if name == "dualpipev":
            entry["formula"] = "(PP/2-1)(F&B+B-3W), PP=2pp, F&B=F+B, B=B+W whole"
            entry["formula_bubble_ms"] = (pp - 1) * ((F + B + W) + (B + W) - 3 * W)
        elif name == "zb_h2":
            entry["formula"] = "(pp-1)(F+B-2W)"
            entry["formula_bubble_ms"] = (pp - 1) * (F + B - 2 * W)
        if "formula_bubble_ms" in entry:
            entry["formula_step_ms"] = work + max(0.0, entry["formula_bubble_ms"])
        if other is not None:
            label, order = other
            if order is None:
                order = compile_schedule(label, pp=pp, microbatches=microbatches, cost=cost)
            else:
                order = lower(order, cost)
            versus = simulate(order, cost)
            entry["versus"] = label
            entry["versus_step_ms"] = versus.step_time
            entry["versus_peak"] = list(versus.peak_inflight)
        out.append(entry)
    return out


def markdown(table: list[dict], reached: list[dict], info: dict) -> str:
    lines = [
        "# Our orders beside PyTorch's (`python -m benchmarks.pytorch_orders`)",
        "",
        f"{info['date']}, commit {info['commit']}, torch {info['torch']}, {info['cpu_model']}; pure simulation",
        "(no GPU). Unit costs: a rank's share of layers F = 1, B = 2 (B = W = 1 split); peak = the",
        "most (stage, mb) between F and B per rank. PyTorch's order is its class's `pipeline_order`, read",
        "through our CSV reader; `m` runs from the least each class accepts to 3pp.",
        "",
        f"Rows: {len(table)}; ours never slower with no rank holding more: "
        f"{sum(map(never_slower, table))} of {len(table)}; equal orders: "
        f"{sum(r['order'] == 'equal' for r in table)}; ours faster: "
        f"{sum(r['ours_step'] < r['torch_step'] - 1e-9 for r in table)}.",
        "",
        "## The goal at pp=4, m=8 under the H200 costs (ms)",
        "",
        "| family | cost file | ours | peak | against | its step | its peak | published bubble | formula step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in reached:
        lines.append(
            f"| {e['family']} | {e['cost_file']} | {e['ours_step_ms']:.2f} | {e['ours_peak']} | "
            f"{e.get('versus', '-')} | {e['versus_step_ms']:.2f} | {e['versus_peak']} | "
            f"{e.get('formula', '-')} = {e.get('formula_bubble_ms', 0):.2f} | {e.get('formula_step_ms', 0):.2f} |"
            if "versus" in e else
            f"| {e['family']} | {e['cost_file']} | {e['ours_step_ms']:.2f} | {e['ours_peak']} | - | - | - | - | - |")
    lines += ["", "## Schedule by schedule", "",
              "| PyTorch | ours | pp | v | m | ours step | PyTorch step | ours peak | PyTorch peak | order |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['torch']} | {r['family']} | {r['pp']} | {r['virtual']} | {r['microbatches']} | "
                     f"{r['ours_step']:g} | {r['torch_step']:g} | {r['ours_peak']} | {r['torch_peak']} | "
                     f"{r['order']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="pp 2..3 only, printed, nothing written")
    parser.add_argument("--out", default=str(RESULTS), help="where the results go (default: benchmarks/results)")
    args = parser.parse_args(argv)
    pps = range(2, 4) if args.smoke else range(2, 9)
    table = list(rows(pps))
    reached = goal()
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(short=True), **machine()}
    text = markdown(table, reached, info)
    slower = [r for r in table if not never_slower(r)]
    if args.smoke:
        print(text)
    else:
        write_results("pytorch_orders", {"machine": info, "goal": reached, "rows": table}, text, Path(args.out))
        print(text.split("## Schedule by schedule")[0])
    if slower:
        print(f"ours slower or holding more in {len(slower)} rows, e.g. {slower[0]}")
    return 1 if slower else 0


if __name__ == "__main__":
    raise SystemExit(main())
