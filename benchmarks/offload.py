"""Host offload and the buffer pool on one GPU (issue 9).

    python -m benchmarks.offload            # on one CUDA GPU (a few minutes on an H200)
    python -m benchmarks.offload --smoke    # a tiny model on CPU: checks the plumbing, writes nothing

The project's Llama (`benchmarks.common.MODEL`, bf16) at pp=4 as four processes on the
one GPU, gloo between them, boundaries staged through pinned host memory
(`HostStagedTransport`), as in `benchmarks.gpu`; each rank builds only its own stage's
blocks on the GPU and runs pipeschedule's `Executor` directly (no nanotron engine).
Before each step the peak statistics are reset, so peaks are the step's own.

1. Offload fractions: 1f1b at m=8 with rank 0 (stage 0) offloading a fraction 0, 0.25,
   0.5, 0.75, 1.0 of its stashes (`pipeschedule.compiler.offload.add_offload`, lead 1; the longest
   waits first), the other ranks none; and 0.25, 0.5, 1.0 streamed in 64 MiB chunks
   (`Executor(offload_chunk=)`, [Note: streamed offload]). Per fraction: stage 0's peak allocated memory,
   its ledger peaks (device stash, host) and the step time: the cases run in rounds and
   the slowdown is paired round by round ([Note: paired offload rounds]). Beside them, the
   simulator's predicted fall in stage 0's peak and its slowdown
   (`pipeschedule.simulate.offload_search.evaluate_offload`), from costs calibrated here (one decoder
   layer, embedding, head; `benchmarks.calibration`) with the host link measured on the
   H200 lent here (55.4 GB/s each way, issue 9) and a 2% compute slowdown while copying.
   Four processes share one GPU, so the measured step time is that of one GPU running
   all stages; the simulator's is four GPUs': compare slowdowns, not times.
2. The buffer pool: 1f1b without offload at m = 8, 32, 128, pool on and off: reserved
   memory per stage (`torch.cuda.max_memory_reserved` of each rank's process, and the
   reserved memory after the step) and the pool's allocation count. Beside them
   (part "nanotron"), nanotron's own 1F1B engine at the same m on the same model, split
   and micro-batch size, through `benchmarks.training.run_cases` ('shared' mode: four
   processes on the GPU, boundaries through `HostStagedP2P`, [Note: host-staged P2P]),
   which also runs an AdamW step after each training step. The check says whether each
   grows with m: some stage's peak reserved rising more than `GROWTH_MIB` from the
   smallest m to the largest.
3. Offload selected in the `pp_engine` value (`ps_1f1b:offload=0[,stream=64]`), run
   through nanotron's engine interface (part "engine"): stage 0's peak allocated memory
   and step time, the three cases in rounds and their slowdowns paired as the fractions'
   ([Note: paired engine rounds] in benchmarks/training.py).

Writes benchmarks/results/offload.json (raw) and offload.md (tables); prints the tables last.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks import training
from benchmarks.common import MICROBATCH_SIZE, MODEL, PP, RESULTS, SMOKE_MODEL, WARMUP, rotated, versions, write_results
from benchmarks.llama.model import ModelConfig
from benchmarks.llama.stages import LlamaStages
from benchmarks.training import model_split, sync, to_device
from pipeschedule.compiler.offload import OffloadPolicy, add_offload
from pipeschedule.simulate.offload_search import evaluate_offload

FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
STREAM_FRACTIONS = (0.25, 0.5, 1.0)  # streamed ([Note: streamed offload]) in chunks of:
STREAM_CHUNK, SMOKE_CHUNK = 64 * 2**20, 4096
OFFLOAD_M = 8
POOL_MS = (8, 32, 128)
LEAD = 1
STEPS = 3
ROUNDS = 5  # of the fractions ([Note: paired offload rounds])
H200_HOST_GBPS = 55.4  # pinned copies each way, measured on the H200 lent here (issue 9)
COPY_SLOWDOWN = 0.02  # matmuls beside a 1 GiB device-to-host copy: 28.4 ms against 27.8 ms (issue 9)
NANOTRON_LABEL = "nanotron 1f1b"
# Twice the widest spread over m = 8..128 of pipeschedule's peak reserved per stage, pool on
# or off, on the H200 (32 MiB; benchmarks/results/offload.md): a rise beyond it is growth.
GROWTH_MIB = 64


def offload_schedule(base, fraction: float):
    """`base` with rank 0 offloading `fraction` of its stashes, lead LEAD."""
    return add_offload(base, OffloadPolicy(fraction=fraction, ranks=(0,), lead=LEAD))


# -- one rank ----------------------------------------------------------------------------------


class RankStages(LlamaStages):
    """`LlamaStages` with only `rank`'s stages on the device (the rest stay on the host,
    unused), so each process holds its own stage's parameters, as in a real run."""

    def __init__(self, cfg, split, device, dtype, stages):
        super().__init__(cfg, split, torch.device("cpu"), dtype)
        for s in stages:
            self.layers[s].to(device)
        if 0 in stages:
            self.embedding.to(device)
        if len(split) - 1 in stages:
            self.norm.to(device)
            self.head.to(device)


def stage_data(cfg, m: int, seed: int, device):
    from benchmarks.llama.reference import microbatch

    batches = [to_device(microbatch(cfg, MICROBATCH_SIZE, i, seed), device) for i in range(m)]
    return [{"input_ids": b["input_ids"]} for b in batches], [
        {"label_ids": b["label_ids"], "label_mask": b["label_mask"]} for b in batches]


def _run(executor, stages, cfg, m: int, device, rank: int, steps: int) -> dict:
    """`WARMUP + steps` steps of one executor; the step's own peaks, the medians."""
    import torch.distributed as dist

    params = [p for s in executor.schedule.stages_of(rank) for p in stages.parameters(s)]
    rows = []
    for step in range(WARMUP + steps):
        inputs, targets = stage_data(cfg, m, 1234 + step, device)
        for p in params:
            p.grad = None
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        dist.barrier()
        start = time.perf_counter()
        executor.step(inputs if rank == executor.schedule.placement[0] else None,
                      targets if rank == executor.schedule.placement[-1] else None)
        sync(device)
        seconds = time.perf_counter() - start
        ledger = executor.ledger
        rows.append({
            "seconds": seconds,
            "peak_allocated": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "peak_reserved": torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None,
            "reserved_after": torch.cuda.memory_reserved(device) if device.type == "cuda" else None,
            "ledger_peak": ledger.high_total, "ledger_stash_peak": ledger.high["stash"],
            "ledger_host_peak": ledger.high_host_total, "moved_bytes": sum(ledger.moved.values()),
            "pool_allocations": executor.pool.allocations if executor.pool is not None else None,
            "host_pool_allocations": executor.offloader.host_pool.allocations,
        })
    measured = rows[WARMUP:]
    out = {key: max((r[key] for r in measured if r[key] is not None), default=None)
           for key in rows[0] if key != "seconds"}
    out["seconds"] = statistics.median(r["seconds"] for r in measured)
    out["all_seconds"] = [r["seconds"] for r in measured]
    out["per_step"] = rows
    sizes = {}
    for (kind, stage, mb), size in executor.ledger.sizes.items():
        if mb == 0:
            sizes.setdefault(kind, {})[stage] = size
    out["buffer_bytes_mb0"] = sizes
    return out


def worker(rank: int, world: int, store, cfg, plan: list[dict], steps: int, rounds: int) -> list[dict]:
    """One rank: every case of `plan` ({"part", "schedule" (JSON), "pool", ...}); the
    fractions in `rounds` rounds ([Note: paired offload rounds]), the rest one after
    another, `steps` measured steps each."""
    from pipeschedule.compiler.ir import Schedule
    from pipeschedule.runtime import Executor, HostStagedTransport

    torch.set_num_threads(2)
    if torch.cuda.is_available():
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    split = model_split(cfg, world)
    torch.manual_seed(0)
    stages = RankStages(cfg, split, device, dtype, [rank])
    transport = HostStagedTransport(store, prefix="offload-bench/")

    def run_case(case: dict, measured: int) -> dict:
        schedule = Schedule.from_json(case["schedule"])
        executor = Executor(schedule, rank, stages, transport, device=device, pool=case["pool"], timeout=600,
                            offload_chunk=case.get("chunk"))
        row = _run(executor, stages, cfg, schedule.microbatches, device, rank, measured)
        del executor
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return row

    rows: dict[int, dict] = {}
    paired = [k for k, case in enumerate(plan) if case["part"] == "fractions"]
    per_round: dict[int, list[dict]] = {k: [] for k in paired}
    for r in range(rounds if paired else 0):
        for k in rotated(paired, r):
            per_round[k].append(run_case(plan[k], 1))
    for k in paired:
        rows[k] = training.merge_rounds(per_round[k], "per_step")
    for k, case in enumerate(plan):
        if k not in rows:
            rows[k] = run_case(case, steps)
    return [{**{key: v for key, v in case.items() if key != "schedule"}, "rank": rank, **rows[k]}
            for k, case in enumerate(plan)]


# [Note: paired offload rounds] Step times measured one case after another move by 3-6%
# on this shared machine, as much as the smaller slowdowns being measured. So the
# fractions run in rounds: each round builds every case's executor in turn (the order
# rotating by one each round), runs WARMUP steps and one measured step, and drops it. A
# case's slowdown is the median over rounds of its step against fraction 0's step of the
# same round (`paired_slowdown`); its peaks are the largest of its measured steps, each
# step's own (the peak statistics are reset before it), as before (`training.merge_rounds`).


def paired_slowdown(row: dict, base: dict) -> float:
    """Median over rounds of (this case's step / the base's step in the same round) - 1
    ([Note: paired offload rounds]); the ratio of medians where the rows were not
    measured in rounds (results from before)."""
    if row.get("rounds") and row.get("rounds") == base.get("rounds"):
        return statistics.median(a / b for a, b in zip(row["all_seconds"], base["all_seconds"])) - 1
    return row["seconds"] / base["seconds"] - 1


# -- the plan, the predictions, the report ----------------------------------------------------


def plan_cases(smoke: bool, skip: set[str]) -> list[dict]:
    from pipeschedule import compile_schedule

    cases = []
    if "fractions" not in skip:
        base = compile_schedule("1f1b", pp=PP, microbatches=4 if smoke else OFFLOAD_M)
        streamed = [(f, SMOKE_CHUNK if smoke else STREAM_CHUNK) for f in STREAM_FRACTIONS]
        for f, chunk in [(f, None) for f in FRACTIONS] + streamed:
            schedule = offload_schedule(base, f) if f > 0 else base
            cases.append({"part": "fractions", "fraction": f, "chunk": chunk, "pool": True, "m": base.microbatches,
                          "schedule": schedule.to_json()})
    if "pool" not in skip:
        for m in ((4, 8) if smoke else POOL_MS):
            base = compile_schedule("1f1b", pp=PP, microbatches=m)
            for pool in (True, False):
                cases.append({"part": "pool", "pool": pool, "m": m, "schedule": base.to_json()})
    return cases


ENGINE_CASES = (("ps_1f1b", "ps_1f1b"), ("offload=0", "ps_1f1b:offload=0"),
                ("offload=0,stream=64", "ps_1f1b:offload=0,stream=64"))


def _run_shared(cfg, case_list, smoke: bool, rounds: int = 1):
    """`training.run_cases` of the cases through nanotron's engine interface, four processes
    on the one GPU, this benchmark's micro-batch size and steps (or `rounds`: [Note:
    paired engine rounds] in benchmarks/training.py): (rows, skipped)."""
    return training.run_cases(cfg, case_list, pp=PP, mode="shared", microbatch_size=MICROBATCH_SIZE,
                              warmup=WARMUP, steps=1 if smoke else STEPS, timeout=300 if smoke else 1500,
                              rounds=rounds)


def measure_engines(cfg, *, smoke: bool) -> tuple[list[dict], list[dict]]:
    """Part 3: offload selected in the `pp_engine` value, through nanotron's engine interface
    (`benchmarks.training.run_cases`, with an AdamW step): pipeschedule's 1F1B at m=8
    plain, with rank 0 offloading every stash whole, and streamed in 64 MiB chunks; the
    three in rounds, so that the slowdowns are paired ([Note: paired offload rounds])."""
    m = 4 if smoke else OFFLOAD_M
    rows, skipped = _run_shared(cfg, [training.Case(label, engine, 1, m) for label, engine in ENGINE_CASES], smoke,
                                rounds=2 if smoke else ROUNDS)
    keys = ("peak_allocated", "peak_reserved", "seconds", "ledger_peak", "all_seconds", "rounds")
    return [{"label": row["case"]["label"], "engine": row["case"]["engine"], "m": m,
             "ranks": [{k: rank.get(k) for k in keys} for rank in row["ranks"]]} for row in rows], skipped


def measure_nanotron(cfg, *, smoke: bool) -> tuple[list[list[dict]], list[dict]]:
    """nanotron's own 1F1B at POOL_MS (part 2): rows shaped as the pool part's (one dict
    per rank), and the cases `run_cases` left out with the reason."""
    case_list = [training.Case(NANOTRON_LABEL, "1f1b", 1, m) for m in ((4, 8) if smoke else POOL_MS)]
    rows, skipped = _run_shared(cfg, case_list, smoke)
    keys = ("peak_allocated", "peak_reserved", "reserved_after", "seconds", "all_seconds")
    return [[{"part": "nanotron", "m": row["case"]["microbatches"], "rank": r, **{k: rank[k] for k in keys}}
             for r, rank in enumerate(row["ranks"])] for row in rows], skipped


def predictions(cfg, calibration: dict, fractions_rows: list[list[dict]], m: int) -> list[dict] | None:
    """Per fraction, the simulator's stage-0 device peak fall and slowdown
    (`pipeschedule.simulate.offload_search.evaluate_offload`)."""
    from benchmarks.costs import stage_costs
    from pipeschedule import compile_schedule
    from pipeschedule.simulate import CostModel

    merged: dict[str, dict] = {}
    for rank_row in fractions_rows[0]:  # fraction 0: the plain buffer sizes
        for kind, per_stage in rank_row["buffer_bytes_mb0"].items():
            merged.setdefault(kind, {}).update(per_stage)
    cost = stage_costs(calibration, model_split(cfg, PP), merged, split_backward=False)
    per_ms = H200_HOST_GBPS * 1e9 / 1e3
    cost.update(offload_bandwidth=per_ms, reload_bandwidth=per_ms, offload_slowdown=COPY_SLOWDOWN)
    base = compile_schedule("1f1b", pp=PP, microbatches=m)
    model = CostModel.from_dict(cost, base)
    out = []
    for row in fractions_rows:
        f, chunk = row[0]["fraction"], row[0].get("chunk")
        choice = evaluate_offload(base, model, OffloadPolicy(fraction=f, ranks=(0,), lead=LEAD, chunk=chunk))
        out.append({"fraction": f, "chunk": chunk, "peak_before": choice.peak_before[0],
                    "peak_after": choice.peak_after[0],
                    "predicted_fall": choice.peak_before[0] - choice.peak_after[0], "slowdown": choice.slowdown,
                    "step_ms": choice.step_time, "base_step_ms": choice.base_step_time})
    return out


def measure(cfg, *, smoke: bool, skip: set[str], commit: str | None) -> dict:
    from pipeschedule.runtime.launch import spawn

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    report = {"versions": versions(commit), "model": asdict(cfg), "pp": PP, "lead": LEAD,
              "microbatch_size": MICROBATCH_SIZE, "dtype": str(dtype).replace("torch.", ""),
              "host_gbps": H200_HOST_GBPS, "copy_slowdown": COPY_SLOWDOWN}
    print(f"model {cfg}, pp={PP}, {dtype}, {report['versions'].get('gpus', 'cpu')}", flush=True)
    if "fractions" not in skip:
        from benchmarks.calibration import run_calibration

        t = time.perf_counter()
        report["calibration_ms"] = run_calibration(cfg, device, dtype, repeats=3 if smoke else 20)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"[calibration] {time.perf_counter() - t:.1f} s", flush=True)
    cases = plan_cases(smoke, skip)
    t = time.perf_counter()
    ranks = spawn(worker, PP, timeout=300 if smoke else 1500,
                  args=(cfg, cases, 1 if smoke else STEPS, 2 if smoke else ROUNDS))
    print(f"[runs] {len(cases)} cases in {time.perf_counter() - t:.1f} s", flush=True)
    rows = [[ranks[r][k] for r in range(PP)] for k in range(len(cases))]
    report["fractions"] = [row for row in rows if row[0]["part"] == "fractions"]
    report["pool"] = [row for row in rows if row[0]["part"] == "pool"]
    if "nanotron" not in skip:
        t = time.perf_counter()
        report["nanotron"], report["nanotron_skipped"] = measure_nanotron(cfg, smoke=smoke)
        print(f"[nanotron] {time.perf_counter() - t:.1f} s; skipped: {report['nanotron_skipped']}", flush=True)
    if "engine" not in skip:
        t = time.perf_counter()
        report["engine"], report["engine_skipped"] = measure_engines(cfg, smoke=smoke)
        print(f"[engine] {time.perf_counter() - t:.1f} s; skipped: {report['engine_skipped']}", flush=True)
    if report["fractions"]:
        report["predictions"] = predictions(cfg, report["calibration_ms"], report["fractions"],
                                            report["fractions"][0][0]["m"])
    return report


def _mb(x) -> str:
    return "-" if x is None else f"{x / 2**20:.2f}"


def _fraction_lines(report: dict) -> list[str]:
    """The section of part 1 (offload fractions) of `render`; [] where the report has none."""
    fractions, predicted = report.get("fractions", []), report.get("predictions")
    if not fractions:
        return []
    m = fractions[0][0]["m"]
    base = fractions[0][0]
    lines = [f"## Stage 0 offloading a fraction of its stashes (1f1b, m={m}, lead {report['lead']})", ""]
    if predicted is None:
        lines += ["The simulator's predictions are not in this report.", ""]
    lines += ["stream: whole stashes, or streamed in chunks of that many MiB ([Note: streamed offload]).", ""]
    if not base.get("rounds"):
        lines += ["step s and slowdown: each case's median of its steps, the cases run one after another, so the "
                  "slowdowns carry the machine's drift between cases (3-6% on this shared machine); runs since "
                  "pair them round by round ([Note: paired offload rounds]).", ""]
    else:
        lines += [f"The cases ran in {base['rounds']} rounds, each building every case's executor in turn "
                  "(the order rotating), a warm-up step and one measured step: step s is a case's median over "
                  "rounds, slowdown the median over rounds of its step against fraction 0's in the same round "
                  "([Note: paired offload rounds] in benchmarks/offload.py); peaks are the largest measured.", ""]
    head = ("| fraction | stream | peak allocated MiB | fall MiB | ledger stash peak MiB | host peak MiB "
            "| step s | slowdown |" + (" predicted fall MiB | predicted slowdown |" if predicted else ""))
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for k, row in enumerate(fractions):
        r0 = row[0]
        fall = None if r0["peak_allocated"] is None else base["peak_allocated"] - r0["peak_allocated"]
        chunk = r0.get("chunk")
        line = (f"| {r0['fraction']:.2f} | {'whole' if chunk is None else f'{chunk / 2**20:g}'} | "
                f"{_mb(r0['peak_allocated'])} | {_mb(fall)} | {_mb(r0['ledger_stash_peak'])} | "
                f"{_mb(r0['ledger_host_peak'])} | {r0['seconds']:.3f} "
                f"| {paired_slowdown(r0, base):+.1%} |")
        if predicted:
            p = predicted[k]
            line += f" {_mb(p['predicted_fall'])} | {p['slowdown']:+.1%} |"
        lines.append(line)
    lines.append("")
    return lines


def render(report: dict, out_dir: Path | None) -> str:
    lines = [f"# Host offload and the buffer pool on one GPU ({report['versions']['date']})", "",
             "Command: `python -m benchmarks.offload`. Versions: "
             + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), "",
             f"Model: {report['model']}, micro-batch size {report['microbatch_size']}, {report['dtype']}, pp={PP} "
             "(four processes on one GPU, gloo, host-staged boundaries), pipeschedule's Executor, no optimizer.", ""]
    if report.get("measured_in"):
        lines += [f"Measured in {report['measured_in']}.", ""]
    lines += _fraction_lines(report)
    pool_rows = report.get("pool", []) + report.get("nanotron", [])
    if pool_rows:
        about_nanotron = (f" {NANOTRON_LABEL}: nanotron's own engine on the same model (boundaries through "
                          "`HostStagedP2P`), with an AdamW step after each step, so its levels include optimizer "
                          "state: compare how each engine's memory changes with m, not the levels."
                          if report.get("nanotron") else "")
        lines += ["## Reserved memory per stage with and without the buffer pool, and nanotron's 1F1B (no offload)",
                  "", "MiB: peak reserved during the step / reserved after it; allocations: the pool's buffers."
                  + about_nanotron, "",
                  "| engine | m | pool | " + " | ".join(f"stage {r} reserved" for r in range(PP))
                  + " | pool allocations | step s |", "|" + "---|" * (PP + 5)]
        for row in sorted(pool_rows, key=lambda row: row[0]["m"]):  # stable: pool on, off, nanotron's
            nanotron = row[0]["part"] == "nanotron"
            cells = " | ".join(f"{_mb(r['peak_reserved'])} / {_mb(r['reserved_after'])}" for r in row)
            allocations = "-" if row[0].get("pool_allocations") is None else str([r["pool_allocations"] for r in row])
            lines.append(f"| {NANOTRON_LABEL if nanotron else 'pipeschedule 1f1b'} | {row[0]['m']} | "
                         f"{'-' if nanotron else 'on' if row[0]['pool'] else 'off'} | {cells} | {allocations} | "
                         f"{statistics.median(r['seconds'] for r in row):.3f} |")
        lines += ["", "step s: the median of each engine's steps, run one engine after the other, nanotron's with an "
                  "optimizer step: not a comparison of the engines' speed (separate runs on this shared machine move "
                  "by 3-6%). Paired, alternating runs of the two engines are in "
                  "[engine_vs_nanotron.md](engine_vs_nanotron.md).", ""]
        lines += [f"- {NANOTRON_LABEL} at m={s['case']['microbatches']} not run: {s['why']}"
                  for s in report.get("nanotron_skipped", [])]
        lines += _pool_check(pool_rows)
    engine_rows = report.get("engine", [])
    if engine_rows:
        base = engine_rows[0]["ranks"][0]
        lines += [f"## Offload chosen in `pp_engine`, through nanotron's engine interface "
                  f"(1f1b, m={engine_rows[0]['m']})",
                  "", "Stage 0 (rank 0) offloads; an AdamW step follows each step.", "",
                  "| pp_engine | stage 0 peak allocated MiB | fall MiB | step s | slowdown |", "|---|---|---|---|---|"]
        for row in engine_rows:
            r0 = row["ranks"][0]
            fall = None if r0["peak_allocated"] is None else base["peak_allocated"] - r0["peak_allocated"]
            seconds = statistics.median(r["seconds"] for r in row["ranks"])
            base_seconds = statistics.median(r["seconds"] for r in engine_rows[0]["ranks"])
            slowdown = paired_slowdown(r0, base) if base.get("rounds") else seconds / base_seconds - 1
            lines.append(f"| `{row['engine']}` | {_mb(r0['peak_allocated'])} | {_mb(fall)} | {seconds:.3f} | "
                         f"{slowdown:+.1%} |")
        rounds = base.get("rounds")
        lines += ["", f"slowdown: the median over {rounds} rounds of the step against `{engine_rows[0]['engine']}`'s "
                  "step of the same round (rank 0; [Note: paired engine rounds] in benchmarks/training.py)."
                  if rounds else "slowdown: ratio of medians of steps measured one case after another (unpaired: "
                  "separate runs on this shared machine move by 3-6%)."]
        lines += [f"- `{s['case']['engine']}` not run: {s['why']}" for s in report.get("engine_skipped", [])] + [""]
    text = "\n".join(lines) + "\n"
    if out_dir is not None:
        (out_dir / "offload.md").write_text(text)
    return text


def _pool_check(pool_rows) -> list[str]:
    """Per engine (pipeschedule's 1f1b with the pool on and off, nanotron's 1f1b): how
    much peak reserved memory per stage varies over m, and whether it grows with m (some
    stage rising more than GROWTH_MIB from the smallest m to the largest)."""
    groups = (("pool on", lambda row: row[0]["part"] == "pool" and row[0]["pool"]),
              ("pool off", lambda row: row[0]["part"] == "pool" and not row[0]["pool"]),
              (NANOTRON_LABEL, lambda row: row[0]["part"] == "nanotron"))
    out = []
    for name, member in groups:
        rows = sorted((row for row in pool_rows if member(row)), key=lambda row: row[0]["m"])
        if len(rows) < 2 or rows[0][0]["peak_reserved"] is None:
            continue
        spread = [max(row[r]["peak_reserved"] for row in rows) - min(row[r]["peak_reserved"] for row in rows)
                  for r in range(PP)]
        rise = [rows[-1][r]["peak_reserved"] - rows[0][r]["peak_reserved"] for r in range(PP)]
        worst = max(range(PP), key=lambda r: rise[r])
        span = f"from m={rows[0][0]['m']} to m={rows[-1][0]['m']}"
        verdict = (f"grows with m (stage {worst} +{_mb(rise[worst])} MiB {span})" if rise[worst] > GROWTH_MIB * 2**20
                   else f"flat (no stage rises more than {GROWTH_MIB} MiB {span})")
        out.append(f"- {name}: peak reserved varies over m by "
                   + ", ".join(f"stage {r} {_mb(s)} MiB" for r, s in enumerate(spread)) + f"; {verdict}")
    return out + [""] if out else []


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.offload", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, one step per case, CPU allowed; writes "
                        "nothing unless --out is given")
    parser.add_argument("--out", type=Path, default=None, help="folder for the results (default benchmarks/results/)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: fractions,pool,nanotron,engine")
    parser.add_argument("--commit", default=None, help="the commit measured (recorded in the results)")
    args = parser.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    if skip - {"fractions", "pool", "nanotron", "engine"}:
        parser.error(f"--skip {args.skip!r}: accepted parts are fractions, pool, nanotron, engine")
    if not args.smoke and not torch.cuda.is_available():
        print("benchmarks.offload: no CUDA GPU here; --smoke runs the plumbing on CPU", file=sys.stderr)
        return 2
    out_dir = args.out if args.out is not None else (None if args.smoke else RESULTS)
    report = measure(ModelConfig(**(SMOKE_MODEL if args.smoke else MODEL)), smoke=args.smoke, skip=skip,
                     commit=args.commit)
    if out_dir is not None:
        write_results("offload", report, out=out_dir)
    print(render(report, out_dir), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
