"""Which stage and rank each block of a nanotron model belongs to under an engine.

[Note: model layout] nanotron's trainer builds the model with `build_model(model_builder,
parallel_context, dtype)`: no `target_pp_ranks`, so every block goes to a rank by
nanotron's cost split over pp ranks ([Note: nanotron's split] in pipeschedule/plan/partition.py). What a
`pp_engine` says of the layout must therefore be applied inside `build_model`
(`integration.nanotron.patches.trainer`), and checked by the engine when it first sees the
model (`check_model`), since a user's script may still build it some other way.

The layout of an engine for a model with blocks b_0 .. b_{n-1} (forward order, as
nanotron lists its `PipelineBlock`s) is a stage per block, non-decreasing, every stage
used, and the engine's placement (rank of each stage):

    stages of the blocks   split=A/B/..  given: the decoder layers (the blocks of the most
                           frequent module builder) in stage order, A on stage 0, B on
                           stage 1, ...; blocks before the first layer (embedding) on
                           stage 0, blocks after the last (norm, head, loss) on the last
                           stage, a block between two layers with the layer before it
                           (a model of alternating linear and activation blocks, as
                           nanotron's pipeline tests build)
                           no split: nanotron's cost arithmetic over pp * virtual stages
                           (`split.nanotron_block_stages`), i.e. exactly what
                           `build_model(target_pp_ranks=placement)` does
    rank of a stage        the engine's placement: 0..pp-1 (1F1B family), round robin
                           over pp * virtual stages (interleaved), V shape (rank r runs
                           stages r and 2pp-1-r: zbv, v_half, v_min, dualpipev)

A stage without blocks runs as an empty stage that passes its input on ([Note: empty
stages] in block_graph.py) where the user asked for it: a `split=` with a 0 (but for stage
0, which reads the data loader), or a model built one stage per rank with some ranks
holding no block (as nanotron's tests/test_serialize.py places 9 blocks 3/3/3/0 at
pp=4), which is taken as it is. Where the engine lays the model out itself (no split)
and nanotron's cost arithmetic leaves a stage empty, the layout is refused with the
layers per stage and a split that fills every stage (or one with a 0, to run it so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from integration.nanotron.pipeline.errors import LayoutError
from integration.nanotron.pipeline.layout_fix import even_split, layout_fix
from integration.nanotron.pipeline.split import nanotron_block_stages


@dataclass(frozen=True)
class ModelLayout:
    """A stage per block and the rank of each stage (see [Note: model layout]).

    `layer_blocks` marks the blocks that are decoder layers (counted by a split)."""

    block_stages: tuple[int, ...]
    placement: tuple[int, ...]
    layer_blocks: tuple[bool, ...]

    @property
    def block_ranks(self) -> list[int]:
        return [self.placement[s] for s in self.block_stages]

    @property
    def layers_per_stage(self) -> list[int]:
        counts = [0] * len(self.placement)
        for stage, is_layer in zip(self.block_stages, self.layer_blocks):
            counts[stage] += is_layer
        return counts

    def describe(self) -> str:
        split = "/".join(map(str, self.layers_per_stage))
        return f"decoder layers per stage {split} on ranks {list(self.placement)}"


def layer_mask(builders: Sequence[object], costs: Sequence[int]) -> list[bool]:
    """Which blocks are decoder layers: those of the most frequent module builder; when
    every builder occurs once (a one-layer model), the first block with a compute cost."""
    if not builders:
        return []
    most = max(builders.count(b) for b in builders)
    if most > 1:
        layer = next(b for b in builders if builders.count(b) == most)
    else:
        layer = next((b for b, cost in zip(builders, costs) if cost > 0), None)
    return [b is layer for b in builders]


def engine_layout(builders: Sequence[object], costs: Sequence[int], *, placement: Sequence[int],
                  split: Sequence[int] | None, engine: str) -> ModelLayout:
    """The layout `engine` (its pp_engine string, for messages) wants for blocks whose
    module builders and nanotron compute costs are given, in forward order."""
    placement = tuple(placement)
    stages = len(placement)
    layers = layer_mask(builders, costs)
    if split is not None:
        if len(split) != stages:
            raise LayoutError(
                f"pp_engine {engine!r}: split lists {len(split)} stages but the engine runs {stages} "
                f"(pp * virtual); give one layer count per stage{_fix_text(engine, layers, placement)}"
            )
        if sum(layers) != sum(split):
            raise LayoutError(
                f"pp_engine {engine!r}: split places {'+'.join(map(str, split))} = {sum(split)} decoder layers "
                f"but the model has {sum(layers)} (model.model_config.num_hidden_layers); make the split sum to "
                f"{sum(layers)}{_fix_text(engine, layers, placement)}"
            )
        owner = [s for s, count in enumerate(split) for _ in range(count)]
        block_stages, seen = [], 0
        for is_layer in layers:
            if is_layer:
                block_stages.append(owner[seen])
                seen += 1
            elif seen == 0 or seen == len(owner):  # before the first layer, after the last
                block_stages.append(0 if seen == 0 else stages - 1)
            else:  # between two layers: with the one before it
                block_stages.append(owner[seen - 1])
    else:
        block_stages = nanotron_block_stages(list(costs), stages)
    layout = ModelLayout(tuple(block_stages), placement, tuple(layers))
    empty = [s for s, n in enumerate(_blocks_per_stage(layout)) if n == 0]
    if split is None and empty:
        raise LayoutError(
            f"pp_engine {engine!r}: nanotron's cost split leaves stage(s) {empty} of {stages} without any block "
            f"({layout.describe()}); every stage needs at least one block{_fix_text(engine, layers, placement)}"
        )
    if 0 in empty:
        raise LayoutError(
            f"pp_engine {engine!r}: split={'/'.join(map(str, split))} leaves stage 0 without any block "
            f"({layout.describe()}); stage 0 reads the data loader, so it needs one (a later stage without one "
            f"passes its input on){_fix_text(engine, layers, placement)}"
        )
    return layout


def _fix_text(engine: str, layers: Sequence[bool], placement: Sequence[int]) -> str:
    """The end of a refusal: the fix that is accepted ([Note: a fix that is accepted] in
    layout_fix.py), after the rule where the model has too few layers for the stages."""
    fix = layout_fix(engine, layers, max(placement) + 1)
    rule = (f"the model's {sum(layers)} decoder layers fill at most {sum(layers) + 2} stages (the embedding on the "
            f"first, the head on the last, a layer on each between)")
    if fix is None:
        return f". {rule[0].upper()}{rule[1:]}: give fewer stages than {len(placement)}"
    if sum(layers) + 2 < len(placement):
        return f"; {rule}. Give {fix.text()}"
    return f". Give {fix.text()}"


def model_stages(found_ranks: Sequence[int], builders: Sequence[object], costs: Sequence[int], *,
                 placement: Sequence[int], split: Sequence[int] | None, engine: str, hook: str = "") -> list[int]:
    """The stage of each block of a built model, or a `LayoutError` if the model is not
    laid out as the engine runs it (the engine's check at its first step).

    With a split, the blocks must sit exactly where the split puts them. Without one,
    any split is accepted whose runs of blocks on one rank are the placement's stages;
    where two consecutive stages share a rank (the turn of a V) the ranks cannot tell
    where one ends, and nanotron's cost arithmetic (what `build_model` applies) decides.
    """
    found_ranks, placement = list(found_ranks), tuple(placement)
    if split is not None:
        expected = engine_layout(builders, costs, placement=placement, split=split, engine=engine)
        if found_ranks != expected.block_ranks:
            raise _mismatch(found_ranks, expected.layer_blocks, placement, expected, engine, hook)
        return list(expected.block_stages)
    runs, stages = [], []
    for rank in found_ranks:
        if not runs or rank != runs[-1]:
            runs.append(rank)
        stages.append(len(runs) - 1)
    if tuple(runs) == placement:
        return stages
    if len(set(placement)) == len(placement) and runs and runs[0] == placement[0] and _subsequence(runs, placement):
        # one stage per rank, some ranks without a block ([Note: empty stages] in block_graph.py):
        # each run on the stage of its rank
        return [placement.index(runs[s]) for s in stages]
    try:
        expected = engine_layout(builders, costs, placement=placement, split=None, engine=engine)
    except LayoutError:
        if tuple(runs) == _runs(placement):  # laid out on the engine's ranks; only the V's turn is unknown
            raise  # the error asks for split=
        # The engine cannot lay this model out itself (no compute costs), and the model's own
        # ranks do not pass through its stages: say what was found, not why a cost split fails.
        raise _mismatch(found_ranks, layer_mask(builders, costs), placement, None, engine, hook) from None
    if found_ranks == expected.block_ranks:
        return list(expected.block_stages)
    raise _mismatch(found_ranks, expected.layer_blocks, placement, expected, engine, hook)


def _subsequence(runs: Sequence[int], placement: Sequence[int]) -> bool:
    """Whether `runs` visits ranks in the placement's order, skipping some."""
    rest = iter(placement)
    return all(rank in rest for rank in runs)


def _runs(ranks: Sequence[int]) -> tuple[int, ...]:
    """`ranks` with consecutive repeats dropped: the ranks a forward pass visits in turn."""
    return tuple(r for i, r in enumerate(ranks) if i == 0 or r != ranks[i - 1])


def _mismatch(found_ranks: Sequence[int], layers: Sequence[bool], placement: Sequence[int],
              expected: ModelLayout | None, engine: str, hook: str) -> LayoutError:
    found = _describe_ranks(found_ranks, layers)
    wants = (expected.describe() if expected is not None
             else f"its blocks to visit ranks {list(_runs(placement))} in turn, in forward order")
    return LayoutError(
        f"pp_engine {engine!r} runs {len(placement)} stages on ranks {list(placement)} and "
        f"expects {wants}, but the model it was given has {found}. nanotron builds the model before "
        f"the engine runs: start training with `python -m integration.nanotron.train --config-file CONFIG`, or put "
        f"`import integration.nanotron` before any other nanotron import in your launch script, so that nanotron's "
        f"build_model applies pp_engine's split and placement; a script that places blocks itself "
        f"(build_and_set_rank) puts them on engine.model_layout(model, pp).block_ranks (give split= in pp_engine "
        f"where the model has no get_block_compute_costs)"
        + (f" ({hook})" if hook else "")
    )


def _describe_ranks(ranks: Sequence[int], layers: Sequence[bool]) -> str:
    runs: list[list[int]] = []  # [rank, layers] per run of consecutive blocks on one rank
    for rank, is_layer in zip(ranks, layers):
        if not runs or runs[-1][0] != rank:
            runs.append([rank, 0])
        runs[-1][1] += is_layer
    return (f"decoder layers per run of blocks {'/'.join(str(n) for _, n in runs)} "
            f"on ranks {[r for r, _ in runs]}")


def _blocks_per_stage(layout: ModelLayout) -> list[int]:
    counts = [0] * len(layout.placement)
    for s in layout.block_stages:
        counts[s] += 1
    return counts


__all__ = ["ModelLayout", "engine_layout", "even_split", "layer_mask", "model_stages"]
