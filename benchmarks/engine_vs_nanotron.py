"""pipeschedule's engines against nanotron's own, side by side in one process tree (issue 19).

    python -m benchmarks.engine_vs_nanotron            # one CUDA GPU: pp=4 as four ranks on it
    python -m benchmarks.engine_vs_nanotron --smoke    # CPU, a tiny model: the plumbing; writes nothing

One torchrun of four ranks per model size builds nanotron's `DistributedTrainer` from a
YAML file (nanotron's `LlamaForTraining`, bf16, fp32 gradient accumulation, AdamW, gloo
between the ranks sharing the GPU: [Note: nanotron over gloo]) and then times its
`training_step` (the engine's `train_batch_iter`, the gradient sync, clipping and the
optimizer step: the users' step) with one engine and then the other, on the same model,
swapping `trainer.pipeline_engine` between steps. Pairs (nanotron's, ours):

    1f1b  vs ps_1f1b              the same 1F1B order
    1f1b  vs capped_1f1b:cap=pp   1F1B through the capped generator, cap not binding
    afab  vs ps_afab              all forwards, then all backwards (m <= 8 only: at m = 32
                                  AFAB's stage 0 holds 32 microbatches, ~64 GiB here, and four
                                  ranks share the GPU)

For each model size (`host-bound`: micro-batch 1, where the host issues kernels about as
fast as the GPU runs them; `gpu-bound`: micro-batch 2, the same kernels on twice the
data, so the GPU's time is about twice the host's) and m in (8, 32): `WARMUP` rounds,
then `ROUNDS` measured rounds, each running both engines once, in the order A B then
B A alternately (so drift falls on both). A step is timed on every rank from a barrier
to the end of its CUDA work and a second barrier; the figure is the ratio of the medians
and, the paired one, 1 + median over rounds of (ours - theirs) / theirs. Four ranks time-
share one GPU: these are one GPU's step times for the whole pipeline.

Writes benchmarks/results/engine_vs_nanotron.json and .md; prints the table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from integration.nanotron.example import TrainerConfig
from pipeschedule.checks import parse_int
from pipeschedule.errors import ParameterError
from benchmarks.common import MODEL, PP, RESULTS, SMOKE_TRAINER, torchrun, torchrun_failure, versions, write_results

PAIRS = (("1f1b", "ps_1f1b"), ("1f1b", f"capped_1f1b:cap={PP}"), ("afab", "ps_afab"))
AFAB_MAX_M = 8  # AFAB keeps every microbatch's activations: at m = 32 stage 0 alone needs ~64 GiB here
MICROBATCHES = (8, 32)
WARMUP, ROUNDS = 2, 7
SIZES = {"host-bound": dict(MODEL, micro_batch_size=1), "gpu-bound": dict(MODEL, micro_batch_size=2)}
SMOKE = {"smoke": SMOKE_TRAINER}


def _rank_main(config_path: str, out_path: str, microbatches: list[int], warmup: int, rounds: int) -> None:
    """Inside each torchrun rank: build the trainer once, time the pairs."""
    import torch
    from nanotron import distributed as dist
    from nanotron.dataloader import sanity_check_dataloader
    from nanotron.parallel.pipeline_parallel.engine import (
        AllForwardAllBackwardPipelineEngine,
        OneForwardOneBackwardPipelineEngine,
    )

    from integration.nanotron import train
    from integration.nanotron.engine_spec import parse_engine
    from integration.nanotron.engine import build_engine

    train.prepare("auto")
    trainer = train.make_trainer(config_path)
    trainer.pipeline_engine = trainer.config.parallelism.pp_engine
    data = sanity_check_dataloader(train.synthetic_batches(trainer), trainer.parallel_context, trainer.config)
    world = trainer.parallel_context.world_pg
    theirs = {"1f1b": OneForwardOneBackwardPipelineEngine(), "afab": AllForwardAllBackwardPipelineEngine()}

    def engine(name):
        return theirs[name] if name in theirs else build_engine(parse_engine(name))

    def timed(which, m: int) -> float:
        trainer.pipeline_engine = which
        trainer.n_micro_batches_per_batch = which.nb_microbatches = m
        dist.barrier(world)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.iteration_step += 1
        trainer.training_step(dataloader=data)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dist.barrier(world)
        return time.perf_counter() - start

    rows = []
    for m in microbatches:
        for a_name, b_name in PAIRS:
            if a_name == "afab" and m > AFAB_MAX_M:
                continue
            a, b = engine(a_name), engine(b_name)  # each ours compiles once, at its first step
            for _ in range(warmup):
                timed(a, m), timed(b, m)
            pairs, host = [], []
            for round_index in range(rounds):
                if round_index % 2 == 0:
                    ta, tb = timed(a, m), timed(b, m)
                else:
                    tb, ta = timed(b, m), timed(a, m)
                pairs.append((ta, tb))
                host.append(_host_times(b))
            rows.append({"m": m, "theirs": a_name, "ours": b_name, "pairs": pairs, "ours_host": host})
    if dist.get_rank(world) == 0:
        Path(out_path).write_text(json.dumps(rows))


def _host_times(engine) -> dict:
    """Where this rank's host time went in the engine's last training step (the
    executor's `StepTimes`: stage forwards and autograd backwards, posting and finishing
    batches, blocked in waits, and the executor's own rest)."""
    times = engine.training_times()
    return {"total_s": times.total_s, "compute_s": times.compute_s, "transport_s": times.transport_s,
            "wait_s": times.wait_s, "overhead_s": times.overhead_s, "instructions": times.instructions}


def run_size(name: str, sizes: dict, work: Path, *, microbatches, warmup, rounds, timeout: float) -> list[dict]:
    config = TrainerConfig(engine="1f1b", pp=PP, microbatches=max(microbatches), steps=10**6, dtype="bfloat16",
                           fp32_accumulation=True, **sizes)
    path = work / f"{name}.yaml"
    path.write_text(config.yaml(str(work / f"checkpoints-{name}")))
    out = work / f"{name}.json"
    result = torchrun(PP, ["-m", "benchmarks.engine_vs_nanotron", "--rank-main", str(path), str(out),
                           ",".join(map(str, microbatches)), str(warmup), str(rounds)], timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(torchrun_failure(name, result))
    rows = json.loads(out.read_text())
    for row in rows:
        row["size"] = name
        ta = [a for a, _ in row["pairs"]]
        tb = [b for _, b in row["pairs"]]
        row["theirs_median_s"], row["ours_median_s"] = statistics.median(ta), statistics.median(tb)
        row["ratio_of_medians"] = row["ours_median_s"] / row["theirs_median_s"]
        row["paired_ratio"] = 1 + statistics.median((b - a) / a for a, b in row["pairs"])
        row["ours_faster_rounds"] = sum(b < a for a, b in row["pairs"])
        host = row["ours_host"]
        row["ours_executor_overhead_s"] = statistics.median(h["overhead_s"] for h in host)
        row["ours_instructions"] = host[0]["instructions"]
    return rows


def render(report: dict) -> str:
    lines = [f"# pipeschedule's engines against nanotron's, side by side ({report['versions']['date']})", "",
             "`python -m benchmarks.engine_vs_nanotron`: nanotron's `DistributedTrainer.training_step` (engine, "
             "gradient sync, clipping, AdamW) on nanotron's `LlamaForTraining` (hidden 2048, 16 layers, seq 4096, "
             f"bf16, fp32 accumulation), pp={report['pp']} as four ranks on one GPU, the two engines alternating "
             f"on the same model: {report['warmup']} warm-up rounds, then {report['rounds']} measured rounds "
             "(A B, then B A). Paired: 1 + median over rounds of (ours - theirs) / theirs. Sizes: "
             + "; ".join(f"{name} micro-batch {size['micro_batch_size']}" for name, size in SIZES.items()) + ".", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), "",
             "| size | m | nanotron | ours | nanotron median | ours median | ratio of medians | paired ratio "
             "| rounds ours faster | executor's own host time (rank 0) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        lines.append(f"| {row['size']} | {row['m']} | `{row['theirs']}` | `{row['ours']}` | "
                     f"{row['theirs_median_s'] * 1e3:.1f} ms | {row['ours_median_s'] * 1e3:.1f} ms | "
                     f"{row['ratio_of_medians']:.3f} | {row['paired_ratio']:.3f} | "
                     f"{row['ours_faster_rounds']}/{len(row['pairs'])} | "
                     f"{row['ours_executor_overhead_s'] * 1e3:.1f} ms over {row['ours_instructions']} instructions "
                     f"({row['ours_executor_overhead_s'] / row['ours_median_s']:.2%}) |")
    lines += ["", "The last column is rank 0's host time in the executor outside stage forwards and backwards, "
              "posting and finishing batches and blocked waits (`StepTimes.overhead_s`), median over rounds. With "
              "four processes time-sharing one GPU the device is the bottleneck, and a kernel launch blocks once "
              "CUDA's launch queue is full, so this column also holds time the host spent waiting for the GPU "
              "inside the executor's own launches (gradient folding, copies); it is not Python overhead alone."]
    return "\n".join(lines) + "\n"


def _microbatches(text: str) -> tuple[int, ...]:
    """`--microbatches`: positive integers, comma-separated."""
    try:
        values = tuple(parse_int(part, "--microbatches") for part in text.split(","))
    except ParameterError as err:
        raise argparse.ArgumentTypeError(f"{err}; give positive integers, comma-separated") from None
    if any(m < 1 for m in values):
        raise argparse.ArgumentTypeError(f"--microbatches takes positive integers, got {text!r}")
    return values


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-main"]:
        config_path, out_path, ms, warmup, rounds = argv[1:6]
        _rank_main(config_path, out_path, [int(m) for m in ms.split(",")], int(warmup), int(rounds))
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine_vs_nanotron",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU; writes nothing")
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--microbatches", type=_microbatches, default=MICROBATCHES, metavar="M[,M...]",
                        help=f"microbatches per step, comma-separated (default {','.join(map(str, MICROBATCHES))})")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument("--commit", help="commit to record (the device machine's tree may lack git history)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    import torch


    if not args.smoke and not torch.cuda.is_available():
        print("benchmarks.engine_vs_nanotron: no CUDA GPU here; use --smoke on a CPU", file=sys.stderr)
        return 2
    sizes = SMOKE if args.smoke else {k: SIZES[k] for k in args.sizes.split(",")}
    unknown = set(args.sizes.split(",")) - set(SIZES)
    if unknown and not args.smoke:
        print(f"benchmarks.engine_vs_nanotron: unknown size {sorted(unknown)}; accepted: {', '.join(SIZES)}",
              file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="pipeschedule-vs-"))
    rows = []
    for name, size in sizes.items():
        rows += run_size(name, size, work, microbatches=args.microbatches, warmup=1 if args.smoke else args.warmup,
                         rounds=2 if args.smoke else args.rounds, timeout=900)
    report = {"versions": versions(args.commit), "pp": PP, "warmup": args.warmup, "rounds": args.rounds, "rows": rows}
    text = render(report)
    if not args.smoke:
        write_results("engine_vs_nanotron", report, text, out=args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
