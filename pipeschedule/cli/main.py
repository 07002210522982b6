"""The `pipeschedule` command.

    pipeschedule compile SCHEDULE --pp P --microbatches M [--virtual V] [--cap C|C0,C1,..] --json PATH
                              [--offload fraction=F[,lead=L][,ranks=..]|auto[,budget=B]][,stream=MiB]]
                              [--host-bandwidth GB/s]
    pipeschedule verify PATH                  exit 0 valid, 1 invalid, 2 unusable input
    pipeschedule simulate SCHEDULE|--schedule PATH [...] [--cost PATH] [--json] [--trace PATH] [--png PATH]
    pipeschedule show SCHEDULE ...            ASCII timeline
    pipeschedule demo                         1f1b vs capped_1f1b vs interleaved, side by side
    pipeschedule plan ...                     what fits a GPU (see `pipeschedule plan -h`)
    pipeschedule check CONFIG ..., train CONFIG --nproc N ...   the nanotron adapter's commands
    pipeschedule --version

SCHEDULE is any pp_engine value ([Note: pp_engine syntax] in compiler/spec.py):
`capped_1f1b:cap=2`, `zbv`, `interleaved_1f1b:virtual=2`, a family's own name (`1f1b`);
--virtual and --cap give the same parameters beside it.

Every error the user can cause ends with one line on stderr and a non-zero exit code,
never a traceback: 2 for bad input (naming the value, cut to a readable length, and what
is accepted; sizes beyond [Note: size limits] in checks.py included), 1 for a schedule
that breaks a rule.

[Note: one command, its own imports] `main` builds the arguments of the one subcommand
it runs (`build_parser(command)`): `compile`, `verify`, `simulate` and `show` load the
compiler and the simulator only, `plan` loads the planner (`pipeschedule.plan`), and a
registered command ([Note: registered commands] in command.py: nanotron's `check` and
`train`) loads its own module, which loads torch and nanotron only once it runs.
`build_parser()` with no command builds them all (tests, help pages).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import textwrap
from dataclasses import replace
from importlib import metadata

from pipeschedule.checks import (
    MAX_SHOWN, check_number, check_png_size, check_trace_size, int_arg, number_arg, parse_int_list, path_arg, shown,
)
from pipeschedule.cli.command import Command, load_command, registered
from pipeschedule.cli.demo import run_demo
from pipeschedule.compiler.effects import COPY_OPS
from pipeschedule.compiler.families import FAMILIES
from pipeschedule.compiler.ir import COMPUTE_OPS, load
from pipeschedule.compiler.offload_spec import AutoOffload, parse_offload
from pipeschedule.compiler.spec import (ScheduleSpec, compile_spec, family_of, inflight_unit, parse_spec,
                                        unbound_cap, value_name)
from pipeschedule.compiler.passes import is_lowered, lower
from pipeschedule.compiler.torch_csv import load_csv, write_csv
from pipeschedule.compiler.verify import check_coverage, verify
from pipeschedule.errors import FormatError, ParameterError, PipescheduleError, ScheduleError
from pipeschedule.simulate import CostModel, load_cost, simulate
from pipeschedule.simulate.offload_search import choose_offload, evaluate_offload
from pipeschedule.simulate.render import ascii_timeline, chrome_trace, png

EXIT_INVALID = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (exit 2)."""

    def error(self, message):
        # argparse repeats the value it refuses ('invalid choice: ...'): cut long ones
        message = re.sub(r"'([^']{%d})[^']{4,}'" % (MAX_SHOWN - 5), r"'\1...'", message)
        raise ParameterError(f"{self.prog}: {message} (see {self.prog} -h)")


def parse_cap(text: str):
    """`--cap 2` -> 2; `--cap 4/3/2/1` (pp_engine's `cap=4/3/2/1`) or `--cap 4,3,2,1` ->
    [4, 3, 2, 1] ([Note: list syntax] in checks.py)."""
    values = parse_int_list(text, "--cap")
    return values[0] if len(values) == 1 else values


def _virtual_help() -> str:
    """Which families take --virtual, and which fix it: `interleaved_1f1b; zbv, v_half, v_min: 2`."""
    takes = [name for name, f in FAMILIES.items() if f.takes_virtual]
    fixed = [name for name, f in FAMILIES.items() if f.chunks() > 1]
    return "; ".join(filter(None, [", ".join(takes), fixed and f"{', '.join(fixed)}: {FAMILIES[fixed[0]].chunks()}"]))


def _schedule_args(parser: argparse.ArgumentParser, *, name_required: bool = True) -> None:
    parser.add_argument("name", nargs=None if name_required else "?", metavar="SCHEDULE",
                        help="a pp_engine value: a family's name or engine name (" + ", ".join(FAMILIES)
                             + "; ps_1f1b, ps_afab) with its parameters, e.g. capped_1f1b:cap=2 or "
                               "interleaved_1f1b:virtual=2")
    parser.add_argument("--pp", type=int_arg("--pp"), default=None, help="pipeline ranks")
    parser.add_argument("--microbatches", "-m", type=int_arg("--microbatches"), default=None,
                        help="microbatches per step")
    parser.add_argument("--virtual", type=int_arg("--virtual"), default=None,
                        help=f"chunks per rank ({_virtual_help()}); as the value's virtual=")
    parser.add_argument("--cap", type=str, default=None,
                        help="in-flight cap: one int for all ranks, or one per rank as pp_engine writes it, "
                             "C0/C1/... (C0,C1,... also); as the value's cap=")


def cli_spec(args) -> ScheduleSpec:
    """The `ScheduleSpec` SCHEDULE names, with --virtual and --cap (where given) as its
    parameters; a family that fixes its chunks takes --virtual of that count, as
    `generate` does."""
    if args.cap is not None:
        parse_cap(args.cap)  # its own words for a cap that is no list of integers
    flags = {"virtual": args.virtual, "cap": args.cap}
    family = family_of(value_name(args.name) or "")
    if family is not None and not family.takes_virtual and args.virtual == family.chunks():
        flags["virtual"] = None  # zbv --virtual 2: its own count
    given = {key: str(value) for key, value in flags.items() if value is not None}
    beside = "".join(f" --{key} {value}" for key, value in given.items())
    spec = parse_spec(args.name, given=given, shown_as=f"schedule {shown(args.name)}{beside}")
    if not isinstance(spec, ScheduleSpec):
        raise ParameterError(f"schedule {shown(args.name)}: auto is chosen by the engine at its first step, from "
                             "what that step measures; name a schedule (capped_1f1b:cap=2, ps_1f1b, ...)")
    return spec


def warn_unfilled(schedule, err=None) -> None:
    """On stderr, one line when a schedule has fewer microbatches than ranks: the share
    of the step its ranks idle at unit costs, beside 1F1B's at m = pp."""
    pp, m = schedule.pp, schedule.microbatches
    if m >= pp:
        return
    idle = simulate(schedule if is_lowered(schedule) else lower(schedule), CostModel.default(schedule)).bubble_fraction
    print(f"pipeschedule: warning: {m} microbatch{'es' if m > 1 else ''} < pp={pp}: the pipeline never fills; this "
          f"schedule's ranks idle {idle:.0%} of the step at unit costs (1F1B at m=pp: {(pp - 1) / (2 * pp - 1):.0%})",
          file=err or sys.stderr)


def _build(args, cost=None, err=None):
    """The lowered, verified schedule SCHEDULE names at --pp, --microbatches (under `cost`
    where given); on stderr, one line where its cap binds on no rank and one where it
    names a split or recompute, which set the model's layout, not the schedule."""
    spec = cli_spec(args)  # an unknown name is refused first, with the accepted ones
    missing = [flag for flag, value in (("--pp", args.pp), ("--microbatches", args.microbatches)) if value is None]
    if missing:
        raise ParameterError(f"{' and '.join(missing)} required to build schedule {shown(args.name)}")
    schedule = compile_spec(spec, pp=args.pp, microbatches=args.microbatches, cost=cost)
    if cost is None:  # said once, for the first build
        unbound = unbound_cap(spec, pp=args.pp, microbatches=args.microbatches)
        if unbound:
            print(f"pipeschedule: warning: {unbound}", file=err or sys.stderr)
        layout = [key for key in ("split", "recompute") if getattr(spec, key) is not None]
        if layout:
            print(f"pipeschedule: note: {' and '.join(layout)} set the model's layout, not the schedule's order: "
                  "the unit costs here do not see them (`pipeschedule plan` prices them)", file=err or sys.stderr)
    return schedule


def _load_any(path: str):
    """The schedule in a file, lowered (`passes.lower`) when the file holds a compute
    order only (a compute_only CSV, say), so that every command checks and runs the
    program that would run; and whether it was lowered here. A compute order is checked
    for rule 1 (coverage) first, so that a missing or misplaced compute is reported as
    such rather than as the order the lowering cannot time. Raises ScheduleError."""
    if path.endswith(".csv"):
        schedule = load_csv(path)
    else:
        schedule = load(path)
    if all(i.op in COMPUTE_OPS for program in schedule.programs for i in program):
        check_coverage(schedule)
        return lower(schedule), True
    return schedule, False


def _offload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--offload", metavar="SPEC", default=None,
                        help="move stashes to host memory: fraction=F[,lead=L][,ranks=R0/R1..] or auto[,budget=0.03]; "
                             "add ,stream=MiB to stream them in chunks of that size")
    parser.add_argument("--host-bandwidth", metavar="GB/s", type=number_arg("--host-bandwidth"), default=None,
                        help="host link per direction, GB/s; cost times are read as ms (default: infinite)")


def _with_host_link(args, cost):
    """`cost` with --host-bandwidth (GB/s = 1e6 bytes per ms) on both directions."""
    if getattr(args, "host_bandwidth", None) is None:
        return cost
    per_ms = check_number("--host-bandwidth", args.host_bandwidth, above=True, hint=" (GB/s per direction)") * 1e6
    return replace(cost, offload_bandwidth=per_ms, reload_bandwidth=per_ms)


def _offloaded(args, schedule, cost):
    """The schedule with --offload applied (None: the option was not given) as
    (schedule, OffloadChoice or None), the choice being made under `cost`."""
    if getattr(args, "offload", None) is None:
        return schedule, None

    spec = parse_offload(args.offload)
    if isinstance(spec, AutoOffload):
        choice = choose_offload(schedule, cost, spec)
    else:
        choice = evaluate_offload(schedule, cost, spec)

    verify(choice.schedule)
    return choice.schedule, choice


def _offload_line(choice) -> str:
    offloaded = ", ".join(f"{k}/{n}" for k, n in choice.counts)
    return (f"offload {choice.policy.text()}: stashes offloaded per rank {offloaded}; step time "
            f"{choice.base_step_time:g} -> {choice.step_time:g} ({choice.slowdown:+.2%}); peak bytes "
            f"{[round(b, 3) for b in choice.peak_before]} -> {[round(b, 3) for b in choice.peak_after]}, "
            f"on the host {[round(b, 3) for b in choice.peak_host]}")


def cmd_compile(args) -> int:
    schedule = _build(args)
    if not (args.json or args.text or args.csv):
        raise ParameterError("compile needs an output: --json PATH, --text PATH or --csv PATH")
    choice = None
    if args.host_bandwidth is not None and args.offload is None:
        raise ParameterError("compile --host-bandwidth only matters with --offload (the link is used to choose it)")

    cost = load_cost(args.cost, schedule) if args.cost else None
    if cost is not None:  # order and place messages by the measured costs ([Note: cost-aware timing])
        schedule = _build(args, cost)
    if args.offload is not None:
        schedule, choice = _offloaded(args, schedule, _with_host_link(args, cost or CostModel.default(schedule)))
    if args.json:
        _write(args.json, schedule.to_json())
    if args.text:
        _write(args.text, schedule.to_text())
    if args.csv:
        _write(args.csv, write_csv(schedule, form=args.csv_form))
        moved = sum(i.op in COPY_OPS for program in schedule.programs for i in program)
        if moved:
            print(f"pipeschedule: note: PyTorch's CSV has no OFFLOAD or RELOAD: {args.csv} leaves out the "
                  f"schedule's {moved} (the --json and --text forms keep them)", file=sys.stderr)
    warn_unfilled(schedule)
    count = sum(len(p) for p in schedule.programs)
    print(f"compiled {schedule.name}: pp={schedule.pp} virtual={schedule.virtual} "
          f"microbatches={schedule.microbatches}, {count} instructions, verified")
    if choice is not None:
        print(_offload_line(choice))
    return 0


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as err:
        raise FormatError(f"cannot write {path}: {err}") from None


def cmd_verify(args) -> int:
    try:
        schedule, lowered = _load_any(args.path)
        verify(schedule)
    except ScheduleError as err:
        head, _, grid = str(err).partition("\n")
        if grid:
            print(grid)
        print(f"pipeschedule verify: {args.path}: invalid: {head}", file=sys.stderr)
        return EXIT_INVALID
    count = sum(len(p) for p in schedule.programs)
    how = ", lowered from its compute order" if lowered else ""
    kind = ", forward only" if schedule.forward_only else ""
    print(f"{args.path}: valid ({schedule.name}, pp={schedule.pp}, virtual={schedule.virtual}, "
          f"microbatches={schedule.microbatches}, {count} instructions{how}{kind})")
    return 0


def _schedule_for(args):
    if args.schedule is not None:
        if family_of(value_name(args.schedule) or "") is not None and not os.path.exists(args.schedule):
            raise ParameterError(f"--schedule takes a schedule file, and {shown(args.schedule)} is a schedule family: "
                                 f"give it as NAME, the first argument (pipeschedule {args.command} "
                                 f"{args.schedule} --pp 4 --microbatches 8)")
        given = [flag for flag, value in (("NAME", args.name), ("--pp", args.pp), ("--microbatches", args.microbatches),
                                          ("--virtual", args.virtual), ("--cap", args.cap)) if value is not None]
        if given:
            raise ParameterError(f"--schedule {shown(args.schedule)} is a whole schedule; {', '.join(given)} "
                                 f"would be ignored: give either a schedule file or NAME with its flags")
        schedule, _ = _load_any(args.schedule)
        verify(schedule)
        return schedule
    if not args.name:
        raise ParameterError("give a schedule family NAME or --schedule PATH")
    return _build(args)


def cmd_simulate(args) -> int:
    if args.schedule is None and args.name and args.pp is not None and args.microbatches is not None:
        _check_drawings(args, args.pp, cli_spec(args).chunks, args.microbatches)  # before any work
    schedule = _schedule_for(args)
    _check_drawings(args, schedule.pp, schedule.virtual, schedule.microbatches)  # before the simulation
    warn_unfilled(schedule)
    cost = _with_host_link(args, load_cost(args.cost, schedule) if args.cost else CostModel.default(schedule))
    choice = None
    if args.offload is not None:
        schedule, choice = _offloaded(args, schedule if is_lowered(schedule) else lower(schedule), cost)
        cost = choice.policy.cost(cost)  # with its streaming, if any
    result = simulate(schedule, cost)
    if args.trace:
        _write(args.trace, json.dumps(chrome_trace(schedule, result)))
    if args.png:
        png(schedule, result, args.png)
    if args.json:
        extra = {"offload": choice.to_dict()} if choice is not None else {}
        print(json.dumps(result.to_dict() | {"name": schedule.name, "pp": schedule.pp, "virtual": schedule.virtual,
                                             "microbatches": schedule.microbatches,
                                             "inflight_unit": inflight_unit(schedule.virtual)} | extra))
    else:
        print(_summary(schedule, result))
        if choice is not None:
            print(f"  peak host bytes  {[round(b, 3) for b in result.peak_host_bytes]}")
            print("  " + _offload_line(choice))
    return 0


def _check_drawings(args, pp: int, virtual: int, microbatches: int) -> None:
    """--png and --trace within their sizes ([Note: size limits])."""
    if args.png:
        check_png_size(pp, virtual, microbatches)
    if args.trace:
        check_trace_size(pp, virtual, microbatches)


def _summary(schedule, result) -> str:
    return (
        f"{schedule.name}: pp={schedule.pp} virtual={schedule.virtual} microbatches={schedule.microbatches}\n"
        f"  step time        {result.step_time:g}\n"
        f"  bubble fraction  {result.bubble_fraction:.4f}\n"
        f"  peak in-flight   {list(result.peak_inflight)} {inflight_unit(schedule.virtual)}\n"
        f"  peak bytes       {[round(b, 3) for b in result.peak_bytes]}"
    )


def cmd_show(args) -> int:
    schedule = _schedule_for(args)
    result = simulate(schedule, CostModel.default(schedule))
    timeline = ascii_timeline(schedule, result, width=args.width)  # a refusal of its size comes alone
    warn_unfilled(schedule)
    print(timeline)
    return 0


def cmd_demo(args) -> int:
    return run_demo()


def _add_compile(p: argparse.ArgumentParser) -> None:
    _schedule_args(p)
    p.add_argument("--json", type=path_arg("--json"), metavar="PATH", help="write the pipeschedule/1 JSON form")
    p.add_argument("--text", type=path_arg("--text"), metavar="PATH", help="write the compact text form")
    p.add_argument("--csv", type=path_arg("--csv"), metavar="PATH", help="write PyTorch's pipeline CSV")
    p.add_argument("--csv-form", choices=("compute_only", "compute_comms"), default="compute_comms")
    _offload_args(p)
    p.add_argument("--cost", metavar="PATH", type=path_arg("--cost"),
                   help="cost model JSON: list-scheduled families order by its times and messages are placed by them; "
                        "--offload auto simulates with it (default: unit costs)")
    p.set_defaults(run=cmd_compile)


def _add_verify(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", type=path_arg("PATH"), metavar="PATH",
                   help="a schedule: pipeschedule/1 JSON, the text form, or PyTorch's CSV (either form)")
    p.set_defaults(run=cmd_verify)


def _add_simulate(p: argparse.ArgumentParser) -> None:
    _schedule_args(p, name_required=False)
    p.add_argument("--schedule", metavar="PATH", type=path_arg("--schedule"), help="a schedule file instead of NAME")
    p.add_argument("--cost", metavar="PATH", type=path_arg("--cost"),
                   help="cost model JSON (per-stage times, buffer bytes, p2p latency/bandwidth; examples/)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--trace", metavar="PATH", type=path_arg("--trace"), help="write a Chrome/Perfetto trace")
    p.add_argument("--png", metavar="PATH", type=path_arg("--png"), help="write a PNG (needs matplotlib)")
    _offload_args(p)
    p.set_defaults(run=cmd_simulate)


def _add_show(p: argparse.ArgumentParser) -> None:
    _schedule_args(p, name_required=False)
    p.add_argument("--schedule", metavar="PATH", type=path_arg("--schedule"), help="a schedule file instead of NAME")
    p.add_argument("--width", type=int_arg("--width"), default=None, help="maximum columns")
    p.set_defaults(run=cmd_show)


def _add_demo(p: argparse.ArgumentParser) -> None:
    p.set_defaults(run=cmd_demo)


def _add_plan(p: argparse.ArgumentParser) -> None:
    from pipeschedule.cli import plan  # the planner: loaded for `plan` only ([Note: one command, its own imports])

    plan.add_arguments(p)
    p.set_defaults(run=plan.run)


COMMANDS = {
    "compile": Command(
        "build, lower and verify a schedule; write it as JSON, text or PyTorch's CSV",
        "Generate the compute order of a schedule family, add its sends, receives and frees, verify every rule "
        "and write the per-rank instruction lists.",
        ("pipeschedule compile capped_1f1b --pp 4 --microbatches 8 --cap 2 --json s.json",
         "pipeschedule compile interleaved_1f1b --pp 4 -m 8 --virtual 2 --text s.txt --offload fraction=0.5"),
        _add_compile),
    "verify": Command(
        "check a schedule file (JSON, text or PyTorch's CSV) against every rule",
        "Check a schedule file against the six rules (coverage, data dependencies, matching, no deadlock, "
        "liveness, caps); a file holding a compute order only is lowered first. Exit 0: valid; 1: invalid (the "
        "rank x step grid around the fault is printed); 2: the file cannot be used.",
        ("pipeschedule verify s.json", "pipeschedule verify torch_schedule.csv"),
        _add_verify),
    "simulate": Command(
        "simulate one step: time, bubble, peak memory per rank",
        "Simulate one step of a schedule under a cost model (default: unit costs) and print its step time, bubble "
        "fraction, peak in-flight microbatches and peak bytes per rank.",
        ("pipeschedule simulate interleaved_1f1b --pp 4 -m 8 --virtual 2 --json",
         "pipeschedule simulate 1f1b --pp 4 -m 8 --cost examples/cost_pp4.json --trace t.json"),
        _add_simulate),
    "show": Command(
        "print a schedule's timeline as ASCII",
        "Print the simulated timeline of a schedule, one row per rank, under unit costs.",
        ("pipeschedule show capped_1f1b --pp 4 -m 8 --cap 2", "pipeschedule show --schedule s.json --width 100"),
        _add_show),
    "demo": Command(
        "1f1b vs capped_1f1b vs interleaved_1f1b at pp=4, 8 microbatches; then nanotron training on CPU",
        "Compile, verify and simulate 1f1b, capped_1f1b (cap 2) and interleaved_1f1b (virtual 2) side by side; "
        "then what installed packages register after it (the nanotron adapter, where torch and nanotron are "
        "installed: nanotron's Llama trained on CPU under nanotron's 1F1B and pipeschedule's capped_1f1b).",
        ("pipeschedule demo",),
        _add_demo),
    "plan": Command(
        "what fits a GPU: memory per stage, throughput, recommended schedule",
        "Evaluate nanotron's default and every schedule, cap and layer split for a model, a layout and a GPU: "
        "memory per rank, simulated throughput, and the pp_engine line of the fastest that fits.",
        ("pipeschedule plan --model llama3-70b --pp 4 --tp 4 --dp 2 --microbatches 8 --gpu gh200",
         "pipeschedule plan --model-file config.yaml --gpu h100 --write planned.yaml"),
        _add_plan),
}  # the core's own; others are registered ([Note: registered commands] in command.py)

DESCRIPTION = """\
Pipeline-parallel schedules for nanotron: each schedule is compiled ahead of time into
per-rank instruction lists (forward, backward, send, receive, free), verified against
every rule before it runs, simulated for time and memory, and run by nanotron's own
trainer through `parallelism.pp_engine` in its YAML (capped_1f1b:cap=2,
interleaved_1f1b:virtual=2, zb_h1, zbv, ...)."""

EPILOG = """\
training (torch and nanotron installed; `check` and `train` are the nanotron adapter's commands):
  pipeschedule train CONFIG --nproc N
  torchrun --nproc-per-node N -m integration.nanotron.train --config-file CONFIG

examples:
  pipeschedule demo
  pipeschedule compile capped_1f1b --pp 4 --microbatches 8 --cap 2 --json s.json
  pipeschedule plan --model-file config.yaml --gpu h100
  pipeschedule check config.yaml --nproc 8

`pipeschedule COMMAND -h` describes each command."""

ALL = "all"  # build_parser(ALL): every subcommand's options


def version() -> str:
    """The installed package's version (pyproject.toml's, through its metadata)."""
    try:
        return metadata.version("pipeschedule")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def all_commands(command: str | None = ALL) -> dict[str, Command]:
    """The core's commands and the registered ones ([Note: registered commands]); a
    registered command is loaded where it is `command` or ALL, or its help is listed (None)."""
    out = dict(COMMANDS)
    for name, entry in registered().items():
        if name in COMMANDS:
            raise ParameterError(f"{entry.value} registers a command {name!r}, which is the core's own")
        if command in (ALL, None, name):
            try:
                out[name] = load_command(name, entry)
            except ParameterError as err:
                if command == name or command == ALL:
                    raise
                out[name] = Command(f"(cannot be loaded: {err})", "", (), lambda p: None)
        else:
            out[name] = Command("", "", (), lambda p: None)  # listed as a choice, not loaded
    return out


def build_parser(command: str | None = ALL) -> argparse.ArgumentParser:
    """The parser of every subcommand (ALL), or of `command` alone: the others are listed
    but take no options, and their modules are not loaded ([Note: one command, its own
    imports]); None: none of them (`pipeschedule -h`, `--version`)."""
    parser = _Parser(prog="pipeschedule", description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"pipeschedule {version()}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    sub.required = True
    for name, spec in all_commands(command).items():
        examples = "examples:\n" + "\n".join("  " + line for line in spec.examples)
        p = sub.add_parser(name, help=spec.help, description=textwrap.fill(spec.description, 88), epilog=examples,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if command in (ALL, name):
            spec.add(p)
    return parser


def command_of(argv) -> str | None:
    """The subcommand `argv` names: its first word that is not an option (the top level
    takes no option with a value), or None."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _run(argv)
    except ScheduleError as err:
        print(f"pipeschedule: invalid schedule: {str(err).splitlines()[0]}", file=sys.stderr)
        return EXIT_INVALID
    except PipescheduleError as err:
        print(f"pipeschedule: error: {str(err).splitlines()[0]}", file=sys.stderr)
        return EXIT_USAGE
    except MemoryError:
        # [Note: size limits] bounds every size before work starts; this is the net under them
        print("pipeschedule: error: out of memory; the size limits (pipeschedule/checks.py) should have refused "
              "this input first: please report it", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("pipeschedule: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`pipeschedule show ... | head`): say nothing more, and point
        # stdout at /dev/null so that the interpreter's last flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports it


def _run(argv: list[str]) -> int:
    """Parse `argv` and run its command; a command that passes unknown options on
    (`Command.passes_unknown`) gets them as `args.passed`."""
    name = command_of(argv)
    parser = build_parser(name)
    commands = all_commands(name) if name is not None and name not in COMMANDS else COMMANDS
    if name in commands and commands[name].passes_unknown:
        args, passed = parser.parse_known_args(argv)
        args.passed = passed
    else:
        args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
