"""The YAML `plan --write` writes reads back as what was written, whatever the strings and
numbers of the user's config (`pipeschedule/plan/yaml_writer.py`), and what would not
read back is refused rather than written."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from pipeschedule.errors import FormatError
from pipeschedule.plan import yaml_writer
from pipeschedule.plan.yaml_writer import dump_yaml
from strategies import examples

keys = st.text(st.characters(min_codepoint=32, max_codepoint=0x24F, exclude_categories=("Cc", "Cs")), min_size=1,
               max_size=12)
scalars = (st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False)
           | st.text(max_size=20) | st.sampled_from(["yes", "No", "on", "null", "~", "1e-08", "0x1F", "1_000", "12:30",
                                                    "1f1b", "capped_1f1b:cap=2,split=1/2", "a: b", "#x", "- x", "",
                                                    " lead", "trail ", "2026-12-07", ".inf", "[1]", "{a: 1}", "'q'",
                                                    "tab\there", "new\nline"]))
documents = st.dictionaries(keys, st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                                               | st.dictionaries(keys, inner, max_size=4), max_leaves=20),
                            max_size=6)


@settings(max_examples=examples(300))
@given(documents)
def test_what_is_written_reads_back_as_it_was(document):
    assert yaml.safe_load(dump_yaml(document)) == document or document == {}


def test_a_pp_engine_value_is_written_plain_as_users_write_it():
    text = dump_yaml({"parallelism": {"pp": 4, "pp_engine": "capped_1f1b:cap=2,split=19/21/21/19"}})
    assert text == "parallelism:\n  pp: 4\n  pp_engine: capped_1f1b:cap=2,split=19/21/21/19\n"
    assert dump_yaml({"lr": 1e-8, "on": "yes"}) == 'lr: 1.0e-08\n"on": "yes"\n'


def test_a_value_that_would_not_read_back_is_refused(monkeypatch):
    monkeypatch.setattr(yaml_writer, "_scalar", lambda value, flow=False: str(value))  # `yes` would read as True
    with pytest.raises(FormatError, match="does not read back as written"):
        dump_yaml({"answer": "yes"})
