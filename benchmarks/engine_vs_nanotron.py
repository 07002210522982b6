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
    afab  vs ps_afab              all forwards, then all backwards

A pair runs where the four ranks' predicted peaks together (`pipeschedule plan`'s memory
model for nanotron's trainer on the same YAML, plus a CUDA context each) fit the GPU; a
pair that does not is listed as not run with its figure. The pairs run in order of that
figure, least first, and what has run is saved after each ([Note: pairs by predicted
memory]). AFAB keeps every microbatch's activations: at m = 8 it is predicted at 80.0 GiB
host-bound with the context and allocator reserve each rank holds (an 80 GB H100 holds
79.2: two runs there ended 65 s in, by their timing in the AFAB pair's first measured
round, rank 0 first: out of memory, when it was predicted at 75.6 GiB with a smaller
allowance) and 137.7 GiB GPU-bound (an H200 holds 139.8); at m = 32, 251 and 479 GiB.

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
import gc
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from integration.nanotron.example import TrainerConfig
from pipeschedule.checks import parse_int
from pipeschedule.errors import ParameterError
from benchmarks.common import (RANK_OVERHEAD_BYTES, MODEL, PP, RESULTS, SMOKE_TRAINER, torchrun,
                               torchrun_cause, torchrun_failure, versions, write_results)
from pipeschedule.runtime.launch import leave

PAIRS = (("1f1b", "ps_1f1b"), ("1f1b", f"capped_1f1b:cap={PP}"), ("afab", "ps_afab"))
# each pair's two engines run the same schedule (cap = pp does not bind): the pair's memory is nanotron's one's
MICROBATCHES = (8, 32)
WARMUP, ROUNDS = 2, 7
SIZES = {"host-bound": dict(MODEL, micro_batch_size=1), "gpu-bound": dict(MODEL, micro_batch_size=2)}
SMOKE = {"smoke": SMOKE_TRAINER}


def _rank_main(config_path: str, out_path: str, microbatches: list[int], warmup: int, rounds: int,
               needs_path: str) -> None:
    """Inside each torchrun rank: build the trainer once, time the pairs that fit the GPU
    (`needs_path`: bytes the four ranks need together, per `m:theirs`); rank 0 writes the
    rows and the pairs left out."""
    import torch
    from nanotron import distributed as dist
    from nanotron.dataloader import sanity_check_dataloader
    from nanotron.parallel.pipeline_parallel.engine import (
        AllForwardAllBackwardPipelineEngine,
        OneForwardOneBackwardPipelineEngine,
    )

    from integration.nanotron import train
    from integration.nanotron.pipeline.engine_spec import parse_engine
    from integration.nanotron.pipeline.engine import build_engine

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

    needs = json.loads(Path(needs_path).read_text())
    capacity = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory \
        if torch.cuda.is_available() else math.inf
    rows, skipped = [], []
    # [Note: pairs by predicted memory] The pairs run in order of predicted need, least first,
    # and rank 0 saves what has run after each: a pair near the GPU's size that runs out of
    # memory then ends the run with every pair that fits better already saved. A pair over
    # the GPU's size is not run at all. Between pairs the engines are dropped and the
    # allocator's cache emptied, so each pair starts from the same state.
    order = sorted(((m, a_name, b_name) for m in microbatches for a_name, b_name in PAIRS),
                   key=lambda case: needs[f"{case[0]}:{case[1]}"])
    for m, a_name, b_name in order:
        need = needs[f"{m}:{a_name}"]
        if need > capacity:
            skipped.append({"m": m, "theirs": a_name, "ours": b_name, "why":
                            f"predicted {need / 2**30:.1f} GiB for the {PP} ranks together; the GPU has "
                            f"{capacity / 2**30:.1f} GiB"})
        else:
            rows.append({"m": m, "theirs": a_name, "ours": b_name, "predicted_need_bytes": need,
                         **_time_pair(engine(a_name), engine(b_name), m, timed, warmup, rounds)})
            trainer.pipeline_engine = None  # (the pair's last engine: nothing holds ours now)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if dist.get_rank(world) == 0:  # whole or not at all: a rank that dies leaves the last saved file
            partial = Path(out_path).with_suffix(".partial")
            partial.write_text(json.dumps({"rows": rows, "skipped": skipped}))
            partial.replace(out_path)


def _time_pair(a, b, m: int, timed, warmup: int, rounds: int) -> dict:
    """Engines a (nanotron's) and b (ours) at m microbatches: `warmup` rounds, then `rounds`
    measured ones, A B and B A in turn; each ours compiles once, at its first step."""
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
    return {"pairs": pairs, "ours_host": host}


def _host_times(engine) -> dict:
    """Where this rank's host time went in the engine's last training step (the
    executor's `StepTimes`: stage forwards and autograd backwards, posting and finishing
    batches, blocked in waits, and the executor's own rest)."""
    times = engine.training_times()
    return {"total_s": times.total_s, "compute_s": times.compute_s, "transport_s": times.transport_s,
            "wait_s": times.wait_s, "overhead_s": times.overhead_s, "instructions": times.instructions}


def predicted_needs(config_path: Path, microbatches) -> dict[str, float]:
    """`m:schedule` -> bytes the PP ranks of nanotron's trainer on `config_path` need
    together at their peaks, for each m and each of nanotron's schedules in PAIRS
    (`pipeschedule plan`'s memory model on the same YAML, nanotron's split, no recompute,
    the flash-attn stand-in's attention), plus RANK_OVERHEAD_BYTES a rank (its CUDA context and
    the allocator's reserve above its peak: the host-bound AFAB pair at m=8, predicted at 75.6
    GiB with 0.59 GiB a rank, died on a 79.2 GiB H100; with the measured 1.67 GiB a rank it is
    80.0 GiB and skipped)."""
    needs = {}
    for m in microbatches:
        command = [sys.executable, "-m", "pipeschedule.cli", "plan", "--model-file", str(config_path),
                   "--microbatches", str(m), "--recompute", "none", "--attention", "sdpa-standin", "--json",
                   "--tables", "none"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} exited with {done.returncode}:\n{done.stderr[-2000:]}")
        candidates = json.loads(done.stdout)["candidates"]
        for theirs in {a for a, _ in PAIRS}:
            ranks = next(c["memory"] for c in candidates
                         if c["schedule"] == theirs and c["cap"] is None and c["split_kind"].startswith("nanotron"))
            needs[f"{m}:{theirs}"] = sum(r["total"] for r in ranks) + len(ranks) * RANK_OVERHEAD_BYTES
    return needs


def run_size(name: str, sizes: dict, work: Path, *, microbatches, warmup, rounds,
             timeout: float) -> tuple[list[dict], list[dict]]:
    """(rows, skipped) of one model size: the pairs timed, and those whose memory the GPU
    does not hold, with the reason."""
    config = TrainerConfig(engine="1f1b", pp=PP, microbatches=max(microbatches), steps=10**6, dtype="bfloat16",
                           fp32_accumulation=True, **sizes)
    path = work / f"{name}.yaml"
    path.write_text(config.yaml(str(work / f"checkpoints-{name}")))
    needs = work / f"{name}-needs.json"
    needs.write_text(json.dumps(predicted_needs(path, microbatches)))
    out = work / f"{name}.json"
    result = torchrun(PP, ["-m", "benchmarks.engine_vs_nanotron", "--rank-main", str(path), str(out),
                           ",".join(map(str, microbatches)), str(warmup), str(rounds), str(needs)], timeout=timeout)
    if result.returncode != 0 and not out.exists():
        raise RuntimeError(torchrun_failure(name, result))
    saved = json.loads(out.read_text())
    rows, skipped = saved["rows"], saved["skipped"]
    if result.returncode != 0:  # [Note: pairs by predicted memory]: the pairs saved stand; name the rest
        failure = torchrun_failure(name, result)
        print(failure, file=sys.stderr)
        done = {(r["m"], r["theirs"], r["ours"]) for r in rows + skipped}
        cause = torchrun_cause(result)
        for m in microbatches:
            for a_name, b_name in PAIRS:
                if (m, a_name, b_name) not in done:
                    skipped.append({"m": m, "theirs": a_name, "ours": b_name, "failed": True,
                                    "why": f"the run ended at this pair or one before it: {cause[:300]}"})
    order = {pair: k for k, pair in enumerate(PAIRS)}
    for listed in (rows, skipped):  # the table's order: by m, then as PAIRS lists them
        listed.sort(key=lambda r: (r["m"], order[(r["theirs"], r["ours"])]))
    for row in rows + skipped:
        row["size"] = name
    for row in rows:
        ta = [a for a, _ in row["pairs"]]
        tb = [b for _, b in row["pairs"]]
        row["theirs_median_s"], row["ours_median_s"] = statistics.median(ta), statistics.median(tb)
        row["ratio_of_medians"] = row["ours_median_s"] / row["theirs_median_s"]
        row["paired_ratio"] = 1 + statistics.median((b - a) / a for a, b in row["pairs"])
        row["ours_faster_rounds"] = sum(b < a for a, b in row["pairs"])
        host = row["ours_host"]
        row["ours_executor_overhead_s"] = statistics.median(h["overhead_s"] for h in host)
        row["ours_instructions"] = host[0]["instructions"]
    return rows, skipped


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
    for row in report.get("skipped", []):
        lines.append(f"| {row['size']} | {row['m']} | `{row['theirs']}` | `{row['ours']}` | not run: {row['why']} "
                     "| | | | | |")
    lines += ["", "The last column is rank 0's host time in the executor outside stage forwards and backwards, "
              "posting and finishing batches and blocked waits (`StepTimes.overhead_s`), median over rounds. With "
              "four processes time-sharing one GPU the device is the bottleneck, and a kernel launch blocks once "
              "CUDA's launch queue is full, so this column also holds time the host spent waiting for the GPU "
              "inside the executor's own launches (gradient folding, copies); it is not Python overhead alone."]
    return "\n".join(lines) + "\n"


def _microbatches(text: str) -> tuple[int, ...]:
    """`--microbatches`: integers of at least PP - 1 (nanotron's 1f1b asks for that many), comma-separated."""
    try:
        values = tuple(parse_int(part, "--microbatches") for part in text.split(","))
    except ParameterError as err:
        raise argparse.ArgumentTypeError(f"{err}; give integers >= {PP - 1}, comma-separated") from None
    low = [m for m in values if m < PP - 1]
    if low:
        raise argparse.ArgumentTypeError(f"--microbatches {low[0]}: nanotron's 1f1b needs at least pp - 1 = {PP - 1} "
                                         f"microbatches; give integers >= {PP - 1}, comma-separated")
    return tuple(dict.fromkeys(values))  # each m once


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-main"]:
        config_path, out_path, ms, warmup, rounds, needs_path = argv[1:7]
        _rank_main(config_path, out_path, [int(m) for m in ms.split(",")], int(warmup), int(rounds), needs_path)
        leave(0)  # not the interpreter's shutdown, with nanotron's groups alive
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
    rows, skipped = [], []
    for name, size in sizes.items():
        timed, left_out = run_size(name, size, work, microbatches=args.microbatches,
                                   warmup=1 if args.smoke else args.warmup, rounds=2 if args.smoke else args.rounds,
                                   timeout=900)
        rows += timed
        skipped += left_out
    report = {"versions": versions(args.commit), "pp": PP, "warmup": args.warmup, "rounds": args.rounds, "rows": rows,
              "skipped": skipped}
    text = render(report)
    if not args.smoke:
        write_results("engine_vs_nanotron", report, text, out=args.out)
    print(text)
    return 1 if any(row.get("failed") for row in skipped) else 0


if __name__ == "__main__":
    sys.exit(main())
