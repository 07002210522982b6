"""What nanotron's own pipeline tests check, in this project's words, over every
pipeschedule engine, on CPU over gloo (issue 34; helpers in pipeline_port.py).

nanotron's tests (tests/test_pipeline_parallel.py and
tests/test_parameters_accumulate_gradient_in_fp32.py in its repository) train small models
of PipelineBlocks that they place themselves and compare with the same model run on one
rank. Here, with every engine built through nanotron's config path:

- nanotron's chain (a linear and an activation block per rank, then a loss) and its model
  passing a tensor that does not require grad (asserted inside its forward), trained by
  every engine that runs one stage per rank: every parameter gets a gradient; losses and
  gradients are those of the one-rank run, and bitwise those of nanotron's AFAB and 1F1B;
- the same models placed by nanotron's tests under engines with two stages per rank
  (interleaved, V shapes): refused in one line; with more blocks, placed by those
  engines' own layouts (split=1/1/..): trained as the one-rank run;
- evaluation (nanotron's forward without an engine): `validate_batch_iter` gives the
  one-rank forward's losses;
- tied weights under DDP with nanotron's fp32 accumulator, its ZeRO optimizer and its DDP
  hook (all-reduce or reduce-scatter): on return from `train_batch_iter` the accumulator
  holds the replicas' average (this replica's slice under reduce-scatter: nanotron's test
  checks only that) and the tied gradients are not yet summed across the pipeline; after
  nanotron's `sync_tied_weights_gradients` they are, equal on the ranks sharing them, and
  the optimizer's fp32 gradient still views the buffer.

The engines come from the family records, so a family added there is trained here; a model joins
by its class in pipeline_port.MODELS and an entry in PLACED_BY_TEST (placed as nanotron's
test places it) or PLACED_BY_ENGINE (a shape each engine places).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import integration.nanotron  # noqa: F401  (first: repairs nanotron, registers the engine names)
from pipeschedule.compiler.families import FAMILIES
from pipeline_port import SEQUENTIAL, Job, Run, TiedJob, TiedRun, engine_of, run_pipelines, run_tied

OPTIONS = ("recompute=full", "offload=0")  # each also drawn on top of one engine of each shape


@dataclass(frozen=True)
class Placed:
    """A model of pipeline_port.MODELS as nanotron's tests place it: the pipeline sizes it
    is built for, and the decoder layers (its repeated blocks) per rank of that placement,
    which is also the split= describing it to an engine (None: no split does; the engines
    run it without one)."""

    pps: tuple[int, ...]
    layers: Callable[[int], list[int] | None]


PLACED_BY_TEST = {
    "chain": Placed((2, 4), lambda pp: [1] * pp),
    "no_grad": Placed((2, 4), lambda pp: [1] * (pp - 1) + [2]),
}
PLACED_BY_ENGINE = ("chain", "no_grad")  # the same shapes with one pair per stage, where each engine puts them


def placed_by_test(pp: int) -> list[str]:
    return [name for name, placed in PLACED_BY_TEST.items() if pp in placed.pps]


def engine_values(pp: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Every registered engine (virtual=2 where it must be named), split into those that
    run one stage per rank and those that run two; then the options on the first of each
    kind, and capped 1F1B at cap 1."""
    values = [f.engine + (":virtual=2" if f.takes_virtual else "") for f in FAMILIES.values()]
    one = [v for v in values if len(engine_of(v, pp).placement(pp)) == pp]
    two = [v for v in values if v not in one]
    one += ["capped_1f1b:cap=1"] + [_with(one[0], option) for option in OPTIONS]
    two += [_with(two[0], option) for option in OPTIONS]
    return tuple(one), tuple(two)


def plain(engines: tuple[str, ...]) -> tuple[str, ...]:
    """`engines` without the option runs."""
    return engines[:len(engines) - len(OPTIONS)]


def _with(engine: str, option: str) -> str:
    return f"{engine}{',' if ':' in engine else ':'}{option}"


def _split(counts) -> str:
    return "split=" + "/".join(map(str, counts))


def engines_on_test_placement(model: str, pp: int) -> tuple[str, ...]:
    """Our engines that run `model` as nanotron's tests place it."""
    one, _ = engine_values(pp)
    layers = PLACED_BY_TEST[model].layers(pp)
    return one + (() if layers is None else (_with("ps_1f1b", _split(layers)),))


def engine_placed(model: str, pp: int) -> tuple[str, tuple[str, ...]]:
    """`model`'s shape with one pair per stage of a two-stages-per-rank engine, and the
    engines that place and train it: every such engine, and 1F1B on the same pairs."""
    _, two = engine_values(pp)
    engines = tuple(_with(engine, _split([1] * 2 * pp)) for engine in two) + (_with("ps_1f1b", _split([2] * pp)),)
    return f"{model}:{2 * pp}", engines


def runs_for(pp: int) -> tuple[Run, ...]:
    _, two = engine_values(pp)
    m = pp + 5  # as nanotron's tests
    runs = []
    for model in placed_by_test(pp):
        runs += [Run(model, SEQUENTIAL, m), Run(model, "afab", m), Run(model, "1f1b", m)]
        runs += [Run(model, engine, m, evaluate=True) for engine in engines_on_test_placement(model, pp)]
        runs += [Run(model, engine, m) for engine in plain(two)]  # refused
    for model in PLACED_BY_ENGINE:
        name, engines = engine_placed(model, pp)
        runs += [Run(name, SEQUENTIAL, m)] + [Run(name, engine, m, evaluate=True) for engine in engines]
    return tuple(runs)


@functools.cache
def job(pp: int) -> dict:
    return {(r["run"].model, r["run"].engine): r for r in run_pipelines(Job(pp, runs_for(pp), timeout=300))}


def assert_same(run: dict, reference: dict) -> None:
    """Same losses and gradients, bitwise; every parameter got a gradient."""
    assert run["error"] is None, run["error"]
    assert reference["error"] is None, reference["error"]
    assert run["no_grad"] == [], (run["run"], run["no_grad"])
    assert run["losses"].equal(reference["losses"]), (run["run"], run["losses"], reference["losses"])
    assert run["grads"].keys() == reference["grads"].keys(), run["run"]
    for name, grad in reference["grads"].items():
        assert run["grads"][name].equal(grad), (run["run"], name, (run["grads"][name] - grad).abs().max())


@pytest.mark.spawn
@pytest.mark.parametrize("pp", [2, 4])
def test_one_stage_per_rank_engines_train_nanotrons_models_as_one_rank_does(pp):
    runs = job(pp)
    for model in placed_by_test(pp):
        reference = runs[model, SEQUENTIAL]
        assert reference["grads"] and reference["no_grad"] == [], reference
        for engine in ("afab", "1f1b") + engines_on_test_placement(model, pp):
            assert_same(runs[model, engine], reference)


@pytest.mark.spawn
@pytest.mark.parametrize("pp", [2, 4])
def test_two_stages_per_rank_engines_refuse_nanotrons_placement_in_one_line(pp):
    runs = job(pp)
    _, two = engine_values(pp)
    for model in placed_by_test(pp):
        for engine in plain(two):
            error = runs[model, engine]["error"]
            assert error is not None, (model, engine)
            line = error.strip().splitlines()[-1]
            placement = engine_of(engine, pp).placement(pp)
            assert len(placement) == 2 * pp
            assert line.startswith("integration.nanotron.pipeline.errors.LayoutError: "
                                   f"pp_engine {engine!r} runs {2 * pp} stages on ranks {placement} "
                                   "and expects its blocks to visit ranks"), line
            layers = PLACED_BY_TEST[model].layers(pp)
            if layers is not None:
                assert f"but the model it was given has decoder layers per run of blocks " \
                       f"{'/'.join(map(str, layers))} on ranks {list(range(pp))}" in line, line


@pytest.mark.spawn
@pytest.mark.parametrize("pp", [2, 4])
def test_two_stages_per_rank_engines_train_the_models_they_place_as_one_rank_does(pp):
    runs = job(pp)
    for model in PLACED_BY_ENGINE:
        name, engines = engine_placed(model, pp)
        reference = runs[name, SEQUENTIAL]
        assert reference["grads"] and reference["no_grad"] == [], reference
        for engine in engines:
            assert_same(runs[name, engine], reference)


@pytest.mark.spawn
@pytest.mark.parametrize("pp", [2, 4])
def test_blocks_are_built_on_their_rank_only(pp):
    """nanotron's build_and_set_rank: a block's module exists on the rank it is set to and
    nowhere else; every rank agrees where each block is."""
    for run in job(pp).values():
        if run["error"] is None:
            assert run["misbuilt"] == [], (run["run"], run["misbuilt"])
            assert run["ranks_agree"], run["run"]


@pytest.mark.spawn
@pytest.mark.parametrize("pp", [2, 4])
def test_evaluation_gives_the_one_rank_forward(pp):
    runs = job(pp)
    evaluated = [r for r in runs.values() if r["run"].evaluate]
    assert len(evaluated) >= len(engine_values(pp)[0]) + len(engine_values(pp)[1])
    for run in evaluated:
        assert run["error"] is None, run["error"]
        reference = runs[run["run"].model, SEQUENTIAL]["eval_losses"]
        assert run["eval_losses"].equal(reference), (run["run"], run["eval_losses"], reference)


# -- tied weights, fp32 accumulation, ZeRO, DDP ----------------------------------------------

TIED_ENGINES = ("ps_afab", "ps_1f1b", "capped_1f1b:cap=1", "zb_h1", "ps_1f1b:recompute=full")


def tied_runs() -> tuple[TiedRun, ...]:
    """nanotron's placement (pp=2: one pair per rank, the two linear weights tied) under
    one-stage-per-rank engines with each DDP hook, and nanotron's own 1F1B (its
    reduce-scatter hook needs NCCL); then four pairs placed by each two-stages-per-rank
    engine, every linear weight tied: two of them share rank 0 (stages 0 and 3 of a V,
    0 and 2 of the interleaved placement), so one parameter is used by two stages there."""
    runs = [TiedRun("chain", engine, reduce_scatter) for engine in TIED_ENGINES for reduce_scatter in (False, True)]
    runs.append(TiedRun("chain", "1f1b", False))
    _, two = engine_values(2)
    runs += [TiedRun("chain:4", _with(engine, "split=1/1/1/1"), reduce_scatter=index % 2 == 1)
             for index, engine in enumerate(plain(two))]
    return tuple(runs)


@functools.cache
def tied_job() -> list:
    runs = tied_runs()
    return list(zip(runs, run_tied(TiedJob(pp=2, dp=2, runs=runs, timeout=300))))


def assert_grad(run: TiedRun, name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    """Bitwise where the reference sums what the engine sums in the same order; where a
    weight is used by two stages of one rank, nanotron's AFAB adds the two uses' half
    gradients in half precision and pipeschedule's engines in fp32 ([Note: parameters
    shared by stages of one rank]): equal to half precision's resolution."""
    if ":" in run.model:
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3, msg=lambda text: f"{run} {name}: {text}")
    else:
        assert got.equal(expected), (run, name, (got - expected).abs().max())


def _slice(record: dict, name: str, tensor: torch.Tensor) -> torch.Tensor:
    start, end = record["offsets"][name]
    return tensor.view(-1)[start:end]


@pytest.mark.spawn
def test_tied_weights_with_fp32_accumulation_and_zero_under_every_engine():
    tied = "mlp.0.linear.pp_block.weight"  # nanotron names a tie after its first member
    for run, records in tied_job():
        for record in records:
            assert record["error"] is None, (run, record["error"])
        m = run.microbatches
        for record in records:
            assert not record["pending"] or run.engine == "1f1b", run  # ours return with the average complete
            reference = record["reference"]
            assert record["tied"] == [tied], record["tied"]
            for name, returned in record["returned"].items():
                expected = reference["averaged"][name] / m
                if run.reduce_scatter:  # only this replica's slice is reduced
                    assert_grad(run, name, _slice(record, name, returned), _slice(record, name, expected))
                else:
                    assert_grad(run, name, returned, expected)
                synced = reference["tied_summed" if name == tied else "averaged"][name] / m
                assert_grad(run, name, _slice(record, name, record["tied_synced"][name]), _slice(record, name, synced))
            assert all(record["views"].values()), (run, record["views"])
        by_place = {(r["pp_rank"], r["dp_rank"]): r for r in records}
        for dp in (0, 1):
            first, second = by_place[0, dp], by_place[1, dp]
            # on return the two pipeline ranks hold their own uses' sums; after the sync, the same
            assert not first["returned"][tied].equal(second["returned"][tied]), run
            assert _slice(first, tied, first["tied_synced"][tied]).equal(
                _slice(first, tied, second["tied_synced"][tied])), run
        if not run.reduce_scatter:  # the whole buffer averaged: the replicas agree
            for pp in (0, 1):
                for name, grad in by_place[pp, 0]["returned"].items():
                    assert grad.equal(by_place[pp, 1]["returned"][name]), (run, name)
