"""A `PlanConfig` from a nanotron config: its model and its layout ([Note: a nanotron
config's layout] in presets.py), under the assumptions of [Note: shared assumptions].

`pipeschedule plan --model-file` reads a config this way (flags overriding the file), and
`pipeschedule check` reads the config it checks this way (the file alone), so that both
price the same YAML alike. `layout_of` resolves each layout option: the value given (a
flag), else the file's, else LAYOUT_DEFAULTS.
"""

from __future__ import annotations

from typing import Any

from pipeschedule.errors import ParameterError
from pipeschedule.plan.assumptions import Assumptions
from pipeschedule.plan.config import PlanConfig, build_config
from pipeschedule.plan.memory import ModelSpec
from pipeschedule.plan.presets import NANOTRON_LAYOUT, load_mapping, load_model, nanotron_layout

LAYOUT_DEFAULTS = {"pp": None, "tp": 1, "dp": [1], "zero": "auto", "microbatches": None, "seq": 8192, "micro_batch": 1,
                   "tp_async": False, "adam_fused": True, "sequence_parallel": True, "fp32_grad_accum": True,
                   "dtype": "bfloat16"}


def layout_of(mapping: Any, source: str | None, given: dict) -> tuple[dict, list[str]]:
    """(every layout option of LAYOUT_DEFAULTS, what the file set in words): `given[option]`
    where it is not None, else the nanotron config's (`mapping`, read from `source`; None:
    no file), else the default. Refuses a layout without pp or microbatches."""
    file_layout = nanotron_layout(mapping, source) if source is not None else {}
    resolved, taken = {}, []
    for option, default in LAYOUT_DEFAULTS.items():
        if given.get(option) is not None:
            resolved[option] = given[option]
        elif option in file_layout:
            value, where = file_layout[option]
            resolved[option] = value
            shown_value = str(value).lower() if isinstance(value, bool) else value
            taken.append(f"{option.replace('_', '-')} {shown_value} ({where})")
        else:
            resolved[option] = default
    for option in ("pp", "microbatches"):
        if resolved[option] is None:
            raise ParameterError(f"give --{option}, or a nanotron config as --model-file (it names "
                                 f"{'.'.join(NANOTRON_LAYOUT[option])})")
    if not isinstance(resolved["dp"], list):  # one dp from the file
        resolved["dp"] = [resolved["dp"]]
    return resolved, taken


def plan_config(model: ModelSpec, layout: dict, assumptions: Assumptions, *, recompute: str = "none",
                **options) -> PlanConfig:
    """The PlanConfig of a resolved layout (`layout_of`) at its smallest dp, under
    `assumptions`; `options`: build_config's other keywords (costs, search, offload)."""
    return build_config(
        model, pp=layout["pp"], microbatches=layout["microbatches"], tp=layout["tp"], dp=min(layout["dp"]),
        zero_stage=0 if layout["zero"] == "auto" else int(layout["zero"]), seq=layout["seq"],
        micro_batch=layout["micro_batch"], recompute=recompute, tp_async=layout["tp_async"],
        adam_fused=layout["adam_fused"], sequence_parallel=layout["sequence_parallel"],
        fp32_grad_accum=layout["fp32_grad_accum"], dtype=layout["dtype"], **assumptions.config_kwargs(), **options)


def config_of_file(path: str, assumptions: Assumptions, *, recompute: str = "none") -> PlanConfig:
    """The PlanConfig of the nanotron config at `path` alone: what `pipeschedule check`
    prices, as `plan --model-file PATH` would with no other flag."""
    mapping = load_mapping(path)
    layout, _ = layout_of(mapping, path, {})
    return plan_config(load_model(path, mapping), layout, assumptions, recompute=recompute)


__all__ = ["LAYOUT_DEFAULTS", "config_of_file", "layout_of", "plan_config"]
