"""The fix a layout refusal suggests: a `pp_engine` value (and, where no split of this pp
can work, a smaller `parallelism.pp`) that is accepted when applied.

[Note: a fix that is accepted] A stage of the engine's layout needs at least one block
([Note: model layout] in layout.py). With a split, the blocks before the first decoder
layer (the embedding) sit on stage 0 and those after the last (final norm, LM head,
loss) on the last stage, so those two stages may hold no decoder layer while every stage
between them needs one: L decoder layers fill at most L + 2 stages. The fix is, first
that holds:

    split        `fitting_split(L, S)`: the engine's own pp * virtual stages, split
                 as evenly as `layout.even_split` splits them where that leaves no stage
                 without a block, else one layer on each stage that needs one and the
                 rest spread the same way
    virtual      (interleaved) the most chunks per rank below the engine's whose stages
                 a split can fill, with that split
    pp           the largest pp below this one whose stages a split can fill, with
                 that split (the job then runs dp * tp * pp processes)

and None where even pp = 1 cannot run the engine (the V shapes need two stages per rank,
which the adapter does not run at pp = 1), or where the engine's per-rank or per-stage
lists (cap, recompute, offload) would no longer match the new counts: the refusal then
states the rule alone. tests/nanotron/test_layout_fix.py applies every fix a refusal
prints and checks that the engine accepts it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from integration.nanotron.pipeline.engine_spec import ScheduleSpec, parse_engine
from pipeschedule.compiler.families import FAMILIES
from pipeschedule.errors import PipescheduleError


@dataclass(frozen=True)
class LayoutFix:
    """A pp_engine value to give, and the pipeline ranks to give with it (None: pp as it is)."""

    engine: str
    pp: int | None = None

    def text(self) -> str:
        """How a refusal says it: `pp_engine: VALUE` (and `parallelism.pp: P`)."""
        return f"pp_engine: {self.engine}" + ("" if self.pp is None else f" with parallelism.pp: {self.pp}")


def even_split(layers: int, stages: int) -> list[int]:
    """`layers` decoder layers over `stages` stages as evenly as possible, the first and
    last stage (which also hold the embedding and the head) getting the smaller shares."""
    base, extra = divmod(layers, stages)
    counts = [base] * stages
    middle = list(range(1, stages - 1)) + [0, stages - 1]  # extra layers go to middle stages first
    for s in middle[:extra]:
        counts[s] += 1
    return counts


def fitting_split(layers: int, stages: int, *, head: bool = True, tail: bool = True) -> tuple[int, ...] | None:
    """`layers` decoder layers over `stages` stages, every stage left with a block: a layer
    on each stage but the first (when blocks precede the first layer: `head`) and the
    last (when blocks follow the last: `tail`); None when there are too few layers.
    As even as `even_split` where that split already qualifies."""
    need = [1] * stages
    if head:
        need[0] = 0
    if tail:
        need[-1] = 0
    if stages < 1 or layers < sum(need):
        return None
    even = even_split(layers, stages)
    if all(n >= k for n, k in zip(even, need)):
        return tuple(even)
    extra = even_split(layers - sum(need), stages)
    return tuple(n + k for n, k in zip(extra, need))


def layout_fix(engine: str, layer_blocks: Sequence[bool], pp: int) -> LayoutFix | None:
    """The fix for engine `engine` (its pp_engine value) at `pp` ranks on a model whose
    blocks are decoder layers where `layer_blocks` is true ([Note: a fix that is
    accepted]); None where there is none to give."""
    try:
        spec = parse_engine(engine)
    except PipescheduleError:
        return None
    if not isinstance(spec, ScheduleSpec):
        return None  # nanotron's own engines take no split; auto runs 1F1B's layout
    family = FAMILIES[spec.family]
    layers = sum(layer_blocks)
    head, tail = bool(layer_blocks) and not layer_blocks[0], bool(layer_blocks) and not layer_blocks[-1]
    virtual = family.chunks(spec.virtual)
    tries = [(pp, virtual)]
    if family.takes_virtual:
        tries += [(pp, v) for v in range(virtual - 1, 0, -1)]
    tries += [(p, virtual if not family.takes_virtual else 1) for p in range(pp - 1, 0, -1)]
    for p, v in tries:
        split = fitting_split(layers, len(family.placement(p, v)), head=head, tail=tail)
        if split is None or (p == 1 and v > 1):  # several chunks at pp = 1: refused (engine.check_spec)
            continue
        fixed = _respecified(spec, p, v, split, pp, virtual)
        if fixed is not None:
            return LayoutFix(fixed.to_string(), None if p == pp else p)
    return None


def _respecified(spec: ScheduleSpec, pp: int, virtual: int, split: tuple[int, ...], old_pp: int,
                 old_virtual: int) -> ScheduleSpec | None:
    """`spec` with `split` (and `virtual` where the family takes it), if its per-rank and
    per-stage lists still fit pp and pp * virtual stages; else None."""
    if pp != old_pp and (isinstance(spec.cap, tuple) or (spec.offload is not None and max(spec.offload) >= pp)):
        return None
    if (pp, virtual) != (old_pp, old_virtual) and isinstance(spec.recompute, tuple):
        return None
    changed = {"split": split}
    if FAMILIES[spec.family].takes_virtual:
        changed["virtual"] = virtual
    return replace(spec, **changed)


__all__ = ["LayoutFix", "even_split", "fitting_split", "layout_fix"]
