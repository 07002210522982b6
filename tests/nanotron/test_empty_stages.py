"""Pipeline ranks that hold no block ([Note: empty stages] in
integration/nanotron/pipeline/block_graph.py), on CPU over gloo with nanotron's real
PipelineBlocks (helpers in pipeline_port.py).

nanotron's own tests/test_serialize.py builds its DummyModel at pp=4 in contiguous runs
of ceil(9 / 4) blocks, 3/3/3/0, and trains it with AFAB; every one-stage-per-rank engine
of ours trains that placement as an empty last stage that passes the loss on: losses,
gradients and evaluation losses bitwise those of the one-rank run and of nanotron's AFAB,
the losses returned on the rank of the loss block, as nanotron's. A split that gives a
middle stage no decoder layer runs it as a stage that passes its input on, under every
family: one stage per rank, interleaved and V shapes.
"""

from __future__ import annotations

import functools

import pytest

from pipeline_port import SEQUENTIAL, Job, Run, run_pipelines
from test_nanotron_pipeline_port import assert_same, engine_values

pytestmark = pytest.mark.spawn

PP = 4
M = PP + 5  # as nanotron's tests
SERIALIZE = "serialize"  # 3/3/3/0 at pp=4


def _with(engine: str, option: str) -> str:
    return f"{engine}{',' if ':' in engine else ':'}{option}"


def middle_empty() -> list[tuple[str, str]]:
    """(model, engine): each engine with a split that gives stage 1 of the pipeline (one
    stage per rank) or stage pp - 1 (two a rank: rank pp-1's first chunk) no layer."""
    one, two = engine_values(PP)
    out = [("chain:4", _with(engine, "split=1/0/2/1")) for engine in ("ps_1f1b", "capped_1f1b:cap=2", "zb_h1")]
    split = [1] * (2 * PP)
    split[PP - 1] = 0
    out += [(f"chain:{sum(split)}", _with(engine, "split=" + "/".join(map(str, split))))
            for engine in two[:len(two) - 2]]  # without the option runs
    return out


def runs() -> tuple[Run, ...]:
    one, _ = engine_values(PP)
    out = [Run(SERIALIZE, SEQUENTIAL, M), Run(SERIALIZE, "afab", M)]
    out += [Run(SERIALIZE, engine, M, evaluate=True) for engine in one]
    for model in sorted({model for model, _ in middle_empty()}):
        out.append(Run(model, SEQUENTIAL, M))
    out += [Run(model, engine, M, evaluate=True) for model, engine in middle_empty()]
    return tuple(out)


@functools.cache
def job() -> dict:
    return {(r["run"].model, r["run"].engine): r for r in run_pipelines(Job(PP, runs(), timeout=600))}


def test_nanotrons_serialize_placement_trains_under_every_one_stage_engine():
    found = job()
    reference, afab = found[SERIALIZE, SEQUENTIAL], found[SERIALIZE, "afab"]
    assert reference["grads"] and reference["no_grad"] == []
    assert_same(afab, reference)  # nanotron's AFAB runs the empty rank too
    one, _ = engine_values(PP)
    for engine in one:
        run = found[SERIALIZE, engine]
        assert_same(run, afab)
        assert run["eval_losses"].equal(reference["eval_losses"]), engine


def test_a_stage_without_layers_passes_its_input_on_in_every_family():
    found = job()
    for model, engine in middle_empty():
        reference = found[model, SEQUENTIAL]
        run = found[model, engine]
        assert_same(run, reference)
        assert run["eval_losses"].equal(reference["eval_losses"]), engine
