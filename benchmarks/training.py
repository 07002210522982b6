"""Real training steps of the integration's Llama under each engine, measured per rank.

Shared by the one-GPU benchmark (`benchmarks.gpu`: four processes on one GPU, gloo,
host-staged boundaries) and the multi-GPU one (`benchmarks.multi_gpu`: one process per
GPU, NCCL). On a machine without CUDA both run on CPU over gloo (their `--smoke` /
`--dry-run` modes), which is how the plumbing is tested.

A `Case` is one engine (a `pp_engine` value: nanotron's own `1f1b` / `afab`, or one of
pipeschedule's) at m microbatches. Each case runs `warmup + steps` training steps
(`engine.train_batch_iter`, then an AdamW step and `zero_grad(set_to_none=True)`).
Before each step the peak statistics are reset, so `peak_allocated` / `peak_reserved`
are that step's own peaks (`torch.cuda.max_memory_*` of the rank's process), and
`reserved_after` is what the allocator still reserves once the step has ended. Beside
them: parameter, optimizer-state and gradient bytes, and for pipeschedule's engines the
runtime ledger's peak of live buffers; and, for every case, the memory model's
prediction (`benchmarks.llama.probe.predict`).

Each rank appends one JSON line per finished case to a progress file, so a case that
fails (out of memory, say) loses only itself and the cases after it.
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import integration.nanotron  # noqa: F401  (first: nanotron 0.4 imports once repaired; installs the patches)
from integration.nanotron.pipeline import split as splits
from benchmarks.common import FIT_SHARE, RANK_OVERHEAD_BYTES, rotated
from benchmarks.llama.model import ModelConfig
from integration.nanotron.pipeline.engine_spec import NANOTRON_ENGINES
from pipeschedule.compiler.families import FAMILIES
from pipeschedule.errors import LaunchError

# The multi-GPU benchmark's model (about 3.6B parameters, Llama-3.2-3B's shape, seq 4096):
# calibrated on one GPU by benchmarks.gpu, run on four by benchmarks.multi_gpu.
MODEL_X4 = ModelConfig(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, vocab=128256, seq=4096)
FIT_TOLERANCE = 0.05  # the memory model's peak against measured allocated bytes
CAP_DROP_SHARE = 0.90  # stage 0's measured fall under a cap, at least this share of the predicted fall

OURS = (  # (label, pp_engine value, virtual); afab last: it needs the most memory
    ("1f1b", "ps_1f1b", 1),
    ("capped c=1", "capped_1f1b:cap=1", 1),
    ("capped c=2", "capped_1f1b:cap=2", 1),
    ("capped c=3", "capped_1f1b:cap=3", 1),
    ("interleaved v=2", "interleaved_1f1b:virtual=2", 2),
    ("interleaved v=2 c=4", "interleaved_1f1b:virtual=2,cap=4", 2),
    ("afab", "ps_afab", 1),
)
NANOTRON = (("nanotron 1f1b", "1f1b", 1), ("nanotron afab", "afab", 1))
SPLIT_BACKWARD = tuple(  # zero-bubble and V-shape schedules (split backward: B, then W)
    (name, family.engine, family.chunks()) for name, family in FAMILIES.items() if family.split_backward)


@dataclass(frozen=True)
class Case:
    """One configuration: an engine (its `pp_engine` value) at m microbatches."""

    label: str
    engine: str
    virtual: int
    microbatches: int

    @property
    def nanotron_own(self) -> bool:
        return self.engine in NANOTRON_ENGINES  # the family of the same name

def cases(schedules, microbatches) -> list[Case]:
    return [Case(label, engine, v, m) for m in microbatches for label, engine, v in schedules]


def model_split(cfg: ModelConfig, stages: int) -> tuple[int, ...]:
    """Decoder layers per stage under nanotron's cost-balanced split (what users get)."""
    return tuple(splits.layers_per_stage(splits.nanotron_block_stages(cfg.block_costs(), stages), stages))


def compiled(case: Case, pp: int):
    """The lowered schedule the case's engine runs (nanotron's own: the same family's)."""
    from integration.nanotron.pipeline.engine_spec import parse_engine
    from integration.nanotron.pipeline.engine import build_engine
    from pipeschedule import compile_schedule

    if case.nanotron_own:
        return compile_schedule(case.engine, pp=pp, microbatches=case.microbatches)
    return build_engine(parse_engine(case.engine)).compile(pp=pp, microbatches=case.microbatches)


def predicted(cfg: ModelConfig, case: Case, *, pp: int, microbatch_size: int, dtype_bytes: int,
              device: str) -> list[dict]:
    """The memory model's terms per rank for this case (`benchmarks.llama.probe.predict`), plus on
    CUDA the cuBLAS workspace that the caching allocator holds from the first matmul."""
    from benchmarks.llama.probe import predict

    ranks = predict(cfg, pp=pp, split=model_split(cfg, pp * case.virtual), schedule=compiled(case, pp),
                    microbatch_size=microbatch_size, dtype_bytes=dtype_bytes, optimizer="adamw", device=device)
    for terms in ranks:
        terms["cuBLAS workspace"] = CUBLAS_WORKSPACE_BYTES if device == "cuda" else 0
    return ranks


# What the memory model (benchmarks.llama.memory) predicts as the allocator's peak of a
# rank: its "step peak" (parameters, optimizer state, the peak of live buffers and
# gradients together, the working set) plus, on CUDA, the cuBLAS workspace.
PEAK_TERMS = ("step peak", "cuBLAS workspace")
# Allocated on the GPU beyond parameters and optimizer state at a step's start, as read on
# the H200 with torch 2.11 (docs/memory_calibration.md): cuBLAS workspaces (the forward's
# thread and autograd's backward thread each get a handle).
CUBLAS_WORKSPACE_BYTES = 64 * 2**20


def predicted_total(terms: dict) -> float:
    """The predicted allocator peak of a rank: the sum of its PEAK_TERMS."""
    return float(sum(terms[k] for k in PEAK_TERMS))


# -- one rank --------------------------------------------------------------------------------


def to_device(batch: dict, device) -> dict:
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (None entries skipped)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        key = (t.untyped_storage().data_ptr(), str(t.device))
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _build_engine(case: Case):
    if case.nanotron_own:
        from nanotron.parallel.pipeline_parallel.engine import (
            AllForwardAllBackwardPipelineEngine,
            OneForwardOneBackwardPipelineEngine,
        )

        return {"1f1b": OneForwardOneBackwardPipelineEngine, "afab": AllForwardAllBackwardPipelineEngine}[case.engine]()
    from integration.nanotron.pipeline.engine_spec import parse_engine
    from integration.nanotron.pipeline.engine import build_engine

    return build_engine(parse_engine(case.engine))


def measure_case(case: Case, cfg: ModelConfig, *, pp: int, context, p2p, pp_rank: int, device, dtype,
                 microbatch_size: int, warmup: int, steps: int, keep_trace: bool) -> dict:
    import torch.distributed as dist

    from benchmarks.llama.reference import clear_shared_state, for_rank, microbatch
    from benchmarks.llama.model import build_llama, llama_block_ranks

    clear_shared_state()
    split = model_split(cfg, pp * case.virtual)
    engine = _build_engine(case)
    placement = engine.placement(pp) if hasattr(engine, "placement") else None  # a V for the V-shape engines
    model = build_llama(cfg, p2p, llama_block_ranks(cfg, pp, split=split, placement=placement), device=device,
                        dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    m = case.microbatches
    record = {"case": asdict(case), "split": split, "rank": pp_rank, "steps": []}
    for step in range(warmup + steps):
        data = (to_device(for_rank(microbatch(cfg, microbatch_size, i, 1234 + step), pp_rank, model.input_pp_rank,
                                   model.output_pp_rank), device) for i in range(m))
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        dist.barrier(group=context.pp_pg)
        start = time.perf_counter()
        engine.train_batch_iter(model, pg=context.pp_pg, batch=data, nb_microbatches=m, grad_accumulator=None)
        if hasattr(p2p, "wait_sends"):
            p2p.wait_sends()  # CPU nanotron P2P: finish the posted sends, as a GPU stream would
        sync(device)
        seconds = time.perf_counter() - start
        ledger = engine.training_ledger() if hasattr(engine, "training_ledger") else None  # nanotron's: none
        entry = {
            "seconds": seconds, "allocated_before": before,
            "peak_allocated": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "peak_reserved": torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None,
            "reserved_after": torch.cuda.memory_reserved(device) if device.type == "cuda" else None,
            "ledger_peak": ledger.high_total if ledger is not None else None,
            "ledger_peak_by_kind": dict(ledger.high) if ledger is not None else None,
            "grad_bytes": tensor_bytes(p.grad for p in model.parameters()),
        }
        if ledger is not None and step == warmup + steps - 1:
            sizes: dict[str, dict[int, int]] = {}
            for (kind, stage, mb), size in ledger.sizes.items():
                if mb == 0:
                    sizes.setdefault(kind, {})[stage] = size
            record["buffer_bytes_mb0"] = sizes
            if keep_trace:
                record["trace"] = [(pc, sum(live.values())) for pc, _, live in ledger.trace]
        record["steps"].append(entry)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    record["param_bytes"] = tensor_bytes(model.parameters())
    record["optimizer_bytes"] = tensor_bytes(
        t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor))
    measured = record["steps"][warmup:]
    record["seconds"] = statistics.median(e["seconds"] for e in measured)
    record["all_seconds"] = [e["seconds"] for e in measured]
    for key in ("peak_allocated", "peak_reserved", "reserved_after", "ledger_peak", "grad_bytes"):
        values = [e[key] for e in measured if e[key] is not None]
        record[key] = max(values) if values else None
    del engine, model, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def worker(rank: int, world_size: int, store, mode: str, cfg: ModelConfig, case_list: list[Case], settings: dict,
           progress: str) -> None:
    """One rank of `run_cases` (spawned). mode: 'shared' (every rank on cuda:0 if there is a
    GPU, else CPU), 'multi' (rank r on cuda:r)."""
    import nanotron.distributed as nanotron_dist

    from integration.nanotron.patches.cpu import cpu_p2p, cpu_parallel_context, host_staged_p2p

    if torch.cuda.is_available():
        device = torch.device("cuda", rank if mode == "multi" else 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    context = cpu_parallel_context(pp=world_size)
    pp_rank = nanotron_dist.get_rank(context.pp_pg)
    if device.type == "cuda" and mode == "multi":
        from nanotron.parallel.pipeline_parallel.p2p import P2P

        p2p = P2P(context.pp_pg, device=device)  # nanotron's own, over NCCL
    elif device.type == "cuda":
        p2p = host_staged_p2p(context.pp_pg, device)  # nanotron's engines on a shared GPU: [Note: host-staged P2P]
    else:
        p2p = cpu_p2p(context.pp_pg)  # pipeschedule's engines do not use it; nanotron's do on CPU
    smallest_m = min(c.microbatches for c in case_list)

    def measure(case: Case, steps: int, trace: bool) -> dict:
        keep = trace and case.label in settings["trace_labels"] and case.microbatches == smallest_m
        return measure_case(case, cfg, pp=world_size, context=context, p2p=p2p, pp_rank=pp_rank, device=device,
                            dtype=dtype, microbatch_size=settings["microbatch_size"], warmup=settings["warmup"],
                            steps=steps, keep_trace=keep)

    rounds = settings.get("rounds", 1)
    with open(os.path.join(progress, f"rank{pp_rank}.jsonl"), "a", encoding="utf-8") as log:
        if rounds == 1:
            records = (measure(case, settings["steps"], True) for case in case_list)
        else:  # [Note: paired engine rounds]
            per_case: list[list[dict]] = [[] for _ in case_list]
            for r in range(rounds):
                for k in rotated(list(range(len(case_list))), r):
                    per_case[k].append(measure(case_list[k], 1, r == rounds - 1))
            records = (merge_rounds(rows, "steps") for rows in per_case)
        for record in records:
            log.write(json.dumps(record) + "\n")
            log.flush()


# [Note: paired engine rounds] With `run_cases(rounds=R)`, R > 1, the cases run in R rounds:
# each round builds every case's engine and model in turn (the order rotating by one each
# round), runs the warm-up steps and ONE measured step, and drops them; a case's
# `all_seconds` then holds one step per round, in round order, so two cases can be
# compared round by round (a drift of the shared machine hits both alike), as
# `benchmarks.offload.paired_slowdown` does. Peaks are the largest over the rounds, each
# step's own. A case's record is written once every round has run, so a failure loses
# every case of the call (with R = 1 only the failing case and those after it).


def merge_rounds(rows: list[dict], steps_key: str) -> dict:
    """One case's records of several rounds as one ([Note: paired engine rounds], [Note:
    paired offload rounds] in benchmarks/offload.py): the last round's record, with every
    number in it the largest over the rounds (the peaks; figures alike in every round stay
    as they are), `steps_key` every round's steps, `all_seconds` every round's measured
    steps in round order, `seconds` their median, and `rounds`."""
    out = dict(rows[-1])
    for key, value in rows[-1].items():
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            values = [row[key] for row in rows if row[key] is not None]
            out[key] = max(values) if values else None
    out[steps_key] = [step for row in rows for step in row[steps_key]]
    out["all_seconds"] = [s for row in rows for s in row["all_seconds"]]
    out["seconds"] = statistics.median(out["all_seconds"])
    out["rounds"] = len(rows)
    return out


def run_cases(cfg: ModelConfig, case_list: list[Case], *, pp: int, mode: str, microbatch_size: int = 1,
              warmup: int = 1, steps: int = 3, trace_labels: tuple[str, ...] = (), timeout: float = 480.0,
              backend: str | None = None, rounds: int = 1) -> tuple[list[dict], list[dict]]:
    """(rows, skipped): one row per case that ran on every rank, and the cases left out
    with the reason. With `rounds` > 1 the cases run in rounds of one measured step each
    ([Note: paired engine rounds]; `steps` is then not read). A case the memory model
    says cannot fit is not run (an out-of-memory rank would end every case after it): in
    'shared' mode the processes' predicted peaks together against the one GPU, in 'multi'
    mode each rank's against its own GPU."""
    from pipeschedule.runtime.launch import spawn

    dtype_bytes = 2 if torch.cuda.is_available() else 4
    capacity = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else math.inf
    predictions, runnable, skipped = {}, [], []
    for case in case_list:
        predictions[case] = predicted(cfg, case, pp=pp, microbatch_size=microbatch_size, dtype_bytes=dtype_bytes,
                                      device="cuda" if torch.cuda.is_available() else "cpu")
        totals = [predicted_total(t) + RANK_OVERHEAD_BYTES for t in predictions[case]]
        need = sum(totals) if mode == "shared" else max(totals)
        if need > FIT_SHARE * capacity:
            where = f"the {pp} processes together" if mode == "shared" else "the fullest rank"
            skipped.append({"case": asdict(case), "why": f"predicted {need / 2**30:.1f} GiB for {where}; "
                            f"the GPU has {capacity / 2**30:.1f} GiB"})
        else:
            runnable.append(case)
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r}: give an integer >= 1")
    settings = {"microbatch_size": microbatch_size, "warmup": warmup, "steps": steps, "trace_labels": trace_labels,
                "rounds": rounds}
    with tempfile.TemporaryDirectory(prefix="pipeschedule-bench-") as progress:
        try:
            spawn(worker, pp, args=(mode, cfg, runnable, settings, progress), timeout=timeout, threads=2,
                  **({"backend": backend} if backend else {}))
        except LaunchError as err:
            print(f"[run_cases] a rank failed; keeping the cases that finished:\n{err}", file=sys.stderr, flush=True)
        records = []
        for r in range(pp):
            path = os.path.join(progress, f"rank{r}.jsonl")
            lines = Path(path).read_text(encoding="utf-8").splitlines() if os.path.exists(path) else []
            records.append([json.loads(line) for line in lines])
    done = min(len(r) for r in records)
    skipped += [{"case": asdict(case), "why": "did not finish (see the log)"} for case in runnable[done:]]
    rows = [{"case": asdict(case), "ranks": [records[r][i] for r in range(pp)], "predicted": predictions[case]}
            for i, case in enumerate(runnable[:done])]
    return rows, skipped


# -- reporting -------------------------------------------------------------------------------


def gib(x) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def measured_terms(rank: dict) -> dict:
    """The measured peak split into terms; `rest` is what no other term explains."""
    terms = {"parameters": rank["param_bytes"], "optimizer": rank["optimizer_bytes"], "gradients": rank["grad_bytes"],
             "buffers": rank["ledger_peak"] or 0}
    if rank.get("peak_allocated") is not None:
        terms["rest"] = rank["peak_allocated"] - sum(terms.values())
    return terms


PREDICTED_KEYS = {"parameters": ("parameters",), "optimizer": ("optimizer state",), "gradients": ("gradients",),
                  "buffers": ("stash peak", "p2p buffers peak"),
                  "rest": ("working set (transient)", "cuBLAS workspace")}


def worst_term(rank: dict, prediction: dict) -> str:
    """The term whose prediction is furthest from its measurement, in words."""
    measured = measured_terms(rank)
    worst, gap = "", -1.0
    for name, keys in PREDICTED_KEYS.items():
        if name in measured:
            p = sum(float(prediction.get(k, 0.0)) for k in keys)
            if abs(p - measured[name]) > gap:
                worst, gap = (f"{name}: measured {gib(measured[name])} GiB, predicted {gib(p)} GiB",
                              abs(p - measured[name]))
    return worst


def memory_table(rows: list[dict]) -> tuple[list[str], dict]:
    """Markdown lines (one per case and rank) and the check: the cases off by more than
    FIT_TOLERANCE (`misses`) out of `compared` (ranks with an allocator figure)."""
    compared: list = []
    lines = ["| schedule | m | rank | peak allocated GiB | predicted GiB | error | peak reserved GiB | "
             "ledger peak GiB | step s |", "|---|---|---|---|---|---|---|---|---|"]
    misses = []
    for row in rows:
        case = row["case"]
        for r, rank in enumerate(row["ranks"]):
            total = predicted_total(row["predicted"][r])
            measured = rank["peak_allocated"]
            error = None if measured is None else (total - measured) / measured
            compared.append(error)
            if error is not None and abs(error) > FIT_TOLERANCE:
                misses.append({"case": case["label"], "m": case["microbatches"], "rank": r, "error": error,
                               "term": worst_term(rank, row["predicted"][r])})
            lines.append(
                f"| {case['label']} | {case['microbatches']} | {r} | {gib(measured)} | {gib(total)} | "
                f"{'-' if error is None else f'{error:+.1%}'} | {gib(rank['peak_reserved'])} | "
                f"{gib(rank['ledger_peak'])} | {rank['seconds']:.3f} |")
    measured = [e for e in compared if e is not None]
    return lines, {"ok": not misses, "compared": len(measured), "misses": misses,
                   "worst": max((abs(e) for e in measured), default=None)}


def check_status(value) -> str:
    """'ok', 'NOT MET', or 'not measured' (no figure to check, e.g. no GPU allocator on CPU)."""
    if isinstance(value, list):
        if not value:
            return "not measured"
        return "ok" if all(c["ok"] for c in value) else "NOT MET"
    if value.get("compared") == 0:
        return "not measured"
    return "ok" if value["ok"] else "NOT MET"


def cap_checks(rows: list[dict]) -> list[dict]:
    """Stage 0's fall under capped_1f1b against 1f1b (pipeschedule's): measured / predicted."""
    out = []
    by = {(r["case"]["label"], r["case"]["microbatches"]): r for r in rows}
    for (label, m), row in by.items():
        base = by.get(("1f1b", m))
        if not label.startswith("capped c=") or base is None or row["ranks"][0]["peak_allocated"] is None:
            continue
        measured = base["ranks"][0]["peak_allocated"] - row["ranks"][0]["peak_allocated"]
        predicted_fall = predicted_total(base["predicted"][0]) - predicted_total(row["predicted"][0])
        share = measured / predicted_fall if predicted_fall > 0 else float("nan")
        out.append({"case": label, "m": m, "measured_fall": measured, "predicted_fall": predicted_fall,
                    "share": share, "ok": predicted_fall <= 0 or share >= CAP_DROP_SHARE})
    return out
