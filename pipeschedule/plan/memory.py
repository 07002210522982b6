"""Memory model of a Llama-style decoder trained with nanotron under pipeline parallelism.

Pure arithmetic: no torch. Every number is bytes on ONE GPU (one tensor-parallel shard of
one pipeline stage). `stage_footprint` says what one stage costs; `rank_memory` adds the in-flight
activations a schedule keeps (the peaks the simulator reads off its program order:
`stash_buffers` / `p2p_buffers` turn footprints into the simulator's per-stage
buffer_bytes) and the budget, one `RankMemory` per rank.

[Note: memory terms] What nanotron keeps on a GPU, by term (P = parameters on the GPU,
z = dp under ZeRO-1 and 1 otherwise, bf16 = 2 bytes), with the line of nanotron 0.4 each
models (files under nanotron/ in the installed package):

    weights                    P * 2              bf16 parameters: `model.dtype: bfloat16`,
                                                  built in that dtype by `_init_model`
                                                  (trainer.py:613-615, `build_model`)
    fp32 grad accumulator      P * 4              `accumulate_grad_in_fp32: true` (nanotron's
                                                  example configs): FP32GradientAccumulator
                                                  keeps an fp32 grad buffer for EVERY
                                                  parameter, also under ZeRO-1
                                                  (optim/gradient_accumulator.py:173,
                                                  helpers.py:182-188: the buckets over
                                                  all `named_parameters`)
    fp32 master weights        P * 4 / z          its fp32 copy of the parameters the rank
                                                  updates, the ZeRO-1 shard
                                                  (gradient_accumulator.py:95, helpers.py:
                                                  202-209); torch allocates the moments at
                                                  the first step
    Adam moments               P * 8 / z          exp_avg, exp_avg_sq of the fp32 master
                                                  (torch's AdamW, built by helpers.py:
                                                  165-176)
    DDP grad buckets           P * 2 (dp > 1)     torch DDP wraps the model only when dp > 1
                                                  and not (fp32 accumulation and ZeRO-1)
                                                  (trainer.py:608-610, 665-674) and
                                                  allocates flat bf16 bucket buffers for
                                                  all parameters when it is built
    bf16 gradients at the      P * 2, nanotron's  `FP32GradientAccumulator.backward`
    end of a backward          engines only       (gradient_accumulator.py:204-210) runs
                                                  `loss.backward()` to its end, then folds
                                                  each `.grad` into fp32 and drops it
                                                  (`_accumulate_grad`, :212-232, `.grad =
                                                  None` at :223): every parameter of the
                                                  stage holds its bf16 gradient at once
                                                  when a microbatch's backward ends. They
                                                  coincide with the other microbatches'
                                                  stashes, not with that microbatch's
                                                  (autograd has released it) nor with the
                                                  backward's transients: the term is what
                                                  they add above the activations' peak
                                                  with those (`grad_fold="backward"`)
    one parameter's gradient   the largest        the gradient a backward produces for one
                               parameter's, * 2   parameter before it joins `.grad` or, in
                                                  pipeschedule's engines, before it is
                                                  folded into fp32 the moment autograd has
                                                  it ([Note: gradient folding] in
                                                  integration/nanotron/pipeline/grad_sync.py): one
                                                  at a time, the largest counted
                                                  (`largest_param`: nanotron's Llama fuses
                                                  q,k,v and gate,up, models/llama.py)
    activations                the simulator's peak of live saved activations: in-flight
                               microbatches x one microbatch's stash (below)
    p2p buffers                its peak of boundary tensors (sent outputs, gradients)
    working set (transient)    the larger of: one layer's activations while its backward
                               (and, under full recompute, its re-run forward) runs; the
                               last stage's logits during its forward, s*b*V/t values in
                               bf16 plus nanotron's fp32 copy (`cast_to_fp32`,
                               models/llama.py:771)

The peaks of the different kinds are added (a conservative bound: the working set and one
parameter's gradient need not coincide with the activations' peak), except nanotron's
bf16 gradients at a backward's end, whose moment the schedule gives (`Peaks.at_backward_ends`).
Not counted: the CUDA context, NCCL buffers and allocator fragmentation (the planner's
`reserve`), the DP all-reduce's buckets in flight. The optimizer step's temporaries are
their own term where they exceed the pipeline (`optimizer_step_transient`).

Without fp32 accumulation (`fp32_grad_accum=False`) the grads stay bf16 in `.grad`
(P * 2, all step) and Adam keeps its moments in the parameter dtype (P * 4 / z).

Activations saved for backward, per decoder layer per microbatch (Korthikanti et al.
2022, bytes, s sequence, b micro-batch, h hidden, a heads, t tensor parallel):

    none / selective   s*b*h*(10 + 24/t)  tensor parallel only
                       s*b*h*34/t         with sequence parallel
                       + 5*a*s^2*b/t      attention scores, only when they are
                                          materialised (no flash attention) and recompute
                                          is `none` (selective recompute drops exactly this)
    full               2*s*b*h            the layer's input (/t with sequence parallel: the
                                          input is sequence-sharded); the rest is rebuilt

`activation_formula="llama"` counts a SwiGLU, GQA, dropout-free layer instead (same
notation, f ffn, k kv heads):  8*s*b*h (norm inputs and matmul inputs, replicated without
SP) + (4*s*b*h + 4*s*b*h*k/a + 6*s*b*f)/t, everything /t with SP, + 2*a*s^2*b/t for
materialised softmax probabilities. For Llama3-70B (f = 3.5h, k = a/8) it gives 33.5 s*b*h
where Korthikanti gives 34. Both assume 2-byte activations and scale with `act_bytes`/2.

The last stage also keeps, per microbatch, the final norm's and the LM head's inputs
(one boundary tensor each) and the loss's softmax in fp32 (4*s*b*V/t bytes:
nanotron's `_ShardedCrossEntropy` saves `exp_logits` of the fp32 logits); the first stage
keeps the token ids (8 bytes each).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipeschedule.errors import ParameterError
from pipeschedule.checks import MAX_DIMENSION, MAX_LAYERS, is_int, shown

RECOMPUTE_MODES = ("none", "selective", "full")
GRAD_FOLDS = ("backward", "parameter")
OPTIMIZERS = ("adam", "none")
DP_BACKENDS = ("nccl", "gloo")
ACTIVATION_FORMULAS = ("nanotron", "korthikanti", "llama")
ATTENTIONS = ("flash-attn", "sdpa-standin", "eager")
GiB = 1 << 30


def _check_int(name: str, value, minimum: int = 1, maximum: int = MAX_DIMENSION) -> int:
    """An integer in [minimum, maximum]; the maximum is one of [Note: size limits] (a
    range, where `checks.check_int` takes a minimum alone: every size of a model is
    bounded)."""
    if not is_int(value) or not minimum <= value <= maximum:
        raise ParameterError(f"{name} must be an integer in {minimum}..{maximum}, got {shown(value)}")
    return value


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-style decoder: embedding, `layers` decoder layers, final norm, LM head.

    hidden: model width h. heads / kv_heads: query and key-value heads (GQA when fewer kv
    heads). ffn: SwiGLU intermediate size. vocab: vocabulary size V. tied_embeddings: the
    LM head reuses the embedding matrix (with pp > 1 both stages still hold a copy).
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab"):
            _check_int(f"model {key}", getattr(self, key), maximum=MAX_LAYERS if key == "layers" else MAX_DIMENSION)
        if self.hidden % self.heads:
            raise ParameterError(
                f"model hidden={self.hidden} is not divisible by heads={self.heads} "
                f"({self.hidden} / {self.heads} = {self.hidden / self.heads:g})"
            )
        if self.heads % self.kv_heads:
            raise ParameterError(f"model heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def layer_params(self, tp: int = 1) -> int:
        """Parameters of one decoder layer on one of `tp` shards: q, k, v, o and the
        SwiGLU matrices are split; the two RMSNorm weights are replicated."""
        d = self.head_dim
        attention = self.hidden * (self.heads * d + 2 * self.kv_heads * d) + self.heads * d * self.hidden
        mlp = 3 * self.hidden * self.ffn
        return (attention + mlp) // tp + 2 * self.hidden

    def padded_vocab(self, tp: int = 1) -> int:
        """nanotron's vocab-parallel embedding needs V divisible by tp; it pads up."""
        return -(-self.vocab // tp) * tp

    def embedding_params(self, tp: int = 1) -> int:
        return self.padded_vocab(tp) * self.hidden // tp

    def head_params(self, tp: int = 1) -> int:
        """LM head (column-parallel, V*h/t) plus the final norm (h, replicated)."""
        return self.padded_vocab(tp) * self.hidden // tp + self.hidden

    def total_params(self) -> int:
        head = self.head_params() - (self.embedding_params() if self.tied_embeddings else 0)
        return self.embedding_params() + self.layers * self.layer_params() + head

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("name", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab",
                                              "tied_embeddings")}


@dataclass(frozen=True)
class TrainingSetup:
    """Everything besides the model and the schedule that decides memory.

    tp / dp / zero_stage: tensor parallel, data parallel and nanotron's ZeRO stage (0 or
    1). seq / micro_batch: tokens per sequence and sequences per microbatch. recompute:
    "none", "selective" or "full". sequence_parallel: nanotron's `tp_mode:
    REDUCE_SCATTER`. flash: the older spelling of attention, checked against it (None:
    follows attention; True: not "eager"; False: "eager"). param_bytes /
    act_bytes: bytes per parameter and per activation value (2 for bf16).
    fp32_grad_accum: nanotron's `accumulate_grad_in_fp32`. ddp_buckets: count DDP's bf16
    bucket buffers when dp > 1. activation_formula: "korthikanti" or "llama"
    ([Note: memory terms]). optimizer: "adam" (Adam/AdamW: two moments per parameter,
    plus fp32 master weights under fp32_grad_accum) or "none" (no optimizer state, as in
    a gradient-only measurement). tp_async: `tp_linear_async_communication`.
    attention: "flash-attn", the adapter's "sdpa-standin" (both flash kernels), or "eager"
    (softmax scores materialised: counted by the korthikanti and llama formulas, which
    nanotron's Llama, always flash, does not run). adam_fused: nanotron's
    `torch_adam_is_fused` (its example configs: true); false adds the temporaries of
    torch's single-tensor Adam to the optimizer step (`optimizer_step_transient`).
    dp_backend: the data-parallel group's backend, "nccl" or "gloo" (ranks sharing a GPU
    in the benchmarks): under gloo, ZeRO-1's all-gather of CUDA tensors also allocates a
    copy of its gathered output on the device (`optimizer_step_transient`). grad_fold: when the
    bf16 gradients are folded into the fp32 accumulator (with fp32_grad_accum):
    "backward", after each microbatch's whole backward, as nanotron's engines do (the
    stage's bf16 gradients all exist at its end), or "parameter", each as autograd
    produces it, as pipeschedule's engines do ([Note: memory terms]).
    """

    tp: int = 1
    dp: int = 1
    zero_stage: int = 0
    seq: int = 8192
    micro_batch: int = 1
    recompute: str = "none"
    sequence_parallel: bool = True
    flash: bool | None = None
    param_bytes: int = 2
    act_bytes: int = 2
    fp32_grad_accum: bool = True
    ddp_buckets: bool = True
    activation_formula: str = "nanotron"
    optimizer: str = "adam"
    tp_async: bool = False
    attention: str = "flash-attn"
    adam_fused: bool = True
    grad_fold: str = "parameter"
    dp_backend: str = "nccl"

    def __post_init__(self) -> None:
        for key in ("tp", "dp", "seq", "micro_batch", "param_bytes", "act_bytes"):
            _check_int(key, getattr(self, key))
        if not is_int(self.zero_stage) or self.zero_stage not in (0, 1):
            raise ParameterError(f"zero_stage must be 0 or 1 (nanotron has ZeRO-1 only), got {shown(self.zero_stage)}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ParameterError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {shown(self.recompute)}")
        if self.activation_formula not in ACTIVATION_FORMULAS:
            raise ParameterError(
                f"activation_formula must be one of {', '.join(ACTIVATION_FORMULAS)}, "
                f"got {shown(self.activation_formula)}"
            )
        if self.attention not in ATTENTIONS:
            raise ParameterError(f"attention must be one of {', '.join(ATTENTIONS)}, got {shown(self.attention)}")
        if self.flash is not None and self.flash != (self.attention != "eager"):
            raise ParameterError(f"flash={self.flash} contradicts attention={self.attention!r}: scores are "
                                 "materialised exactly under attention='eager' (give attention alone)")
        if self.attention == "eager" and self.activation_formula == "nanotron":
            raise ParameterError("attention 'eager' (scores materialised) is counted by the korthikanti and llama "
                                 "activation formulas; nanotron's Llama runs flash-attn or the adapter's sdpa-standin")
        if self.grad_fold not in GRAD_FOLDS:
            raise ParameterError(f"grad_fold must be one of {', '.join(GRAD_FOLDS)}, got {shown(self.grad_fold)}")
        if self.optimizer not in OPTIMIZERS:
            raise ParameterError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {shown(self.optimizer)}")
        if self.dp_backend not in DP_BACKENDS:
            raise ParameterError(f"dp_backend must be one of {', '.join(DP_BACKENDS)}, got {shown(self.dp_backend)}")
        if self.sequence_parallel and self.seq % self.tp:
            raise ParameterError(
                f"sequence parallel splits the sequence over tp: seq={self.seq} is not divisible by tp={self.tp}"
            )

    @property
    def scores_materialised(self) -> bool:
        """Whether attention keeps its softmax scores (attention "eager"): they add to the
        stash without recompute and to the rerun under selective recompute."""
        return self.attention == "eager"

    def check_model(self, model: ModelSpec) -> None:
        """nanotron's own asserts: tp divides the query heads, the kv heads and the ffn."""
        for key, value in (("heads", model.heads), ("kv_heads", model.kv_heads), ("ffn", model.ffn)):
            if value % self.tp:
                raise ParameterError(
                    f"tp={self.tp} does not divide the model's {key}={value}: each tensor-parallel "
                    f"rank must hold a whole number of them"
                )


# -- activations ---------------------------------------------------------------------------


def _tokens(setup: TrainingSetup) -> tuple[int, int, int]:
    """(s*b, tokens a norm sees, tokens a column-parallel linear saves) on one TP rank.
    With sequence parallel a norm sees s*b/t tokens; a column-parallel linear saves the
    all-gathered s*b unless its communication is async, whose autograd function saves the
    sharded input and gathers it again in backward
    (nanotron/parallel/tensor_parallel/functional.py:119-144 against 341-359)."""
    sb, t = setup.seq * setup.micro_batch, setup.tp
    local = sb // t if setup.sequence_parallel else sb
    gathered = sb // t if setup.sequence_parallel and setup.tp_async else sb
    return sb, local, gathered


def nanotron_layer_stash(model: ModelSpec, setup: TrainingSetup, recompute: str | None = None) -> dict[str, int]:
    """Bytes one nanotron `LlamaDecoderLayer` saves for backward per microbatch on one TP
    rank, by tensor (the activations of [Note: memory terms])."""
    recompute = setup.recompute if recompute is None else recompute
    sb, local, gathered = _tokens(setup)
    h, a, f, t, e = model.hidden, model.heads, model.ffn, setup.tp, setup.act_bytes
    kv = 2 * model.kv_heads * model.head_dim
    if recompute == "full":
        return {"layer input (checkpoint)": local * h * e, "sequence mask (bool)": sb}
    standin = setup.attention == "sdpa-standin"
    norm = local * (2 * max(e, 4) * h + 4) if standin else local * (h * e + 4)
    out = {"input norm": norm, "qkv_proj input": gathered * h * e}
    if standin:
        out["rotary cos, sin (fp32)"] = 8 * setup.seq * model.head_dim
    if recompute == "selective":
        out["attention q, k, v (checkpoint inputs)"] = sb * (h + kv) * e // t
        out["attention output"] = sb * h * e // t
    else:
        out["attention q, k, v"] = sb * (3 * h if standin else h + kv) * e // t
        out["attention output"] = sb * h * e // t * (2 if standin else 1)
        out["attention logsumexp (fp32)"] = sb * a * 4 // t
        out["attention RNG state"] = 16
    out["post norm"] = norm
    out["gate_up_proj input"] = gathered * h * e
    out["SwiGLU: gate_up out, silu, product"] = 4 * sb * f * e // t
    if standin:
        out["unattributed (measured)"] = 4 * sb // t
    return out


def weight_stash_layer(model: ModelSpec, setup: TrainingSetup) -> int:
    """Bytes one decoder layer keeps from its B to its W under a split backward, on one
    TP rank: each deferred linear's input and the gradient of its output
    ([Note: split backward] in pipeschedule/runtime/split_backward.py). Inputs: the
    gathered input of qkv_proj and of gate_up_proj (s*b*h each), o_proj's (s*b*h/t) and
    down_proj's (s*b*f/t); output gradients: qkv (s*b*(q+kv)/t), o_proj and down_proj
    before their reduce-scatter (s*b*h each), gate_up (2*s*b*f/t). About 0.9 GiB for
    Llama3-70B at tp=4, seq 8192."""
    sb, t, e = setup.seq * setup.micro_batch, setup.tp, setup.act_bytes
    h, f, kv = model.hidden, model.ffn, 2 * model.kv_heads * model.head_dim
    inputs = 2 * sb * h + sb * h // t + sb * f // t
    grads = sb * (h + kv) // t + 2 * sb * h + 2 * sb * f // t
    return (inputs + grads) * e


def weight_stash_head(model: ModelSpec, setup: TrainingSetup) -> int:
    """The LM head's share of the W stash: its gathered input and its logits' gradient."""
    sb = setup.seq * setup.micro_batch
    return (sb * model.hidden + sb * model.padded_vocab(setup.tp) // setup.tp) * setup.act_bytes


def weight_stash_bytes(model: ModelSpec, setup: TrainingSetup, layers: int, *, last: bool, recomputed: int = 0) -> int:
    """A stage's W stash: its layers' (none when recomputed: a rerun layer computes its
    weight gradients at B, integration/nanotron/pipeline/recompute.py) and the LM head's."""
    kept = 0 if setup.recompute == "full" else (layers - min(recomputed, layers)) * weight_stash_layer(model, setup)
    return kept + (weight_stash_head(model, setup) if last else 0)


def layer_activation_bytes(model: ModelSpec, setup: TrainingSetup, recompute: str | None = None) -> int:
    """Bytes one decoder layer saves for backward per microbatch ([Note: memory terms])."""
    recompute = setup.recompute if recompute is None else recompute
    if setup.activation_formula == "nanotron":
        return sum(nanotron_layer_stash(model, setup, recompute).values())
    s, b, h, a, t = setup.seq, setup.micro_batch, model.hidden, model.heads, setup.tp
    sp = setup.sequence_parallel
    scale = setup.act_bytes / 2
    sbh = s * b * h
    if recompute == "full":
        return math.ceil(2 * sbh / (t if sp else 1) * scale)
    if setup.activation_formula == "korthikanti":
        per = sbh * 34 / t if sp else sbh * (10 + 24 / t)
        scores = 5 * a * s * s * b / t
    else:
        f, k = model.ffn, model.kv_heads
        sharded = 4 * sbh + 4 * sbh * k / a + 6 * s * b * f
        per = (8 * sbh + sharded) / t if sp else 8 * sbh + sharded / t
        scores = 2 * a * s * s * b / t
    if recompute == "none" and setup.scores_materialised:
        per += scores
    return math.ceil(per * scale)


def head_stash(model: ModelSpec, setup: TrainingSetup) -> dict[str, int]:
    """What the last stage's final norm, LM head and loss save per microbatch. nanotron:
    the norm (as a layer's), the LM head's input (gathered unless async), the fp32
    `exp_logits` of `_ShardedCrossEntropy` (functional.py:86) and its targets and masks
    (12 bytes per token, measured by the ledger, and two scalars)."""
    if setup.activation_formula != "nanotron":
        boundary = boundary_bytes(model, setup)
        return {"final norm + LM head inputs": 2 * boundary, "loss softmax (fp32)": 4 * logits_values(model, setup)}
    sb, local, gathered = _tokens(setup)
    layer = nanotron_layer_stash(model, setup, "none")
    return {"final norm": layer["input norm"], "LM head input": gathered * model.hidden * setup.act_bytes,
            "loss exp_logits (fp32)": 4 * logits_values(model, setup), "loss targets and masks": 12 * sb + 8}


def boundary_bytes(model: ModelSpec, setup: TrainingSetup) -> int:
    """One hidden-state tensor between stages: s*b*h values, sequence-sharded with SP."""
    values = setup.seq * setup.micro_batch * model.hidden // (setup.tp if setup.sequence_parallel else 1)
    return values * setup.act_bytes


def logits_values(model: ModelSpec, setup: TrainingSetup) -> int:
    """s*b*V/t: the last stage's vocab-sharded logits of one microbatch."""
    return setup.seq * setup.micro_batch * model.padded_vocab(setup.tp) // setup.tp


# -- one stage ------------------------------------------------------------------------------


def static_per_param(setup: TrainingSetup) -> dict[str, float]:
    """Bytes held all step per parameter, by term ([Note: memory terms]). Linear in the
    parameter count, so a stage's static bytes are additive over its layers."""
    shard = setup.dp if setup.zero_stage == 1 else 1
    adam = setup.optimizer == "adam"
    out = {"weights": float(setup.param_bytes)}
    if setup.fp32_grad_accum:
        out["fp32 grad accumulator"] = 4.0
        if adam:
            out["fp32 master weights"] = 4 / shard
            out["Adam moments"] = 8 / shard
    else:
        out["gradients"] = float(setup.param_bytes)
        if adam:
            out["Adam moments"] = 2 * setup.param_bytes / shard
    if builds_ddp(setup) and setup.ddp_buckets:
        out["DDP grad buckets"] = float(setup.param_bytes)
    return out


def builds_ddp(setup: TrainingSetup) -> bool:
    """nanotron wraps the model in torch DDP only when dp > 1 and not (fp32 accumulation
    with ZeRO): `make_ddp` in nanotron/trainer.py:608-610. Under ZeRO-1 with fp32
    accumulation there are no DDP buckets; the trainer all-reduces the fp32 gradients
    itself after the pipeline step (trainer.py:341-350)."""
    return setup.dp > 1 and not (setup.fp32_grad_accum and setup.zero_stage > 0)


def transient_per_param(setup: TrainingSetup) -> float:
    """bf16 gradient bytes per parameter that exist at once at the end of a backward
    ([Note: memory terms]): every parameter's (`param_bytes`) where nanotron's engines fold
    after the whole backward (fp32 accumulation, `grad_fold="backward"`,
    nanotron/optim/gradient_accumulator.py:204-210); none otherwise: pipeschedule's
    engines fold each gradient as it is produced, and without fp32 accumulation the
    gradients are static (`static_per_param`). One parameter's gradient at a time is
    `largest_param`'s."""
    if setup.fp32_grad_accum and setup.grad_fold == "backward":
        return float(setup.param_bytes)
    return 0.0


def largest_param(model: ModelSpec, tp: int, layers: int, *, first: bool, last: bool) -> int:
    """Elements of the largest parameter tensor of a stage on one TP rank. nanotron's Llama
    fuses q, k, v into `qkv_proj` and gate, up into `gate_up_proj` (models/llama.py:
    CausalSelfAttention, MLP), both column-parallel; `o_proj` and `down_proj` are
    row-parallel; the embedding and the LM head hold V*h/t (vocab-parallel, padded): the
    largest of `stage_param_sizes`."""
    return max(stage_param_sizes(model, layers, first=first, last=last, tp=tp), default=0)


def one_grad_bytes(model: ModelSpec, setup: TrainingSetup, layers: int, *, first: bool, last: bool) -> int:
    """Bytes of the gradient a backward is producing for one parameter, the largest, before
    it is folded into fp32 or added into `.grad` ([Note: memory terms]): beside the
    working set of any backward, whatever the engine."""
    return setup.param_bytes * largest_param(model, setup.tp, layers, first=first, last=last)


def working_set(model: ModelSpec, setup: TrainingSetup, layers: int, *, last: bool,
                rerun: bool = False) -> tuple[str, int]:
    """The largest short-lived activation of a stage's step, with its name: a decoder
    layer's backward (SwiGLU's gradients, 4*s*b*f/t values; under full recompute also the
    rerun layer's whole stash), or the last stage's fp32 logits (nanotron's
    `cast_to_fp32`). Parameter gradients are their own terms (`one_grad_bytes`,
    `transient_per_param`)."""
    e, sb, t = setup.act_bytes, setup.seq * setup.micro_batch, setup.tp
    layer = 0
    if layers:
        layer = 4 * sb * model.ffn * e // t
        if setup.recompute == "full" or rerun:
            layer += layer_activation_bytes(model, setup, recompute="none")
    head = 4 * logits_values(model, setup) if last else 0
    return ("logits fp32 (transient)", head) if head > layer else ("layer backward (transient)", layer)


@dataclass(frozen=True)
class StageFootprint:
    """What one pipeline stage costs on one GPU, before any schedule is applied.

    static: bytes held the whole step, by term. grads_transient: the bf16 gradients at the
    end of a backward under nanotron's engines (additive over stages); one_grad: one
    parameter's gradient, the largest (pipeschedule's engines, or no fp32 accumulation).
    stash: bytes one in-flight microbatch keeps until its backward, by term (their sum is
    `stash_bytes`; it includes the stage's input, which its first layer saves).
    boundary: one tensor crossing a stage boundary.
    input_bytes: the stage's input as the simulator's `act_in` (token ids on stage 0).
    working: the largest short-lived activation of one step on this stage (one layer's
    during backward or recompute, or the logits of the last stage's forward), with its
    name.
    """

    layers: int
    first: bool
    last: bool
    params: int
    static: Mapping[str, float]
    grads_transient: float
    stash: Mapping[str, int]
    boundary: int
    input_bytes: int
    working: tuple[str, int]
    recomputed: int = 0  # layers of this stage that recompute (on top of setup.recompute)
    one_grad: int = 0
    param_sizes: tuple[int, ...] = ()  # its parameter tensors in the optimizer's order (`stage_param_sizes`)

    @property
    def stash_bytes(self) -> int:
        return sum(self.stash.values())

    @property
    def static_bytes(self) -> float:
        return sum(self.static.values())

    # Separate numbers, for calibration against measured memory.
    @property
    def parameter_bytes(self) -> float:
        return self.static.get("weights", 0)

    @property
    def gradient_bytes(self) -> float:
        return sum(self.static.get(k, 0) for k in ("fp32 grad accumulator", "gradients", "DDP grad buckets"))

    @property
    def optimizer_bytes(self) -> float:
        return sum(self.static.get(k, 0) for k in ("fp32 master weights", "Adam moments"))


def stage_params(model: ModelSpec, layers: int, *, first: bool, last: bool, tp: int) -> int:
    """Parameters on one GPU of a stage with `layers` decoder layers."""
    params = layers * model.layer_params(tp)
    if first:
        params += model.embedding_params(tp)
    if last:
        params += model.head_params(tp)
    if first and last and model.tied_embeddings:  # one stage holds both: the LM head is the embedding's weight
        params -= model.embedding_params(tp)
    return params


def stage_param_sizes(model: ModelSpec, layers: int, *, first: bool, last: bool, tp: int) -> tuple[int, ...]:
    """Elements of each parameter tensor of a stage on one TP rank, in the order nanotron's
    Llama registers them, which is the order its optimizer steps them (`named_parameters`,
    nanotron/helpers.py:162): the embedding; per decoder layer `input_layernorm`,
    `qkv_proj`, `o_proj`, `post_attention_layernorm`, `gate_up_proj`, `down_proj`
    (models/llama.py: `LlamaDecoderLayer`, `CausalSelfAttention`, `MLP`); the final norm
    and the LM head. They sum to `stage_params` (one stage holding a tied head lists the
    embedding once)."""
    h, d = model.hidden, model.head_dim
    layer = (h, (model.heads + 2 * model.kv_heads) * d // tp * h, model.heads * d // tp * h, h,
             2 * model.ffn // tp * h, model.ffn // tp * h)
    out = (model.embedding_params(tp),) if first else ()
    out += layer * layers
    if last:
        out += (h,) if first and model.tied_embeddings else (h, model.head_params(tp) - h)
    return out


def shared_params(model: ModelSpec, placement: Sequence[int], tp: int) -> tuple[int, ...]:
    """Per rank, the parameters its stages' footprints count twice: with tied embeddings,
    a rank that holds the first stage and the last as two stages (the V shapes put both
    on rank 0; every chunk is on rank 0 at pp=1) holds the embedding, which is the LM
    head's weight, once: nanotron's `tie_parameters` makes the two modules of one rank
    share one parameter. (One stage holding both is counted once by `stage_params`.)"""
    out = [0] * (max(placement) + 1)
    if model.tied_embeddings and len(placement) > 1 and placement[0] == placement[-1]:
        out[placement[0]] = model.embedding_params(tp)
    return tuple(out)


def stage_footprint(model: ModelSpec, setup: TrainingSetup, layers: int, *, first: bool, last: bool,
                    recomputed: int = 0) -> StageFootprint:
    """The footprint of one stage holding `layers` decoder layers (plus the embedding when
    `first`, the final norm, LM head and loss when `last`)."""
    _check_int("layers", layers, 0)
    params = stage_params(model, layers, first=first, last=last, tp=setup.tp)
    boundary = boundary_bytes(model, setup)
    recomputed = min(recomputed, layers)
    stash = {"decoder layers": (layers - recomputed) * layer_activation_bytes(model, setup)}
    if recomputed:
        stash["recomputed layers' inputs"] = recomputed * layer_activation_bytes(model, setup, recompute="full")
    if last:
        stash.update(head_stash(model, setup))
    working = working_set(model, setup, layers, last=last, rerun=recomputed > 0)
    return StageFootprint(
        layers=layers, first=first, last=last, params=params,
        static={k: v * params for k, v in static_per_param(setup).items()},
        grads_transient=transient_per_param(setup) * params,
        stash=stash, boundary=boundary,
        input_bytes=8 * setup.seq * setup.micro_batch if first else boundary,
        working=working, recomputed=recomputed,
        one_grad=one_grad_bytes(model, setup, layers, first=first, last=last),
        param_sizes=stage_param_sizes(model, layers, first=first, last=last, tp=setup.tp),
    )


def stage_footprints(model: ModelSpec, setup: TrainingSetup, split: Sequence[int],
                     recomputed: Sequence[int] | None = None) -> list[StageFootprint]:
    """Footprints of every stage of `split` (decoder layers per stage, in stage order);
    recomputed[s]: how many of stage s's layers recompute (the engine's `recompute=N0/N1/..`)."""
    setup.check_model(model)
    last = len(split) - 1
    recomputed = recomputed or (0,) * len(split)
    return [stage_footprint(model, setup, n, first=s == 0, last=s == last, recomputed=recomputed[s])
            for s, n in enumerate(split)]


# -- per rank, under a schedule ([Note: memory terms]) ----------------------------------------------


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

ACTIVATIONS, P2P = "activations", "p2p buffers"
GRADS = "bf16 gradients at a backward's end (transient)"  # nanotron's engines: the stage's, above the activations
ONE_GRAD = "one parameter's gradient (transient)"
OPTIMIZER_STEP = "optimizer step (transient, above the pipeline)"


def optimizer_step_transient(setup: TrainingSetup, sizes: Sequence[int]) -> float:
    """Bytes the optimizer step allocates above the static terms, for parameter tensors of
    `sizes` elements on the GPU in the order the optimizer steps them (`stage_param_sizes`).
    [Note: the optimizer step's transient]"""
    if setup.optimizer != "adam":
        return 0.0
    dp = setup.dp if setup.zero_stage else 1
    pieces = [-(-n // dp) for n in sizes]  # ZeRO-1: the rank's slice of each tensor (the first rank's, the larger)
    moment = 4 if setup.fp32_grad_accum else setup.param_bytes
    adam = 0.0 if setup.adam_fused else float(moment * max(
        (before + 2 * n for before, n in zip([0, *pieces], pieces)), default=0))
    if not (setup.zero_stage and setup.dp > 1):
        return adam
    params = sum(sizes)
    gathered = setup.param_bytes * params
    gather = setup.param_bytes * params / setup.dp + gathered + (gathered if setup.dp_backend == "gloo" else 0)
    return max(adam, gather)  # the all-gather runs after Adam has returned


# [Note: the optimizer step's transient] What the optimizer step allocates above the
# static terms (nanotron 0.4, torch 2.x):
# - Adam. nanotron builds torch's AdamW with `fused=torch_adam_is_fused` always given
#   (nanotron/helpers.py:167-176), so torch never picks its foreach path: `adam()` defaults
#   to foreach only when both `fused` and `foreach` are None, and otherwise takes foreach
#   as False (torch/optim/adam.py, `adam`, "Respect when the user inputs False/True").
#   Unfused, it is `_single_tensor_adam`, a loop over the tensors whose only temporaries
#   are `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`: while the
#   division runs, the square root and the quotient of tensor i (2 n_i moments' worth)
#   are alive beside the previous tensor's `denom` (n_(i-1)), which the assignment frees
#   only then. The transient is moment bytes * max_i (n_(i-1) + 2 n_i) over the tensors
#   the rank steps, in their order: for nanotron's Llama the embedding (first, alone),
#   the LM head after the final norm, or `gate_up_proj` after `post_attention_layernorm`.
#   (Measured on an H100, ZeRO-0 pp=2 dp=2, hidden 4096, vocab 32000: the last stage's
#   step peaked 1,048,594,944 bytes above its start, where 4 * (4096 + 2 * 131,072,000) =
#   1,048,592,384; benchmarks/results/zero1_step_zero0.md.) AdamW's decoupled weight
#   decay is in place. The fused kernel allocates nothing of this size.
# - ZeRO-1's all-gather, after Adam has returned (`ZeroDistributedOptimizer.step`,
#   nanotron/optim/zero.py:107-135): `all_gather_coalesced` (nanotron/distributed.py:
#   153-221) flattens the rank's shard (2 P / dp) and one buffer per rank for the output
#   (2 P in all). Over gloo (dp_backend "gloo") `ProcessGroupGloo::enqueue` also records
#   the work for its flight recorder with `getOutputTensors()`, which for an all-gather
#   is `newLikeFlat(outputs[0])`: a new tensor of the gathered size on the device of the
#   outputs (2 P more, freed at once; measured: the first stage's ZeRO-1 step peaked 2 P +
#   3 MB above the NCCL sum, benchmarks/results/zero1_step.md). NCCL gathers in place.
# The step's peak is then the static terms plus the larger of the two, and a rank's total
# is the larger of that and the pipeline's peak (`rank_memory`): what the pipeline held
# beyond the static terms (activations, bf16 gradients) is gone by the step.


@dataclass(frozen=True)
class RankMemory:
    """Peak memory of one GPU of pipeline rank `rank` under a schedule.

    terms: bytes by term in display order: the static terms summed over the rank's stages,
    "activations" (the simulator's peak of live saved activations), "p2p buffers" (its
    peak of boundary tensors), one parameter's gradient, the largest working set, and under
    nanotron's engines the bf16 gradients at a backward's end (what they add above the
    activations' peak with a backward's transients). Peaks of different kinds are added
    (an upper bound: they need not coincide) but for the gradients at a backward's end,
    which the schedule places.
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
        return sum(self.terms.get(k, 0)
                   for k in ("fp32 grad accumulator", "gradients", "DDP grad buckets", GRADS, ONE_GRAD))

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
    setup: TrainingSetup | None = None,
    shared: Sequence[int] = (),
    peak_backward_end: Sequence[float] | None = None,
) -> list[RankMemory]:
    """Combine stage footprints with a schedule's simulated peaks, one entry per rank.

    peak_stash[r] / peak_p2p[r]: the simulator's `peak_bytes` of rank r with
    `stash_buffers` / `p2p_buffers` as the cost model's buffer_bytes.
    peak_backward_end[r]: the most saved activations of rank r alive when one of its
    backwards ends, that backward's own released (`Peaks.at_backward_ends` under the
    stash cost): where nanotron's engines hold the stage's bf16 gradients, which add what
    exceeds the activations' peak with a backward's transients, one parameter's gradient
    and the working set (None: they are added whole). With `setup`, a
    rank whose optimizer step peaks above its pipeline gets the difference as the term
    "optimizer step (transient, above the pipeline)" (`optimizer_step_transient`).
    shared[r]: parameters rank r's stages count twice (`shared_params`), held once
    (needs `setup`, whose bytes per parameter say what they hold).
    """
    if any(shared) and setup is None:
        raise ParameterError("rank_memory: shared parameters need the setup (bytes per parameter)")
    out = []
    for r in range(len(peak_stash)):
        stages = tuple(s for s, rank in enumerate(placement) if rank == r)
        twice = shared[r] if r < len(shared) else 0
        terms: dict[str, float] = {}
        for s in stages:
            for key, value in footprints[s].static.items():
                terms[key] = terms.get(key, 0) + value
        if twice:
            for key, per_param in static_per_param(setup).items():
                terms[key] -= per_param * twice
        terms[ACTIVATIONS] = float(peak_stash[r])
        terms[P2P] = float(peak_p2p[r])
        grads = sum(footprints[s].grads_transient for s in stages)
        if twice:
            grads -= transient_per_param(setup) * twice
        one = max((footprints[s].one_grad for s in stages), default=0)
        if one:
            terms[ONE_GRAD] = float(one)
        name, value = max((footprints[s].working for s in stages), key=lambda w: w[1], default=("", 0))
        if value:
            terms[name] = float(value)
        if grads and peak_backward_end is not None:  # above the activations' peak with a backward's transients
            grads = max(0.0, float(peak_backward_end[r]) + grads - float(peak_stash[r]) - one - value)
        if grads:
            terms[GRADS] = grads
        if setup is not None:  # the optimizer step's peak, where it is above the pipeline's
            static = sum(sum(footprints[s].static.values()) for s in stages)
            if twice:
                static -= sum(static_per_param(setup).values()) * twice
            sizes = [n for s in stages for n in footprints[s].param_sizes]
            if twice in sizes:  # a tied embedding the rank holds once is stepped once
                sizes.remove(twice)
            step = static + optimizer_step_transient(setup, sizes)
            if step > sum(terms.values()):
                terms[OPTIMIZER_STEP] = step - sum(terms.values())
        out.append(RankMemory(
            rank=r, stages=stages, layers=tuple(footprints[s].layers for s in stages),
            inflight=int(peak_inflight[r]), terms=terms, budget=float(budget),
        ))
    return out


__all__ = [
    "ACTIVATIONS",
    "ACTIVATION_FORMULAS",
    "GRADS",
    "GRAD_FOLDS",
    "GiB",
    "ModelSpec",
    "OPTIMIZERS",
    "DP_BACKENDS",
    "ONE_GRAD",
    "OPTIMIZER_STEP",
    "P2P",
    "RECOMPUTE_MODES",
    "RankMemory",
    "StageFootprint",
    "TrainingSetup",
    "boundary_bytes",
    "largest_param",
    "layer_activation_bytes",
    "shared_params",
    "logits_values",
    "one_grad_bytes",
    "optimizer_step_transient",
    "p2p_buffers",
    "rank_memory",
    "stage_footprint",
    "stage_footprints",
    "stage_param_sizes",
    "stage_params",
    "stash_buffers",
    "static_per_param",
    "transient_per_param",
]
