"""nanotron's own trainer on parallel workers: each pipeline rank on its own CPU cores.

    python -m benchmarks.parallel.trainer_groups                 # pp=4, an equal share of this machine's cores each
    python -m benchmarks.parallel.trainer_groups --pp 2 --microbatches 8
    python -m benchmarks.parallel.trainer_groups --smoke         # a tiny model, three engines: the plumbing

The one setting where nanotron's engines and ours both run with their ranks at the same
time (four ranks time-sharing one GPU fill each other's bubbles): pp processes started by
torchrun, each pinned to its own physical cores (`os.sched_setaffinity`, as many compute
threads as it has CPUs), gloo between them, nanotron's `DistributedTrainer` built from a
YAML ([Note: nanotron over gloo]). The model's layout depends on the engine (interleaved
and V shapes place blocks otherwise), so the engines fall into layout groups, and each rank
builds one trainer per group, all in one torchrun ([Note: every layout in one launch]); every engine runs
on its group's trainer, swapped between steps (`trainer.pipeline_engine`), m swapped with
it, in rounds whose order rotates over every engine of every group, so every ratio is
paired by round.

[Note: every layout in one launch] These CPUs drift by up to 10% within minutes (measured 2026-12-07: our
1F1B 1.521 s in the first launch, 1.676 s in the last), which is as large as the gains to
be measured. A torchrun per layout, one after another, compared interleaved v=2 (another
layout) with our 1F1B across that drift: 85% of its predicted gain in one run, 53% in the
next. Several trainers in one process cost only their memory (nanotron's `ParallelContext`
makes new process groups each time), and a round then holds every engine within seconds.

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

from benchmarks.common import RESULTS, rotated, torchrun, torchrun_failure, versions
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

def _rank_main(spec_path: str, out_path: str) -> None:
    """One rank: a trainer per layout group of `spec_path`'s, every engine of every group
    stepped in rotating rounds; the rows (all ranks') written to `out_path` after each round."""
    spec = json.loads(Path(spec_path).read_text())
    groups = pinning.parse_spec(os.environ.get(GROUPS_ENV, ""))
    local = int(os.environ["LOCAL_RANK"])
    if groups:
        pinning.pin(groups[local])
    import torch

    if groups or spec["threads"]:
        torch.set_num_threads(spec["threads"] or len(groups[local]))
    from integration.nanotron import train  # (first: repairs nanotron 0.4's import, installs the patches)
    from nanotron import distributed as dist

    train.prepare("auto")
    microbatches = spec["microbatches"]
    steppers, cases = [], []
    for layout in spec["layouts"]:  # [Note: every layout in one launch]
        steppers.append(_Stepper.build(train, layout["config"], max(microbatches)))
        cases += [(len(steppers) - 1, name, m) for m in microbatches for name in layout["engines"]]
    objects = {case: _engine(case[1]) for case in cases}
    world = steppers[0].world
    link = _link(steppers[0].trainer.parallel_context.pp_pg, steppers[0].trainer.config, torch)
    rows, started = [], time.perf_counter()
    for round_index in range(spec["warmup"] + spec["rounds"]):
        for case in rotated(cases, round_index):
            layout, name, m = case
            row = steppers[layout](objects[case], m)
            if round_index >= spec["warmup"]:
                rows.append({"engine": name, "m": m, "layout": layout, "round": round_index - spec["warmup"], **row})
        gathered = [None] * dist.get_world_size(world)
        dist.all_gather_object(gathered, (rows, time.perf_counter() - started), group=world)
        if dist.get_rank(world) == 0:
            partial = Path(out_path).with_suffix(".partial")
            partial.write_text(json.dumps({"ranks": [g[0] for g in gathered], "link": link, "cores": groups,
                                           "threads": torch.get_num_threads(),
                                           "rounds_run": max(0, round_index + 1 - spec["warmup"])}))
            partial.replace(out_path)
        elapsed = gathered[0][1]  # rank 0's clock decides for every rank
        if rows and spec["budget_s"] and elapsed * (round_index + 2) / (round_index + 1) > spec["budget_s"]:
            break  # another round would overrun: stop with whole rounds


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

    @classmethod
    def build(cls, train, config_path: str, microbatches: int) -> _Stepper:
        """nanotron's trainer from the YAML at `config_path`, frozen, with its first
        `microbatches` batches."""
        from nanotron.dataloader import sanity_check_dataloader

        trainer = train.make_trainer(config_path, stash_meter=False)
        trainer.pipeline_engine = trainer.config.parallelism.pp_engine
        _freeze(trainer)
        stream = sanity_check_dataloader(train.synthetic_batches(trainer), trainer.parallel_context, trainer.config)
        return cls(trainer, [next(stream) for _ in range(microbatches)], trainer.parallel_context.world_pg)

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


def summarise(run: dict, args, groups) -> dict:
    """Every (engine, m) of the launch, compared (every pair by round: one launch)."""
    cases, rows = merge_ranks(run), []
    for (name, m), rounds in cases.items():
        same = cases.get((report.SAME_ORDER.get(name), m))
        rows.append(report.case_row(name, m, "launch", rounds, report.schedule_of(name, args.pp, m),
                                    run["link"], same))
    report.compare(rows)
    return {"pp": args.pp, "microbatches": args.microbatches, "rounds": run["rounds_run"], "warmup": args.warmup,
            "model": SMOKE_MODEL if args.smoke else MODEL, "cores": [list(g) for g in groups],
            "threads": run["threads"], "layouts": run["layouts"], "links": {"launch": run["link"]}, "rows": rows,
            "incomplete": run.get("incomplete"), "losses_equal": report.losses_equal(rows, "1f1b")}


def render(summary: dict) -> str:
    v = summary.get("versions", {})
    links = "; ".join(f"{k}: latency {lk['latency_s'] * 1e6:.0f} us, {lk['bandwidth'] / 1e9:.2f} GB/s"
                      for k, lk in summary["links"].items())
    layouts = "; ".join(", ".join(f"`{e}`" for e in group) for group in summary["layouts"])
    lines = [f"# Pipeline schedules on pinned CPU groups: nanotron's trainer, pp={summary['pp']} ({v.get('date', '')})",
             "", f"`python -m benchmarks.parallel.trainer_groups --pp {summary['pp']}`. Versions: "
             + ", ".join(f"{k} {val}" for k, val in v.items()), "",
             f"Cores per rank: {summary['cores']}, {summary['threads']} compute threads a rank. "
             f"Model (nanotron's Llama, float32, micro-batch 1): "
             f"{summary['model']}. One launch, a trainer per layout group ({layouts}); "
             f"{summary['warmup']} warm-up round(s), {summary['rounds']} measured, each round every engine in a "
             f"rotating order, so every ratio is paired by round; every step nanotron's `training_step` at learning "
             f"rate 0 on the same data. Link (gloo, pipeline rank 0 <-> 1): {links}.", ""]
    if summary.get("incomplete"):
        lines += [f"Incomplete: {summary['incomplete']}", ""]
    lines += report.table(summary["rows"]) + report.footer(summary)
    late = report.late_table(summary["rows"])
    if late:
        lines += [""] + late
    return "\n".join(lines) + "\n"


def run_launch(layouts: list[list[str]], args, work: Path) -> dict:
    """One torchrun: a trainer per layout group on every rank; the ranks' rows, the link and
    the cores. A launch that fails after a measured round keeps its rounds, marked incomplete."""
    spec = {"layouts": [], "microbatches": args.microbatches, "warmup": args.warmup, "rounds": args.rounds,
            "budget_s": args.budget, "threads": args.threads}
    for k, engines in enumerate(layouts):
        config = work / f"group{k}.yaml"
        config.write_text(config_text(engines, args, str(work / f"checkpoints-{k}")))
        spec["layouts"].append({"config": str(config), "engines": engines})
    (work / "spec.json").write_text(json.dumps(spec))
    out = work / "rows.json" if args.smoke else args.out / f"parallel_trainer_groups_pp{args.pp}.partial.json"
    out.parent.mkdir(parents=True, exist_ok=True)  # (not under work: what has run stays if the parent is killed)
    started = time.perf_counter()
    result = torchrun(args.pp, ["-m", "benchmarks.parallel.trainer_groups", "--rank-main", str(work / "spec.json"),
                                str(out)], timeout=args.timeout)
    failure = None if result.returncode == 0 else torchrun_failure("the launch", result)
    if failure and not out.exists():
        raise RuntimeError(failure)
    saved = json.loads(out.read_text())
    if failure:
        print(failure, file=sys.stderr)
        saved["incomplete"] = failure.splitlines()[0] + f" after {saved['rounds_run']} measured round(s)"
    saved.update(layouts=layouts, wall_s=time.perf_counter() - started)
    return saved


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.parallel.trainer_groups",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks, each on its own cores (default 4)")
    parser.add_argument("--microbatches", type=_counts, default=[8, 32],
                        help="microbatch counts, comma-separated (default 8,32)")
    parser.add_argument("--engines", type=lambda t: t.split(";"), default=None,
                        help="pp_engine values separated by ';' (default: every family this tree has)")
    parser.add_argument("--cores-per-rank", type=int, default=None,
                        help="physical cores per rank (default: an equal share)")
    parser.add_argument("--threads", type=int, default=None,
                        help="compute threads per rank (default: one a core of its group); fewer leave its "
                             "communication threads a core")
    parser.add_argument("--no-pin", action="store_true",
                        help="leave the ranks unpinned (to try the plumbing where cores are few)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="unmeasured rounds first (default 1, the least: a first step builds our executor, "
                             "which then keeps the timeline)")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds at most (default 2; --smoke 1)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds of stepping after which no further round starts (default: no limit; "
                             "at least one measured round runs)")
    parser.add_argument("--timeout", type=float, default=3000.0, help="seconds for the launch (default 3000)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, three engines, m=4: writes nothing")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the results go (default benchmarks/results)")
    parser.add_argument("--rank-main", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_main:
        _rank_main(*args.rank_main)
        leave(0)
    if args.smoke:
        args.engines, args.microbatches = list(SMOKE_ENGINES), [4]
    if args.rounds is None:
        args.rounds = 1 if args.smoke else 2
    for name, value, least in (("--pp", args.pp, 2), ("--warmup", args.warmup, 1), ("--rounds", args.rounds, 1),
                                ("--threads", 1 if args.threads is None else args.threads, 1)):
        if value < least:
            parser.error(f"{name} {value}: accepted {least} or more")
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
    with tempfile.TemporaryDirectory(prefix="trainer-groups-") as tmp:
        run = run_launch(layouts, args, Path(tmp))
    print(f"one launch, {len(layouts)} layout group(s), {run['rounds_run']} measured round(s), "
          f"{run['wall_s']:.0f} s", flush=True)
    summary = summarise(run, args, groups)
    summary["versions"] = versions()
    markdown = render(summary)
    if not args.smoke:
        report.write(f"parallel_trainer_groups_pp{args.pp}", summary, markdown, args.out)
        (args.out / f"parallel_trainer_groups_pp{args.pp}.partial.json").unlink()
    print(markdown)
    return 0


def _counts(text: str) -> list[int]:
    """'8,32' -> [8, 32]; a clear error for anything but positive integers."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: accepted positive integers separated by commas, e.g. 8,32")
    return counts


if __name__ == "__main__":
    sys.exit(main())
