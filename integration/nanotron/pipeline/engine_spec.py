"""`parallelism.pp_engine` values: what a user may write, parsed into an `EngineSpec`.

[Note: pp_engine syntax] nanotron parses its config with dacite `strict=True`, so an
extra key next to `pp_engine` fails; an engine's parameters travel inside the value.
Two forms are accepted, and both load to the same `EngineSpec`:

    pp_engine: capped_1f1b:cap=2,split=19/21/21/19          # string form
    pp_engine: {name: capped_1f1b, cap: 2, split: [19, 21, 21, 19]}   # mapping form

Grammar of the string form: `NAME[:KEY=VALUE[,KEY=VALUE]...]`; a VALUE is an integer or
a list of integers joined by `/` (`cap=4/3/2/1`; `,` separates parameters, so a list
cannot be joined by it here; a string of the mapping form, like the command line's
`--cap`, takes `4,3,2,1` too: [Note: list syntax] in pipeschedule/checks.py). No spaces or quotes are needed, so the
value survives YAML unquoted (a `:` not followed by a space does not start a mapping)
and `yaml.dump` writes it back as a plain string. In the mapping form a list may also be
a YAML list.

Which engine runs:

    afab, 1f1b            nanotron's own engines, unchanged; they take no parameters
    ps_afab, ps_1f1b      pipeschedule's engine running the same schedules
    capped_1f1b           pipeschedule; cap (default ceil(pp/2)), split
    interleaved_1f1b      pipeschedule; virtual (required), cap, split
    zb_h1                 pipeschedule, split backward (B, then W); cap, split
    zbv, v_half, v_min    pipeschedule, split backward, V-shape placement (rank r runs
                          stages r and 2pp-1-r); cap (stage-microbatches, >= 2), split
    zb_h2, dualpipev      pipeschedule, split backward (dualpipev: V shape); cap, split
    interleaved_zb        pipeschedule, split backward, round robin; virtual (required), cap, split
    looped_bfs            pipeschedule, round robin; virtual (required), split

`1f1b` and `afab` keep meaning nanotron's engines so that every existing config keeps
its meaning; pipeschedule's versions carry the `ps_` prefix. Parameters:

    cap      in-flight microbatches per rank: one integer >= 1 for every rank, or one
             per rank (`4/3/2/1`); clipped as the generator documents
    virtual  model chunks per rank (interleaved only), integer >= 1
    split    decoder layers per stage, pp * virtual integers >= 0 in stage order (2pp for
             the V-shape engines); the embedding sits on stage 0, the final norm, LM
             head and loss on the last
    recompute  activation recomputation: `full` (every decoder layer keeps only its input
             and recomputes its forward in B), `N` (the first N decoder layers of every
             stage) or `N0/N1/...` (per stage), or `selective` (nanotron's own
             recomputation of the attention core, `CoreAttention.checkpoint_attention`);
             integration/nanotron/pipeline/recompute.py
    offload  ranks (`0` or `0/1`) whose stashes all go to host memory between their F
             and their B (`pipeschedule.compiler.offload.add_offload`, fraction 1; stashes whose
             wait is at most `lead` computes stay)
    lead     computes between a RELOAD and the B that needs it, integer >= 0 (default 1;
             needs offload)
    stream   MiB: stream the offloaded stashes in chunks of this size while F saves them
             and B consumes them, instead of moving each whole ([Note: streamed offload]
             in pipeschedule/runtime/stream_offload.py); integer >= 1, needs offload

Saving writes the canonical string form (`EngineSpec.to_string()`): keys in the order
virtual, cap, split, recompute, offload, lead, stream, defaults left out.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Mapping

from integration.nanotron.pipeline.registry import AUTO_ENGINE, ENGINES, NANOTRON_ENGINES, accepted_summary
from pipeschedule.checks import LIST_SEPARATORS, MAX_DIGITS, MAX_LAYERS, TooManyDigits, is_int, parse_int, shown
from pipeschedule.compiler.families import family_virtual
from pipeschedule.compiler.offload import OffloadPolicy
from pipeschedule.errors import ParameterError

PARAM_ORDER = ("virtual", "cap", "split", "recompute", "offload", "lead", "stream", "reserve")
RECOMPUTE_MODES = ("full", "selective")


@dataclass(frozen=True)
class EngineSpec:
    """A parsed `pp_engine` value. `name` is the config name (`capped_1f1b`, `1f1b`, ...).

    `cap` is None (the engine's default), an int, or a tuple with one int per rank;
    `virtual` is None except for interleaved engines; `split` is None (nanotron's
    cost-balanced split) or decoder layers per stage; `recompute` None, "full",
    "selective", or decoder layers recomputed per stage (an int for every stage, or one
    per stage); `offload` None or the ranks that
    offload their stashes, `lead` and `stream` (MiB) None (defaults) or integers.
    """

    name: str
    cap: int | tuple[int, ...] | None = None
    virtual: int | None = None
    split: tuple[int, ...] | None = None
    recompute: str | int | tuple[int, ...] | None = None
    offload: tuple[int, ...] | None = None
    lead: int | None = None
    stream: int | None = None
    reserve: int | None = None  # auto only: GiB of the GPU kept back (default 2)

    @property
    def is_nanotron_builtin(self) -> bool:
        return self.name in NANOTRON_ENGINES

    @property
    def family(self) -> str:
        """The pipeschedule generator family (`pipeschedule.compiler.families.FAMILIES`)."""
        if self.is_nanotron_builtin:
            return self.name
        if self.name == AUTO_ENGINE:
            return "capped_1f1b"  # its first step; the layout is 1F1B's
        return ENGINES[self.name].family

    def params(self) -> dict[str, Any]:
        """The parameters that are set, in canonical order."""
        return {key: getattr(self, key) for key in PARAM_ORDER if getattr(self, key) is not None}

    def to_string(self) -> str:
        """The canonical string form; `parse_engine(spec.to_string()) == spec`."""
        parts = [f"{key}={_format_value(value)}" for key, value in self.params().items()]
        return self.name + (":" + ",".join(parts) if parts else "")

    def offload_policy(self):
        """The `pipeschedule.compiler.offload.OffloadPolicy` of `offload` / `lead` (None: no offload)."""
        if self.offload is None:
            return None

        return OffloadPolicy(1.0, self.offload, 1 if self.lead is None else self.lead)

    @property
    def offload_chunk(self) -> int | None:
        """Bytes per chunk of streamed offload (None: stashes move whole)."""
        return None if self.stream is None else self.stream * 2**20

    def check_against(self, *, pp: int, num_layers: int | None = None, virtual: int | None = None) -> None:
        """Check the parameters that depend on the run: cap list and split lengths, split
        sum, offload ranks, several chunks per rank at pp = 1.

        Engines call this once they know pp (config load does not: dacite builds
        `pp_engine` before the rest of `parallelism`).
        """
        if self.offload is not None and max(self.offload) >= pp:
            raise ParameterError(
                f"pp_engine {self.to_string()!r}: offload names rank {max(self.offload)} but pp = {pp} "
                f"(ranks 0..{pp - 1})"
            )
        if virtual is None:
            virtual = 1 if self.is_nanotron_builtin else family_virtual(self.family, self.virtual)
        if pp == 1 and virtual > 1:
            raise ParameterError(
                f"pp_engine {self.to_string()!r} runs {virtual} model chunks per rank, which this adapter does not "
                f"run at pp = 1 (one rank holds every chunk, and the data loader's tensors reach each chunk directly "
                f"instead of through the stage before: the first step stopped with an internal error); at pp = 1 "
                f"use ps_1f1b, capped_1f1b or nanotron's own 1f1b"
            )
        if isinstance(self.recompute, tuple) and len(self.recompute) != pp * virtual:
            raise ParameterError(
                f"pp_engine {self.to_string()!r}: recompute lists {len(self.recompute)} stages but "
                f"pp * virtual = {pp} * {virtual} = {pp * virtual}; give one count per stage, one integer for "
                f"every stage, full or selective"
            )
        if isinstance(self.cap, tuple) and len(self.cap) != pp:
            raise ParameterError(
                f"pp_engine {self.to_string()!r}: cap lists {len(self.cap)} ranks but pp = {pp}; "
                "give one cap per rank or a single integer"
            )
        if self.split is not None:
            stages = pp * virtual
            if len(self.split) != stages:
                raise ParameterError(
                    f"pp_engine {self.to_string()!r}: split lists {len(self.split)} stages but "
                    f"pp * virtual = {pp} * {virtual} = {stages}"
                )
            if num_layers is not None and sum(self.split) != num_layers:
                raise ParameterError(
                    f"pp_engine {self.to_string()!r}: split places {'+'.join(map(str, self.split))} = "
                    f"{sum(self.split)} decoder layers but the model has {num_layers}"
                )


def parse_engine(value: Any) -> EngineSpec:
    """Parse a `pp_engine` value (string or mapping form); raises ParameterError (a ValueError).

    Every message names the offending value and lists what is accepted.
    """
    if isinstance(value, str):
        name, raw = _split_string(value)
    elif isinstance(value, Mapping):
        name, raw = _split_mapping(value)
    else:
        raise _error(value, f"expected a string or a mapping, got {type(value).__name__}")
    if name in NANOTRON_ENGINES:
        if raw:
            raise _error(
                value,
                f"nanotron's own {name!r} takes no parameters (got {', '.join(raw)}); "
                f"for pipeschedule's engine write ps_{name}",
            )
        return EngineSpec(name)
    if name == AUTO_ENGINE:
        unknown = [key for key in raw if key != "reserve"]
        if unknown:
            raise _error(value, f"unknown parameter {unknown[0]!r} for auto; auto accepts: reserve (GiB)")
        reserve = _integer(value, "reserve", raw["reserve"]) if "reserve" in raw else None
        if reserve is not None and reserve < 0:
            raise _error(value, f"reserve is GiB kept back, an integer >= 0, got {reserve}")
        return EngineSpec(name, reserve=reserve)
    entry = ENGINES.get(name)
    if entry is None:
        raise _error(value, f"unknown engine {name!r}{_closest(name, (*NANOTRON_ENGINES, *ENGINES, AUTO_ENGINE))}")
    unknown = [key for key in raw if key not in entry.params]
    if unknown:
        raise _error(
            value,
            f"unknown parameter {unknown[0]!r} for {name}; {name} accepts: "
            + (", ".join(entry.params) if entry.params else "no parameters") + _closest(unknown[0], entry.params),
        )
    missing = [key for key in entry.required if key not in raw]
    if missing:
        raise _error(value, f"{name} needs {missing[0]}=N")
    values = {key: _convert(value, key, raw[key]) for key in raw}
    loose = [key for key in ("lead", "stream") if key in values and "offload" not in values]
    if loose:
        raise _error(value, f"{loose[0]} applies to offloaded stashes: give offload=RANKS too (e.g. offload=0)")
    return EngineSpec(name, **values)


# -- helpers ---------------------------------------------------------------------------


def _error(value: Any, reason: str, kind: type[ParameterError] = ParameterError) -> ParameterError:
    return kind(f"pp_engine {value!r}: {reason}. Accepted: {accepted_summary()}")


def _closest(name: str, known) -> str:
    """` (did you mean NAME?)` for the known name closest to a mistyped one (in any case),
    if one is close (difflib's ratio at least 0.6); else nothing."""
    by_folded = {k.lower(): k for k in known}
    close = difflib.get_close_matches(name.lower(), list(by_folded), n=1)
    return f" (did you mean {by_folded[close[0]]}?)" if close else ""


def _split_string(value: str) -> tuple[str, dict[str, Any]]:
    name, sep, rest = value.strip().partition(":")
    name = name.strip()
    raw: dict[str, Any] = {}
    if sep:
        if not rest.strip():
            raise _error(value, "nothing after ':'; write NAME or NAME:KEY=VALUE[,KEY=VALUE]")
        for item in rest.split(","):
            key, eq, text = item.partition("=")
            key = key.strip()
            if not eq and key.isdigit() and raw:  # cap=4,3,2,1: a list joined as the command line may join it
                last = next(reversed(raw))
                raise _error(value, f"cannot read parameter {item.strip()!r}: in the string form ',' separates "
                                    f"parameters, so a list is joined with '/' ({last}=4/3/2/1)")
            if not eq or not key:
                raise _error(value, f"cannot read parameter {item.strip()!r}; expected KEY=VALUE")
            if key in raw:
                raise _error(value, f"parameter {key!r} given twice")
            raw[key] = text.strip()
    return name, raw


def _split_mapping(value: Mapping) -> tuple[str, dict[str, Any]]:
    if "name" not in value:
        raise _error(dict(value), "the mapping form needs a 'name' key")
    name = value["name"]
    if not isinstance(name, str):
        raise _error(dict(value), f"name must be a string, got {name!r}")
    raw = {key: item for key, item in value.items() if key != "name"}
    for key in raw:
        if not isinstance(key, str):
            raise _error(dict(value), f"parameter names must be strings, got {key!r}")
    return name.strip(), raw


def _convert(value: Any, key: str, raw: Any) -> Any:
    """One parameter's value, checked; `value` is the whole pp_engine value for messages."""
    if key == "virtual":
        number = _integer(value, key, raw)
        if not 1 <= number <= MAX_LAYERS:  # each chunk needs a decoder layer (1e6 printed a 30 MB line, 1e8 hung)
            raise _error(value, f"virtual must be an integer in 1..{MAX_LAYERS} (each chunk holds a decoder layer), "
                                f"got {shown(raw)}")
        return number
    if key in ("lead", "stream"):
        number = _integer(value, key, raw)
        least = 0 if key == "lead" else 1
        if number < least:
            what = "computes" if key == "lead" else "MiB per chunk"
            raise _error(value, f"{key} must be an integer >= {least} ({what}), got {raw!r}")
        return number
    if key == "recompute":
        if isinstance(raw, str) and raw.strip() in RECOMPUTE_MODES:
            return raw.strip()
        try:
            items = _integers(value, key, raw)
        except TooManyDigits:
            raise  # its own reason: the mode list below would hide it
        except ParameterError:
            items = [-1]
        if any(n < 0 for n in items):
            raise _error(value, f"recompute must be full, selective, or decoder layers per stage (integers >= 0), "
                                f"got {raw!r}")
        return items[0] if len(items) == 1 else tuple(items)
    items = _integers(value, key, raw)
    if key == "offload":
        if any(r < 0 for r in items) or len(set(items)) != len(items):
            raise _error(value, f"offload must list distinct ranks >= 0 (0 or 0/1), got {raw!r}")
        return tuple(items)
    if key == "cap":
        if any(c < 1 for c in items):
            raise _error(value, f"cap must be an integer >= 1 (or one per rank, as 4/3/2/1), got {raw!r}")
        return items[0] if len(items) == 1 else tuple(items)  # one entry means every rank
    if key == "split":
        if any(n < 0 for n in items) or sum(items) < 1:
            raise _error(
                value, f"split must list decoder layers per stage (integers >= 0, at least one layer), got {raw!r}"
            )
        return tuple(items)
    raise ParameterError(f"no converter for parameter {key!r}: the registry and PARAM_ORDER disagree")


def _integer(value: Any, key: str, raw: Any) -> int:
    """An integer parameter, written as text or (the mapping form) as a YAML integer; at
    most MAX_DIGITS digits either way ([Note: size limits]), parse_int's reason kept."""
    if is_int(raw):
        if abs(raw) >= 10 ** MAX_DIGITS:
            raise _error(value, f"{key} has more than {MAX_DIGITS} digits, got {shown(raw)}; at most {MAX_DIGITS} "
                                f"are accepted", TooManyDigits)
        return raw
    if isinstance(raw, str):
        try:
            return parse_int(raw, key)  # ASCII digits, as everywhere ([Note: size limits])
        except ParameterError as err:
            raise _error(value, str(err), type(err)) from None  # (TooManyDigits stays itself)
    raise _error(value, f"{key} must be an integer, got {shown(raw)}")


def _integers(value: Any, key: str, raw: Any) -> list[int]:
    if isinstance(raw, (list, tuple)):
        if not raw:
            raise _error(value, f"{key} is an empty list")
        return [_integer(value, key, item) for item in raw]
    used = [sep for sep in LIST_SEPARATORS if isinstance(raw, str) and sep in raw]
    if len(used) > 1:
        raise _error(value, f"{key} joins its integers with one of / and , (4/3/2/1 or 4,3,2,1), got {raw!r}")
    if used:  # `,` reaches here from the mapping form only: in the string form it separates parameters
        return [_integer(value, key, item) for item in raw.split(used[0])]
    return [_integer(value, key, raw)]


def _format_value(value: Any) -> str:
    if isinstance(value, tuple):
        return "/".join(str(v) for v in value)
    return str(value)
