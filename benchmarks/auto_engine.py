"""`pp_engine: auto` on a GPU: what it chooses, what it predicted, what the chosen engine used (issue 17).

    python -m benchmarks.auto_engine                  # one CUDA GPU: pp=4 as four ranks on it
    python -m benchmarks.auto_engine --smoke          # CPU, a tiny model: the plumbing; writes nothing

Each run is the users' launch (`torchrun -m integration.nanotron.train --config-file
CONFIG --record DIR`) with `pp_engine: auto:reserve=R`: nanotron's trainer on its
`LlamaForTraining` (the benchmarks' model: hidden 2048, 16 layers, seq 4096, bf16, fp32
accumulation, AdamW), pp=4 as four ranks on one GPU. The budget of each rank is the GPU's
memory less R GiB ([Note: auto engine]); four ranks share the one GPU here, so each rank
is given the whole GPU less R, and R is set high to make the budget bind. The first step
runs capped 1F1B with cap 1 and measures; from the second step the chosen engine runs.
For each R: the choice, each rank's measured static and stash, the predicted peak, and
the measured peak allocated of the steps run by the chosen engine (after the first).

Writes benchmarks/results/auto_engine.json and .md; prints the table last.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import MICROBATCH_SIZE, MODEL, PP, RESULTS, SMOKE_TRAINER, versions, write_results
from benchmarks.trainer import launch
from integration.nanotron.example import TrainerConfig

RESERVES = (2, 130)  # GiB: 1F1B fits; a budget of about 10 GiB per rank, where 1F1B's stage 0 (13.5 GiB) does not
MICROBATCHES, STEPS = 8, 4
GiB = 2**30


def measure(*, smoke: bool, commit: str | None, reserves=RESERVES) -> dict:
    work = Path(tempfile.mkdtemp(prefix="pipeschedule-auto-"))
    sizes = dict(SMOKE_TRAINER) if smoke else dict(MODEL, micro_batch_size=MICROBATCH_SIZE)
    runs = []
    for reserve in reserves:
        config = TrainerConfig(engine=f"auto:reserve={reserve}", pp=PP, microbatches=MICROBATCHES, steps=STEPS,
                               dtype="bfloat16", fp32_accumulation=True, **sizes)
        records = sorted(launch(config, work, f"auto-{reserve}", timeout=900), key=lambda r: r["pp_rank"])
        auto = records[0]["auto"]
        ranks = []
        for record in records:
            later = record["steps"][1:]
            ranks.append({
                "pp_rank": record["pp_rank"], "engine": record["engine"],
                "first_step_peak": record["steps"][0]["peak_allocated"],
                "chosen_peak": max((s["peak_allocated"] or 0 for s in later), default=None),
                "chosen_seconds": [s["seconds"] for s in later],
            })
        runs.append({"reserve_gib": reserve, "auto": auto, "ranks": ranks,
                     "losses": [s["loss"] for s in records[-1]["steps"]]})
    return {"versions": versions(commit), "model": sizes, "pp": PP, "microbatches": MICROBATCHES, "steps": STEPS,
            "runs": runs}


def render(report: dict) -> str:
    lines = [f"# pp_engine auto on one GPU ({report['versions']['date']})", "",
             "`python -m benchmarks.auto_engine`: nanotron's trainer on its `LlamaForTraining` (hidden "
             f"{report['model']['hidden']}, {report['model']['layers']} layers, seq {report['model']['seq']}, bf16, "
             f"fp32 accumulation, AdamW), pp={report['pp']} as four ranks on one GPU, m={report['microbatches']}, "
             f"{report['steps']} steps; `pp_engine: auto:reserve=R`. Step 1 runs capped 1F1B with cap 1 and measures; "
             "steps 2 on run the chosen engine. Figures in GiB per pp rank.", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), "",
             "| reserve | budget | chosen | why | static (measured) | stash (measured) | predicted peak "
             "| measured peak, chosen engine | within budget |", "|---|---|---|---|---|---|---|---|---|"]
    for run in report["runs"]:
        auto = run["auto"]
        if auto is None:
            continue
        measured = [r["chosen_peak"] for r in run["ranks"]]
        fits = all(m is None or m <= b for m, b in zip(measured, auto["budget"]))
        lines.append(f"| {run['reserve_gib']} GiB | {_gib(auto['budget'][:1])} | `{auto['engine']}` | {auto['why']} | "
                     f"{_gib(auto['static'])} | {_gib(auto['stash'])} | {_gib(auto['predicted_peaks'])} | "
                     f"{_gib(measured)} | {'yes' if fits else 'NO'} |")
    lines += ["", "What the first step timed per rank (F and B of one microbatch, synchronised; one copy to host "
              "memory, all ranks at once) and the chosen engine's step time (median of the steps after the first):", ""]
    for run in report["runs"]:
        auto = run["auto"]
        if auto is None or "forward_s" not in auto:
            continue
        seconds = sorted(t for r in run["ranks"][:1] for t in r["chosen_seconds"])
        step = f"{seconds[len(seconds) // 2]:.3f} s" if seconds else "-"
        lines.append(f"- reserve {run['reserve_gib']} GiB: F " + " / ".join(f"{x * 1e3:.1f}" for x in auto["forward_s"])
                     + " ms, B " + " / ".join(f"{x * 1e3:.1f}" for x in auto["backward_s"]) + " ms, host link "
                     + " / ".join(f"{x / 1e9:.1f}" for x in auto["host_bandwidth"]) + f" GB/s; step {step}")
    lines += ["", "Prediction error of the chosen engine's peak per rank (measured / predicted - 1):", ""]
    for run in report["runs"]:
        auto = run["auto"]
        if auto is None:
            continue
        errors = [(m / p - 1) if m and p else None for m, p in
                  zip((r["chosen_peak"] for r in run["ranks"]), auto["predicted_peaks"])]
        lines.append(f"- reserve {run['reserve_gib']} GiB, `{auto['engine']}`: "
                     + " / ".join("-" if e is None else f"{e:+.1%}" for e in errors))
    return "\n".join(lines) + "\n"


def _gib(values) -> str:
    return " / ".join("-" if v is None else f"{v / GiB:.2f}" for v in values)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.auto_engine", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU; writes nothing")
    parser.add_argument("--reserves", default=",".join(map(str, RESERVES)), help="comma-separated GiB")
    parser.add_argument("--commit", help="commit to record")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("benchmarks.auto_engine: no CUDA GPU here; use --smoke on a CPU", file=sys.stderr)
        return 2
    try:
        reserves = tuple(int(r) for r in args.reserves.split(","))
    except ValueError:
        print(f"benchmarks.auto_engine: --reserves {args.reserves!r}: accepted: comma-separated integers (GiB)",
              file=sys.stderr)
        return 2
    report = measure(smoke=args.smoke, commit=args.commit, reserves=reserves[:1] if args.smoke else reserves)
    text = render(report)
    if not args.smoke:
        write_results("auto_engine", report, text, out=args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
