"""One phase of one large schedule, timed in process: compile (generate + lower), verify or
simulate of zbv at pp=64, m=512, interleaved 1F1B at pp=64, virtual=2, m=512, or 1F1B at
pp=64, m=1024 (65,536 (stage, microbatch) pairs each).

    python -m benchmarks.phase_times CASE PHASE [--repeat 3] [--lift-limit]

Prints `PHASE CASE SECONDS`: the least process CPU time of `--repeat` runs (the collector run
before each), the schedule built once before them (verify and simulate). To compare two
checkouts, run it alternately with PYTHONPATH set to each, one process at a time, and take
the ratio pair by pair (results/phase_times.md). `--lift-limit` raises the schedule size limit
first, for a checkout from before it accepted these sizes (32,768 pairs).
"""

from __future__ import annotations

import argparse
import gc
import time

CASES = {"zbv": ("zbv", 64, None, 512), "interleaved": ("interleaved_1f1b", 64, 2, 512),
         "1f1b": ("1f1b", 64, None, 1024)}
PHASES = ("compile", "verify", "simulate")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=CASES)
    parser.add_argument("phase", choices=PHASES)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--lift-limit", action="store_true", help="accept the sizes on an older checkout")
    args = parser.parse_args(argv)
    if args.lift_limit:
        import pipeschedule.checks as checks  # noqa: PLC0415  (before anything reads the limit)

        checks.MAX_STAGE_MICROBATCHES = max(checks.MAX_STAGE_MICROBATCHES, 2**17)
    from pipeschedule.compiler.families import generate  # noqa: PLC0415
    from pipeschedule.compiler.passes import lower  # noqa: PLC0415
    from pipeschedule.compiler.verify import verify  # noqa: PLC0415
    from pipeschedule.simulate import simulate  # noqa: PLC0415

    name, pp, virtual, m = CASES[args.case]

    def compiled():
        return lower(generate(name, pp=pp, microbatches=m, virtual=virtual))

    lowered = None if args.phase == "compile" else compiled()
    run = {"compile": compiled, "verify": lambda: verify(lowered), "simulate": lambda: simulate(lowered)}[args.phase]
    best = float("inf")
    for _ in range(args.repeat):
        gc.collect()
        start = time.process_time()
        run()
        best = min(best, time.process_time() - start)
    print(args.phase, args.case, round(best, 4), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
