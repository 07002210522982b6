"""`pipeschedule plan`: its flags, turned into a PlanConfig (`plan.config.build_config`),
and its run.

The model comes from a preset (--model), a YAML/JSON file (--model-file, which may be a
whole nanotron config) or the size flags, which also override a preset or file
(--model llama3-70b --layers 40). Memory flags are in GiB, bandwidth in GB/s.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from pipeschedule.checks import (MAX_PLAN_DPS, PLAN_SEARCH_WORK, int_arg, int_list_arg, number_arg, path_arg,
                                shown)
from pipeschedule.errors import FormatError, ParameterError
from pipeschedule.plan.advice import advise
from pipeschedule.plan.assumptions import Assumptions, add_arguments as add_assumptions
from pipeschedule.plan.from_config import LAYOUT_DEFAULTS, layout_of, plan_config
from pipeschedule.plan.memory import ATTENTIONS, RECOMPUTE_MODES, ModelSpec
from pipeschedule.plan.nanotron_yaml import complete_config, config_text, merged_config
from pipeschedule.plan.presets import DTYPE_BYTES, MODELS, load_mapping, load_model, model_preset
from pipeschedule.plan.report import plan_png

SIZE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")


class Removed(argparse.Action):
    """A flag that is gone: one line saying what replaces it."""

    def __call__(self, parser, namespace, values, option_string=None):
        raise argparse.ArgumentError(self, f"{option_string} was folded into --attention: give --attention "
                                           f"{' | '.join(ATTENTIONS)} (eager: scores materialised)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """plan's flags, group by group, in the order `--help` lists them."""
    _model_arguments(parser)
    _layout_arguments(parser)
    add_assumptions(parser)  # [Note: shared assumptions]: check takes the same
    _gpu_arguments(parser)
    _search_arguments(parser)


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model (a preset, a file, or the sizes)")
    model.add_argument("--model", help=f"preset: {', '.join(MODELS)}")
    model.add_argument("--model-file", type=path_arg("--model-file"),
                       help="YAML or JSON with the sizes (a nanotron config works)")
    for flag in SIZE_FLAGS:
        name = "--" + flag.replace("_", "-")
        model.add_argument(name, type=int_arg(name), help=f"model {flag} (overrides the preset)")


def _layout_arguments(parser: argparse.ArgumentParser) -> None:
    layout = parser.add_argument_group("layout and training")
    # The layout's defaults are LAYOUT_DEFAULTS, applied after a nanotron config's values
    # (`resolve_layout`): None here means "not given".
    layout.add_argument("--pp", type=int_arg("--pp"), help="pipeline stages (required unless --model-file is a "
                                                           "nanotron config, which names them)")
    layout.add_argument("--tp", type=int_arg("--tp"), help="tensor parallel (default 1)")
    layout.add_argument("--dp", type=int_list_arg("--dp"),
                        help="data parallel replicas, or several to compare (1,2,4,8 or 1/2/4/8): one row each, one "
                             "recommendation (default 1)")
    layout.add_argument("--zero", choices=("0", "1", "auto"),
                        help="nanotron ZeRO stage, or auto: plan 0 and (dp > 1) 1 (default auto)")
    layout.add_argument("--microbatches", type=int_arg("--microbatches"),
                        help="microbatches per replica per step (nanotron batch_accumulation_per_replica; required "
                             "unless a nanotron config names it)")
    layout.add_argument("--seq", type=int_arg("--seq"), help="sequence length (default 8192, Llama3's)")
    layout.add_argument("--micro-batch", type=int_arg("--micro-batch"), help="sequences per microbatch (default 1)")
    layout.add_argument("--recompute", choices=RECOMPUTE_MODES + ("auto",), default="auto",
                        help="activation recompute, or auto: plan none, selective and full (default auto)")
    layout.add_argument("--tp-async", action=argparse.BooleanOptionalAction,
                        help="nanotron tp_linear_async_communication (default off, nanotron's default)")
    layout.add_argument("--adam-fused", action=argparse.BooleanOptionalAction,
                        help="nanotron torch_adam_is_fused (default on); off adds foreach Adam's temporary")
    layout.add_argument("--flash", "--no-flash", action=Removed, nargs=0, help=argparse.SUPPRESS)
    layout.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction,
                        help="nanotron tp_mode REDUCE_SCATTER (default on; a nanotron config without tp_mode: off, "
                             "its ALL_REDUCE)")
    layout.add_argument("--fp32-grad-accum", action=argparse.BooleanOptionalAction,
                        help="nanotron accumulate_grad_in_fp32 (default on)")
    layout.add_argument("--dtype", choices=tuple(DTYPE_BYTES),
                        help="nanotron model.dtype: the bytes of a weight and an activation (default bfloat16)")


def _gpu_arguments(parser: argparse.ArgumentParser) -> None:
    gpu = parser.add_argument_group("GPU and costs")
    gpu.add_argument("--gpu-tflops", type=number_arg("--gpu-tflops"), help="peak bf16 TFLOP/s (default: the preset's)")
    gpu.add_argument("--mfu", type=number_arg("--mfu"), default=0.5,
                     help="fraction of peak the matmuls reach (default 0.5)")
    gpu.add_argument("--p2p-bandwidth", type=number_arg("--p2p-bandwidth"), default=25.0,
                     help="GB/s between stages (default 25)")
    gpu.add_argument("--dp-bandwidth", type=number_arg("--dp-bandwidth"), default=25.0,
                     help="GB/s per GPU of the data-parallel gradient collectives (default 25)")
    gpu.add_argument("--p2p-latency", type=number_arg("--p2p-latency"), default=20.0,
                     help="microseconds per message (default 20)")
    gpu.add_argument("--offload", metavar="SPEC", default=None,
                     help="report what a given host offload adds to the recommendation (offload of whole ranks is "
                          "searched anyway where the host link is known): fraction=F[,lead=L][,ranks=..] or "
                          "auto[,budget=0.03]; add ,stream=MiB to stream stashes in chunks of that size")
    gpu.add_argument("--host-memory", metavar="GiB", type=number_arg("--host-memory"), default=None,
                     help="host memory per GPU that offloaded stashes may take; giving it lets a plan that offloads "
                          "be recommended where the link is only the GPU preset's datasheet figure (default: no "
                          "bound, and such plans are shown as options)")


def _search_arguments(parser: argparse.ArgumentParser) -> None:
    search = parser.add_argument_group("search and output")
    search.add_argument("--virtual", type=int_arg("--virtual"), default=4,
                        help="the most chunks per rank tried for interleaved candidates: every count from 2 up to it "
                             "whose chunks divide the layers evenly (default 4)")
    search.add_argument("--node-limit", type=int_arg("--node-limit"), default=20_000,
                        help=f"search nodes per optimal split (the columns and simulations it adds count as nodes), "
                             f"within a budget all the run's searches share "
                             f"({PLAN_SEARCH_WORK} over layers x pp): a search it stops early is a best found row "
                             f"(default 20000)")
    search.add_argument("--tables", choices=("none", "top", "all"), default="none",
                        help="beyond the best plan per dp, the recommendation and its YAML: top adds the memory per "
                             "rank, term by term, of the baseline and the recommendation; all adds every dp's lever "
                             "search, every candidate and its memory (default none)")
    search.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    search.add_argument("--png", metavar="PATH", type=path_arg("--png"),
                        help="write a stacked bar chart of memory per stage")
    search.add_argument("--write", metavar="OUT.yaml", type=path_arg("--write"),
                        help="write a whole nanotron config that runs the recommendation: the --model-file config with "
                             "every setting the estimate assumed merged in, or a complete one to start from; "
                             "`pipeschedule check OUT.yaml` (with the same assumption flags) accepts it")


def resolve_layout(args, err=None) -> argparse.Namespace:
    """`args` with every layout option set: the flag where given, else the value the
    nanotron config of --model-file names ([Note: a nanotron config's layout] in
    plan/presets.py), else LAYOUT_DEFAULTS (`plan.from_config.layout_of`). What the file
    set is said on `err`, once."""
    resolved = vars(args).copy()
    mapping = None
    if args.model_file is not None:  # read once: model_from_args takes the sizes from the same mapping
        mapping = resolved["model_mapping"] = load_mapping(args.model_file)
    layout, taken = layout_of(mapping, args.model_file, {option: resolved.get(option) for option in LAYOUT_DEFAULTS})
    resolved.update(layout)
    if taken:
        print(f"plan: from the nanotron config {args.model_file} (flags override): {', '.join(taken)}",
              file=err or sys.stderr)
    for dp in resolved["dp"]:
        if dp < 1:
            raise ParameterError(f"--dp takes data-parallel sizes >= 1, got {dp}")
    if len(set(resolved["dp"])) > MAX_PLAN_DPS:
        raise ParameterError(f"--dp compares at most {MAX_PLAN_DPS} data-parallel sizes (each is a lever search of "
                             f"its own), got {len(set(resolved['dp']))}")
    return argparse.Namespace(**resolved)


def model_from_args(args) -> ModelSpec:
    if args.model_file is not None and args.model is not None:
        raise ParameterError(f"give --model {shown(args.model)} or --model-file {shown(args.model_file)}, not both "
                             f"(a file's sizes would replace the preset's); single sizes override either")
    if args.model_file is not None:
        model = load_model(args.model_file, getattr(args, "model_mapping", None))
    elif args.model:
        model = model_preset(args.model)
    else:
        missing = [f"--{k.replace('_', '-')}" for k in SIZE_FLAGS if k != "kv_heads" and getattr(args, k) is None]
        if missing:
            raise ParameterError(f"give --model, --model-file, or the sizes ({', '.join(missing)} missing)")
        heads = args.heads
        return ModelSpec("custom", layers=args.layers, hidden=args.hidden, heads=heads,
                         kv_heads=args.kv_heads or heads, ffn=args.ffn, vocab=args.vocab)
    overrides = {k: getattr(args, k) for k in SIZE_FLAGS if getattr(args, k) is not None}
    return replace(model, **overrides) if overrides else model


def config_from_args(args):
    """The PlanConfig of the resolved flags (`resolve_layout`), at the smallest dp asked."""
    return plan_config(
        model_from_args(args), vars(args), Assumptions.from_args(args),
        recompute="none" if args.recompute == "auto" else args.recompute, dp_bandwidth=args.dp_bandwidth,
        gpu_tflops=args.gpu_tflops, mfu=args.mfu, p2p_bandwidth=args.p2p_bandwidth, p2p_latency=args.p2p_latency,
        virtual=args.virtual, node_limit=args.node_limit, offload=args.offload, host_memory=args.host_memory,
    )


class _Progress:
    """On a terminal, one line that says which of the lever search's plans is being made
    (a plan of a large model can take seconds to a minute each), rewritten in place and
    cleared at the end; nothing where stderr is not a terminal."""

    def __init__(self, stream, several_dp: bool) -> None:
        self.stream, self.several_dp, self.shown = stream, several_dp, False

    def __call__(self, k: int, n: int, dp: int, zero: int, mode: str) -> None:
        at = f"dp={dp}, " if self.several_dp else ""
        self.stream.write(f"\rplan: {at}ZeRO-{zero}, recompute {mode} ({k} of {n})...\033[K")
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()


def run(args, out=None, err=None) -> int:
    """The plan of each dp asked, the recommendation and its YAML ([Note: plan advice] in
    plan/advice.py), as text or one JSON object; exit 0, or 1 when nothing fits."""
    out, err = out or sys.stdout, err or sys.stderr
    args = resolve_layout(args, err)
    config = config_from_args(args)
    progress = _Progress(err, len(set(args.dp)) > 1) if err.isatty() else None
    try:
        advice = advise(config, args.dp, zero=None if args.zero == "auto" else (int(args.zero),),
                        recompute=None if args.recompute == "auto" else (args.recompute,), progress=progress)
    finally:
        if progress is not None:
            progress.clear()
    written = _write_config(args, advice) if args.write else None
    if args.json:
        for warning in advice.warnings:  # the text shows them; beside JSON they go to stderr too
            print(f"plan: warning: {warning}", file=err)
        data = advice.to_dict()
        data["summary"]["written"] = written
        out.write(json.dumps(data) + "\n")
    else:
        out.write(advice.to_text(tables=args.tables))
        if args.write:
            out.write(_written_text(args, advice, written))
    if args.png:  # the recommendation's plan, or the first dp's best when nothing fits
        plan_png(advice.plan_for_png, args.png)
    return 0 if advice.recommended is not None else 1


def _write_config(args, advice) -> str | None:
    """The recommendation's whole config at --write ([Note: written config] in
    plan/nanotron_yaml.py: merged into the --model-file config where it is a nanotron
    config); the path, or None where nothing fits (nothing is written)."""
    rec = advice.recommended
    if rec is None:
        return None
    mapping = getattr(args, "model_mapping", None)
    if isinstance(mapping, dict) and isinstance(mapping.get("parallelism"), dict):
        whole = merged_config(mapping, rec.config, rec.candidate, nanotron_default=rec.is_default)
    else:
        whole = complete_config(rec.config, rec.candidate, nanotron_default=rec.is_default)
    text = config_text(whole)
    try:
        with open(args.write, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as err:
        raise FormatError(f"cannot write {args.write}: {err.strerror or err}") from None
    return args.write


def _written_text(args, advice, written: str | None) -> str:
    if written is None:
        return f"\nNothing written to {args.write}: nothing fits.\n"
    rec = advice.recommended
    st = rec.config.setup
    nproc = st.dp * st.tp * rec.config.pp
    source = (f"{args.model_file} with the recommendation merged in" if isinstance(getattr(args, "model_mapping", None),
              dict) and "parallelism" in args.model_mapping else "a complete config to start from (set its data, "
              "tokenizer, learning rate and steps)")
    flags = " ".join(Assumptions.from_args(args).flags())
    return (f"\nWrote {written}: {source}. Check it under the same assumptions, then train it "
            f"({nproc} processes):\n  pipeschedule check {written}{' ' + flags if flags else ''} --nproc {nproc}\n"
            f"  pipeschedule train {written} --nproc {nproc}  (on several nodes: --nproc per node, with torchrun's "
            f"--nnodes; {nproc} processes in all)\n")


__all__ = ["LAYOUT_DEFAULTS", "add_arguments", "config_from_args", "model_from_args", "resolve_layout", "run"]
