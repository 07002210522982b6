"""What a step costs after the pipeline: the data-parallel gradient reduction and the
optimizer step, as nanotron runs them.

[Note: step tail] Per pipeline rank r with P_r parameters on its GPU, dp replicas, a
ring collective over `dp_bandwidth` bytes/s per GPU, and the optimizer streaming its
state through `hbm_bandwidth`:

    ZeRO-0, dp > 1      torch DDP all-reduces the gradients (fp32 under fp32 accumulation:
                        nanotron's `fp32_accum_hook`, helpers.py:237-255) in buckets while
                        the last microbatch's backward runs (`ddp_trigger_sync_in_bwd`), so
                        only what outlasts rank r's last backward is exposed
    ZeRO-1, fp32 accum  no DDP (trainer.py:608-610): after the pipeline the trainer
                        all-reduces every fp32 gradient (`sync_gradients_across_dp` with
                        reduce_scatter=False, trainer.py:341-350), not overlapped; after
                        the optimizer step ZeroDistributedOptimizer all-gathers the bf16
                        parameters (2 bytes each)
    ZeRO-1, bf16 grads  DDP as under ZeRO-0 (bf16 gradients), then the all-gather
    optimizer step      AdamW over the rank's shard (P_r / dp under ZeRO-1): 30 bytes per
                        parameter with fp32 accumulation (read grad, master, two moments;
                        write master, moments, bf16 weight), 14 without

An all-reduce moves 2 (dp-1)/dp of the buffer per GPU, an all-gather (dp-1)/dp. The step
waits for the slowest rank, so the tail is the largest over ranks. The tied-embedding
gradient sync and gradient clipping are left out (small next to these).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeschedule.plan.memory import TrainingSetup, builds_ddp


def rank_tail(setup: TrainingSetup, params: int, last_backward: float, *, dp_bandwidth: float,
              hbm_bandwidth: float) -> dict[str, float]:
    """Seconds of one rank's step tail by part ([Note: step tail])."""
    dp = setup.dp
    grad_bytes = params * (4 if setup.fp32_grad_accum else setup.param_bytes)
    out = {}
    if dp > 1:
        allreduce = 2 * (dp - 1) / dp * grad_bytes / dp_bandwidth
        if builds_ddp(setup):
            out["DP all-reduce (exposed)"] = max(0.0, allreduce - last_backward)
        else:
            out["DP all-reduce (after the pipeline)"] = allreduce
        if setup.zero_stage:
            out["ZeRO-1 all-gather"] = (dp - 1) / dp * params * setup.param_bytes / dp_bandwidth
    shard = params / (dp if setup.zero_stage else 1)
    out["optimizer step"] = shard * (30 if setup.fp32_grad_accum else 14) / hbm_bandwidth
    return out


def step_tail(setup: TrainingSetup, params: Sequence[int], placement: Sequence[int],
              backward: Sequence[float], *, dp_bandwidth: float, hbm_bandwidth: float,
              shared: Sequence[int] = ()) -> tuple[float, dict]:
    """(seconds, the slowest rank's parts) of the tail after the pipeline; params[s]: the
    parameters of stage s on one GPU, backward[s]: one microbatch's backward seconds of
    stage s (B + W); shared[r]: parameters rank r's stages count twice (memory.shared_params)."""
    worst, parts = 0.0, {}
    for r in range(max(placement) + 1):
        stages = [s for s, p in enumerate(placement) if p == r]
        held = sum(params[s] for s in stages) - (shared[r] if r < len(shared) else 0)
        tail = rank_tail(setup, held, sum(backward[s] for s in stages),
                         dp_bandwidth=dp_bandwidth, hbm_bandwidth=hbm_bandwidth)
        if sum(tail.values()) >= worst:
            worst, parts = sum(tail.values()), dict(tail, rank=r)
    return worst, parts


__all__ = ["rank_tail", "step_tail"]
