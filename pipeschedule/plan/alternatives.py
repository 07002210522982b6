"""Which alternatives a plan tries, and in which order: every family of FAMILIES as its
`Family` record says, at its chunk counts and caps (`alternatives`), the caps of the
`searched` family (`searched_caps`), and the families a config leaves out because the
engines cannot run them as planned (`dropped`).
"""

from __future__ import annotations

from pipeschedule.compiler.families import FAMILIES
from pipeschedule.plan.config import PlanConfig
from pipeschedule.plan.evaluation import Evaluator
from pipeschedule.simulate import CostModel

Alternative = tuple  # (family, cap, virtual): cap None, an int (stage-microbatches) or a tuple per rank

# The order the alternatives are tried in: the fastest-looking first, so that the best
# time so far prunes the split searches of the slower ones (and among equally fast ones
# that fit, the earliest, the simplest change, is recommended). Split backward comes
# early: it is often the fastest. Then every family's caps, then the slow ones. A family
# of FAMILIES named in neither list is tried after FAST.
FAST = ("1f1b", "zb_h1", "zbv", "v_half", "interleaved_1f1b")
SLOW = ("v_min", "looped_bfs", "afab")  # v_min: the least memory, looped_bfs the most; rarely the fastest
SEARCHED = "searched"  # tried at caps of its own: searched_caps
SEARCHED_PLAN_PAIRS = 2**11  # (stage, microbatch) pairs of the capped `searched` schedules of one plan run


def alternatives(config: PlanConfig, evaluator: Evaluator, virtuals: tuple[int, ...]) -> list[Alternative]:
    """(family, cap, virtual) of every alternative, in the order of FAST and SLOW, each
    as its `Family` record says: at its own chunks per rank (each count of `virtuals`,
    `fitting.virtual_tried`'s, where it takes any), where every stage gets a decoder layer;
    uncapped, except a family with a default cap (its uncapped form is 1F1B), which is
    tried at every cap below pp; `searched` at `searched_caps`; the caps of the
    others that take one and do not split the backward, in stage-microbatches below their
    uncapped peak (at the fewest chunks per rank only)."""
    pp = config.pp
    usable = _usable(config, virtuals)
    order = [n for n in FAST if n in usable] + [n for n in usable if n not in FAST and n not in SLOW]
    out = [(name, None, v) for name in order if usable[name][0].default_cap is None and name != SEARCHED
           for v in usable[name][1]]
    for name in order:
        f, vs = usable[name]
        if f.default_cap is not None:
            out += [(name, c, v) for v in vs for c in range(pp - 1, 0, -1)]
        elif name == SEARCHED:
            out += [(name, c, v) for v in vs for c in searched_caps(pp, config.microbatches)]
    for name in order:
        f, vs = usable[name]
        if f.takes_cap and f.default_cap is None and not f.split_backward:
            out += _stage_microbatch_caps(evaluator, name, vs[0])
    out += [(name, None, v) for name in SLOW if name in usable for v in usable[name][1]]
    return out


def _usable(config: PlanConfig, virtuals: tuple[int, ...]) -> dict:
    """{family: (its Family, the chunk counts it is tried at)} of the families worth trying."""
    pp, L = config.pp, config.model.layers
    usable = {}
    for name, f in FAMILIES.items():
        vs = virtuals if f.takes_virtual else (f.chunks(),)
        vs = tuple(v for v in vs if not (pp == 1 and (v > 1 or f.split_backward)) and L >= pp * v)
        if not vs:
            continue  # the same as another candidate, nothing to gain at pp=1, or a stage without a layer
        if f.split_backward and config.setup.tp_async and config.setup.tp > 1:
            continue  # [Note: dropped candidates]
        usable[name] = (f, vs)
    return usable


def _stage_microbatch_caps(evaluator: Evaluator, name: str, v: int) -> list[Alternative]:
    """The capped forms of family `name` at `v` chunks per rank ([Note: virtual counts]: caps
    at the fewest chunks only): caps in stage-microbatches, v*k holding about as much as k
    microbatches of 1F1B, below the uncapped schedule's peak. Past pp=8 a spread of k is
    tried rather than every one."""
    pp = evaluator.config.pp
    ks = range(1, pp) if pp <= 8 else sorted({1, 2, 3, 4, pp // 4, pp // 2, 3 * pp // 4, pp - 1})
    schedule = evaluator.schedule(name, None, v)
    peak = max(evaluator.peaks(name, None, v, CostModel.default(schedule))[1])
    return [(name, v * k, v) for k in sorted(ks, reverse=True) if v * k < peak]


def searched_caps(pp: int, microbatches: int) -> list[int]:
    """[Note: searched candidates] The caps below pp at which the planner tries `searched`,
    beside capped_1f1b at each (uncapped, under the unit costs the planner generates its
    schedules with, the search keeps zb_h1's order, already a candidate). Each is a search
    of its own (seeds, annealing: up to about 0.5 s at the plan's largest sizes, shared by
    the run's plans like every schedule), and each adds a candidate to every plan, so a
    run searches at most SEARCHED_PLAN_PAIRS (stage, microbatch) pairs in all: every cap
    where that allows, else as many as it allows, evenly spread: k of them at pp * i / (k
    + 1) rounded, i = 1..k (one: pp / 2, about capped_1f1b's default; none where pp * m
    alone is more).
    benchmarks/limits.py times the largest plans with them."""
    count, caps = min(pp - 1, SEARCHED_PLAN_PAIRS // (pp * microbatches)), pp - 1
    if count <= 0:
        return []
    if count == caps:
        return list(range(caps, 0, -1))
    return sorted({max(1, min(caps, round((k + 1) * pp / (count + 1)))) for k in range(count)}, reverse=True)


def dropped(config: PlanConfig) -> tuple[tuple[str, str], ...]:
    """[Note: dropped candidates] (family, why) of the families the planner does not list
    because the engines cannot run them as planned under this config: with
    `tp_linear_async_communication: true` at tp > 1 nanotron's linears are autograd
    functions that compute the weight gradient inside their own backward
    (nanotron/parallel/tensor_parallel/functional.py:119-160, 362-400), so a split backward
    defers nothing and W is empty: zb_h1 and the V shapes would run as their 1F1B-like
    order with B = the whole backward."""
    if not (config.setup.tp_async and config.setup.tp > 1):
        return ()
    why = ("tp_linear_async_communication: true: nanotron's async TP linears compute weight gradients "
           "in their own backward, so the split backward defers nothing")
    return tuple((name, why) for name, f in FAMILIES.items() if f.split_backward)


__all__ = ["FAST", "SEARCHED", "SEARCHED_PLAN_PAIRS", "SLOW", "alternatives", "dropped", "searched_caps"]
