"""Does stage 0's memory grow with the number of microbatches? (issue 17, the users' m = 128 pattern)

    python -m benchmarks.diagnostics.growth            # one CUDA GPU: dp=2 x pp=2 as four ranks on it
    python -m benchmarks.diagnostics.growth --smoke    # CPU, a tiny model: the plumbing; writes nothing

The users' report: with ZeRO-1 and fp32 gradient accumulation, 128 microbatches per step
ran out of memory at dp = 2 and 4 but not at dp = 8; a correct 1F1B keeps stage 0's
activations at pp microbatches whatever m, so that pattern needs memory that grows with
m (about 0.3-0.4 GiB per microbatch at their size). This runs nanotron's own trainer
(`integration.nanotron.train`, nanotron's `LlamaForTraining`, bf16, ZeRO-1, fp32
accumulation, AdamW) at dp=2 x pp=2, m = 16 and 128, with nanotron's 1F1B and with
pipeschedule's `ps_1f1b` and `capped_1f1b:cap=1`, and records every rank's peak allocated
and reserved memory of each step (reset before each step). Growth is the rise of a
rank's peak from m=16 to m=128, in total and per extra microbatch.

Writes benchmarks/results/growth.json and growth.md; prints the table last.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.trainer import WARMUP, launch
from benchmarks.common import MICROBATCH_SIZE, MODEL, RESULTS, SMOKE_TRAINER, versions, write_results
from integration.nanotron.example import TrainerConfig

ENGINES = ("1f1b", "ps_1f1b", "capped_1f1b:cap=1")
COUNTS = (16, 128)
STEPS = 3


def measure(*, smoke: bool, commit: str | None, engines=ENGINES, seq: int | None = None, counts=COUNTS,
            steps: int = STEPS) -> dict:
    work = Path(tempfile.mkdtemp(prefix="pipeschedule-growth-"))
    sizes = dict(SMOKE_TRAINER) if smoke else dict(MODEL, micro_batch_size=MICROBATCH_SIZE)
    if seq is not None:
        sizes["seq"] = seq
    rows = []
    for m in (4, 16) if smoke else counts:
        for engine in engines:
            config = TrainerConfig(engine=engine, pp=2, dp=2, microbatches=m, steps=steps, zero_stage=1,
                                   fp32_accumulation=True, dtype="bfloat16", **sizes)
            name = f"{engine.replace(':', '_').replace('=', '')}-{m}"
            records = launch(config, work, name, timeout=900)
            per_rank = []
            for record in sorted(records, key=lambda r: r["world_rank"]):
                measured = record["steps"][WARMUP:] or record["steps"]
                per_rank.append({
                    "world_rank": record["world_rank"], "pp_rank": record["pp_rank"], "dp_rank": record["dp_rank"],
                    "peak_allocated": [s["peak_allocated"] for s in record["steps"]],
                    "peak_reserved": [s["peak_reserved"] for s in record["steps"]],
                    "peak_allocated_pipeline": [s.get("peak_allocated_pipeline") for s in record["steps"]],
                    "allocated_at_start": [s.get("allocated_at_start") for s in record["steps"]],
                    "seconds": [s["seconds"] for s in measured],
                    "ledger_stash": [s["ledger"]["stash_peak_bytes"] if s["ledger"] else None for s in record["steps"]],
                })
            rows.append({"engine": engine, "m": m, "ranks": per_rank})
            print(f"{engine} m={m}: peak allocated per rank (GiB) "
                  + " / ".join(f"{max(x or 0 for x in r['peak_allocated']) / 2**30:.2f}" for r in per_rank), flush=True)
    return {"versions": versions(commit), "model": sizes, "pp": 2, "dp": 2, "zero_stage": 1, "steps": steps,
            "rows": rows}


def render(report: dict) -> str:
    gib = 2**30
    counts = sorted({row["m"] for row in report["rows"]})
    lines = [f"# Stage memory against the number of microbatches ({report['versions']['date']})", "",
             "`python -m benchmarks.diagnostics.growth`: nanotron's trainer on its `LlamaForTraining` (hidden "
             f"{report['model']['hidden']}, {report['model']['layers']} layers, seq {report['model']['seq']}, "
             f"micro-batch {report['model']['micro_batch_size']}, bf16), ZeRO-1 with fp32 gradient accumulation, "
             "dp=2 x pp=2 as four ranks on one GPU (gloo); peak memory of each rank's process over "
             f"{report['steps']} steps (reset before each step; the largest shown).", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), "",
             "| engine | rank (pp, dp) | " + " | ".join(f"peak allocated m={m}" for m in counts)
             + " | growth | per extra microbatch | " + " | ".join(f"peak reserved m={m}" for m in counts) + " |",
             "|---|---|" + "---|" * (2 * len(counts) + 2)]
    engines = list(dict.fromkeys(row["engine"] for row in report["rows"]))
    for engine in engines:
        by_m = {row["m"]: row for row in report["rows"] if row["engine"] == engine}
        for index, rank in enumerate(by_m[counts[0]]["ranks"]):
            allocated = [max(by_m[m]["ranks"][index]["peak_allocated"]) for m in counts]
            reserved = [max(by_m[m]["ranks"][index]["peak_reserved"]) for m in counts]
            growth = allocated[-1] - allocated[0]
            rise = (f"{growth / gib:+.2f} GiB | {growth / (counts[-1] - counts[0]) / 2**20:+.1f} MiB"
                    if len(counts) > 1 else "- | -")
            lines.append(f"| `{engine}` | {rank['world_rank']} ({rank['pp_rank']}, {rank['dp_rank']}) | "
                         + " | ".join(f"{a / gib:.2f} GiB" for a in allocated)
                         + f" | {rise} | "
                         + " | ".join(f"{r / gib:.2f} GiB" for r in reserved) + " |")
    lines += ["", "Where each step's peak falls: the peak of its pipeline part (up to the end of "
              "`train_batch_iter`) and of the whole step (the gradient sync, clipping and the optimizer step "
              "after it), and what is allocated when the step starts; per step, m = "
              f"{counts[-1]}, GiB.", "",
              "| engine | rank (pp, dp) | step | allocated at start | pipeline peak | step peak | peak in |",
              "|---|---|---|---|---|---|---|"]
    for engine in engines:
        row = next(r for r in report["rows"] if r["engine"] == engine and r["m"] == counts[-1])
        for rank in row["ranks"]:
            for step, (start, pipe, whole) in enumerate(zip(rank.get("allocated_at_start", []),
                                                            rank.get("peak_allocated_pipeline", []),
                                                            rank["peak_allocated"]), 1):
                if None in (start, pipe, whole):
                    continue
                where = "pipeline" if pipe >= whole else "sync + optimizer"
                lines.append(f"| `{engine}` | {rank['world_rank']} ({rank['pp_rank']}, {rank['dp_rank']}) | {step} | "
                             f"{start / gib:.2f} | {pipe / gib:.2f} | {whole / gib:.2f} | {where} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.diagnostics.growth",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU; writes nothing")
    parser.add_argument("--commit", help="commit to record")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated (default {','.join(ENGINES)})")
    parser.add_argument("--seq", type=int, help=f"sequence length (default {MODEL['seq']})")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"training steps per run (default {STEPS})")
    parser.add_argument("--stem", default="growth", help="results file name, without suffix (default growth)")
    parser.add_argument("--counts", default=",".join(map(str, COUNTS)),
                        help=f"microbatch counts, comma-separated (default {','.join(map(str, COUNTS))})")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("benchmarks.diagnostics.growth: no CUDA GPU here; use --smoke on a CPU", file=sys.stderr)
        return 2
    report = measure(smoke=args.smoke, commit=args.commit, engines=tuple(args.engines.split(",")), seq=args.seq,
                     counts=tuple(int(m) for m in args.counts.split(",")), steps=args.steps)
    text = render(report) if not args.smoke else json.dumps(
        [{"engine": r["engine"], "m": r["m"], "ledger": [x["ledger_stash"] for x in r["ranks"]]}
         for r in report["rows"]])
    if not args.smoke:
        write_results(args.stem, report, text, out=args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
