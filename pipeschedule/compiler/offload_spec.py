"""The `--offload` spec: a policy for the offload pass, or a request to search for one.

    parse_offload(text)   `fraction=F[,lead=L][,ranks=..][,stream=MiB]` -> OffloadPolicy
                          `auto[,budget=B][,ranks=..][,stream=MiB]`     -> AutoOffload
    AutoOffload           what the search (`pipeschedule.simulate.offload_search.choose_offload`)
                          is asked for: a step-time budget, the ranks, the leads tried

The spec is read here, beside the pass it configures (`offload.add_offload`), so that
`pipeschedule compile --offload` reads it without loading the planner.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeschedule.checks import check_number, is_int, parse_int, parse_number, shown
from pipeschedule.compiler.offload import MIB, OffloadPolicy, check_chunk
from pipeschedule.errors import ParameterError

DEFAULT_BUDGET = 0.03
DEFAULT_LEADS = (0, 1, 2, 3, 4)
MAX_BUDGET = 100.0  # a step-time budget beyond it allows any offload (1e300 printed a 300-digit percentage)


@dataclass(frozen=True)
class AutoOffload:
    """`choose_offload`'s request: the step-time budget (a fraction: 0.03 allows 3% over
    the schedule without offload), the ranks it may offload (None: all), the leads tried."""

    budget: float = DEFAULT_BUDGET
    ranks: tuple[int, ...] | None = None
    leads: tuple[int, ...] = DEFAULT_LEADS
    chunk: float | None = None

    def __post_init__(self) -> None:
        check_chunk(self.chunk)
        check_number("offload budget", self.budget, hint=" (0.03 = 3% slower at most)")
        if self.budget > MAX_BUDGET:
            raise ParameterError(f"offload budget {shown(self.budget)} allows a step {self.budget:.3g} times "
                                 f"slower; at most {MAX_BUDGET:g} (the step {MAX_BUDGET:g}x slower) is accepted")
        OffloadPolicy(ranks=self.ranks)  # same checks
        if not self.leads or not all(is_int(x) and x >= 0 for x in self.leads):
            raise ParameterError(f"offload leads must be integers >= 0, got {shown(self.leads)}")


def parse_offload(text: str) -> OffloadPolicy | AutoOffload:
    """`--offload` values: `fraction=F[,lead=L][,ranks=R0/R1..][,stream=MiB]` (F and L may
    be one per rank, F0/F1/..) or `auto[,budget=B][,ranks=..][,stream=MiB]`; stream= sets
    the chunk of streamed stashes in MiB. Raises ParameterError naming the part that is
    wrong and what is accepted."""
    accepted = ("accepted: fraction=F[,lead=L][,ranks=R0/R1..][,stream=MiB] with F in [0, 1] (or F0/F1/.. per rank), "
                "or auto[,budget=B][,ranks=..][,stream=MiB]")
    if not isinstance(text, str) or not text.strip():
        raise ParameterError(f"--offload needs a value, got {shown(text)}; {accepted}")
    parts = [p.strip() for p in text.split(",")]
    auto = parts[0] == "auto"
    if auto:
        parts = parts[1:]
    values: dict[str, str] = {}
    allowed = ("budget", "ranks", "stream") if auto else ("fraction", "lead", "ranks", "stream")
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or key not in allowed or key in values or not value:
            raise ParameterError(f"--offload {shown(text)}: cannot read {shown(part)}; {accepted}")
        values[key] = value

    def numbers(key: str, kind):
        parse = parse_int if kind is int else parse_number  # ASCII digits, finite ([Note: size limits])
        parts = values[key].split("/")
        if kind is float and any(p.strip().lstrip("+-").lower() in ("inf", "infinity", "nan") for p in parts):
            raise ParameterError(f"--offload {shown(text)}: {key}={shown(values[key])} is not finite; {accepted}")
        try:
            return tuple(parse(x, key) for x in parts)
        except ParameterError:
            raise ParameterError(f"--offload {shown(text)}: {key}={shown(values[key])} is not "
                                 f"{'an integer' if kind is int else 'a number'} (or a /-separated list); "
                                 f"{accepted}") from None

    ranks = numbers("ranks", int) if "ranks" in values else None
    try:
        chunk = None
        if "stream" in values:
            mib = numbers("stream", float)
            if len(mib) != 1 or not mib[0] * MIB >= 1:
                raise ParameterError(f"stream takes one number of MiB, at least one byte "
                                     f"({1 / MIB:.3g} MiB: the chunk), "
                                     f"got {shown(values['stream'])}")
            chunk = mib[0] * MIB
        if auto:
            budget = numbers("budget", float) if "budget" in values else (DEFAULT_BUDGET,)
            if len(budget) != 1:
                raise ParameterError(f"budget takes one number, got {shown(values['budget'])}")
            return AutoOffload(budget=budget[0], ranks=ranks, chunk=chunk)
        if "fraction" not in values:
            raise ParameterError("fraction= is missing")
        fraction = numbers("fraction", float)
        lead = numbers("lead", int) if "lead" in values else (1,)
        return OffloadPolicy(fraction[0] if len(fraction) == 1 else fraction, ranks,
                             lead[0] if len(lead) == 1 else lead, chunk)
    except ParameterError as err:
        if str(err).startswith("--offload"):
            raise
        raise ParameterError(f"--offload {shown(text)}: {err}; {accepted}") from None


__all__ = ["DEFAULT_BUDGET", "DEFAULT_LEADS", "MAX_BUDGET", "AutoOffload", "parse_offload"]
