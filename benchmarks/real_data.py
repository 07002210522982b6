"""The launcher on real text on a GPU (issue 33 item 7): nanotron's 1F1B against
`capped_1f1b:cap=2`, the same YAML but for `pp_engine`.

    python -m benchmarks.real_data --prepare DIR   # here: a corpus and a tokenizer into DIR
    python -m benchmarks.real_data --data DIR      # one CUDA GPU: pp=4 as four ranks on it
    python -m benchmarks.real_data --smoke         # CPU, a tiny model on a tiny corpus: the plumbing

The corpus is real text made locally: every module of this Python's standard library, one
JSON line per file (`{"text": source}`), and a byte-level BPE tokenizer trained on it with
`tokenizers`, saved as a `transformers` tokenizer folder. The run is the users' launch:
`torchrun --nproc-per-node 4 -m integration.nanotron.train --config-file CONFIG --record DIR`,
nanotron's `DistributedTrainer` on its `LlamaForTraining` (bf16, fp32 gradient
accumulation, AdamW), the data read by nanotron's own data path (integration/nanotron/data.py:
`get_datasets`, `clm_process`, `get_train_dataloader`). Both engines have nanotron's split
and placement, so they start from the same weights and read the same samples.

Reports: the losses step by step (on the GPU kernels are not bitwise deterministic, so
equal to the noise of a repeated run rather than to the bit), the per-stage pipeline peak
(the allocator's peak up to the end of `train_batch_iter`) of each engine, the fall on
stage 0 against the memory model's (pipeschedule/plan/memory.py) and the first-step block
that rank 0 printed. Writes benchmarks/results/real_data.json and .md.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import tempfile
from pathlib import Path

from benchmarks.common import RESULTS, torchrun, torchrun_failure, versions, write_results
from benchmarks.plan_calibration import split_of
from integration.nanotron.example import TrainerConfig
from pipeschedule.plan import PlanConfig
from pipeschedule.plan.memory import OPTIMIZER_STEP, GiB, ModelSpec, TrainingSetup
from pipeschedule.plan.evaluation import Evaluator, evaluate_engine

ENGINES = {"1f1b": ("1f1b", None, 1), "capped_1f1b:cap=2": ("capped_1f1b", 2, 1)}
PP, MICROBATCHES, WARMUP = 4, 8, 2
SIZES = dict(hidden=2048, layers=16, heads=16, kv_heads=8, ffn=5632, vocab=8192, seq=1024, micro_batch_size=1)
STEPS = 20
SMOKE_SIZES = dict(hidden=32, layers=8, heads=4, kv_heads=2, ffn=64, vocab=512, seq=32, micro_batch_size=1)


def prepare(folder: Path, *, vocab: int, limit: int | None = None) -> tuple[Path, Path]:
    """`folder/corpus/stdlib.jsonl` and `folder/tokenizer/`: the corpus and the tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus, tokenizer_dir = folder / "corpus", folder / "tokenizer"
    corpus.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py"))[:limit]
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    (corpus / "stdlib.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["</s>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>")
    fast.save_pretrained(tokenizer_dir)
    tokens = sum(len(ids) for ids in fast(texts)["input_ids"])
    about = (f"the {len(files)} modules of Python {sys.version.split()[0]}'s standard library (one JSON line each, "
             f"{sum(map(len, texts)) / 2**20:.1f} MiB of text, {tokens:,} tokens), a byte-level BPE tokenizer of "
             f"{len(fast)} tokens trained on them")
    (folder / "about.json").write_text(json.dumps({"text": about, "files": len(files), "tokens": tokens}))
    return corpus, tokenizer_dir


def run(data: Path, sizes: dict, steps: int, work: Path) -> dict:
    out = {}
    for engine in ENGINES:
        config = TrainerConfig(engine=engine, pp=PP, microbatches=MICROBATCHES, steps=steps, dtype="bfloat16",
                               fp32_accumulation=True, dataset=str(data / "corpus"),
                               tokenizer=str(data / "tokenizer"), **sizes)
        name = engine.replace(":", "_").replace("=", "")
        path, record = work / f"{name}.yaml", work / f"record-{name}"
        path.write_text(config.yaml(str(work / f"checkpoints-{name}")))
        result = torchrun(config.world, ["-m", "integration.nanotron.train", "--config-file", str(path),
                                         "--record", str(record)], timeout=900)
        if result.returncode != 0:
            raise RuntimeError(torchrun_failure(engine, result))
        records = [json.loads((record / f"rank{r}.json").read_text()) for r in range(config.world)]
        peaks = [0] * PP
        for rec in records:
            for step in rec["steps"][WARMUP:] or rec["steps"]:
                peaks[rec["pp_rank"]] = max(peaks[rec["pp_rank"]], step.get("peak_allocated_pipeline") or 0)
        loss_rank = next(r for r in records if r["steps"][0]["loss"] is not None)
        block = [line for line in (result.stdout + result.stderr).splitlines() if "pipeschedule:" in line]
        stages = sorted((r for r in records if r["dp_rank"] == r["tp_rank"] == 0), key=lambda r: r["pp_rank"])
        by_step = {key: [[s.get(key) for s in rec["steps"]] for rec in stages]
                   for key in ("peak_allocated_pipeline", "allocated_at_start", "allocated_after_pipeline")}
        out[engine] = {"losses": [s["loss"] for s in loss_rank["steps"]], "peak_allocated_pipeline": peaks,
                       "by_step": by_step,
                       "block_ranks": records[0]["block_ranks"], "first_step": records[0].get("first_step"),
                       "log_tail": (result.stdout + result.stderr).splitlines()[-12:], "block": block[:40]}
        print(f"{engine}: losses {' '.join(f'{x:.3f}' for x in out[engine]['losses'])}; pipeline peaks "
              + " / ".join(f"{p / GiB:.2f}" for p in peaks) + " GiB", flush=True)
    return out


def predicted(sizes: dict, runs: dict) -> dict:
    """The memory model's pipeline peak per stage of each run."""
    model = ModelSpec("real-data", layers=sizes["layers"], hidden=sizes["hidden"], heads=sizes["heads"],
                      kv_heads=sizes["kv_heads"], ffn=sizes["ffn"], vocab=sizes["vocab"])
    setup = TrainingSetup(tp=1, seq=sizes["seq"], micro_batch=sizes["micro_batch_size"], sequence_parallel=False,
                          attention="sdpa-standin", adam_fused=False)
    planner = Evaluator(PlanConfig(model, setup, pp=PP, microbatches=MICROBATCHES, gpu_memory=139 * GiB))
    out = {}
    for engine, result in runs.items():
        family, cap, virtual = ENGINES[engine]
        cand = evaluate_engine(planner, engine, family, cap, virtual, split_of(result["block_ranks"], PP))
        out[engine] = [m.total - m.terms.get(OPTIMIZER_STEP, 0.0) for m in cand.memory]
    return out


def render(report: dict) -> str:
    runs, pred = report["runs"], report["predicted"]
    ref, capped = runs["1f1b"], runs["capped_1f1b:cap=2"]
    s = report["model"]
    lines = [f"# nanotron's launcher on real text: nanotron's 1F1B against capped_1f1b:cap=2 "
             f"({report['versions']['date']})", "",
             f"`python -m benchmarks.real_data --data DIR` (DIR from `--prepare`): {report['corpus']}. nanotron's "
             f"trainer from the YAML, its Llama at hidden {s['hidden']}, {s['layers']} layers, vocab {s['vocab']}, "
             f"seq {s['seq']}, micro-batch 1, m={MICROBATCHES}, bf16, fp32 gradient accumulation, AdamW; pp=4 as four "
             f"ranks on one GPU (gloo, host-staged boundaries); {report['steps']} steps. Peaks: the allocator's peak "
             f"up to the end of `train_batch_iter`, steps {WARMUP + 1} on.", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), "",
             "| pp_engine | pipeline peak per stage, measured (GiB) | predicted (GiB) |", "|---|---|---|"]
    for engine, result in runs.items():
        lines.append(f"| `{engine}` | " + " / ".join(f"{p / GiB:.2f}" for p in result["peak_allocated_pipeline"])
                     + " | " + " / ".join(f"{p / GiB:.2f}" for p in pred[engine]) + " |")
    fall = ref["peak_allocated_pipeline"][0] - capped["peak_allocated_pipeline"][0]
    expected = pred["1f1b"][0] - pred["capped_1f1b:cap=2"][0]
    gaps = [abs(a - b) for a, b in zip(ref["losses"], capped["losses"])]
    lines += ["", f"Step by step (steps {WARMUP + 1}-{report['steps']}), the spread of each stage's pipeline peak, "
              "largest minus smallest (a peak that grows with the steps shows here):", ""]
    for engine, result in runs.items():
        rows = result.get("by_step", {}).get("peak_allocated_pipeline") or []
        spreads = [max(r[WARMUP:]) - min(r[WARMUP:]) for r in rows if len(r) > WARMUP]
        lines.append(f"- `{engine}`: " + " / ".join(f"{s / 2**20:.1f}" for s in spreads) + " MiB")
    lines += ["", f"Stage 0 falls by {fall / GiB:.2f} GiB under cap 2; the memory model predicts "
              f"{expected / GiB:.2f} GiB ({fall / expected:.3f} of it).", "",
              "| step | " + " | ".join(f"`{e}`" for e in runs) + " |", "|---|" + "---|" * len(runs)]
    for i, losses in enumerate(zip(*(r["losses"] for r in runs.values()))):
        lines.append(f"| {i + 1} | " + " | ".join(f"{x:.4f}" for x in losses) + " |")
    lines += ["", f"Largest |difference| of the two engines' losses over the steps: {max(gaps):.2e}.", "",
              "What rank 0 printed at the first step (`capped_1f1b:cap=2`):", "", "```",
              *capped["block"], "```", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.real_data", description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", type=Path, metavar="DIR", help="write the corpus and the tokenizer into DIR")
    parser.add_argument("--data", type=Path, metavar="DIR", help="train on DIR (from --prepare) on the GPU")
    parser.add_argument("--smoke", action="store_true", help="tiny model and corpus on CPU; writes nothing")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps per run (default {STEPS})")
    parser.add_argument("--commit", help="commit to record (the device machine's tree may lack git history)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where real_data.json and .md go")
    args = parser.parse_args(argv)
    if args.prepare is not None:
        corpus, tokenizer = prepare(args.prepare, vocab=SIZES["vocab"])
        print(f"corpus {corpus} ({sum(f.stat().st_size for f in corpus.iterdir()) / 2**20:.1f} MiB), "
              f"tokenizer {tokenizer}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="pipeschedule-real-data-"))
    if args.smoke:
        prepare(work / "data", vocab=SMOKE_SIZES["vocab"], limit=20)
        runs = run(work / "data", SMOKE_SIZES, WARMUP + 1, work)
        print(f"smoke: {len(runs)} engines trained on text; predicted stage 0 "
              + ", ".join(f"{e} {p[0] / 2**20:.2f} MiB" for e, p in predicted(SMOKE_SIZES, runs).items()))
        return 0
    import torch

    if args.data is None or not torch.cuda.is_available():
        print("benchmarks.real_data: give --data DIR (made by --prepare) on a machine with a CUDA GPU, or --smoke",
              file=sys.stderr)
        return 2
    corpus = json.loads((args.data / "about.json").read_text()) if (args.data / "about.json").exists() else {}
    runs = run(args.data, SIZES, args.steps, work)
    report = {"versions": versions(args.commit), "model": SIZES, "steps": args.steps, "runs": runs,
              "predicted": predicted(SIZES, runs),
              "corpus": corpus.get("text", "a corpus made by --prepare")}
    text = render(report)
    write_results("real_data", report, text, out=args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
