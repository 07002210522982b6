"""Train with nanotron's own trainer from a YAML file, with pipeschedule's engines available.

    torchrun --nproc-per-node N -m integration.nanotron.train --config-file CONFIG [--record DIR]

This is nanotron's `run_train.py` flow, plus the one import that teaches nanotron
pipeschedule's engine names and layout ([Note: nanotron hooks]): nanotron's
`DistributedTrainer` is built from the YAML, then trained. `parallelism.pp_engine`
chooses the engine, nanotron's own (`1f1b`, `afab`) or ours
(`capped_1f1b:cap=2`, `interleaved_1f1b:virtual=2`, `zb_h1`, ...).

The backend: NCCL when every local rank has a GPU of its own (nanotron's own path); gloo
otherwise, that is on a machine without a GPU or with several ranks per GPU
([Note: nanotron over gloo]); `--backend` overrides. Without flash-attn installed, a
pure-torch stand-in takes its place (`flash_attn_standin`).

Data: with `data.dataset` set (a Hugging Face dataset name or a local folder, the text
column, the tokenizer in `tokenizer.tokenizer_name_or_path`), nanotron's own data path
as its run_train.py builds it ([Note: nanotron's data path] in data.py), sharded over the
data-parallel replicas and continued at the consumed samples of a resumed checkpoint;
the dataset and tokenizer are loaded and checked against the model before the trainer
is built. With `data.dataset: null` (or no `data` section) each data-parallel replica
reads a synthetic token stream: microbatch i of replica d is drawn from a generator
seeded by (data seed, d, i), the same tensors whatever the engine, pp or placement, so
runs with different engines see the same data (nanotron's own dummy generator seeds by
pp rank, so its labels change with the rank of the loss); a resumed run goes on from the
microbatch after the last one its checkpoint's run consumed.

Progress: after the first step world rank 0 logs one block through nanotron's logging
(the engine, its schedule, the stash per rank predicted and measured: [Note: the
first-step block] in progress.py); nanotron's own per-step lines follow.

Before anything else every rank checks the config as `pipeschedule check` does
([Note: pre-flight] in check.py: nanotron's loader, the engine, the layout of the model,
the schedule, and the world size against the processes torchrun started). A refusal that
follows from the config and files alone (a config nanotron cannot read, a bad
`pp_engine` value, a layout the engine cannot run, a world size the config does not
fill, data that cannot feed the model) is the same on every rank: world rank 0 says it
in one line and the other ranks stop without a word ([Note: one refusal, once]).

`--record DIR` writes, per rank, `DIR/rank{R}.json` (`record_of`, without weights): the
rank's place (world, pp, dp, tp), the engine, each step's loss (on the loss rank, else
null), seconds, peak device memory (CUDA: of the whole step and of its pipeline part up
to the end of `train_batch_iter`, before the gradient sync and the optimizer step; null
on CPU) and the engine's ledger peaks (null under nanotron's own engines, which keep no
ledger), the first-step block's figures (`first_step`), the block rank of each pipeline
block, and what `pp_engine: auto` measured and chose. `--record-weights` adds
`DIR/rank{R}-weights.pt`: the parameters after the last step by name (torch.load), for
comparisons between engines.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import logging
import os
import signal
import sys
import time
import traceback

import integration.nanotron  # noqa: F401  (first: repairs nanotron 0.4's import, installs the patches)
import torch
from nanotron import distributed as dist
from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer
from integration.nanotron import data, flash_attn_standin, launch, progress
from integration.nanotron.check import preflight, read_config
from integration.nanotron.pipeline.errors import DataError, PipescheduleError
from integration.nanotron.gloo import use_gloo
from integration.nanotron.pipeline.step import pipeline_blocks
from pipeschedule.runtime.launch import leave

BACKENDS = ("auto", "nccl", "gloo")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m integration.nanotron.train",
                                     description="nanotron's trainer from a YAML file, with pipeschedule's engines")
    parser.add_argument("--config-file", required=True, help="nanotron YAML config")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="auto: NCCL with one GPU per local rank, else gloo")
    parser.add_argument("--record", metavar="DIR",
                        help="write DIR/rank{R}.json per rank: losses, step times, peak memory, the first step's stash")
    parser.add_argument("--record-weights", action="store_true",
                        help="with --record: also DIR/rank{R}-weights.pt, the weights after the last step")
    parser.add_argument("--checked", action="store_true",
                        help="the config was checked before the ranks started (pipeschedule train): no pre-flight here")
    return parser.parse_args(argv)


def choose_backend(requested: str) -> str:
    """NCCL when each local rank has its own GPU, gloo otherwise (or as requested)."""
    if requested != "auto":
        return requested
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks else "gloo"


def synthetic_batches(trainer):
    """The synthetic token stream of this replica, as nanotron's data loaders deliver it:
    inputs on the model's input rank, labels on its output rank, `TensorPointer`s elsewhere."""
    config, context = trainer.config, trainer.parallel_context
    model = trainer.unwrapped_model
    seed = config.data.seed if config.data is not None and config.data.seed is not None else 1234
    batch, seq = config.tokens.micro_batch_size, config.tokens.sequence_length
    vocab = trainer.model_config.vocab_size
    dp_rank, pp_rank = dist.get_rank(context.dp_pg), dist.get_rank(context.pp_pg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    resumed = trainer.consumed_train_samples // (batch * context.dp_pg.size())  # microbatches read before a resume
    for index in itertools.count(resumed):
        generator = torch.Generator().manual_seed(stream_seed(seed, dp_rank, index))
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
        full = {
            "input_ids": tokens[:, :-1], "input_mask": torch.ones(batch, seq, dtype=torch.bool),
            "label_ids": tokens[:, 1:], "label_mask": torch.ones(batch, seq, dtype=torch.bool),
        }
        yield {
            key: value.contiguous().to(device)
            if pp_rank == (model.input_pp_rank if key.startswith("input") else model.output_pp_rank)
            else TensorPointer(group_rank=model.input_pp_rank if key.startswith("input") else model.output_pp_rank)
            for key, value in full.items()
        }


def stream_seed(seed: int, replica: int, index: int) -> int:
    """The generator seed of microbatch `index` of data-parallel replica `replica`."""
    digest = hashlib.sha256(f"{seed}/{replica}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def make_trainer(config_file: str, record: bool = False, *, stash_meter: bool = True):
    """nanotron's `DistributedTrainer`, which also measures its first step for the block of
    [Note: the first-step block] and, when `record`, keeps each step's record.
    `stash_meter=False`: no stash meter under nanotron's engines (for a caller that
    attaches saved-tensors hooks of its own, which a second meter would hide from it)."""
    # Imported here, after `prepare`: nanotron's trainer imports its Llama, which imports
    # flash-attn, so the stand-in (flash_attn_standin.install) must be in place first.
    from nanotron.trainer import DistributedTrainer

    class LauncherTrainer(DistributedTrainer):
        """nanotron's trainer; `training_step` also measures time, memory and the stash."""

        def post_init(self):
            self.records = []
            self.first_step = None  # the block's figures, after the first step of this run

        def training_step(self, dataloader):
            first = self.iteration_step == self.start_iteration_step + 1
            view = _engine_view(self) if first else None
            meter = _stash_meter(self) if stash_meter and view is not None and not view.ours else None
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.synchronize()
            peaks = StepPeaks()
            phases = {"allocated_at_start": torch.cuda.memory_allocated() if cuda else None}
            engine = self.pipeline_engine
            wrapped = engine.__dict__.get("train_batch_iter")  # a wrapper of the caller's, kept after the step
            engine.train_batch_iter = _phase_peak(engine.train_batch_iter, phases, peaks)
            start = time.perf_counter()
            try:
                with peaks, (meter.attached(self.unwrapped_model) if meter else contextlib.nullcontext()):
                    outputs, loss_avg = super().training_step(dataloader)
                    if cuda:
                        torch.cuda.synchronize()
            finally:
                if wrapped is None:
                    del engine.train_batch_iter  # the class's method again
                else:
                    engine.train_batch_iter = wrapped
            seconds = time.perf_counter() - start
            if record:
                self.records.append({
                    "step": self.iteration_step, "seconds": seconds,
                    "loss": None if loss_avg is None else float(loss_avg),
                    "peak_allocated": peaks.allocated if cuda else None,
                    "peak_reserved": peaks.reserved if cuda else None,
                    **phases,
                    "ledger": _ledger_summary(self.pipeline_engine),
                })
            if view is not None:
                stash = meter.finish()["peak_bytes"] if meter else _ledger_stash(engine)
                self.first_step = _report_first_step(self, view, stash, phases["peak_allocated_pipeline"])
            return outputs, loss_avg

    return LauncherTrainer(config_file)


_LOG = logging.getLogger("pipeschedule.nanotron")


def _engine_view(trainer):
    """The first-step block's view of the engine on the trainer's model, or None (said in
    one line) where the engine cannot describe itself."""
    try:
        return progress.view_of(trainer.pipeline_engine, trainer.model, trainer.parallel_context.pp_pg.size(),
                                trainer.n_micro_batches_per_batch)
    except PipescheduleError as err:
        _log_rank0(trainer, f"{progress.PREFIX}no first-step block: {err}")
        return None


def _stash_meter(trainer):
    from integration.nanotron.stash import StashMeter

    return StashMeter.for_model(trainer.unwrapped_model)


def _ledger_stash(engine) -> float | None:
    ledger = engine.training_ledger() if hasattr(engine, "training_ledger") else None
    return None if ledger is None else float(ledger.high["stash"])


def _report_first_step(trainer, view, stash, allocated) -> dict:
    """Gather what every rank measured, log the block on world rank 0 ([Note: the
    first-step block]); returns the block's figures (the same on every rank)."""
    context = trainer.parallel_context
    mine = progress.Measured(dist.get_rank(context.pp_pg), dist.get_rank(context.dp_pg), dist.get_rank(context.tp_pg),
                             stash, allocated)
    measured = [None] * context.world_pg.size()
    torch.distributed.all_gather_object(measured, mine, group=context.world_pg)
    attention = "sdpa-standin" if flash_attn_standin.is_installed() else "flash-attn"
    predicted = progress.predicted_stash(view, trainer.config, trainer.model_config, attention=attention)
    _log_rank0(trainer, progress.block(view, predicted, measured, step=trainer.iteration_step))
    ranks = sorted((m for m in measured if m.dp_rank == 0 and m.tp_rank == 0), key=lambda m: m.pp_rank)
    return {"engine": view.name, "family": view.family, "microbatches": view.microbatches,
            "placement": list(view.placement), "layers_per_stage": list(view.layers),
            "predicted_stash": None if isinstance(predicted, str) else list(predicted[0]),
            "predicted_inflight": None if isinstance(predicted, str) else list(predicted[1]),
            "measured_stash": [m.stash for m in ranks], "measured_by": "ledger" if view.ours else "stash meter",
            "peak_allocated_pipeline": [m.allocated for m in ranks]}


def _log_rank0(trainer, text: str) -> None:
    from nanotron.logging import log_rank

    log_rank(text, logger=_LOG, level=logging.INFO, group=trainer.parallel_context.world_pg, rank=0)


class StepPeaks:
    """The CUDA allocator's peak allocated and reserved bytes over one step, however often
    the peak counters are reset inside it; nothing on a machine without CUDA.

    [Note: nanotron resets the peaks] nanotron's trainer calls its `log_memory` before and
    after `train_batch_iter` in its first four steps (`iteration_step < 5`), and
    `log_memory` calls `torch.cuda.reset_peak_memory_stats()`; a step's
    `max_memory_allocated()` read at its end then covers only what came after the last
    reset (the gradient sync, clipping and the optimizer step), never the pipeline. Inside
    `with StepPeaks()`, that reset first folds the peaks so far into `allocated` and
    `reserved`. (benchmarks/results/growth.json of 2026-12-03 ran three steps and so
    recorded the optimizer's part only: nanotron's 1F1B and capped 1F1B with cap 1 showed
    the same stage-0 peak, 7.84 GiB, where the pipeline's part was 9.32 GiB under 1F1B,
    as the memory model predicted; docs/memory_calibration.md.)
    """

    def __init__(self) -> None:
        self.allocated = self.reserved = 0
        self._reset = None

    def fold(self) -> None:
        if torch.cuda.is_available():
            self.allocated = max(self.allocated, torch.cuda.max_memory_allocated())
            self.reserved = max(self.reserved, torch.cuda.max_memory_reserved())

    def __enter__(self) -> StepPeaks:
        if torch.cuda.is_available():
            self._reset = torch.cuda.reset_peak_memory_stats
            torch.cuda.reset_peak_memory_stats = self._folding_reset
            self._reset()
        return self

    def _folding_reset(self, device=None) -> None:
        self.fold()
        self._reset(device)

    def __exit__(self, *exc) -> None:
        if self._reset is not None:
            self.fold()
            torch.cuda.reset_peak_memory_stats, self._reset = self._reset, None


def _phase_peak(train_batch_iter, phases: dict, peaks: StepPeaks):
    """`train_batch_iter` that also notes, in `phases`, the allocator's peak up to its end
    (`peak_allocated_pipeline`: the pipeline's part of the step, before the gradient sync
    and the optimizer step) and what is allocated then (`allocated_after_pipeline`)."""

    def measured(*args, **kwargs):
        outputs = train_batch_iter(*args, **kwargs)
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            peaks.fold()
        phases["peak_allocated_pipeline"] = peaks.allocated if cuda else None
        phases["allocated_after_pipeline"] = torch.cuda.memory_allocated() if cuda else None
        return outputs

    return measured


def record_of(trainer, *, weights: bool = True) -> dict:
    """What `--record` writes for this rank: ranks, engine, per-step records, the
    first-step block's figures, block ranks and (`weights`) the parameters after the last
    step (fp32, CPU, by nanotron's tied-aware names)."""
    context = trainer.parallel_context
    params = {name: p.detach().float().cpu().clone()
              for name, p in trainer.unwrapped_model.get_named_params_with_correct_tied()} if weights else None
    return {
        "world_rank": dist.get_rank(context.world_pg), "pp_rank": dist.get_rank(context.pp_pg),
        "dp_rank": dist.get_rank(context.dp_pg), "tp_rank": dist.get_rank(context.tp_pg),
        "engine": _engine_name(trainer.config.parallelism.pp_engine), "steps": list(trainer.records),
        "first_step": trainer.first_step,
        "params": params, "block_ranks": [b.rank for b in pipeline_blocks(trainer.unwrapped_model)],
        "auto": _auto_summary(trainer.config.parallelism.pp_engine),
        "searched": _searched_summary(trainer.config.parallelism.pp_engine),
    }


def write_record(trainer, directory: str, *, weights: bool = False) -> None:
    """`--record DIR`: `DIR/rank{R}.json` (`record_of` without the parameters) and, with
    `weights`, `DIR/rank{R}-weights.pt` (the parameters by name)."""
    os.makedirs(directory, exist_ok=True)
    record = record_of(trainer, weights=weights)
    params = record.pop("params")
    rank = record["world_rank"]
    with open(os.path.join(directory, f"rank{rank}.json"), "w") as handle:
        json.dump(record, handle, indent=1)
    if weights:
        torch.save(params, os.path.join(directory, f"rank{rank}-weights.pt"))


def _auto_summary(engine) -> dict | None:
    """What `pp_engine: auto` measured and chose ([Note: auto engine]); None for other engines."""
    choice = getattr(engine, "choice", None)
    if choice is None:
        return None
    return {"engine": choice.engine, "why": choice.why, "predicted_peaks": list(choice.peaks),
            **{name: list(values) for name, values in engine.figures.items()}}


def _searched_summary(engine) -> dict | None:
    """What `pp_engine: searched` measured at its first step and the order it ran after
    ([Note: searched engine]); None for other engines or before a measurement."""
    cost = getattr(engine, "cost", None)
    if cost is None or not hasattr(engine, "_runners"):
        return None
    runs = [runner.schedule for (_, _, train), runner in engine._runners.items() if train]
    return {"cost": [list(stage) for stage in cost], "seed": runs[0].params.get("seed") if runs else None}


def prepare(backend: str = "auto") -> str:
    """Set up this process for nanotron's trainer: the flash-attn stand-in where flash-attn
    is missing, the gloo mode where the backend is gloo. Returns the backend."""
    flash_attn_standin.install()
    chosen = choose_backend(backend)
    if chosen == "gloo":
        use_gloo()
    return chosen


def train(config_file: str, *, record: bool = False, text: data.TextData | None = None):
    """Build nanotron's trainer from `config_file` and train it on the config's data (`text`:
    what `data.load` gave for it, loaded here when the config names a dataset and it is
    not given); returns the trainer."""
    trainer = make_trainer(config_file, record)
    if text is None and not _synthetic(trainer.config):
        text = data.load(trainer.config)
    trainer.train(synthetic_batches(trainer) if text is None else data.train_dataloader(trainer, text))
    return trainer


def run(config_file: str, *, backend: str = "auto", record: str | None = None, weights: bool = False,
        checked: bool = False) -> None:
    """One process of the job: read and check the config ([Note: pre-flight]: its engine,
    layout and schedule, and the world size torchrun started; not again where `checked`,
    [Note: one launch] in launch.py) and its data, prepare, train, and write the record if
    asked."""
    try:
        config = read_config(config_file)  # (the trainer reads it again: nanotron 0.4's takes a file, not a Config)
        if not checked:
            preflight(config_file, config=config, nproc=int(os.environ.get("WORLD_SIZE", "1")),
                      source="torchrun's world size (WORLD_SIZE)", memory=False, data=False)
        text = data.load(config)
    except PipescheduleError as err:
        raise SameOnEveryRank(str(err)) from None
    _quiet["stopping"] = False  # checked: from here on a SIGTERM means another rank failed on its own
    prepare(backend)
    trainer = train(config_file, record=record is not None, text=text)
    if record:
        write_record(trainer, record, weights=weights)


class SameOnEveryRank(PipescheduleError):
    """A refusal every rank makes alike, from the config and files alone ([Note: one
    refusal, once])."""


def _ledger_summary(engine) -> dict | None:
    ledger = engine.training_ledger() if hasattr(engine, "training_ledger") else None
    if ledger is None:
        return None
    return {"peak_bytes": ledger.high_total, "stash_peak_bytes": ledger.high["stash"]}


def _engine_name(engine) -> str:
    spec = getattr(engine, "spec", None)
    return spec.to_string() if spec is not None else type(engine).__name__


def _synthetic(config) -> bool:
    return config.data is None or config.data.dataset is None


def main(argv=None) -> int:
    args = parse_args(argv)
    rank = os.environ.get("RANK", "?")
    if launch.under_launch():  # [Note: one launch]: the launcher says what failed, once
        return _main_under_launch(args, rank)
    _say_when_stopped(rank)
    # Until the config and data are checked, a SIGTERM means rank 0 refused them, and said so.
    _quiet["stopping"] = rank not in ("0", "?")
    try:
        run(args.config_file, backend=args.backend, record=args.record, weights=args.record_weights,
            checked=args.checked)
    except (SameOnEveryRank, DataError) as err:
        _refuse_once(rank, err)
    except PipescheduleError as err:
        _say(f"integration.nanotron.train rank {rank}: {err}")
        _abort(2)
    except Exception:  # noqa: BLE001  (any failure ends every rank, never a silent hang)
        _say(f"integration.nanotron.train rank {rank} failed:\n{traceback.format_exc()}")
        _abort(1)
    return 0


def _main_under_launch(args, rank: str) -> int:
    """A rank started by `pipeschedule train` ([Note: one launch]): SIGTERM and SIGINT end it
    at once, even inside a collective; a failure is written for the launcher to say, and
    the rank leaves without a word."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)
    try:
        run(args.config_file, backend=args.backend, record=args.record, weights=args.record_weights,
            checked=args.checked)
    except Exception as err:  # noqa: BLE001  (any failure ends every rank: torchrun stops the others)
        launch.rank_failed(rank, err)
        _abort(2 if isinstance(err, PipescheduleError) else 1)
    return 0


QUIET_WAIT_S = 60.0  # how long a rank other than 0 waits for torchrun to end it after a shared refusal
_quiet = {"stopping": False}


def _refuse_once(rank: str, err: PipescheduleError) -> None:
    """[Note: one refusal, once] A refusal that follows from the config and files alone is
    made by every rank alike. World rank 0 prints it and leaves; torchrun then ends the
    others with SIGTERM, which they take without a word, whether they have reached the
    refusal themselves or are still checking (`run` reads and checks the config and its
    data before anything else, and a rank other than 0 keeps quiet on SIGTERM until that
    is done). A rank other than 0 that is still
    running `QUIET_WAIT_S` later (rank 0 did not refuse: its view of the files differs)
    prints its own line and leaves."""
    if rank not in ("0", "?"):
        _quiet["stopping"] = True
        time.sleep(QUIET_WAIT_S)
    _say(f"integration.nanotron.train rank {rank}: {err}")
    _abort(2)


def _say_when_stopped(rank: str) -> None:
    """When one rank fails, torchrun ends the others with SIGTERM (or SIGINT on Ctrl-C);
    each says so in one line instead of vanishing, unless it is waiting on rank 0's
    refusal ([Note: one refusal, once]). A rank blocked inside a C++ collective runs this
    only once the call returns; torchrun's SIGKILL follows after its grace period."""

    def stopped(signum, frame):  # noqa: ARG001
        if not _quiet["stopping"]:
            _say(f"integration.nanotron.train rank {rank}: stopped by {signal.Signals(signum).name} "
                 "(torchrun ends every rank when one fails; the failing rank printed why)")
        _abort(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stopped)


def _say(text: str) -> None:
    """A rank's line on stderr in one write, so that ranks sharing the launcher's pipe do not
    split each other's lines (`print` writes the text and its newline apart)."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _abort(code: int) -> None:
    """Leave at once: torchrun (default --max-restarts 0) then ends the other ranks,
    which may be blocked in a collective with this one."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main())  # not the interpreter's shutdown: pipeschedule.runtime.launch.leave
