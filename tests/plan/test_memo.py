"""[Note: run-wide memos]: what the plans of one run keep by its arguments, that keeping it
changes no answer, and the offload floor (`least_offloaded`) that spares simulations."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import pytest

from pipeschedule.compiler.families import generate
from pipeschedule.compiler.passes import lower
from pipeschedule.errors import ParameterError
from pipeschedule.plan import memo as memo_module
from pipeschedule.plan import peaks as peaks_module
from pipeschedule.plan import planner as planner_module
from pipeschedule.plan import step_graph as step_graph_module
from pipeschedule.plan.advice import advise
from pipeschedule.plan.config import PlanConfig
from pipeschedule.plan.fitting import least_offloaded, offloaded
from pipeschedule.plan.memo import Memo, plain
from pipeschedule.plan.memory import GiB, TrainingSetup
from pipeschedule.plan.planner import _Planner, plan
from pipeschedule.plan.presets import model_preset
from pipeschedule.plan.split_problem import SplitProblem
from pipeschedule.plan.step_graph import StepGraph
from pipeschedule.simulate import CostModel

L70 = model_preset("llama3-70b")


def users(**setup) -> PlanConfig:
    """Llama3-70B at pp=4 on a GH200 with its host link known: rows that do not fit, host
    offload tried on them, and searches over 80 layers."""
    st = TrainingSetup(**{"tp": 4, "seq": 8192, "tp_async": True, "dp": 1, **setup})
    return PlanConfig(L70, st, pp=4, microbatches=16, gpu_memory=96 * GiB, gpu_name="gh200", host_bandwidth=450e9)


def test_a_memo_keeps_values_within_its_cells_and_is_emptied_when_full():
    calls = []

    def twice(k):
        calls.append(k)
        return 2 * k

    memo = Memo(10, lambda key, value: 4)
    assert memo.get(1, lambda: twice(1)) == 2 and memo.get(1, lambda: twice(1)) == 2
    assert calls == [1] and (memo.hits, memo.misses) == (1, 1)
    memo.get(2, lambda: twice(2))  # 8 of 10 cells
    memo.get(3, lambda: twice(3))  # 12 would pass 10: emptied, then 3 kept
    assert list(memo.values) == [3] and memo.used == 4
    assert memo.get(1, lambda: twice(1)) == 2 and calls == [1, 2, 3, 1]  # computed again, the same value
    small = Memo(3, lambda key, value: 4)  # an entry larger than the memo is computed, never kept
    assert small.get("a", lambda: 7) == 7 and small.values == {} and small.used == 0


def test_only_plain_numbers_are_kept():
    assert plain((1.0, 2, 0.0)) and plain(())
    assert not plain((1.0, Fraction(1, 2))) and not plain((True,)) and not plain(("1",))


def test_exact_costs_are_never_served_a_kept_float_answer():
    """Fraction(1, 3) equals no float, but Fraction(1, 2) equals 0.5: the step graph keeps
    float costs' answers and computes exact ones anew, so exact sums stay exact."""
    graph = StepGraph(lower(generate("1f1b", pp=2, microbatches=3)))
    msgs = graph.message_times((0.0, 0.0), (0.0, 0.0))
    floats = graph.step((0.5, 0.5), (1.0, 1.0), (0.0, 0.0), msgs)
    exact = graph.step((Fraction(1, 2),) * 2, (Fraction(1),) * 2, (Fraction(0),) * 2, msgs)
    assert exact[0] == floats[0] and isinstance(exact[0], Fraction)
    assert graph.step_memo.misses == 1  # the exact step went around the memo
    assert graph.step((0.5, 0.5), (1.0, 1.0), (0.0, 0.0), msgs) is floats  # the float one is kept


def test_the_fast_checks_still_refuse_what_the_full_checks_refuse():
    """CostModel and SplitProblem check float tuples at C speed; a NaN, an infinity, a
    negative or a bool still gets the one-line error that names it."""
    ok = CostModel((1.0, 2.0), (1.0, 2.0), (0.0, 0.0), {})
    assert ok.forward == (1.0, 2.0)
    assert CostModel((Fraction(1, 3),), (1,), (0,), {}).forward == (Fraction(1, 3),)
    for bad in (float("nan"), float("inf"), -1.0, True):
        with pytest.raises(ParameterError, match="forward"):
            CostModel((1.0, bad), (1.0, 1.0), (0.0, 0.0), {})
        with pytest.raises(ParameterError, match=r"layer_forward\[1\]"):
            SplitProblem(layer_forward=(1.0, bad), layer_backward=(1.0, 1.0), layer_weight=(0.0, 0.0),
                         stage_forward=(0.0,), stage_backward=(0.0,), stage_weight=(0.0,),
                         layer_static=(1.0, 1.0), layer_stash=(1.0, 1.0), stage_static=(0.0,),
                         stage_stash=(0.0,), rank_bytes=(0.0,), budget=None, boundary=(0.0,))


def _without_memos(monkeypatch) -> None:
    for module in (step_graph_module, peaks_module, planner_module):
        monkeypatch.setattr(module, "MEMO_CELLS", 0)


def test_a_run_with_memos_gives_every_answer_of_a_run_without(monkeypatch):
    """Three dp sizes (15 plans: ZeRO-0/1 x 3 recompute modes, searches, partial recompute,
    host offload) with the memos and with memos that keep nothing: the same advice, figure
    for figure; and the memos did serve the run."""
    made = []
    init = Memo.__init__

    def counted(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(memo_module.Memo, "__init__", counted)
    kept = advise(users(), (1, 2, 4)).to_dict()
    hits = sum(m.hits for m in made)
    assert hits > 1000, hits
    made.clear()
    _without_memos(monkeypatch)
    fresh = advise(users(), (1, 2, 4)).to_dict()
    assert sum(m.hits for m in made) == 0
    assert kept == fresh


def test_the_offload_floor_is_never_above_the_simulated_offload():
    """`least_offloaded` says a rank is over however its stashes go to the host; for every
    row of these plans that does not fit, each offloading rank's total, moved whole and
    streamed, is at least what the floor counts, and where the floor says over, the
    simulated offload is over too."""
    checked = over = 0
    for setup in ({}, {"dp": 2, "zero_stage": 1}, {"recompute": "full"}):
        config = replace(users(**setup), host_bandwidth=450e9)
        planner = _Planner(config)
        for cand in plan(config).candidates:
            if cand.fits or not cand.memory or planner.schedule(cand.family, cand.cap, cand.virtual).split_backward:
                continue
            ranks = tuple(r.rank for r in cand.memory if not r.fits)
            floor = least_offloaded(planner, cand, ranks)
            for stream in (None, 256):
                row = offloaded(planner, cand, ranks, stream)
                worst = max((row.memory[r] for r in ranks), key=lambda m: m.overflow)
                if floor is not None:
                    assert worst.overflow >= floor.overflow * (1 - 1e-12), (cand.label, stream)
                    assert not row.fits
                    over += 1
                checked += 1
    assert checked >= 20 and over >= 5, (checked, over)
