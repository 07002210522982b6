"""Initial weights by parameter name ([Note: same initial weights] in integration/nanotron/patches/initial_weights.py).

The spawned job builds nanotron's own trainer (no training) from YAML files that differ
only in the engine, the layout, tp, dp and tied embeddings, and compares the full
initial weights, assembled from the ranks' shards by nanotron's sharding metadata: the
same, bit for bit, everywhere (drawn in blocks small enough that each weight spans
several, across nanotron's shards). It also runs nanotron's own `init_model_randomly` on the
same models to check the distributions are nanotron's. The unit tests draw tp shards by
hand-made sharding metadata (nanotron's own `mark_as_sharded`) against the full draw.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import integration.nanotron  # noqa: F401  (first: repairs nanotron)
from integration.nanotron.patches import initial_weights
from integration.nanotron.pipeline.errors import UnsupportedConfigError
from nanotron.parallel.parameters import NanotronParameter, SlicesPair
from trainer_jobs import TrainerConfig, initial_all

UNTIED = {
    "1f1b": TrainerConfig(engine="1f1b"),
    "interleaved": TrainerConfig(engine="interleaved_1f1b:virtual=2"),
    "zbv": TrainerConfig(engine="zbv"),
    "split": TrainerConfig(engine="capped_1f1b:cap=1,split=1/3"),
    "tp2": TrainerConfig(engine="1f1b", pp=1, tp=2),
    "tp2-sp": TrainerConfig(engine="1f1b", pp=1, tp=2, tp_mode="REDUCE_SCATTER"),
    "dp2": TrainerConfig(engine="1f1b", pp=1, dp=2),
}
TIED = {
    "tied-1f1b": TrainerConfig(engine="1f1b", tie_embeddings=True),
    "tied-zbv": TrainerConfig(engine="zbv", tie_embeddings=True),  # embedding and head on rank 0: one tensor
    "tied-tp2": TrainerConfig(engine="1f1b", pp=1, tp=2, tie_embeddings=True),
}
OTHER_SEED = {"seed-43": TrainerConfig(engine="1f1b", seed=43)}
CONFIGS = {**UNTIED, **TIED, **OTHER_SEED}


BLOCK_NUMEL = 100  # blocks of 3 rows of a 32-wide weight: across nanotron's q/k/v and gate/up chunks and shards


@pytest.fixture(scope="module")
def initial(tmp_path_factory):
    results = initial_all(list(CONFIGS.values()), tmp_path_factory.mktemp("initial"), block_numel=BLOCK_NUMEL,
                          timeout=600)
    return dict(zip(CONFIGS, results))


def replica0(result: dict, key: str = "ours") -> dict:
    replicas = result[key]
    for other in replicas.values():  # every data-parallel replica starts the same
        assert other.keys() == replicas[0].keys()
        assert all(other[name].equal(value) for name, value in replicas[0].items())
    return replicas[0]


@pytest.mark.spawn
def test_every_engine_layout_tp_and_dp_starts_from_the_same_weights(initial):
    reference = replica0(initial["1f1b"])
    assert len(reference) == 3 + 4 * 6  # embedding, final norm, lm_head; 6 per decoder layer
    for key in UNTIED:
        weights = replica0(initial[key])
        assert weights.keys() == reference.keys(), key
        for name, value in reference.items():
            assert weights[name].equal(value), (key, name)


@pytest.mark.spawn
def test_tied_embeddings_start_from_the_untied_embedding(initial):
    """The LM head tied to the embedding has the embedding's name, so it starts as the
    embedding, on one rank (zbv) or two (1f1b), at any tp; the rest is as untied."""
    untied = replica0(initial["1f1b"])
    for key in TIED:
        weights = replica0(initial[key])
        assert weights.keys() == untied.keys() - {"model.lm_head.pp_block.weight"}, key
        for name, value in weights.items():
            assert value.equal(untied[name]), (key, name)


@pytest.mark.spawn
def test_the_seed_chooses_the_weights(initial):
    ours, other = replica0(initial["1f1b"]), replica0(initial["seed-43"])
    for name, value in ours.items():
        if value.std() > 0:  # drawn, not constant
            assert not other[name].equal(value), name


@pytest.mark.spawn
@pytest.mark.parametrize("key", ["1f1b", "tp2"])
def test_distributions_are_nanotrons(initial, key):
    """Per parameter, against nanotron's own `init_model_randomly` on the same model:
    constants (norm weights) equal, drawn weights with the same standard deviation
    (within 10%: each has at least 1024 values) and mean near 0, from another stream."""
    ours, theirs = replica0(initial[key], "ours"), replica0(initial[key], "nanotron")
    assert ours.keys() == theirs.keys()
    stds = {}
    for name, value in ours.items():
        reference = theirs[name]
        if reference.std() == 0:
            assert value.equal(reference), name
            continue
        assert value.numel() >= 1024
        assert abs(value.std().item() / reference.std().item() - 1) < 0.1, (name, value.std(), reference.std())
        assert abs(value.mean().item()) < 4 * reference.std().item() / value.numel() ** 0.5, name
        assert not value.equal(reference), name
        stds[name.rsplit(".", 2)[-2]] = reference.std().item()
    # nanotron's rule as the module docstring states it: rows N(0, std / sqrt(2 * layers))
    assert stds["o_proj"] < 0.6 * stds["qkv_proj"] and stds["down_proj"] < 0.6 * stds["gate_up_proj"]


# -- fill on its own: shards of a full draw ---------------------------------------------


def sharded(shape: tuple[int, int], *, dim: int, chunks: tuple[int, ...], rank: int, tp: int) -> NanotronParameter:
    """Rank `rank`'s shard of a (rows, cols) parameter split over `tp` ranks along `dim`,
    each of `chunks` (summing to the dim) split evenly, as nanotron's tensor-parallel
    linears shard with contiguous chunks; marked with nanotron's own `mark_as_sharded`."""
    pairs, local_start, global_start = [], 0, 0
    for chunk in chunks:
        part = chunk // tp
        local = slice(local_start, local_start + part)
        global_ = slice(global_start + rank * part, global_start + (rank + 1) * part)
        pairs.append(SlicesPair(local_slices=tuple(local if d == dim else slice(None) for d in range(2)),
                                global_slices=tuple(global_ if d == dim else slice(None) for d in range(2))))
        local_start, global_start = local_start + part, global_start + chunk
    local_shape = tuple(s // tp if d == dim else s for d, s in enumerate(shape))
    param = NanotronParameter(torch.full(local_shape, float("nan")))
    param.mark_as_sharded(global_ranks=tuple(range(tp)), local_global_slices_pairs=tuple(pairs),
                          unsharded_shape=shape)
    return param


@st.composite
def layouts(draw):
    tp = draw(st.integers(1, 4))
    chunks = tuple(tp * draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 3))))
    dim = draw(st.integers(0, 1))
    other = draw(st.integers(1, 7))
    shape = (sum(chunks), other) if dim == 0 else (other, sum(chunks))
    return shape, dim, chunks, tp, draw(st.integers(0, 1)), draw(st.integers(1, 40))


@settings(max_examples=80, deadline=None)
@given(layouts())
def test_tp_shards_are_parts_of_the_full_draw(layout):
    """Shards split along either dimension, drawn in blocks along either (nanotron's
    rows split dim 1 and are drawn along it; the property holds either way)."""
    shape, dim, chunks, tp, block_dim, block_numel = layout
    original = initial_weights.BLOCK_NUMEL
    initial_weights.BLOCK_NUMEL = block_numel  # blocks smaller than, and across, the shards
    try:
        full = NanotronParameter(torch.empty(shape))
        initial_weights.fill(full, name="w", std=0.02, seed=7, dim=block_dim)
        assembled = torch.full(shape, float("nan"))
        for rank in range(tp):
            param = sharded(shape, dim=dim, chunks=chunks, rank=rank, tp=tp)
            initial_weights.fill(param, name="w", std=0.02, seed=7, dim=block_dim)
            for pair in param.get_sharded_info().local_global_slices_pairs:
                assembled[pair.global_slices] = param[pair.local_slices]
    finally:
        initial_weights.BLOCK_NUMEL = original
    assert assembled.equal(full)


def test_a_shard_mapped_wrongly_is_not_the_full_draw():
    """The property above can fail: a shard whose metadata names other rows gets other values."""
    full = NanotronParameter(torch.empty(8, 3))
    initial_weights.fill(full, name="w", std=0.02, seed=7)
    wrong = sharded((8, 3), dim=0, chunks=(8,), rank=1, tp=2)
    initial_weights.fill(wrong, name="w", std=0.02, seed=7)
    assert not wrong.equal(full[:4]) and wrong.equal(full[4:])


def test_blocks_depend_on_the_full_shape_only():
    assert initial_weights.block_length((10, 3), 0) == initial_weights.BLOCK_NUMEL // 3
    assert initial_weights.block_length((3, 10), 1) == initial_weights.BLOCK_NUMEL // 3
    assert initial_weights.block_length((10, initial_weights.BLOCK_NUMEL * 2), 0) == 1
    assert initial_weights.block_length((5,), 0) == initial_weights.BLOCK_NUMEL


def test_a_shard_draws_only_the_blocks_it_holds(monkeypatch):
    """Blocked along the split dimension (a row linear's dim 1), each of two tp ranks
    draws half of the blocks; blocked along the other, each would draw them all."""
    drawn = []
    seed_of = initial_weights.block_seed
    monkeypatch.setattr(initial_weights, "block_seed", lambda seed, name, k: drawn.append(k) or seed_of(seed, name, k))
    monkeypatch.setattr(initial_weights, "BLOCK_NUMEL", 8)  # one column of 8 rows, or one row of 6 columns
    for block_dim, expected in ((1, [0, 1, 2]), (0, list(range(8)))):
        drawn.clear()
        initial_weights.fill(sharded((8, 6), dim=1, chunks=(6,), rank=0, tp=2), name="w", std=0.02, seed=7,
                             dim=block_dim)
        assert drawn == expected, block_dim


def test_strided_shards_are_refused():
    param = NanotronParameter(torch.empty(2, 2))
    param.mark_as_sharded(global_ranks=(0, 1), unsharded_shape=(4, 2), local_global_slices_pairs=(
        SlicesPair(local_slices=(slice(None), slice(None)), global_slices=(slice(0, 4, 2), slice(None))),))
    with pytest.raises(UnsupportedConfigError, match="strided slice"):
        initial_weights.fill(param, name="w", std=0.02, seed=7)
