"""Ranks given different schedules stop at their first step, every one of them, with an
error that quotes both schedules and names what differs ([Note: schedule agreement]).

Over gloo, one spawn of two processes runs every scenario in turn, each on a transport
of its own prefix (the comparison happens before any message is posted, so a failed
scenario leaves the process group usable): m 5 against 4 (which used to slide messages
across step boundaries and, in one step, return normally on rank 1), the cap, the
placement, one rank's program alone, and a rank that never starts. In one process: the
same comparisons, and nothing is published or looked up after the first step.
"""

from __future__ import annotations

import time

import pytest
import torch

from pipeschedule.compiler.families import generate
from pipeschedule.compiler.ir import Instr, Op, Schedule
from pipeschedule.compiler.passes import lower
from pipeschedule.runtime import (
    DistTransport, Executor, InProcessPipeline, InProcessTransport, InProcessWorld, ModuleStages, RuntimeScheduleError,
    ScheduleMismatchError, ScheduleSummary, run_in_process,
)
from pipeschedule.runtime.launch import spawn

from runtime_helpers import loss_fn, make_chunks, make_data, without

TIMEOUT = 20.0  # the watchdog: a scenario that hung would take this long
FAST = 5.0  # every rank must stop well within this


def capped(m: int, cap: int = 1):
    return lower(generate("capped_1f1b", pp=2, microbatches=m, cap=cap))


def placed(placement: tuple[int, ...], m: int = 3) -> Schedule:
    """All forwards, then all backwards, of len(placement) stages on two ranks; the same
    name for every placement, so only the placement (and the programs) differ."""
    programs: list[list[Instr]] = [[], []]
    for s, rank in enumerate(placement):
        programs[rank] += [Instr(Op.F, s, mb) for mb in range(m)]
    for s in reversed(range(len(placement))):
        programs[placement[s]] += [Instr(Op.B, s, mb) for mb in range(m)]
    return lower(Schedule("afab_placed", 2, len(placement) // 2, m, placement, tuple(map(tuple, programs))))


def scenarios() -> dict[str, tuple[Schedule, Schedule | None]]:
    """name -> (rank 0's schedule, rank 1's; None: rank 1 never starts)."""
    base = capped(4)
    return {
        "m": (capped(5), capped(4)),
        "cap": (capped(4, cap=1), capped(4, cap=2)),
        "placement": (placed((0, 1, 0, 1)), placed((0, 1, 1, 0))),
        "programs": (base, without(base, 1, Op.RECV_F, 1, 2)),
        "absent": (base, None),
    }


def _executor(schedule, rank, transport, timeout):
    return Executor(schedule, rank, ModuleStages(make_chunks(schedule.num_stages), loss_fn), transport, timeout=timeout)


def agreement_worker(rank: int, world: int, store) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, schedules in scenarios().items():
        schedule = schedules[rank]
        transport = DistTransport(store, prefix=f"agreement/{name}/")
        start = time.monotonic()
        if schedule is None:  # this rank never starts; the other's watchdog must name it
            time.sleep(2.5)
            continue
        timeout = 1.5 if name == "absent" else TIMEOUT
        executor = _executor(schedule, rank, transport, timeout)
        try:
            executor.step(*make_data(schedule.num_stages, schedule.microbatches))
            out[name] = ("returned", "", (), time.monotonic() - start)
        except RuntimeScheduleError as err:
            out[name] = (type(err).__name__, str(err), getattr(err, "fields", ()), time.monotonic() - start)
    return out


@pytest.fixture(scope="module")
def gloo_runs():
    start = time.monotonic()
    ranks = spawn(agreement_worker, 2, timeout=120)
    print(f"agreement: {len(scenarios())} scenarios over gloo in {time.monotonic() - start:.1f} s")
    return ranks


EXPECTED = {  # scenario -> (fields named, words in every rank's message)
    "m": (("m",), ("m (5 vs 4)", "m (4 vs 5)")),
    "cap": (("params.cap",), ("params.cap ([1, 1] vs [2, 1])", "params.cap ([2, 1] vs [1, 1])")),
    "placement": (("placement",),
                  ("placement ([0, 1, 0, 1] vs [0, 1, 1, 0])", "placement ([0, 1, 1, 0] vs [0, 1, 0, 1])")),
    "programs": (("programs",), ("the programs of rank 1", "the programs of rank 1")),
}


@pytest.mark.spawn
@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_every_rank_stops_at_once_naming_the_difference(gloo_runs, scenario):
    fields, words = EXPECTED[scenario]
    for rank in (0, 1):
        kind, message, found, elapsed = gloo_runs[rank][scenario]
        assert kind == "ScheduleMismatchError", (rank, kind, message)
        assert found == fields, message
        assert words[rank] in message, message
        assert message.startswith(f"rank {rank}, step 0, pc 0 (comparing schedules, before its first instruction)")
        assert elapsed < FAST, f"rank {rank} took {elapsed:.1f} s"
    # Each rank quotes both schedules in words.
    schedules = scenarios()[scenario]
    for rank in (0, 1):
        message = gloo_runs[rank][scenario][1]
        assert all(ScheduleSummary.of(s).describe() in message for s in schedules), message


@pytest.mark.spawn
def test_a_rank_that_never_starts_is_named_by_the_watchdog(gloo_runs):
    kind, message, _, elapsed = gloo_runs[0]["absent"]
    assert kind == "RuntimeScheduleError", message
    assert "timed out after 1.5 s waiting for rank 1 to start its first step, where every rank publishes the " \
           "schedule it runs" in message, message
    assert elapsed < FAST
    assert "absent" not in gloo_runs[1]


# -- in one process -----------------------------------------------------------------------


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_in_process_mismatch(scenario):
    fields, _ = EXPECTED[scenario]
    schedules = scenarios()[scenario]
    world = InProcessWorld(2)
    executors = [_executor(s, r, world.transport(r), TIMEOUT) for r, s in enumerate(schedules)]
    with pytest.raises(ScheduleMismatchError) as caught:  # the in-process driver stops at the first rank's error
        run_in_process(executors, *make_data(schedules[0].num_stages, schedules[0].microbatches))
    assert caught.value.fields == fields
    assert caught.value.ranks == (1 - caught.value.rank,)
    with pytest.raises(RuntimeScheduleError, match="stopped with an error in an earlier step"):
        executors[caught.value.rank].step()


def test_a_schedule_for_another_number_of_ranks_is_refused_at_once():
    schedule = lower(generate("1f1b", pp=2, microbatches=2))
    world = InProcessWorld(3)
    executor = _executor(schedule, 0, world.transport(0), TIMEOUT)
    with pytest.raises(ScheduleMismatchError, match=r"a schedule for 2 ranks, over a transport of 3 ranks") as caught:
        run_in_process([executor], *make_data(2, 2))
    assert caught.value.fields == ("pp",)


class CountingTransport(InProcessTransport):
    """An in-process rank that counts its store traffic."""

    def __init__(self, world, rank):
        super().__init__(world, rank)
        self.calls = 0

    def publish(self, key, value):
        self.calls += 1
        super().publish(key, value)

    def lookup(self, key):
        self.calls += 1
        return super().lookup(key)


def test_only_the_first_step_publishes_or_looks_up_anything():
    schedule = lower(generate("interleaved_1f1b", pp=2, microbatches=3, virtual=2))
    world = InProcessWorld(2)
    transports = [CountingTransport(world, r) for r in range(2)]
    stages = ModuleStages(make_chunks(schedule.num_stages), loss_fn)
    executors = [Executor(schedule, r, stages, transports[r]) for r in range(2)]
    data = make_data(schedule.num_stages, schedule.microbatches)
    run_in_process(executors, *data)
    assert all(t.calls > 0 for t in transports)
    assert sorted(k for k in world.metadata if "/schedule/" in k) == ["x0/schedule/0", "x0/schedule/1"]
    for t in transports:
        t.calls = 0
    run_in_process(executors, *data)
    assert [t.calls for t in transports] == [0, 0]


def test_the_digest_is_the_whole_schedule_and_the_same_on_every_rank():
    a, b = capped(4), capped(4)
    assert a is not b and ScheduleSummary.of(a) == ScheduleSummary.of(b)
    assert ScheduleSummary.decode(ScheduleSummary.of(a).encode()) == ScheduleSummary.of(a)
    edited = without(a, 1, Op.RECV_F, 1, 2)
    assert ScheduleSummary.of(edited).digest != ScheduleSummary.of(a).digest
    assert ScheduleSummary.of(edited).programs[0] == ScheduleSummary.of(a).programs[0]
    pipeline = InProcessPipeline(a, ModuleStages(make_chunks(2), loss_fn))
    pipeline.step(*make_data(2, 4))  # the same schedule on both ranks: no error
