"""`run_training_demo()`: nanotron's own trainer trains nanotron's own Llama from a YAML file,
once with nanotron's 1F1B engine and once with pipeschedule's `capped_1f1b:cap=2`, on CPU,
pp=4 over 4 gloo processes ([Note: nanotron over gloo]).

Both runs are `integration.nanotron.train` on the same config but for `pp_engine`
(`integration.nanotron.example`: 8 decoder layers, AdamW, 8 microbatches per step,
synthetic data), 3 optimizer steps each, both from the same initial weights (drawn by
parameter name: [Note: same initial weights] in patches/initial_weights.py). Printed per step:
the loss under each engine (equal, bit for bit), then the peak of what each stage kept
for backward in the first step, in microbatches' worth (the stash meter,
`integration.nanotron.stash`): nanotron's 1F1B holds pp - r microbatches on stage r
([4, 3, 2, 1]), capped_1f1b with cap 2 at most 2 ([2, 2, 2, 1]).

    python -m integration.nanotron.demo        # or: pipeschedule demo
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import tempfile
import time
from pathlib import Path

import integration.nanotron  # noqa: F401  (first: repairs nanotron 0.4's import, installs the patches)
from integration.nanotron import train
from integration.nanotron.example import TrainerConfig
from integration.nanotron.stash import StashMeter, microbatches_worth
from pipeschedule.runtime.launch import spawn

PP, MICROBATCHES, STEPS = 4, 8, 3
OURS = "capped_1f1b:cap=2"
CONFIG = TrainerConfig(pp=PP, layers=8, hidden=64, heads=4, kv_heads=2, vocab=256, seq=32, microbatches=MICROBATCHES,
                       steps=STEPS)


def _worker(rank: int, world_size: int, store, paths: list[str]) -> list[dict]:
    train.prepare("gloo")
    out = []
    quiet = contextlib.redirect_stderr(io.StringIO())  # nanotron's progress bars and warnings
    for path in paths:
        with quiet, contextlib.redirect_stdout(io.StringIO()):
            trainer = train.make_trainer(path, record=True, stash_meter=False)  # (it meters the steps itself)
        summaries = []
        step = trainer.training_step

        def metered(dataloader, step=step, trainer=trainer, summaries=summaries):
            meter = StashMeter.for_model(trainer.unwrapped_model)
            with meter.attached(trainer.unwrapped_model):
                result = step(dataloader)
            summaries.append(meter.finish())
            return result

        trainer.training_step = metered  # measure what each step keeps for backward
        with quiet, contextlib.redirect_stdout(io.StringIO()):
            trainer.train(train.synthetic_batches(trainer))
        first = summaries[0]
        out.append({"losses": [s["loss"] for s in trainer.records],
                    "stash": (microbatches_worth(first), first["peak_bytes"])})
    return out


def run_training_demo() -> int:
    """Trains with both engines and prints them side by side; 0 when the losses agree."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pipeschedule-demo-") as tmp:
        configs = [dataclasses.replace(CONFIG, engine="1f1b"), dataclasses.replace(CONFIG, engine=OURS)]
        paths = []
        for config, name in zip(configs, ("1f1b", "ours")):
            path = Path(tmp) / f"{name}.yaml"
            path.write_text(config.yaml(str(Path(tmp) / f"checkpoints-{name}")))
            paths.append(str(path))
        pieces = spawn(_worker, PP, args=(paths,), timeout=240.0)
    theirs, ours = ([next(p[i]["losses"] for p in pieces if p[i]["losses"][0] is not None)] for i in (0, 1))
    theirs, ours = theirs[0], ours[0]
    print(f"nanotron's trainer and LlamaForTraining from a YAML file, pp={PP} (4 gloo processes, CPU), "
          f"{MICROBATCHES} microbatches per step, AdamW, the same data and initial weights")
    print(f"{'step':>4}  {'nanotron 1f1b loss':>20}  {OURS + ' loss':>24}  equal")
    for step, (a, b) in enumerate(zip(theirs, ours), start=1):
        print(f"{step:>4}  {a:>20.10f}  {b:>24.10f}  {'yes' if a == b else 'NO'}")
    print("peak saved-for-backward memory per stage in step 1 (microbatches' worth; bytes):")
    for i, name in ((0, "nanotron 1f1b"), (1, OURS)):
        stash = [p[i]["stash"] for p in pieces]
        print(f"  {name:<18} {[round(w, 2) for w, _ in stash]}  {[b for _, b in stash]}")
    print(f"({time.monotonic() - start:.1f} s)")
    return 0 if theirs == ours and len(ours) == STEPS else 1


if __name__ == "__main__":
    raise SystemExit(run_training_demo())
