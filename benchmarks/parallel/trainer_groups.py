"""nanotron's own trainer on parallel workers: each pipeline rank on its own CPU cores.

    python -m benchmarks.parallel.trainer_groups                 # pp=4, an equal share of this machine's cores each
    python -m benchmarks.parallel.trainer_groups --pp 2 --microbatches 8
    python -m benchmarks.parallel.trainer_groups --smoke         # a tiny model, three engines: the plumbing

The one setting where nanotron's engines and ours both run with their ranks at the same
time (four ranks time-sharing one GPU fill each other's bubbles): pp processes started by
torchrun, each pinned to its own physical cores (`os.sched_setaffinity`, as many compute
threads as it has CPUs), gloo between them, nanotron's `DistributedTrainer` built from a
YAML ([Note: nanotron over gloo]). The model's layout depends on the engine (interleaved
and V shapes place blocks otherwise), so the engines run in layout groups, one torchrun
per group; inside a group every engine runs on the same trainer, swapped between steps
(`trainer.pipeline_engine`), m swapped with it, in rounds whose order rotates. The round-
robin group runs first and its two 1F1B engines again last, which says how far the
machine drifted between the groups' launches (their ratios are not paired).

Every step is nanotron's `training_step` (the engine, gradient sync, clipping, AdamW) on
the same m microbatches with learning rate 0, so every engine's loss at a given m must be
bitwise nanotron's 1F1B loss (CPU): checked and reported. Per (engine, m): the median
step, each rank's busy time and bubble from the executor's timeline ([Note: measured
timeline]), the ledger's peak live bytes per rank, and the simulator's step for the
engine's own schedule under the stage costs measured in these steps and the gloo link
measured here (benchmarks/parallel/predict.py). Writes `--out`/parallel_trainer_groups_pp{pp}.json
(every raw figure and one step's spans per engine) and .md; prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.common import RESULTS, rotated, torchrun, torchrun_failure, versions, write_results
from benchmarks.parallel import pinning, report
from pipeschedule.runtime.launch import leave

NANOTRON = ("1f1b", "afab")
ENGINES = ("1f1b", "afab", "ps_1f1b", "ps_afab", "capped_1f1b:cap=1", "capped_1f1b:cap=2", "capped_1f1b:cap=3",
           "zb_h1", "interleaved_1f1b:virtual=2", "interleaved_1f1b:virtual=3", "zbv", "v_half", "v_min")
LATER_FAMILIES = ("zb_h2", "interleaved_zb:virtual=2", "looped_bfs:virtual=2", "dualpipev")  # where this tree has them
MODEL = dict(hidden=384, heads=6, kv_heads=2, ffn=1024, layers=24, vocab=2048, seq=256, micro_batch_size=1)
SMOKE_MODEL = dict(hidden=32, heads=4, kv_heads=2, ffn=64, layers=12, vocab=128, seq=16, micro_batch_size=1)
SMOKE_ENGINES = ("1f1b", "ps_1f1b", "interleaved_1f1b:virtual=2")
GROUPS_ENV = "PIPESCHEDULE_CORE_GROUPS"


def available_engines(names=ENGINES + LATER_FAMILIES) -> list[str]:
    """`names` whose family this tree has (nanotron's own always)."""
    from pipeschedule.compiler.families import FAMILIES

    return [n for n in names if n in NANOTRON or n.split(":")[0] in FAMILIES or n.startswith("ps_")]


def placement_of(name: str, pp: int) -> tuple[int, ...]:
    """The rank of each stage under engine `name` (nanotron's own: one stage a rank)."""
    if name in NANOTRON:
        return tuple(range(pp))
    from integration.nanotron.pipeline.engine import build_engine

    return tuple(build_engine(name).placement(pp))


def layout_groups(engines, pp: int) -> list[list[str]]:
    """The engines grouped by the placement their model needs, in first-seen order."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for name in engines:
        groups.setdefault(placement_of(name, pp), []).append(name)
    return list(groups.values())


def config_text(engines: list[str], args, checkpoints: str) -> str:
    """The group's YAML: its first engine builds the layout."""
    from integration.nanotron.example import TrainerConfig

    cfg = TrainerConfig(engine=engines[0], pp=args.pp, microbatches=max(args.microbatches), steps=10**6,
                        dtype="float32", clip_grad=1.0, **(SMOKE_MODEL if args.smoke else MODEL))
    config = yaml.safe_load(cfg.yaml(checkpoints))
    config["logging"].update(log_level="warning", log_level_replica="warning")
    return yaml.safe_dump(config, sort_keys=False)


# -- inside each torchrun rank -------------------------------------------------------------

def _rank_main(config_path: str, out_path: str, engines: list[str], microbatches: list[int], warmup: int,
               rounds: int) -> None:
    groups = pinning.parse_spec(os.environ.get(GROUPS_ENV, ""))
    local = int(os.environ["LOCAL_RANK"])
    if groups:
        pinning.pin(groups[local])
    import torch

    if groups:
        torch.set_num_threads(len(groups[local]))
    from integration.nanotron import train  # (first: repairs nanotron 0.4's import, installs the patches)
    from nanotron import distributed as dist
    from nanotron.dataloader import sanity_check_dataloader

    train.prepare("auto")
    trainer = train.make_trainer(config_path, stash_meter=False)
    trainer.pipeline_engine = trainer.config.parallelism.pp_engine
    _freeze(trainer)
    stream = sanity_check_dataloader(train.synthetic_batches(trainer), trainer.parallel_context, trainer.config)
    batches = [next(stream) for _ in range(max(microbatches))]
    world, pp_pg = trainer.parallel_context.world_pg, trainer.parallel_context.pp_pg
    step = _Stepper(trainer, batches, world)
    cases = [(name, m) for m in microbatches for name in engines]
    objects = {case: _engine(case[0]) for case in cases}
    rows = []
    link = _link(pp_pg, trainer.config, torch)
    for round_index in range(warmup + rounds):
        for name, m in rotated(cases, round_index):
            row = step(objects[name, m], m)
            if round_index >= warmup:
                rows.append({"engine": name, "m": m, "round": round_index - warmup, **row})
        gathered = [None] * dist.get_world_size(world)
        dist.all_gather_object(gathered, rows, group=world)
        if dist.get_rank(world) == 0:
            partial = Path(out_path).with_suffix(".partial")
            partial.write_text(json.dumps({"ranks": gathered, "link": link, "cores": groups,
                                           "threads": torch.get_num_threads()}))
            partial.replace(out_path)


def _freeze(trainer) -> None:
    """Learning rate 0 from the first step on (nanotron's scheduler refuses a configured 0:
    it divides by it), so every step starts from the same weights."""
    scheduler = trainer.lr_scheduler
    scheduler.base_lrs = [0.0] * len(scheduler.base_lrs)
    for group in scheduler.optimizer.param_groups:
        group["lr"] = 0.0


def _engine(name: str):
    from nanotron.parallel.pipeline_parallel.engine import (AllForwardAllBackwardPipelineEngine,
                                                            OneForwardOneBackwardPipelineEngine)

    from integration.nanotron.pipeline.engine import build_engine

    if name == "1f1b":
        return OneForwardOneBackwardPipelineEngine()
    if name == "afab":
        return AllForwardAllBackwardPipelineEngine()
    return build_engine(name)


class _Stepper:
    """Times one `training_step` of an engine at m microbatches (barrier to barrier), with
    its loss, and for ours the timeline's spans and the ledger's peak."""

    def __init__(self, trainer, batches, world):
        self.trainer, self.batches, self.world = trainer, batches, world

    def __call__(self, engine, m: int) -> dict:
        import torch
        from nanotron import distributed as dist

        from benchmarks.parallel.predict import span_rows
        from pipeschedule.runtime.timeline import Timeline

        trainer, cuda = self.trainer, torch.cuda.is_available()
        trainer.pipeline_engine = engine
        trainer.n_micro_batches_per_batch = engine.nb_microbatches = m
        executor = engine.training_executor() if hasattr(engine, "training_executor") else None
        if executor is not None and executor.timeline is None:
            executor.timeline = Timeline(executor.device)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        marks = {}
        engine.train_batch_iter = _marking(engine.train_batch_iter, marks)  # (the class's method again below)
        dist.barrier(self.world)
        start = time.perf_counter()
        trainer.iteration_step += 1
        try:
            _, loss = trainer.training_step(dataloader=iter(self.batches[:m]))
        finally:
            del engine.train_batch_iter
        if cuda:
            torch.cuda.synchronize()
        dist.barrier(self.world)
        seconds = time.perf_counter() - start
        row = {"seconds": seconds, "loss": None if loss is None else float(loss),
               "pipeline_begin_s": marks["begin"] - start, "pipeline_end_s": marks["end"] - start}
        if executor is not None and executor.timeline is not None:
            row["spans"] = span_rows(executor.timeline.spans())
            row["ledger_peak_bytes"] = executor.ledger.high_total
            times = executor.times
            row["executor"] = {"compute_s": times.compute_s, "transport_s": times.transport_s,
                               "wait_s": times.wait_s, "overhead_s": times.overhead_s}
        if cuda:
            row["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
        return row


def _marking(train_batch_iter, marks: dict):
    """`train_batch_iter` noting when it began and ended in `marks`: the pipeline's part of
    the step (the gradient sync, clipping and optimizer step follow it)."""
    def marked(*args, **kwargs):
        marks["begin"] = time.perf_counter()
        try:
            return train_batch_iter(*args, **kwargs)
        finally:
            marks["end"] = time.perf_counter()
    return marked


def _link(pg, config, torch) -> dict:
    """Seconds of one gloo message between pipeline ranks 0 and 1 (half a round trip, median):
    empty, one boundary (micro-batch x sequence x hidden, float32) and 16 MiB; the latency is
    the empty one's, the bandwidth the 16 MiB one's beyond it."""
    from nanotron import distributed as dist

    rank = dist.get_rank(pg)
    boundary = config.tokens.micro_batch_size * config.tokens.sequence_length * config.model.model_config.hidden_size
    out = {}
    for label, numel in (("empty", 1), ("boundary", boundary), ("16MiB", 4 * 2**20)):
        tensor, times = torch.zeros(numel), []
        for _ in range(8):
            dist.barrier(pg)
            start = time.perf_counter()
            if rank == 0:
                dist.send(tensor, dist.get_global_rank(pg, 1), group=pg)
                dist.recv(tensor, dist.get_global_rank(pg, 1), group=pg)
            elif rank == 1:
                dist.recv(tensor, dist.get_global_rank(pg, 0), group=pg)
                dist.send(tensor, dist.get_global_rank(pg, 0), group=pg)
            times.append((time.perf_counter() - start) / 2)
        out[label] = statistics.median(times[2:])
    out["boundary_bytes"] = boundary * 4
    out["latency_s"] = out["empty"]
    out["bandwidth"] = 16 * 2**20 / max(out["16MiB"] - out["empty"], 1e-9)
    return out


# -- the parent ----------------------------------------------------------------------------

def merge_ranks(run: dict) -> dict[tuple[str, int], list[dict]]:
    """(engine, m) -> one dict per measured round: rank 0's seconds, the loss rank's loss,
    every rank's spans and peaks."""
    out: dict[tuple[str, int], list[dict]] = {}
    for k, row in enumerate(run["ranks"][0]):
        rows = [rank_rows[k] for rank_rows in run["ranks"]]
        out.setdefault((row["engine"], row["m"]), []).append({
            "seconds": row["seconds"],
            "pipeline_s": max(r["pipeline_end_s"] for r in rows) - min(r["pipeline_begin_s"] for r in rows),
            "executor": [r.get("executor") for r in rows],
            "loss": next((r["loss"] for r in rows if r["loss"] is not None), None),
            "spans": [r.get("spans") for r in rows],
            "ledger_peak_bytes": [r.get("ledger_peak_bytes") for r in rows],
            "cuda_peak_bytes": [r.get("cuda_peak_bytes") for r in rows],
        })
    return out


def summarise(runs: list[dict], args, groups) -> dict:
    """Every (engine, m) of every group, compared; the drift of the repeated references."""
    rows, drift = [], None
    for run in runs:
        cases = merge_ranks(run)
        if run["label"] == "again":
            first = next(r for r in rows if r["engine"] in run["engines"])
            again = statistics.median(r["seconds"] for r in cases[first["engine"], first["m"]])
            drift = {"engine": first["engine"], "m": first["m"], "first_s": first["median_s"], "last_s": again}
            continue
        for (name, m), rounds in cases.items():
            same = cases.get((report.SAME_ORDER.get(name), m))
            rows.append(report.case_row(name, m, run["label"], rounds, report.schedule_of(name, args.pp, m),
                                        run["link"], same))
    report.compare(rows)
    return {"pp": args.pp, "microbatches": args.microbatches, "rounds": args.rounds, "warmup": args.warmup,
            "model": SMOKE_MODEL if args.smoke else MODEL, "cores": [list(g) for g in groups],
            "links": {run["label"]: run["link"] for run in runs}, "rows": rows, "drift": drift,
            "losses_equal": report.losses_equal(rows, "1f1b")}


def render(summary: dict) -> str:
    v = summary.get("versions", {})
    links = "; ".join(f"{k}: latency {lk['latency_s'] * 1e6:.0f} us, {lk['bandwidth'] / 1e9:.2f} GB/s"
                      for k, lk in summary["links"].items())
    lines = [f"# Pipeline schedules on pinned CPU groups: nanotron's trainer, pp={summary['pp']} ({v.get('date', '')})",
             "", f"`python -m benchmarks.parallel.trainer_groups --pp {summary['pp']}`. Versions: "
             + ", ".join(f"{k} {val}" for k, val in v.items()), "",
             f"Cores per rank: {summary['cores']}. Model (nanotron's Llama, float32, micro-batch 1): "
             f"{summary['model']}. "
             f"{summary['warmup']} warm-up round(s), {summary['rounds']} measured; every step nanotron's "
             f"`training_step` at learning rate 0 on the same data. Link (gloo, pipeline rank 0 <-> 1): {links}.", ""]
    return "\n".join(lines + report.table(summary["rows"]) + report.footer(summary)) + "\n"


def run_group(engines: list[str], args, work: Path, label: str) -> dict:
    """One torchrun of the group's engines; the ranks' rows, the link and the cores."""
    config = work / f"{label}.yaml"
    config.write_text(config_text(engines, args, str(work / f"checkpoints-{label}")))
    out = work / f"{label}.json"
    command = ["-m", "benchmarks.parallel.trainer_groups", "--rank-main", str(config), str(out), ",".join(engines),
               ",".join(map(str, args.microbatches)), str(args.warmup), str(args.rounds)]
    started = time.perf_counter()
    result = torchrun(args.pp, command, timeout=args.timeout)
    if result.returncode != 0:
        raise RuntimeError(torchrun_failure(f"group {label} ({', '.join(engines)})", result))
    saved = json.loads(out.read_text())
    saved.update(engines=engines, label=label, wall_s=time.perf_counter() - started)
    return saved


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.parallel.trainer_groups",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks, each on its own cores (default 4)")
    parser.add_argument("--microbatches", type=lambda t: [int(x) for x in t.split(",")], default=[8, 32],
                        help="microbatch counts, comma-separated (default 8,32)")
    parser.add_argument("--engines", type=lambda t: t.split(";"), default=None,
                        help="pp_engine values separated by ';' (default: every family this tree has)")
    parser.add_argument("--cores-per-rank", type=int, default=None,
                        help="physical cores per rank (default: an equal share)")
    parser.add_argument("--no-pin", action="store_true",
                        help="leave the ranks unpinned (to try the plumbing where cores are few)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first (default 1)")
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds (default 2)")
    parser.add_argument("--timeout", type=float, default=1500.0, help="seconds per torchrun (default 1500)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, three engines, m=4; writes nothing")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the results go (default benchmarks/results)")
    parser.add_argument("--rank-main", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_main:
        config, out, engines, ms, warmup, rounds = args.rank_main
        _rank_main(config, out, engines.split(","), [int(x) for x in ms.split(",")], int(warmup), int(rounds))
        leave(0)
    if args.smoke:
        args.engines, args.microbatches, args.rounds = list(SMOKE_ENGINES), [4], 1
    engines = available_engines(args.engines or ENGINES + LATER_FAMILIES)
    groups = []
    if not args.no_pin:
        try:
            groups = pinning.core_groups(args.pp, args.cores_per_rank)
        except ValueError as err:
            print(f"trainer_groups: {err}", file=sys.stderr)
            return 2
    os.environ[GROUPS_ENV] = pinning.spec(groups)
    layouts = layout_groups(engines, args.pp)
    runs = []
    with tempfile.TemporaryDirectory(prefix="trainer-groups-") as tmp:
        for k, group in enumerate(layouts):
            runs.append(run_group(group, args, Path(tmp), f"group{k}"))
            print(f"group {k}: {', '.join(group)} done in {runs[-1]['wall_s']:.0f} s", flush=True)
            if not args.smoke:  # what has run stays if a later group does not finish
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / f"parallel_trainer_groups_pp{args.pp}.partial.json").write_text(json.dumps(runs))
        references = [name for name in ("1f1b", "ps_1f1b") if name in layouts[0]]
        if references and len(layouts) > 1:  # the machine's drift between the first and the last launch
            runs.append(run_group(references, args, Path(tmp), "again"))
    summary = summarise(runs, args, groups)
    summary["versions"] = versions()
    markdown = render(summary)
    if not args.smoke:
        report.write_traces(summary, args.out / f"parallel_trainer_groups_pp{args.pp}_traces")
        write_results(f"parallel_trainer_groups_pp{args.pp}", summary, markdown, args.out)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
