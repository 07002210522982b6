"""What a memory estimate assumes that no key of a nanotron config says: the GPU and what is
kept back of it, the attention kernel, how activations are counted.

[Note: shared assumptions] `pipeschedule plan` and `pipeschedule check` price a config by
one memory model, so they must price it under the same assumptions, or the plan's
recommendation is refused by the check of the very config it wrote (it was: plan assumed
flash-attn, check the attention of the machine it ran on, and the users' 70B plan read
91.2 GiB in one and 114.56 GiB in the other). Both commands therefore take the same flags
(`add_arguments`), with the same defaults, build one `Assumptions` from them
(`Assumptions.from_args`), build the planner's `PlanConfig` from it (`config_kwargs`)
and print the same lines of it in their reports (`assumption_lines`). Where the machine a command runs on
differs from the assumption (no flash-attn here, say), the command says so, and keeps the
assumption: the estimate is of the GPUs the job will run on.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pipeschedule.checks import check_number, number_arg, shown
from pipeschedule.errors import ParameterError
from pipeschedule.plan.memory import ACTIVATION_FORMULAS, ATTENTIONS, GiB, builds_ddp
from pipeschedule.plan.presets import GPUS, MEASURED_HOST_LINKS, gpu_preset, preset_key

ATTENTION_WORDS = {
    "flash-attn": "flash-attn, nanotron's (where it is not installed, the adapter's pure-torch stand-in runs: "
                  "--attention sdpa-standin prices that)",
    "sdpa-standin": "the adapter's pure-torch stand-in for flash-attn (integration/nanotron/flash_attn_standin.py; "
                    "--attention)",
    "eager": "eager attention that saves its softmax scores, not what nanotron's Llama runs (--attention)",
}


@dataclass(frozen=True)
class Assumptions:
    """gpu: a GPU preset (`presets.GPUS`); gpu_memory: GiB per GPU, overriding the preset's
    (None: the preset's); reserve: GiB kept back for the CUDA context, NCCL buffers and
    allocator slack; attention: the kernel (`memory.ATTENTIONS`); activation_formula: the
    per-layer activation count (`memory.ACTIVATION_FORMULAS`); ddp_buckets: count torch
    DDP's gradient buckets where nanotron builds DDP; host_bandwidth: GB/s a direction of
    the host link offloaded stashes cross (None: the preset's, where it has one), which
    sets how long an offloaded stash stays on the device."""

    gpu: str = "gh200"
    gpu_memory: float | None = None
    reserve: float = 2.0
    attention: str = "flash-attn"
    activation_formula: str = "nanotron"
    ddp_buckets: bool = True
    host_bandwidth: float | None = None

    def __post_init__(self) -> None:
        gpu_preset(self.gpu)  # a name that is no preset is refused here, with the presets
        if self.gpu_memory is not None:
            check_number("--gpu-memory", self.gpu_memory, above=True, hint=" (GiB)")
        check_number("--reserve", self.reserve, hint=" (GiB)")
        if self.host_bandwidth is not None:
            check_number("--host-bandwidth", self.host_bandwidth, above=True, hint=" (GB/s per direction)")
        if self.attention not in ATTENTIONS:
            raise ParameterError(f"--attention must be one of {', '.join(ATTENTIONS)}, got {shown(self.attention)}")
        if self.activation_formula not in ACTIVATION_FORMULAS:
            raise ParameterError(f"--activation-formula must be one of {', '.join(ACTIVATION_FORMULAS)}, got "
                                 f"{shown(self.activation_formula)}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Assumptions:
        """The assumptions of the flags `add_arguments` added."""
        return cls(gpu=args.gpu, gpu_memory=args.gpu_memory, reserve=args.reserve, attention=args.attention,
                   activation_formula=args.activation_formula, ddp_buckets=args.ddp_buckets,
                   host_bandwidth=args.host_bandwidth)

    def config_kwargs(self) -> dict:
        """`plan.config.build_config`'s keyword arguments for these assumptions."""
        return {"gpu": self.gpu, "gpu_memory": self.gpu_memory, "reserve": self.reserve, "attention": self.attention,
                "activation_formula": self.activation_formula, "ddp_buckets": self.ddp_buckets,
                "host_bandwidth": self.host_bandwidth}

    def flags(self) -> list[str]:
        """The flags that give these assumptions, where they differ from the defaults (what
        a command that must agree with this one is given)."""
        default, out = Assumptions(), []
        for key in ("gpu", "gpu_memory", "reserve", "attention", "activation_formula", "host_bandwidth"):
            value = getattr(self, key)
            if value != getattr(default, key):
                out += [f"--{key.replace('_', '-')}", f"{value:g}" if isinstance(value, float) else str(value)]
        if not self.ddp_buckets:
            out.append("--no-ddp-buckets")
        return out


def assumption_lines(config, *, offload: bool = False) -> list[str]:
    """What a report prints of the assumptions a `PlanConfig` was built under, one line
    each with the flags that change it ([Note: shared assumptions]: `plan` and `check`
    print these same lines); the host link where stashes are offloaded (`offload`)."""
    st = config.setup
    label = GPUS.get(preset_key(config.gpu_name, GPUS), {}).get("label", config.gpu_name)
    buckets = ""
    if builds_ddp(st):
        buckets = (f"; DDP's {config.dtype_name} gradient buckets counted at one gradient's size (--no-ddp-buckets "
                   "leaves them out)" if st.ddp_buckets else "; DDP's gradient buckets not counted (--no-ddp-buckets)")
    return [(f"GPU: {label}, {config.gpu_memory / GiB:g} GiB, {config.reserve / GiB:g} GiB of it kept back for the "
             f"CUDA context, NCCL buffers and allocator slack (--gpu, --gpu-memory, --reserve)"),
            f"attention: {ATTENTION_WORDS[st.attention]}",
            f"activations counted by the {st.activation_formula} formula (--activation-formula){buckets}"] + (
        [f"host link: {config.host_bandwidth / 1e9:g} GB/s a direction ({host_link_words(config)}; --host-bandwidth)"
         if config.host_bandwidth is not None else "host link: unknown for this GPU (--host-bandwidth GB/s)"]
        if offload else [])


def host_link_words(config) -> str:
    """Where the host link figure of `config` comes from, in words ([Note: offload advice]
    in config.py)."""
    if config.host_link_source == "given":
        return "the figure given with --host-bandwidth"
    if config.host_link_source == "measured":
        return MEASURED_HOST_LINKS.get(preset_key(config.gpu_name, MEASURED_HOST_LINKS), "measured")
    return "the GPU preset's datasheet figure; no offload plan has run over such a link"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of [Note: shared assumptions], in a group of their own; `plan` and `check`
    both add them."""
    group = parser.add_argument_group("assumptions (plan and check take the same, and print them)")
    group.add_argument("--gpu", default="gh200", help=f"GPU preset: {', '.join(GPUS)} (default gh200)")
    group.add_argument("--gpu-memory", type=number_arg("--gpu-memory"), help="GiB per GPU (overrides the preset)")
    group.add_argument("--reserve", type=number_arg("--reserve"), default=2.0,
                       help="GiB kept back for CUDA context, NCCL buffers, allocator slack (default 2)")
    group.add_argument("--attention", choices=ATTENTIONS, default="flash-attn",
                       help="attention kernel: flash-attn (nanotron's), the adapter's sdpa-standin (where flash-attn "
                            "is not installed), or eager (softmax scores materialised, under --activation-formula "
                            "korthikanti or llama; selective recompute then reruns them); default flash-attn")
    group.add_argument("--activation-formula", choices=ACTIVATION_FORMULAS, default="nanotron",
                       help="per-layer activation count (default nanotron: its Llama's saved tensors)")
    group.add_argument("--ddp-buckets", action=argparse.BooleanOptionalAction, default=True,
                       help="count torch DDP's gradient buckets when nanotron builds DDP (dp > 1 without ZeRO-1 and "
                            "fp32 accumulation; default on)")
    group.add_argument("--host-bandwidth", metavar="GB/s", type=number_arg("--host-bandwidth"), default=None,
                       help="host link per direction, for stashes offloaded to host memory (default: the preset's, "
                            "gh200 450, h200 55.4)")


__all__ = ["ATTENTION_WORDS", "Assumptions", "add_arguments", "assumption_lines", "host_link_words"]
