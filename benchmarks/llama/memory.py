"""Memory of the project's Llama (model.py here) per pipeline rank under a lowered
schedule, term by term, counted the way the runtime's ledger counts it, so that a
prediction can be checked against a measurement (probe.py). Pure arithmetic: no torch.
(The planner's model of a Llama at scale is `pipeschedule.plan.memory`; this one
builds on its terms.)

`predict_ranks(model, setup, split, schedule)` returns, per rank, bytes by term:

    parameters               the rank's parameters (param dtype)
    gradients                their `.grad` after backward (param dtype; no fp32 accumulation)
    optimizer state          torch.optim.AdamW on the parameters in their dtype: exp_avg and
                             exp_avg_sq, plus one fp32 `step` scalar per parameter tensor
                             (0 with optimizer "none")
    stash per microbatch     what autograd saves during one microbatch's F on the rank
                             ([Note: what the integration Llama saves])
    stash peak               the simulator's peak of live stash on the rank under the schedule
                             (with W: each stash shrinks at its B to what W keeps,
                             `weight_stash`, as the ledger's `resize` does)
    p2p buffers peak         its peak of live boundary tensors (act_in, act_out, grad_out,
                             grad_in), each the packed boundary ([Note: packed boundary])
    working set (transient)  an estimate of the largest short-lived allocation (`working_set`;
                             checked on a GPU only: CPU has no allocator statistics)
    step peak                what the allocator should report as the step's peak:
                             parameters + optimizer state + the peak of live buffers and
                             gradients together
                             ([Note: gradients appear at the first backward]) + the working set

[Note: what the integration Llama saves] Saved-for-backward storages of one microbatch,
read from llama.py and checked tensor by tensor with saved_tensors_hooks (torch 2.13,
CPU). s sequence, b micro-batch size, h hidden, a heads, d = h/a, f ffn, V vocab,
e bytes of the activation dtype, w = max(e, 4) (RMSNorm computes its statistics in at
least fp32). Each storage is counted once, at its full size, as the ledger does.

  each decoder layer
    input RMSNorm      input in fp32: `x.to(fp32)`, saved by pow and mul   s*b*h*w
                       (fp32: that is x itself, so on a stage's first layer it is the
                       received act_in, which the ledger counts as p2p, not stash; bf16:
                       an fp32 copy, always counted, and x itself is not saved)
                       rsqrt(mean(x^2) + eps), fp32                          s*b*w
                       normalised x in the act dtype (saved by `* weight`)   s*b*h*e
                       output (input of q_proj and kv_proj, one storage)     s*b*h*e
    rotary             cos and sin tables, one pair for q and one for k      4*s*d*e
                       (`x * cos` saves the table, not x: the table needs no grad)
    SDPA (CPU flash)   q after rotary, k and v repeated to all a heads (the  4*s*b*h*e
                       `repeat` copies, so GQA saves nothing here), and the
                       output (o_proj's input is a view of it)
                       logsumexp, fp32                                       a*s*b*4
    residual           x + attention, in fp32 (post norm's pow and mul)      s*b*h*w
                       (bf16: its fp32 copy; the bf16 sum itself is not saved)
    post RMSNorm       rsqrt s*b*w, normalised s*b*h*e, output (gate_up_proj's input) s*b*h*e
    SwiGLU             gate_up output (silu saves gate, the product saves up:  2*s*b*f*e
                       two views of one storage)
                       silu(gate) (saved by the product)                     s*b*f*e
                       silu(gate) * up (down_proj's input)                   s*b*f*e
    not saved          q_proj / kv_proj outputs before rotary and repeat, o_proj and
                       down_proj outputs, the layer's output (the next block saves it as
                       its input, or it leaves the stage)
  first stage          token ids (F.embedding saves the indices), int64         s*b*8
  last stage           final RMSNorm: input (same rule as a layer's), rsqrt,
                       normalised, output (the LM head's input)
                       log_softmax output of the fp32 logits (cross_entropy)  s*b*V*4
                       (the logits themselves, and their fp32 cast, are not saved)
                       labels, int64 (nll_loss's target)                      s*b*8
                       label mask as fp32 (`per_token * mask`)                s*b*4
                       two fp32 scalars: nll_loss's total_weight, mask.sum()  8

On CUDA the attention saves the same q, k, v, output and fp32 logsumexp, plus its RNG
state: 16 bytes per layer with the flash kernel (measured on an H200, torch 2.11, bf16:
every other term agreed to the byte), `attention_rng_bytes`. The memory-efficient kernel
pads the logsumexp's sequence axis to a multiple of 32 (`attention_lse_pad`; not measured).

Boundaries ([Note: packed boundary] in integration/nanotron/pipeline/boundary.py): a stage sends
one packed tensor of the act dtype: the hidden states (s*b*h*e) and, when the next
stage starts with a decoder layer, the bool sequence mask as raw bytes rounded up to
whole elements. Received gradients and sent input gradients have the same size. Stage
0's act_in is 0 in the ledger (the nanotron engine feeds the data loader outside the
executor); its token ids are counted in the stash, since the embedding saves them.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeschedule.errors import ParameterError
from pipeschedule.compiler.ir import Op, Schedule
from pipeschedule.plan.memory import (
    ModelSpec,
    StageFootprint,
    TrainingSetup,
    stage_params,
    static_per_param,
)
from pipeschedule.plan.memory import ACTIVATIONS, P2P, rank_memory
from pipeschedule.simulate import CostModel, simulate

TERMS = (
    "parameters",
    "gradients",
    "optimizer state",
    "stash per microbatch",
    "stash peak",
    "p2p buffers peak",
    "working set (transient)",
    "step peak",
)
LAYER_TENSORS = 7  # parameter tensors of a decoder layer: 2 norms, q, kv, o, gate_up, down
STEP_BYTES = 4  # AdamW's per-tensor `step` (an fp32 scalar unless capturable/fused)


def _wide(setup: TrainingSetup) -> int:
    """Bytes of RMSNorm's statistics dtype: promote(act dtype, fp32)."""
    return max(setup.act_bytes, 4)


def rmsnorm_stash(model: ModelSpec, setup: TrainingSetup, *, input_received: bool, prefix: str) -> dict[str, int]:
    """What one RMSNorm followed by a projection saves ([Note: what the integration Llama saves])."""
    sb, h, e, w = setup.seq * setup.micro_batch, model.hidden, setup.act_bytes, _wide(setup)
    received_fp32 = input_received and e >= 4  # x.to(fp32) is x itself: the act_in
    return {
        f"{prefix} input (fp32)": 0 if received_fp32 else sb * h * w,
        f"{prefix} rsqrt": sb * w,
        f"{prefix} normalised": sb * h * e,
        f"{prefix} output": sb * h * e,
    }


def decoder_layer_stash(model: ModelSpec, setup: TrainingSetup, *, input_received: bool = False,
                        attention_lse_pad: int = 1, attention_rng_bytes: int = 0) -> dict[str, int]:
    """Bytes one decoder layer saves per microbatch, by tensor. input_received: the layer
    is the first of a stage that receives its input (then, in fp32, its input is the
    ledger's act_in, not stash). attention_lse_pad: the logsumexp's sequence axis is
    rounded up to a multiple of this (1 on CPU and for CUDA's flash kernel).
    attention_rng_bytes: the kernel's saved RNG state (0 on CPU; 16 on CUDA's flash
    kernel: philox seed and offset, int64 each; seen on an H200 with torch 2.11)."""
    s, b, h, a, f = setup.seq, setup.micro_batch, model.hidden, model.heads, model.ffn
    e, sb = setup.act_bytes, s * b
    lse_seq = -(-s // attention_lse_pad) * attention_lse_pad
    out = rmsnorm_stash(model, setup, input_received=input_received, prefix="input norm:")
    out["rotary cos, sin (q and k)"] = 4 * s * model.head_dim * e
    out["attention q, k, v (all heads)"] = 3 * sb * h * e
    out["attention output"] = sb * h * e
    out["attention logsumexp (fp32)"] = a * b * lse_seq * 4
    if attention_rng_bytes:
        out["attention RNG state"] = attention_rng_bytes
    out.update(rmsnorm_stash(model, setup, input_received=False, prefix="post norm:"))
    out["gate_up output"] = 2 * sb * f * e
    out["silu(gate)"] = sb * f * e
    out["silu(gate) * up"] = sb * f * e
    return out


def head_stash(model: ModelSpec, setup: TrainingSetup, *, input_received: bool) -> dict[str, int]:
    """Bytes the last stage's final norm, LM head and loss save per microbatch."""
    sb = setup.seq * setup.micro_batch
    out = rmsnorm_stash(model, setup, input_received=input_received, prefix="final norm:")
    out["log_softmax of fp32 logits"] = sb * model.vocab * 4
    out["labels (int64)"] = sb * 8
    out["label mask (fp32)"] = sb * 4
    out["loss scalars (fp32)"] = 2 * 4
    return out


def embedding_stash(model: ModelSpec, setup: TrainingSetup) -> dict[str, int]:
    return {"token ids (int64)": setup.seq * setup.micro_batch * 8}


def packed_boundary_bytes(model: ModelSpec, setup: TrainingSetup, *, with_mask: bool) -> int:
    """The one tensor crossing a stage boundary: hidden states plus, if `with_mask`, the
    bool sequence mask as raw bytes padded to whole act-dtype elements."""
    sb, e = setup.seq * setup.micro_batch, setup.act_bytes
    mask = -(-sb // e) * e if with_mask else 0
    return sb * model.hidden * e + mask


def stage_stash(model: ModelSpec, setup: TrainingSetup, layers: int, *, first: bool, last: bool,
                attention_lse_pad: int = 1, attention_rng_bytes: int = 0) -> dict[str, int]:
    """Stash of one stage per microbatch, by part: embedding ids, each decoder layer, head."""
    out: dict[str, int] = {}
    if first:
        out.update(embedding_stash(model, setup))
    for i in range(layers):
        layer = decoder_layer_stash(model, setup, input_received=not first and i == 0,
                                    attention_lse_pad=attention_lse_pad, attention_rng_bytes=attention_rng_bytes)
        out[f"decoder layer {i}"] = sum(layer.values())
    if last:
        out["final norm + LM head + loss"] = sum(
            head_stash(model, setup, input_received=not first and layers == 0).values())
    return out


def weight_stash(model: ModelSpec, setup: TrainingSetup, layers: int, *, last: bool) -> int:
    """Bytes a stage's stash keeps from its B to its W under a split backward
    ([Note: split backward] in pipeschedule/runtime/split_backward.py): for each deferred linear,
    its input and the gradient of its output, each storage once. Per decoder layer the
    inputs are the normalised input (shared by q_proj and kv_proj), the attention output
    (o_proj), the normalised residual (gate_up_proj) and silu(gate) * up (down_proj); the
    output gradients are those of q, kv, o, gate_up and down. On the last stage the LM
    head adds its input and its logits' gradient. Embedding and norms have no linear.
    Checked against the ledger's `resized` of a zb_h1 run (tests/nanotron/test_memory_calibration.py)."""
    sb, h, f, e = setup.seq * setup.micro_batch, model.hidden, model.ffn, setup.act_bytes
    q, kv = model.heads * model.head_dim, 2 * model.kv_heads * model.head_dim
    layer = sb * e * (3 * h + f) + sb * e * (q + kv + h + 2 * f + h)
    head = sb * e * (h + model.vocab) if last else 0
    return layers * layer + head


def working_set(model: ModelSpec, setup: TrainingSetup, layers: int, *, last: bool) -> tuple[str, int]:
    """The largest short-lived allocation above what the ledger counts, whichever is larger:

    - a decoder layer's backward: the gradient of the gate_up output, s*b*2f in the act
      dtype, the largest single tensor that backward allocates (autograd frees each saved
      tensor once its node has run, so the layer's other gradients mostly replace stash
      the ledger still counts);
    - the last stage: the fp32 logits and their fp32 gradient, 2 * s*b*V*4 (the LM head's
      act-dtype logits are a temporary: `.float()` saves nothing, so they are gone before
      the loss runs).

    Checked on the H200 (docs/memory_calibration.md, benchmarks/results/gpu.md): an
    earlier estimate (a whole layer's stash; the logits in three dtypes) over-predicted
    every rank's peak by 0.25 to 0.3 GiB."""
    layer = 2 * setup.seq * setup.micro_batch * model.ffn * setup.act_bytes if layers else 0
    head = 2 * setup.seq * setup.micro_batch * model.vocab * 4 if last else 0
    return ("logits (transient)", head) if head > layer else ("layer backward (transient)", layer)


def llama_footprints(model: ModelSpec, setup: TrainingSetup, split: Sequence[int], *,
                     attention_lse_pad: int = 1, attention_rng_bytes: int = 0) -> list[StageFootprint]:
    """Stage footprints as the runtime's ledger counts them: `stash` excludes the received
    input, `input_bytes` is the packed boundary received (0 on stage 0), `boundary` the
    packed boundary sent (0 on the last stage)."""
    setup.check_model(model)
    if sum(split) != model.layers:
        raise ParameterError(
            f"split {list(split)} sums to {sum(split)}, but the model has {model.layers} decoder layers")
    last = len(split) - 1
    sent = [0 if s == last else packed_boundary_bytes(model, setup, with_mask=split[s + 1] > 0)
            for s in range(len(split))]
    out = []
    for s, layers in enumerate(split):
        params = stage_params(model, layers, first=s == 0, last=s == last, tp=setup.tp)
        out.append(StageFootprint(
            layers=layers, first=s == 0, last=s == last, params=params,
            static={k: v * params for k, v in static_per_param(setup).items()},
            grads_transient=0.0,
            stash=stage_stash(model, setup, layers, first=s == 0, last=s == last,
                              attention_lse_pad=attention_lse_pad, attention_rng_bytes=attention_rng_bytes),
            boundary=sent[s], input_bytes=sent[s - 1] if s else 0,
            working=working_set(model, setup, layers, last=s == last),
        ))
    return out


def ledger_buffers(
    footprints: Sequence[StageFootprint]
) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(stash, p2p) buffer_bytes for the simulator, kind by kind as the ledger counts them
    ([Note: what the ledger counts] in pipeschedule/runtime/ledger.py)."""
    sent = tuple(fp.boundary for fp in footprints)
    received = tuple(fp.input_bytes for fp in footprints)
    return ({"stash": tuple(fp.stash_bytes for fp in footprints)},
            {"act_in": received, "act_out": sent, "grad_out": sent, "grad_in": received})


def parameter_tensors(layers: int, *, first: bool, last: bool) -> int:
    """Parameter tensors of a stage: 7 per decoder layer, the embedding, final norm, LM head."""
    return LAYER_TENSORS * layers + int(first) + 2 * int(last)


def predict_ranks(model: ModelSpec, setup: TrainingSetup, split: Sequence[int], schedule: Schedule, *,
                  attention_lse_pad: int = 1, attention_rng_bytes: int = 0) -> list[dict[str, float]]:
    """Per rank, bytes by term (`TERMS`) for `split` (decoder layers per stage, one entry
    per stage of the lowered `schedule`). setup: tp=1, dp=1, no fp32 gradient
    accumulation (the integration keeps gradients in `.grad`), param_bytes / act_bytes
    the dtype's, optimizer "adam" (AdamW in the param dtype) or "none"."""
    if len(split) != schedule.num_stages:
        raise ParameterError(
            f"split {list(split)} has {len(split)} stages; schedule {schedule.name!r} has {schedule.num_stages}")
    if setup.tp != 1 or setup.dp != 1 or setup.fp32_grad_accum:
        raise ParameterError(
            f"the integration Llama runs tp=1, dp=1 without fp32 gradient accumulation; got tp={setup.tp}, "
            f"dp={setup.dp}, fp32_grad_accum={setup.fp32_grad_accum}"
        )
    footprints = llama_footprints(model, setup, split, attention_lse_pad=attention_lse_pad,
                                  attention_rng_bytes=attention_rng_bytes)
    stash, p2p = ledger_buffers(footprints)
    n = schedule.num_stages
    unit = ((1.0,) * n, (2.0,) * n, (0.0,) * n)
    kept = (tuple(weight_stash(model, setup, fp.layers, last=fp.last) for fp in footprints)
            if schedule.split_backward else None)
    stash_run = simulate(schedule, CostModel(*unit, stash, weight_stash=kept))
    p2p_run = simulate(schedule, CostModel(*unit, p2p))
    live_peaks = buffers_and_gradients_peak(schedule, footprints, {**stash, **p2p}, setup.param_bytes,
                                            weight_stash=kept)
    rows = rank_memory(footprints, schedule.placement, peak_stash=stash_run.peak_bytes, peak_p2p=p2p_run.peak_bytes,
                       peak_inflight=stash_run.peak_inflight, budget=float("inf"))
    out = []
    for row in rows:
        fps = [footprints[s] for s in row.stages]
        counters = sum(parameter_tensors(fp.layers, first=fp.first, last=fp.last) for fp in fps)
        optimizer = row.optimizer_bytes + (STEP_BYTES * counters if setup.optimizer == "adam" else 0)
        out.append({
            "parameters": row.parameter_bytes,
            "gradients": row.gradient_bytes,
            "optimizer state": float(optimizer),
            "stash per microbatch": float(sum(fp.stash_bytes for fp in fps)),
            "stash peak": row.terms[ACTIVATIONS],
            "p2p buffers peak": row.terms[P2P],
            "working set (transient)": float(max(fp.working[1] for fp in fps)),
        })
        terms = out[-1]
        terms["step peak"] = (terms["parameters"] + terms["optimizer state"] + live_peaks[row.rank]
                              + terms["working set (transient)"])
    return out


def buffers_and_gradients_peak(schedule: Schedule, footprints: Sequence[StageFootprint],
                               buffer_bytes: dict[str, tuple[int, ...]], param_bytes: int, *,
                               weight_stash: Sequence[int] | None = None) -> list[float]:
    """Per rank, the most bytes of live buffers (stash and boundaries, as the ledger counts
    them) plus the gradients allocated so far, over one step under unit costs.

    [Note: gradients appear at the first backward] Training zeroes gradients with
    `zero_grad(set_to_none=True)`, so a stage's `.grad` tensors are allocated by its first
    B of the step and live to its end. Where a rank's buffers peak before that B (all
    forwards first: afab, a long interleaved warmup) the peak does not hold the gradients;
    adding the two peaks would over-count by the whole gradient size."""
    result = simulate(schedule, CostModel((1.0,) * schedule.num_stages, (2.0,) * schedule.num_stages,
                                          (0.0,) * schedule.num_stages, buffer_bytes, weight_stash=weight_stash))
    first_b: dict[int, float] = {}
    for event in result.events:
        if event.instr.op is Op.B and event.instr.stage not in first_b:
            first_b[event.instr.stage] = event.start
    peaks = []
    for rank, curve in enumerate(result.memory):
        grads = sorted((first_b[s], footprints[s].params * param_bytes)
                       for s, r in enumerate(schedule.placement) if r == rank and s in first_b)
        peak, k, held = 0.0, 0, 0.0
        for t, live in curve:
            while k < len(grads) and grads[k][0] <= t:
                held += grads[k][1]
                k += 1
            peak = max(peak, live + held)
        peaks.append(peak)
    return peaks


__all__ = [
    "TERMS", "decoder_layer_stash", "embedding_stash", "head_stash", "ledger_buffers", "llama_footprints",
    "packed_boundary_bytes", "parameter_tensors", "predict_ranks", "rmsnorm_stash", "stage_stash", "weight_stash",
    "working_set",
]
