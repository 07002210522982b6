"""The nanotron config that pins a plan, and in words what no key of it can say.

[Note: plan YAML] `plan_yaml(config, candidate, nanotron_default=)` writes every setting
of nanotron's config that the estimate assumed, which is also what `pipeschedule plan
--model-file` reads back ([Note: a nanotron config's layout] in presets.py):

    parallelism  dp, pp, tp; pp_engine: the schedule, and inside its value what nanotron
                 has no key for (virtual, cap, split, recompute, offload: [Note: pp_engine
                 syntax] in pipeschedule/compiler/spec.py; nanotron 0.4 has no
                 recompute setting, so recompute travels there too); tp_mode,
                 tp_linear_async_communication
    model        dtype; model_config: the sizes planned (num_hidden_layers, hidden_size,
                 num_attention_heads, num_key_value_heads, intermediate_size, vocab_size,
                 tie_word_embeddings)
    tokens       sequence_length, micro_batch_size, batch_accumulation_per_replica
    optimizer    zero_stage, accumulate_grad_in_fp32, torch_adam_is_fused

It is a fragment: merged into a whole config (nanotron also needs general, tokenizer,
the model's init_method, the optimizer's learning rate ...), it loads with nanotron's own
`get_config_from_file`, and `plan --model-file` on it plans the same layout
(tests/plan/test_advice.py). `beyond_yaml(config, candidate)` says, one line each, what
the estimate assumed that nanotron's config has no key for.
"""

from __future__ import annotations

from pipeschedule.plan.config import PlanConfig
from pipeschedule.plan.fitting import OffloadCandidate
from pipeschedule.plan.memory import GiB, builds_ddp
from pipeschedule.plan.presets import GPUS, MEASURED_HOST_LINKS, preset_key

ATTENTION_WORDS = {
    "flash-attn": "flash-attn installed (nanotron's Llama imports it; where it is not, the adapter's pure-torch "
                  "stand-in runs: plan that with --attention sdpa-standin)",
    "sdpa-standin": "the adapter's pure-torch stand-in for flash-attn (integration/nanotron/flash_attn_standin.py)",
    "eager": "eager attention that saves its softmax scores (not what nanotron's Llama runs)",
}


def plan_sections(config: PlanConfig, candidate, *, nanotron_default: bool = False) -> dict:
    """The settings of [Note: plan YAML] as nested mappings, in nanotron's spelling."""
    st, m = config.setup, config.model
    return {
        "parallelism": {"dp": st.dp, "pp": config.pp, "tp": st.tp, "pp_engine": candidate.engine(nanotron_default),
                        "tp_mode": "REDUCE_SCATTER" if st.sequence_parallel else "ALL_REDUCE",
                        "tp_linear_async_communication": st.tp_async},
        "model": {"dtype": config.dtype_name,
                  "model_config": {"num_hidden_layers": m.layers, "hidden_size": m.hidden,
                                   "num_attention_heads": m.heads, "num_key_value_heads": m.kv_heads,
                                   "intermediate_size": m.ffn, "vocab_size": m.vocab,
                                   "tie_word_embeddings": m.tied_embeddings}},
        "tokens": {"sequence_length": st.seq, "micro_batch_size": st.micro_batch,
                   "batch_accumulation_per_replica": config.microbatches},
        "optimizer": {"zero_stage": st.zero_stage, "accumulate_grad_in_fp32": st.fp32_grad_accum,
                      "torch_adam_is_fused": st.adam_fused},
    }


def plan_yaml(config: PlanConfig, candidate, *, nanotron_default: bool = False) -> list[str]:
    """The YAML of [Note: plan YAML], as lines (block style, two spaces an indent)."""
    return _lines(plan_sections(config, candidate, nanotron_default=nanotron_default), 0)


def _lines(mapping: dict, indent: int) -> list[str]:
    out = []
    for key, value in mapping.items():
        if isinstance(value, dict):
            out += [" " * indent + f"{key}:"] + _lines(value, indent + 2)
        else:
            out.append(" " * indent + f"{key}: {_scalar(value)}")
    return out


def _scalar(value) -> str:
    """A YAML scalar: booleans as true/false; an engine value plain (its ':' is followed by
    no space and it holds no '#', so YAML reads it as one string)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


def beyond_yaml(config: PlanConfig, candidate) -> list[str]:
    """What the estimate assumed that nanotron's config has no key for, one line each."""
    st = config.setup
    label = GPUS.get(preset_key(config.gpu_name, GPUS), {}).get("label", config.gpu_name)
    lines = [
        (f"GPU: {label}, {config.gpu_memory / GiB:g} GiB, {config.reserve / GiB:g} GiB of it kept back for the CUDA "
         f"context, NCCL buffers and allocator slack (--gpu, --gpu-memory, --reserve)"),
        f"attention: {ATTENTION_WORDS[st.attention]}",
        (f"activations counted by the {st.activation_formula} formula (--activation-formula)"
         + (f"; DDP's {config.dtype_name} gradient buckets counted at one gradient's size (--no-ddp-buckets "
            "leaves them out)" if builds_ddp(st) and st.ddp_buckets else "")),
        (f"times: {config.gpu_tflops:g} TFLOP/s at {config.mfu:g} of peak, pipeline messages at "
         f"{config.p2p_bandwidth / 1e9:g} GB/s and {config.p2p_latency * 1e6:g} us, the data-parallel reduction at "
         f"{config.dp_bandwidth / 1e9:g} GB/s, the optimizer step at {config.hbm_bandwidth / 1e12:g} TB/s: they "
         "rank the plans; the seconds are estimates"),
    ]
    if isinstance(candidate, OffloadCandidate):
        host = max(candidate.host_bytes, default=0.0)
        lines.append(f"host offload over a link of {config.host_bandwidth / 1e9:g} GB/s a direction "
                     f"({host_link_words(config)}), with {host / GiB:.1f} GiB of host memory a GPU")
    return lines


def host_link_words(config: PlanConfig) -> str:
    """Where the host link figure of `config` comes from, in words ([Note: offload advice])."""
    if config.host_link_source == "given":
        return "the figure given with --host-bandwidth"
    if config.host_link_source == "measured":
        return MEASURED_HOST_LINKS.get(preset_key(config.gpu_name, MEASURED_HOST_LINKS), "measured")
    return "the GPU preset's datasheet figure; no offload plan has run over such a link"


__all__ = ["ATTENTION_WORDS", "beyond_yaml", "host_link_words", "plan_sections", "plan_yaml"]
