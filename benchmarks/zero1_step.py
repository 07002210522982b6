"""One ZeRO-1 step's peak on a GPU against the planner's optimizer-step term (issue 41, item 6).

    python -m benchmarks.zero1_step          # one CUDA GPU: pp=2 x dp=2 as four ranks on it (about two minutes)
    python -m benchmarks.zero1_step --smoke  # CPU, a tiny model: checks the plumbing, writes nothing

The memory model says that under ZeRO-1 a rank's peak is set after the pipeline, in the
optimizer step: the static terms (bf16 weights, the fp32 gradient accumulator, the rank's
shard of fp32 master weights and Adam moments) plus `optimizer_step_transient`
(pipeschedule/plan/memory.py, [Note: the optimizer step's transient]): the larger of torch's
single-tensor Adam's temporaries and `all_gather_coalesced`'s flattened shard and gathered
output (nanotron/optim/zero.py `_all_gather_params`), with gloo's device copy of the gathered
output (`dp_backend="gloo"`: the ranks here share a GPU over gloo). Nothing had measured it.
This runs the users' launch (nanotron's `DistributedTrainer` from a YAML; bf16, fp32
gradient accumulation, AdamW unfused, clip 1.0) on a parameter-heavy Llama (hidden 4096, ffn
14336, a sequence of 32 tokens: activations are small, so the optimizer step sets the peak)
at pp=2 and dp=2, ZeRO-1 and, for contrast, ZeRO-0; the four ranks share the one GPU over
gloo with host-staged boundaries ([Note: nanotron over gloo]), so the dp collectives are
gloo's on CUDA tensors, staged through the host (no GPU memory of their own but the
gathered copy above, where NCCL would hold buffers: the planner's `reserve`).

Per rank: the allocator's peak over the whole step (`peak_allocated`, the largest over the
measured steps), its peak up to the end of the pipeline (`peak_allocated_pipeline`), and the
planner's total for that rank (`evaluate_engine`, nanotron's `1f1b`, the split nanotron made)
with its optimizer-step term. The goal: the planner's total within 3% of the measured peak.

Writes benchmarks/results/zero1_step.json and .md; prints the table last.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.common import RESULTS, SMOKE_TRAINER, versions, write_results
from benchmarks.plan_calibration import split_of
from benchmarks.trainer import launch
from integration.nanotron.example import TrainerConfig
from pipeschedule.plan import PlanConfig
from pipeschedule.plan.evaluation import Evaluator, evaluate_engine
from pipeschedule.plan.memory import OPTIMIZER_STEP, GiB, ModelSpec, TrainingSetup

PP, DP, MICROBATCHES, STEPS, WARMUP, ENGINE = 2, 2, 4, 3, 1, "1f1b"
PARAM_HEAVY = dict(hidden=4096, heads=32, kv_heads=8, ffn=14336, layers=4, vocab=32000, seq=32, micro_batch_size=1)
GOAL = 0.03  # the planner's total within 3% of the measured peak


def config_for(zero_stage: int, sizes: dict, steps: int) -> TrainerConfig:
    return TrainerConfig(engine=ENGINE, pp=PP, dp=DP, zero_stage=zero_stage, microbatches=MICROBATCHES, steps=steps,
                         dtype="bfloat16", fp32_accumulation=True, **sizes)


def measure(zero_stage: int, sizes: dict, steps: int, work: Path) -> list[dict]:
    """Per rank (world order): pp and dp rank, the whole step's and the pipeline's peaks
    (largest over the measured steps), the bytes allocated at a step's start, the losses."""
    records = launch(config_for(zero_stage, sizes, steps), work, f"zero{zero_stage}", timeout=600)
    out = []
    for record in records:
        measured = record["steps"][WARMUP:] or record["steps"]
        out.append({
            "pp_rank": record["pp_rank"], "dp_rank": record["dp_rank"], "block_ranks": record["block_ranks"],
            "peak_allocated": max(s["peak_allocated"] or 0 for s in measured),
            "peak_allocated_pipeline": max(s["peak_allocated_pipeline"] or 0 for s in measured),
            "allocated_at_start": max(s["allocated_at_start"] or 0 for s in measured),
            "peak_reserved": max(s["peak_reserved"] or 0 for s in measured),
            "losses": [s["loss"] for s in record["steps"]],
        })
    return out


def predict(zero_stage: int, sizes: dict, split: list[int]) -> list[dict]:
    """Per pipeline rank: the planner's total, its optimizer-step term and its static terms."""
    model = ModelSpec("param-heavy", layers=sizes["layers"], hidden=sizes["hidden"], heads=sizes["heads"],
                      kv_heads=sizes["kv_heads"], ffn=sizes["ffn"], vocab=sizes["vocab"])
    setup = TrainingSetup(tp=1, dp=DP, zero_stage=zero_stage, seq=sizes["seq"], micro_batch=sizes["micro_batch_size"],
                          sequence_parallel=False, attention="sdpa-standin", adam_fused=False, dp_backend="gloo")
    planner = Evaluator(PlanConfig(model, replace(setup), pp=PP, microbatches=MICROBATCHES, gpu_memory=139 * GiB))
    cand = evaluate_engine(planner, ENGINE, "1f1b", None, 1, split)
    return [{"total": m.total, "optimizer_step": m.terms.get(OPTIMIZER_STEP, 0.0),
             "pipeline": m.total - m.terms.get(OPTIMIZER_STEP, 0.0), "terms": dict(m.terms)} for m in cand.memory]


def run_all(sizes: dict, steps: int, stages: tuple[int, ...]) -> dict:
    work = Path(tempfile.mkdtemp(prefix="pipeschedule-zero1-"))
    out = {}
    for zero_stage in stages:
        ranks = measure(zero_stage, sizes, steps, work)
        split = split_of(ranks[0]["block_ranks"], PP)
        out[f"zero{zero_stage}"] = {"split": split, "ranks": ranks, "predicted": predict(zero_stage, sizes, split)}
        print(f"ZeRO-{zero_stage}: peaks " + " / ".join(f"{r['peak_allocated'] / GiB:.3f}" for r in ranks) + " GiB",
              flush=True)
    return out


def rows(runs: dict) -> list[dict]:
    """One row per (ZeRO stage, rank): measured against predicted."""
    out = []
    for name, run in runs.items():
        for rank in run["ranks"]:
            pred = run["predicted"][rank["pp_rank"]]
            measured = rank["peak_allocated"]
            out.append({"zero": name, "pp_rank": rank["pp_rank"], "dp_rank": rank["dp_rank"],
                        "measured": measured, "measured_pipeline": rank["peak_allocated_pipeline"],
                        "predicted": pred["total"], "predicted_pipeline": pred["pipeline"],
                        "optimizer_term": pred["optimizer_step"], "reserved": rank["peak_reserved"],
                        "error": pred["total"] / measured - 1 if measured else None})
    return out


def render(report: dict) -> str:
    m = report["model"]
    stages = sorted({r["zero"].removeprefix("zero") for r in report["rows"]}) or ["1"]
    lines = [f"# One ZeRO-{'/'.join(stages)} step's peak against the planner ({report['versions']['date']})", "",
             "`python -m benchmarks.zero1_step`: nanotron's trainer from a YAML, its Llama at hidden "
             f"{m['hidden']}, ffn {m['ffn']}, {m['layers']} layers, vocab {m['vocab']}, seq {m['seq']}, micro-batch 1, "
             f"m={MICROBATCHES}, bf16, fp32 gradient accumulation, AdamW (unfused), clip 1.0; pp={PP} x dp={DP} as "
             f"four ranks on one GPU (gloo, host-staged); engine nanotron's `{ENGINE}`; {report['steps']} steps, the "
             f"first {WARMUP} not measured. Measured: the allocator's peak over the whole step and up to the end of "
             "the pipeline. Predicted: the planner's total for the rank (`evaluate_engine`) and, within it, the term "
             "'optimizer step (transient, above the pipeline)'.", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), "",
             "| ZeRO | pp rank | dp rank | measured step peak (GiB) | predicted total | error | measured pipeline peak "
             "| predicted pipeline | optimizer-step term (GiB) | measured step - pipeline | peak reserved (GiB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        lines.append(f"| {row['zero']} | {row['pp_rank']} | {row['dp_rank']} | {row['measured'] / GiB:.3f} "
                     f"| {row['predicted'] / GiB:.3f} | {100 * row['error']:+.1f}% "
                     f"| {row['measured_pipeline'] / GiB:.3f} | {row['predicted_pipeline'] / GiB:.3f} "
                     f"| {row['optimizer_term'] / GiB:.3f} "
                     f"| {(row['measured'] - row['measured_pipeline']) / GiB:.3f} | {row['reserved'] / GiB:.3f} |")
    worst = max((abs(r["error"]) for r in report["rows"] if r["zero"] == "zero1"), default=None)
    if worst is not None:
        verdict = "met" if worst <= GOAL else "missed"
        lines += ["", f"ZeRO-1: the planner's totals within {100 * worst:.1f}% of the measured peaks "
                      f"(goal {100 * GOAL:.0f}%: {verdict})."]
    losses = {name: next(r["losses"] for r in run["ranks"] if r["losses"][0] is not None)
              for name, run in report["runs"].items()}
    lines += ["", "Losses (a rank of the last stage): " + "; ".join(
        f"{name} " + ", ".join(f"{x:.4f}" for x in values) for name, values in losses.items())]
    return "\n".join(lines) + "\n"


def _stages(text: str) -> list[int]:
    stages = [s.strip() for s in text.split(",")]
    if not stages or any(s not in ("0", "1") for s in stages):
        raise argparse.ArgumentTypeError(f"--zero takes 0 and 1, comma-separated; got {text!r}")
    return [int(s) for s in stages]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.zero1_step", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU; writes nothing")
    parser.add_argument("--commit", help="commit to record (the device machine's tree may lack git history)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where zero1_step.json and .md go")
    parser.add_argument("--zero", type=_stages, default=[1],
                        help="ZeRO stages to run, comma-separated from 0 and 1 (default 1)")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("benchmarks.zero1_step: no CUDA GPU here; use --smoke on a CPU", file=sys.stderr)
        return 2
    sizes = {**SMOKE_TRAINER, "ffn": 64, "layers": 4} if args.smoke else PARAM_HEAVY
    steps = WARMUP + 1 if args.smoke else STEPS
    runs = run_all(sizes, steps, (1,) if args.smoke else tuple(args.zero))
    report = {"versions": versions(args.commit), "model": sizes, "pp": PP, "dp": DP, "microbatches": MICROBATCHES,
              "steps": steps, "runs": runs, "rows": rows(runs) if not args.smoke else []}
    if args.smoke:
        pred = runs["zero1"]["predicted"]
        print(f"smoke: ZeRO-1 ran on {len(runs['zero1']['ranks'])} ranks; predicted totals (MiB) "
              + "/".join(f"{p['total'] / 2**20:.2f}" for p in pred) + ", optimizer-step terms (MiB) "
              + "/".join(f"{p['optimizer_step'] / 2**20:.2f}" for p in pred))
        return 0
    text = render(report)
    write_results("zero1_step", report, text, out=args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
