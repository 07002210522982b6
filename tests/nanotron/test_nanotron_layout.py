"""Where an engine puts the blocks of a model that is not a Llama ([Note: model layout] in
integration/nanotron/pipeline/layout.py), and what it says of a model laid out by someone else.

nanotron's own pipeline tests build models of alternating blocks (a linear, then an
activation, per rank; then a loss) and place them themselves with `build_and_set_rank`.
With `split=` the decoder layers are the linears; every block between two of them must
stay with the one before it, so that the stages follow forward order. A model whose
blocks visit the ranks in an order the engine's stages cannot follow (one run of blocks
per rank under an interleaved or V placement) is refused in one line that names the
ranks the engine needs and the ranks it found.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from integration.nanotron.pipeline.block_graph import LOSS, BlockGraph, Source
from integration.nanotron.pipeline.errors import LayoutError
from integration.nanotron.pipeline.layout import engine_layout, model_stages
from strategies import examples

LINEAR = "linear"  # the one module builder shared by several blocks: the decoder layers


def alternating(pairs: int, *, extra_between: tuple[int, ...] = (), before: int = 0) -> list[str]:
    """Module builders of a model: `before` leading blocks, then `pairs` linear blocks each
    followed by 1 + extra_between[i] other blocks, then a loss. Every other block has a
    builder of its own (as nanotron's tests build activations from a fresh lambda)."""
    blocks = [f"first{k}" for k in range(before)]
    for i in range(pairs):
        blocks.append(LINEAR)
        blocks += [f"activation{i}.{k}" for k in range(1 + (extra_between[i] if i < len(extra_between) else 0))]
    return blocks + ["loss"]


def costs(blocks: list[str]) -> list[int]:
    """nanotron-style compute costs: the linears 1, the rest 0 (a one-pair model's layer
    is then its one costly block)."""
    return [int(b == LINEAR) for b in blocks]


def test_a_block_between_two_layers_goes_with_the_layer_before_it():
    layout = engine_layout(alternating(4), [0] * 9, placement=[0, 1, 1, 0], split=(1, 1, 1, 1), engine="zbv")
    assert layout.block_stages == (0, 0, 1, 1, 2, 2, 3, 3, 3)
    assert layout.block_ranks == [0, 0, 1, 1, 1, 1, 0, 0, 0]
    # nanotron's test places pair r on rank r and the loss on the last: a 1F1B engine with a split agrees
    assert engine_layout(alternating(2), [0] * 5, placement=[0, 1], split=(1, 1), engine="ps_1f1b").block_ranks == [
        0, 0, 1, 1, 1]


@settings(max_examples=examples(200))
@given(st.data())
def test_split_layouts_follow_forward_order(data):
    """Any split of any alternating model: stages never go back, each stage holds the
    layers the split gives it, and a non-layer block sits on the stage of the layer
    before it (stage 0 before the first layer, the last stage after the last one)."""
    stages = data.draw(st.integers(1, 6), label="stages")
    split = data.draw(st.lists(st.integers(0, 3), min_size=stages, max_size=stages).filter(lambda s: sum(s) > 0),
                      label="split")
    pairs = sum(split)
    extra = tuple(data.draw(st.lists(st.integers(0, 2), min_size=pairs, max_size=pairs), label="extra"))
    before = data.draw(st.integers(0, 2), label="before")
    blocks = alternating(pairs, extra_between=extra, before=before)
    try:
        layout = engine_layout(blocks, costs(blocks), placement=list(range(stages)), split=tuple(split),
                               engine="ps_1f1b")
    except LayoutError as error:  # only for a stage left without any block
        assert "without any block" in str(error) and 0 in split
        return
    assert _forward_order_faults(blocks, split, layout.block_stages) == []


def _forward_order_faults(blocks: list[str], split: list[int], block_stages) -> list[str]:
    """What is wrong with `block_stages` for `blocks` under `split` (empty when right)."""
    owner = [s for s, count in enumerate(split) for _ in range(count)]
    faults, seen = [], 0
    for index, (block, stage) in enumerate(zip(blocks, block_stages)):
        if index and stage < block_stages[index - 1]:
            faults.append(f"block {index} goes back to stage {stage}")
        if block == LINEAR:
            want = owner[seen]
            seen += 1
        else:
            want = 0 if seen == 0 else len(split) - 1 if seen == len(owner) else owner[seen - 1]
        if stage != want:
            faults.append(f"block {index} ({block}) on stage {stage}, not {want}")
    return faults


def test_the_check_finds_the_old_rule_wrong():
    """The property's check rejects the rule used before (every non-layer block after the
    first layer on the last stage)."""
    blocks, split = alternating(4), [1, 1, 1, 1]
    old = [0, 3, 1, 3, 2, 3, 3, 3, 3]
    assert _forward_order_faults(blocks, split, old)[:2] == ["block 1 (activation0.0) on stage 3, not 0",
                                                             "block 2 goes back to stage 1"]


@pytest.mark.parametrize("engine, placement, visits", [
    ("zbv", [0, 1, 1, 0], [0, 1, 0]),
    ("interleaved_1f1b:virtual=2", [0, 1, 0, 1], [0, 1, 0, 1]),
    ("v_min", [0, 1, 2, 3, 3, 2, 1, 0], [0, 1, 2, 3, 2, 1, 0]),
])
def test_a_model_with_one_run_of_blocks_per_rank_is_refused_naming_both_orders(engine, placement, visits):
    """nanotron's test models (a linear and an activation per rank, the loss on the last)
    under placements with two stages per rank: one line naming the ranks the engine
    needs and the ranks found, not the cost split's complaint."""
    pp = max(placement) + 1
    blocks = alternating(pp)
    found = [r for r in range(pp) for _ in range(2)] + [pp - 1]
    with pytest.raises(LayoutError) as caught:
        model_stages(found, blocks, [0] * len(blocks), placement=placement, split=None, engine=engine)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"pp_engine {engine!r} runs {len(placement)} stages on ranks {placement} and expects "
                              f"its blocks to visit ranks {visits} in turn")
    assert f"the model it was given has decoder layers per run of blocks {'/'.join(['1'] * pp)} on ranks " \
           f"{list(range(pp))}" in message
    assert "cost split" not in message and "build_and_set_rank" in message


def test_a_v_model_on_the_right_ranks_without_costs_asks_for_a_split():
    """Blocks on the V's ranks, but nothing says where the turn's two stages on rank 1
    divide: the refusal asks for split= (which then runs it)."""
    blocks = alternating(4)
    found = [0, 0, 1, 1, 1, 1, 0, 0, 0]
    with pytest.raises(LayoutError, match=r"^pp_engine 'zbv': .* Give pp_engine: zbv:split=1/1/1/1$"):
        model_stages(found, blocks, [0] * 9, placement=[0, 1, 1, 0], split=None, engine="zbv")
    assert model_stages(found, blocks, [0] * 9, placement=[0, 1, 1, 0], split=(1, 1, 1, 1), engine="zbv") == [
        0, 0, 1, 1, 2, 2, 3, 3, 3]


def test_empty_stages_run_where_asked_and_stage_0_must_hold_a_block():
    """[Note: empty stages]: a split with a 0 leaves that stage empty (it passes its input
    on), but not stage 0, which reads the data loader; a model built one stage per rank
    with ranks that hold no block (nanotron's test_serialize: 3/3/3/0) is taken as built;
    the engine's own cost split leaving a stage empty is still refused with a fix."""
    layout = engine_layout(alternating(3), [0] * 7, placement=[0, 1, 2, 3], split=(1, 0, 1, 1), engine="ps_1f1b")
    assert layout.block_stages == (0, 0, 2, 2, 3, 3, 3)
    with pytest.raises(LayoutError, match=r"leaves stage 0 without any block .* stage 0 reads the data loader"):
        engine_layout(alternating(3), [0] * 7, placement=[0, 1, 2, 3], split=(0, 1, 1, 1), engine="ps_1f1b")
    blocks = alternating(4)  # 9 blocks, as nanotron's DummyModel at pp=4
    found = [index // 3 for index in range(9)]
    assert model_stages(found, blocks, [0] * 9, placement=[0, 1, 2, 3], split=None, engine="ps_1f1b") == found
    with pytest.raises(LayoutError, match="nanotron's cost split leaves stage"):
        engine_layout(alternating(1), [1, 0, 1], placement=[0, 1, 2, 3], split=None, engine="ps_1f1b")


def test_inputs_travel_through_empty_stages_and_the_loss_past_them():
    """[Note: empty stages]: a chain 0 -> 2 over an empty stage 1 goes 0 -> 1 -> 2, the
    loss of stage 2 goes on to the empty last stage 3; the stage graph stays the chain."""
    sources = {(1, "x"): Source(block=0), (2, "x"): Source(block=1)}  # block 2 reads block 1, block 1 block 0
    graph = BlockGraph(sources, block_stage=(0, 2, 2), placement=(0, 1, 2, 3))
    assert graph.empty == {1, 3} and graph.loss_stage == 2
    assert graph.route((1, "x")) == [(0, 1), (1, 2)] and graph.carrier((1, "x")) == (0, 1)
    assert graph.route(LOSS) == [(2, 3)] and graph.route((2, "x")) == []
    assert graph.edges == [(0, 1), (1, 2), (2, 3)]
    assert graph.edge_keys((1, 2)) == [(1, "x")] and graph.edge_keys((2, 3)) == [LOSS]
    full = BlockGraph(sources, block_stage=(0, 1, 2), placement=(0, 1, 2))  # nothing empty: as before
    assert full.empty == set() and full.edges == [(0, 1), (1, 2)] and full.route(LOSS) == []
