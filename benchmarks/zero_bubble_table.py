"""The zero-bubble and V-shape families side by side under unit costs.

    python -m benchmarks.zero_bubble_table                 # pp=4, m=16 (the table of docs/schedules.md)
    python -m benchmarks.zero_bubble_table --pp 8 -m 32

Costs per stage: F = B = W = 1 for split-backward schedules; 1F1B's B is the whole
backward, B = 2 (W = 0). No communication cost. Activation: the simulator's peak of live
stash bytes per rank ([Note: when bytes count]), the stash of one (stage, mb) weighing
1/virtual, so 1 is one microbatch through a rank's whole share of layers (a V-shape stage
holds half of it). capped_1f1b is capped at V-Half's first-rank activation.
"""

from __future__ import annotations

import argparse
from fractions import Fraction

from pipeschedule import compile_schedule
from pipeschedule.simulate import CostModel, simulate


def unit_cost(schedule) -> CostModel:
    """F = B = W = 1 per stage (B = 2, W = 0 without a split); stash 1/virtual per (stage, mb)."""
    S, split = schedule.num_stages, schedule.split_backward
    return CostModel((1,) * S, ((1 if split else 2),) * S, ((1 if split else 0),) * S,
                     {"stash": (Fraction(1, schedule.virtual),) * S})


def figures(name: str, pp: int, microbatches: int, cap=None):
    """(schedule, bubble fraction, per-rank peak activation, step time per unit of work)."""
    schedule = compile_schedule(name, pp=pp, microbatches=microbatches, cap=cap)
    result = simulate(schedule, unit_cost(schedule))
    return schedule, result


def rows(pp: int, microbatches: int):
    v_half = figures("v_half", pp, microbatches)[1]
    same = int(max(v_half.peak_bytes))  # capped 1F1B at V-Half's activation, in microbatches
    cases = [("1f1b", None), ("capped_1f1b", same), ("zb_h1", None), ("zbv", None), ("v_half", None), ("v_min", None)]
    base = None
    for name, cap in cases:
        schedule, result = figures(name, pp, microbatches, cap)
        time = result.step_time / schedule.virtual  # a V-shape stage is half a rank's share
        base = base or time
        yield name if cap is None else f"{name} cap={cap}", result, base / time


def table(pp: int, microbatches: int) -> str:
    lines = [
        "| schedule | bubble | peak activation per rank (microbatches) | throughput vs 1f1b |",
        "|---|---|---|---|",
    ]
    for label, result, relative in rows(pp, microbatches):
        peaks = ", ".join(f"{float(b):g}" for b in result.peak_bytes)
        lines.append(f"| {label} | {result.bubble_fraction:.3f} | {peaks} | {relative:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", "-m", type=int, default=16)
    args = parser.parse_args(argv)
    print(f"pp={args.pp}, m={args.microbatches}, unit costs F=B=W=1 per stage (1F1B: B=2), no communication cost")
    print(table(args.pp, args.microbatches))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
