"""`pipeschedule demo`: what a cap buys and what it costs, in ten seconds.

Compiles 1f1b, capped_1f1b (cap 2) and interleaved_1f1b (v=2) for pp=4 and 8
microbatches, verifies each against every rule, simulates them under the default costs
(a rank's share of the model: F=1, B=2) and prints their timelines and a table of bubble
fraction and per-rank peak in-flight microbatches. Then, where torch and nanotron are
installed (`pip install torch==2.13.0 -e '.[nanotron]'`), nanotron's own trainer trains
nanotron's own Llama from a YAML file on CPU, pp=4 over 4 gloo processes, with
nanotron's 1F1B and with our capped_1f1b (cap 2): equal losses, and the first stage's
stash halved.
"""

from __future__ import annotations

import importlib.util

from pipeschedule import compile_schedule
from pipeschedule.simulate import CostModel, simulate
from pipeschedule.simulate.render import ascii_timeline

PP, MICROBATCHES = 4, 8
CASES = (
    ("1f1b", dict(name="1f1b")),
    ("capped_1f1b cap=2", dict(name="capped_1f1b", cap=2)),
    ("interleaved_1f1b v=2", dict(name="interleaved_1f1b", virtual=2)),
)


def run_demo() -> int:
    rows = []
    for label, params in CASES:
        params = dict(params)
        schedule = compile_schedule(params.pop("name"), pp=PP, microbatches=MICROBATCHES, **params)  # verified
        result = simulate(schedule, CostModel.default(schedule))
        count = sum(len(p) for p in schedule.programs)
        print(f"== {label}: pp={PP}, {MICROBATCHES} microbatches, {count} instructions, verified (6 rules)")
        print(ascii_timeline(schedule, result, width=100))
        print()
        # In-flight memory of interleaved is counted in chunks (1/v of a rank's layers).
        per_mb = [round(n / schedule.virtual, 2) for n in result.peak_inflight]
        rows.append((label, result.step_time, result.bubble_fraction, list(result.peak_inflight), per_mb))

    header = ("schedule", "step time", "bubble", "peak in-flight per rank", "= microbatches' activations")
    table = [header] + [(r[0], f"{r[1]:g}", f"{r[2]:.3f}", str(r[3]), str(r[4])) for r in rows]
    widths = [max(len(row[c]) for row in table) for c in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    base = rows[0]
    capped = rows[1]
    print(
        f"\ncap 2 holds rank 0 to {capped[3][0]} microbatches in flight instead of {base[3][0]} "
        f"({capped[4][0] / base[4][0]:.0%} of 1F1B's first-stage activations) and costs "
        f"{capped[1] / base[1] - 1:.0%} more step time; interleaving cuts the bubble from "
        f"{base[2]:.3f} to {rows[2][2]:.3f}."
    )
    return _training_demo()


def _training_demo() -> int:
    # The compiler imports no torch: only look for it here; integration/ does the rest.
    missing = [name for name in ("torch", "nanotron", "einops") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"\n(training part skipped: {', '.join(missing)} not installed; install it with "
              f"`pip install torch==2.13.0 -e '.[nanotron]'`)")
        return 0
    from integration.nanotron.demo import run_training_demo  # repairs nanotron 0.4, registers our engines

    print("\n== training: nanotron's trainer and Llama, its own 1F1B against pipeschedule's capped_1f1b (cap 2)")
    return run_training_demo()
