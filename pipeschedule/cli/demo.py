"""`pipeschedule demo`: what a cap buys and what it costs, in ten seconds.

Compiles 1f1b, capped_1f1b (cap 2) and interleaved_1f1b (v=2) for pp=4 and 8
microbatches, verifies each against every rule, simulates them under the default costs
(a rank's share of the model: F=1, B=2) and prints their timelines and a table of bubble
fraction and per-rank peak in-flight stage-microbatches. Then what installed packages
register after it ([Note: registered commands] in command.py): the nanotron adapter, where
torch and nanotron are installed (`pip install torch==2.13.0 -e '.[nanotron]'`), has
nanotron's own trainer train nanotron's own Llama from a YAML file on CPU, pp=4 over 4
gloo processes, with nanotron's 1F1B and with our capped_1f1b (cap 2): equal losses, and
the first stage's stash halved.
"""

from __future__ import annotations

from pipeschedule import compile_schedule
from pipeschedule.cli.command import DEMO_GROUP, registered
from pipeschedule.errors import ParameterError
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

    header = ("schedule", "step time", "bubble", "peak in-flight stage-microbatches per rank",
              "= microbatches' activations")
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
    """What installed packages register to run after the schedules ([Note: registered
    commands] in command.py: the nanotron adapter's training on CPU); the compiler imports
    no torch, so the part that needs it is theirs. Returns the first non-zero exit code."""
    parts = registered(DEMO_GROUP)
    if not parts:
        print("\n(training part skipped: no installed package registers one; the nanotron adapter does once "
              "installed with `pip install torch==2.13.0 -e '.[nanotron]'`)")
        return 0
    for name, entry in parts.items():
        try:
            part = entry.load()
        except Exception as err:  # noqa: BLE001  (its module failing to import: said in one line)
            raise ParameterError(f"demo part {name!r} is registered by {entry.value}, which cannot be loaded: "
                                 f"{type(err).__name__}: {err} (reinstall: pip install -e .)") from None
        code = part()
        if code:
            return code
    return 0
