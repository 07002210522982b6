"""The relaxation of the split search for alike layers ([Note: split relaxation]): real
layer counts, the step time bounded below by the cuts, solved by the simplex method on
its dual so that each new cut only adds a column.

[Note: split relaxation] With alike layers a cut of [Note: exact split search] is
const_c + sum_s unit_c[s] * n_s, n_s the layers of stage s. Over real n with
lo <= n <= hi and sum n = L, the least of max_c cut_c is a linear program whose dual is

    max  sum_c a_c l_c + L mu + sum_s lo_s al_s - hi_s be_s
    s.t. sum_c l_c = 1,  -sum_c l_c unit_c[s] + mu + al_s - be_s = 0 (every s),  l, al, be >= 0

Any l >= 0 with sum 1 makes sum_c l_c cut_c a valid cut itself (a convex combination of
lower bounds is one), so the weights the simplex holds at any step may be handed to the
search, whatever its rounding: the search computes what that cut proves on its own.
The simplex multipliers at the optimum are the relaxed split n* and its bound t*; the
critical path at n* (the simulator's chain under those real costs: a chain is a cut
whatever costs found it) is the cut Kelley's method adds next
(`partition.optimal_split`), until t* reaches the best time or the chain at n* is no
longer than t* (the relaxation is then solved: only branching can prove more).
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import mul

_TOL = 1e-9


class Relaxation:
    """The dual of [Note: split relaxation], by the revised simplex with an explicit
    basis inverse. Columns: mu+ and mu- (mu = mu+ - mu-), al_s, be_s, then one l_c per
    cut. Rows: 0 (sum l = 1), 1 + s (stage s)."""

    def __init__(self, lo: Sequence[float], hi: Sequence[float], layers: int) -> None:
        self.S, self.L = len(lo), layers
        self.lo, self.hi = [float(x) for x in lo], [float(x) for x in hi]
        self.consts: list[float] = []
        self.units: list[list[float]] = []
        self.basis: list[int] = []  # column basic in each row
        self.inverse: list[list[float]] = []
        self.values: list[float] = []  # of the basic columns

    def add(self, const: float, unit: Sequence[float]) -> None:
        """A cut const + unit . n; the first one makes the starting basis (l = 1 on it)."""
        self.consts.append(float(const))
        self.units.append([float(u) for u in unit])
        if not self.basis:  # l_0 in row 0, al_s in row 1 + s: al_s = unit[s] >= 0
            S, u = self.S, self.units[0]
            self.basis = [self._cut_column(0)] + [2 + s for s in range(S)]
            self.values = [1.0] + list(u)
            self.inverse = [[1.0] + [0.0] * S] + [[u[s]] + [0.0] * s + [1.0] + [0.0] * (S - 1 - s) for s in range(S)]

    def set_upper(self, hi: Sequence[float]) -> None:
        self.hi = [float(x) for x in hi]

    def _cut_column(self, c: int) -> int:
        return 2 + 2 * self.S + c

    def _cost(self, j: int) -> float:
        S = self.S
        if j < 2:
            return self.L if j == 0 else -self.L
        if j < 2 + S:
            return self.lo[j - 2]
        if j < 2 + 2 * S:
            return -self.hi[j - 2 - S]
        return self.consts[j - 2 - 2 * S]

    def _column(self, j: int) -> list[float]:
        S = self.S
        if j < 2:
            return [0.0] + [1.0 if j == 0 else -1.0] * S
        col = [0.0] * (S + 1)
        if j < 2 + S:
            col[j - 1] = 1.0
        elif j < 2 + 2 * S:
            col[j - 1 - S] = -1.0
        else:
            col[0] = 1.0
            col[1:] = [-u for u in self.units[j - 2 - 2 * S]]
        return col

    def _prices(self) -> list[float]:
        y = [0.0] * (self.S + 1)
        for j, row in zip(self.basis, self.inverse):
            c = self._cost(j)
            if c:
                y = [a + c * b for a, b in zip(y, row)]
        return y

    def _entering(self, y: list[float], bland: bool) -> int | None:
        """The column to enter: the largest reduced cost above tolerance (the first one
        under Bland's rule), None at the optimum."""
        S, yn = self.S, y[1:]
        basic = set(self.basis)
        total = sum(yn)
        best, choice = _TOL * (1.0 + abs(y[0])), None
        candidates = [(0, self.L - total), (1, total - self.L)]
        candidates += [(2 + s, self.lo[s] - yn[s]) for s in range(S)]
        candidates += [(2 + S + s, yn[s] - self.hi[s]) for s in range(S)]
        candidates += [(self._cut_column(c), a - y[0] + sum(map(mul, u, yn)))
                       for c, (a, u) in enumerate(zip(self.consts, self.units))]
        for j, d in candidates:
            if d > best and j not in basic:
                if bland:
                    return j
                best, choice = d, j
        return choice

    def solve(self, max_pivots: int = 400) -> tuple[float, list[float], list[float]]:
        """(t*, n*, weights): the relaxation's bound and split (the simplex multipliers,
        clipped into the box), and the cuts' weights (>= 0, sum 1). Stops after
        `max_pivots` with what it has, which is still a valid set of weights."""
        degenerate = 0
        for _ in range(max_pivots):
            y = self._prices()
            j = self._entering(y, bland=degenerate > 20)
            if j is None:
                break
            inv = self.inverse
            col = self._column(j)
            w = [sum(map(mul, row, col)) for row in inv]
            r, theta = None, 0.0
            for i, wi in enumerate(w):
                if wi > 1e-12:
                    ratio = self.values[i] / wi
                    if r is None or ratio < theta - 1e-15 or (ratio <= theta + 1e-15 and self.basis[i] < self.basis[r]):
                        r, theta = i, ratio
            if r is None:
                break  # unbounded: cannot happen with a cut and lo <= hi; stop with what there is
            theta = max(theta, 0.0)
            degenerate = degenerate + 1 if theta <= 1e-15 else 0
            self.values = [v - theta * wi for v, wi in zip(self.values, w)]
            self.values[r] = theta
            self.basis[r] = j
            pivot = inv[r]
            scale = 1.0 / w[r]
            pivot = [x * scale for x in pivot]
            self.inverse = [pivot if i == r else ([a - wi * b for a, b in zip(row, pivot)] if wi else row)
                            for i, (row, wi) in enumerate(zip(inv, w))]
        y = self._prices()
        n = _onto_layers([min(max(v, lo), hi) for v, lo, hi in zip(y[1:], self.lo, self.hi)], self.lo, self.hi, self.L)
        weights = [0.0] * len(self.consts)
        for j, v in zip(self.basis, self.values):
            if j >= 2 + 2 * self.S and v > 0:
                weights[j - 2 - 2 * self.S] = v
        total = sum(weights)
        weights = [x / total for x in weights] if total > 0 else weights
        return y[0], n, weights


def _onto_layers(n: list[float], lo: list[float], hi: list[float], layers: int) -> list[float]:
    """`n` moved back onto sum n = layers inside the box, stage by stage: the multipliers
    are the split only up to the basis inverse's rounding, which a cut with coefficients
    near 1e-11 beside ones near 1 makes visible (1.0000153 layers where the box allows 1)."""
    excess = sum(n) - layers
    out = list(n)
    for s in range(len(out)):
        if abs(excess) <= 1e-12 * (1 + layers):
            break
        room = out[s] - lo[s] if excess > 0 else out[s] - hi[s]  # how far stage s may move
        step = min(excess, room) if excess > 0 else max(excess, room)
        out[s] -= step
        excess -= step
    return out


__all__ = ["Relaxation"]
