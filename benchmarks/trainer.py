"""nanotron's own trainer from a YAML file, nanotron's 1F1B against pipeschedule's engines (issue 15).

    python -m benchmarks.trainer            # one CUDA GPU: pp=4 as four ranks on it (several minutes)
    python -m benchmarks.trainer --smoke    # CPU, a tiny model: checks the plumbing, writes nothing

Each run is the users' launch: `torchrun --nproc-per-node 4 -m integration.nanotron.train
--config-file CONFIG --record DIR`, nanotron's `DistributedTrainer` on nanotron's
`LlamaForTraining` (bf16, fp32 gradient accumulation, AdamW), the engine chosen in the
YAML's `pp_engine` alone. Four ranks share the one GPU, so their group is gloo with
boundaries staged through pinned host memory ([Note: nanotron over gloo]).

Engines: nanotron's `1f1b`, `capped_1f1b:cap=2`, `interleaved_1f1b:virtual=2`, `zb_h1`,
all on the same synthetic data and from the same initial weights (drawn by parameter
name, [Note: same initial weights] in integration/nanotron/patches/initial_weights.py), so losses
are comparable step by step. The engines run in `ROUNDS` alternating rounds (A B C D A B C D),
so a slow stretch of the shared machine does not fall on one engine only; step time is
the median over the measured steps (after `WARMUP`) of every round, per-stage peak
memory the largest over them (`torch.cuda.max_memory_allocated` / `_reserved` of each
rank's process, reset before each step). Four processes on one GPU time-share it: the
step time is that of one GPU running all four stages, not of a four-GPU pipeline.

Writes benchmarks/results/trainer.json (raw) and trainer.md (tables); prints the tables last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import (MICROBATCH_SIZE, MODEL, PP, RESULTS, SMOKE_TRAINER, torchrun, torchrun_failure, versions,
                               write_results)
from integration.nanotron.example import TrainerConfig

ENGINES = ("1f1b", "capped_1f1b:cap=2", "interleaved_1f1b:virtual=2", "zb_h1")
MICROBATCHES, STEPS, WARMUP, ROUNDS = 8, 6, 2, 2
SIZES = dict(MODEL, micro_batch_size=MICROBATCH_SIZE)


def config_for(engine: str, *, smoke: bool, steps: int) -> TrainerConfig:
    sizes = SMOKE_TRAINER if smoke else SIZES
    return TrainerConfig(engine=engine, pp=PP, microbatches=MICROBATCHES, steps=steps,
                         dtype="bfloat16", fp32_accumulation=True, **sizes)


def launch(config: TrainerConfig, work: Path, name: str, timeout: float) -> list[dict]:
    """One torchrun of the users' launcher; the four ranks' records."""
    path = work / f"{name}.yaml"
    path.write_text(config.yaml(str(work / f"checkpoints-{name}")))
    record = work / f"record-{name}"
    result = torchrun(config.world, ["-m", "integration.nanotron.train", "--config-file", str(path),
                                     "--record", str(record)], timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(torchrun_failure(config.engine, result))
    return [json.loads((record / f"rank{r}.json").read_text()) for r in range(config.world)]


def measure(*, smoke: bool, commit: str | None, rounds: int, steps: int, engines: tuple[str, ...] = ENGINES) -> dict:
    work = Path(tempfile.mkdtemp(prefix="pipeschedule-trainer-"))
    runs: dict[str, list] = {engine: [] for engine in engines}
    for round_index in range(rounds):
        for engine in engines:
            name = f"{engine.replace(':', '_').replace('=', '').replace(',', '_')}-{round_index}"
            records = launch(config_for(engine, smoke=smoke, steps=steps), work, name, timeout=600)
            runs[engine].append(records)
            print(f"round {round_index} {engine}: {summarise([records])['step_s']:.3f} s/step", flush=True)
    report = {"versions": versions(commit), "model": SIZES if not smoke else SMOKE_TRAINER, "pp": PP,
              "microbatches": MICROBATCHES, "steps": steps, "warmup": WARMUP, "rounds": rounds,
              "engines": {engine: summarise(rounds) for engine, rounds in runs.items()}}
    return report


def summarise(rounds: list[list[dict]]) -> dict:
    """Per engine: losses per step of each round, median step time over the measured
    steps, per-stage peaks (largest over measured steps and rounds)."""
    losses, times = [], []
    peak_alloc = [0] * PP
    peak_reserved = [0] * PP
    ledger_stash = [0] * PP
    for records in rounds:
        loss_rank = next(r for r in records if r["steps"][0]["loss"] is not None)
        losses.append([s["loss"] for s in loss_rank["steps"]])
        by_step = list(zip(*(r["steps"] for r in records)))
        measured = by_step[WARMUP:] if len(by_step) > WARMUP else by_step
        times += [max(s["seconds"] for s in step) for step in measured]
        for record in records:
            rank = record["pp_rank"]
            for step in record["steps"][WARMUP:] or record["steps"]:
                peak_alloc[rank] = max(peak_alloc[rank], step["peak_allocated"] or 0)
                peak_reserved[rank] = max(peak_reserved[rank], step["peak_reserved"] or 0)
                if step["ledger"]:
                    ledger_stash[rank] = max(ledger_stash[rank], step["ledger"]["stash_peak_bytes"])
    return {"losses": losses, "step_s": statistics.median(times), "step_s_all": times,
            "peak_allocated": peak_alloc, "peak_reserved": peak_reserved, "ledger_stash": ledger_stash,
            "block_ranks": rounds[0][0]["block_ranks"]}


def render(report: dict) -> str:
    gib = 2**30
    reference = next(iter(report["engines"]))
    ref = report["engines"][reference]
    lines = [
        f"# nanotron's trainer from a YAML file: nanotron's 1F1B against pipeschedule's engines "
        f"({report['versions']['date']})", "",
        "`python -m benchmarks.trainer`: nanotron's `DistributedTrainer` on its own `LlamaForTraining` "
        f"(hidden {report['model']['hidden']}, {report['model']['layers']} layers, seq {report['model']['seq']}, "
        f"micro-batch {report['model']['micro_batch_size']}, bf16, fp32 gradient accumulation, AdamW), "
        f"pp={report['pp']} as four ranks on one GPU (gloo, boundaries staged through host memory), "
        f"m={report['microbatches']}, {report['steps']} steps per run, the first {report['warmup']} not measured, "
        f"{report['rounds']} round(s) over the engines in turn. Each run is "
        "`torchrun --nproc-per-node 4 -m integration.nanotron.train --config-file CONFIG`, "
        "the engine chosen by `pp_engine` alone; every run starts from the same saved weights.", "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), "",
        f"| pp_engine | step time (median) | vs {reference} | peak allocated per stage (GiB) "
        "| peak reserved per stage (GiB) | ledger stash peak per stage (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for engine, row in report["engines"].items():
        lines.append(
            f"| `{engine}` | {row['step_s']:.3f} s | {row['step_s'] / ref['step_s']:.3f} | "
            + " / ".join(f"{b / gib:.2f}" for b in row["peak_allocated"]) + " | "
            + " / ".join(f"{b / gib:.2f}" for b in row["peak_reserved"]) + " | "
            + (" / ".join(f"{b / 2**20:.0f}" for b in row["ledger_stash"]) if any(row["ledger_stash"]) else "-")
            + " |")
    lines += ["", "Losses per step (first round; every run starts from the same weights and data). On CPU the engines "
              "give bitwise equal losses and weights (tests/nanotron/test_nanotron_trainer.py); on the GPU "
              "nondeterministic kernels (atomic adds in backward) make any two runs drift, the same engine's "
              "included: compare the engines' gaps with that of a repeated run.", "",
              "| pp_engine | " + " | ".join(f"step {i + 1}" for i in range(len(ref["losses"][0])))
              + f" | max |Δ| vs {reference} (any round) |",
              "|---|" + "---|" * (len(ref["losses"][0]) + 1)]
    for engine, row in report["engines"].items():
        gaps = [abs(a - b) for rnd in row["losses"] for a, b in zip(rnd, ref["losses"][0])]
        lines.append(f"| `{engine}` | " + " | ".join(f"{x:.6f}" for x in row["losses"][0]) + f" | {max(gaps):.2e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trainer", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU; writes nothing")
    parser.add_argument("--commit", help="commit to record (the device machine's tree may lack git history)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where trainer.json and trainer.md go")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"alternating rounds (default {ROUNDS})")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps per run (default {STEPS})")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help=f"comma-separated pp_engine values, the first the reference (default {','.join(ENGINES)})")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps <= WARMUP:
        print(f"benchmarks.trainer: --rounds must be >= 1 and --steps > {WARMUP} (warm-up steps), got "
              f"{args.rounds} and {args.steps}", file=sys.stderr)
        return 2
    if not args.smoke and not torch.cuda.is_available():
        print("benchmarks.trainer: no CUDA GPU here; use --smoke on a CPU", file=sys.stderr)
        return 2
    report = measure(smoke=args.smoke, commit=args.commit, rounds=1 if args.smoke else args.rounds,
                     steps=WARMUP + 1 if args.smoke else args.steps, engines=tuple(args.engines.split(",")))
    text = render(report)
    if not args.smoke:
        write_results("trainer", report, text, out=args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
