"""The bf16 gradients' transient on a GPU: nanotron's 1F1B against pipeschedule's engines in a
parameter-heavy configuration (issue 32).

    python -m benchmarks.grad_fold [--seq N]  # one CUDA GPU: pp=4 as four ranks on it (two minutes)
    python -m benchmarks.grad_fold --smoke    # CPU, a tiny model: checks the plumbing, writes nothing

nanotron's `FP32GradientAccumulator.backward` folds every bf16 gradient into fp32 after a
microbatch's whole backward, so at its end the stage holds all of them (2 bytes per
parameter); pipeschedule's engines fold each gradient as autograd produces it ([Note:
gradient folding] in integration/nanotron/pipeline/grad_sync.py). With parameters dominating (hidden
4096, ffn 14336, 12 layers, a sequence of 32 tokens by default, 4 microbatches) the stash is
small and the stage's peak is set by where the gradients live. Each run is the users' launch (nanotron's
`DistributedTrainer` from a YAML, bf16, fp32 gradient accumulation, AdamW), four ranks sharing
the one GPU over gloo with host-staged boundaries.

Per stage: the pipeline's peak allocated (`peak_allocated_pipeline`: up to the end of
`train_batch_iter`, before the optimizer step) of each engine; the fall from nanotron's
1F1B to each of ours, against (a) 2 bytes per parameter of the stage less the largest
parameter's gradient and (b) the memory model's term (pipeschedule/plan/memory.py: nanotron's
gradients at a backward's end, what they add above the activations' peak); and the memory
model's predicted pipeline peak against the measured one for every engine.

Writes benchmarks/results/grad_fold_seq{N}.json and .md; prints the tables last.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
import tempfile
from pathlib import Path

import torch

from benchmarks.common import RESULTS, SMOKE_TRAINER, versions, write_results
from benchmarks.plan_calibration import split_of
from benchmarks.trainer import launch
from integration.nanotron.example import TrainerConfig
from pipeschedule.plan import PlanConfig
from pipeschedule.plan.memory import (GRADS, OPTIMIZER_STEP, GiB, ModelSpec, TrainingSetup, largest_param,
                                      stage_params)
from pipeschedule.plan.evaluation import Evaluator, evaluate_engine

PP, MICROBATCHES, STEPS, WARMUP = 4, 4, 3, 1
PARAM_HEAVY = dict(hidden=4096, heads=32, kv_heads=8, ffn=14336, layers=12, vocab=32000, seq=32, micro_batch_size=1)
# engine -> (family, cap, virtual) as the planner names it
ENGINES = {"1f1b": ("1f1b", None, 1), "ps_1f1b": ("1f1b", None, 1), "capped_1f1b:cap=2": ("capped_1f1b", 2, 1),
           "ps_1f1b:recompute=full": ("1f1b", None, 1)}


def config_for(engine: str, sizes: dict, steps: int) -> TrainerConfig:
    return TrainerConfig(engine=engine, pp=PP, microbatches=MICROBATCHES, steps=steps, dtype="bfloat16",
                         fp32_accumulation=True, **sizes)


def measure(sizes: dict, steps: int, work: Path, engines) -> dict:
    """Per engine: per stage the largest pipeline peak over the measured steps, the block ranks, the losses."""
    out = {}
    for engine in engines:
        records = launch(config_for(engine, sizes, steps), work, engine.replace(":", "_").replace("=", ""),
                         timeout=600)
        peaks = [0] * PP
        for record in records:
            for step in record["steps"][WARMUP:]:
                peaks[record["pp_rank"]] = max(peaks[record["pp_rank"]], step["peak_allocated_pipeline"] or 0)
        loss_rank = next(r for r in records if r["steps"][0]["loss"] is not None)
        out[engine] = {"peak_allocated_pipeline": peaks, "block_ranks": records[0]["block_ranks"],
                       "losses": [s["loss"] for s in loss_rank["steps"]]}
        print(f"{engine}: pipeline peaks {' / '.join(f'{p / GiB:.3f}' for p in peaks)} GiB", flush=True)
    return out


def predict(sizes: dict, runs: dict) -> dict:
    """The memory model for each run: per stage the predicted pipeline peak (the optimizer
    step's excess left out), nanotron's gradient term, 2 P and the largest parameter."""
    model = ModelSpec("param-heavy", layers=sizes["layers"], hidden=sizes["hidden"], heads=sizes["heads"],
                      kv_heads=sizes["kv_heads"], ffn=sizes["ffn"], vocab=sizes["vocab"])
    setup = TrainingSetup(tp=1, seq=sizes["seq"], micro_batch=sizes["micro_batch_size"], sequence_parallel=False,
                          attention="sdpa-standin", adam_fused=False)
    out = {}
    for engine, run in runs.items():
        family, cap, virtual = ENGINES[engine]
        recompute = "full" if "recompute=full" in engine else "none"
        planner = Evaluator(PlanConfig(model, replace(setup, recompute=recompute), pp=PP, microbatches=MICROBATCHES,
                                      gpu_memory=139 * GiB))
        split = split_of(run["block_ranks"], PP)
        cand = evaluate_engine(planner, engine, family, cap, virtual, split)
        out[engine] = {
            "split": split,
            "pipeline_peak": [m.total - m.terms.get(OPTIMIZER_STEP, 0.0) for m in cand.memory],
            "grads_term": [m.terms.get(GRADS, 0.0) for m in cand.memory],
            "two_p": [2 * stage_params(model, n, first=s == 0, last=s == PP - 1, tp=1) for s, n in enumerate(split)],
            "largest": [2 * largest_param(model, 1, n, first=s == 0, last=s == PP - 1) for s, n in enumerate(split)],
        }
    return out


def render(report: dict) -> str:
    runs, pred = report["runs"], report["predicted"]
    ref = runs["1f1b"]["peak_allocated_pipeline"]
    date = report["versions"]["date"]
    lines = [f"# Where the bf16 gradients live: nanotron's 1F1B against pipeschedule's engines ({date})",
             "", "`python -m benchmarks.grad_fold`: nanotron's trainer from a YAML, its Llama at "
             f"hidden {report['model']['hidden']}, ffn {report['model']['ffn']}, {report['model']['layers']} layers, "
             f"vocab {report['model']['vocab']}, seq {report['model']['seq']}, micro-batch 1, m={MICROBATCHES}, bf16, "
             "fp32 gradient accumulation, AdamW; pp=4 as four ranks on one GPU (gloo, host-staged boundaries); "
             f"{report['steps']} steps, the first {WARMUP} not measured. Peak = the allocator's peak up to the end of "
             "`train_batch_iter` (the pipeline, before the gradient sync and the optimizer step).", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), "",
             "## The fall from nanotron's 1F1B, per stage (MiB)", "",
             "2P - largest: 2 bytes per parameter of the stage less the largest parameter's gradient (the fall where "
             "nothing else differs: `ps_1f1b`, nanotron's schedule and split); model: the memory model's predicted "
             "fall (nanotron's gradients above its activations' peak, and for the other engines their stash too).", "",
             "| pp_engine | stage | nanotron 1f1b peak | this engine's peak | fall | 2P - largest "
             "| fall / (2P - largest) | model's fall | fall / model |", "|---|---|---|---|---|---|---|---|---|"]
    mib = 2**20
    for engine, run in runs.items():
        if engine == "1f1b":
            continue
        for s, peak in enumerate(run["peak_allocated_pipeline"]):
            fall = ref[s] - peak
            formula = pred["1f1b"]["two_p"][s] - pred["1f1b"]["largest"][s]
            term = pred["1f1b"]["pipeline_peak"][s] - pred[engine]["pipeline_peak"][s]
            lines.append(f"| `{engine}` | {s} | {ref[s] / mib:.1f} | {peak / mib:.1f} | {fall / mib:.1f} "
                         f"| {formula / mib:.1f} | {fall / formula:.3f} | {term / mib:.1f} | "
                         f"{fall / term if term else float('nan'):.3f} |")
    lines += ["", "## The memory model's pipeline peak against the measured one (GiB)", "",
              "| pp_engine | split | predicted per stage | measured per stage | worst error |", "|---|---|---|---|---|"]
    for engine, run in runs.items():
        p, m = pred[engine]["pipeline_peak"], run["peak_allocated_pipeline"]
        worst = max((a / b - 1 for a, b in zip(p, m)), key=abs)
        lines.append(f"| `{engine}` | {'/'.join(map(str, pred[engine]['split']))} | "
                     + " / ".join(f"{x / GiB:.3f}" for x in p) + " | " + " / ".join(f"{x / GiB:.3f}" for x in m)
                     + f" | {100 * worst:+.1f}% |")
    lines += ["", "Losses of the first steps (the same weights and data; GPU kernels are not bitwise "
              "deterministic): " + "; ".join(f"`{e}` " + ", ".join(f"{x:.4f}" for x in r["losses"])
                                           for e, r in runs.items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grad_fold", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU; writes nothing")
    parser.add_argument("--commit", help="commit to record (the device machine's tree may lack git history)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where grad_fold_seq{N}.json and .md go")
    parser.add_argument("--seq", type=int, default=PARAM_HEAVY["seq"],
                        help=f"tokens per sequence (default {PARAM_HEAVY['seq']}; a multiple of 8, 8..4096)")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("benchmarks.grad_fold: no CUDA GPU here; use --smoke on a CPU", file=sys.stderr)
        return 2
    if not (8 <= args.seq <= 4096 and args.seq % 8 == 0):
        print(f"benchmarks.grad_fold: --seq must be a multiple of 8 in 8..4096, got {args.seq}", file=sys.stderr)
        return 2
    sizes = {**SMOKE_TRAINER, "ffn": 64, "layers": 8} if args.smoke else {**PARAM_HEAVY, "seq": args.seq}
    steps = WARMUP + 1 if args.smoke else STEPS
    engines = ("1f1b", "ps_1f1b") if args.smoke else tuple(ENGINES)  # the smoke run: the plumbing, two engines
    runs = measure(sizes, steps, Path(tempfile.mkdtemp(prefix="pipeschedule-grad-fold-")), engines)
    report = {"versions": versions(args.commit), "model": sizes, "pp": PP, "microbatches": MICROBATCHES,
              "steps": steps, "runs": runs, "predicted": predict(sizes, runs)}
    if args.smoke:
        print(f"smoke: {len(runs)} engines ran; predicted pipeline peaks (MiB) "
              + "; ".join(f"{e} " + "/".join(f"{x / 2**20:.2f}" for x in p["pipeline_peak"])
                          for e, p in report["predicted"].items()))
        return 0
    text = render(report)
    write_results(f"grad_fold_seq{args.seq}", report, text, out=args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
