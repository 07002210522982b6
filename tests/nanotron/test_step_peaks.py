"""`StepPeaks` ([Note: nanotron resets the peaks] in integration/nanotron/train.py): a
step's peak survives the resets nanotron's `log_memory` makes inside the step. CUDA only:
the peaks are the CUDA caching allocator's."""

from __future__ import annotations

import pytest
import torch

from integration.nanotron.train import StepPeaks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA allocator's peaks")


def test_a_reset_inside_the_step_keeps_the_peak_before_it():
    torch.cuda.synchronize()
    before, reset = torch.cuda.memory_allocated(), torch.cuda.reset_peak_memory_stats
    size = 256 * 2**20
    with StepPeaks() as peaks:
        big = torch.empty(size, dtype=torch.uint8, device="cuda")
        del big
        torch.cuda.reset_peak_memory_stats()  # what nanotron's log_memory does
        small = torch.empty(size // 4, dtype=torch.uint8, device="cuda")
        del small
    assert peaks.allocated >= before + size
    assert torch.cuda.max_memory_allocated() < before + size  # the reset did happen
    assert torch.cuda.reset_peak_memory_stats is reset  # restored on exit


def test_without_a_reset_it_is_the_allocators_peak():
    with StepPeaks() as peaks:
        x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
        del x
    assert peaks.allocated == torch.cuda.max_memory_allocated()
