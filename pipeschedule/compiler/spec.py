"""`ScheduleSpec`: the one grammar of `pp_engine` values, parsed, printed and compiled here.

[Note: pp_engine syntax] nanotron parses its config with dacite `strict=True`, so an
extra key next to `pp_engine` fails; a schedule's parameters travel inside the value.
Two forms are accepted, and both parse to the same `ScheduleSpec`:

    pp_engine: capped_1f1b:cap=2,split=19/21/21/19                    # string form
    pp_engine: {name: capped_1f1b, cap: 2, split: [19, 21, 21, 19]}   # mapping form

Grammar of the string form: `NAME[:KEY=VALUE[,KEY=VALUE]...]`; a VALUE is an integer, a
word (recompute's `full`, `selective`) or a list of integers joined by `/`
(`cap=4/3/2/1`; `,` separates parameters, so a list cannot be joined by it here; a string
of the mapping form, like the command line's `--cap`, takes `4,3,2,1` too: [Note: list
syntax] in pipeschedule/checks.py). No spaces or quotes are needed, so the value survives
YAML unquoted (a `:` not followed by a space does not start a mapping). In the mapping
form a list may also be a YAML list.

NAME is a schedule family's engine name or its own name (`FAMILIES`: `capped_1f1b`,
`ps_1f1b` or `1f1b`, ...), `auto`, or a name the caller runs itself (`foreign`: nanotron's
adapter passes nanotron's own `1f1b` and `afab`, which then keep meaning nanotron's
engines). Which parameters a name takes is derived from its `Family` record: `virtual`
where the family takes any chunk count (required there: without it the order is 1F1B's
under another name), `cap` where it takes a cap, and every family takes

    split      decoder layers per stage, pp * virtual integers >= 0 in stage order (the
               nanotron adapter's layout; None: nanotron's cost-balanced split)
    recompute  `full`, `selective`, `N` (the first N decoder layers of every stage) or
               `N0/N1/...` (per stage)
    offload    ranks (`0` or `0/1`) whose stashes all go to host memory between their F
               and their B (`offload.add_offload`, fraction 1)
    lead       computes between a RELOAD and the B that needs it (default 1; needs offload)
    stream     MiB: stashes stream in chunks of this size (needs offload)

`auto[:reserve=GiB]` is `AutoSpec`: the engine chosen at the first step
(pipeschedule.plan.auto). A value prints back in one canonical string form
(`ScheduleSpec.to_string()`: the family's engine name, then virtual, cap, split,
recompute, offload, lead, stream, each where given): `parse_spec(s.to_string()) == s`.

Defaults come from the family record, never restated: the chunks per rank
(`Family.chunks`), the cap (`Family.default_cap`: capped_1f1b's ceil(pp/2)), the
placement. `compile_spec(spec, pp=, microbatches=)` is the one way from a value to the
lowered, verified schedule it runs (with its OFFLOAD / RELOAD).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeschedule.checks import LIST_SEPARATORS, MAX_DIGITS, MAX_LAYERS, TooManyDigits, is_int, parse_int, shown
from pipeschedule.compiler.families import FAMILIES, Family, generate
from pipeschedule.compiler.generators.common import per_rank_caps
from pipeschedule.compiler.offload import OffloadPolicy, add_offload
from pipeschedule.compiler.passes import lower
from pipeschedule.compiler.verify import verify
from pipeschedule.errors import ParameterError

PARAM_ORDER = ("virtual", "cap", "split", "recompute", "offload", "lead", "stream")
COMMON_PARAMS = ("split", "recompute", "offload", "lead", "stream")  # what every family takes
RECOMPUTE_MODES = ("full", "selective")
AUTO = "auto"  # auto[:reserve=GiB] ([Note: auto engine] in the nanotron adapter's engine.py)


def family_params(family: Family) -> tuple[str, ...]:
    """The parameters a family's value takes, in canonical order: virtual where it takes
    any chunk count, cap where it takes one, then COMMON_PARAMS."""
    own = tuple(key for key, taken in (("virtual", family.takes_virtual), ("cap", family.takes_cap)) if taken)
    return own + COMMON_PARAMS


def family_required(family: Family) -> tuple[str, ...]:
    """The parameters a family's value must give: virtual where it takes any count."""
    return ("virtual",) if family.takes_virtual else ()


def _by_name() -> dict[str, Family]:
    """Every name a value may start with: each family's engine name and its own."""
    names = {f.engine: f for f in FAMILIES.values()}
    names.update({f.name: f for f in FAMILIES.values() if f.name not in names})
    return names


@dataclass(frozen=True)
class ScheduleSpec:
    """A parsed `pp_engine` value of one of pipeschedule's schedules.

    family     a `FAMILIES` name (`capped_1f1b`, `1f1b`, ...)
    virtual    chunks per rank, given where the family takes any (required there), else None
    cap        None (the family's default), an int for every rank, or one int per rank
    split      None (nanotron's cost-balanced split) or decoder layers per stage
    recompute  None, "full", "selective", or decoder layers recomputed per stage (an int
               for every stage, or one per stage)
    offload    None or the ranks whose stashes go to host memory; lead (computes) and
               stream (MiB) None (defaults) or integers, given only with offload
    """

    family: str
    virtual: int | None = None
    cap: int | tuple[int, ...] | None = None
    split: tuple[int, ...] | None = None
    recompute: str | int | tuple[int, ...] | None = None
    offload: tuple[int, ...] | None = None
    lead: int | None = None
    stream: int | None = None

    def __post_init__(self) -> None:
        reason = _invalid(self)
        if reason:
            raise ParameterError(f"{self!r}: {reason}")

    @property
    def record(self) -> Family:
        return FAMILIES[self.family]

    @property
    def name(self) -> str:
        """Its name in nanotron's config (`FAMILIES[family].engine`: `capped_1f1b`, `ps_1f1b`)."""
        return self.record.engine

    @property
    def chunks(self) -> int:
        """Chunks per rank it runs with: `virtual`, else the family's own."""
        return self.record.chunks(self.virtual)

    def cap_at(self, pp: int):
        """The cap it runs with at `pp` ranks: its own, else the family's default
        (capped_1f1b: ceil(pp/2)), else None (uncapped)."""
        if self.cap is not None or self.record.default_cap is None:
            return self.cap
        return self.record.default_cap(pp)

    def placement(self, pp: int) -> list[int]:
        """The rank of each of its pp * chunks stages (the family's placement)."""
        return list(self.record.placement(pp, self.chunks))

    def params(self) -> dict[str, Any]:
        """The parameters that are set, in canonical order."""
        return {key: getattr(self, key) for key in PARAM_ORDER if getattr(self, key) is not None}

    def to_string(self) -> str:
        """The canonical string form; `parse_spec(spec.to_string()) == spec`."""
        parts = [f"{key}={_text(value)}" for key, value in self.params().items()]
        return self.name + (":" + ",".join(parts) if parts else "")

    def to_mapping(self) -> dict[str, Any]:
        """The mapping form (lists as lists); `parse_spec(spec.to_mapping()) == spec`."""
        return {"name": self.name} | {k: list(v) if isinstance(v, tuple) else v for k, v in self.params().items()}

    def __str__(self) -> str:
        return self.to_string()

    def offload_policy(self) -> OffloadPolicy | None:
        """The `OffloadPolicy` of offload / lead / stream (None: no offload)."""
        if self.offload is None:
            return None
        chunk = None if self.stream is None else self.stream * 2**20
        return OffloadPolicy(1.0, self.offload, 1 if self.lead is None else self.lead, chunk)

    @property
    def offload_chunk(self) -> int | None:
        """Bytes per chunk of streamed offload (None: stashes move whole)."""
        return None if self.stream is None else self.stream * 2**20

    def check_against(self, *, pp: int, num_layers: int | None = None) -> None:
        """The parameters that depend on the run: per-rank cap and per-stage split and
        recompute lengths, the split's sum against `num_layers` (where given), the
        offload ranks. Raises ParameterError naming the value and the numbers."""
        stages = pp * self.chunks
        if self.offload is not None and max(self.offload) >= pp:
            raise ParameterError(f"pp_engine {self.to_string()!r}: offload names rank {max(self.offload)} but "
                                 f"pp = {pp} (ranks 0..{pp - 1})")
        if isinstance(self.cap, tuple) and len(self.cap) != pp:
            raise ParameterError(f"pp_engine {self.to_string()!r}: cap lists {len(self.cap)} ranks but pp = {pp}; "
                                 "give one cap per rank or a single integer")
        if isinstance(self.recompute, tuple) and len(self.recompute) != stages:
            raise ParameterError(
                f"pp_engine {self.to_string()!r}: recompute lists {len(self.recompute)} stages but pp * virtual = "
                f"{pp} * {self.chunks} = {stages}; give one count per stage, one integer for every stage, full or "
                "selective")
        if self.split is not None:
            if len(self.split) != stages:
                raise ParameterError(f"pp_engine {self.to_string()!r}: split lists {len(self.split)} stages but "
                                     f"pp * virtual = {pp} * {self.chunks} = {stages}")
            if num_layers is not None and sum(self.split) != num_layers:
                raise ParameterError(
                    f"pp_engine {self.to_string()!r}: split places {'+'.join(map(str, self.split))} = "
                    f"{sum(self.split)} decoder layers but the model has {num_layers}")

    def compile(self, *, pp: int, microbatches: int, cost=None):
        """`compile_spec(self, pp=, microbatches=, cost=)`."""
        return compile_spec(self, pp=pp, microbatches=microbatches, cost=cost)


@dataclass(frozen=True)
class AutoSpec:
    """`auto[:reserve=GiB]`: the engine chosen at the first step; `reserve` GiB of the GPU
    kept back (None: the engine's default)."""

    reserve: int | None = None

    def __post_init__(self) -> None:
        if self.reserve is not None and not (is_int(self.reserve) and self.reserve >= 0):
            raise ParameterError(f"{self!r}: reserve is GiB kept back, an integer >= 0, got {shown(self.reserve)}")

    name = AUTO
    family = "capped_1f1b"  # its first step's; the layout is 1F1B's

    def params(self) -> dict[str, Any]:
        return {} if self.reserve is None else {"reserve": self.reserve}

    def to_string(self) -> str:
        return AUTO + ("" if self.reserve is None else f":reserve={self.reserve}")

    def to_mapping(self) -> dict[str, Any]:
        return {"name": AUTO} | self.params()

    def __str__(self) -> str:
        return self.to_string()


@dataclass(frozen=True)
class ForeignSpec:
    """A name the caller runs itself (`parse_spec(..., foreign=)`: nanotron's own `1f1b`
    and `afab` for its adapter); no parameters."""

    name: str

    def params(self) -> dict[str, Any]:
        return {}

    def to_string(self) -> str:
        return self.name

    def to_mapping(self) -> dict[str, Any]:
        return {"name": self.name}

    def __str__(self) -> str:
        return self.name


Spec = ScheduleSpec | AutoSpec | ForeignSpec


def parse_spec(value: Any, *, foreign: tuple[str, ...] = (), foreign_words: str = "", given: Mapping | None = None,
               shown_as: str | None = None) -> Spec:
    """Parse a `pp_engine` value (string or mapping form); raises ParameterError naming the
    value, the reason and what is accepted. `foreign`: names the caller runs itself
    (returned as `ForeignSpec`; they take no parameters and are described in messages as
    `foreign_words`, e.g. "nanotron's own"). `given`: parameters given beside the value
    (the command line's --virtual, --cap), as text; one the value gives too is refused
    unless both agree. `shown_as`: how messages show the value (default: `pp_engine VALUE`)."""
    def error(reason: str, kind: type[ParameterError] = ParameterError, accepted: bool = False) -> ParameterError:
        return spec_error(value, reason, foreign, foreign_words, kind, shown_as, accepted=accepted)

    if isinstance(value, str):
        name, raw = _split_string(value, error)
    elif isinstance(value, Mapping):
        name, raw = _split_mapping(value, error)
    else:
        raise error(f"expected a string or a mapping, got {type(value).__name__}", accepted=True)
    for key, text in (given or {}).items():
        if key in raw and str(raw[key]).replace(",", "/") != str(text).replace(",", "/"):
            raise error(f"{key} given twice: {key}={raw[key]} in the value and {text} beside it")
        raw[key] = text

    if name in foreign:
        if raw:
            own = _by_name().get(name)
            hint = f"; for pipeschedule's engine of that schedule write {own.engine}" if own is not None else ""
            raise error(f"{foreign_words or 'the'} {name!r} takes no parameters (got {', '.join(raw)}){hint}")
        return ForeignSpec(name)
    if name == AUTO:
        unknown = [key for key in raw if key != "reserve"]
        if unknown:
            raise error(f"unknown parameter {unknown[0]!r} for auto; auto accepts: reserve (GiB)")
        reserve = _integer(error, "reserve", raw["reserve"]) if "reserve" in raw else None
        if reserve is not None and reserve < 0:
            raise error(f"reserve is GiB kept back, an integer >= 0, got {reserve}")
        return AutoSpec(reserve)
    family = _by_name().get(name)
    if family is None:
        known = (*foreign, *_by_name(), AUTO)
        raise error(f"unknown engine {shown(name)}{_closest(name, known)}", accepted=True)
    accepted = family_params(family)
    unknown = [key for key in raw if key not in accepted]
    if unknown:
        raise error(f"unknown parameter {unknown[0]!r} for {name}; {name} accepts: {', '.join(accepted)}"
                    + _closest(unknown[0], accepted))
    missing = [key for key in family_required(family) if key not in raw]
    if missing:
        raise error(f"{name} needs {missing[0]}=N (the model chunks per rank; 1 is 1F1B's order)")
    values = {key: _convert(error, key, raw[key]) for key in raw}
    loose = [key for key in ("lead", "stream") if key in values and "offload" not in values]
    if loose:
        raise error(f"{loose[0]} applies to offloaded stashes: give offload=RANKS too (e.g. offload=0)")
    return ScheduleSpec(family.name, **values)


def value_name(value: Any) -> str | None:
    """The name a value starts with (`capped_1f1b` of `capped_1f1b:cap=2` or of
    {name: capped_1f1b}), or None where it has none."""
    if isinstance(value, str):
        return value.strip().partition(":")[0].strip()
    if isinstance(value, Mapping) and isinstance(value.get("name"), str):
        return value["name"].strip()
    return None


def family_of(name: str) -> Family | None:
    """The family a value's name means (its engine name or its own), or None."""
    return _by_name().get(name)


def accepted_summary(foreign: tuple[str, ...] = (), foreign_words: str = "") -> str:
    """One line listing every accepted value, for error messages."""
    syntax = {"virtual": "virtual=V", "cap": "cap=N|N0/N1/...", "split": "split=A/B/..."}
    usages = []
    for family in FAMILIES.values():
        own = [key for key in family_params(family) if key in syntax]
        required = family_required(family)
        optional = ",".join(syntax[key] for key in own if key not in required)
        if required:
            usages.append(f"{family.engine}:{','.join(syntax[key] for key in required)}[,{optional}]")
        else:
            usages.append(f"{family.engine}[:{optional}]")
    theirs = f"{', '.join(foreign)} ({foreign_words} engines, no parameters); " if foreign else ""
    return (f"{theirs}{'; '.join(usages)} (pipeschedule, each also taking recompute=full|selective|N|N0/N1.. and "
            "offload=R0/R1..[,lead=L][,stream=MiB]); auto[:reserve=GiB] (the fastest of 1F1B, capped 1F1B and 1F1B "
            "with host offload that fits, chosen at the first step); or the mapping form {name: capped_1f1b, cap: 2}")


def spec_error(value: Any, reason: str, foreign: tuple[str, ...] = (), foreign_words: str = "",
               kind: type[ParameterError] = ParameterError, shown_as: str | None = None, *,
               accepted: bool = True) -> ParameterError:
    """The refusal of a value: the value, the reason and, where the name or the form is at
    fault (`accepted`), every value accepted (a parameter's refusal names its own rule)."""
    where = shown_as or f"pp_engine {repr(value) if len(repr(value)) <= 200 else shown(value)}"
    listed = f". Accepted: {accepted_summary(foreign, foreign_words)}" if accepted else ""
    return kind(f"{where}: {reason}{listed}")


# -- compiling ---------------------------------------------------------------------------------


def compile_spec(spec: ScheduleSpec, *, pp: int, microbatches: int, cost=None, check: bool = True):
    """The lowered, verified schedule `spec` runs at (pp, m): its family's order with its
    chunks and cap (the family's defaults where it leaves them out), lowered under `cost`
    (None: unit costs; [Note: cost-aware timing]), with its OFFLOAD / RELOAD where it
    offloads. Raises ParameterError for a value that does not fit pp (`check_against`)."""
    if not isinstance(spec, ScheduleSpec):
        raise ParameterError(f"compile_spec takes a ScheduleSpec, got {shown(spec)}")
    spec.check_against(pp=pp)
    order = generate(spec.family, pp=pp, microbatches=microbatches, virtual=spec.virtual, cap=spec.cap_at(pp),
                     cost=cost)
    schedule = lower(order, cost)
    policy = spec.offload_policy()
    if policy is not None:
        schedule = add_offload(schedule, policy)
    if check:
        verify(schedule)
    return schedule


def inflight_peaks(order) -> list[int]:
    """Per rank, the most (stage, microbatch) pairs whose F has run and B has not (rule 6's
    count, stage-microbatches), read from a compute order or a lowered schedule."""
    peaks = []
    for program in order.programs:
        live = high = 0
        for instr in program:
            op = instr.op.value if hasattr(instr.op, "value") else instr.op
            if op == "F":
                live += 1
                high = max(high, live)
            elif op == "B":
                live -= 1
        peaks.append(high)
    return peaks


def unbound_cap(spec: ScheduleSpec, *, pp: int, microbatches: int) -> str | None:
    """One line where `spec` gives a cap that binds on no rank at (pp, m) (its schedule is
    then the family's uncapped order); None where it binds somewhere or gives none. The
    uncapped peak is the family's order with a cap no rank can reach (chunks * m)."""
    if spec.cap is None or not spec.record.takes_cap:
        return None
    caps = per_rank_caps(list(spec.cap) if isinstance(spec.cap, tuple) else spec.cap, pp)
    free = inflight_peaks(generate(spec.family, pp=pp, microbatches=microbatches, virtual=spec.virtual,
                                   cap=spec.chunks * microbatches))
    if any(peak > cap for peak, cap in zip(free, caps)):
        return None
    unit = inflight_unit(spec.chunks)
    return (f"cap {_text(spec.cap)} binds on no rank: {spec.name} at pp={pp}, m={microbatches} holds at most "
            f"{_text(tuple(free))} {unit} in flight per rank without it, so it runs the uncapped order (a cap binds "
            f"where it is below a rank's count)")


def inflight_unit(chunks: int) -> str:
    """The unit of an in-flight count: microbatches where a rank runs one stage, else
    stage-microbatches (a rank's `chunks` stages each count)."""
    return "microbatches" if chunks == 1 else f"stage-microbatches ({chunks} stages a rank)"


# -- reading -----------------------------------------------------------------------------------


def _closest(name: str, known) -> str:
    """` (did you mean NAME?)` for the known name closest to a mistyped one (in any case),
    if one is close (difflib's ratio at least 0.6); where the typo begins two or three known
    names (`interleaved`, `zb_h`), all of them (`interleaved_1f1b or interleaved_zb`); else
    nothing."""
    by_folded = {k.lower(): k for k in known}
    folded = name.lower()
    starting = [k for f, k in by_folded.items() if f.startswith(folded) and f != folded] if folded else []
    if 2 <= len(starting) <= 3:
        return f" (did you mean {' or '.join(starting)}?)"
    close = difflib.get_close_matches(folded, list(by_folded), n=1)
    return f" (did you mean {by_folded[close[0]]}?)" if close else ""


def _split_string(value: str, error) -> tuple[str, dict[str, Any]]:
    name, sep, rest = value.strip().partition(":")
    name = name.strip()
    raw: dict[str, Any] = {}
    if sep:
        if not rest.strip():
            raise error("nothing after ':'; write NAME or NAME:KEY=VALUE[,KEY=VALUE]", accepted=True)
        for item in rest.split(","):
            key, eq, text = item.partition("=")
            key = key.strip()
            if not eq and key.isdigit() and raw:  # cap=4,3,2,1: a list joined as the command line may join it
                last = next(reversed(raw))
                raise error(f"cannot read parameter {item.strip()!r}: in the string form ',' separates "
                            f"parameters, so a list is joined with '/' ({last}=4/3/2/1)")
            if not eq or not key:
                raise error(f"cannot read parameter {item.strip()!r}; expected KEY=VALUE")
            if key in raw:
                raise error(f"parameter {key!r} given twice")
            raw[key] = text.strip()
    return name, raw


def _split_mapping(value: Mapping, error) -> tuple[str, dict[str, Any]]:
    if "name" not in value:
        raise error("the mapping form needs a 'name' key", accepted=True)
    name = value["name"]
    if not isinstance(name, str):
        raise error(f"name must be a string, got {shown(name)}", accepted=True)
    raw = {key: item for key, item in value.items() if key != "name"}
    for key in raw:
        if not isinstance(key, str):
            raise error(f"parameter names must be strings, got {key!r}")
    return name.strip(), raw


def _convert(error, key: str, raw: Any) -> Any:
    """One parameter's value, read and checked; `error(reason)` makes the refusal."""
    if key == "virtual":
        number = _integer(error, key, raw)
        if not 1 <= number <= MAX_LAYERS:  # each chunk needs a decoder layer (1e6 printed a 30 MB line, 1e8 hung)
            raise error(f"virtual must be an integer in 1..{MAX_LAYERS} (each chunk holds a decoder layer), "
                        f"got {shown(raw)}")
        return number
    if key in ("lead", "stream"):
        number = _integer(error, key, raw)
        least = 0 if key == "lead" else 1
        if number < least:
            what = "computes" if key == "lead" else "MiB per chunk"
            raise error(f"{key} must be an integer >= {least} ({what}), got {raw!r}")
        return number
    if key == "recompute":
        if isinstance(raw, str) and raw.strip() in RECOMPUTE_MODES:
            return raw.strip()
        try:
            items = _integers(error, key, raw)
        except TooManyDigits:
            raise  # its own reason: the mode list below would hide it
        except ParameterError:
            items = [-1]
        if any(n < 0 for n in items):
            raise error(f"recompute must be full, selective, or decoder layers per stage (integers >= 0), got {raw!r}")
        return items[0] if len(items) == 1 else tuple(items)
    items = _integers(error, key, raw)
    if key == "offload":
        if any(r < 0 for r in items) or len(set(items)) != len(items):
            raise error(f"offload must list distinct ranks >= 0 (0 or 0/1), got {raw!r}")
        return tuple(items)
    if key == "cap":
        if any(c < 1 for c in items):
            raise error(f"cap must be an integer >= 1 (or one per rank, as 4/3/2/1), got {raw!r}")
        return items[0] if len(items) == 1 else tuple(items)  # one entry means every rank
    if key == "split":
        if any(n < 0 for n in items) or sum(items) < 1:
            raise error(f"split must list decoder layers per stage (integers >= 0, at least one layer), got {raw!r}")
        return tuple(items)
    raise ParameterError(f"no reader for parameter {key!r}: family_params and PARAM_ORDER disagree")


def _integer(error, key: str, raw: Any) -> int:
    """An integer parameter, written as text or (the mapping form) as a YAML integer; at
    most MAX_DIGITS digits either way ([Note: size limits]), parse_int's reason kept."""
    if is_int(raw):
        if abs(raw) >= 10 ** MAX_DIGITS:
            raise error(f"{key} has more than {MAX_DIGITS} digits, got {shown(raw)}; at most {MAX_DIGITS} are "
                        "accepted", TooManyDigits)
        return raw
    if isinstance(raw, str):
        try:
            return parse_int(raw, key)  # ASCII digits, as everywhere ([Note: size limits])
        except ParameterError as err:
            raise error(str(err), type(err)) from None  # (TooManyDigits stays itself)
    raise error(f"{key} must be an integer, got {shown(raw)}")


def _integers(error, key: str, raw: Any) -> list[int]:
    if isinstance(raw, (list, tuple)):
        if not raw:
            raise error(f"{key} is an empty list")
        return [_integer(error, key, item) for item in raw]
    used = [sep for sep in LIST_SEPARATORS if isinstance(raw, str) and sep in raw]
    if len(used) > 1:
        raise error(f"{key} joins its integers with one of / and , (4/3/2/1 or 4,3,2,1), got {raw!r}")
    if used:  # `,` reaches here from the mapping form only: in the string form it separates parameters
        return [_integer(error, key, item) for item in raw.split(used[0])]
    return [_integer(error, key, raw)]


def _text(value: Any) -> str:
    return "/".join(str(v) for v in value) if isinstance(value, tuple) else str(value)


# -- the checks of a value built in Python ------------------------------------------------------


def _ints(value, least: int) -> bool:
    return isinstance(value, tuple) and len(value) > 0 and all(is_int(v) and v >= least for v in value)


def _invalid(spec: ScheduleSpec) -> str | None:
    """Why `spec` is no value of the grammar, or None: the checks `parse_spec` makes of
    text, made of a value built in Python, so that both hold the same values."""
    family = FAMILIES.get(spec.family) if isinstance(spec.family, str) else None
    if family is None:
        return f"unknown family {shown(spec.family)}; accepted: {', '.join(FAMILIES)}"
    if family.takes_virtual:
        if spec.virtual is None:
            return f"{spec.family} needs virtual (the model chunks per rank; 1 is 1F1B's order)"
        if not (is_int(spec.virtual) and 1 <= spec.virtual <= MAX_LAYERS):
            return f"virtual must be an integer in 1..{MAX_LAYERS}, got {shown(spec.virtual)}"
    elif spec.virtual is not None:
        fixed = (f"places exactly {family.chunks()} stages on each rank" if family.chunks() > 1
                 else "runs one stage a rank")
        return f"{spec.family} {fixed} and takes no virtual, got virtual={shown(spec.virtual)}"
    if spec.cap is not None:
        if not family.takes_cap:
            return f"{spec.family} takes no cap, got cap={shown(spec.cap)}"
        if not ((is_int(spec.cap) and spec.cap >= 1) or (_ints(spec.cap, 1) and len(spec.cap) > 1)):
            return f"cap must be an integer >= 1 or a tuple of several, got {shown(spec.cap)}"
    if spec.split is not None and not (_ints(spec.split, 0) and sum(spec.split) >= 1):
        return (f"split must be a tuple of decoder layers per stage (integers >= 0, at least one), "
                f"got {shown(spec.split)}")
    recompute = spec.recompute
    if recompute is not None and not (recompute in RECOMPUTE_MODES or (is_int(recompute) and recompute >= 0)
                                      or (_ints(recompute, 0) and len(recompute) > 1)):
        return f"recompute must be full, selective, an integer >= 0 or a tuple of several, got {shown(recompute)}"
    if spec.offload is not None and not (_ints(spec.offload, 0) and len(set(spec.offload)) == len(spec.offload)):
        return f"offload must be a tuple of distinct ranks >= 0, got {shown(spec.offload)}"
    for key, least in (("lead", 0), ("stream", 1)):
        value = getattr(spec, key)
        if value is not None and not (is_int(value) and value >= least):
            return f"{key} must be an integer >= {least}, got {shown(value)}"
        if value is not None and spec.offload is None:
            return f"{key} applies to offloaded stashes: give offload too"
    return None


__all__ = ["AUTO", "COMMON_PARAMS", "PARAM_ORDER", "RECOMPUTE_MODES", "AutoSpec", "ForeignSpec", "ScheduleSpec",
           "Spec", "accepted_summary", "compile_spec", "family_params", "family_required", "inflight_peaks",
           "inflight_unit", "family_of", "parse_spec", "spec_error", "unbound_cap", "value_name"]
