"""Memory of one GPU of each pipeline rank under a schedule: stage footprints
(memory.py) plus the peaks the simulator reads off the schedule's program order.

`stash_buffers` / `p2p_buffers` turn footprints into the simulator's per-stage
buffer_bytes; `rank_memory` combines the resulting `peak_bytes` with the static and
transient terms into one `RankMemory` per rank ([Note: memory terms] in memory.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipeschedule.memory import StageFootprint


def stash_buffers(footprints: Sequence[StageFootprint]) -> dict[str, tuple[int, ...]]:
    """The simulator's buffer_bytes counting saved activations only (see `rank_memory`)."""
    return {"stash": tuple(fp.stash_bytes for fp in footprints)}


def p2p_buffers(footprints: Sequence[StageFootprint]) -> dict[str, tuple[int, ...]]:
    """The simulator's buffer_bytes counting the tensors that cross stage boundaries: the
    sent output and both gradients (a received input is also the first layer's saved
    input, so it is counted with the stash; stage 0's input is the token ids)."""
    boundary = tuple(fp.boundary for fp in footprints)
    ids = tuple(fp.input_bytes if fp.first else 0 for fp in footprints)
    return {"act_in": ids, "act_out": boundary, "grad_out": boundary, "grad_in": boundary}


# -- one rank under a schedule ---------------------------------------------------------------

ACTIVATIONS, P2P, GRADS = "activations", "p2p buffers", "bf16 gradients (transient)"


@dataclass(frozen=True)
class RankMemory:
    """Peak memory of one GPU of pipeline rank `rank` under a schedule.

    terms: bytes by term in display order: the static terms summed over the rank's stages,
    "activations" (the simulator's peak of live saved activations), "p2p buffers" (its
    peak of boundary tensors), the bf16 gradients of a backward, and the largest working
    set. Peaks of different kinds are added (an upper bound: they need not coincide).
    inflight: the most microbatches (stage-microbatches when interleaved) in flight.
    """

    rank: int
    stages: tuple[int, ...]
    layers: tuple[int, ...]
    inflight: int
    terms: Mapping[str, float]
    budget: float

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    @property
    def overflow(self) -> float:
        """Bytes over budget (negative: headroom)."""
        return self.total - self.budget

    @property
    def parameter_bytes(self) -> float:
        return self.terms.get("weights", 0)

    @property
    def gradient_bytes(self) -> float:
        return sum(self.terms.get(k, 0) for k in ("fp32 grad accumulator", "gradients", "DDP grad buckets", GRADS))

    @property
    def optimizer_bytes(self) -> float:
        return sum(self.terms.get(k, 0) for k in ("fp32 master weights", "Adam moments"))

    @property
    def activation_bytes(self) -> float:
        return self.terms.get(ACTIVATIONS, 0) + self.terms.get(P2P, 0)

    def to_dict(self) -> dict:
        return {
            "rank": self.rank, "stages": list(self.stages), "layers": list(self.layers),
            "inflight": self.inflight, "terms": {k: float(v) for k, v in self.terms.items()},
            "total": float(self.total), "budget": float(self.budget), "fits": self.fits,
        }


def rank_memory(
    footprints: Sequence[StageFootprint],
    placement: Sequence[int],
    *,
    peak_stash: Sequence[float],
    peak_p2p: Sequence[float],
    peak_inflight: Sequence[int],
    budget: float,
) -> list[RankMemory]:
    """Combine stage footprints with a schedule's simulated peaks, one entry per rank.

    peak_stash[r] / peak_p2p[r]: the simulator's `peak_bytes` of rank r with
    `stash_buffers` / `p2p_buffers` as the cost model's buffer_bytes.
    """
    out = []
    for r in range(len(peak_stash)):
        stages = tuple(s for s, rank in enumerate(placement) if rank == r)
        terms: dict[str, float] = {}
        for s in stages:
            for key, value in footprints[s].static.items():
                terms[key] = terms.get(key, 0) + value
        terms[ACTIVATIONS] = float(peak_stash[r])
        terms[P2P] = float(peak_p2p[r])
        grads = sum(footprints[s].grads_transient for s in stages)
        if grads:
            terms[GRADS] = grads
        name, value = max((footprints[s].working for s in stages), key=lambda w: w[1], default=("", 0))
        if value:
            terms[name] = float(value)
        out.append(RankMemory(
            rank=r, stages=stages, layers=tuple(footprints[s].layers for s in stages),
            inflight=int(peak_inflight[r]), terms=terms, budget=float(budget),
        ))
    return out


__all__ = ["ACTIVATIONS", "GRADS", "P2P", "RankMemory", "p2p_buffers", "rank_memory", "stash_buffers"]
