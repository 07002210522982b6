"""The search behind the `searched` family (searched.py): compute orders timed with
per-stage F, B and W times and message delays, built by list scheduling and improved by
local search, each within a per-rank cap. It knows nothing of the other families; its
caller seeds it and picks the result by simulation.

[Note: search model] An order is one list per rank of (op, stage, mb), op F, B or W (a
split backward: B the input gradient, W the weight gradient). `finish` times it as
every instruction running as soon as its rank is free and its inputs are there: F(s, mb)
after F(s-1, mb) plus the message delay of that boundary (0 where both stages share a
rank), B(s, mb) after F(s, mb) and B(s+1, mb) plus its delay, W(s, mb) after B(s, mb).
The delay of a message is the cost's latency plus its bytes over the bandwidth, as the
simulator charges when the receive is posted before the message is sent; it is a model
of the simulator, not the simulator, so the caller compares its best results by
simulation ([Note: searched schedule] in searched.py). `finish` returns None for an
order with a dependency cycle (a rank waits for an end that never comes).

A rank's *in-flight* count is the stage-microbatches whose F has run and whose B has not
(rule 6's count); its *held* count those whose F has run and whose W has not (the
stashes it keeps, some of them past their B). Every order made or accepted here keeps
both within the problem's `limits` and `stash_limits` at every instruction.

[Note: local search] `improve` anneals: it swaps two neighbouring instructions of one
rank picked at random (a fixed seed: every rank that runs the search finds the same
order), keeps the swap when the order stays acyclic and within the limits and its step
time is lower, or higher by d with probability exp(-d / T), T falling linearly from
TEMPERATURE times the start's step time to 0, and returns the best order it met (a
smaller step time, or the same and a smaller sum of the ranks' finishes: that second
key breaks the ties of a flat critical path). It never swaps two instructions of one
stage and op (each stage runs its F, B and W in microbatch order) nor two of one
(stage, mb), and it times at most MAX_TRIES swaps and `budget` instructions in all.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass
from typing import Sequence

from pipeschedule.errors import ParameterError

F, B, W = 0, 1, 2
OPS = "FBW"
MAX_TRIES = 2048  # swaps the local search times from one start, at most
TEMPERATURE = 0.01  # the local search's first temperature, a fraction of the step time
Order = list  # per rank: a list of (op, stage, mb)


@dataclass(frozen=True)
class Problem:
    """What the search orders: `microbatches` through the stages of `placement` (rank of
    each stage), rank r holding at most `limits[r]` stage-microbatches in flight (F to B,
    rule 6) and `stash_limits[r]` from F to W, timed by per-stage `forward`, `backward`
    (input gradient), `weight` and the delay of each boundary's messages: `send_f[s]`
    from stage s to s+1, `send_b[s]` from stage s back to s-1 (0 where the two stages
    share a rank)."""

    placement: tuple[int, ...]
    microbatches: int
    limits: tuple[int, ...]
    stash_limits: tuple[int, ...]
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...]
    send_f: tuple[float, ...]
    send_b: tuple[float, ...]

    @property
    def pp(self) -> int:
        return len(self.limits)

    @property
    def stages(self) -> int:
        return len(self.placement)

    @property
    def size(self) -> int:
        """Instructions of one order: F, B and W of every (stage, mb)."""
        return 3 * self.stages * self.microbatches


def finish(problem: Problem, order: Order) -> tuple[float, float] | None:
    """(step time, sum of the ranks' last ends) of `order` ([Note: search model]), or
    None when it has a dependency cycle. Linear in the instructions: a rank runs until
    it needs an end not yet known, and is resumed when that end is produced."""
    S, m, pp = problem.stages, problem.microbatches, problem.pp
    durations = (problem.forward, problem.backward, problem.weight)
    send_f, send_b = problem.send_f, problem.send_b
    f_end, b_end = [None] * (S * m), [None] * (S * m)
    f_parked, b_parked = [None] * (S * m), [None] * (S * m)
    pcs, free = [0] * pp, [0.0] * pp
    work = list(range(pp - 1, -1, -1))
    while work:
        r = work.pop()
        program, pc, t = order[r], pcs[r], free[r]
        n = len(program)
        while pc < n:
            op, s, mb = program[pc]
            k = s * m + mb
            if op == F:
                ready = 0.0
                if s:
                    end = f_end[k - m]
                    if end is None:
                        _park(f_parked, k - m, r)
                        break
                    ready = end + send_f[s - 1]
            elif op == B:
                ready = f_end[k]
                if ready is None:
                    _park(f_parked, k, r)
                    break
                if s < S - 1:
                    end = b_end[k + m]
                    if end is None:
                        _park(b_parked, k + m, r)
                        break
                    end += send_b[s + 1]
                    if end > ready:
                        ready = end
            else:
                ready = b_end[k]
                if ready is None:
                    _park(b_parked, k, r)
                    break
            t = (ready if ready > t else t) + durations[op][s]
            if op == F:
                f_end[k] = t
                if f_parked[k] is not None:
                    work += f_parked[k]
                    f_parked[k] = None
            elif op == B:
                b_end[k] = t
                if b_parked[k] is not None:
                    work += b_parked[k]
                    b_parked[k] = None
            pc += 1
        pcs[r], free[r] = pc, t
    if any(pc < len(program) for pc, program in zip(pcs, order)):
        return None
    return max(free), sum(free)


def _park(parked: list, key: int, rank: int) -> None:
    if parked[key] is None:
        parked[key] = [rank]
    else:
        parked[key].append(rank)


def held_peaks(problem: Problem, order: Order) -> tuple[list[int], list[int]]:
    """Per rank, the most stage-microbatches in flight (F run, B not: rule 6's count) and
    the most held (F run, W not; B where the order has no W for that (stage, mb))."""
    inflight, stash = [], []
    for program in order:
        split = {(s, mb) for op, s, mb in program if op == W}
        now = held = top = top_held = 0
        for op, s, mb in program:
            if op == F:
                now, held = now + 1, held + 1
                top, top_held = max(top, now), max(top_held, held)
            elif op == B:
                now -= 1
                if (s, mb) not in split:
                    held -= 1
            else:
                held -= 1
        inflight.append(top)
        stash.append(top_held)
    return inflight, stash


def within_limits(problem: Problem, order: Order) -> bool:
    """Whether `order` keeps every rank within its cap and its stash limit."""
    inflight, stash = held_peaks(problem, order)
    return all(i <= c for i, c in zip(inflight, problem.limits)) and \
        all(h <= c for h, c in zip(stash, problem.stash_limits))


def list_order(problem: Problem, *, prefer_b: bool, eager_w: bool) -> Order | None:
    """A split-backward order by event-driven list scheduling under the search model:
    whenever a rank is free it runs a ready B or a ready F that its limits allow (B
    first when `prefer_b`, else F first; among several, the oldest microbatch, then the
    later stage), else its oldest pending W; with `eager_w` a W runs right after its B.
    An F that brings a microbatch into the rank (its first local stage) needs a free
    slot for each of the rank's stages, so that the oldest microbatch can always move on
    ([Note: split list scheduling] in zero_bubble.py). None if it stops short (it does
    not under B first; the tests check)."""
    S, m, pp = problem.stages, problem.microbatches, problem.pp
    placement, limits, stash_limits = problem.placement, problem.limits, problem.stash_limits
    durations = (problem.forward, problem.backward, problem.weight)
    local = [[s for s in range(S) if placement[s] == r] for r in range(pp)]
    entry = [stages[0] if stages else None for stages in local]
    f_ready = [[None] * m for _ in range(S)]  # when F(s, mb)'s input is on its rank
    b_ready = [[None] * m for _ in range(S)]  # when B(s, mb)'s output gradient is
    for mb in range(m):
        f_ready[0][mb] = 0.0
    f_done = [[None] * m for _ in range(S)]
    next_f, next_b = [0] * S, [0] * S
    inflight, held, free_at = [0] * pp, [0] * pp, [0.0] * pp
    pending_w = [[] for _ in range(pp)]
    order: Order = [[] for _ in range(pp)]
    wakeups = [(0.0, r) for r in range(pp)]
    while wakeups:
        t, r = heapq.heappop(wakeups)
        if free_at[r] > t:
            continue
        ready_b = ready_f = None
        for s in local[r]:
            mb = next_b[s]
            if mb < next_f[s] and f_done[s][mb] <= t and b_ready[s][mb] is not None and b_ready[s][mb] <= t:
                if ready_b is None or (mb, -s) < (ready_b[2], -ready_b[1]):
                    ready_b = (B, s, mb)
            mb = next_f[s]
            if mb < m and f_ready[s][mb] is not None and f_ready[s][mb] <= t:
                need = len(local[r]) if s == entry[r] else 1  # entering keeps a slot for each later local stage
                if inflight[r] + need <= limits[r] and held[r] + need <= stash_limits[r]:
                    if ready_f is None or (mb, -s) < (ready_f[2], -ready_f[1]):
                        ready_f = (F, s, mb)
        if eager_w and pending_w[r]:
            choice = (W, *pending_w[r].pop(0))
        else:
            first, second = (ready_b, ready_f) if prefer_b else (ready_f, ready_b)
            choice = first or second
            if choice is None and pending_w[r]:
                choice = (W, *pending_w[r].pop(0))
        if choice is None:
            continue  # idle until a message arrives or this rank finishes something
        op, s, mb = choice
        end = free_at[r] = t + durations[op][s]
        order[r].append(choice)
        heapq.heappush(wakeups, (end, r))
        if op == F:
            f_done[s][mb] = end
            next_f[s] += 1
            inflight[r] += 1
            held[r] += 1
            if s == S - 1:
                b_ready[s][mb] = end
            else:
                arrive = end + problem.send_f[s]
                f_ready[s + 1][mb] = arrive
                heapq.heappush(wakeups, (arrive, placement[s + 1]))
        elif op == B:
            next_b[s] += 1
            inflight[r] -= 1
            pending_w[r].append((s, mb))
            if s:
                arrive = end + problem.send_b[s]
                b_ready[s - 1][mb] = arrive
                heapq.heappush(wakeups, (arrive, placement[s - 1]))
        else:
            held[r] -= 1
    if sum(map(len, order)) != problem.size:
        return None
    return order


def split_after(order: Sequence[Sequence[tuple[int, int, int]]]) -> Order:
    """An unsplit order (F and whole B) as a split one: each W right after its B."""
    return [[step for op, s, mb in program for step in ((op, s, mb),) + (((W, s, mb),) if op == B else ())]
            for program in order]


def _swappable(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
    """Whether neighbours a, b of one rank may trade places ([Note: local search])."""
    return not ((a[0] == b[0] and a[1] == b[1]) or (a[1] == b[1] and a[2] == b[2]))


def _counts_ok(program: list, limit: int, stash_limit: int, at: int) -> bool:
    """Whether `program` (split: every B has its W) stays within `limit` in flight and
    `stash_limit` held through position `at` (a swap of positions at - 1 and at moves
    the counts only between them)."""
    inflight = held = 0
    for op, _, _ in program[:at + 1]:
        if op == F:
            inflight, held = inflight + 1, held + 1
        elif op == B:
            inflight -= 1
        else:
            held -= 1
    return inflight <= limit and held <= stash_limit


def improve(problem: Problem, order: Order, budget: int, seed: int = 0) -> tuple[tuple[float, float], Order, int]:
    """The annealing of [Note: local search] from `order` (acyclic and within the limits; not changed),
    timing at most `budget` instructions in all. Returns (the best key, its order, the
    budget left)."""
    order = [list(program) for program in order]
    current = best = finish(problem, order)
    if best is None:
        raise ParameterError("improve needs an acyclic order (finish() is None for this one)")
    kept = [list(program) for program in order]
    size = sum(map(len, order))
    tries = total = min(budget // size, MAX_TRIES)
    rng = random.Random(seed)
    ranks = [r for r, program in enumerate(order) if len(program) > 1]
    start = TEMPERATURE * best[0]
    for _ in range(4 * tries):  # each try is timed or refused before timing
        if tries <= 0 or not ranks:
            break
        r = ranks[rng.randrange(len(ranks))]
        program = order[r]
        i = rng.randrange(len(program) - 1)
        a, b = program[i], program[i + 1]
        if not _swappable(a, b):
            continue
        program[i], program[i + 1] = b, a
        if b[0] == F and not _counts_ok(program, problem.limits[r], problem.stash_limits[r], i):
            program[i], program[i + 1] = a, b
            continue
        tries -= 1
        budget -= size
        key = finish(problem, order)
        if key is None:
            program[i], program[i + 1] = a, b
            continue
        rise = key[0] - current[0]
        heat = start * tries / total  # cooling linearly to 0
        if rise <= 0 or (heat > 0 and rng.random() < math.exp(-rise / heat)):
            current = key
            if better(key, best):
                best, kept = key, [list(p) for p in order]
        else:
            program[i], program[i + 1] = a, b
    return best, kept, budget


def better(key: tuple[float, float], than: tuple[float, float]) -> bool:
    """Whether `key` is strictly below `than`, ignoring differences of rounding (sums of
    the same durations in another order): a smaller step time, or the same step time and
    a smaller sum of the ranks' finishes."""
    (time, total), (best_time, best_total) = key, than
    tolerance = 1e-9 * max(1.0, abs(best_time))
    if time < best_time - tolerance:
        return True
    return abs(time - best_time) <= tolerance and total < best_total - tolerance * len(key)


__all__ = ["B", "F", "OPS", "Order", "Problem", "W", "better", "finish", "held_peaks", "improve", "list_order",
           "split_after", "within_limits"]
