"""What a plan is made of: its config, the compute-cost model, and the evaluated
candidates (plan.py builds and ranks them).

[Note: compute costs] Per microbatch and GPU: a decoder layer's forward is 2 * P * s*b
(P its parameters: q, k, v, o and SwiGLU, GQA counted) plus 4 * s^2 * b * h for the
attention matmuls, all / tp; backward is twice the forward; full recompute adds one more
forward to the backward (4F per layer instead of 3F), selective recompute without flash
adds the attention matmuls. A split-backward schedule (zb_h1, zbv, v_half, v_min) runs
the weight-gradient matmuls, 2 * P * s*b / tp, as W and the rest of the backward
(recompute included) as B. The LM head costs 2 * V * h * s*b / tp forward, twice that
backward; the embedding lookup nothing. Seconds = FLOPs / (peak TFLOP/s * mfu). A message
costs latency + bytes / bandwidth. DP gradient sync and the optimizer step are the same
for every candidate of a plan and are left out, so the throughput is that of the
pipeline alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeschedule.errors import ParameterError
from pipeschedule.generators import FIXED_VIRTUAL
from pipeschedule.memory import GiB, ModelSpec, TrainingSetup, stage_footprints
from pipeschedule.rank_memory import RankMemory
from pipeschedule.limits import MAX_SEARCH_NODES, check_at_most, check_plan_size, check_schedule_size, shown


@dataclass(frozen=True)
class PlanConfig:
    """What a plan is for. gpu_memory / reserve: bytes per GPU and bytes kept back for the
    CUDA context, NCCL buffers and allocator slack (budget = gpu_memory - reserve).
    gpu_tflops / mfu: peak bf16 TFLOP/s and the fraction of it matmuls reach, for absolute
    times only ([Note: compute costs]). p2p_bandwidth (bytes/s) / p2p_latency (s): one
    pipeline message. virtual: chunks per rank of the interleaved candidates. node_limit:
    search budget of each optimal split. offload / host_bandwidth: the offload to report
    for the recommended candidate (None: none) and the host link it runs over (bytes/s
    per direction).
    """

    model: ModelSpec
    setup: TrainingSetup
    pp: int
    microbatches: int
    gpu_memory: float
    reserve: float = 2 * GiB
    gpu_tflops: float = 989.0
    mfu: float = 0.5
    p2p_bandwidth: float = 25e9
    p2p_latency: float = 20e-6
    virtual: int = 2
    node_limit: int = 20_000
    gpu_name: str = "custom"
    offload: object = None  # offload.OffloadPolicy or AutoOffload: what `plan` reports offload would add
    host_bandwidth: float | None = None  # bytes/s per direction of the host link (None: unknown)

    def __post_init__(self) -> None:
        for key in ("pp", "microbatches", "virtual", "node_limit"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParameterError(f"{key} must be an integer >= 1, got {shown(value)}")
        for key in ("gpu_memory", "gpu_tflops", "mfu", "p2p_bandwidth"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ParameterError(f"{key} must be a number > 0, got {shown(value)}")
        if not 0 < self.mfu <= 1:
            raise ParameterError(f"mfu is a fraction of peak in (0, 1], got {shown(self.mfu)}")
        for key in ("reserve", "p2p_latency"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ParameterError(f"{key} must be a number >= 0, got {shown(value)}")
        if self.reserve >= self.gpu_memory:
            raise ParameterError(
                f"reserve {self.reserve / GiB:g} GiB leaves nothing of gpu_memory {self.gpu_memory / GiB:g} GiB"
            )
        if self.model.layers < self.pp:
            raise ParameterError(
                f"pp={self.pp} exceeds the model's {self.model.layers} decoder layers: a stage would get no layer"
            )
        # [Note: size limits], before any candidate is built
        check_plan_size(self.pp, self.microbatches, self.model.layers)
        check_schedule_size(self.pp, self.virtual, self.microbatches)
        check_at_most("node_limit", self.node_limit, MAX_SEARCH_NODES)
        self.setup.check_model(self.model)
        if self.offload is not None and self.host_bandwidth is None:
            raise ParameterError(f"offload needs the host link's bandwidth: give --host-bandwidth GB/s "
                                 f"(presets know gh200 and h200; the GPU here is {shown(self.gpu_name)})")
        if self.host_bandwidth is not None and (isinstance(self.host_bandwidth, bool) or not 0 < self.host_bandwidth < math.inf):
            raise ParameterError(f"host_bandwidth must be a number > 0 (bytes/s), got {shown(self.host_bandwidth)}")

    @property
    def budget(self) -> float:
        return self.gpu_memory - self.reserve

    @property
    def tokens_per_gpu(self) -> int:
        """Tokens one GPU's pipeline processes per step: m * b * s / (tp * pp)."""
        return self.microbatches * self.setup.micro_batch * self.setup.seq / (self.setup.tp * self.pp)


# -- compute costs ------------------------------------------------------------------------------


def layer_seconds(config: PlanConfig) -> tuple[float, float]:
    """(forward, backward) seconds of one decoder layer per microbatch ([Note: compute costs])."""
    m, st = config.model, config.setup
    tokens = st.seq * st.micro_batch
    attention = 4 * st.seq * st.seq * st.micro_batch * m.hidden
    forward = (2 * m.layer_params() * tokens + attention) / st.tp
    backward = 2 * forward
    if st.recompute == "full":
        backward += forward
    elif st.recompute == "selective" and not st.flash:
        backward += attention / st.tp
    rate = config.gpu_tflops * 1e12 * config.mfu
    return forward / rate, backward / rate


def weight_seconds(config: PlanConfig) -> tuple[float, float]:
    """(layer, head) seconds of the weight-gradient part of the backward per microbatch:
    the parameter matmuls once more (2 * P * s*b / tp), attention excluded. A split-backward
    schedule runs it as W and the rest of the backward as B ([Note: compute costs])."""
    m, st = config.model, config.setup
    tokens = st.seq * st.micro_batch
    rate = config.gpu_tflops * 1e12 * config.mfu
    layer = 2 * m.layer_params() * tokens / st.tp / rate
    head = 2 * m.padded_vocab(st.tp) * m.hidden * tokens / st.tp / rate
    return layer, head


def head_seconds(config: PlanConfig) -> tuple[float, float]:
    m, st = config.model, config.setup
    forward = 2 * m.padded_vocab(st.tp) * m.hidden * st.seq * st.micro_batch / st.tp
    rate = config.gpu_tflops * 1e12 * config.mfu
    return forward / rate, 2 * forward / rate


# -- candidates -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """One way to run the pipeline, evaluated.

    family / cap / virtual: the schedule. split: decoder layers per stage; split_kind:
    "nanotron" (nanotron's split), "nanotron=optimal" (the search proved it best),
    "optimal" (found and proven best by `optimal_split`), "no better" (the search proved
    no split of this schedule beats a faster candidate already found; the split shown is
    the best it simulated), "best found" (the search hit its node limit), "least overflow"
    (no split fits; the one that overflows least, without numbers). step_time (s),
    tokens_per_gpu (tokens/s per GPU), memory (per rank).
    note: why a candidate is missing numbers (no split fits, too few layers).
    """

    family: str
    cap: int | tuple[int, ...] | None
    virtual: int
    split: tuple[int, ...] | None
    split_kind: str
    step_time: float | None = None
    tokens_per_gpu: float | None = None
    memory: tuple[RankMemory, ...] = ()
    proven: bool | None = None
    note: str = ""
    relative: float | None = field(default=None, compare=False)

    @property
    def fits(self) -> bool:
        return bool(self.memory) and all(r.fits for r in self.memory)

    @property
    def peak(self) -> RankMemory | None:
        return max(self.memory, key=lambda r: r.total - r.budget, default=None)

    @property
    def label(self) -> str:
        name = "1f1b" if self.family == "1f1b" else self.family
        if self.virtual > 1 and self.family not in FIXED_VIRTUAL:
            name += f" v={self.virtual}"
        if self.cap is not None:
            name += f" cap={cap_text(self.cap)}"
        return name

    def engine(self, nanotron_default: bool = False) -> str:
        """The `parallelism.pp_engine` value our nanotron integration reads (see
        integration/nanotron/engine_spec.py): nanotron's own engine when it is nanotron's
        default, else pipeschedule's with virtual, cap and split inside the value."""
        if nanotron_default:
            return "1f1b"
        name = {"1f1b": "ps_1f1b", "afab": "ps_afab"}.get(self.family, self.family)
        params = []
        if self.virtual > 1 and self.family not in FIXED_VIRTUAL:
            params.append(f"virtual={self.virtual}")
        if self.cap is not None:
            params.append(f"cap={cap_text(self.cap)}")
        if self.split is not None and not self.split_kind.startswith("nanotron"):
            params.append("split=" + "/".join(str(n) for n in self.split))
        return name + (":" + ",".join(params) if params else "")

    def yaml_lines(self, pp: int, nanotron_default: bool = False) -> list[str]:
        return ["parallelism:", f"  pp: {pp}", f"  pp_engine: {self.engine(nanotron_default)}"]

    def to_dict(self) -> dict:
        return {
            "schedule": self.family, "cap": list(self.cap) if isinstance(self.cap, tuple) else self.cap,
            "virtual": self.virtual, "label": self.label,
            "split": list(self.split) if self.split else None, "split_kind": self.split_kind,
            "step_time_s": self.step_time, "tokens_per_s_per_gpu": self.tokens_per_gpu,
            "relative_throughput": self.relative, "fits": self.fits, "proven_optimal": self.proven,
            "pp_engine": self.engine(), "note": self.note,
            "memory": [r.to_dict() for r in self.memory],
        }


def cap_label(cap):
    return tuple(cap) if isinstance(cap, (list, tuple)) else cap


def cap_text(cap) -> str:
    return "/".join(str(c) for c in cap) if isinstance(cap, tuple) else str(cap)


def fitted_caps(config: PlanConfig, split: Sequence[int], p2p: Sequence[float]) -> tuple[int, ...] | None:
    """Per-rank in-flight caps of 1F1B that fit the budget with this split: the most
    microbatches each rank's memory allows (p2p[r]: bytes set aside for its p2p buffers),
    made non-increasing along the pipeline as capped_1f1b needs. None if a rank cannot
    hold one."""
    footprints = stage_footprints(config.model, config.setup, split)
    pp, caps, running = len(split), [], config.microbatches
    for r, fp in enumerate(footprints):
        room = config.budget - fp.static_bytes - fp.grads_transient - fp.working[1] - p2p[r]
        k = int(room // fp.stash_bytes) if fp.stash_bytes > 0 else pp
        running = min(running, k, pp - r)
        if running < 1:
            return None
        caps.append(running)
    return tuple(caps)


__all__ = ["Candidate", "PlanConfig", "cap_label", "cap_text", "fitted_caps", "head_seconds", "layer_seconds",
           "weight_seconds"]
