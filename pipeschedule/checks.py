"""The checks of every argument, defined once: integers and finite numbers given from
Python (`is_int`, `is_number`, `is_finite`, `check_int`, `check_number`), numbers typed as text
(`parse_int`, `parse_number`, and `int_arg` / `number_arg` / `path_arg` for argparse), the sizes
pipeschedule accepts ([Note: size limits]), and `shown`, a bad value cut to a readable
length for messages.

[Note: size limits] Every limit here is chosen so that any input it accepts finishes
within 10 s on a 2-core machine, measured command by command at the largest accepted
input by `python -m benchmarks.limits` (benchmarks/results/limits.md), each command's
limit as high as that allows. Work and memory grow with the (stage, microbatch) pairs of
a schedule (about 11 lowered instructions each) and, beyond that, with its stages alone
(templates, tracks and messages per stage: 1F1B at pp=32768, m=1 took 7 s to compile;
v_min at 2**14 stages 8 s, its Chrome trace 9 s of CPU), so stages have a bound of their
own. Per command (seconds on 2 cores at the limit, benchmarks/results/limits.md of
2026-12-07):
- compile, verify, simulate, show: MAX_STAGE_MICROBATCHES pairs, MAX_STAGES stages: zbv
  compiled with --cost (its list schedule timed) took 6.3 s, to JSON, text and CSV at once
  4.6 s, v_min at 8192 stages 5.4 s, verify of zbv's text form 4.2 s, the 8192-rank
  timeline 5.7 s; at 2**17 pairs the first three took 8.0, 7.0 and 7.0 s of CPU on a busy
  machine, too near 10 s (interleaved 1F1B at pp=64, v=2, m=512 is 65,536 pairs: 1.6 s to
  compile);
- a Chrome trace (`simulate --trace`, an event per instruction and tracks per rank) and a
  PNG (`simulate --png`, a bar per compute) cost more per pair: MAX_TRACE_STAGE_MICROBATCHES
  and MAX_PNG_STAGE_MICROBATCHES, at which the trace of v_min at 8192 stages took 6.4 s and
  the PNGs 4.2 s; a PNG draws every rank (MAX_PNG_RANKS);
- an ASCII timeline (`show`) holds ranks x cells of time, which grows as pp**2 (1F1B at
  pp=16384, 35 s of CPU for a 1.6 GB text), so it is bounded by its size
  (MAX_TIMELINE_CELLS; --width narrows it; a cell of a summary row costs about 1 us);
- `plan`: below.
The planner's work grows with its candidates times their size
and with the layers it splits times the stages, times the plans of its lever search (3
recompute modes, and 2 ZeRO stages where dp > 1) for each data-parallel size it compares.
Its split searches share one budget per run, PLAN_SEARCH_WORK nodes x layers x pp
([Note: plan search budget] in plan/splits.py; deterministic, no clock; a cut's columns
count as nodes). The plans of one run share their schedules and keep what they compute
([Note: run-wide memos] in plan/memo.py), and what remains grows with the plans times
their candidates (about one per pipeline rank: the caps of capped and interleaved 1F1B)
times each candidate's (stage, microbatch) pairs: MAX_PLAN_WORK bounds plans x pp x pp x
microbatches: the most plans each shape accepts finish within 7.7 s (benchmarks/results/
limits.md), while 12 plans at pp=12, m=85, 341 layers took 9.7 to 12 s and 21 at pp=16,
m=64 (--dp 1,2,4,8) 9.4 to 11.7 s.
Every entry point checks here, before it allocates or loops: the command line (its
parsers, `parse_int` and `parse_number`), `generate` and `compile_schedule`
(`check_common`), the loaders (`Schedule`, the CSV reader), the planner (`PlanConfig`,
`ModelSpec`, `TrainingSetup`), the streamed offload (`CostModel`), the offload search
(`choose_offload`: ranks x leads x 8 simulations, so it has a bound of its own), the
Chrome trace and PNG writers. A refusal is one line naming the value, the limit, the
arithmetic and what to change.
"""

from __future__ import annotations

import math
import re
from numbers import Real

from pipeschedule.errors import ArgumentError, ParameterError

MAX_STAGE_MICROBATCHES = 3 * 2**15  # pp * virtual * microbatches of one schedule: compile, verify, simulate, show
MAX_STAGES = 2**13  # pp * virtual of one schedule
MAX_TRACE_STAGE_MICROBATCHES = 3 * 2**14  # pairs of a schedule whose Chrome trace `simulate --trace` writes
MAX_PNG_STAGE_MICROBATCHES = 3 * 2**14  # pairs of a schedule one PNG draws (`simulate --png`)
MAX_PNG_RANKS = 256  # ranks one PNG draws (a row each)
MAX_TIMELINE_CELLS = 2**22  # characters of one ASCII timeline (`show`): ranks x cells of time
MAX_PLAN_STAGE_MICROBATCHES = 2**10  # pp * microbatches of a plan (it simulates ~50 candidates)
MAX_PLAN_LAYER_STAGES = 2**12  # layers * pp of a plan (its split search)
MAX_LAYERS = 1024  # decoder layers of a model
MAX_DIMENSION = 2**31  # any other size of a model or a setup: hidden, heads, vocab, seq, tp, dp, ...
MAX_SEARCH_NODES = 10**5  # the planner's search nodes per optimal split (5x the default; 10^6 took 1-2 min)
PLAN_SEARCH_WORK = 2**24  # split-search nodes x layers x pp of one `plan` run ([Note: plan search budget])
MAX_PLAN_DPS = 16  # data-parallel sizes one `plan` compares: each is a lever search of its own
MAX_PLAN_WORK = 2**17  # plans x pp x pp x microbatches of one `plan` run (8 plans at pp=16, m=64)
MAX_STREAM_PIECES = 4096  # pieces a streamed stash is cut into
MAX_OFFLOAD_SEARCH = 2**18  # (stage, microbatch) pairs simulated in all by one offload search (`choose_offload`)
MAX_SEARCH_PAIRS = 2**12  # (stage, microbatch) pairs of a `searched` schedule: it simulates each of its candidates
MAX_SEARCH_STAGES = 2**11  # stages of a `searched` schedule (its seeds are built per stage: pp=4096, m=1 took 7 s)
SEARCH_WORK = 2**18  # instructions the `searched` annealing times, in all (a start each on small orders: searched.py)
MAX_DIGITS = 18  # digits of an integer typed as text
MAX_SHOWN = 60  # characters of a bad value repeated in a message


def is_int(value) -> bool:
    """An int, not a bool (True is an int to Python, never a count here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A real number (int, float, Fraction, ...), not a bool and not NaN."""
    return isinstance(value, Real) and not isinstance(value, bool) and value == value


def is_finite(value) -> bool:
    """A number (`is_number`) whose float is finite: an int too large for a float (which
    compares below math.inf, but overflows once used with floats) is not."""
    try:
        return is_number(value) and math.isfinite(value)
    except OverflowError:
        return False


def finite_floats(values) -> bool:
    """Every value a float, finite and >= 0: what `check_number` accepts for floats,
    checked at C speed for the planner's long tuples (other numbers take the full check)."""
    return set(map(type, values)) == {float} and all(0.0 <= x < math.inf for x in values)


def check_int(name: str, value, minimum: int = 1, error=ParameterError) -> int:
    """`value` when it is an integer >= `minimum`; else raises `error` naming it."""
    if not is_int(value) or value < minimum:
        raise error(f"{name} must be an integer >= {minimum}, got {shown(value)}")
    return value


def check_number(name: str, value, minimum: float = 0, *, above: bool = False, hint: str = "",
                 error=ParameterError):
    """`value` when it is a finite number >= `minimum` (> with `above`); else raises
    `error` naming it, with `hint` (units, what 0 means) after the rule."""
    if not is_finite(value) or not (value > minimum if above else value >= minimum):
        rule = f"{'>' if above else '>='} {minimum:g}"
        raise error(f"{name} must be a finite number {rule}{hint}, got {shown(value)}")
    return value


def shown(value) -> str:
    """`repr(value)` cut to a readable length; an integer too long to print whole is
    given by its size."""
    if is_int(value) and value.bit_length() > 200:
        return f"an integer of about {int(value.bit_length() * math.log10(2))} digits"
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."


def check_schedule_size(pp: int, virtual: int, microbatches: int, error=ParameterError) -> None:
    """Refuses a schedule of more than MAX_STAGES stages or MAX_STAGE_MICROBATCHES
    (stage, microbatch) pairs; the counts are integers >= 1 (checked by the caller)."""
    stages = pp * virtual
    if stages > MAX_STAGES:
        raise error(f"pp * virtual = {_num(pp)} * {_num(virtual)} = {_num(stages)} stages; at most {MAX_STAGES} "
                    f"are accepted: give fewer ranks or chunks per rank")
    total = stages * microbatches
    if total > MAX_STAGE_MICROBATCHES:
        raise error(
            f"pp * virtual * microbatches = {_num(pp)} * {_num(virtual)} * {_num(microbatches)} = {_num(total)} "
            f"(stage, microbatch) pairs; at most {MAX_STAGE_MICROBATCHES} are accepted: give fewer microbatches"
            + (" or stages" if stages > 1 else "")
        )


def check_plan_size(pp: int, microbatches: int, layers: int) -> None:
    """Refuses a plan whose candidates or split search would run for minutes."""
    total = pp * microbatches
    if total > MAX_PLAN_STAGE_MICROBATCHES:
        raise ParameterError(
            f"plan: pp * microbatches = {_num(pp)} * {_num(microbatches)} = {_num(total)}; at most "
            f"{MAX_PLAN_STAGE_MICROBATCHES} are accepted (the planner simulates every candidate at that size)"
        )
    total = layers * pp
    if total > MAX_PLAN_LAYER_STAGES:
        raise ParameterError(
            f"plan: layers * pp = {_num(layers)} * {_num(pp)} = {_num(total)}; at most {MAX_PLAN_LAYER_STAGES} "
            f"are accepted (the split search grows with both)"
        )


def check_plan_run(plans: int, pp: int, microbatches: int) -> None:
    """Refuses a `plan` run whose plans together would run past the bound ([Note: size
    limits]): each plan simulates about one candidate per rank at pp x microbatches pairs."""
    total = plans * pp * pp * microbatches
    if total > MAX_PLAN_WORK:
        most = max(1, MAX_PLAN_WORK // (pp * pp * microbatches))
        raise ParameterError(
            f"plan: {_num(plans)} plans (one per data-parallel size, ZeRO stage and recompute mode) x pp * pp * "
            f"microbatches = {_num(plans)} * {_num(pp)} * {_num(pp)} * {_num(microbatches)} = {_num(total)}; at most "
            f"{MAX_PLAN_WORK} are accepted, {most} plan{'s' if most > 1 else ''} at this size: compare fewer --dp "
            f"sizes (each dp > 1 is 6 plans, dp=1 is 3), or give --zero and --recompute (1 plan per dp), or fewer "
            f"microbatches"
        )


def check_offload_search(ranks: int, leads: int, pairs: int) -> None:
    """Refuses an offload search (`choose_offload`: up to 8 fractions per rank and lead,
    each a simulation of the whole schedule) that would simulate more than
    MAX_OFFLOAD_SEARCH (stage, microbatch) pairs in all."""
    total = ranks * leads * 8 * pairs
    if total > MAX_OFFLOAD_SEARCH:
        raise ParameterError(
            f"offload auto: {ranks} ranks * {leads} leads * 8 fractions = {ranks * leads * 8} simulations of "
            f"{_num(pairs)} (stage, microbatch) pairs = {_num(total)}; at most {MAX_OFFLOAD_SEARCH} are accepted "
            f"(some 5 s on two cores): give ranks= (fewer ranks), fraction= (one simulation), or fewer microbatches"
        )


def check_png_ranks(ranks: int, error=ParameterError) -> None:
    """Refuses a PNG of more than MAX_PNG_RANKS ranks (one row each)."""
    if ranks > MAX_PNG_RANKS:
        raise error(f"--png draws one row per rank: pp = {_num(ranks)}; at most {MAX_PNG_RANKS} are accepted "
                    f"(--trace writes a Chrome trace of up to {MAX_TRACE_STAGE_MICROBATCHES} (stage, microbatch) "
                    f"pairs)")


def check_png_size(pp: int, virtual: int, microbatches: int, error=ParameterError) -> None:
    """Refuses a PNG of more than MAX_PNG_RANKS ranks or MAX_PNG_STAGE_MICROBATCHES
    (stage, microbatch) pairs ([Note: size limits]: a bar per compute)."""
    check_png_ranks(pp, error)
    _check_drawn("--png draws a bar per compute", pp, virtual, microbatches, MAX_PNG_STAGE_MICROBATCHES, "--png",
                 error)


def check_trace_size(pp: int, virtual: int, microbatches: int, error=ParameterError) -> None:
    """Refuses a Chrome trace of more than MAX_TRACE_STAGE_MICROBATCHES (stage,
    microbatch) pairs ([Note: size limits]: an event per instruction)."""
    _check_drawn("--trace writes an event per instruction", pp, virtual, microbatches, MAX_TRACE_STAGE_MICROBATCHES,
                 "--trace", error)


def _check_drawn(what: str, pp: int, virtual: int, microbatches: int, limit: int, flag: str, error) -> None:
    total = pp * virtual * microbatches
    if total > limit:
        raise error(f"{what}: pp * virtual * microbatches = {_num(pp)} * {_num(virtual)} * {_num(microbatches)} = "
                    f"{_num(total)} (stage, microbatch) pairs; at most {limit} are accepted there (simulate alone "
                    f"takes {MAX_STAGE_MICROBATCHES}): give fewer microbatches, or leave out {flag}")


def check_timeline_cells(ranks: int, cells: int, error=ParameterError) -> None:
    """Refuses an ASCII timeline of more than MAX_TIMELINE_CELLS characters (ranks rows
    of `cells` cells)."""
    if ranks * cells > MAX_TIMELINE_CELLS:
        raise error(f"the timeline would be {_num(ranks)} ranks x {_num(cells)} cells = {_num(ranks * cells)} "
                    f"characters; at most {MAX_TIMELINE_CELLS} are accepted: give a width (--width) of at most "
                    f"{max(1, MAX_TIMELINE_CELLS // ranks)}")


def check_at_most(name: str, value: int, limit: int, error=ParameterError) -> None:
    if value > limit:
        raise error(f"{name} = {_num(value)}; at most {limit} is accepted")


def check_stream_pieces(stash_bytes: float, chunk: float, error=ParameterError) -> None:
    """Refuses a streaming chunk that cuts a stash of `stash_bytes` into more than
    MAX_STREAM_PIECES pieces."""
    pieces = stash_bytes / chunk if chunk > 0 else math.inf
    if pieces > MAX_STREAM_PIECES:
        smallest = stash_bytes / MAX_STREAM_PIECES / 2**20
        raise error(
            f"streamed offload: a chunk of {chunk:g} bytes cuts a stash of {stash_bytes:g} bytes into "
            f"{pieces:.3g} pieces; at most {MAX_STREAM_PIECES} are accepted (a chunk of at least {smallest:.3g} MiB)"
        )


_INT = re.compile(r"[+-]?[0-9]+")
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


class TooManyDigits(ParameterError):
    """`parse_int`'s refusal of an integer over MAX_DIGITS digits, told apart so that a
    caller that tries other readings after a refusal keeps this reason."""


def parse_int(text: str, what: str) -> int:
    """An integer typed as text: ASCII digits with an optional sign, at most MAX_DIGITS
    of them (as the instruction and CSV readers take them); no `_`, no other digits."""
    if not isinstance(text, str) or not _INT.fullmatch(text.strip()):
        raise ParameterError(f"{what} must be an integer (ASCII digits 0-9), got {shown(text)}")
    digits = text.strip().lstrip("+-")
    if len(digits) > MAX_DIGITS:
        raise TooManyDigits(f"{what} has {len(digits)} digits, got {shown(text)}; at most {MAX_DIGITS} are accepted")
    return int(text)


# [Note: list syntax] A list of integers (caps per rank, layers per stage, ranks, dp
# sizes) is written `4/3/2/1` everywhere: in a pp_engine string `,` separates parameters
# (`capped_1f1b:cap=4/3/2/1,split=19/21/21/19`), so it cannot join a list there. Where it
# clashes with nothing, on the command line (--cap, --dp) and in the strings of the
# pp_engine mapping form ({name: capped_1f1b, cap: "4,3,2,1"}), `4,3,2,1` reads the same.
LIST_SEPARATORS = "/,"


def parse_int_list(text: str, what: str) -> list[int]:
    """Integers joined by one of LIST_SEPARATORS ([Note: list syntax]), each read as
    `parse_int` reads it: `4/3/2/1` and `4,3,2,1` -> [4, 3, 2, 1]; `2` -> [2]."""
    if not isinstance(text, str):
        raise ParameterError(f"{what} must be integers joined by / or , (4/3/2/1), got {shown(text)}")
    used = [sep for sep in LIST_SEPARATORS if sep in text]
    if len(used) > 1:
        raise ParameterError(f"{what} joins its integers with one of / and , (4/3/2/1 or 4,3,2,1), got {shown(text)}")
    parts = text.split(used[0]) if used else [text]
    try:
        return [parse_int(part, what) for part in parts]
    except TooManyDigits:
        raise
    except ParameterError:
        raise ParameterError(f"{what} must be an integer or integers joined by / or , (4/3/2/1 or 4,3,2,1; ASCII "
                             f"digits), got {shown(text)}") from None


def parse_number(text: str, what: str) -> float:
    """A finite number typed as text: ASCII digits, an optional sign, point and exponent
    (`1.5`, `2e-3`); no `_`, no other digits, no inf or nan."""
    if not isinstance(text, str) or not _NUMBER.fullmatch(text.strip()):
        raise ParameterError(f"{what} must be a number (ASCII digits, e.g. 1.5 or 2e-3), got {shown(text)}")
    value = float(text)
    if not math.isfinite(value):
        raise ParameterError(f"{what} must be a finite number, got {shown(text)}")
    return value


def int_list_arg(flag: str):
    """An argparse `type` reading `flag`'s value with `parse_int_list`."""
    return _arg(parse_int_list, flag)


def int_arg(flag: str):
    """An argparse `type` reading `flag`'s value with `parse_int`."""
    return _arg(parse_int, flag)


def number_arg(flag: str):
    """An argparse `type` reading `flag`'s value with `parse_number`."""
    return _arg(parse_number, flag)


def path_arg(flag: str):
    """An argparse `type` for a file path: any text but the empty one (which the commands
    would otherwise take for 'not given')."""
    def read(text: str) -> str:
        if not text:
            raise ArgumentError(f"{flag} needs a file path, got ''")
        return text

    read.__name__ = "path"
    return read


def _arg(parse, flag: str):
    def read(text: str):
        try:
            return parse(text, flag)
        except ParameterError as err:
            raise ArgumentError(str(err)) from None

    read.__name__ = parse.__name__
    return read


def _num(value: int) -> str:
    return shown(value) if isinstance(value, int) and value.bit_length() > 200 else str(value)
