"""The exact split search of [Note: exact split search] (partition.py): linear cuts from
critical paths, per-stage caps they imply, a branch and bound over stage boundaries that
simulates the leaves it reaches, and Kelley's method on the relaxation that strengthens
its cuts ([Note: split relaxation], split_relax.py).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from itertools import accumulate, chain, islice, repeat
from operator import add, sub

from pipeschedule.simulate.critical_path import CriticalPath
from pipeschedule.plan.split_problem import Evaluator
from pipeschedule.plan.split_relax import Relaxation


class Cut:
    """A linear lower bound on the step time: const + sum over stages of the weighted
    layer costs ([Note: exact split search]); per-stage prefix sums make a range O(1).
    `coef` keeps what made it (per-stage weights of F, B and W, and the constant)."""

    def __init__(self, ev: Evaluator, forward, backward, weight, const: float) -> None:
        p = ev.p
        self.coef = (tuple(forward), tuple(backward), tuple(weight), const)
        self.const = const + sum(
            a * x + b * y + c * z
            for a, b, c, x, y, z in zip(forward, backward, weight, p.stage_forward, p.stage_backward, p.stage_weight)
        )
        self.prefix = []
        layers = list(zip(p.layer_forward, p.layer_backward, p.layer_weight))
        for a, b, c in zip(forward, backward, weight):
            if ev.homogeneous:  # one layer's weight, summed as the list of equal ones would be
                f, g, h = layers[0]
                self.prefix.append([0.0, *accumulate(repeat(a * f + b * g + c * h, len(layers)))])
                continue
            unit = [a * f + b * g + c * h for f, g, h in layers]
            self.prefix.append([0.0, *accumulate(unit)])
        self.unit = [pre[1] - pre[0] for pre in self.prefix]  # per-layer weight when homogeneous

    def value(self, split: Sequence[int]) -> float:
        """This bound's value at a split."""
        bounds = [0, *accumulate(split)]
        return self.const + sum(pre[bounds[s + 1]] - pre[bounds[s]] for s, pre in enumerate(self.prefix))

    def completion(self, first: list, caps: list | None, L: int) -> list:
        """table[s][j]: a lower bound on this cut's part from stages s.. holding layers
        j..L-1 (math.inf where they cannot). Homogeneous layers (`caps` given: the most
        layers each stage may take): fill the cheapest stages first; otherwise every
        remaining layer at its cheapest remaining stage."""
        S = len(self.prefix)
        table = [[math.inf] * (L + 1) for _ in range(S + 1)]
        table[S][L] = 0.0
        # The sums below run in C (map, accumulate) and add the same numbers in the same order
        # as a loop over the layers would.
        if caps is None:
            units = [math.inf] * L
            for s in range(S - 1, -1, -1):
                pre = self.prefix[s]
                units = list(map(min, units, map(sub, pre[1:], pre[:-1])))  # the cheapest layer i from stage s on
                sums = list(accumulate(reversed(units[first[s]:]), initial=0.0))[1:]  # layers L-1, L-2, ...
                table[s][first[s]:L] = sums[::-1]
            return table
        for s in range(S - 1, -1, -1):
            stages = sorted(range(s, S), key=lambda t: self.unit[t])
            base = sum(self.unit[t] for t in stages)
            need = S - s  # one layer per stage at least
            # each further layer in the cheapest stage with room: value k at row[L - need - k]
            steps = islice(chain.from_iterable(repeat(self.unit[t], caps[t] - 1) for t in stages), L - need)
            values = list(accumulate(steps, initial=base))
            table[s][L - need - len(values) + 1:L - need + 1] = values[::-1]
        return table


def stage_caps(cuts: list, S: int, L: int, limit: float, memory_caps: list) -> list:
    """Homogeneous layers: the most layers stage t may hold in any split all of whose cuts
    stay below `limit`, and within memory. A cut's value is at least const + a_t*n_t +
    (the cheapest way to place the other L - n_t layers on the other stages, within their
    caps); two passes let each stage's cap tighten the others'."""
    caps = [min(c, L - (S - 1)) for c in memory_caps]
    for _ in range(2):
        for cut in cuts:
            for t in range(S):
                unit = cut.unit[t]
                if unit <= 0:
                    continue
                others = sorted((cut.unit[u], caps[u]) for u in range(S) if u != t)
                n = caps[t]
                while n >= 1:
                    rest, value = L - n, cut.const + unit * n
                    for a, _c in others:  # one layer each, then cheapest first
                        value += a
                    rest -= len(others)
                    for a, c in others:
                        if rest <= 0:
                            break
                        take = min(rest, c - 1)
                        value += a * take
                        rest -= take
                    if rest <= 0 and value < limit:
                        break
                    if rest > 0:  # the others cannot hold the rest: t must hold more
                        break
                    n -= 1
                caps[t] = n
    return caps


def boundary_tables(ev: Evaluator):
    """maxe[s][j]: the last boundary e such that stage s holding j..e-1 fits on its own;
    feasible[s][j]: stages s.. can hold layers j.. (per-stage conditions). Kept by the
    problem's bytes (`Evaluator.kept`): read them, never change them."""
    return ev.kept("boundary tables", lambda: _boundary_tables(ev))


def _boundary_tables(ev: Evaluator):
    L, S = ev.p.num_layers, ev.p.num_stages
    maxe = [[0] * (L + 1) for _ in range(S)]
    static, stash = ev.prefix["layer_static"], ev.prefix["layer_stash"]
    for s in range(S):
        cap, e, row = ev.cap[ev.rank_of[s]], 0, maxe[s]
        extra_static, extra_stash, k = ev.p.stage_static[s], ev.p.stage_stash[s], ev.inflight[s]
        for j in range(L + 1):
            e = max(e, j)
            sj, tj = static[j], stash[j]
            # ev.stage_bytes(s, j, e + 1) <= cap, term for term: the same operations in the same order
            while e < L and (static[e + 1] - sj) + extra_static + k * ((stash[e + 1] - tj) + extra_stash) <= cap:
                e += 1
            row[j] = e
    feasible = [[False] * (L + 1) for _ in range(S + 1)]
    feasible[S][L] = True
    for s in range(S - 1, -1, -1):
        count = [0, *accumulate(int(x) for x in feasible[s + 1])]  # count[e] = feasible[s+1][0..e-1]
        for j in range(L):
            hi = min(maxe[s][j], L - (S - s - 1))
            if hi > j and count[hi + 1] - count[j + 1] > 0:
                feasible[s][j] = True
    return maxe, feasible


def balanced_seed(ev: Evaluator, maxe, feasible) -> tuple[int, ...] | None:
    """Least largest stage time (F+B+W) by bisection with greedy packing: a good start."""
    L, S = ev.p.num_layers, ev.p.num_stages
    one = [ev.p.layer_forward[i] + ev.p.layer_backward[i] + ev.p.layer_weight[i] for i in range(L)]
    extra = [ev.p.stage_forward[s] + ev.p.stage_backward[s] + ev.p.stage_weight[s] for s in range(S)]
    prefix = [0.0, *accumulate(one)]

    def pack(limit: float):
        j, split = 0, []
        for s in range(S):
            hi = min(maxe[s][j], L - (S - s - 1))
            e = j + 1
            while e < hi and prefix[e + 1] - prefix[j] + extra[s] <= limit and feasible[s + 1][e + 1]:
                e += 1
            if s == S - 1:
                e = L
                if prefix[L] - prefix[j] + extra[s] > limit:
                    return None
            if e > hi or not feasible[s + 1][e]:
                return None
            split.append(e - j)
            j = e
        return tuple(split)

    lo, hi = 0.0, prefix[-1] + max(extra)
    best = pack(hi)
    for _ in range(60):
        mid = (lo + hi) / 2
        found = pack(mid)
        if found is not None:
            best, hi = found, mid
        else:
            lo = mid
    return best if best is not None and ev.fits(best) else None


class Search:
    """One branch and bound over stage boundaries whose cuts grow as it simulates the
    leaves it reaches ([Note: exact split search]): a leaf that survives the current cuts
    is simulated once, its critical path becomes a cut, and the search goes on.

    For speed the cuts are stored by column: `prefix_col[s][e]` lists every cut's value of
    stage s over layers 0..e-1, `bound_col[s][e]` the same plus the completion bound of
    stages s+1.. from layer e, so a node's bound for boundary e is one max over a sum.
    The columns of the first `built` cuts are there; the rest are added when a run starts
    (cuts found outside a run, by seeds or the relaxation, cost nothing until then).
    Building one cut's columns writes S x (L + 1) numbers, as many as `column_work` nodes
    scan (a node scans up to one boundary per layer, L x pp as the budget counts it,
    [Note: plan search budget] in splits.py), so `nodes` counts each build as that many
    nodes; likewise each simulation after the seeds' (`seeded`: a leaf, a probe, a
    relaxation's split; `Evaluator.simulations`) walks the step graph's batches,
    `simulation_work` nodes. `work`, all of it in nodes, is
    what the node limit bounds, and a run that cannot build its columns within it does
    not start.
    """

    def __init__(self, ev: Evaluator, maxe, feasible, node_limit: int) -> None:
        self.ev, self.maxe, self.feasible, self.node_limit = ev, maxe, feasible, node_limit
        self.L, self.S = ev.p.num_layers, ev.p.num_stages
        self.homogeneous = ev.homogeneous
        self.memory_caps = [maxe[s][0] for s in range(self.S)]
        self.cuts: list[Cut] = []
        self.caps = None
        self.prefix_col = [[[] for _ in range(self.L + 1)] for _ in range(self.S)]
        self.bound_col = [[[] for _ in range(self.L + 1)] for _ in range(self.S)]
        self.built, self.running = 0, False
        self.best_split, self.best_time = None, math.inf
        self.fallback = (None, math.inf)  # the best split simulated, even above a cutoff
        self.nodes = 0
        self.column_work = -(-self.S * (self.L + 1) // (self.L * ev.schedule.pp))  # nodes a cut's columns count
        self.simulation_work = -(-len(ev.graph.order) // (self.L * ev.schedule.pp))  # nodes a simulation counts
        self.seeded = 0  # the simulations of the seeds, which every search runs: not counted
        self.seen: set = set()
        self.exploring: list[float] = []  # the bound of the option each open level explores
        self.stopped_bound: float | None = None  # what no split beats, where the last run stopped at its limit

    @property
    def work(self) -> int:
        """Nodes visited, columns built and simulations run, all in nodes."""
        return self.nodes + (self.ev.simulations - self.seeded) * self.simulation_work

    @property
    def limit(self) -> float:
        return self.best_time - 1e-12 * abs(self.best_time) if self.best_time < math.inf else math.inf

    def _columns(self, cut: Cut) -> None:
        self.nodes += self.column_work
        table = cut.completion(list(range(self.S)), self.caps, self.L)
        for s in range(self.S):  # the appends run in C (`map`): a cut's columns are S x (L + 1) numbers
            pre = cut.prefix[s]
            deque(map(list.append, self.prefix_col[s], pre), maxlen=0)
            deque(map(list.append, self.bound_col[s], map(add, pre, table[s + 1])), maxlen=0)

    def _build(self) -> None:
        for cut in self.cuts[self.built:]:
            self._columns(cut)
        self.built = len(self.cuts)

    def add_cut(self, cut: Cut) -> None:
        self.cuts.append(cut)
        if self.running:
            self._build()

    def add_path(self, path: CriticalPath) -> None:
        self.add_cut(Cut(self.ev, path.forward, path.backward, path.weight, path.messages))

    def evaluate(self, split: tuple) -> None:
        time, path = self.ev.step_time(split)
        if split not in self.seen:
            self.seen.add(split)
            self.add_path(path)
        if time < self.fallback[1] * (1 - 1e-12):  # ties keep the earlier (a seed first)
            self.fallback = (split, time)
        if time < self.best_time:
            self.best_split, self.best_time = split, time
            self._tighten()

    def _tighten(self) -> None:
        """Recompute the per-stage caps for the new limit, and the columns."""
        if not self.homogeneous or not self.cuts:
            return
        caps = stage_caps(self.cuts, self.S, self.L, self.limit, self.memory_caps)
        if caps == self.caps:
            return
        self.caps = caps
        self.prefix_col = [[[] for _ in range(self.L + 1)] for _ in range(self.S)]
        self.bound_col = [[[] for _ in range(self.L + 1)] for _ in range(self.S)]
        self.built = 0
        if self.running:
            self._build()

    def run(self) -> bool:
        """Search (again, from the top, with every cut found so far); True when it
        finished (the best split is then optimal). Nodes, and column builds as nodes,
        count over all runs."""
        self._tighten()
        if self.caps is not None and min(self.caps) < 1:
            return True
        self.chosen: list[int] = []
        self.used = [0.0] * len(self.ev.cap)
        ev = self.ev
        self.held = [0] * len(ev.cap)  # layers chosen per rank
        self.left = [len(stages) for stages in ev.stages_of]  # stages not chosen yet per rank
        self.floors = [ev.tail_floor(r, self.left[r]) for r in range(len(ev.cap))]  # each rank's tail, bounded below
        self.open = sum(1 for left in self.left if left)  # ranks with stages to choose, and the layers they hold
        self.open_held = 0
        if self.work + (len(self.cuts) - self.built) * self.column_work >= self.node_limit:
            self.stopped_bound = None  # its columns alone would pass the limit: stopped before its first choice
            return False
        self._build()
        self.running = True
        self.exploring, self.stopped_bound = [], None
        try:
            return self._dfs(0, 0, [c.const for c in self.cuts])
        finally:
            self.running = False

    def lower_bound(self) -> float | None:
        """Where the last run stopped at its node limit: a time no split that fits beats
        (None: it did not stop, or stopped before its first choice). Every split not yet
        ruled out completes the option some open level explores, or one after it in that
        level's order, whose bounds are no lower; so the least of those bounds, and the
        best time, bound them all."""
        if self.stopped_bound is None:
            return None
        return min(self.stopped_bound, self.best_time)

    def _partial(self, partial: list) -> list:
        """`partial` (cut values of the stages chosen so far) extended to cuts added since."""
        if len(partial) == len(self.cuts):
            return partial
        bounds = [0, *accumulate(self.chosen)]
        extra = [cut.const + sum(cut.prefix[t][bounds[t + 1]] - cut.prefix[t][bounds[t]]
                                 for t in range(len(self.chosen)))
                 for cut in self.cuts[len(partial):]]
        return partial + extra

    def _dfs(self, s: int, j: int, partial: list) -> bool:
        """Stages s.. from layer j on; partial: the cuts' values of the stages chosen so
        far. Every bound adds a bound below the step's tail, the largest of: each rank's
        (`floors`: exact for a rank whose stages are all chosen, else the least its layers
        so far and one more per stage to come allow, `Evaluator.tail_floor`), and the
        ranks' with stages to come together: they share the layers left, so one of them
        ends with at least their mean (`Evaluator.least_floor`), and the least tail of any
        split (`Evaluator.least_tail`)."""
        self.nodes += 1
        if self.work > self.node_limit:
            if self.exploring:
                self.stopped_bound = min(self.exploring)
            return False
        ev, L, S = self.ev, self.L, self.S
        r = ev.rank_of[s]
        tailed = ev.p.rank_tail is not None
        others = max(max((f for q, f in enumerate(self.floors) if q != r), default=0.0), ev.least_tail()) \
            if tailed else 0.0
        held, left = self.held[r], self.left[r]
        last = s == S - 1
        hi = L if last else min(self.maxe[s][j], L - (S - s - 1))
        if self.caps is not None:
            hi = min(hi, j + self.caps[s])
        base = list(map(sub, partial, self.prefix_col[s][j]))  # partial minus stage s up to j
        options, limit, bcol = [], self.limit, self.bound_col[s]
        for e in range(L if last else j + 1, hi + 1):
            if not self.feasible[s + 1][e]:
                continue
            extra = ev.stage_bytes(s, j, e)
            if self.used[r] + extra > ev.cap[r]:
                break  # more layers only add bytes
            floor = tail = 0.0
            if tailed:
                n = held + e - j
                if left == 1:  # r's stages are all chosen: its tail is known
                    floor = ev.rank_tail(r, n)
                    still, pooled = self.open - 1, self.open_held - held
                else:
                    floor = ev.tail_floor(r, n + left - 1)
                    still, pooled = self.open, self.open_held + e - j
                mean = -(-(L - e + pooled) // still) if still else 0  # layers the open ranks end with, at least
                tail = max(others, floor, ev.least_floor(mean) if still else 0.0)
            bound = max(map(add, base, bcol[e])) + tail
            if bound < limit:
                options.append((bound, e, extra, tail, floor))
        options.sort(key=lambda o: o[0])
        self.exploring.append(0.0)
        for bound, e, extra, tail, floor in options:
            self.exploring[-1] = bound
            if len(partial) != len(self.cuts):  # cuts grew in a sibling's subtree
                partial = self._partial(partial)
                base = list(map(sub, partial, self.prefix_col[s][j]))
            if self.caps is not None and e - j > self.caps[s]:
                continue
            if max(map(add, base, self.bound_col[s][e])) + tail >= self.limit:
                continue
            self.chosen.append(e - j)
            if last:
                self.evaluate(tuple(self.chosen))
            else:
                self.used[r] += extra
                kept = self.floors[r], self.open, self.open_held
                self.held[r], self.left[r], self.floors[r] = held + e - j, left - 1, floor
                if left == 1:
                    self.open, self.open_held = self.open - 1, self.open_held - held
                else:
                    self.open_held += e - j
                ok = self._dfs(s + 1, e, list(map(add, base, self.prefix_col[s][e])))
                self.held[r], self.left[r] = held, left
                self.floors[r], self.open, self.open_held = kept
                self.used[r] -= extra
                if not ok:
                    self.chosen.pop()
                    return False
            self.chosen.pop()
        self.exploring.pop()
        return True


def combined(ev: Evaluator, cuts: list, weights: list) -> Cut:
    """sum_c weights[c] * cuts[c] (weights >= 0, sum 1): a cut ([Note: split relaxation])."""
    S = ev.p.num_stages
    parts = [[0.0] * S for _ in range(3)]
    const = 0.0
    for w, cut in zip(weights, cuts):
        if w > 0:
            for part, coef in zip(parts, cut.coef):
                for s in range(S):
                    part[s] += w * coef[s]
            const += w * cut.coef[3]
    return Cut(ev, *parts, const)


def rounded(n: list, L: int) -> tuple | None:
    """Real layer counts to whole ones summing to L: floors, then one more layer for the
    largest remainders; None where a stage would get none."""
    whole = [int(x + 1e-9) for x in n]
    order = sorted(range(len(n)), key=lambda s: whole[s] - n[s])
    for s in order[:max(0, L - sum(whole))]:
        whole[s] += 1
    return tuple(whole) if sum(whole) == L and min(whole) >= 1 else None


def relax(search: Search, rounds: int) -> None:
    """Kelley's method on [Note: split relaxation] (alike layers): solve the relaxation,
    add the critical path at its real split n* and simulate n* rounded to whole layers,
    until its bound reaches the best time, the chain at n* is no longer than its bound,
    or `rounds`; then add the relaxation's combined cut, with which the search's root
    prunes every split the relaxation rules out."""
    ev, S, L = search.ev, search.S, search.L
    p = ev.p
    relaxation = Relaxation([1] * S, search.caps or search.memory_caps, L)
    weights = None
    for _ in range(rounds):
        if search.work >= search.node_limit:
            break  # its simulations count against the search's node limit
        for cut in search.cuts[len(relaxation.consts):]:
            relaxation.add(cut.const, cut.unit)
        bound, n, weights = relaxation.solve()
        if bound >= search.limit:
            break
        costs = [[x * layer + extra for x, extra in zip(n, stage)] for layer, stage in (
            (p.layer_forward[0], p.stage_forward), (p.layer_backward[0], p.stage_backward),
            (p.layer_weight[0], p.stage_weight))]
        path = ev.probe(*costs)
        search.add_path(path)
        if path.length(*costs) <= bound * (1 + 1e-9):
            break  # the relaxation is solved: only branching proves more
        split = rounded(n, L)
        if split is not None and split not in search.seen and ev.fits(split):
            search.evaluate(split)  # its chain joins the cuts; a better time tightens the caps
            relaxation.set_upper(search.caps or search.memory_caps)
    if weights is not None:
        search.add_cut(combined(ev, search.cuts[:len(weights)], weights))


__all__ = ["Cut", "Search", "balanced_seed", "boundary_tables", "combined", "relax", "stage_caps"]
