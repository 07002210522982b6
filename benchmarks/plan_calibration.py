"""The planner's memory model (pipeschedule.plan.memory, activation_formula "nanotron")
against nanotron's own trainer measured on an H200: per stage, predicted step peak
against `torch.cuda.max_memory_allocated`, and the predicted stash per microbatch
against the engine's ledger.

    python -m benchmarks.plan_calibration

Reads benchmarks/results/trainer.json (pp=4, m=8, seq 4096, ZeRO 0) and growth.json
(dp=2 x pp=2, ZeRO-1, seq 2048, m=16 and 128). Both ran nanotron's LlamaForTraining with
the adapter's SDPA stand-in for flash-attn (attention="sdpa-standin"), tp=1, bf16, fp32
gradient accumulation, AdamW (foreach: `torch_adam_is_fused: false`). Pure arithmetic:
no torch, no GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeschedule.plan import PlanConfig
from pipeschedule.plan.memory import GiB, ModelSpec, TrainingSetup
from pipeschedule.plan.partition import nanotron_split
from pipeschedule.plan.evaluation import Evaluator, evaluate_engine

RESULTS = Path(__file__).parent / "results"
ENGINES = {"1f1b": ("1f1b", None, 1), "capped_1f1b:cap=2": ("capped_1f1b", 2, 1),
           "interleaved_1f1b:virtual=2": ("interleaved_1f1b", None, 2), "zb_h1": ("zb_h1", None, 1),
           "capped_1f1b:cap=1": ("capped_1f1b", 1, 1), "ps_1f1b": ("1f1b", None, 1)}


def model_of(record: dict) -> ModelSpec:
    m = record["model"]
    return ModelSpec("nanotron-llama", layers=m["layers"], hidden=m["hidden"], heads=m["heads"],
                     kv_heads=m["kv_heads"], ffn=m["ffn"], vocab=m["vocab"])


def split_of(block_ranks: list[int], stages: int) -> list[int]:
    """Decoder layers per stage from nanotron's block placement (block 0 the embedding,
    blocks 1..L the layers; a new stage starts where the rank changes)."""
    split, stage, prev = [0] * stages, 0, block_ranks[0]
    for rank in block_ranks[1:-4]:
        if rank != prev:
            stage, prev = stage + 1, rank
        split[stage] += 1
    return split


def rows() -> list[tuple]:
    """(file, engine, m, rank, predicted peak, measured peak, predicted stash, ledger stash)."""
    out = []
    trainer = json.loads((RESULTS / "trainer.json").read_text())
    model = model_of(trainer)
    setup = TrainingSetup(tp=1, seq=trainer["model"]["seq"], sequence_parallel=False, attention="sdpa-standin",
                          adam_fused=False)
    planner = Evaluator(PlanConfig(model, setup, pp=trainer["pp"], microbatches=trainer["microbatches"],
                                  gpu_memory=139 * GiB))
    for name, record in trainer["engines"].items():
        family, cap, virtual = ENGINES[name]
        split = split_of(record["block_ranks"], trainer["pp"] * virtual)
        cand = evaluate_engine(planner, name, family, cap, virtual, split)
        for r, mem in enumerate(cand.memory):
            out.append(("trainer.json", name, trainer["microbatches"], r, mem.total, record["peak_allocated"][r],
                        mem.terms["activations"], record["ledger_stash"][r] or None))
    growth = json.loads((RESULTS / "growth.json").read_text())
    model = model_of(growth)
    setup = TrainingSetup(tp=1, dp=growth["dp"], zero_stage=growth["zero_stage"], seq=growth["model"]["seq"],
                          sequence_parallel=False, attention="sdpa-standin",
                          adam_fused=False, dp_backend="gloo")  # (its ranks shared one GPU: gloo throughout)
    for row in growth["rows"]:
        family, cap, virtual = ENGINES[row["engine"]]
        planner = Evaluator(PlanConfig(model, setup, pp=growth["pp"], microbatches=row["m"], gpu_memory=139 * GiB))
        cand = evaluate_engine(planner, row["engine"], family, cap, virtual, nanotron_split(model, growth["pp"]))
        for rank in row["ranks"]:
            if rank["dp_rank"]:
                continue  # the dp replicas measure the same
            mem = cand.memory[rank["pp_rank"]]
            out.append(("growth.json", row["engine"], row["m"], rank["pp_rank"], mem.total, max(rank["peak_allocated"]),
                        mem.terms["activations"], rank["ledger_stash"][-1]))
    return out


def main() -> None:
    print("| file | pp_engine | m | stage | predicted peak GiB | measured peak allocated GiB | error | "
          "predicted stash peak GiB | ledger stash peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for file, engine, m, r, pred, meas, stash, ledger in rows():
        ledger_text = f"{ledger / GiB:.3f}" if ledger else "-"
        error = 100 * (pred / meas - 1)
        print(f"| {file} | `{engine}` | {m} | {r} | {pred / GiB:.2f} | {meas / GiB:.2f} | {error:+.1f}% "
              f"| {stash / GiB:.3f} | {ledger_text} |")


if __name__ == "__main__":
    main()
