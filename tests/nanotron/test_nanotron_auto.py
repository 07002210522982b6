"""`pp_engine: auto` in nanotron's trainer ([Note: auto engine] in integration/nanotron/engine.py):
the first step runs capped 1F1B with cap 1 and measures; then the chosen engine runs. On CPU
the budget is unbounded, so it chooses 1F1B: losses and parameters bitwise those of
nanotron's 1F1B, and the stash goes from one microbatch (step 1) to 1F1B's (step 2)."""

from __future__ import annotations

import pytest

from integration.nanotron.engine import AutoEngine, build_engine
from integration.nanotron.engine_spec import parse_engine
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
