"""pp GPUs on one, a process and a host per rank: every schedule family under CUDA MPS, beside the simulator.

    python -m benchmarks.parallel.mps_ranks                   # one CUDA GPU, pp=4 processes (minutes)
    python -m benchmarks.parallel.mps_ranks --share 100       # the control: every rank may use every SM
    python -m benchmarks.parallel.mps_ranks --smoke           # CPU, a tiny model, gloo: the plumbing; writes nothing

`benchmarks.parallel.gpu_partitions` runs the pp ranks in one process, so one host thread
enqueues every rank's kernels; pp GPUs have pp hosts. Here each rank is its own process
(`pipeschedule.runtime.launch.spawn`), running pipeschedule's `Executor` over
torch.distributed as a real run does, with the messages over gloo through pinned host
memory (`HostStagedTransport`: NCCL refuses two ranks on one GPU). The processes are
clients of a private CUDA MPS daemon (benchmarks/parallel/mps.py), each limited to
`--share` percent of the SMs (default 100 / pp), so their kernels run side by side, each
on its own share, as the SM probe measured (parallel_sm_probe.md). Model, data and
engines are gpu_partitions': the project's Llama (bf16), its decoder layers cut into each
schedule's stages as evenly as they go; every rank builds the same weights on the host
and keeps on the GPU only the modules of its own stages for the case it runs. Every
case runs in one rotation (`--warmup` rounds unmeasured, then `--rounds`), so every
ratio between engines is paired round by round.

Per (engine, m), as gpu_partitions reports it (`benchmarks.parallel.report`): the step
from the common start (a barrier) to the last rank's end of device work, median over
rounds; each rank's busy time and bubble from CUDA events around every F, B and W; each
rank's peak live bytes (ledger) and peak allocated bytes (its process's allocator); the
simulator's step for the engine's schedule under the stage costs measured in these steps
and the one-way time of one boundary measured here (rank 0 and 1 ping-pong through the
transport: device to host, gloo, host to device); and the host's enqueue of every block (a
track of its own in the traces; gpu_partitions' table of host waits is not printed: here a
rank's host also waits for each message it receives, so a block enqueued late waited for
its data as often as for its host). A case that runs out of memory is reported, not run
again (every rank leaves the transport it failed on for a new one: [Note: no retry on a
failed group] in pipeschedule/runtime/transport.py). Writes `--out`/parallel_mps_ranks.json
and .md and one Chrome trace per case; prints the table last. `python -m
benchmarks.parallel.shared_chip --results <the .json>` adds the shared chip's rates to the
prediction.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch
import torch.distributed as dist

from benchmarks.common import rotated, versions
from benchmarks.parallel import report, shared_chip
from benchmarks.parallel.gpu_partitions import (MODEL, SMOKE_ENGINES, SMOKE_MODEL, available, case_arguments,
                                                check_case_arguments, diagnosis, even_split)
from benchmarks.parallel.predict import span_rows

LINK_REPEATS = 20
PREFIX = "mps-ranks"


# -- one rank ------------------------------------------------------------------------------


class Rank:
    """One rank's process: the model (every module on the host but its stages'), the data,
    the transport and one executor per case."""

    def __init__(self, rank: int, plan: dict, store):
        from benchmarks.llama.model import ModelConfig
        from benchmarks.llama.reference import microbatch
        from benchmarks.llama.stages import LlamaStages
        from benchmarks.training import to_device

        self.rank, self.plan, self.store = rank, plan, store
        self.device = torch.device("cuda", 0) if plan["cuda"] else torch.device("cpu")
        if plan["cuda"]:
            torch.cuda.set_device(self.device)
        self.cfg = ModelConfig(**plan["model"])
        self.model = LlamaStages(self.cfg, (self.cfg.layers,), "cpu", torch.bfloat16)  # the same weights everywhere
        self.params = list(self.model.parameters(0))
        batches = [to_device(microbatch(self.cfg, plan["micro_batch"], i, 7), self.device)
                   for i in range(max(plan["microbatches"]))]
        self.inputs = [{"input_ids": b["input_ids"]} for b in batches]
        self.targets = [{"label_ids": b["label_ids"], "label_mask": b["label_mask"]} for b in batches]
        self.views: dict[int, object] = {}
        self.executors: dict[tuple[str, int], object] = {}
        self.transports = 0
        self.transport = self._new_transport()

    def _new_transport(self):
        """A transport on a process group of its own, so that one a failed case used can be
        left behind (collective: every rank calls it in the same order)."""
        from pipeschedule.runtime import HostStagedTransport

        group = dist.new_group(backend="gloo")
        self.transports += 1
        return HostStagedTransport(self.store, group=group, prefix=f"{PREFIX}/{self.transports}/")

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def view(self, stages: int):
        """The model cut into `stages` stages (shared modules)."""
        if stages not in self.views:
            self.views[stages] = self.model.regrouped(even_split(self.cfg.layers, stages))
        return self.views[stages]

    def place(self, view, mine: set[int]) -> None:
        """Only the modules of this rank's stages on the device; every other on the host."""
        host = torch.device("cpu")
        count = len(view.split)
        for s in sorted(range(count), key=lambda s: s in mine):  # out first, then in
            for module in view.modules(s):
                module.to(self.device if s in mine else host)

    def executor(self, name: str, m: int):
        from pipeschedule.runtime import Executor
        from pipeschedule.runtime.timeline import Timeline

        if (name, m) not in self.executors:
            schedule = report.schedule_of(name, self.plan["pp"], m)
            built = Executor(schedule, self.rank, self.view(schedule.num_stages), self.transport, device=self.device,
                             timeout=600.0)
            built.timeline = Timeline(self.device)
            self.executors[name, m] = built
        return self.executors[name, m]

    def step(self, name: str, m: int) -> dict:
        """One measured step of the case on this rank; times are the host's clock
        (`time.perf_counter`, one clock for every process of the machine)."""
        executor = self.executor(name, m)
        schedule = executor.schedule
        for p in self.params:
            p.grad = None
        self.place(self.view(schedule.num_stages), set(schedule.stages_of(self.rank)))
        self.sync()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        dist.barrier()
        start = time.perf_counter()
        outputs = executor.step(self.inputs[:m] if self.rank == schedule.placement[0] else None,
                                self.targets[:m] if self.rank == schedule.placement[-1] else None)
        enqueued = time.perf_counter()
        self.sync()
        end = time.perf_counter()
        timeline = executor.timeline
        loss = (float(sum(out["loss"].float() for out in outputs)) if self.rank == schedule.placement[-1]
                else None)
        return {"start": start, "end": end, "enqueued": enqueued, "origin": timeline.host_origin,
                "spans": span_rows(timeline.spans()), "host": timeline.host_spans() if timeline.cuda else None,
                "loss": loss, "ledger_peak": executor.ledger.high_total,
                "cuda_peak": torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None}

    def forget(self) -> None:
        """After a failed case: every executor (they hold the failed transport), a new transport."""
        self.executors.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.transport = self._new_transport()


def one_way_seconds(rank: Rank) -> float | None:
    """Ranks 0 and 1 pass one boundary back and forth through the transport
    (`LINK_REPEATS` times after three unmeasured): half the median round trip, on rank 0;
    None on the others."""
    from pipeschedule.runtime import P2P

    if rank.rank > 1:
        return None
    size = rank.plan["micro_batch"] * rank.cfg.seq * rank.cfg.hidden
    buffer = torch.zeros(size, dtype=torch.bfloat16, device=rank.device)
    peer = 1 - rank.rank
    order = (True, False) if rank.rank == 0 else (False, True)
    times = []
    for _ in range(LINK_REPEATS + 3):
        start = time.perf_counter()
        for send in order:
            pending = rank.transport.post([P2P(send, peer, buffer)])
            while not pending.wait_for(1.0):
                pass  # the other rank is alive (spawn's timeout ends a dead pair)
            pending.finish()
        rank.sync()
        times.append((time.perf_counter() - start) / 2)
    sends = rank.transport.outstanding_sends()
    if sends is not None:
        while not sends.wait_for(1.0):
            pass
        sends.finish()
    return statistics.median(times[3:]) if rank.rank == 0 else None


def combine(rows: list[dict]) -> dict:
    """The ranks' rows of one step as one round of `report.case_row`: times from the
    earliest start; each rank's spans (device) and enqueues (host) moved from its own
    origin to that common start."""
    t0 = min(r["start"] for r in rows)
    spans, host = [], []
    for r in rows:
        shift = r["origin"] - t0
        spans.append([(op, s, mb, a + shift, b + shift) for op, s, mb, a, b in r["spans"]])
        host.append(None if r["host"] is None else [(a + shift, b + shift) for a, b in r["host"]])
    out = {"seconds": max(r["end"] for r in rows) - t0, "loss": next(r["loss"] for r in rows if r["loss"] is not None),
           "enqueue_s": max(r["enqueued"] for r in rows) - t0, "spans": spans, "offset_s": [0.0] * len(rows),
           "ledger_peak_bytes": [r["ledger_peak"] for r in rows], "cuda_peak_bytes": [r["cuda_peak"] for r in rows]}
    if all(h is not None for h in host):
        out["host"] = host
    return out


def rank_main(rank: int, world: int, store, plan: dict) -> dict | None:
    """Every case in rotation on this rank; rank 0 returns {"rounds": [[engine, m, round], ...],
    "failed": {...}, "link_s"}, the others None."""
    me = Rank(rank, plan, store)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, one_way_seconds(me))
    link_s = gathered[0]
    cases = [(name, m) for m in plan["microbatches"] for name in plan["engines"]]
    rounds: list = []
    failed: dict[str, str] = {}
    for k in range(plan["warmup"] + plan["rounds"]):
        for name, m in rotated(cases, k):
            if f"{name} m={m}" in failed:
                continue
            try:
                row, error = me.step(name, m), None
            except Exception as err:  # noqa: BLE001  (every rank learns of every rank's failure below)
                row, error = None, f"rank {rank}: {type(err).__name__}: {str(err).splitlines()[0][:300]}"
            dist.all_gather_object(gathered, (row, error))
            errors = [e for _r, e in gathered if e is not None]
            if errors:
                if not any("out of memory" in e for e in errors):
                    raise RuntimeError(f"{name} m={m} failed: {' | '.join(errors)}")
                failed[f"{name} m={m}"] = next(e for e in errors if "out of memory" in e)
                me.forget()
                continue
            if k >= plan["warmup"] and rank == 0:
                rounds.append([name, m, combine([r for r, _e in gathered])])
        if rank == 0:
            print(f"round {k + 1} of {plan['warmup'] + plan['rounds']} done", flush=True)
    return {"rounds": rounds, "failed": failed, "link_s": link_s} if rank == 0 else None


# -- the parent ------------------------------------------------------------------------------


def measure(plan: dict, threads: int, timeout: float) -> dict:
    from pipeschedule.runtime.launch import spawn

    result = spawn(rank_main, plan["pp"], args=(plan,), timeout=timeout, grace=60.0, threads=threads)[0]
    link = {"boundary_bytes": plan["micro_batch"] * plan["model"]["seq"] * plan["model"]["hidden"] * 2,
            "latency_s": result["link_s"], "bandwidth": float("inf")}
    by_case: dict[tuple[str, int], list[dict]] = {}
    for name, m, row in result["rounds"]:
        by_case.setdefault((name, m), []).append(row)
    rows = [report.case_row(name, m, "mps", rounds, report.schedule_of(name, plan["pp"], m), link)
            for (name, m), rounds in by_case.items()]
    report.compare(rows)
    shared = shared_chip.table({"pp": plan["pp"], "link": link, "rows": rows}, shared_chip.PROBE_SLOPE)
    return {"shared_chip": shared,
            **{k: plan[k] for k in ("pp", "share", "micro_batch", "microbatches", "rounds", "warmup", "model")},
            "splits": {str(n): even_split(plan["model"]["layers"], n) for n in sorted(
                {report.schedule_of(r["engine"], plan["pp"], r["m"]).num_stages for r in rows})},
            "link": link, "rows": rows,
            "not_run": [{"engine": key.split(" m=")[0], "m": int(key.split(" m=")[1]), "why": why}
                        for key, why in result["failed"].items()],
            "losses_equal": report.losses_equal(rows, report.REFERENCE)}


def memory_table(rows: list[dict]) -> list[str]:
    lines = ["| engine | m | peak allocated per rank, GiB (the rank's process) | peak live per rank, GiB (ledger) |",
             "|---|---|---|---|"]
    for r in rows:
        cuda = r.get("cuda_peak_bytes") or []
        if not any(cuda):
            return []
        lines.append(f"| `{r['engine']}` | {r['m']} | " + "/".join(f"{b / 2**30:.2f}" for b in cuda) + " | "
                     + "/".join(f"{b / 2**30:.2f}" for b in r["ledger_peak_bytes"]) + " |")
    return lines


def render(summary: dict) -> str:
    v = summary.get("versions", {})
    link = summary["link"]
    lines = [f"# Pipeline schedules as {summary['pp']} processes on one GPU under MPS ({v.get('date', '')})", "",
             f"`python -m benchmarks.parallel.mps_ranks --share {summary['share']} --micro-batch "
             f"{summary['micro_batch']}`. Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()), "",
             f"Model (the project's Llama, bf16, micro-batch {summary['micro_batch']}): {summary['model']}; decoder "
             "layers per stage " + "; ".join("/".join(map(str, s)) for s in summary["splits"].values())
             + f". Each rank a process with {summary['share']}% of the SMs; {summary['warmup']} warm-up round(s), "
             f"{summary['rounds']} measured, every case in one rotation. One boundary "
             f"({link['boundary_bytes'] / 2**20:.0f} MiB) from a rank to the next through the transport: "
             f"{link['latency_s'] * 1e3:.2f} ms.", ""]
    lines += report.table(summary["rows"]) + report.footer(summary)
    lines += diagnosis(summary)
    memory = memory_table(summary["rows"])
    if memory:
        lines += [""] + memory
    return "\n".join(lines + report.not_run_lines(summary)) + "\n"


def main(argv=None) -> int:
    from benchmarks.parallel import mps
    from pipeschedule.errors import LaunchError

    parser = argparse.ArgumentParser(prog="python -m benchmarks.parallel.mps_ranks",
                                     description=__doc__.split("\n\n")[0])
    case_arguments(parser, each="one process each", microbatches=[8])
    parser.add_argument("--share", type=int, default=None,
                        help="percent of the SMs each rank's process may use, 1..100 (default 100 / pp)")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads per rank (default 2)")
    parser.add_argument("--commit", default=None, help="the commit to name in the results (default: git's)")
    args = parser.parse_args(argv)
    check_case_arguments(parser, args, f"every rank has its own host here; give the engine without "
                                       f"{report.HOST_THREADS}")
    if args.threads < 1:
        parser.error(f"--threads {args.threads}: a whole number >= 1 is accepted")
    share = 100 // args.pp if args.share is None else args.share
    if not 1 <= share <= 100:
        parser.error(f"--share {share}: a whole percentage 1..100 is accepted")
    engines = available(args.engines)
    plan = {"pp": args.pp, "share": share, "micro_batch": args.micro_batch, "microbatches": args.microbatches,
            "engines": engines, "warmup": args.warmup, "rounds": args.rounds, "cuda": not args.smoke,
            "model": dict(MODEL)}
    if args.smoke:
        plan.update(engines=list(SMOKE_ENGINES), microbatches=[4], rounds=1, model=dict(SMOKE_MODEL))
    elif not torch.cuda.is_available():
        print("mps_ranks: needs a CUDA GPU (or --smoke on CPU)", file=sys.stderr)
        return 2
    try:
        if args.smoke:
            summary = measure(plan, threads=1, timeout=600)
        else:
            with mps.daemon() as env, mps.clients(env, share):
                summary = measure(plan, threads=args.threads, timeout=3000)
    except (mps.MPSUnavailable, LaunchError) as err:
        print(f"mps_ranks: {err}", file=sys.stderr)
        return 2 if isinstance(err, mps.MPSUnavailable) else 1
    from dataclasses import asdict

    from benchmarks.llama.model import ModelConfig

    summary["model"] = asdict(ModelConfig(**summary["model"]))
    summary["versions"] = versions(args.commit)
    markdown = render(summary)
    if not args.smoke:
        stem = "parallel_mps_ranks" + ("" if args.share is None else f"_share{share}") \
            + ("" if args.micro_batch == 1 else f"_mb{args.micro_batch}")
        report.write(stem, summary, markdown, args.out)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
