"""pp GPUs on one: every schedule family on SM partitions of one GPU, measured beside the simulator.

    python -m benchmarks.parallel.gpu_partitions                  # one CUDA GPU, pp=4 partitions (minutes)
    python -m benchmarks.parallel.gpu_partitions --route streams  # the control: ranks on ordinary streams
    python -m benchmarks.parallel.gpu_partitions --host both      # each engine also with a host thread per rank
    python -m benchmarks.parallel.gpu_partitions --micro-batch 2  # more device work per block the host enqueues
    python -m benchmarks.parallel.gpu_partitions --smoke          # CPU, a tiny model: the plumbing; writes nothing

All pp ranks run in one process (`PartitionedPipeline`, [Note: partitioned stepping] in
pipeschedule/runtime/partitioned.py), each rank's kernels on its own partition of the
device's SMs (`--route driver`: CUDA green contexts through cuda-bindings; `torch`:
`torch.cuda.green_contexts`), messages as on-device copies ordered by events, the host
enqueuing ahead. The model is the project's Llama (benchmarks/llama, bf16, `MODEL`), built
once and cut into each schedule's stages with its decoder layers as even as they go
(`even_split`; every engine computes on the same weights and data). The engines of one
stage count run in rounds whose order rotates; the stage counts run one after another
(their ratios are not paired; the first group's 1F1B runs again last to show the drift).

Per (engine, m): the step from the first enqueue to the end of the device's work (median
over rounds), each rank's busy time and bubble from CUDA events around every F, B and W
([Note: measured timeline]), each rank's peak live bytes from its ledger, and the
simulator's step for the engine's schedule under the stage costs measured in these steps
and a boundary copy measured here; and the host's part of each rank's idle time: how long
its partition waited for the host to enqueue its next block (`report.host_pacing`). `--host
threads` (or `both`) drives each rank from its own host thread ([Note: a host thread per
rank] in pipeschedule/runtime/inprocess.py; rows named `<engine>@threads`). A case that
runs out of memory is reported, not run again. Before the table: the partitioned step's
losses and gradients against the same step run without partitions (`InProcessPipeline`).
Writes `--out`/parallel_gpu_partitions.json and .md and one Chrome trace per case (with the
host's enqueue of each block on a track of its own); prints the table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS, rotated, versions
from benchmarks.parallel import report, shared_chip
from benchmarks.parallel.predict import span_rows
from pipeschedule.errors import RuntimeScheduleError

ENGINES = ("ps_1f1b", "ps_afab", "capped_1f1b:cap=1", "capped_1f1b:cap=2", "capped_1f1b:cap=3", "zb_h1",
           "interleaved_1f1b:virtual=2", "interleaved_1f1b:virtual=3", "zbv", "v_half", "v_min",
           "zb_h2", "interleaved_zb:virtual=2", "looped_bfs:virtual=2", "dualpipev")
MODEL = dict(hidden=4096, layers=16, heads=32, kv_heads=8, ffn=11008, vocab=32000, seq=2048)
SMOKE_MODEL = dict(hidden=64, layers=12, heads=4, kv_heads=2, ffn=128, vocab=256, seq=32)
SMOKE_ENGINES = ("ps_1f1b", "zb_h1", "interleaved_1f1b:virtual=2", "zbv")


def available(names) -> list[str]:
    """`names` whose family this tree has."""
    from pipeschedule.compiler.families import FAMILIES

    return [n for n in names if n.startswith("ps_") or n.split(":")[0] in FAMILIES]


def even_split(layers: int, stages: int) -> tuple[int, ...]:
    """Decoder layers per stage, as even as they go; the extra ones on the middle stages (the
    first stage also embeds, the last also runs the head and the loss)."""
    base, extra = divmod(layers, stages)
    middle = sorted(range(stages), key=lambda s: abs(s - (stages - 1) / 2))[:extra]
    return tuple(base + (s in middle) for s in range(stages))


class Model:
    """The benchmark's weights, built once, and its data."""

    def __init__(self, cfg, args, device):
        from benchmarks.llama.reference import microbatch
        from benchmarks.llama.stages import LlamaStages
        from benchmarks.training import to_device

        self.cfg, self.device = cfg, device
        self.stages = LlamaStages(cfg, (cfg.layers,), device, torch.bfloat16)
        batches = [to_device(microbatch(cfg, args.micro_batch, i, 7), device) for i in range(max(args.microbatches))]
        self.inputs = [{"input_ids": b["input_ids"]} for b in batches]
        self.targets = [{"label_ids": b["label_ids"], "label_mask": b["label_mask"]} for b in batches]


class Group:
    """The engines of one stage count: the model cut into that many stages, and each case's pipeline."""

    def __init__(self, model: Model, stages_count: int, engines: list[str], args, streams):
        self.cfg, self.count, self.args, self.streams = model.cfg, stages_count, args, streams
        self.device = model.device
        self.split = even_split(model.cfg.layers, stages_count)
        self.stages = model.stages.regrouped(self.split)
        self.params = [p for s in range(stages_count) for p in self.stages.parameters(s)]
        self.inputs, self.targets = model.inputs, model.targets
        self.cases = [(name, m) for m in args.microbatches for name in engines]
        self.pipelines: dict = {}
        self.failed: dict = {}

    def pipeline(self, name: str, m: int):
        from pipeschedule.runtime import InProcessPipeline
        from pipeschedule.runtime.partitioned import PartitionedPipeline
        from pipeschedule.runtime.timeline import Timeline

        if (name, m) not in self.pipelines:
            schedule = report.schedule_of(name, self.args.pp, m)
            threads = name.endswith(report.HOST_THREADS)
            if self.streams is None:
                built = InProcessPipeline(schedule, self.stages, threads=threads, device=self.device)
            else:
                built = PartitionedPipeline(schedule, self.stages, self.streams, threads=threads)
            for executor in built.executors:
                executor.timeline = Timeline(self.device)
            self.pipelines[name, m] = built
        return self.pipelines[name, m]

    def step(self, name: str, m: int) -> dict:
        """One step of the case: seconds, loss (the sum of the microbatches' scaled losses),
        spans and ledger peaks per rank."""
        pipeline = self.pipeline(name, m)
        for p in self.params:
            p.grad = None
        _sync(self.device)
        start = time.perf_counter()
        outputs = pipeline.step(self.inputs[:m], self.targets[:m])
        enqueued = time.perf_counter() - start
        _sync(self.device)
        seconds = time.perf_counter() - start
        last = pipeline.schedule.placement[-1]
        loss = float(sum(out["loss"].float() for out in outputs[last]))
        timelines = [e.timeline for e in pipeline.executors]
        return {"seconds": seconds, "loss": loss, "enqueue_s": enqueued,
                "spans": [span_rows(t.spans()) for t in timelines], "host": [t.host_spans() for t in timelines],
                "offset_s": [t.host_origin - start for t in timelines],
                "ledger_peak_bytes": [e.ledger.high_total for e in pipeline.executors]}

    def run(self) -> dict:
        """Warm-up and measured rounds; (engine, m) -> measured rounds."""
        rounds: dict = {}
        for k in range(self.args.warmup + self.args.rounds):
            for name, m in rotated(self.cases, k):
                if (name, m) in self.failed:
                    continue
                try:
                    row = self.step(name, m)
                except (torch.cuda.OutOfMemoryError, RuntimeScheduleError) as err:
                    if "out of memory" not in str(err):
                        raise
                    self.failed[name, m] = f"out of memory: {str(err).splitlines()[0][:200]}"
                    self.pipelines.pop((name, m), None)
                    gc.collect()
                    torch.cuda.empty_cache()
                    continue
                if k >= self.args.warmup:
                    rounds.setdefault((name, m), []).append(row)
        return rounds

    def close(self) -> None:
        self.pipelines.clear()
        for p in self.params:
            p.grad = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def exactness(group: Group, name: str, m: int) -> dict:
    """The case's partitioned step against the same step without partitions: losses and the
    largest gradient difference (the forward's kernels are deterministic, autograd's
    accumulation may not be)."""
    from pipeschedule.runtime import InProcessPipeline

    def grads_after(pipeline) -> tuple[float, list[torch.Tensor]]:
        for p in group.params:
            p.grad = None
        outputs = pipeline.step(group.inputs[:m], group.targets[:m])
        _sync(group.device)
        last = pipeline.schedule.placement[-1]
        loss = float(sum(out["loss"].float() for out in outputs[last]))
        return loss, [p.grad.detach().float().clone() for p in group.params]

    partitioned = grads_after(group.pipeline(name, m))
    plain = grads_after(InProcessPipeline(report.schedule_of(name, group.args.pp, m), group.stages,
                                          device=group.device))
    largest = max(float((a - b).abs().max()) for a, b in zip(partitioned[1], plain[1]))
    scale = max(float(b.abs().max()) for b in plain[1])
    return {"engine": name, "m": m, "loss_partitioned": partitioned[0], "loss_plain": plain[0],
            "losses_equal": partitioned[0] == plain[0], "largest_grad_difference": largest, "largest_grad": scale}


def boundary_link(cfg, device, streams, micro_batch: int = 1) -> dict:
    """One boundary's on-device copy (1 x seq x hidden bf16) timed on a partition's stream:
    the simulator's message latency (bandwidth unbounded)."""
    size = micro_batch * cfg.seq * cfg.hidden
    if device.type != "cuda":
        return {"boundary_bytes": size * 2, "latency_s": 0.0, "bandwidth": float("inf")}
    source, into = torch.randn(size, device=device, dtype=torch.bfloat16), torch.empty(size, device=device,
                                                                                       dtype=torch.bfloat16)
    stream = streams[0] if streams else torch.cuda.current_stream()
    times = []
    with torch.cuda.stream(stream):
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            into.copy_(source)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    return {"boundary_bytes": size * 2, "latency_s": statistics.median(times[5:]), "bandwidth": float("inf")}


def with_host(engines: list[str], host: str) -> list[str]:
    """The engines' names as `--host` runs them: "one" as given, "threads" each with a
    host thread per rank, "both" each followed by its threaded twin."""
    threaded = [name + report.HOST_THREADS for name in engines]
    return {"one": engines, "threads": threaded,
            "both": [n for pair in zip(engines, threaded) for n in pair]}[host]


def stage_groups(engines: list[str], pp: int) -> dict[int, list[str]]:
    """Stage count -> the engines that run that many stages, in first-seen order."""
    out: dict[int, list[str]] = {}
    for name in engines:
        out.setdefault(report.schedule_of(name, pp, 2 * pp).num_stages, []).append(name)
    return out


def measure(args, cfg, device, streams, partial: Path | None = None) -> dict:
    link = boundary_link(cfg, device, streams, args.micro_batch)
    rows, failed, checks, drift, splits = [], [], [], None, {}
    groups = stage_groups(with_host(available(args.engines), args.host), args.pp)
    model = Model(cfg, args, device)
    for index, (count, engines) in enumerate(groups.items()):
        group = Group(model, count, engines, args, streams)
        splits[count] = group.split
        if index == 0:
            checks.append(exactness(group, engines[0], min(args.microbatches)))
        for (name, m), rounds in group.run().items():
            rows.append(report.case_row(name, m, f"S={count}", rounds, report.schedule_of(name, args.pp, m), link))
        failed += [{"engine": n, "m": m, "why": why} for (n, m), why in group.failed.items()]
        group.close()
        print(f"stages {count}: {', '.join(engines)} done", flush=True)
        if partial is not None:  # what has run stays if a later group does not finish
            partial.write_text(json.dumps({"rows": rows, "not_run": failed, "exactness": checks, "link": link},
                                          default=str))
    first = next((r for r in rows if r["engine"] == report.REFERENCE), rows[0] if rows else None)
    if first is not None and len(groups) > 1:
        again = Group(model, args.pp, [first["engine"]], args, streams)
        again.cases = [(first["engine"], first["m"])]
        repeat = again.run().get((first["engine"], first["m"]), [])
        again.close()
        if repeat:
            drift = {"engine": first["engine"], "m": first["m"], "first_s": first["median_s"],
                     "last_s": statistics.median(r["seconds"] for r in repeat)}
    report.compare(rows)
    shared = shared_chip.table({"pp": args.pp, "link": link, "rows": rows}, shared_chip.PROBE_SLOPE)
    return {"shared_chip": shared, "pp": args.pp, "route": args.route, "host": args.host,
            "micro_batch": args.micro_batch, "microbatches": args.microbatches,
            "rounds": args.rounds, "warmup": args.warmup, "model": asdict_cfg(cfg), "splits": splits, "link": link,
            "rows": rows, "not_run": failed,
            "exactness": checks, "drift": drift, "losses_equal": report.losses_equal(rows, report.REFERENCE)}


def asdict_cfg(cfg) -> dict:
    from dataclasses import asdict

    return asdict(cfg)


def diagnosis(summary: dict) -> list[str]:
    """The lines after the table of a one-GPU run (this one, `mps_ranks`): where each step
    differs from the simulated one, and the prediction with the chip shared."""
    lines = []
    late = report.late_table(summary["rows"])
    if late:
        lines += [""] + late
    if summary.get("shared_chip"):
        lines += ["", "With the chip shared ([Note: a shared chip] in benchmarks/parallel/shared_chip.py: the same "
                  "blocks, each running slower while more ranks compute, as the SM probe measured):", ""]
        lines += shared_chip.render(summary["shared_chip"], shared_chip.PROBE_SLOPE, "this run").splitlines()[2:]
    return lines


def render(summary: dict) -> str:
    v = summary.get("versions", {})
    link = summary["link"]
    lines = [f"# Pipeline schedules on SM partitions of one GPU, pp={summary['pp']} ({v.get('date', '')})", "",
             f"`python -m benchmarks.parallel.gpu_partitions --route {summary['route']} --host "
             f"{summary.get('host', 'one')} --micro-batch {summary.get('micro_batch', 1)}`. Versions: "
             + ", ".join(f"{k} {val}" for k, val in v.items()), "",
             f"Model (the project's Llama, bf16, micro-batch {summary.get('micro_batch', 1)}): {summary['model']}; "
             "decoder layers per stage "
             + "; ".join(f"{'/'.join(map(str, v))}" for v in summary["splits"].values())
             + f". {summary['warmup']} warm-up round(s), {summary['rounds']} measured. A boundary's copy on a "
             "partition: "
             f"{link['latency_s'] * 1e6:.0f} us ({link['boundary_bytes'] / 2**20:.0f} MiB).", ""]
    for check in summary["exactness"]:
        lines.append(f"Exactness, `{check['engine']}` m={check['m']}: loss partitioned {check['loss_partitioned']!r}, "
                     f"without partitions {check['loss_plain']!r} ({'equal' if check['losses_equal'] else 'DIFFER'});"
                     f" largest gradient difference {check['largest_grad_difference']:.3g} "
                     f"(largest gradient {check['largest_grad']:.3g}).")
    lines += [""] + report.table(summary["rows"]) + report.footer(summary)
    lines += diagnosis(summary)
    host = report.host_table(summary["rows"])
    if host:
        lines += ["", "The host (`--host " + summary.get("host", "one") + "`): when it had enqueued the whole step, "
                  "each rank's idle time, the part of it its partition waited for the host to enqueue the next "
                  "block (the block's enqueue began after the previous block had ended, and the block began within "
                  f"{report.LAUNCH_S * 1e3:.1f} ms of it), and the host time to enqueue one block.", ""] + host
    return "\n".join(lines + report.not_run_lines(summary)) + "\n"


def case_arguments(parser, *, each: str, microbatches: list[int]) -> None:
    """The arguments of the benchmarks that emulate pp GPUs on one (this one and
    `mps_ranks`); `each` says what a rank gets, `microbatches` is the default."""
    parser.add_argument("--pp", type=int, default=4, help=f"pipeline ranks, {each} (default 4)")
    parser.add_argument("--microbatches", type=lambda t: [int(x) for x in t.split(",")], default=microbatches,
                        help=f"microbatch counts, comma-separated (default {','.join(map(str, microbatches))})")
    parser.add_argument("--engines", type=lambda t: t.split(";"), default=list(ENGINES),
                        help="pp_engine values separated by ';' (default: every family this tree has)")
    parser.add_argument("--micro-batch", type=int, default=1,
                        help="sequences per microbatch (default 1); larger blocks give the device more work per "
                             "host enqueue")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first (default 1)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (default 3)")
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny model, four engines; writes nothing")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the results go (default benchmarks/results)")


def check_case_arguments(parser, args, threaded: str = "use --host threads or both instead") -> None:
    """Refuses (parser.error: exit 2, the value named) what `case_arguments` parsed but cannot
    run; `threaded` is what to say of an engine named with the host-thread suffix."""
    if args.pp < 2:
        parser.error(f"--pp {args.pp}: a pipeline of at least 2 ranks is accepted")
    for flag, value in (("--micro-batch", args.micro_batch), ("--rounds", args.rounds)):
        if value < 1:
            parser.error(f"{flag} {value}: a whole number >= 1 is accepted")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup}: a whole number >= 0 is accepted")
    if any(m < 1 for m in args.microbatches):
        parser.error(f"--microbatches {','.join(map(str, args.microbatches))}: whole numbers >= 1 are accepted")
    suffixed = [n for n in args.engines if n.endswith(report.HOST_THREADS)]
    if suffixed:
        parser.error(f"--engines: {', '.join(suffixed)}: {threaded}")
    unknown = [n for n in args.engines if not available([n])]
    if unknown:
        parser.error(f"--engines: {', '.join(unknown)}: not a family this tree has")


def main(argv=None) -> int:
    from benchmarks.llama.model import ModelConfig

    parser = argparse.ArgumentParser(prog="python -m benchmarks.parallel.gpu_partitions",
                                     description=__doc__.split("\n\n")[0])
    case_arguments(parser, each="one SM partition each", microbatches=[8, 32])
    parser.add_argument("--route", choices=("auto", "balanced", "driver", "torch", "streams"), default="auto",
                        help="how the partitions are made (default auto: balanced, else driver, else torch; "
                             "streams: no partition, a control)")
    parser.add_argument("--host", choices=("one", "threads", "both"), default="one",
                        help="one host thread enqueues every rank (default), a thread per rank, or both, "
                             "alternating")
    args = parser.parse_args(argv)
    check_case_arguments(parser, args)
    if args.smoke:
        args.engines, args.microbatches, args.rounds, device, streams = list(SMOKE_ENGINES), [4], 1, \
            torch.device("cpu"), None
        cfg = ModelConfig(**SMOKE_MODEL)
    else:
        if not torch.cuda.is_available():
            print("gpu_partitions: needs a CUDA GPU (or --smoke on CPU)", file=sys.stderr)
            return 2
        from pipeschedule.runtime.partitioned import sm_partitions

        device, cfg = torch.device("cuda"), ModelConfig(**MODEL)
        routes = ("balanced", "driver", "torch") if args.route == "auto" else (args.route,)
        for route in routes:
            try:
                contexts, streams = sm_partitions(args.pp, route=route)
                args.route = route
                break
            except Exception as err:  # noqa: BLE001  (a route this machine lacks: the next one, or the error)
                print(f"gpu_partitions: route {route}: {type(err).__name__}: {err}", file=sys.stderr)
        else:
            return 2
    partial = None if args.smoke else args.out / "parallel_gpu_partitions.partial.json"
    if partial is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    summary = measure(args, cfg, device, streams, partial)
    summary["versions"] = versions()
    markdown = render(summary)
    if not args.smoke:
        stem = "parallel_gpu_partitions" + ("_streams" if args.route == "streams" else "") \
            + ("" if args.host == "one" else f"_host_{args.host}") \
            + ("" if args.micro_batch == 1 else f"_mb{args.micro_batch}")
        report.write(stem, summary, markdown, args.out)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
