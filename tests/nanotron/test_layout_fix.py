"""Refusals that suggest a fix suggest one that is accepted ([Note: a fix that is accepted]
in integration/nanotron/pipeline/layout_fix.py): over engines, pp, virtual, layer counts and given
splits, every `pp_engine: VALUE [with parallelism.pp: P]` a layout refusal prints is read
back from the message, applied, and laid out and compiled by the engine without a
refusal."""

from __future__ import annotations

import re

import pytest
from hypothesis import assume, given, settings, strategies as st

import integration.nanotron  # noqa: F401  (registers the engines, as a launch script would)
from integration.nanotron.check import engine_layout
from integration.nanotron.pipeline.errors import LayoutError
from integration.nanotron.pipeline.layout_fix import even_split, fitting_split
from integration.nanotron.pipeline.engine_spec import NANOTRON_ENGINES
from nanotron.config.models_config import LlamaConfig
from nanotron.config.utils_config import cast_str_to_pipeline_engine
from pipeschedule.compiler.families import FAMILIES
from pipeschedule.errors import ParameterError
from strategies import examples

FIX = re.compile(r"pp_engine: (\S+)(?: with parallelism\.pp: (\d+))?")


def model(layers: int) -> LlamaConfig:
    """nanotron's own Llama config class (4 heads, 2 kv heads, width 32)."""
    return LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=layers, vocab_size=128, max_position_embeddings=16)


def accepted(value: str, pp: int, layers: int, microbatches: int = 4) -> bool:
    """Whether pp_engine `value` at `pp` ranks lays out a model of `layers` decoder layers
    and compiles its schedule, as `pipeschedule check` and the engine's first step do."""
    engine = cast_str_to_pipeline_engine(value)  # nanotron's loader, ours registered
    try:
        engine_layout(engine, model(layers), pp)
        if hasattr(engine, "compile"):
            engine.compile(pp=pp, microbatches=microbatches)
    except (LayoutError, ParameterError):
        return False
    return True


def fixes_in(message: str, pp: int) -> list[tuple[str, int]]:
    """Every (pp_engine value, pp) a refusal suggests."""
    return [(value, int(new_pp) if new_pp else pp) for value, new_pp in FIX.findall(message)]


@st.composite
def engine_values(draw):
    """(pp_engine value, pp, layers): a pipeschedule engine of any family at pp 1..6, its
    virtual where it takes one, a cap half of the time, and a split half of the time of
    any length and sum (the right ones among them)."""
    family = FAMILIES[draw(st.sampled_from(sorted(FAMILIES)))]
    pp, layers = draw(st.integers(1, 6)), draw(st.integers(1, 16))
    params = []
    virtual = family.chunks()
    if family.takes_virtual:
        virtual = draw(st.integers(1, 4))
        params.append(f"virtual={virtual}")
    if family.takes_cap and draw(st.booleans()):
        params.append(f"cap={draw(st.integers(virtual, 2 * pp * virtual))}")
    if draw(st.booleans()):
        stages = pp * virtual
        length = draw(st.sampled_from([stages, stages, stages, max(1, stages - 1), stages + 1]))
        exact = draw(st.booleans())
        split = (list(draw(st.permutations(even_split(layers, length)))) if exact else
                 draw(st.lists(st.integers(0, layers), min_size=length, max_size=length)))
        assume(sum(split) >= 1)
        params.append("split=" + "/".join(map(str, split)))
    return family.engine + (":" + ",".join(params) if params else ""), pp, layers


@settings(max_examples=examples(400))
@given(engine_values())
def test_every_fix_a_layout_refusal_suggests_is_accepted(case):
    value, pp, layers = case
    try:
        engine = cast_str_to_pipeline_engine(value)
        engine_layout(engine, model(layers), pp)
        return
    except LayoutError as err:
        message = str(err)
    except ParameterError:
        return  # a refusal of the value itself (lengths against pp), which suggests no layout
    fixes = fixes_in(message, pp)
    assert len(message.splitlines()) == 1
    if not fixes:  # then the rule is said: the model is too small for any pp this engine runs at
        assert "give fewer stages than" in message, message
        return
    for fixed, new_pp in fixes:
        assert accepted(fixed, new_pp, layers), (value, pp, layers, message)


@settings(max_examples=examples(200))
@given(st.sampled_from(NANOTRON_ENGINES), st.integers(2, 9), st.integers(1, 4))
def test_every_fix_for_nanotrons_engines_is_accepted(name, pp, layers):
    """nanotron's own split leaves trailing ranks without a block when pp exceeds the
    model's blocks' reach (pp > layers + 4 for its Llama): the suggestions run."""
    try:
        engine_layout(cast_str_to_pipeline_engine(name), model(layers), pp)
        return
    except LayoutError as err:
        message = str(err)
    fixes = fixes_in(message, pp)
    assert fixes, message
    for fixed, new_pp in fixes:
        assert accepted(fixed, new_pp, layers), (name, pp, layers, message)


def test_the_interleaved_refusal_of_issue_33_now_suggests_what_runs():
    """4 layers at virtual=3, pp=4: the refusal used to suggest split=0/1/1/1/1/0/0/0/0/0/0/0,
    itself refused with the same suggestion."""
    with pytest.raises(LayoutError) as refused:
        engine_layout(cast_str_to_pipeline_engine("interleaved_1f1b:virtual=3"), model(4), 4)
    message = str(refused.value)
    assert "the model's 4 decoder layers fill at most 6 stages" in message
    assert fixes_in(message, 4) == [("interleaved_1f1b:virtual=1,split=1/1/1/1", 4)]
    assert accepted("interleaved_1f1b:virtual=1,split=1/1/1/1", 4, 4)


def test_the_acceptance_check_refuses_the_old_suggestions():
    """The checker above is not blind: broken values are refused by it (the suggestion the
    refusal of issue 33 used to print left stages empty, which now run)."""
    old = "interleaved_1f1b:virtual=3,split=" + "/".join(map(str, even_split(4, 12)))
    assert accepted(old, 4, 4)  # its empty stages now pass their input on ([Note: empty stages])
    assert not accepted("capped_1f1b:split=1/1/1", 4, 3)  # a stage count short
    assert accepted("zbv:split=0/0/0/0/0/0/4/0", 4, 4)  # middle stages left empty pass on ([Note: empty stages])
    assert not accepted("1f1b", 8, 1)  # nanotron's split leaves ranks 5..7 empty
    assert accepted("zbv:split=0/1/1/1/1/1/1/0", 4, 6)


@pytest.mark.parametrize("layers, stages, head, tail", [(4, 6, True, True), (3, 4, False, True), (5, 5, True, False),
                                                        (4, 4, False, False), (7, 3, True, True)])
def test_fitting_split_leaves_no_stage_without_a_block(layers, stages, head, tail):
    split = fitting_split(layers, stages, head=head, tail=tail)
    assert sum(split) == layers and len(split) == stages
    assert all(n >= 1 for s, n in enumerate(split) if not (s == 0 and head) and not (s == stages - 1 and tail))
    assert max(split) - min(split[1:-1] or split) <= 1 or min(split) == 0
    assert fitting_split(stages - 3, stages) is None  # too few layers for the stages between
