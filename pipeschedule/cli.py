"""The `pipeschedule` command.

    pipeschedule compile NAME --pp P --microbatches M [--virtual V] [--cap C|C0,C1,..] --json PATH
    pipeschedule verify PATH                  exit 0 valid, 1 invalid, 2 unusable input
    pipeschedule simulate NAME|--schedule PATH [...] [--cost PATH] [--json] [--trace PATH] [--png PATH]
    pipeschedule show NAME ...                ASCII timeline
    pipeschedule demo                         1f1b vs capped_1f1b vs interleaved, side by side
    pipeschedule plan ...                     what fits a GPU (see `pipeschedule plan -h`)

Every error the user can cause ends with one line on stderr and a non-zero exit code,
never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from pipeschedule.errors import FormatError, ParameterError, PipescheduleError, ScheduleError

EXIT_INVALID = 1
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (exit 2)."""

    def error(self, message):
        raise ParameterError(f"{self.prog}: {message} (see {self.prog} -h)")


def parse_cap(text: str):
    """`--cap 2` -> 2; `--cap 4,3,2,1` -> [4, 3, 2, 1]."""
    parts = text.split(",")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise ParameterError(f"--cap must be an integer or a comma-separated list of integers, got {text!r}") from None
    return values[0] if len(values) == 1 else values


def _family_names():
    from pipeschedule.generators import FAMILIES

    return list(FAMILIES)


def _schedule_args(parser: argparse.ArgumentParser, *, name_required: bool = True) -> None:
    parser.add_argument("name", nargs=None if name_required else "?", help="schedule family: " + ", ".join(_family_names()))
    parser.add_argument("--pp", type=int, default=None, help="pipeline ranks")
    parser.add_argument("--microbatches", "-m", type=int, default=None, help="microbatches per step")
    parser.add_argument("--virtual", type=int, default=None, help="chunks per rank (interleaved_1f1b; zbv, v_half, v_min: 2)")
    parser.add_argument("--cap", type=str, default=None, help="in-flight cap: one int for all ranks or C0,C1,... per rank")


def _build(args):
    from pipeschedule import compile_schedule

    missing = [flag for flag, value in (("--pp", args.pp), ("--microbatches", args.microbatches)) if value is None]
    if missing:
        raise ParameterError(f"{' and '.join(missing)} required to build schedule {args.name!r}")
    cap = parse_cap(args.cap) if args.cap is not None else None
    return compile_schedule(args.name, pp=args.pp, microbatches=args.microbatches, virtual=args.virtual, cap=cap)


def _load_any(path: str):
    if path.endswith(".csv"):
        from pipeschedule.torch_csv import load_csv

        return load_csv(path)
    from pipeschedule.ir import load

    return load(path)


def cmd_compile(args) -> int:
    schedule = _build(args)
    if not (args.json or args.text or args.csv):
        raise ParameterError("compile needs an output: --json PATH, --text PATH or --csv PATH")
    if args.json:
        _write(args.json, schedule.to_json())
    if args.text:
        _write(args.text, schedule.to_text())
    if args.csv:
        from pipeschedule.torch_csv import write_csv

        _write(args.csv, write_csv(schedule, form=args.csv_form))
    count = sum(len(p) for p in schedule.programs)
    print(f"compiled {schedule.name}: pp={schedule.pp} virtual={schedule.virtual} microbatches={schedule.microbatches}, {count} instructions, verified")
    return 0


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as err:
        raise FormatError(f"cannot write {path}: {err}") from None


def cmd_verify(args) -> int:
    from pipeschedule.verify import verify

    schedule = _load_any(args.path)
    try:
        verify(schedule)
    except ScheduleError as err:
        head, _, grid = str(err).partition("\n")
        if grid:
            print(grid)
        print(f"pipeschedule verify: {args.path}: invalid: {head}", file=sys.stderr)
        return EXIT_INVALID
    count = sum(len(p) for p in schedule.programs)
    print(f"{args.path}: valid ({schedule.name}, pp={schedule.pp}, virtual={schedule.virtual}, microbatches={schedule.microbatches}, {count} instructions)")
    return 0


def _schedule_for(args):
    if args.schedule:
        from pipeschedule.verify import verify

        schedule = _load_any(args.schedule)
        verify(schedule)
        return schedule
    if not args.name:
        raise ParameterError("give a schedule family NAME or --schedule PATH")
    return _build(args)


def cmd_simulate(args) -> int:
    from pipeschedule.simulate import CostModel, load_cost, simulate

    schedule = _schedule_for(args)
    cost = load_cost(args.cost, schedule) if args.cost else CostModel.default(schedule)
    result = simulate(schedule, cost)
    if args.trace:
        from pipeschedule.render import chrome_trace

        _write(args.trace, json.dumps(chrome_trace(schedule, result)))
    if args.png:
        from pipeschedule.render import png

        png(schedule, result, args.png)
    if args.json:
        print(json.dumps(result.to_dict() | {"name": schedule.name, "pp": schedule.pp, "virtual": schedule.virtual, "microbatches": schedule.microbatches}))
    else:
        print(_summary(schedule, result))
    return 0


def _summary(schedule, result) -> str:
    return (
        f"{schedule.name}: pp={schedule.pp} virtual={schedule.virtual} microbatches={schedule.microbatches}\n"
        f"  step time        {result.step_time:g}\n"
        f"  bubble fraction  {result.bubble_fraction:.4f}\n"
        f"  peak in-flight   {list(result.peak_inflight)}\n"
        f"  peak bytes       {[round(b, 3) for b in result.peak_bytes]}"
    )


def cmd_show(args) -> int:
    from pipeschedule.render import ascii_timeline
    from pipeschedule.simulate import CostModel, simulate

    schedule = _schedule_for(args)
    result = simulate(schedule, CostModel.default(schedule))
    print(ascii_timeline(schedule, result, width=args.width))
    return 0


def cmd_demo(args) -> int:
    from pipeschedule.demo import run_demo

    return run_demo()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pipeschedule", description="Compile, verify, simulate and plan pipeline-parallel schedules.")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("compile", help="build, lower and verify a schedule; write it as JSON/text/CSV")
    _schedule_args(p)
    p.add_argument("--json", metavar="PATH", help="write the pipeschedule/1 JSON form")
    p.add_argument("--text", metavar="PATH", help="write the compact text form")
    p.add_argument("--csv", metavar="PATH", help="write PyTorch's pipeline CSV")
    p.add_argument("--csv-form", choices=("compute_only", "compute_comms"), default="compute_comms")
    p.set_defaults(run=cmd_compile)

    p = sub.add_parser("verify", help="check a schedule file (JSON, text or PyTorch CSV) against every rule")
    p.add_argument("path")
    p.set_defaults(run=cmd_verify)

    for name, run, helptext in (("simulate", cmd_simulate, "simulate time and memory"), ("show", cmd_show, "print the ASCII timeline")):
        p = sub.add_parser(name, help=helptext)
        _schedule_args(p, name_required=False)
        p.add_argument("--schedule", metavar="PATH", help="a schedule file instead of NAME")
        if name == "simulate":
            p.add_argument("--cost", metavar="PATH", help="cost model JSON (per-stage times, buffer bytes, p2p latency/bandwidth)")
            p.add_argument("--json", action="store_true", help="print one JSON object")
            p.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace")
            p.add_argument("--png", metavar="PATH", help="write a PNG (needs matplotlib)")
        else:
            p.add_argument("--width", type=int, default=None, help="maximum columns")
        p.set_defaults(run=run)

    p = sub.add_parser("demo", help="1f1b vs capped_1f1b vs interleaved_1f1b at pp=4, 8 microbatches")
    p.set_defaults(run=cmd_demo)

    try:
        from pipeschedule.plan import add_plan_arguments, run_plan
    except ImportError:  # the planner is optional while it is being built
        pass
    else:
        p = sub.add_parser("plan", help="what fits a GPU: memory per stage, throughput, recommended schedule")
        add_plan_arguments(p)
        p.set_defaults(run=run_plan)
    return parser


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except ScheduleError as err:
        print(f"pipeschedule: invalid schedule: {str(err).splitlines()[0]}", file=sys.stderr)
        return EXIT_INVALID
    except PipescheduleError as err:
        print(f"pipeschedule: error: {str(err).splitlines()[0]}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("pipeschedule: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
