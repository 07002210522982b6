"""`pipeschedule train CONFIG --nproc N [torchrun options]`: the pre-flight once, then the ranks.

[Note: one launch] torchrun run by hand starts the ranks first, and every rank checks the
config ([Note: one refusal, once] in train.py); a rank that fails prints its traceback,
and torchrun adds its own (ChildFailedError, a table per rank, "Root Cause ... error_file:
<N/A>"). This command puts one process in front:

    1. pre-flight  the config checked once, as `pipeschedule check` checks it (nanotron's
                   loader, the engine, the world size against --nproc times torchrun's
                   --nnodes, the layout, the schedule, the dataset and tokenizer: [Note:
                   pre-flight] in check.py); a refusal is one line and exit 2, before
                   any rank starts
    2. the ranks   torchrun, run in this process (`torch.distributed.run`, its options as
                   given), starting `-m integration.nanotron.train --checked` on each
                   rank: nanotron's trainer, without a second pre-flight. The ranks run
                   with no handler of SIGTERM or SIGINT, so that when torchrun stops them
                   they end at once, even inside a collective (a Python handler runs only
                   once the call returns)
    3. a failure   each rank that fails writes its one line (and its traceback, to a file
                   beside it) into a report folder and prints nothing; the ranks' stderr
                   (the C++ warnings of a dying collective, say) goes to files there too
                   (torchrun's --redirects 2, unless its --redirects, --tee or --log-dir
                   is given); torchrun's own logs and table are silenced. The first rank
                   to fail is named in one line, once: a rank killed from outside (it
                   could say nothing) before one that failed by itself, and among those
                   the first to fail; a rank ended by SIGTERM, torchrun's own way of
                   stopping the others, only when no rank failed by itself. Exit 1; the
                   report folder is kept (removed after a run that ends well).

torchrun ends every rank within its monitor interval of the first failure (a rank killed
mid-step included); relaunching with `checkpoints.resume_checkpoint_path` continues from
the last checkpoint (tests/nanotron/test_launch_faults.py: losses bitwise equal to a run
that was never interrupted). `torchrun ... -m integration.nanotron.train --config-file
CONFIG` keeps working as before.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback

from integration.nanotron.check import check_world, preflight, read_config
from integration.nanotron.pipeline.errors import ParameterError, PipescheduleError

REPORT_ENV = "PIPESCHEDULE_TRAIN_REPORT"  # the report folder, set for the ranks by `launch`
TRAIN_MODULE = "integration.nanotron.train"


def launch(config_file: str, *, nproc: int, torchrun: list[str], backend: str = "auto",
           record: str | None = None) -> int:
    """[Note: one launch]: 0 when every rank finished; 1 (after the one line) when a rank
    failed; raises PipescheduleError (the command's one line, exit 2) for a config refused
    before any rank starts."""
    args = torchrun_args(torchrun, nproc, config_file, backend, record)
    nnodes = fixed_nodes(args.nnodes)
    config = read_config(config_file)
    if nnodes is not None:
        check_world(config, nproc * nnodes, "--nproc" + (f" * --nnodes = {nproc} * {nnodes}" if nnodes > 1 else ""))
    found = preflight(config_file, config=config, memory=False, data=True)
    for warning in found.warnings:  # it runs, but likely not as meant (a cap that binds on no rank)
        print(f"pipeschedule train: warning: {warning}", file=sys.stderr, flush=True)
    report = tempfile.mkdtemp(prefix="pipeschedule-train-")
    if args.log_dir is None and not _given(torchrun, ("-r", "--redirects", "-t", "--tee")):
        args.log_dir, args.redirects = report, "2"  # the ranks' stderr (C++ and Python warnings) into files
    os.environ[REPORT_ENV] = report
    code = 1
    try:
        code = _run(args, report)
        return code
    finally:
        os.environ.pop(REPORT_ENV, None)
        if code == 0:
            shutil.rmtree(report, ignore_errors=True)


def torchrun_args(torchrun: list[str], nproc: int, config_file: str, backend: str, record: str | None):
    """torchrun's own parse of its options and the rank's command line; an option it does
    not take is refused in one line."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    taken = {flag for action in parser._actions for flag in action.option_strings}  # noqa: SLF001
    given = [word.split("=", 1)[0] for word in torchrun if word.startswith("-")]
    for flag in given:
        if flag not in taken:
            raise ParameterError(f"pipeschedule train: {flag} is no option of torchrun's (nor of train's: --nproc, "
                                 f"--backend, --record); see python -m torch.distributed.run -h")
        if flag in ("--nproc-per-node", "--nproc_per_node", "-m", "--module", "--no-python", "--no_python"):
            raise ParameterError(f"pipeschedule train: {flag} is set by train itself (--nproc N; the module it "
                                 f"starts is {TRAIN_MODULE})")
    rank_args = ["--config-file", config_file, "--checked", "--backend", backend] + (
        ["--record", record] if record else [])

    def refuse(message: str):
        raise ParameterError(f"pipeschedule train: torchrun cannot read its options: {message}")

    parser.error = refuse  # (argparse's own: usage and exit 2, a second voice)
    return parser.parse_args([*torchrun, "--nproc-per-node", str(nproc), "-m", TRAIN_MODULE, *rank_args])


def _given(words: list[str], flags: tuple[str, ...]) -> bool:
    return any(word.split("=", 1)[0] in flags for word in words)


def fixed_nodes(nnodes: str) -> int | None:
    """torchrun's --nnodes as one count (`2`, `2:2`), or None for an elastic range."""
    low, _, high = str(nnodes).partition(":")
    try:
        low_n, high_n = int(low), int(high or low)
    except ValueError:
        raise ParameterError(f"pipeschedule train: --nnodes {nnodes!r} is no count (N or MIN:MAX)") from None
    return low_n if low_n == high_n else None


def _run(args, report: str) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    quiet = _quiet_torchrun()
    try:
        run(args)
    except ChildFailedError as failed:
        where = f" (each rank's stderr: {args.log_dir})" if args.log_dir == report else ""
        print(f"pipeschedule train: {first_failure(failed.failures, report)}{where}", file=sys.stderr, flush=True)
        return 1
    except SignalException as stopped:  # Ctrl-C or a scheduler's SIGTERM: torchrun has ended the ranks
        name = signal.Signals(stopped.sigval).name
        print(f"pipeschedule train: stopped by {name}; every rank was ended", file=sys.stderr, flush=True)
        return 128 + int(stopped.sigval)
    finally:
        for name, level in quiet.items():
            logging.getLogger(name).setLevel(level)
    return 0


def _quiet_torchrun() -> dict[str, int]:
    """torchrun's loggers silenced (its per-rank table and traceback, its warnings);
    returns their levels, to restore."""
    import torch.distributed.run  # noqa: F401  (its modules' loggers exist once imported)

    levels = {}
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")):
            logger = logging.getLogger(name)
            levels[name] = logger.level
            logger.setLevel(logging.CRITICAL + 1)
    return levels


def first_failure(failures: dict, report: str) -> str:
    """The one line of the rank that failed first ([Note: one launch]): `failures` torchrun's
    {global rank: ProcessFailure}, `report` the folder the ranks wrote to.

    SIGTERM is torchrun's own stop signal: once one rank fails, torchrun ends the others with
    it (and reports them among the failures), so a rank ended by SIGTERM without a word is
    named only when no rank failed by itself. A rank killed by any other signal without a
    word (SIGKILL: the OOM killer, kill -9) was killed from outside: named first."""
    said = {rank: _said(report, rank) for rank in failures}
    silent = {rank: failure for rank, failure in failures.items() if failure.exitcode < 0 and said[rank] is None}
    outside = [rank for rank, failure in silent.items() if -failure.exitcode != signal.SIGTERM]
    if outside:
        return _killed(min(outside), silent)
    speaking = sorted((entry["time"], rank) for rank, entry in said.items() if entry is not None)
    if speaking:
        rank = speaking[0][1]
        return f"rank {rank}: {said[rank]['line']}"
    by_itself = {rank: failure for rank, failure in failures.items() if failure.exitcode > 0}
    if by_itself:
        rank, failure = min(by_itself.items(), key=lambda item: item[1].timestamp)
        return f"rank {rank} ended with exit code {failure.exitcode} without saying why"
    return _killed(min(silent), silent)


def _killed(rank: int, silent: dict) -> str:
    name = signal.Signals(-silent[rank].exitcode).name
    return (f"rank {rank} was killed by {name} (it could say nothing: killed from outside, or out of host "
            f"memory); every rank was stopped")


def _said(report: str, rank: int) -> dict | None:
    try:
        with open(os.path.join(report, f"rank{rank}.json"), encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


# -- the rank's side ------------------------------------------------------------------------------


def under_launch() -> bool:
    """Whether this rank was started by `pipeschedule train` ([Note: one launch])."""
    return bool(os.environ.get(REPORT_ENV))


def rank_failed(rank: str, err: BaseException) -> None:
    """This rank's one line into the report folder (and its traceback beside it, for an
    error that is not one of ours), for the launcher to say ([Note: one launch])."""
    report = os.environ[REPORT_ENV]
    line = " ".join(str(err).split()) or type(err).__name__
    if not isinstance(err, PipescheduleError):
        path = os.path.join(report, f"rank{rank}.traceback")
        with open(path, "w", encoding="utf-8") as handle:
            handle.write("".join(traceback.format_exception(err)))
        line = f"{type(err).__name__}: {line} (its traceback: {path})"
    with open(os.path.join(report, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump({"time": time.time(), "line": line}, handle)


__all__ = ["REPORT_ENV", "first_failure", "fixed_nodes", "launch", "rank_failed", "torchrun_args", "under_launch"]
