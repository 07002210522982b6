"""What `pp_engine: auto` picks once its first step has measured the model ([Note: auto
engine] in integration/nanotron/engine.py). Pure arithmetic: no torch.

[Note: auto choice] The layout is fixed when nanotron builds the model (nanotron's split,
one stage per rank), so auto chooses among the schedules that run on it: 1F1B and
capped 1F1B. Under capped 1F1B with cap c, rank r of pp holds min(c, pp - r, m)
microbatches' stashes at its peak (1F1B: c = pp), so with static[r] the bytes rank r
holds besides its stash (measured at the first step, run with cap 1) and stash[r] one
microbatch's stash (the ledger's), its peak is static[r] + min(c, pp - r, m) * stash[r].
Fewer microbatches in flight never run faster under 1F1B's order, so the answer is each
rank's largest cap that fits, made non-increasing along the pipeline (as capped_1f1b
needs): 1F1B itself when every rank holds its pp - r, one uniform cap when that is what
the caps are, else per-rank caps; nothing fits when a rank cannot hold one microbatch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipeschedule.errors import ParameterError
from pipeschedule.plan.memory import GiB


@dataclass(frozen=True)
class AutoChoice:
    """engine: the pp_engine value chosen; peaks: predicted bytes per rank; why: one line."""

    engine: str
    cap: int | tuple[int, ...] | None
    peaks: tuple[float, ...]
    why: str


def inflight(pp: int, microbatches: int, cap: int, rank: int) -> int:
    """Microbatches rank `rank` holds at its peak under capped 1F1B ([Note: auto choice])."""
    return min(cap, pp - rank, microbatches)


def choose_cap(pp: int, microbatches: int, static: Sequence[float], stash: Sequence[float],
               budget: Sequence[float]) -> AutoChoice:
    """The fastest 1F1B-family schedule that fits ([Note: auto choice]); raises
    ParameterError naming the rank and what it needs when not even one microbatch fits."""
    if not (len(static) == len(stash) == len(budget) == pp):
        raise ParameterError(f"auto needs one static, stash and budget figure per rank (pp={pp}), "
                             f"got {len(static)}, {len(stash)}, {len(budget)}")
    for name, figures in (("static", static), ("stash", stash), ("budget", budget)):
        for r, x in enumerate(figures):
            if not (isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0
                    and (name == "budget" or math.isfinite(x))):
                raise ParameterError(f"auto's {name} figure of rank {r} is {x!r}; accepted: bytes >= 0, finite "
                                     "(a budget may be unbounded)")

    caps, running = [], pp
    for r in range(pp):
        room = budget[r] - static[r]
        k = pp if stash[r] <= 0 or math.isinf(room) else int(room // stash[r])
        running = min(running, k, pp - r)
        if running < 1:
            raise ParameterError(
                f"pp_engine auto: nothing fits: rank {r} needs {(static[r] + stash[r]) / GiB:.2f} GiB with one "
                f"microbatch in flight ({static[r] / GiB:.2f} static + {stash[r] / GiB:.2f} stash), budget "
                f"{budget[r] / GiB:.2f} GiB; lower the reserve, recompute (pp_engine ...:recompute=full) or use "
                "more GPUs")
        caps.append(running)
    peaks = tuple(static[r] + inflight(pp, microbatches, caps[r], r) * stash[r] for r in range(pp))
    if all(c == pp - r for r, c in enumerate(caps)):
        return AutoChoice("ps_1f1b", None, peaks, "1F1B fits every rank")
    if all(c == min(caps[0], pp - r) for r, c in enumerate(caps)):
        return AutoChoice(f"capped_1f1b:cap={caps[0]}", caps[0], peaks,
                          f"1F1B does not fit; cap {caps[0]} is the largest that does")
    text = "/".join(map(str, caps))
    return AutoChoice(f"capped_1f1b:cap={text}", tuple(caps), peaks, f"the largest caps per rank that fit: {text}")


__all__ = ["AutoChoice", "choose_cap", "inflight"]
