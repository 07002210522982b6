"""What [Note: measured throughput] in pipeschedule/plan/config.py says: the range the plan prints is
what `benchmarks.users_case` computes from the one measured run, and the planner's
figures it rests on are the ones docs/users_case.md gives."""

from __future__ import annotations

import pytest

from benchmarks import users_case
from pipeschedule.plan.config import MEASURED_MFU


def test_the_printed_range_is_the_measured_runs_two_readings():
    full = users_case.mfu_for(users_case.MEASURED, users_case.M, users_case.READINGS[users_case.A])
    none = users_case.mfu_for(users_case.MEASURED, users_case.M,
                              users_case.SPEED_READINGS["B: bf16 gradients and Adam, no recompute"])
    assert MEASURED_MFU == (round(none, 2), round(full, 2))


def test_the_count_at_half_of_peak_is_19_percent_low_or_8_percent_high():
    a = users_case.default(1, 0, users_case.M, **users_case.READINGS[users_case.A]).tokens_per_gpu
    b = users_case.default(1, 0, users_case.M, fp32_grad_accum=False, recompute="none").tokens_per_gpu
    assert round(a) == 633 and a / users_case.MEASURED - 1 == pytest.approx(-0.19, abs=0.005)
    assert b / users_case.MEASURED - 1 == pytest.approx(0.08, abs=0.005)
