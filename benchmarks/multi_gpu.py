"""Single-node multi-GPU benchmark: pipeschedule's engines against nanotron's own.

    python -m benchmarks.multi_gpu              # four GPUs, one process each, NCCL
    python -m benchmarks.multi_gpu --dry-run    # tiny model, four gloo processes on CPU: the plumbing

One process per GPU, NCCL between them (NVLink multicast off: NCCL_NVLS_ENABLE=0 and
its siblings are set for the children if unset). The model is `training.MODEL_X4`
(about 3.6B parameters, bf16, sequence 4096), pp=4, nanotron's cost-balanced split.
Engines: nanotron's own `1f1b` and `afab`, and pipeschedule's `ps_1f1b`, `capped_1f1b`
at caps 1 to 3, `interleaved_1f1b` (v=2) and capped interleaved, at 8 and 32
microbatches (`training.run_cases`: a case the memory model says cannot fit a GPU is
reported, not run).

Per case: tokens/s/GPU (median step after one warm-up step), each stage's peak allocated
and reserved memory, and beside them the memory model's prediction and the simulator's
step time from the one-GPU calibration (`calibration_x4_ms` in
benchmarks/results/gpu.json, written by `python -m benchmarks.gpu`; the p2p link's
latency and bandwidth there are assumptions). Results go to `--out` (default
benchmarks/results/): multi_gpu.json, multi_gpu.md, multi_gpu.png.

Checks printed last: our 1f1b at least as fast as nanotron's (ratio >= 0.98 counts as
"within noise"); stage-0 memory under capped_1f1b falls as predicted; interleaving's
bubble reduction (measured step time against 1f1b's); simulated step time within 5%.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks import training
from benchmarks.common import PP, RESULTS, versions, write_results
from benchmarks.calibration import simulate_cases
from benchmarks.costs import stage_costs
from benchmarks.training import NANOTRON, OURS, Case, cases, gib, model_split

MICROBATCHES = (8, 32)
DRY_RUN_MODEL = training.ModelConfig(hidden=64, layers=8, heads=4, kv_heads=2, ffn=128, vocab=256, seq=32)
SPEED_NOISE = 0.98  # our 1f1b / nanotron's 1f1b at least this counts as "no slower"
SIM_TOLERANCE = 0.05
NCCL_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def predictions(cfg, calibration: dict, case_list: list[Case]) -> dict[Case, dict]:
    """Simulated step time per case from the one-GPU calibration; boundary tensors of
    s*b*h bf16 values (the hidden states) for the link's transfer time."""
    boundary = cfg.seq * cfg.hidden * 2
    costs = {}
    for v in sorted({c.virtual for c in case_list}):
        stages = PP * v
        buffers = {kind: dict.fromkeys(range(stages), boundary) for kind in ("act_out", "grad_in")}
        costs[v] = stage_costs(calibration, model_split(cfg, stages), buffers, split_backward=False)
    sims = simulate_cases(cfg, costs, case_list, pp=PP)
    return {case: sim for case, sim in zip(case_list, sims)}


def tokens_per_s_per_gpu(cfg, row: dict) -> float:
    seconds = max(rank["seconds"] for rank in row["ranks"])
    return row["case"]["microbatches"] * cfg.seq / seconds / PP


def report(cfg, rows: list[dict], skipped: list[dict], sims: dict, meta: dict) -> tuple[str, dict]:
    lines = [f"# Multi-GPU benchmark ({meta['versions']['date']})", "",
             "Command: `python -m benchmarks.multi_gpu`. Versions: "
             + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()), "",
             f"Model: {asdict(cfg)}, pp={PP}, one process per GPU, {meta['transport']}, AdamW, "
             "nanotron's cost-balanced split.", "",
             "| engine | m | tokens/s/GPU | simulated | sim error | stage peak allocated GiB (predicted) | "
             "stage peak reserved GiB |", "|---|---|---|---|---|---|---|"]
    speed = {}
    for row in rows:
        case = Case(**row["case"])
        tps = tokens_per_s_per_gpu(cfg, row)
        speed[(case.label, case.microbatches)] = tps
        sim = sims.get(case)
        sim_tps = sim["tokens_per_s_per_gpu"] if sim else None
        error = None if sim_tps is None else (tps - sim_tps) / sim_tps
        peaks = " / ".join(f"{gib(r['peak_allocated'])} ({gib(training.predicted_total(p))})"
                           for r, p in zip(row["ranks"], row["predicted"]))
        reserved = " / ".join(gib(r["peak_reserved"]) for r in row["ranks"])
        lines.append(f"| {case.label} | {case.microbatches} | {tps:.0f} | "
                     f"{'-' if sim_tps is None else f'{sim_tps:.0f}'} | {'-' if error is None else f'{error:+.1%}'} | "
                     f"{peaks} | {reserved} |")
    lines += [f"- not run: {s['case']['label']} m={s['case']['microbatches']}: {s['why']}" for s in skipped]
    checks: dict = {}
    for m in MICROBATCHES:
        ours, theirs = speed.get(("1f1b", m)), speed.get(("nanotron 1f1b", m))
        if ours and theirs:
            checks[f"1f1b_vs_nanotron_m{m}"] = {"ratio": ours / theirs, "ok": ours / theirs >= SPEED_NOISE}
        plain, inter = speed.get(("1f1b", m)), speed.get(("interleaved v=2", m))
        if plain and inter:
            checks[f"interleaving_gain_m{m}"] = {"ratio": inter / plain, "ok": inter > plain}
    checks["cap_fall"] = training.cap_checks(rows)
    sim_errors = []
    for row in rows:
        sim = sims.get(Case(**row["case"]))
        if sim is not None:
            sim_errors.append(abs(tokens_per_s_per_gpu(cfg, row) - sim["tokens_per_s_per_gpu"])
                              / sim["tokens_per_s_per_gpu"])
    if sim_errors:
        checks["simulator_within_5pct"] = {"worst": max(sim_errors), "ok": max(sim_errors) <= SIM_TOLERANCE}
    table, checks["memory_model_within_5pct"] = training.memory_table(rows)
    lines += ["", "## Per-stage memory", ""] + table + ["", "## Checks", ""]
    for name, value in checks.items():
        detail = "" if isinstance(value, list) else ", ".join(f"{k} {v:.3f}" for k, v in value.items()
                                                                if isinstance(v, float))
        lines.append(f"- {name}: {training.check_status(value)} {detail}".rstrip())
    return "\n".join(lines) + "\n", checks


def plot(cfg, rows: list[dict], sims: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 8))
    labels = [f"{r['case']['label']}\nm={r['case']['microbatches']}" for r in rows]
    xs = range(len(rows))
    top.bar(xs, [tokens_per_s_per_gpu(cfg, r) for r in rows], color="C0", label="measured")
    top.scatter(xs, [(sims.get(Case(**r["case"])) or {}).get("tokens_per_s_per_gpu", float("nan")) for r in rows],
                marker="_", s=300, color="black", label="simulated", zorder=3)
    top.set_ylabel("tokens/s/GPU")
    top.set_xticks(list(xs), labels, fontsize=7)
    top.legend()
    width = 0.8 / PP
    for rank in range(PP):
        bottom.bar([x + rank * width for x in xs], [(r["ranks"][rank]["peak_allocated"] or 0) / 2**30 for r in rows],
                   width * 0.9, color=f"C{rank}", label=f"stage {rank}")
    bottom.set_ylabel("peak allocated GiB")
    bottom.set_xticks([x + 0.4 - width / 2 for x in xs], labels, fontsize=7)
    bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_predictions(calibration_path: Path, out_dir: Path) -> int:
    """The simulator's step time and bubble per case for MODEL_X4 on four GPUs, from the
    one-GPU calibration: what a run on four GPUs should show (and is checked against)."""
    try:
        saved = json.loads(calibration_path.read_text(encoding="utf-8"))
        calibration = saved["calibration_x4_ms"]
    except (OSError, ValueError, KeyError) as err:
        print(f"benchmarks.multi_gpu: no calibration for the x4 model in {calibration_path} ({err})", file=sys.stderr)
        return 2
    cfg = training.MODEL_X4
    sims = predictions(cfg, calibration, cases(NANOTRON + OURS, MICROBATCHES))
    lines = ["# Predictions for the multi-GPU benchmark (not a measurement)", "",
             f"`python -m benchmarks.multi_gpu --predict-only`: the simulator with block times measured on one H200 "
             f"({saved['versions']['date']}, commit {saved['versions'].get('commit')}) for {asdict(cfg)}, pp={PP}, "
             "nanotron's split, the p2p link assumed (0.02 ms, 100 GB/s). nanotron's own engines run the same "
             "schedules as ps_1f1b / ps_afab here; their blocking metadata exchanges are not modelled.", "",
             "| engine | m | step ms | bubble | tokens/s/GPU |", "|---|---|---|---|---|"]
    lines += [f"| {c.label} | {c.microbatches} | {s['step_ms']:.1f} | {s['bubble']:.3f} "
              f"| {s['tokens_per_s_per_gpu']:.0f} |"
              for c, s in sims.items()]
    text = "\n".join(lines) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "multi_gpu_predictions.md").write_text(text)
    print(text)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.multi_gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU (gloo); writes nothing unless --out")
    parser.add_argument("--out", type=Path, default=None, help="folder for the results (default benchmarks/results/)")
    parser.add_argument("--calibration", type=Path, default=RESULTS / "gpu.json",
                        help="benchmarks.gpu's results, for the simulator's predictions")
    parser.add_argument("--commit", default=None, help="the commit measured (recorded in the results)")
    parser.add_argument("--predict-only", action="store_true",
                        help="run nothing: write the simulator's predictions (multi_gpu_predictions.md) and stop")
    args = parser.parse_args(argv)
    if args.predict_only:
        return write_predictions(args.calibration, args.out if args.out is not None else RESULTS)
    if not args.dry_run and torch.cuda.device_count() < PP:
        print(f"benchmarks.multi_gpu: needs {PP} CUDA GPUs, found {torch.cuda.device_count()}; "
              "--dry-run runs the plumbing on CPU", file=sys.stderr)
        return 2
    for key, value in NCCL_SAFE_ENV.items():
        os.environ.setdefault(key, value)
    cfg = DRY_RUN_MODEL if args.dry_run else training.MODEL_X4
    out_dir = args.out if args.out is not None else (None if args.dry_run else RESULTS)
    case_list = cases(NANOTRON + OURS, (4,) if args.dry_run else MICROBATCHES)
    calibration = None
    try:
        saved = json.loads(args.calibration.read_text(encoding="utf-8"))
        if saved.get("model_x4") == asdict(cfg):
            calibration = saved["calibration_x4_ms"]
    except (OSError, ValueError, KeyError) as err:
        print(f"no calibration read from {args.calibration} ({err}); no simulated predictions", file=sys.stderr)
    sims = predictions(cfg, calibration, case_list) if calibration else {}
    multi = torch.cuda.is_available() and not args.dry_run
    rows, skipped = training.run_cases(
        cfg, case_list, pp=PP, mode="multi" if multi else "shared", warmup=1, steps=1 if args.dry_run else 4,
        timeout=300 if args.dry_run else 540, backend="nccl" if multi else "gloo")
    meta = {"versions": versions(args.commit), "transport": "NCCL" if multi else "gloo on CPU"}
    text, checks = report(cfg, rows, skipped, sims, meta)
    if out_dir is not None:
        payload = {**meta, "model": asdict(cfg), "pp": PP, "rows": rows, "skipped": skipped, "checks": checks,
                   "simulated": [{"case": asdict(c), **s} for c, s in sims.items()]}
        write_results("multi_gpu", payload, text, out=out_dir)
        if rows:
            plot(cfg, rows, sims, out_dir / "multi_gpu.png")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
