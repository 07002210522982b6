"""YAML written without a YAML package: block mappings and sequences, scalars plain where
YAML reads them back as themselves, else double-quoted (printable characters as they are,
the others escaped).

`dump_yaml(obj)` reads the text back (`presets.read_yaml`: PyYAML's safe loader where it is
installed, as nanotron reads its configs) and refuses to return text that does not read
back equal to `obj`, so a config `plan --write` writes is the config it planned.
"""

from __future__ import annotations

import math
import re
from typing import Any

from pipeschedule.errors import FormatError
from pipeschedule.plan.presets import read_yaml

# A plain scalar YAML (1.1, PyYAML's) reads as this same string: a letter, `_` or `/`
# first (a digit, sign or dot may start a number: 0x1F, 1_000, 1:30), then letters,
# digits and `_ . / : = , + -` (no space: no ': ' or ' #'), and none of the words YAML
# resolves to a boolean or null. In a flow list `,` would end the item: quoted there.
_PLAIN = re.compile(r"[A-Za-z_/][A-Za-z0-9_./:=,+-]*")
_SPECIAL = re.compile(r"(?i)(y|yes|n|no|true|false|on|off|null)")


def dump_yaml(obj: dict, source: str = "the written config") -> str:
    """`obj` (nested dicts, lists, strings, numbers, booleans, None) as block-style YAML;
    raises FormatError where the text would not read back as `obj`."""
    text = "\n".join(_mapping(obj, 0)) + "\n"
    back = read_yaml(text, source)
    if back != obj:
        raise FormatError(f"{source} does not read back as written (a value YAML reads as another type); please "
                          "report it")
    return text


def _mapping(obj: dict, indent: int) -> list[str]:
    lines = []
    pad = " " * indent
    for key, value in obj.items():
        if isinstance(value, dict) and value:
            lines += [f"{pad}{_scalar(key)}:"] + _mapping(value, indent + 2)
        elif isinstance(value, list) and value and any(isinstance(v, (dict, list)) for v in value):
            lines += [f"{pad}{_scalar(key)}:"] + _sequence(value, indent + 2)
        else:
            lines.append(f"{pad}{_scalar(key)}: {_inline(value)}")
    return lines


def _sequence(items: list, indent: int) -> list[str]:
    lines = []
    pad = " " * indent
    for item in items:
        if isinstance(item, dict) and item:
            inner = _mapping(item, indent + 2)
            lines += [f"{pad}- {inner[0].lstrip()}"] + inner[1:]
        elif isinstance(item, list) and item and any(isinstance(v, (dict, list)) for v in item):
            lines += [f"{pad}-"] + _sequence(item, indent + 2)
        else:
            lines.append(f"{pad}- {_inline(item)}")
    return lines


def _inline(value: Any, flow: bool = False) -> str:
    if isinstance(value, dict):
        return "{}"  # (empty: a non-empty mapping is written as a block)
    if isinstance(value, list):
        return "[" + ", ".join(_inline(v, flow=True) for v in value) + "]"
    return _scalar(value, flow)


def _scalar(value: Any, flow: bool = False) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _float(value)
    text = str(value)
    if _PLAIN.fullmatch(text) and not _SPECIAL.fullmatch(text) and not (flow and "," in text):
        return text
    return '"' + "".join(_escaped(c) for c in text) + '"'


# What YAML takes raw inside a double-quoted scalar: its printable set, less the line
# breaks it would fold (NEL, LS, PS) and the two characters the quotes escape.
_RAW = re.compile("[\x20-\x7E\xA0-\u2027\u202A-\uD7FF\uE000-\uFFFD\U00010000-\U0010FFFF]")


def _escaped(char: str) -> str:
    if char in '"\\':
        return "\\" + char
    if _RAW.fullmatch(char):
        return char
    return f"\\u{ord(char):04x}" if ord(char) < 0x10000 else f"\\U{ord(char):08x}"


def _float(value: float) -> str:
    """A float as YAML 1.1 reads it back: a dot in the mantissa and a signed exponent
    (PyYAML reads `1e-08` as a string)."""
    if math.isnan(value):
        return ".nan"
    if math.isinf(value):
        return ".inf" if value > 0 else "-.inf"
    text = repr(value)
    mantissa, _, exponent = text.partition("e")
    if "." not in mantissa:
        mantissa += ".0"
    if exponent and exponent[0] not in "+-":
        exponent = "+" + exponent
    return mantissa + ("e" + exponent if exponent else "")


__all__ = ["dump_yaml"]
