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

[Note: written config] `plan --write OUT.yaml` writes a whole config: the user's nanotron
config (--model-file) with the sections above merged into it (`merged_config`: every key
of theirs kept, every key the estimate assumed set to what it assumed), or, without one,
`complete_config`: those sections inside a small complete config of nanotron 0.4 for its
Llama (synthetic data, AdamW with warmup and cosine decay, checkpoints under
`checkpoints`), to start from. Either loads with nanotron's loader, `pipeschedule check`
accepts it under the same assumptions, predicting the same memory per rank as the plan
(tests/nanotron/test_plan_write.py), and the launcher trains it.
"""

from __future__ import annotations

import copy

from pipeschedule.plan.config import MEASURED_MFU, PlanConfig
from pipeschedule.plan.fitting import OffloadCandidate
from pipeschedule.plan.assumptions import assumption_lines, host_link_words
from pipeschedule.plan.memory import GiB
from pipeschedule.plan.yaml_writer import dump_yaml

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


def merged_config(mapping: dict, config: PlanConfig, candidate, *, nanotron_default: bool = False) -> dict:
    """[Note: written config]: the user's nanotron config `mapping` with the plan's
    sections merged in; a key nanotron nests elsewhere in the user's version
    (`optimizer.optimizer_factory.torch_adam_is_fused` after 0.4) is set where it is."""
    out = copy.deepcopy(mapping)
    sections = plan_sections(config, candidate, nanotron_default=nanotron_default)
    optimizer = out.get("optimizer")
    if isinstance(optimizer, dict) and isinstance(optimizer.get("optimizer_factory"), dict):
        factory = sections["optimizer"].pop("torch_adam_is_fused")
        sections["optimizer"]["optimizer_factory"] = {"torch_adam_is_fused": factory}
    _merge(out, sections)
    return out


def _merge(into: dict, sections: dict) -> None:
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def complete_config(config: PlanConfig, candidate, *, nanotron_default: bool = False) -> dict:
    """[Note: written config]: a whole nanotron 0.4 config for its Llama holding the plan's
    sections; what the plan does not decide is a small default to edit (the data, the
    tokenizer, the learning rate, the steps)."""
    base = {
        "general": {"project": "pipeschedule", "run": "planned", "seed": 42},
        "checkpoints": {"checkpoints_path": "checkpoints", "checkpoint_interval": 1000, "save_initial_state": False,
                        "resume_checkpoint_path": None},
        "parallelism": {},
        "model": {"make_vocab_size_divisible_by": 1, "init_method": {"std": 0.02},
                  "model_config": {"max_position_embeddings": config.setup.seq}},
        "tokenizer": {"tokenizer_name_or_path": None},
        "tokens": {"train_steps": 1000},
        "optimizer": {
            "weight_decay": 0.01, "clip_grad": 1.0, "adam_eps": 1e-8, "adam_beta1": 0.9, "adam_beta2": 0.95,
            "learning_rate_scheduler": {"learning_rate": 3e-4, "lr_warmup_steps": 100, "lr_warmup_style": "linear",
                                        "lr_decay_style": "cosine", "min_decay_lr": 3e-5}},
        "logging": {"log_level": "info", "log_level_replica": "info", "iteration_step_info_interval": 1},
        "data": {"dataset": None, "seed": 1234, "num_loading_workers": 1},
    }
    return merged_config(base, config, candidate, nanotron_default=nanotron_default)


def config_text(mapping: dict) -> str:
    """A written config's YAML (it reads back as `mapping`: `yaml_writer.dump_yaml`)."""
    return dump_yaml(mapping)


def beyond_yaml(config: PlanConfig, candidate) -> list[str]:
    """What the estimate assumed that nanotron's config has no key for, one line each."""
    lines = assumption_lines(config) + [
        (f"times: {config.gpu_tflops:g} TFLOP/s at {config.mfu:g} of peak (--mfu), pipeline messages at "
         f"{config.p2p_bandwidth / 1e9:g} GB/s and {config.p2p_latency * 1e6:g} us, the data-parallel reduction at "
         f"{config.dp_bandwidth / 1e9:g} GB/s, the optimizer step at {config.hbm_bandwidth / 1e12:g} TB/s; the one "
         f"run measured reached {MEASURED_MFU[0]:g} to {MEASURED_MFU[1]:g} of peak by this count (by its recompute: "
         f"docs/users_case.md), so expect {MEASURED_MFU[0] / config.mfu:.2f}x to "
         f"{MEASURED_MFU[1] / config.mfu:.2f}x the printed tokens/s"),
    ]
    if isinstance(candidate, OffloadCandidate):
        host = max(candidate.host_bytes, default=0.0)
        lines.append(f"host offload over a link of {config.host_bandwidth / 1e9:g} GB/s a direction "
                     f"({host_link_words(config)}), with {host / GiB:.1f} GiB of host memory a GPU")
    return lines


__all__ = ["beyond_yaml", "complete_config", "config_text", "host_link_words", "merged_config", "plan_sections",
           "plan_yaml"]
