"""`pp_engine: auto` in nanotron's trainer ([Note: auto engine] in integration/nanotron/pipeline/engine.py):
the first step runs capped 1F1B with cap 1 and measures; then the chosen engine runs. On CPU
the budget is unbounded, so it chooses 1F1B: losses and parameters bitwise those of
nanotron's 1F1B, and the stash goes from one microbatch (step 1) to 1F1B's (step 2)."""

from __future__ import annotations

import pytest

from integration.nanotron.pipeline.engine import AutoEngine, build_engine
from integration.nanotron.pipeline.engine_spec import parse_engine
from pipeschedule.errors import ParameterError

from trainer_jobs import TrainerConfig, train_all


def test_auto_parses_and_builds():
    assert parse_engine("auto:reserve=4").to_string() == "auto:reserve=4"
    assert parse_engine({"name": "auto"}).to_string() == "auto"
    engine = build_engine("auto")
    assert isinstance(engine, AutoEngine) and engine.spec.to_string() == "capped_1f1b:cap=1"
    for bad, match in (("auto:cap=2", "auto accepts: reserve"), ("auto:reserve=x", "reserve must be an integer"),
                       ({"name": "auto", "reserve": -1}, "reserve is GiB kept back")):
        with pytest.raises(ParameterError, match=match):
            parse_engine(bad)


@pytest.mark.spawn
def test_auto_trains_as_nanotron_1f1b_on_cpu(tmp_path):
    configs = [TrainerConfig(engine="1f1b", pp=2, microbatches=4), TrainerConfig(engine="auto", pp=2, microbatches=4)]
    ref, auto = train_all(configs, tmp_path, timeout=600)
    assert auto["losses"] == ref["losses"]
    for name, value in ref["params"].items():
        assert auto["params"][name].equal(value), name
    first, second = auto["stash"][0][:2]
    assert second == 2 * first  # stage 0: cap 1 at step 1, 1F1B's two microbatches at pp=2 from step 2


def test_an_offload_choice_is_what_its_engine_runs():
    """[Note: auto offload]: the engine string auto picks compiles, through the engine, to
    the schedule the choice simulated: the same device peaks under the same costs."""
    from dataclasses import replace

    from pipeschedule.compiler.ir import BUFFERS
    from pipeschedule.plan.auto import Measured, choose
    from pipeschedule.simulate import CostModel, simulate

    gib, pp, m = 2**30, 4, 8
    measured = Measured((5.27 * gib, 3.4 * gib, 3.4 * gib, 4.06 * gib), (2.05 * gib, 1.64 * gib, 1.64 * gib, 1.8 * gib),
                        (9.8 * gib,) * pp, (0.03,) * pp, (0.06,) * pp, (450e9,) * pp)
    choice = choose(pp, m, measured)
    engine = build_engine(choice.engine)
    assert engine.spec.offload == choice.offload
    schedule = engine.compile(pp=pp, microbatches=m)
    cost = CostModel((0.03,) * pp, (0.06,) * pp, (0.0,) * pp,
                     {k: (measured.stash if k == "stash" else (0,) * pp) for k in BUFFERS},
                     offload_bandwidth=450e9, reload_bandwidth=450e9)
    result = simulate(schedule, replace(cost, offload_chunk=engine.spec.offload_chunk))
    offloaded = [r in choice.offload for r in range(pp)]
    assert choice.offload == (0,)
    assert choice.peaks == tuple(s + (max(p, st) if o else p) for s, p, st, o in
                                 zip(measured.static, result.peak_bytes, measured.stash, offloaded))
    assert result.step_time == choice.step_time


def test_the_choice_is_logged_through_nanotrons_handler():
    """nanotron's handler splits a record's format string at newlines and formats each piece
    with every argument: auto's multi-line message printed 'Logging error' tracebacks instead."""
    import io
    import logging

    from integration.nanotron.pipeline.engine import _LOG, warn_lines
    from nanotron.logging import NewLineStreamHandler

    stream = io.StringIO()
    handler = NewLineStreamHandler(stream)
    handler.setFormatter(logging.Formatter("[%(levelname)s] %(message)s"))
    _LOG.addHandler(handler)
    try:
        warn_lines("auto (rank 0): 100% of 1 GiB: running ps_1f1b; pin it with\n  parallelism:\n    pp_engine: ps_1f1b")
    finally:
        _LOG.removeHandler(handler)
    assert stream.getvalue().splitlines() == [
        "[WARNING] auto (rank 0): 100% of 1 GiB: running ps_1f1b; pin it with", "[WARNING]   parallelism:",
        "[WARNING]     pp_engine: ps_1f1b"]
