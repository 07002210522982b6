"""`run_training_demo()`: nanotron's own 1F1B engine and pipeschedule's capped_1f1b (cap 2)
train the same Llama-style model side by side, on CPU, pp=4 over 4 gloo processes.

Each engine trains a freshly built model (same weights, [Note: deterministic init]) for
3 steps of plain SGD, each on the same batch of 8 microbatches (so the loss falls). Printed per step: the mean
microbatch loss under each engine (equal, bit for bit), then the peak of what each
stage keeps for backward (the stash meter, `integration.nanotron.stash`) in
microbatches' worth: nanotron's 1F1B holds pp - r microbatches on stage r ([4, 3, 2, 1]),
capped_1f1b with cap 2 at most 2 ([2, 2, 2, 1]).

    python -m integration.nanotron.demo        # or: pipeschedule demo
"""

from __future__ import annotations

import time

import integration.nanotron  # noqa: F401  (first: repairs nanotron, registers the engine names)

PP, MICROBATCHES, STEPS, LR = 4, 8, 3, 0.5


def _worker(rank: int, world_size: int, engine_name: str) -> dict:
    import torch
    from nanotron.parallel.pipeline_parallel.engine import (
        OneForwardOneBackwardPipelineEngine,
    )

    from integration.nanotron.cpu import cpu_p2p, cpu_parallel_context
    from integration.nanotron.engine import CappedOneFOneBEngine
    from integration.nanotron.engine_spec import parse_engine
    from integration.nanotron.harness import _clear_shared_state, for_rank, microbatch
    from integration.nanotron.llama import ModelConfig, build_llama, llama_block_ranks
    from integration.nanotron.stash import StashMeter, microbatches_worth

    cfg = ModelConfig(hidden=64, layers=8, heads=4, kv_heads=2, ffn=128, vocab=256, seq=32)
    context = cpu_parallel_context(pp=world_size)
    p2p = cpu_p2p(context.pp_pg)
    if engine_name == "1f1b":
        engine = OneForwardOneBackwardPipelineEngine()
        split = None
    else:
        engine = CappedOneFOneBEngine(parse_engine(engine_name))
        engine.check(pp=world_size, num_layers=cfg.layers)
        split = engine.spec.split
    model = build_llama(cfg, p2p, llama_block_ranks(cfg, world_size, split=split))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, stash = [], []
    for step in range(STEPS):
        _clear_shared_state()
        model.stash_meter = StashMeter.for_model(model)
        data = (
            for_rank(microbatch(cfg, 2, i, 1234), rank, model.input_pp_rank, model.output_pp_rank)
            for i in range(MICROBATCHES)
        )
        outputs = engine.train_batch_iter(model, pg=context.pp_pg, batch=data, nb_microbatches=MICROBATCHES,
                                          grad_accumulator=None)
        p2p.wait_sends()
        summary = model.stash_meter.finish()
        model.stash_meter = None
        stash.append((microbatches_worth(summary), summary["peak_bytes"]))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if isinstance(outputs[0]["loss"], torch.Tensor):
            losses.append(float(sum(o["loss"] for o in outputs)))  # the step's mean microbatch loss
    return {"losses": losses, "stash": stash}


def _train(engine_name: str) -> tuple[list[float], list[tuple[float, int]]]:
    from integration.nanotron.harness import spawn

    pieces = spawn(_worker, PP, (engine_name,), timeout=110.0)
    losses = next(p["losses"] for p in pieces if p["losses"])
    return losses, [p["stash"][0] for p in pieces]  # stash of the first step, per stage


def run_training_demo() -> int:
    """Trains with both engines and prints them side by side; 0 when the losses agree."""
    start = time.monotonic()
    ours_name = "capped_1f1b:cap=2"
    theirs, their_stash = _train("1f1b")
    ours, our_stash = _train(ours_name)
    print(f"Llama-style model, pp={PP} (4 gloo processes, CPU), {MICROBATCHES} microbatches per step, SGD lr={LR}, the same batch each step")
    print(f"{'step':>4}  {'nanotron 1f1b loss':>20}  {ours_name + ' loss':>24}  equal")
    for step, (a, b) in enumerate(zip(theirs, ours)):
        print(f"{step:>4}  {a:>20.10f}  {b:>24.10f}  {'yes' if a == b else 'NO'}")
    print("peak saved-for-backward memory per stage (microbatches' worth; bytes):")
    print(f"  nanotron 1f1b      {[round(w, 2) for w, _ in their_stash]}  {[b for _, b in their_stash]}")
    print(f"  {ours_name:<18} {[round(w, 2) for w, _ in our_stash]}  {[b for _, b in our_stash]}")
    print(f"({time.monotonic() - start:.1f} s)")
    return 0 if theirs == ours and len(ours) == STEPS else 1


if __name__ == "__main__":
    raise SystemExit(run_training_demo())
