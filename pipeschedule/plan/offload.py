"""What the planner counts for a rank that offloads its stashes to host memory.

    streamed_device_peak(simulated, stashes) the device bytes of a rank that streams its stashes

The offload pass is `pipeschedule.compiler.offload.add_offload`, the `--offload` spec
`pipeschedule.compiler.offload_spec`, and the search within a step-time budget
`pipeschedule.simulate.offload_search.choose_offload`.
"""

from __future__ import annotations

from collections.abc import Sequence


def streamed_device_peak(simulated: float, stashes: Sequence[float]) -> float:
    """The device bytes a planner counts for the saved activations of a rank that streams
    its stashes to host memory: the simulator's peak, but at least the largest stash of
    one (stage, microbatch) of the rank.

    [Note: streamed offload floor] Measured on the H200 (benchmarks/results/
    auto_engine_offload_rules.md: nanotron's Llama, pp=4 as four ranks on one GPU, 64 MiB
    chunks), the runtime kept 0.45 of stage 0's stash on the device where the simulator
    said 0.15 for the same run (it does not see the chunks that wait for their copy's event
    while others are copied, nor ranks sharing a link). Both the planner and `pp_engine:
    auto` therefore count an offloading rank with one whole stash: an upper bound on what
    was measured, so what they say fits did fit.
    """
    return max(simulated, max(stashes, default=0.0))


__all__ = ["streamed_device_peak"]
