"""Models whose blocks form a graph, not a chain ([Note: block graph] in
integration/nanotron/pipeline/block_graph.py), trained by our engines against nanotron's AFAB on
CPU over gloo: nanotron's diamond (our port, graph_models.Diamond) under every engine
whose layout holds it, and random graphs of blocks under every engine, each laid out for
that engine's placement.

The diamond's gradients are compared bitwise: every parameter gets one gradient per
microbatch in microbatch order under every engine, and the bottom's output, read by two
stages, gets the sum of two gradients (commutative). Random graphs may hand one tensor
to three or more consumers, whose gradients autograd may sum in another order than
nanotron's engine does; they are compared within 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from pipeschedule.runtime.launch import spawn

from graph_models import DIAMOND_ENGINES, diamond_worker, random_worker

pytestmark = pytest.mark.spawn

DIAMOND_EDGES = [[0, 1], [0, 2], [1, 3], [2, 3]]
ONE_STAGE_PER_RANK = ("ps_afab", "ps_1f1b", "capped_1f1b", "capped_1f1b:cap=1", "capped_1f1b:cap=2", "zb_h1",
                      "zb_h2")
M = 6


@pytest.fixture(scope="module")
def diamond():
    return spawn(diamond_worker, 4, timeout=300, args=(M,))


def assert_grads(ours: dict, theirs: dict, exact: bool, what: str) -> None:
    assert ours.keys() == theirs.keys(), what
    for name, grad in theirs.items():
        got = ours[name]
        assert (got is None) == (grad is None), f"{what}: {name}"
        if grad is None:
            continue
        if exact:
            assert torch.equal(got, grad), f"{what}: {name} differs by {(got - grad).abs().max().item():.3e}"
        else:
            torch.testing.assert_close(got, grad, rtol=1e-5, atol=1e-6, msg=f"{what}: {name}")


def test_the_diamond_trains_as_nanotrons_afab_under_every_engine_of_one_stage_per_rank(diamond):
    assert set(ONE_STAGE_PER_RANK) <= set(DIAMOND_ENGINES)
    for engine in ONE_STAGE_PER_RANK:
        for rank, ranks in enumerate(diamond):
            row, ref = ranks[engine], ranks["afab"]
            assert "error" not in row, f"{engine}: {row.get('error')}"
            assert row["edges"] == DIAMOND_EDGES, engine  # stages 1 and 2 talk to 0 and 3, never to each other
            assert_grads(row["grads"], ref["grads"], True, f"{engine} rank {rank}")
            assert all(g is not None for g in row["grads"].values()), engine
            if rank == 3:
                assert len(row["losses"]) == M and all(torch.equal(a, b) for a, b in zip(row["losses"], ref["losses"]))
            else:
                assert row["losses"] is None and ref["losses"] is None


def test_the_diamond_evaluates_with_the_forward_half(diamond):
    row, ref = diamond[3]["ps_1f1b"], diamond[3]["afab"]
    assert all(torch.equal(a, b) for a, b in zip(row["eval_losses"], ref["losses"], strict=True))


def test_engines_whose_layout_cannot_hold_the_diamond_refuse_it_in_one_line(diamond):
    """Interleaved and V shapes run two stages on each rank; the diamond puts one pair of
    blocks on each rank, which their layouts cannot hold (as nanotron's own tests place
    blocks themselves). The refusal names the engine, the ranks its stages run on, and
    what the model it was given has, in one line."""
    for engine in set(DIAMOND_ENGINES) - set(ONE_STAGE_PER_RANK):
        for ranks in diamond:
            error = ranks[engine]["error"]
            assert error.startswith(f"LayoutError: pp_engine {engine!r} runs 8 stages on ranks "), error
            assert "but the model it was given has" in error and "\n" not in error, error


# -- random graphs of blocks --------------------------------------------------------------

LAYOUTS = {  # name -> (engines, placement of pp)
    "one": (("ps_afab", "ps_1f1b", "capped_1f1b:cap=1", "zb_h1", "zb_h2"), lambda pp: list(range(pp))),
    "round_robin": (("interleaved_1f1b:virtual=2", "interleaved_zb:virtual=2", "looped_bfs:virtual=2"),
                    lambda pp: [s % pp for s in range(2 * pp)]),
    "v": (("zbv", "v_half", "v_min", "dualpipev"), lambda pp: list(range(pp)) + list(reversed(range(pp)))),
}


@st.composite
def model_specs(draw, stages: int):
    """A random graph of blocks over `stages` stages ([Note: block graph]): an input
    block on stage 0, one or two layers per stage, each reading one to three earlier
    blocks (the first layer of a stage at least one of an earlier stage) and sometimes the
    data, and a loss block on the last stage reading every block that nothing else reads."""
    blocks = [("embed", 0, ["x"], draw(st.integers(3, 4)))]
    for stage in range(stages):
        for k in range(draw(st.integers(1, 2))):
            earlier = [j for j, b in enumerate(blocks) if b[1] < stage]
            candidates = list(range(len(blocks)))
            first = [draw(st.sampled_from(earlier))] if k == 0 and earlier else []
            more = draw(st.lists(st.sampled_from(candidates), max_size=2, unique=True))
            inputs = list(dict.fromkeys(first + more)) or [len(blocks) - 1]
            if draw(st.integers(0, 4)) == 0:
                inputs.append("x")
            blocks.append(("layer", stage, inputs, draw(st.integers(3, 4))))
    read = {src for _, _, inputs, _ in blocks for src in inputs if src != "x"}
    blocks.append(("loss", stages - 1, [j for j in range(len(blocks)) if j not in read], 1))
    split = [sum(1 for kind, s, _, _ in blocks if kind == "layer" and s == stage) for stage in range(stages)]
    return {"blocks": blocks, "split": split}


@st.composite
def random_cases(draw):
    pp = draw(st.integers(2, 3))
    cases = []
    for engines, placement in LAYOUTS.values():
        places = placement(pp)
        spec = draw(model_specs(len(places)))
        split = "/".join(map(str, spec["split"]))
        cases.append((spec, places, [f"{e}{',' if ':' in e else ':'}split={split}" for e in engines]))
    return pp, cases


@settings(max_examples=3, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])  # no shrinking:
@given(random_cases())  # each example spawns ranks, and a failure prints the models
def test_every_engine_trains_random_graphs_of_blocks_as_nanotrons_afab(case):
    """Against the model in one process (every block on one rank, no engine: what AFAB
    computes), and against nanotron's AFAB wherever it runs the model right."""
    pp, cases = case
    results = spawn(random_worker, pp, timeout=600, args=(cases, 3))
    for number, (spec, placement, engines) in enumerate(cases):
        for rank in range(pp):
            row, ref = results[rank][number], results[rank][number]["reference"]
            for engine in ("afab", *engines) if "afab" in row else engines:
                what = f"{engine} rank {rank} on {spec['blocks']} placed {placement}"
                assert "error" not in row[engine], f"{what}: {row[engine].get('error')}"
                grads = row[engine]["grads"]
                assert grads and set(grads) <= set(ref["grads"]), what  # this rank's blocks, by the same names
                assert_grads(grads, {name: ref["grads"][name] for name in grads}, False, what)
                if row[engine]["losses"] is not None:
                    torch.testing.assert_close(row[engine]["losses"], ref["losses"], rtol=1e-6, atol=1e-7, msg=what)
                if engine != "afab" and "afab" in row:
                    assert_grads(grads, row["afab"]["grads"], False, f"{what} (against nanotron's AFAB)")
