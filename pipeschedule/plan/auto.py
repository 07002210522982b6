"""What `pp_engine: auto` picks once its first step has measured the model ([Note: auto
engine] in integration/nanotron/pipeline/engine.py). Pure arithmetic: no torch.

[Note: auto choice] The layout is fixed when nanotron builds the model (nanotron's split,
one stage per rank), so auto chooses among the schedules that run on it: 1F1B and
capped 1F1B. Under capped 1F1B with cap c, rank r of pp holds min(c, pp - r, m)
microbatches' stashes at its peak (1F1B: c = pp), so with static[r] the bytes rank r
holds besides its stash (measured at the first step, run with cap 1) and stash[r] one
microbatch's stash (the ledger's), its peak is static[r] + min(c, pp - r, m) * stash[r].
Fewer microbatches in flight never run faster under 1F1B's order, so the answer is each
rank's largest cap that fits, made non-increasing along the pipeline (as capped_1f1b
needs): 1F1B itself when every rank holds its min(pp - r, m), one uniform cap when that is what
the caps are, else per-rank caps; nothing fits when a rank cannot hold one microbatch.

[Note: auto offload] A cap buys memory with throughput (a capped first stage waits a
whole pipeline round trip per microbatch); host offload buys it with copies, nearly free
over a fast link (GH200's). So when 1F1B does not fit and the first step also measured
each rank's F and B seconds and its host link (`Measured`), `choose` sets two candidates
against each other under one cost model (those times, the stash bytes, that link): the
caps above, and 1F1B with the stashes of every rank that 1F1B overflows streamed to host
memory in `STREAM_MIB` chunks (`ps_1f1b:offload=R0/R1..,stream=64`). Each is simulated
(`pipeschedule.simulate`: device stash bytes over the step, step time); a candidate fits
when static + its device peak stays within every rank's budget, and the faster fitting
one wins. Two rules keep offload honest, both from its run on the H200
(benchmarks/results/auto_engine.md, four ranks sharing one GPU and its PCIe link):
- An offloading rank is counted with at least one whole stash on the device
  ([Note: streamed offload floor] in plan/offload.py: the runtime kept 0.45 of a stash
  where the simulator said 0.15).
- Where a cap fits, offload is considered only on ranks whose link copies a stash out
  within one F (`stash / host_bandwidth <= forward_s`), so that streaming hides behind
  the compute: there, with copies slower than F, the simulator put offload at 0.82x of
  cap 2's step and it ran at about 1.08x.
So offload never fits where cap 1 does not (cap 1 also holds one stash): it is chosen
only for speed, where it beats the cap in simulation with its copies hidden.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipeschedule.compiler.ir import BUFFERS
from pipeschedule.compiler.offload import add_offload
from pipeschedule.compiler.spec import ScheduleSpec, compile_spec
from pipeschedule.errors import ParameterError
from pipeschedule.plan.memory import GiB
from pipeschedule.plan.offload import streamed_device_peak
from pipeschedule.simulate import CostModel, simulate

STREAM_MIB = 64  # chunk of the streamed offload auto chooses (the H200 runs streamed 64 MiB chunks)


@dataclass(frozen=True)
class AutoChoice:
    """spec: the schedule chosen (its pp_engine value: `engine`); peaks: predicted bytes
    per rank; why: one line; step_time: simulated seconds where candidates were set
    against each other (None otherwise); offload: the ranks whose stashes stream to host
    memory."""

    spec: ScheduleSpec
    cap: int | tuple[int, ...] | None
    peaks: tuple[float, ...]
    why: str
    step_time: float | None = None
    offload: tuple[int, ...] = ()

    @property
    def engine(self) -> str:
        """The pp_engine value that pins the choice."""
        return self.spec.to_string()


@dataclass(frozen=True)
class Measured:
    """What the first step measured, per pp rank ([Note: auto offload]): `static` bytes
    (all but the stash), one microbatch's `stash` bytes, the `budget` bytes; and, for
    setting caps against offload, the seconds of one F (`forward_s`) and one B
    (`backward_s`) of the rank's stage, and its host link's bytes per second
    (`host_bandwidth`); None where not measured (then caps alone are chosen)."""

    static: tuple[float, ...]
    stash: tuple[float, ...]
    budget: tuple[float, ...]
    forward_s: tuple[float, ...] | None = None
    backward_s: tuple[float, ...] | None = None
    host_bandwidth: tuple[float, ...] | None = None

    def times_known(self) -> bool:
        return None not in (self.forward_s, self.backward_s, self.host_bandwidth)


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
    if all(c >= min(pp - r, microbatches) for r, c in enumerate(caps)):  # what 1F1B holds at this m fits
        peaks = tuple(static[r] + inflight(pp, microbatches, pp, r) * stash[r] for r in range(pp))
        return AutoChoice(ScheduleSpec("1f1b"), None, peaks, "1F1B fits every rank")
    if all(c == min(caps[0], pp - r) for r, c in enumerate(caps)):
        return AutoChoice(ScheduleSpec("capped_1f1b", cap=caps[0]), caps[0], peaks,
                          f"1F1B does not fit; cap {caps[0]} is the largest that does")
    text = "/".join(map(str, caps))
    return AutoChoice(ScheduleSpec("capped_1f1b", cap=tuple(caps)), tuple(caps), peaks,
                      f"the largest caps per rank that fit: {text}")


def choose(pp: int, microbatches: int, measured: Measured) -> AutoChoice:
    """The faster of capped 1F1B and 1F1B with streamed offload that fits ([Note: auto
    offload]); caps alone (`choose_cap`) where the times were not measured. Raises
    ParameterError naming the rank and its figures when not even cap 1 fits."""
    capped = choose_cap(pp, microbatches, measured.static, measured.stash, measured.budget)
    if capped.cap is None or not measured.times_known():
        return capped
    _check_times(pp, measured)
    cost = _cost(measured)
    capped = replace(capped, step_time=simulate(_compiled(pp, microbatches, capped.cap), cost).step_time)
    offloaded = _offload_candidate(pp, microbatches, measured, cost)
    if offloaded is None:
        return replace(capped, why=f"{capped.why}; streaming the overflowing ranks' stashes would not hide "
                                   "behind their forwards")
    best, other = (offloaded, capped) if offloaded.step_time < capped.step_time else (capped, offloaded)
    return replace(best, why=f"{best.why}; {best.step_time / other.step_time:.3f}x the simulated step time of "
                             f"{other.engine}")


def _offload_candidate(pp: int, m: int, measured: Measured, cost: CostModel) -> AutoChoice | None:
    """1F1B with the stashes of the ranks it overflows streamed to host memory, or None
    when that does not fit or a rank's copies would not hide behind its forwards
    ([Note: auto offload])."""
    over = tuple(r for r in range(pp) if measured.static[r] + inflight(pp, m, pp, r) * measured.stash[r]
                 > measured.budget[r])
    if not over or any(measured.stash[r] / measured.host_bandwidth[r] > measured.forward_s[r] for r in over):
        return None
    spec = ScheduleSpec("1f1b", offload=over, stream=STREAM_MIB)
    policy = spec.offload_policy()
    result = simulate(add_offload(_compiled(pp, m, None), policy), policy.cost(cost))
    peaks = tuple(measured.static[r] + (streamed_device_peak(result.peak_bytes[r], [measured.stash[r]]) if r in over
                                        else result.peak_bytes[r]) for r in range(pp))
    if any(p > b for p, b in zip(peaks, measured.budget)):
        return None
    ranks = "/".join(map(str, over))
    return AutoChoice(spec, None, peaks,
                      f"1F1B does not fit; 1F1B with rank {ranks}'s stashes streamed to host memory does",
                      result.step_time, over)


def _compiled(pp: int, m: int, cap):
    spec = ScheduleSpec("1f1b") if cap is None else ScheduleSpec("capped_1f1b", cap=cap)
    return compile_spec(spec, pp=pp, microbatches=m, check=False)


def _cost(measured: Measured) -> CostModel:
    """The simulator's costs of the measured step: per stage its F and B seconds and its
    stash bytes (other buffers count as static), messages free, the slowest rank's host link."""
    link = min(measured.host_bandwidth)
    stages = len(measured.stash)
    buffers = {kind: (measured.stash if kind == "stash" else (0,) * stages) for kind in BUFFERS}
    return CostModel(tuple(measured.forward_s), tuple(measured.backward_s), (0.0,) * stages, buffers,
                     offload_bandwidth=link, reload_bandwidth=link)


def _check_times(pp: int, measured: Measured) -> None:
    for name in ("forward_s", "backward_s", "host_bandwidth"):
        figures = getattr(measured, name)
        if len(figures) != pp or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                         and math.isfinite(x) and x >= 0 for x in figures):
            raise ParameterError(f"auto's {name} figures must be one finite number >= 0 per rank (pp={pp}), "
                                 f"got {list(figures)!r}")
    if not all(x > 0 for x in measured.host_bandwidth):
        raise ParameterError(f"auto's host_bandwidth must be > 0 bytes/s on every rank, got "
                             f"{list(measured.host_bandwidth)!r}")


__all__ = ["STREAM_MIB", "AutoChoice", "Measured", "choose", "choose_cap", "inflight"]
