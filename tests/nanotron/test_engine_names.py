"""Unknown `pp_engine` names and parameters get the closest known one ("caped_1f1b": did
you mean capped_1f1b?), and that one loads."""

from __future__ import annotations

import re
import string

import pytest
from hypothesis import assume, given, settings, strategies as st

from integration.nanotron.pipeline.engine_spec import parse_engine
from integration.nanotron.pipeline.engine_spec import AUTO_ENGINE, NANOTRON_ENGINES
from pipeschedule.compiler.families import FAMILIES
from pipeschedule.errors import ParameterError
from strategies import examples

ENGINES = {f.engine: f for f in FAMILIES.values()} | {f.name: f for f in FAMILIES.values()}  # both name a family
KNOWN = tuple(dict.fromkeys((*NANOTRON_ENGINES, *ENGINES, AUTO_ENGINE)))


@st.composite
def typos(draw):
    """A known engine name with one character deleted, inserted, replaced or swapped."""
    name = draw(st.sampled_from(KNOWN))
    at = draw(st.integers(0, len(name) - 1))
    letter = draw(st.sampled_from(string.ascii_lowercase + string.digits + "_"))
    edit = draw(st.sampled_from(["delete", "insert", "replace", "swap"]))
    typo = {"delete": name[:at] + name[at + 1:], "insert": name[:at] + letter + name[at:],
            "replace": name[:at] + letter + name[at + 1:],
            "swap": name[:at] + name[at + 1:at + 2] + name[at] + name[at + 2:]}[edit]
    assume(typo and typo not in KNOWN)
    return name, typo


@settings(max_examples=examples(300))
@given(typos())
def test_a_mistyped_engine_name_gets_a_known_name_that_loads(case):
    name, typo = case
    with pytest.raises(ParameterError) as refused:
        parse_engine(typo)
    said = re.search(r"did you mean (\S+(?: or \S+)*)\?", str(refused.value))
    if said is None:  # a short name a typo took far from every name (abab, 1b1b): the list of names follows
        assert "Accepted: " in str(refused.value) and len(name) <= 4
        return
    for suggested in said.group(1).split(" or "):  # several where the typo begins them (zb_h: zb_h1 or zb_h2)
        assert suggested in KNOWN
        required = "virtual=2" if suggested in ENGINES and ENGINES[suggested].takes_virtual else ""
        assert parse_engine(suggested + (":" + required if required else "")).name == suggested


def test_typos_of_the_issue_get_their_names():
    for typo, name in (("caped_1f1b", "capped_1f1b"), ("1F1B", "1f1b"), ("interleaved", "interleaved_1f1b or "
                                                                                     "interleaved_zb")):
        with pytest.raises(ParameterError, match=rf"unknown engine '{typo}' \(did you mean {name}\?\)"):
            parse_engine(typo)
    with pytest.raises(ParameterError, match=r"accepts: cap, split.* \(did you mean cap\?\)"):
        parse_engine("capped_1f1b:caps=2")


def test_a_name_far_from_every_engine_gets_the_list_alone():
    with pytest.raises(ParameterError) as refused:
        parse_engine("gpipe_schedule")
    assert "did you mean" not in str(refused.value) and "Accepted: afab, 1f1b" in str(refused.value)
