"""Where each rank's host time goes in a training step, nanotron's engine against ours (issue 19).

    python -m benchmarks.diagnostics.engine_profile            # one CUDA GPU: pp=4 as four ranks on it
    python -m benchmarks.diagnostics.engine_profile --smoke    # CPU, a tiny model: the plumbing

One torchrun of four ranks builds nanotron's `DistributedTrainer` (nanotron's
`LlamaForTraining`, the host-bound size of `benchmarks.engine_vs_nanotron`) and, for each
pair (nanotron's engine, ours), warms both up and then runs `--steps` training steps of
each under cProfile on every rank. It writes, per rank and engine, the functions with the
most own time and the most cumulative time, paths shown relative to this checkout
(site-packages as `site-packages/`), plus the profiled step times (cProfile slows Python
down, so they are for the breakdown, not for the comparison: that is
`benchmarks.engine_vs_nanotron`).

Writes benchmarks/results/engine_profile.md and .json (the same sections, per rank).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (MODEL, PP, RESULTS, SMOKE_TRAINER, torchrun, torchrun_failure, versions,
                               write_results)
from pipeschedule.runtime.launch import leave
from integration.nanotron.example import TrainerConfig

PAIRS = (("1f1b", "ps_1f1b"), ("afab", "ps_afab"))
HOST_BOUND = dict(MODEL, micro_batch_size=1)
CHECKOUT = str(Path(__file__).resolve().parents[2]) + "/"


def _rank_main(config_path: str, out_dir: str, pairs: list[tuple[str, str]], m: int, steps: int) -> None:
    """Inside each torchrun rank: build the trainer once, profile each engine's steps."""
    import torch
    from nanotron import distributed as dist
    from nanotron.dataloader import sanity_check_dataloader
    from nanotron.parallel.pipeline_parallel.engine import (
        AllForwardAllBackwardPipelineEngine,
        OneForwardOneBackwardPipelineEngine,
    )

    from integration.nanotron import train
    from integration.nanotron.pipeline.engine import build_engine
    from integration.nanotron.pipeline.engine_spec import parse_engine

    train.prepare("auto")
    trainer = train.make_trainer(config_path)
    data = sanity_check_dataloader(train.synthetic_batches(trainer), trainer.parallel_context, trainer.config)
    world = trainer.parallel_context.world_pg
    rank = dist.get_rank(world)
    theirs = {"1f1b": OneForwardOneBackwardPipelineEngine, "afab": AllForwardAllBackwardPipelineEngine}

    def run_steps(engine, count: int) -> list[float]:
        trainer.pipeline_engine = engine
        trainer.n_micro_batches_per_batch = engine.nb_microbatches = m
        seconds = []
        for _ in range(count):
            dist.barrier(world)
            start = time.perf_counter()
            trainer.iteration_step += 1
            trainer.training_step(dataloader=data)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        return seconds

    sections = []
    for pair in pairs:
        engines = [(name, theirs[name]() if name in theirs else build_engine(parse_engine(name))) for name in pair]
        for _, engine in engines:
            run_steps(engine, 2)  # warm-up: compile, shapes, allocator
        for name, engine in engines:
            profile = cProfile.Profile()
            profile.enable()
            seconds = run_steps(engine, steps)
            profile.disable()
            sections.append(_section(name, rank, seconds, profile))
    Path(out_dir, f"rank{rank}.md").write_text("\n".join(sections))


def _section(name: str, rank: int, seconds: list[float], profile: cProfile.Profile) -> str:
    text = []
    for key, count in (("tottime", 25), ("cumtime", 40)):
        stream = io.StringIO()
        pstats.Stats(profile, stream=stream).sort_stats(key).print_stats(count)
        text.append(_relative(stream.getvalue()))
    steps = ", ".join(f"{s * 1e3:.1f}" for s in seconds)
    return (f"## rank {rank}: `{name}`\n\nprofiled steps (ms): {steps}\n\n```\n" + "\n".join(text).strip()
            + "\n```\n")


def _relative(text: str) -> str:
    """Paths in a profile relative to this checkout, and packages under `site-packages/`
    (the device machine installs the carried wheels with `--target /tmp/site`)."""
    text = text.replace(CHECKOUT, "").replace("/tmp/site/", "site-packages/")
    marker = "site-packages/"
    lines = []
    for line in text.splitlines():
        if marker in line:
            head, _, tail = line.partition(marker)
            cut = head.rfind(" ")
            line = head[: cut + 1] + marker + tail
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-main"]:
        config_path, out_dir, pairs, m, steps = argv[1:6]
        _rank_main(config_path, out_dir, [tuple(p.split(":", 1)) for p in pairs.split(",")], int(m), int(steps))
        leave(0)  # not the interpreter's shutdown, with nanotron's groups alive
    parser = argparse.ArgumentParser(prog="python -m benchmarks.diagnostics.engine_profile",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU; writes nothing")
    parser.add_argument("-m", "--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per engine (default 3)")
    parser.add_argument("--ranks", default="0,3", help="ranks whose profiles are kept (default 0,3)")
    parser.add_argument("--commit", help="commit to record (the device machine's tree may lack git history)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("benchmarks.diagnostics.engine_profile: no CUDA GPU here; use --smoke on a CPU", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="pipeschedule-profile-"))
    sizes = SMOKE_TRAINER if args.smoke else HOST_BOUND
    config = TrainerConfig(engine="1f1b", pp=PP, microbatches=args.microbatches, steps=10**6, dtype="bfloat16",
                           fp32_accumulation=True, **sizes)
    path = work / "config.yaml"
    path.write_text(config.yaml(str(work / "checkpoints")))
    pairs = ",".join(f"{a}:{b}" for a, b in PAIRS)
    result = torchrun(PP, ["-m", "benchmarks.diagnostics.engine_profile", "--rank-main", str(path), str(work), pairs,
                           str(args.microbatches), str(1 if args.smoke else args.steps)], timeout=900)
    if result.returncode != 0:
        print(torchrun_failure("engine_profile", result), file=sys.stderr)
        return 1
    ranks = [int(r) for r in args.ranks.split(",")]
    header = (f"# Host time per function, nanotron's engines against ours ({versions(args.commit)['date']})\n\n"
              f"`python -m benchmarks.diagnostics.engine_profile`: nanotron's trainer on its `LlamaForTraining` "
              f"(the host-bound size of benchmarks.engine_vs_nanotron), pp={PP} as four ranks on one GPU, "
              f"m={args.microbatches}; {args.steps} steps of each engine under cProfile after 2 warm-up steps.\n\n"
              "Versions: " + ", ".join(f"{k} {v}" for k, v in versions(args.commit).items()) + "\n")
    text = header + "\n" + "\n".join((work / f"rank{r}.md").read_text() for r in ranks)
    if not args.smoke:
        report = {"versions": versions(args.commit), "pp": PP, "microbatches": args.microbatches, "steps": args.steps,
                  "ranks": {r: (work / f"rank{r}.md").read_text() for r in ranks}}
        write_results("engine_profile", report, text, out=args.out)
    print(text[-6000:])
    print("\nprofiled steps (ms), by rank and engine:")
    for line in text.splitlines():
        if line.startswith("## rank "):
            head = line.removeprefix("## ")
        elif line.startswith("profiled steps (ms):"):
            print(f"  {head}: {line.partition(':')[2].strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
