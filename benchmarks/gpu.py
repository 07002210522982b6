"""One-GPU benchmarks: per-stage memory, executor overhead, simulator calibration.

    python -m benchmarks.gpu                 # the full run on one CUDA GPU (a few minutes on an H200)
    python -m benchmarks.gpu --smoke         # a tiny model on CPU: checks the plumbing, writes nothing
    python -m benchmarks.gpu --render benchmarks/results/gpu.json   # tables and plots again, no GPU

It runs four measurements in one call and writes under `--out` (default
benchmarks/results/): gpu.json (every raw measurement), gpu.md (the tables and checks,
with the memory model's predictions computed when rendering), gpu_memory.png,
gpu_release.png and the cost files gpu_cost_v1[_split].json, gpu_cost_v2[_split].json
that `pipeschedule simulate --cost` reads.

1. Per-stage memory of real training. The Llama-style model of the nanotron integration
   (benchmarks/llama/model.py; `MODEL` below, bf16) at pp=4 as four processes on the
   one GPU: gloo between them, boundary tensors staged through pinned host memory
   (`HostStagedTransport`, which the engines pick when gloo runs on a CUDA machine). Each
   configuration (schedule x microbatches) runs `WARMUP` + `STEPS` training steps
   (nanotron engine `train_batch_iter`, then an AdamW step); before each step the peak
   statistics are reset, so `peak_allocated` / `peak_reserved` are the step's own peaks
   (`torch.cuda.max_memory_*` of the rank's process). Beside each: the memory model's
   prediction (`benchmarks.llama.probe.predict`) and the measured terms
   (parameters, optimizer state, gradients, the runtime ledger's peak of live buffers,
   and the rest: the transient working set), so a miss names its term.
2. Executor overhead (benchmarks/gpu_overhead.py). All four stages in ONE process on the
   GPU (`InProcessPipeline`, the same blocks as plain modules): step time through the
   executor against the same forward and backward calls, in the same order, from a plain
   loop; the difference is the runtime's overhead. Beside them: one backward per
   microbatch through all stages (no boundaries), the executor measuring every stash
   with the ledger's hooks (`measure_stash="every"`), and each variant's GPU busy time
   and synchronisations.
3. Calibration. One decoder layer, the embedding and the head+loss timed with CUDA
   events (forward; full backward; input-gradient-only backward, so that
   weight = full - input for split-backward schedules); per stage, summed into cost
   files; buffer bytes per stage from the ledger of part 1. Then the simulated step time,
   bubble and tokens/s/GPU of each schedule for pp=4 on four such GPUs: predictions the
   multi-GPU benchmark checks. The p2p link is an assumption (`P2P_LATENCY_MS`,
   `P2P_GBPS`), not a measurement.
4. Activation release over time: live bytes per rank after each instruction of one step
   (the ledger's trace) for 1f1b against capped_1f1b, beside the simulator's curve for
   the same schedule and the measured buffer sizes (gpu_release.png).

What the run checks (printed last and in gpu.md): stage 0's peak
allocated memory under capped_1f1b at cap c falls against 1f1b by at least 90% of the
predicted fall, at every microbatch count; the memory model's peak within 5% of measured
allocated bytes for every configuration; executor overhead below 1% of the step.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks import training
from benchmarks.common import MICROBATCH_SIZE, MODEL, PP, RESULTS, SMOKE_MODEL, WARMUP, versions, write_results
from benchmarks.calibration import run_calibration, simulate_cases
from benchmarks.costs import P2P_GBPS, P2P_LATENCY_MS, stage_costs
from benchmarks.training import (
    OURS,
    SPLIT_BACKWARD,
    Case,
    cases,
    compiled,
    gib,
    model_split,
    predicted_total,
)
from benchmarks.gpu_overhead import overhead_lines, run_overhead
from benchmarks.llama.model import ModelConfig

MICROBATCHES = (8, 32)
STEPS = 3
OVERHEAD_TARGET = 0.01
OVERHEAD_STEPS = 15  # measured rounds per micro-batch size
OVERHEAD_MICROBATCH_SIZES = (1, 2)  # 1: the memory runs' size (host-bound on the H200); 2: GPU-bound
TRACE_LABELS = ("1f1b", "capped c=2")


# -- part 3: calibration -------------------------------------------------------------------


def release_curves(rows: list[dict], costs: dict[int, dict], labels: tuple[str, ...]) -> dict:
    """Per rank, on the simulated time axis: the simulator's live bytes (its step curve)
    and the ledger's measured live bytes after each instruction, drawn from the simulated
    start of that instruction (the simulator counts a buffer from the start of the
    instruction that produces it, so the two curves step together where they agree)."""
    from pipeschedule.simulate import CostModel, simulate

    curves = {}
    for row in rows:
        case = row["case"]
        if case["label"] not in labels or "trace" not in row["ranks"][0]:
            continue
        schedule = compiled(Case(**case), PP)
        result = simulate(schedule, CostModel.from_dict(costs[case["virtual"]], schedule))
        ranks = []
        for rank in range(PP):
            start = {e.index: e.start for e in result.events if e.rank == rank}
            trace = row["ranks"][rank]["trace"]
            ranks.append({"simulated": [list(point) for point in result.memory[rank]],
                          "measured": [[start[pc], live] for pc, live in trace]})
        curves[case["label"]] = ranks
    return curves


# -- reporting -----------------------------------------------------------------------------


def plot_memory(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = sorted({r["case"]["microbatches"] for r in rows})
    fig, axes = plt.subplots(len(ms), 1, figsize=(12, 4 * len(ms)), squeeze=False)
    for ax, m in zip(axes[:, 0], ms):
        sub = [r for r in rows if r["case"]["microbatches"] == m]
        width = 0.8 / PP
        for rank in range(PP):
            xs = [i + rank * width for i in range(len(sub))]
            measured = [(r["ranks"][rank].get("peak_allocated") or 0) / 2**30 for r in sub]
            pred = [predicted_total(r["predicted"][rank]) / 2**30 for r in sub]
            ax.bar(xs, measured, width * 0.9, label=f"rank {rank} measured", color=f"C{rank}")
            ax.scatter(xs, pred, marker="_", s=200, color="black", label="predicted" if rank == 0 else None, zorder=3)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sub))], [r["case"]["label"] for r in sub], fontsize=8)
        ax.set_ylabel("peak allocated GiB")
        ax.set_title(f"per-stage peak allocated memory, pp={PP}, m={m} (bars measured, dashes predicted)")
        ax.legend(fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_release(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, max(1, len(curves)), figsize=(7 * max(1, len(curves)), 4.5), squeeze=False)
    for ax, (label, ranks) in zip(axes[0], curves.items()):
        for rank, curve in enumerate(ranks):
            for key, style in (("measured", {"linewidth": 3, "alpha": 0.45}),
                               ("simulated", {"linestyle": "--", "linewidth": 1})):
                xs, ys = zip(*curve[key])
                ax.plot(xs, [y / 2**30 for y in ys], drawstyle="steps-post", color=f"C{rank}",
                        label=f"rank {rank} {key}" if key == "measured" or rank == 0 else None, **style)
        ax.set_title(f"{label}: live buffer bytes over one step (dashed: simulated)")
        ax.set_xlabel("simulated time (ms)")
        ax.set_ylabel("GiB")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure(cfg: ModelConfig, *, smoke: bool, skip: set[str], commit: str | None, split: str | None = None) -> dict:
    """Every measurement, raw: what `render` turns into tables, checks and plots. split:
    None (pipeschedule's F/B engines), "also" (and the split-backward ones) or "only"
    (the split-backward ones alone)."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    steps = 1 if smoke else STEPS
    report = {"versions": versions(commit), "model": asdict(cfg), "pp": PP,
              "microbatch_size": MICROBATCH_SIZE, "dtype": str(dtype).replace("torch.", "")}
    print(f"model {cfg}, pp={PP}, {dtype}, {report['versions'].get('gpus', 'cpu')}", flush=True)
    if "calibration" not in skip:
        t = time.perf_counter()
        report["calibration_ms"] = run_calibration(cfg, device, dtype, repeats=3 if smoke else 20)
        if not smoke:  # the multi-GPU benchmark's model, for its predictions
            report["calibration_x4_ms"] = run_calibration(training.MODEL_X4, device, dtype, repeats=20)
            report["model_x4"] = asdict(training.MODEL_X4)
        print(f"[calibration] {time.perf_counter() - t:.1f} s: {json.dumps(report['calibration_ms'])}", flush=True)
    if "overhead" not in skip:
        report["overhead"] = []
        for size in (1,) if smoke else OVERHEAD_MICROBATCH_SIZES:
            t = time.perf_counter()
            report["overhead"].append(o := run_overhead(
                cfg, device, dtype, pp=PP, m=8, steps=2 if smoke else OVERHEAD_STEPS, warmup=WARMUP,
                microbatch_size=size, split=model_split(cfg, PP)))
            print(f"[overhead] micro-batch size {size}, {time.perf_counter() - t:.1f} s: baseline "
                  f"{o['pure_compute_s'] * 1e3:.1f} ms, executor {o['executor_step_s'] * 1e3:.1f} ms, overhead "
                  f"{o['overhead_fraction']:+.2%}", flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if "memory" not in skip:
        t = time.perf_counter()
        schedules = {None: OURS, "also": OURS + SPLIT_BACKWARD, "only": SPLIT_BACKWARD}[split]
        case_list = cases(schedules, (4,) if smoke else MICROBATCHES)
        rows, report["skipped"] = training.run_cases(
            cfg, case_list, pp=PP, mode="shared", microbatch_size=MICROBATCH_SIZE, warmup=WARMUP, steps=steps,
            trace_labels=TRACE_LABELS, timeout=300 if smoke else 480)
        report["memory"] = [{k: v for k, v in row.items() if k != "predicted"} for row in rows]
        print(f"[memory] {time.perf_counter() - t:.1f} s; skipped: {report['skipped']}", flush=True)
    return report


def _weight_stash(cfg: ModelConfig, split: tuple[int, ...], dtype_bytes: int) -> list[int]:
    """Per stage, the bytes a stash keeps from B to W (`benchmarks.llama.memory.weight_stash`)."""
    from benchmarks.llama.probe import model_spec, training_setup
    from benchmarks.llama.memory import weight_stash

    setup = training_setup(cfg, microbatch_size=MICROBATCH_SIZE, dtype_bytes=dtype_bytes, optimizer="adamw")
    return [weight_stash(model_spec(cfg), setup, layers, last=s == len(split) - 1) for s, layers in enumerate(split)]


def render(report: dict, out_dir: Path | None) -> str:
    """Tables, checks, cost files and plots from `measure`'s report, with the memory
    model's current predictions (so a corrected model re-renders without a GPU)."""
    cfg = ModelConfig(**report["model"])
    dtype_bytes = 2 if report["dtype"] == "bfloat16" else 4
    device = "cuda" if "gpus" in report["versions"] else "cpu"
    rows = [{**row, "predicted": training.predicted(cfg, Case(**row["case"]), pp=PP, microbatch_size=MICROBATCH_SIZE,
                                                    dtype_bytes=dtype_bytes, device=device)}
            for row in report.get("memory", [])]
    checks: dict = {}
    lines = [f"# One-GPU benchmarks ({report['versions']['date']})", "",
             "Command: `python -m benchmarks.gpu` (re-render: `python -m benchmarks.gpu --render "
             "benchmarks/results/gpu.json`). Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
             "", f"Model: {report['model']}, micro-batch size {MICROBATCH_SIZE}, {report['dtype']}, pp={PP} "
             "(four processes on one GPU, gloo, host-staged boundaries), AdamW after each step.", ""]
    if report.get("measured_in"):  # parts measured in separate calls (the device's 10-minute limit per call)
        lines += ["Measured in separate calls at the same commit, merged into gpu.json:", ""]
        lines += [f"- {call}" for call in report["measured_in"]] + [""]
    if rows:
        table, checks["model_within_5pct"] = training.memory_table(rows)
        misses = checks["model_within_5pct"]["misses"]
        checks["cap_fall"] = training.cap_checks(rows)
        lines += ["## Per-stage peak memory of one training step", ""] + table + [""]
        lines += [f"- not run: {s['case']['label']} m={s['case']['microbatches']}: {s['why']}"
                  for s in report.get("skipped", [])]
        lines += [f"- off by {miss['error']:+.1%}: {miss['case']} m={miss['m']} rank {miss['rank']}; largest gap: "
                  f"{miss['term']}" for miss in misses]
        lines += ["", "Stage 0's fall under capped_1f1b against 1f1b (measured / predicted):", ""]
        lines += [f"- {c['case']} m={c['m']}: {gib(c['measured_fall'])} / {gib(c['predicted_fall'])} GiB = "
                  f"{c['share']:.0%} ({'ok' if c['ok'] else 'BELOW 90%'})" for c in checks["cap_fall"]]
        lines.append("")
    if "overhead" in report:
        results = report["overhead"] if isinstance(report["overhead"], list) else [report["overhead"]]
        checks["overhead_below_1pct"] = {"ok": all(o["overhead_fraction"] < OVERHEAD_TARGET for o in results),
                                         "fraction": {o.get("microbatch_size", 1): o["overhead_fraction"]
                                                      for o in results}}
        lines += overhead_lines(results)
    calibration = report.get("calibration_ms")
    if calibration is not None:
        lines += ["## Calibration (ms per block, median of 20)", "",
                  "| block | forward | backward | input-only backward | weight |", "|---|---|---|---|---|"]
        lines += [f"| {name} | {t['forward']:.3f} | {t['backward']:.3f} | {t['backward_input']:.3f} "
                  f"| {t['weight']:.3f} |"
                  for name, t in calibration.items()]
        lines.append("")
    if calibration is not None and rows:
        costs, split_costs = {}, {}
        for v in sorted({row["case"]["virtual"] for row in rows}):
            row = next(r for r in rows if r["case"]["virtual"] == v)
            merged: dict[str, dict] = {}
            for rank in row["ranks"]:
                for kind, per_stage in rank.get("buffer_bytes_mb0", {}).items():
                    merged.setdefault(kind, {}).update(per_stage)
            split = model_split(cfg, PP * v)
            costs[v] = stage_costs(calibration, split, merged, split_backward=False)
            split_costs[v] = stage_costs(calibration, split, merged, split_backward=True,
                                         weight_stash=_weight_stash(cfg, split, dtype_bytes))
        sims = simulate_cases(cfg, costs, [Case(**r["case"]) for r in rows], pp=PP, microbatch_size=MICROBATCH_SIZE)
        lines += [f"## Simulated pp={PP} on {PP} such GPUs (calibrated costs; p2p latency {P2P_LATENCY_MS} ms and "
                  f"{P2P_GBPS:g} GB/s assumed)", "", "| schedule | m | step ms | bubble | tokens/s/GPU |",
                  "|---|---|---|---|---|"]
        lines += [f"| {s['case']['label']} | {s['case']['microbatches']} | {s['step_ms']:.1f} | {s['bubble']:.3f} | "
                  f"{s['tokens_per_s_per_gpu']:.0f} |" for s in sims]
        lines.append("")
        curves = release_curves(rows, costs, TRACE_LABELS)
        if out_dir is not None:
            for v in costs:
                (out_dir / f"gpu_cost_v{v}.json").write_text(json.dumps(costs[v], indent=1) + "\n")
                (out_dir / f"gpu_cost_v{v}_split.json").write_text(json.dumps(split_costs[v], indent=1) + "\n")
            if curves:
                plot_release(curves, out_dir / "gpu_release.png")
    lines += ["## Checks", ""]
    lines += [f"- {name}: {training.check_status(value)}" for name, value in checks.items()]
    text = "\n".join(lines) + "\n"
    if out_dir is not None:
        (out_dir / "gpu.md").write_text(text)
        if rows:
            plot_memory(rows, out_dir / "gpu_memory.png")
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model, one step per case, CPU allowed; writes nothing unless --out is given")
    parser.add_argument("--out", type=Path, default=None, help="folder for the results (default benchmarks/results/)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: memory,overhead,calibration")
    parser.add_argument("--commit", default=None, help="the commit measured (recorded in the results)")
    parser.add_argument("--split-backward", nargs="?", const="also", choices=("also", "only"), default=None,
                        help="also (or only: --split-backward only) run zb_h1, zbv, v_half and v_min (split backward; "
                        "V-shape placements)")
    parser.add_argument("--render", type=Path, default=None, metavar="GPU_JSON",
                        help="measure nothing: re-render the tables and plots of a saved gpu.json")
    args = parser.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - {"memory", "overhead", "calibration"}
    if unknown:
        parser.error(f"--skip {args.skip!r}: unknown parts {sorted(unknown)}; accepted: memory, overhead, calibration")
    if args.split_backward == "only" and args.out is None and args.render is None and not args.smoke:
        parser.error("--split-backward only measures part of the report: give --out DIR (benchmarks/results/gpu.json "
                     "holds the full run; the split-only one is kept as gpu_split.*)")
    out_dir = args.out if args.out is not None else (None if args.smoke else RESULTS)
    if args.render is not None:
        try:
            report = json.loads(args.render.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            print(f"benchmarks.gpu: cannot read {args.render}: {err}", file=sys.stderr)
            return 2
    else:
        if not args.smoke and not torch.cuda.is_available():
            print("benchmarks.gpu: no CUDA GPU here; --smoke runs the plumbing on CPU", file=sys.stderr)
            return 2
        report = measure(ModelConfig(**(SMOKE_MODEL if args.smoke else MODEL)), smoke=args.smoke, skip=skip,
                         commit=args.commit, split=args.split_backward)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)  # (render writes the tables, plots and cost files there)
    if out_dir is not None and args.render is None:
        write_results("gpu", report, out=out_dir)
    print(render(report, out_dir), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
