"""Less memory without the cap's throughput cost, in simulation with GPU-calibrated costs.

    python -m benchmarks.moonshot            # prints the table, writes benchmarks/results/moonshot.{md,json}

Issue 8's target: at half of 1F1B's first-stage activation memory, at least 95% of
1F1B's throughput (a plain cap gets about 50% at pp=4 and cap 2). Pure Python: it reads
the block times that `python -m benchmarks.gpu` measured on the H200
(benchmarks/results/gpu.json, `calibration_ms`), so it runs anywhere.

Model: the one-GPU benchmark's Llama (hidden 2048, 16 layers, seq 4096, bf16), pp=4,
the embedding on stage 0 and the head and loss on the last stage. Costs per stage from
the measured forward, backward and input-only backward times (a split-backward
schedule's B is the input-gradient part, its W the rest); the stash of a (stage, mb)
from the calibrated memory model (benchmarks/llama/memory.py, `llama_footprints`);
boundaries of s*h bf16 values over an assumed 100 GB/s link. Every candidate is compiled
with that cost (`compile_schedule(..., cost=)`): the list-scheduled families order by the
measured times and lowering places the messages by them.

Split search (small on purpose): with e = layers / stages (4 for one stage per rank, 2
for two), the first stage gets e - a layers and the last stage (which holds the head)
e - b, for a, b in {0, 1, 2}; the layers left are spread as evenly as possible over the
middle stages, the earlier ones taking any extra. That is 9 splits per family, the even
one (a = b = 0) among them. Every family gets the same 9, 1F1B included.

Reference: 1F1B at its best split: the fastest of its 9 (among those within 0.5% of the
fastest, the one with the least rank-0 stash, so that the memory bound is the strictest
one a re-split 1F1B would give). "First-stage activation memory" is rank 0's peak of
live stash bytes in the simulated step (the stash lives from F to B, or to W when the
backward is split), as a fraction of the reference's. Throughput is the reference's step
time over the schedule's. For each family, every split and every cap from 1 (2 for two
stages per rank) to its uncapped peak is tried; the table lists, per family, the fastest
variant within the memory bound. The even-split 1F1B is shown too, with the memory
fraction it would give as the reference instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.common import PP, RESULTS, write_results
from benchmarks.costs import stage_costs
from pipeschedule.errors import ParameterError
from pipeschedule.compiler.families import FAMILIES, generate
from benchmarks.llama.memory import llama_footprints
from pipeschedule.plan.memory import ModelSpec, TrainingSetup
from pipeschedule.compiler.passes import lower
from pipeschedule.simulate import CostModel, simulate
from pipeschedule.compiler.verify import verify

MEMORY_BOUND = 0.5  # of 1F1B's first-stage activation memory
TARGET = 0.95  # of 1F1B's throughput
SEARCHED = (  # (family, stages per rank): every family but AFAB (the most memory), interleaved at v=2
    tuple((name, family.chunks(2 if family.takes_virtual else None)) for name, family in FAMILIES.items()
          if name != "afab"))


def model_and_setup(saved: dict) -> tuple[ModelSpec, TrainingSetup]:
    m = saved["model"]
    model = ModelSpec("benchmark-llama", layers=m["layers"], hidden=m["hidden"], heads=m["heads"],
                      kv_heads=m["kv_heads"], ffn=m["ffn"], vocab=m["vocab"])
    setup = TrainingSetup(tp=1, dp=1, seq=m["seq"], micro_batch=saved.get("microbatch_size", 1),
                          sequence_parallel=False, flash=True, param_bytes=2, act_bytes=2, fp32_grad_accum=False,
                          ddp_buckets=False, activation_formula="llama", optimizer="adam")
    return model, setup


SEARCH_OFFSETS = (0, 1, 2)  # layers taken off the first stage (a) and the last stage (b)
REFERENCE_TIE = 0.005  # 1F1B splits within this of the fastest count as tied


def splits(layers: int, stages: int) -> list[tuple[int, ...]]:
    """The split search of the module docstring: first stage e - a, last e - b layers,
    the rest spread evenly over the middle stages (the earlier ones taking any extra)."""
    e = layers // stages
    out = []
    for a in SEARCH_OFFSETS:
        for b in SEARCH_OFFSETS:
            first, last = e - a, e - b
            rest, middle = layers - first - last, stages - 2
            if first < 0 or last < 0 or middle <= 0:
                continue
            split = (first, *(rest // middle + (i < rest % middle) for i in range(middle)), last)
            if split not in out:
                out.append(split)
    return out


def cost_for(saved: dict, split: tuple[int, ...], split_backward: bool) -> dict:
    model, setup = model_and_setup(saved)
    footprints = llama_footprints(model, setup, split)
    buffers = {"stash": {s: fp.stash_bytes for s, fp in enumerate(footprints)}}
    return stage_costs(saved["calibration_ms"], split, buffers, split_backward=split_backward)


def evaluate(saved: dict, m: int) -> list[dict]:
    """Every (family, split, cap) at m microbatches, compiled with its calibrated cost:
    first-stage activation and throughput vs the reference 1F1B."""
    rows = []
    layers = saved["model"]["layers"]
    for family, per_rank in SEARCHED:
        virtual = 2 if family == "interleaved_1f1b" else None
        caps = [None] + list(range(2 if per_rank == 2 else 1, PP * per_rank + 1)) if family != "1f1b" else [None]
        for split in splits(layers, PP * per_rank):
            costs = cost_for(saved, split, FAMILIES[family].split_backward)
            times = list(zip(costs["forward"], costs["backward"], costs["weight"]))  # per stage (F, B, W)
            for cap in caps:
                try:
                    schedule = generate(family, pp=PP, microbatches=m, cap=cap, virtual=virtual, cost=times)
                except ParameterError:
                    continue
                schedule = lower(schedule, times)
                verify(schedule)
                result = simulate(schedule, CostModel.from_dict(costs, schedule))
                rows.append({"family": family, "cap": cap, "split": list(split), "m": m, "step_ms": result.step_time,
                             "bubble": result.bubble_fraction, "rank0_stash": result.peak_bytes[0],
                             "peak_stash": list(result.peak_bytes)})
    ones = [r for r in rows if r["family"] == "1f1b"]
    fastest = min(r["step_ms"] for r in ones)
    base = min((r for r in ones if r["step_ms"] <= fastest * (1 + REFERENCE_TIE)),
               key=lambda r: (r["rank0_stash"], r["step_ms"]))
    even = next(r for r in ones if len(set(r["split"])) == 1)
    for r in rows:
        r["memory_vs_1f1b"] = r["rank0_stash"] / base["rank0_stash"]
        r["memory_vs_even_1f1b"] = r["rank0_stash"] / even["rank0_stash"]
        r["max_rank_vs_1f1b"] = max(r["peak_stash"]) / max(base["peak_stash"])
        r["throughput_vs_1f1b"] = base["step_ms"] / r["step_ms"]
        r["reference"] = r is base
    return rows


def best_within(rows: list[dict], bound: float, busiest: float = float("inf")) -> list[dict]:
    """Per family, the fastest row whose rank-0 stash is within `bound` of the reference's
    (and whose largest per-rank peak is within `busiest` of the reference's largest)."""
    out = []
    for family, _ in SEARCHED:
        fitting = [r for r in rows if r["family"] == family and r["memory_vs_1f1b"] <= bound + 1e-9
                   and r["max_rank_vs_1f1b"] <= busiest + 1e-9]
        if fitting:
            out.append(max(fitting, key=lambda r: r["throughput_vs_1f1b"]))
    return out


def split_text(split) -> str:
    return "-".join(map(str, split))


def render(saved: dict, results: dict[int, list[dict]]) -> tuple[str, bool]:
    lines = ["# Half of 1F1B's first-stage activation memory: throughput kept, by schedule", "",
             "Command: `python -m benchmarks.moonshot` (pure Python; block times measured on the H200 by "
             f"`python -m benchmarks.gpu`, {saved['versions']['date']}, commit {saved['versions'].get('commit')}). "
             f"pp={PP}, model {saved['model']['hidden']} hidden, {saved['model']['layers']} layers, seq "
             f"{saved['model']['seq']}. Every schedule is compiled with the calibrated cost; split-backward "
             "schedules use the measured input-only backward as B and the rest as W. Split: decoder layers per "
             "stage in stage order (the embedding on the first, the head and loss on the last; on a V shape "
             "rank 0 holds the first and the last stage). Splits searched: first stage e-a, last e-b layers, "
             "a, b in {0, 1, 2}, the rest spread over the middle (e = layers per stage when even).", "",
             "Reference (1.00 / 1.000): 1F1B at its best split (the fastest; among splits within "
             f"{REFERENCE_TIE:.1%} of it, the least rank-0 stash). Column 'vs even 1F1B': rank-0 stash as a "
             "fraction of the even-split 1F1B's instead. Column 'busiest rank': the largest per-rank peak stash "
             "as a fraction of the reference's largest (re-splitting moves layers, and their stash, off rank 0).", ""]
    met = {}
    for m, rows in results.items():
        lines += [f"## m = {m}", "", "| schedule | split | cap | rank-0 activation vs 1F1B | vs even 1F1B | "
                  "busiest rank vs 1F1B's | throughput vs 1F1B | bubble | peak stash per rank (GiB) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        base = next(r for r in rows if r["reference"])
        even = next(r for r in rows if r["family"] == "1f1b" and len(set(r["split"])) == 1)
        shown = [(base, "1f1b (reference)")] + ([(even, "1f1b (even split)")] if even is not base else [])
        shown += [(r, r["family"]) for r in best_within(rows, MEMORY_BOUND)]
        for r, label in shown:
            lines.append(f"| {label} | {split_text(r['split'])} | {r['cap'] if r['cap'] is not None else '-'} | "
                         f"{r['memory_vs_1f1b']:.2f} | {r['memory_vs_even_1f1b']:.2f} | {r['max_rank_vs_1f1b']:.2f} | "
                         f"{r['throughput_vs_1f1b']:.3f} | {r['bubble']:.3f} | "
                         f"{' / '.join(f'{b / 2**30:.2f}' for b in r['peak_stash'])} |")
        best = max(best_within(rows, MEMORY_BOUND), key=lambda r: r["throughput_vs_1f1b"])
        ok = best["throughput_vs_1f1b"] >= TARGET
        met[m] = ok
        lines += ["", f"Best within {MEMORY_BOUND:.0%} of the reference's first-stage activation memory: "
                  f"{best['family']} split {split_text(best['split'])} cap {best['cap']}, "
                  f"{best['throughput_vs_1f1b']:.1%} of 1F1B's throughput "
                  f"({'meets' if ok else 'misses'} the {TARGET:.0%} target)."]
        capped = [r for r in best_within(rows, MEMORY_BOUND, busiest=1.0)]
        if capped:
            top = max(capped, key=lambda r: r["throughput_vs_1f1b"])
            lines += ["", f"Also keeping every rank's peak within the reference's largest: {top['family']} split "
                      f"{split_text(top['split'])} cap {top['cap']}, {top['throughput_vs_1f1b']:.1%}."]
        lines.append("")
    return "\n".join(lines) + "\n", all(met.values())


def frontier(rows: list[dict]) -> list[dict]:
    """The rows no other row of the same family beats on both rank-0 memory and
    throughput (what the results file keeps; the table above is drawn from all rows)."""
    return [r for r in rows if not any(
        o["family"] == r["family"] and o["memory_vs_1f1b"] <= r["memory_vs_1f1b"]
        and o["throughput_vs_1f1b"] >= r["throughput_vs_1f1b"]
        and (o["memory_vs_1f1b"], o["throughput_vs_1f1b"]) != (r["memory_vs_1f1b"], r["throughput_vs_1f1b"])
        for o in rows) or r.get("reference")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moonshot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", type=Path, default=RESULTS / "gpu.json")
    parser.add_argument("--microbatches", default="8,16,32", help="comma-separated m values (default 8,16,32)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    try:
        saved = json.loads(args.calibration.read_text(encoding="utf-8"))
        saved["calibration_ms"], saved["model"]  # noqa: B018  (both must be there)
        ms = [int(x) for x in args.microbatches.split(",")]
    except (OSError, ValueError, KeyError) as err:
        print(f"benchmarks.moonshot: {err}", file=sys.stderr)
        return 2
    results = {m: evaluate(saved, m) for m in ms}
    text, _ = render(saved, results)
    if args.out is not None:
        write_results("moonshot", {str(m): frontier(rows) for m, rows in results.items()}, text, out=args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
