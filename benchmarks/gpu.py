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
   (integration/nanotron/llama.py; `MODEL` below, bf16) at pp=4 as four processes on the
   one GPU: gloo between them, boundary tensors staged through pinned host memory
   (`HostStagedTransport`, which the engines pick when gloo runs on a CUDA machine). Each
   configuration (schedule x microbatches) runs `WARMUP` + `STEPS` training steps
   (nanotron engine `train_batch_iter`, then an AdamW step); before each step the peak
   statistics are reset, so `peak_allocated` / `peak_reserved` are the step's own peaks
   (`torch.cuda.max_memory_*` of the rank's process). Beside each: the memory model's
   prediction (`integration.nanotron.memory_probe.predict`) and the measured terms
   (parameters, optimizer state, gradients, the runtime ledger's peak of live buffers,
   and the rest: the transient working set), so a miss names its term.
2. Executor overhead. All four stages in ONE process on the GPU (`InProcessPipeline`,
   the same blocks as plain modules): step time through the executor against the pure
   compute of the same forward and backward calls in a plain loop; the difference is the
   runtime's overhead. Also the executor's own host time per instruction.
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
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks import training
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
    sync,
    to_device,
)
from integration.nanotron.llama import (
    DecoderLayer,
    FinalNorm,
    LMHead,
    Loss,
    ModelConfig,
    TokenEmbedding,
)

RESULTS = Path(__file__).parent / "results"
PP = 4
MODEL = ModelConfig(hidden=2048, layers=16, heads=16, kv_heads=8, ffn=5632, vocab=32000, seq=4096)
SMOKE_MODEL = ModelConfig(hidden=64, layers=8, heads=4, kv_heads=2, ffn=128, vocab=256, seq=32)
MICROBATCH_SIZE = 1
MICROBATCHES = (8, 32)
WARMUP, STEPS = 1, 3
OVERHEAD_TARGET = 0.01
TRACE_LABELS = ("1f1b", "capped c=2")


class LlamaStages:
    """`Stages` over llama.py's blocks as plain modules (no nanotron `PipelineBlock`):
    stage 0 embeds, the last stage ends with the final norm, the head and the loss; the
    boundary is the hidden states."""

    def __init__(self, cfg: ModelConfig, split: tuple[int, ...], device, dtype):
        self.cfg, self.split = cfg, split
        index = 1
        self.layers = []
        for count in split:
            self.layers.append(torch.nn.ModuleList(
                DecoderLayer(cfg, index + i).to(device=device, dtype=dtype) for i in range(count)))
            index += count
        self.embedding = TokenEmbedding(cfg, 0).to(device=device, dtype=dtype)
        self.norm = FinalNorm(cfg, index).to(device=device, dtype=dtype)
        self.head = LMHead(cfg, index + 1).to(device=device, dtype=dtype)
        self.loss = Loss(cfg, index + 2)

    def forward(self, stage: int, mb: int, act_in, target):
        x = self.embedding(act_in["input_ids"], None)["input_embeds"] if stage == 0 else act_in
        for layer in self.layers[stage]:
            x = layer(x, None)["hidden_states"]
        if stage < len(self.split) - 1:
            return x
        logits = self.head(self.norm(x)["hidden_states"])["logits"]
        return self.loss(logits, target["label_ids"], target["label_mask"])["loss"]

    def parameters(self, stage: int):
        modules = list(self.layers[stage])
        if stage == 0:
            modules.append(self.embedding)
        if stage == len(self.split) - 1:
            modules += [self.norm, self.head]
        return [p for module in modules for p in module.parameters()]


def run_overhead(cfg: ModelConfig, device, dtype, m: int, steps: int) -> dict:
    from integration.nanotron.harness import microbatch
    from pipeschedule import compile_schedule
    from pipeschedule.runtime import InProcessPipeline

    split = model_split(cfg, PP)
    stages = LlamaStages(cfg, split, device, dtype)
    batches = [to_device(microbatch(cfg, MICROBATCH_SIZE, i, 99), device) for i in range(m)]
    inputs = [{"input_ids": b["input_ids"]} for b in batches]
    targets = [{"label_ids": b["label_ids"], "label_mask": b["label_mask"]} for b in batches]
    params = [p for s in range(PP) for p in stages.parameters(s)]
    schedule = compile_schedule("1f1b", pp=PP, microbatches=m)
    pipeline = InProcessPipeline(schedule, stages, device=device)
    instructions = sum(len(p) for p in schedule.programs)

    def pure_step():
        for i in range(m):
            x = inputs[i]
            for s in range(PP):
                x = stages.forward(s, i, x, targets[i] if s == PP - 1 else None)
            (x / m).backward()

    def pipe_step():
        pipeline.step(inputs, targets)

    def timed(fn, *, collect: bool = True) -> tuple[list[float], list[float], int]:
        """Step times (synchronised), host times (until `fn` returns, before the final
        synchronise: if these approach the step time the host is the bottleneck) and the
        cudaMalloc calls made meanwhile (allocator churn)."""
        out, host = [], []
        mallocs = _segments(device)
        for step in range(WARMUP + steps):
            for p in params:
                p.grad = None
            sync(device)
            if not collect:
                gc.disable()
            start = time.perf_counter()
            fn()
            issued = time.perf_counter()
            sync(device)
            end = time.perf_counter()
            gc.enable()
            if step >= WARMUP:
                out.append(end - start)
                host.append(issued - start)
        return out, host, _segments(device) - mallocs

    runs: dict[str, dict[str, list]] = {k: {"step": [], "host": [], "mallocs": []} for k in ("pure", "executor",
                                                                                               "executor_no_gc")}
    for _ in range(3):  # alternate, so that drift (clocks, allocator state) hits every variant alike
        for key, fn, collect in (("pure", pure_step, True), ("executor", pipe_step, True),
                                 ("executor_no_gc", pipe_step, False)):
            step_s, host_s, mallocs = timed(fn, collect=collect)
            runs[key]["step"] += step_s
            runs[key]["host"] += host_s
            runs[key]["mallocs"].append(mallocs)
    executors = pipeline.executors
    host = {key: sum(getattr(e.times, key) for e in executors) for key in ("compute_s", "transport_s", "wait_s", "total_s")}
    pure_s, pipe_s = statistics.median(runs["pure"]["step"]), statistics.median(runs["executor"]["step"])
    return {
        "schedule": "1f1b", "pp": PP, "microbatches": m, "instructions": instructions,
        "pure_compute_s": pure_s, "executor_step_s": pipe_s, "runs": runs,
        "executor_no_gc_step_s": statistics.median(runs["executor_no_gc"]["step"]),
        "overhead_s": pipe_s - pure_s, "overhead_fraction": (pipe_s - pure_s) / pipe_s,
        "overhead_us_per_instruction": (pipe_s - pure_s) / instructions * 1e6,
        "executor_host_times_last_step": host,
    }


def _segments(device) -> int:
    """cudaMalloc calls so far (0 on CPU)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.memory_stats(device).get("segment.all.allocated", 0)


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
            for key, style in (("measured", {"linewidth": 3, "alpha": 0.45}), ("simulated", {"linestyle": "--", "linewidth": 1})):
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


def measure(cfg: ModelConfig, *, smoke: bool, skip: set[str], commit: str | None, with_split: bool = False) -> dict:
    """Every measurement, raw: what `render` turns into tables, checks and plots."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    steps = 1 if smoke else STEPS
    report = {"versions": training.versions(commit), "model": asdict(cfg), "pp": PP,
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
        t = time.perf_counter()
        report["overhead"] = o = run_overhead(cfg, device, dtype, m=8, steps=steps)
        print(f"[overhead] {time.perf_counter() - t:.1f} s: pure {o['pure_compute_s'] * 1e3:.1f} ms, executor "
              f"{o['executor_step_s'] * 1e3:.1f} ms, overhead {o['overhead_fraction']:+.2%}", flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "memory" not in skip:
        t = time.perf_counter()
        case_list = cases(OURS + (SPLIT_BACKWARD if with_split else ()), (4,) if smoke else MICROBATCHES)
        rows, report["skipped"] = training.run_cases(
            cfg, case_list, pp=PP, mode="shared", microbatch_size=MICROBATCH_SIZE, warmup=WARMUP, steps=steps,
            trace_labels=TRACE_LABELS, timeout=300 if smoke else 480)
        report["memory"] = [{k: v for k, v in row.items() if k != "predicted"} for row in rows]
        print(f"[memory] {time.perf_counter() - t:.1f} s; skipped: {report['skipped']}", flush=True)
    return report


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
        o = report["overhead"]
        checks["overhead_below_1pct"] = {"ok": o["overhead_fraction"] < OVERHEAD_TARGET,
                                         "fraction": o["overhead_fraction"]}
        lines += ["## Executor overhead (in-process, one GPU, 1f1b, m=8)", "",
                  "| pure compute ms | through the executor ms | overhead | per instruction us |", "|---|---|---|---|",
                  f"| {o['pure_compute_s'] * 1e3:.2f} | {o['executor_step_s'] * 1e3:.2f} | "
                  f"{o['overhead_fraction']:+.2%} | {o['overhead_us_per_instruction']:.1f} |", ""]
        if "runs" in o:
            lines += ["Per variant (all steps, ms; host: until the step call returned, before the final "
                      "synchronise; cudaMalloc calls per round):", ""]
            lines += [f"- {key}: steps {', '.join(f'{t * 1e3:.1f}' for t in run['step'])}; host "
                      f"{', '.join(f'{t * 1e3:.1f}' for t in run['host'])}; cudaMalloc {run['mallocs']}"
                      for key, run in o["runs"].items()]
            lines.append("")
    calibration = report.get("calibration_ms")
    if calibration is not None:
        lines += ["## Calibration (ms per block, median of 20)", "", "| block | forward | backward | input-only backward "
                  "| weight |", "|---|---|---|---|---|"]
        lines += [f"| {name} | {t['forward']:.3f} | {t['backward']:.3f} | {t['backward_input']:.3f} | {t['weight']:.3f} |"
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
            split_costs[v] = stage_costs(calibration, split, merged, split_backward=True)
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
    parser.add_argument("--split-backward", action="store_true",
                        help="also run zb_h1, zbv, v_half and v_min (split backward; V-shape placements)")
    parser.add_argument("--render", type=Path, default=None, metavar="GPU_JSON",
                        help="measure nothing: re-render the tables and plots of a saved gpu.json")
    args = parser.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - {"memory", "overhead", "calibration"}
    if unknown:
        parser.error(f"--skip {args.skip!r}: unknown parts {sorted(unknown)}; accepted: memory, overhead, calibration")
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
        report = measure(SMOKE_MODEL if args.smoke else MODEL, smoke=args.smoke, skip=skip, commit=args.commit,
                         with_split=args.split_backward)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        if args.render is None:
            (out_dir / "gpu.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(render(report, out_dir), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
