"""Every rank runs the same schedule: compared once, at an executor's first step.

[Note: schedule agreement] Messages between two ranks pair by order, not by what they
carry, so ranks given different schedules do not fail where they differ: with m=5 on
rank 0 and m=4 on rank 1, messages slid across step boundaries, rank 1 finished every
step and rank 0 several, with gradients built from the next step's data, before a
timeout; a one-step run returned normally on rank 1. So at the start of its first step
each executor publishes a `ScheduleSummary` of the schedule it runs, through the
transport's store under its namespace (`<namespace>schedule/<rank>`), and waits until
every rank of the transport has published its own (`Agreement`, a `Pending`: the
watchdog turns a rank that never arrives into an error naming it). Then it compares:
on a mismatch every rank stops with a `ScheduleMismatchError` that quotes each schedule
in words and names the fields that differ ("m (5 vs 4)", "params.cap ([1, 1] vs
[2, 2])", "placement ...", or, when only programs differ, the ranks whose programs
do). The summary's digest covers the whole schedule (name, pp, virtual, m, placement,
params and every rank's program, in the text form of its instructions), so every rank
that runs the same schedule computes the same digest. It is paid once per executor
(the summary: 1 ms at pp=4, m=32; 0.1 s at pp=16, m=128, v=2; 1 s at pp=64, m=512,
v=2) with one store write and world_size - 1 lookups; later steps pay nothing.

Compared: what every rank must agree on for messages to pair, including where the
schedule moves stashes to host memory (OFFLOAD and RELOAD are instructions). Not
compared: options of one executor that change neither a message nor a result
(`offload_chunk` and `reload_window`, `pool`, `measure_stash`). `shapes=` is compared:
a receiver allocates what it was given, and a sender checks its output against what it
was given, so ranks given different shapes (or some ranks none) had gloo deliver a smaller
message into a larger buffer without a word, or abort a process.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from pipeschedule.compiler.ir import Op, Schedule
from pipeschedule.runtime.transport import Pending, Transport

SHORT = 12  # hex digits of a digest shown in messages


@dataclass(frozen=True)
class ScheduleSummary:
    """What ranks compare ([Note: schedule agreement]): the schedule's fields in words,
    one digest per rank's program, and the digest of the whole schedule."""

    name: str
    pp: int
    virtual: int
    m: int
    placement: tuple[int, ...]
    params: str  # JSON, keys sorted
    offload: tuple[int, ...]  # OFFLOAD instructions per rank
    programs: tuple[str, ...]  # digest of each rank's program
    digest: str
    shapes: str = "{}"  # the executor's `shapes=`, JSON: boundary -> TensorMeta.encode(), keys sorted
    edges: str = ""  # the stage graph, JSON, where it is not the chain ([Note: stage graph])

    @staticmethod
    def of(schedule: Schedule, shapes=None) -> ScheduleSummary:
        """`shapes`: the boundary shapes the executor was given (`shapes=`), or None."""
        params = json.dumps(dict(schedule.params), sort_keys=True, default=str)
        given = json.dumps({_boundary_text(s): meta.encode() for s, meta in sorted((shapes or {}).items())})
        edges = "" if schedule.is_chain else json.dumps([list(e) for e in schedule.edges])
        head = json.dumps([schedule.name, schedule.pp, schedule.virtual, schedule.microbatches,
                           list(schedule.placement), params] + ([given] if shapes else []) + ([edges] if edges else []))
        texts = [" ".join(map(str, program)) for program in schedule.programs]
        digest = hashlib.sha256("\n".join([head, *texts]).encode()).hexdigest()
        return ScheduleSummary(
            schedule.name, schedule.pp, schedule.virtual, schedule.microbatches, tuple(schedule.placement), params,
            tuple(sum(1 for i in program if i.op is Op.OFFLOAD) for program in schedule.programs),
            tuple(hashlib.sha256(text.encode()).hexdigest()[:SHORT] for text in texts), digest, given, edges,
        )

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def decode(text: str) -> ScheduleSummary:
        fields = json.loads(text)
        for key in ("placement", "offload", "programs"):
            fields[key] = tuple(fields[key])
        return ScheduleSummary(**fields)

    def describe(self) -> str:
        offload = "none" if not any(self.offload) else list(self.offload)
        edges = f" edges={self.edges}" if self.edges else ""
        return (f"{self.name} pp={self.pp} virtual={self.virtual} m={self.m} placement={list(self.placement)}{edges} "
                f"params={self.params} offload={offload} (digest {self.digest[:SHORT]})")

    def differences(self, other: ScheduleSummary) -> list[tuple[str, str]]:
        """(field, both values in words, this one's first) for each field in which
        `other` differs; the programs only when nothing else does."""
        out = [(key, f"{key} ({mine} vs {theirs})") for key, mine, theirs in (
            ("name", self.name, other.name), ("pp", self.pp, other.pp), ("virtual", self.virtual, other.virtual),
            ("m", self.m, other.m), ("placement", list(self.placement), list(other.placement)),
        ) if mine != theirs]
        mine, theirs = json.loads(self.params), json.loads(other.params)
        out += [(f"params.{key}", f"params.{key} ({mine.get(key, 'unset')} vs {theirs.get(key, 'unset')})")
                for key in sorted(set(mine) | set(theirs)) if mine.get(key) != theirs.get(key)]
        if self.edges != other.edges:
            out.append(("edges", f"the stage graph ({self.edges or 'the chain'} vs {other.edges or 'the chain'})"))
        if self.shapes != other.shapes:
            out.append(("shapes", f"the boundary shapes given (shapes= {self.shapes} vs {other.shapes})"))
        if self.offload != other.offload:
            out.append(("offload", f"offload, OFFLOAD instructions per rank "
                                   f"({list(self.offload)} vs {list(other.offload)})"))
        if not out and self.digest != other.digest:
            ranks = [r for r, (a, b) in enumerate(zip(self.programs, other.programs)) if a != b]
            out.append(("programs", f"the programs of {_ranks(ranks)} (same fields, other instructions)"))
        return out


class Agreement(Pending):
    """Publishes this rank's summary and waits for every rank's
    ([Note: schedule agreement]); once ready, `mismatch()` says how the others differ, or None."""

    def __init__(self, transport: Transport, namespace: str, rank: int, summary: ScheduleSummary):
        self.transport, self.rank, self.summary = transport, rank, summary
        self.key = f"{namespace}schedule/"
        self.seen: dict[int, ScheduleSummary] = {rank: summary}
        transport.publish(f"{self.key}{rank}", summary.encode())

    @property
    def missing(self) -> list[int]:
        return [r for r in range(self.transport.world_size) if r not in self.seen]

    @property
    def what(self) -> str:  # the watchdog's words for this wait
        missing = self.missing
        whose = "its" if len(missing) == 1 else "their"
        return (f"{_ranks(missing)} to start {whose} first step, where every rank publishes the schedule it runs "
                f"([Note: schedule agreement]); a rank that never builds this executor, or builds its executors "
                f"on this transport in another order, never does")

    def ready(self) -> bool:
        for r in self.missing:
            text = self.transport.lookup(f"{self.key}{r}")
            if text is not None:
                self.seen[r] = ScheduleSummary.decode(text)
        return not self.missing

    def wrong_world(self) -> str | None:
        """Why this rank's schedule cannot run over this transport (its pp is not the
        transport's number of ranks), or None."""
        mine = self.summary
        if self.transport.world_size == mine.pp:
            return None
        return (f"this rank runs {mine.describe()}, a schedule for {mine.pp} ranks, over a transport of "
                f"{self.transport.world_size} ranks")

    def mismatch(self) -> tuple[str, tuple[str, ...], tuple[int, ...]] | None:
        """Once ready: None when every rank runs this schedule; else (the message, the
        fields that differ, the ranks whose schedule differs)."""
        mine = self.summary
        others: dict[str, list[int]] = {}
        for r, theirs in sorted(self.seen.items()):
            if theirs.digest != mine.digest:
                others.setdefault(theirs.digest, []).append(r)
        if not others:
            return None
        lines, fields = [f"ranks run different schedules: rank {self.rank} runs {mine.describe()}"], []
        for ranks in others.values():
            theirs = self.seen[ranks[0]]
            differ = mine.differences(theirs)
            fields += [field for field, _ in differ if field not in fields]
            verb = "runs" if len(ranks) == 1 else "run"
            lines.append(f"{_ranks(ranks)} {verb} {theirs.describe()}: "
                         f"they differ in {', '.join(d for _, d in differ)}")
        lines.append("every rank must run the same schedule (executors pair up across ranks by the order "
                     "they are built on a transport)")
        ranks = tuple(r for group in others.values() for r in group)
        return "\n  ".join(lines), tuple(fields), ranks


def _boundary_text(boundary) -> str:
    """A `shapes=` key as text: the producing stage, or the edge "s-t" on a stage graph."""
    return f"{boundary[0]}-{boundary[1]}" if isinstance(boundary, tuple) else str(boundary)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
