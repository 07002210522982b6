"""1F1B (PipeDream-flush), and 1F1B with a per-rank cap on microbatches in flight.

pp=4, m=6 (F = 1 cell, B = 2 cells):

    rank 0  F0 F1 F2 F3 .  .  .  B0 B0 F4 B1 B1 F5 B2 B2 ...
    rank 1  .  F0 F1 F2 .  .  B0 B0 F3 B1 B1 F4 ...
    rank 2  .  .  F0 F1 .  B0 B0 F2 B1 B1 ...
    rank 3  .  .  .  F0 B0 B0 F1 B1 B1 ...

Rank r runs k_r forwards, then alternates backward and forward, then drains the
remaining backwards; k_r microbatches are in flight at its peak. Plain 1F1B has
k_r = min(pp - r, m). With a cap, k_r = min(cap_r, pp - r, m, k_{r-1}).

[Note: cap monotonicity] A microbatch in flight on rank r (its F done, its B not) is also
in flight on every earlier rank, whose B comes after r's. So rank r can never hold more
than rank r-1 does; a cap list that grows along the pipeline is clipped to the running
minimum, which is also what keeps the order free of cycles: rank r+1's B(i) needs
F(i + k_{r+1} - 1) from rank r, which rank r runs before its B(i) iff k_{r+1} <= k_r.
"""

from pipeschedule.generators.common import check_common, interleave_1f1b, make, per_rank_caps

DEFAULT_CAP_DOC = "ceil(pp / 2): half of 1F1B's first-stage activation memory"


def default_cap(pp: int) -> int:
    """The cap `capped_1f1b` uses when none is given: ceil(pp / 2)."""
    return (pp + 1) // 2


def effective_caps(cap, pp: int, microbatches: int) -> list[int]:
    """Per-rank k_r of [Note: cap monotonicity]."""
    caps = per_rank_caps(cap, pp)
    out, running = [], microbatches
    for r in range(pp):
        running = min(running, caps[r], pp - r)
        out.append(running)
    return out


def _build(name: str, pp: int, microbatches: int, caps: list[int], params: dict):
    programs = []
    for r in range(pp):
        forwards = [(r, mb) for mb in range(microbatches)]
        programs.append(interleave_1f1b(forwards, forwards, warmup=caps[r] - 1))
    return make(name, pp, 1, microbatches, range(pp), programs, params)


def one_f_one_b(pp: int, microbatches: int):
    check_common(pp, microbatches)
    return _build("1f1b", pp, microbatches, effective_caps(pp, pp, microbatches), {})


def capped_1f1b(pp: int, microbatches: int, cap=None):
    """1F1B in which rank r keeps at most cap[r] microbatches in flight.

    `cap` is one int for all ranks or a list of pp ints; None means `default_cap(pp)`.
    With cap >= pp this is 1F1B instruction for instruction.
    """
    check_common(pp, microbatches)
    caps = effective_caps(default_cap(pp) if cap is None else cap, pp, microbatches)
    return _build("capped_1f1b", pp, microbatches, caps, {"cap": caps})
