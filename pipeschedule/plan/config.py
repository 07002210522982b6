"""What a plan is for: its config (`PlanConfig`, or `build_config` in the command line's
units) and the compute-cost model of its candidates (planner.py builds and ranks them).

[Note: compute costs] Per microbatch and GPU: a decoder layer's forward is 2 * P * s*b
(P its parameters: q, k, v, o and SwiGLU, GQA counted) plus 4 * s^2 * b * h for the
attention matmuls, all / tp; backward is twice the forward; full recompute adds one more
forward to the backward (4F per layer instead of 3F), selective recompute without flash
adds the attention matmuls. A split-backward schedule (zb_h1, zbv, v_half, v_min) runs
the weight-gradient matmuls, 2 * P * s*b / tp, as W and the rest of the backward
(recompute included) as B. The LM head costs 2 * V * h * s*b / tp forward, twice that
backward; the embedding lookup nothing. Seconds = FLOPs / (peak TFLOP/s * mfu). A message
costs latency + bytes / bandwidth. The step time adds the data-parallel gradient
reduction and the optimizer step ([Note: step tail] in dp_step.py).

[Note: measured throughput] One run has been measured against these counts: the users'
Llama3-70B at dp=1, pp=4, tp=4, m=16 on GH200s, about 780 tokens/s per GPU with
nanotron's 1F1B (docs/users_case.md, `python -m benchmarks.users_case`). Their fork's
recompute is not known, and it decides the count: recomputing every layer adds a
forward to each backward (4F instead of 3F), and the run then reached 0.62 of 989 TFLOP/s
by this count (the planner at 0.5: 633 tokens/s, 19% low); recomputing nothing (or only
the attention core, which flash-attn makes free), 0.46 (843, 8% high). The bubble is in
the simulated step either way (m=64 is 12% faster per GPU, as the users found). The
memory observations point to the second reading (dp=1 fits "just barely" and each stage
holds ~10 GB less than the one before: reading B there). `--mfu` stays 0.5, and the plan
says the range: a run of the printed plan should give MEASURED_MFU / mfu of the printed
tokens/s, 0.92x to 1.24x at 0.5. The attention count, 4 s^2 h per layer, is the full
matrix; flash-attn's causal kernel computes about half of it (6.8% of a 70B layer's
count at seq 8192), one of the things the fraction absorbs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeschedule.errors import ParameterError
from pipeschedule.plan.memory import GiB, ModelSpec, TrainingSetup
from pipeschedule.compiler.offload_spec import parse_offload
from pipeschedule.plan.partition import nanotron_stages
from pipeschedule.plan.presets import (DTYPE_BYTES, gpu_preset, host_bandwidth as host_link, host_link_source,
                                       load_model, model_preset)
from pipeschedule.checks import (
    MAX_SEARCH_NODES,
    check_at_most,
    check_int,
    check_number,
    check_plan_size,
    check_schedule_size,
    shown,
)


MEASURED_MFU = (0.46, 0.62)  # [Note: measured throughput]: the one measured run, by its two recompute readings


@dataclass(frozen=True)
class PlanConfig:
    """What a plan is for. gpu_memory / reserve: bytes per GPU and bytes kept back for the
    CUDA context, NCCL buffers and allocator slack (budget = gpu_memory - reserve).
    gpu_tflops / mfu: peak bf16 TFLOP/s and the fraction of it matmuls reach, for absolute
    times only ([Note: compute costs]). p2p_bandwidth (bytes/s) / p2p_latency (s): one
    pipeline message. virtual: the most chunks per rank of the interleaved candidates
    (each count up to it is tried, [Note: virtual counts]). node_limit:
    search nodes of each optimal split, within the budget a plan's searches share
    ([Note: plan search budget] in splits.py). offload / host_bandwidth: the offload to report
    for the recommended candidate (None: none) and the host link it runs over (bytes/s
    per direction), which the offload lever also runs over. host_memory: bytes per GPU
    the offloaded stashes may take on the host (None: no bound). host_link_source: where
    host_bandwidth comes from, "given" (by the caller), "measured" (a preset whose copies
    were timed) or "vendor" (a preset's datasheet figure), which decides whether an
    offloading candidate may be recommended ([Note: offload advice]).
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
    virtual: int = 4
    node_limit: int = 20_000
    gpu_name: str = "custom"
    offload: object = None  # offload.OffloadPolicy or AutoOffload: what `plan` reports offload would add
    host_bandwidth: float | None = None  # bytes/s per direction of the host link (None: unknown)
    host_memory: float | None = None  # bytes of host memory per GPU offloaded stashes may take (None: no bound)
    dp_bandwidth: float = 25e9  # bytes/s per GPU of the data-parallel collectives ([Note: step tail])
    hbm_bandwidth: float = 4e12  # bytes/s of GPU memory, for the optimizer step
    host_link_source: str = "given"  # "given", "measured" or "vendor" ([Note: offload advice])
    dtype: str | None = None  # nanotron's model.dtype (DTYPE_BYTES); None: named by setup.param_bytes

    def __post_init__(self) -> None:
        for key in ("pp", "microbatches", "virtual", "node_limit"):
            check_int(key, getattr(self, key))
        for key in ("gpu_memory", "gpu_tflops", "mfu", "p2p_bandwidth", "dp_bandwidth", "hbm_bandwidth"):
            check_number(key, getattr(self, key), above=True)
        if not 0 < self.mfu <= 1:
            raise ParameterError(f"mfu is a fraction of peak in (0, 1], got {shown(self.mfu)}")
        for key in ("reserve", "p2p_latency"):
            check_number(key, getattr(self, key))
        if self.reserve >= self.gpu_memory:
            raise ParameterError(
                f"reserve {self.reserve / GiB:g} GiB leaves nothing of gpu_memory {self.gpu_memory / GiB:g} GiB"
            )
        if self.model.layers < self.pp and nanotron_stages(self.model, self.pp)[1] != self.pp - 1:
            # Fewer layers than stages plan only where nanotron's own split still ends at the
            # LM head on the last stage (a stage of the final norm or the head alone, which
            # nanotron trains); the alternatives need a layer per stage and are left out.
            raise ParameterError(
                f"pp={self.pp} exceeds the model's {self.model.layers} decoder layers: a stage would get no layer, "
                f"and nanotron's split puts the LM head on stage {nanotron_stages(self.model, self.pp)[1]}, not the "
                f"last"
            )
        # [Note: size limits], before any candidate is built
        check_plan_size(self.pp, self.microbatches, self.model.layers)
        check_schedule_size(self.pp, self.virtual, self.microbatches)
        check_at_most("node_limit", self.node_limit, MAX_SEARCH_NODES)
        self.setup.check_model(self.model)
        if self.offload is not None and self.host_bandwidth is None:
            raise ParameterError(f"offload needs the host link's bandwidth: give --host-bandwidth GB/s "
                                 f"(presets know gh200 and h200; the GPU here is {shown(self.gpu_name)})")
        if self.host_bandwidth is not None:
            check_number("host_bandwidth", self.host_bandwidth, above=True, hint=" (bytes/s)")
        if self.host_memory is not None:
            check_number("host_memory", self.host_memory, hint=" (bytes per GPU)")
        if self.dtype is not None:
            if self.dtype not in DTYPE_BYTES:
                raise ParameterError(f"dtype must be one of {', '.join(DTYPE_BYTES)} (nanotron's model.dtype), got "
                                     f"{shown(self.dtype)}")
            if DTYPE_BYTES[self.dtype] != self.setup.param_bytes or self.setup.param_bytes != self.setup.act_bytes:
                raise ParameterError(f"dtype {self.dtype} is {DTYPE_BYTES[self.dtype]} bytes a value, but the setup "
                                     f"counts param_bytes={self.setup.param_bytes}, act_bytes={self.setup.act_bytes}")
        if self.host_link_source not in HOST_LINK_SOURCES:
            raise ParameterError(f"host_link_source must be one of {', '.join(HOST_LINK_SOURCES)}, got "
                                 f"{shown(self.host_link_source)}")

    @property
    def dtype_name(self) -> str | None:
        """nanotron's model.dtype this plan counts: `dtype`, else the one its setup's bytes
        name (2: bfloat16, nanotron's default; 4: float32), else None."""
        if self.dtype is not None:
            return self.dtype
        if self.setup.param_bytes == self.setup.act_bytes:
            return {2: "bfloat16", 4: "float32"}.get(self.setup.param_bytes)
        return None

    @property
    def offload_recommendable(self) -> bool:
        """Whether a candidate that moves stashes to the host may be recommended
        ([Note: offload advice])."""
        return self.host_link_source != "vendor" or self.host_memory is not None

    @property
    def budget(self) -> float:
        return self.gpu_memory - self.reserve

    @property
    def tokens_per_gpu(self) -> int:
        """Tokens one GPU's pipeline processes per step: m * b * s / (tp * pp)."""
        return self.microbatches * self.setup.micro_batch * self.setup.seq / (self.setup.tp * self.pp)


HOST_LINK_SOURCES = ("given", "measured", "vendor")

# [Note: offload advice] A candidate that moves stashes to host memory is timed over the
# host link, so it is recommended only where that link's figure can be trusted: measured
# (a preset whose copies were timed, presets.MEASURED_HOST_LINKS), given by the user
# (--host-bandwidth, their own figure), or where the user asks for offload by bounding
# the host memory it may take (--host-memory). Over a datasheet figure alone (GH200's
# NVLink-C2C, 450 GB/s a direction: no offload plan has run over it) the offload rows are
# still planned and listed, and the fastest is shown as an option with the link it
# assumes, but the recommendation is the fastest candidate without offload.


# [Note: virtual counts] Interleaving is tried at the chunk counts v = 2 .. config.virtual
# (default 4) that give every one of the pp * v chunks a decoder layer; a count that
# leaves a chunk without one is named in the plan's `dropped` with the arithmetic. Chunks
# need not hold equal numbers of layers (the engines run any split, and the split search
# balances them): asking for equal chunks would drop interleaving from Llama3-405B at
# pp=16 (126 layers over 32 chunks), which the search has always covered. Of the counts,
# `fitting.virtual_tried` keeps those from the fewest up while each one's pipeline at
# nanotron's split is faster than the count's before it (more chunks shorten the bubble
# and add messages). The capped forms are tried at the fewest chunks only: a cap of v*k
# stage-microbatches holds about k microbatches whatever v, and each further count's
# capped split searches cost seconds (the users' case: 3.5 s of CPU per lever
# combination at v=4) for rows that run at a third of 1F1B's throughput.


def virtual_counts(config: PlanConfig) -> tuple[tuple[int, ...], tuple[tuple[str, str], ...]]:
    """([Note: virtual counts]) (the chunk counts per rank tried for interleaving, and
    (candidate, why) for each count up to config.virtual not tried)."""
    pp, L = config.pp, config.model.layers
    if pp == 1:
        return (), ()
    tried, dropped = [], []
    for v in range(2, config.virtual + 1):
        if L < pp * v:
            dropped.append((f"interleaved_1f1b v={v}", f"{L} layers over pp*v = {pp * v} chunks leaves a chunk "
                                                       "without a layer"))
        else:
            tried.append(v)
    return tuple(tried), tuple(dropped)


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
    elif st.recompute == "selective" and st.scores_materialised:
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


# -- in the command line's units ---------------------------------------------------------------


RATE_FLOOR = 1e-3  # GB/s and TFLOP/s: below it a step takes longer than a float counts (1e-310 GB/s overflowed)


def _scaled(flag: str, value: float | None, scale: float, unit: str, *, zero_ok: bool = False,
            floor: float = 0.0) -> float | None:
    """`value`, given in the command line's `unit`, times `scale` (None stays None);
    ParameterError naming `flag` and the value as given unless it is a finite number > 0
    (>= 0 with `zero_ok`; >= `floor` where one is given) whose scaled value is finite too."""
    if value is None:
        return None
    check_number(flag, value, above=not zero_ok, hint=f" ({unit})")
    if value < floor:
        raise ParameterError(f"{flag} must be at least {floor:g} {unit}, got {shown(value)}")
    out = value * scale
    if not math.isfinite(out):
        raise ParameterError(f"{flag} {shown(value)} {unit} is too large to count with (it overflows a float)")
    return out


def build_config(
    model, *, pp: int, microbatches: int, tp: int = 1, dp: int = 1, zero_stage: int = 0, seq: int = 8192,
    micro_batch: int = 1, recompute: str = "none", sequence_parallel: bool = True,
    fp32_grad_accum: bool = True, ddp_buckets: bool = True, activation_formula: str = "nanotron",
    gpu: str | None = "gh200", gpu_memory: float | None = None, reserve: float = 2.0,
    gpu_tflops: float | None = None, mfu: float = 0.5, p2p_bandwidth: float = 25.0, p2p_latency: float = 20.0,
    virtual: int = 4, node_limit: int = 20_000, offload=None, host_bandwidth: float | None = None,
    dp_bandwidth: float = 25.0, tp_async: bool = False, attention: str = "flash-attn", adam_fused: bool = True,
    host_memory: float | None = None, dtype: str = "bfloat16",
):
    """A PlanConfig in the command line's units: `model` a preset name, a model file path
    or a ModelSpec; gpu_memory and reserve in GiB (gpu_memory overrides the `gpu` preset),
    p2p_bandwidth, dp_bandwidth and host_bandwidth in GB/s, p2p_latency in microseconds, host_memory
    in GiB per GPU (None: offloaded stashes unbounded); offload an
    `--offload` spec, an OffloadPolicy or an AutoOffload; dtype nanotron's model.dtype
    (DTYPE_BYTES: the bytes of a weight and of an activation value)."""
    if isinstance(model, str):
        model = load_model(model) if model.endswith((".yaml", ".yml", ".json")) else model_preset(model)
    if not isinstance(model, ModelSpec):
        raise ParameterError(f"model must be a preset name, a model file or a ModelSpec, got {shown(model)}")
    if dtype not in DTYPE_BYTES:
        raise ParameterError(f"--dtype must be one of {', '.join(DTYPE_BYTES)} (nanotron's model.dtype), got "
                             f"{shown(dtype)}")
    setup = TrainingSetup(
        param_bytes=DTYPE_BYTES[dtype], act_bytes=DTYPE_BYTES[dtype],
        tp=tp, dp=dp, zero_stage=zero_stage, seq=seq, micro_batch=micro_batch, recompute=recompute,
        sequence_parallel=sequence_parallel, fp32_grad_accum=fp32_grad_accum,
        ddp_buckets=ddp_buckets, activation_formula=activation_formula, tp_async=tp_async, attention=attention,
        adam_fused=adam_fused,
    )
    if gpu_memory is None and gpu is None:
        raise ParameterError("give a GPU preset (gpu=) or its memory in GiB (gpu_memory=)")
    preset = gpu_preset(gpu) if gpu is not None else {"memory": None, "tflops": 989.0}
    memory = _scaled("--gpu-memory", gpu_memory, GiB, "GiB") if gpu_memory is not None else preset["memory"]
    _scaled("--gpu-tflops", gpu_tflops, 1e12, "TFLOP/s", floor=RATE_FLOOR)  # used as FLOP/s
    link, source = host_link(gpu, host_bandwidth), host_link_source(gpu, host_bandwidth)
    return PlanConfig(
        model=model, setup=setup, pp=pp, microbatches=microbatches, gpu_memory=memory,
        reserve=_scaled("--reserve", reserve, GiB, "GiB", zero_ok=True),
        gpu_tflops=gpu_tflops if gpu_tflops is not None else preset["tflops"], mfu=mfu,
        p2p_bandwidth=_scaled("--p2p-bandwidth", p2p_bandwidth, 1e9, "GB/s", floor=RATE_FLOOR),
        p2p_latency=_scaled("--p2p-latency", p2p_latency, 1e-6, "microseconds", zero_ok=True),
        virtual=virtual, node_limit=node_limit, gpu_name=gpu if gpu_memory is None else f"{gpu_memory:g} GiB",
        offload=parse_offload(offload) if isinstance(offload, str) else offload,
        host_bandwidth=_scaled("--host-bandwidth", link, 1e9, "GB/s", floor=RATE_FLOOR),
        dp_bandwidth=_scaled("--dp-bandwidth", dp_bandwidth, 1e9, "GB/s", floor=RATE_FLOOR),
        hbm_bandwidth=preset.get("hbm", 4.0) * 1e12,
        host_memory=_scaled("--host-memory", host_memory, GiB, "GiB", zero_ok=True),
        host_link_source=source or "given", dtype=dtype,
    )


__all__ = ["MEASURED_MFU", "PlanConfig", "build_config", "head_seconds", "layer_seconds", "virtual_counts",
           "weight_seconds"]
