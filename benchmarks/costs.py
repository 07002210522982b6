"""Cost files for `pipeschedule simulate --cost` from measured block times. Pure Python
(no torch), so that simulations from saved calibrations run anywhere."""

from __future__ import annotations

P2P_LATENCY_MS = 0.02  # assumed NCCL point-to-point latency between GPUs of one node
P2P_GBPS = 100.0  # assumed NCCL point-to-point bandwidth between GPUs of one node, GB/s


def stage_costs(times: dict, split: tuple[int, ...], buffer_bytes: dict, *, split_backward: bool,
                latency_ms: float = P2P_LATENCY_MS, gbps: float = P2P_GBPS,
                weight_stash: list[int] | None = None) -> dict:
    """A `pipeschedule simulate --cost` file (times in ms) for stages holding `split` decoder
    layers (the embedding on the first, the head and loss on the last). With
    `split_backward`, B is the input-gradient part and W the rest (for schedules with W).
    `buffer_bytes`: kind -> {stage: bytes}. `weight_stash`: per stage, the bytes a stash
    keeps from B to W (written only with `split_backward`)."""
    last = len(split) - 1
    forward, backward, weight = [], [], []
    for s, layers in enumerate(split):
        parts = [("layer", layers)] + ([("embedding", 1)] if s == 0 else []) + ([("head_loss", 1)] if s == last else [])
        f = sum(times[name]["forward"] * n for name, n in parts)
        full = sum(times[name]["backward"] * n for name, n in parts)
        w = sum(times[name]["weight"] * n for name, n in parts)
        forward.append(round(f, 4))
        backward.append(round(full - w if split_backward else full, 4))
        weight.append(round(w if split_backward else 0.0, 4))
    stages = len(split)
    buffers = {kind: [int(per_stage.get(str(s), per_stage.get(s, 0))) for s in range(stages)]
               for kind, per_stage in buffer_bytes.items()}
    out = {"forward": forward, "backward": backward, "weight": weight, "buffer_bytes": buffers,
           "latency": latency_ms, "bandwidth": gbps * 1e9 / 1e3}  # bytes per ms
    if split_backward and weight_stash is not None:
        out["weight_stash"] = [int(b) for b in weight_stash]
    return out
