"""Where the host time of `benchmarks.gpu_overhead`'s step goes: the executor against the plain loop (issue 19).

    python -m benchmarks.diagnostics.executor_profile            # one CUDA GPU, the benchmark's model
    python -m benchmarks.diagnostics.executor_profile --smoke    # CPU, a tiny model: the plumbing

The same variants as `benchmarks.gpu_overhead` (`build_variants`: one process, all four
stages, 1f1b at m=8): `ordered` (the forward and backward calls from a plain loop) and
`executor` (`InProcessPipeline`), each warmed up, then `--steps` steps under cProfile, a
full collection and a synchronise before each. Prints, per variant, the functions with
the most own time, then pipeschedule's own functions by cumulative time, and the sum of
own time spent in pipeschedule/ per step: the executor's Python, which the baseline
does not run. cProfile slows Python calls down, so the figures are for the breakdown,
not for the overhead (that is `benchmarks.gpu_overhead`).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import sys

import torch

from benchmarks.common import MODEL, PP, SMOKE_MODEL
from benchmarks.gpu_overhead import build_variants
from benchmarks.llama.model import ModelConfig
from benchmarks.training import model_split, sync

M = 8


def profile_variants(cfg: ModelConfig, device, dtype, *, steps: int, top: int) -> str:
    """The report of the module docstring, as text."""
    calls, _, zero_grads = build_variants(cfg, device, dtype, split=model_split(cfg, PP), pp=PP, m=M,
                                          microbatch_size=1)
    out = io.StringIO()
    for key in ("ordered", "executor"):
        profiler = cProfile.Profile()
        for step in range(2 + steps):
            zero_grads()
            gc.collect()
            sync(device)
            if step >= 2:
                profiler.enable()
            calls[key]()
            profiler.disable()
            sync(device)
        stats = pstats.Stats(profiler, stream=out)
        own = sum(tt for (path, _, _), (_, _, tt, _, _) in stats.stats.items() if "pipeschedule" in path)
        print(f"==== {key}: {steps} profiled steps; own time in pipeschedule/ {own / steps * 1e3:.2f} ms a step",
              file=out)
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats("pipeschedule", top)
    return out.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.diagnostics.executor_profile",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model on whatever device is here")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps per variant (default 5)")
    parser.add_argument("--top", type=int, default=40, help="functions listed per table (default 40)")
    args = parser.parse_args(argv)
    for name in ("steps", "top"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: must be at least 1")
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("benchmarks.diagnostics.executor_profile: no CUDA GPU here; --smoke runs on CPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    cfg = ModelConfig(**(SMOKE_MODEL if args.smoke else MODEL))
    print(profile_variants(cfg, device, torch.bfloat16 if cuda else torch.float32, steps=args.steps, top=args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
