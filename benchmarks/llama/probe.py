"""Measured and predicted memory of the integration Llama, per pipeline rank, term by term.

    measure(cfg, pp=, engine=, microbatches=, microbatch_size=, ...) -> list[dict[str, float]]
    predict(cfg, pp=, split=, schedule=, microbatch_size=, dtype_bytes=, optimizer=) -> list[dict[str, float]]

Both return one dict per pp rank, term -> bytes, with the keys of
`benchmarks.llama.memory.TERMS` (measure leaves out the working set, which needs an
allocator's statistics; on CUDA it adds "allocator peak", torch.cuda.max_memory_allocated
over the last step). `predict` is pure arithmetic ([Note: what the integration Llama saves] in
benchmarks/llama/memory.py) over the same model, split and lowered schedule;
`measure` runs real training steps through pipeschedule's nanotron engines in pp gloo
processes (`pipeschedule.runtime.launch.spawn`) and reads:

    parameters            sum of p.nbytes over the rank's parameters
    gradients             sum of p.grad.nbytes after the step's last backward
    optimizer state       sum of the nbytes of every tensor in torch.optim.AdamW's state
                          after its step (exp_avg, exp_avg_sq, step), 0 without optimizer
    stash per microbatch  the executor's Ledger: bytes of ("stash", stage, mb), summed over
                          the rank's stages, largest over mb ("stash per microbatch (min)":
                          the smallest, to show they agree)
    stash peak            the ledger's high-water mark of stash
    p2p buffers peak      the highest sum of live act_in, act_out, grad_out and grad_in over
                          the ledger's per-instruction trace (and each kind's own high-water
                          mark as "high <kind>")

The ledger is the last step's (`steps`, default 2: the second step runs with optimizer
state allocated, as training does).

Example (CPU, fp32; on a GPU pass device="cuda", dtype=torch.bfloat16, dtype_bytes=2):

    cfg = ModelConfig(hidden=64, layers=4, heads=4, kv_heads=2, ffn=160, vocab=256, seq=64)
    measured = measure(cfg, pp=2, engine="capped_1f1b:cap=1", split=(2, 2), microbatches=4, microbatch_size=2)
    predicted = predict(cfg, pp=2, split=(2, 2), schedule=engine_schedule("capped_1f1b:cap=1", pp=2, microbatches=4),
                        microbatch_size=2, dtype_bytes=4, optimizer="adamw")
    table(measured, predicted)  # text, one row per (rank, term), with the relative error

Script form: `python -m benchmarks.llama.probe` prints the calibration table of
docs/memory_calibration.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

import integration.nanotron  # noqa: F401  (first: nanotron 0.4 imports once repaired; installs the patches)
import nanotron.distributed as nanotron_dist

from benchmarks.llama.memory import TERMS, predict_ranks
from benchmarks.llama.model import ModelConfig, build_llama, llama_block_ranks
from benchmarks.llama.reference import clear_shared_state, for_rank, microbatch
from integration.nanotron.patches.cpu import cpu_p2p, cpu_parallel_context
from integration.nanotron.pipeline.engine import build_engine
from integration.nanotron.pipeline.engine_spec import parse_engine
from pipeschedule.compiler.ir import Schedule
from pipeschedule.plan.memory import ModelSpec, TrainingSetup
from pipeschedule.runtime.launch import spawn

# the working set and the step peak are predicted only: CPU has no allocator peak
MEASURED_TERMS = tuple(t for t in TERMS if t not in ("working set (transient)", "step peak"))
OPTIMIZERS = ("adamw", "none")
P2P_KINDS = ("act_in", "act_out", "grad_out", "grad_in")


@dataclasses.dataclass(frozen=True)
class ProbeRun:
    """One measured configuration. engine: a pipeschedule `pp_engine` value (`ps_1f1b`,
    `capped_1f1b:cap=2`, ...). split: decoder layers per stage (None: the engine spec's,
    else nanotron's). microbatches: m per step."""

    engine: str
    microbatches: int
    split: tuple[int, ...] | None = None


# -- prediction ---------------------------------------------------------------------------


def model_spec(cfg: ModelConfig) -> ModelSpec:
    return ModelSpec("integration-llama", layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads,
                     kv_heads=cfg.kv_heads, ffn=cfg.ffn, vocab=cfg.vocab)


def training_setup(cfg: ModelConfig, *, microbatch_size: int, dtype_bytes: int, optimizer: str) -> TrainingSetup:
    """The integration's setup: tp=1, dp=1, gradients in `.grad` in the parameter dtype,
    AdamW (or no optimizer) in the parameter dtype, activations in the same dtype."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    return TrainingSetup(
        tp=1, dp=1, seq=cfg.seq, micro_batch=microbatch_size, sequence_parallel=False, flash=True,
        param_bytes=dtype_bytes, act_bytes=dtype_bytes, fp32_grad_accum=False, ddp_buckets=False,
        activation_formula="llama", optimizer="adam" if optimizer == "adamw" else "none",
    )


def engine_schedule(engine: str, *, pp: int, microbatches: int) -> Schedule:
    """The lowered, verified schedule the pipeschedule engine `engine` runs for (pp, m)."""
    return build_engine(parse_engine(engine)).compile(pp=pp, microbatches=microbatches)


def layers_per_stage(cfg: ModelConfig, pp: int, split: Sequence[int] | None,
                     placement: Sequence[int] | None = None) -> tuple[int, ...]:
    """Decoder layers of each stage as the model is built (nanotron's split when None)."""
    ranks = llama_block_ranks(cfg, pp, split=split, placement=placement)
    counts: list[int] = []
    previous = None
    for index, rank in enumerate(ranks):
        if rank != previous:
            counts.append(0)
            previous = rank
        if 1 <= index <= cfg.layers:
            counts[-1] += 1
    return tuple(counts)


def predict(cfg: ModelConfig, *, pp: int, split: Sequence[int] | None, schedule: Schedule | str,
            microbatch_size: int, dtype_bytes: int, optimizer: str = "adamw",
            microbatches: int | None = None, device: str = "cpu",
            attention_lse_pad: int = 1) -> list[dict[str, float]]:
    """Predicted bytes per rank, by term (`TERMS`).

    cfg              the integration model's sizes (hidden, layers, heads, kv_heads, ffn, vocab, seq)
    pp               pipeline ranks
    split            decoder layers per stage (None: nanotron's split)
    schedule         the lowered schedule (`engine_schedule(...)`, or an engine's `compile`),
                     or a pp_engine value, then compiled for `microbatches`
    microbatch_size  sequences per microbatch
    dtype_bytes      bytes of the parameter and activation dtype (4 fp32, 2 bf16)
    optimizer        "adamw" (torch.optim.AdamW in the parameter dtype) or "none"
    device           "cpu" or "cuda": which SDPA kernel's saved tensors to count (on CUDA
                     the flash kernel also saves 16 bytes of RNG state per layer)
    attention_lse_pad  the attention kernel's logsumexp sequence padding (1 on CPU and for
                     flash attention; 32 for CUDA's memory-efficient kernel)
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if isinstance(schedule, str):
        if microbatches is None:
            raise ValueError(f"schedule {schedule!r} is an engine name: give microbatches to compile it")
        schedule = engine_schedule(schedule, pp=pp, microbatches=microbatches)
    placement = schedule.placement if schedule.virtual > 1 else None
    if split is not None and len(split) == schedule.num_stages:
        layers = tuple(split)  # given per stage (also where two consecutive stages share a rank: a V's turn)
    else:
        layers = layers_per_stage(cfg, pp, split, placement)
    setup = training_setup(cfg, microbatch_size=microbatch_size, dtype_bytes=dtype_bytes, optimizer=optimizer)
    return predict_ranks(model_spec(cfg), setup, layers, schedule, attention_lse_pad=attention_lse_pad,
                         attention_rng_bytes=16 if device == "cuda" else 0)


# -- measurement --------------------------------------------------------------------------


def measure(cfg: ModelConfig, *, pp: int, engine: str, microbatches: int, microbatch_size: int,
            split: Sequence[int] | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu",
            optimizer: str = "adamw", steps: int = 2, data_seed: int = 1234,
            timeout: float = 120.0) -> list[dict[str, float]]:
    """Measured bytes per rank, by term (module docstring): `steps` training steps of the
    integration Llama under the pipeschedule engine `engine` (a pp_engine value) in pp
    gloo processes. device "cpu" or "cuda" (rank r on GPU r % device_count; boundary
    tensors are staged through host memory, as the engine does for gloo on CUDA)."""
    run = ProbeRun(engine, microbatches, None if split is None else tuple(split))
    return measure_runs(cfg, pp=pp, runs=(run,), microbatch_size=microbatch_size, dtype=dtype, device=device,
                        optimizer=optimizer, steps=steps, data_seed=data_seed, timeout=timeout)[0]


def measure_runs(cfg: ModelConfig, *, pp: int, runs: Sequence[ProbeRun], microbatch_size: int,
                 dtype: torch.dtype = torch.float32, device: str = "cpu", optimizer: str = "adamw",
                 steps: int = 2, data_seed: int = 1234, timeout: float = 120.0) -> list[list[dict[str, float]]]:
    """`measure` for several runs in one process group (one spawn): result[i][rank]."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    args = (cfg, tuple(runs), microbatch_size, dtype, device, optimizer, steps, data_seed)
    per_rank = spawn(_probe_worker, pp, args=args, timeout=timeout)
    return [[per_rank[r][i] for r in range(pp)] for i in range(len(runs))]


def _probe_worker(rank, world_size, store, cfg, runs, microbatch_size, dtype, device, optimizer, steps,
                  data_seed) -> list:
    context = cpu_parallel_context(tp=1, pp=world_size, dp=1)
    p2p = cpu_p2p(context.pp_pg)
    where = torch.device("cpu")
    if device == "cuda":
        where = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(where)
    elif device != "cpu":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return [_probe_once(cfg, run, context, p2p, microbatch_size, dtype, where, optimizer, steps, data_seed)
            for run in runs]


def _probe_once(cfg, run: ProbeRun, context, p2p, microbatch_size, dtype, device, optimizer, steps, data_seed) -> dict:
    pp = context.pipeline_parallel_size
    pp_rank = nanotron_dist.get_rank(context.pp_pg)
    spec = parse_engine(run.engine)
    engine = build_engine(spec)
    split = run.split if run.split is not None else spec.split
    placement = None
    if engine.virtual > 1:
        placement = engine.compile(pp=pp, microbatches=run.microbatches).placement
    model = build_llama(cfg, p2p, llama_block_ranks(cfg, pp, split=split, placement=placement), device=device,
                        dtype=dtype)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params) if optimizer == "adamw" and params else None
    m = run.microbatches
    for step in range(steps):
        clear_shared_state()  # [Note: nanotron's shared deques]
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            allocator_start = torch.cuda.memory_allocated(device)
        data = (
            _to(for_rank(microbatch(cfg, microbatch_size, step * m + i, data_seed),
                         pp_rank, model.input_pp_rank, model.output_pp_rank), device)
            for i in range(m)
        )
        engine.train_batch_iter(model=model, pg=context.pp_pg, batch=data, nb_microbatches=m, grad_accumulator=None)
        p2p.wait_sends()
        grads = sum(p.grad.nbytes for p in params if p.grad is not None)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            allocator_peak = torch.cuda.max_memory_allocated(device)
        if opt is not None:
            opt.step()
    ledger = _ledger(engine)
    out = {
        "parameters": float(sum(p.nbytes for p in params)),
        "gradients": float(grads),
        "optimizer state": float(_optimizer_bytes(opt)),
        **_ledger_terms(ledger),
    }
    if device.type == "cuda":
        out["allocator peak"] = float(allocator_peak)
        out["allocator at step start"] = float(allocator_start)
    return out


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _ledger(engine):
    """The executor's ledger of the engine's one training runner."""
    ledger = engine.training_ledger()
    if ledger is None:
        raise RuntimeError("the engine has not trained yet")
    return ledger


def _optimizer_bytes(opt) -> int:
    if opt is None:
        return 0
    return sum(v.nbytes for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor))


def _ledger_terms(ledger) -> dict[str, float]:
    per_mb: dict[int, int] = {}
    for (kind, _stage, mb), size in ledger.sizes.items():
        if kind == "stash":
            per_mb[mb] = per_mb.get(mb, 0) + size
    p2p_peak = max((sum(live[k] for k in P2P_KINDS) for _, _, live in ledger.trace), default=0)
    out = {
        "stash per microbatch": float(max(per_mb.values())),
        "stash per microbatch (min)": float(min(per_mb.values())),
        "stash peak": float(ledger.high["stash"]),
        "p2p buffers peak": float(p2p_peak),
    }
    out.update({f"high {k}": float(ledger.high[k]) for k in P2P_KINDS})
    return out


# -- comparison ---------------------------------------------------------------------------


def relative_errors(measured: Sequence[dict], predicted: Sequence[dict],
                    terms: Sequence[str] = MEASURED_TERMS) -> list[dict[str, float]]:
    """Per rank, term -> (predicted - measured) / measured (0 when both are 0, inf when only
    the measurement is 0)."""
    out = []
    for got, want in zip(measured, predicted, strict=True):
        row = {}
        for term in terms:
            m, p = got[term], want[term]
            row[term] = 0.0 if m == p else (p - m) / m if m else float("inf")
        out.append(row)
    return out


def table(measured: Sequence[dict], predicted: Sequence[dict], terms: Sequence[str] = MEASURED_TERMS) -> str:
    """Markdown rows: rank | term | predicted | measured | error."""
    errors = relative_errors(measured, predicted, terms)
    lines = ["| rank | term | predicted (bytes) | measured (bytes) | error |", "|---|---|---:|---:|---:|"]
    for r, (got, want, err) in enumerate(zip(measured, predicted, errors)):
        for term in terms:
            lines.append(f"| {r} | {term} | {want[term]:,.0f} | {got[term]:,.0f} | {100 * err[term]:+.2f}% |")
    return "\n".join(lines)


CALIBRATION_MODEL = ModelConfig(hidden=96, layers=4, heads=6, kv_heads=2, ffn=256, vocab=512, seq=96)
CALIBRATION_CASES = (  # (pp, run): the fp32 table of docs/memory_calibration.md and the tests
    (2, ProbeRun("ps_1f1b", 6, (2, 2))),
    (2, ProbeRun("capped_1f1b:cap=1", 6, (2, 2))),
    (4, ProbeRun("ps_1f1b", 8, (1, 1, 1, 1))),
    (4, ProbeRun("capped_1f1b:cap=2", 8, (1, 1, 1, 1))),
)
CALIBRATION_BF16_CASES = (  # pp=2, bf16 on CPU: a stage without decoder layers too
    (2, ProbeRun("ps_1f1b", 4, (1, 3))),
    (2, ProbeRun("capped_1f1b:cap=1", 4, (4, 0))),
)
CALIBRATION_SPLIT_CASES = (  # split backward (B, then W): the stash shrinks at B to what W keeps
    (4, ProbeRun("zb_h1", 8, (1, 1, 1, 1))),
)
CALIBRATION_MICROBATCH_SIZE = 2


def summary_table(rows: Sequence[tuple[str, Sequence[dict], Sequence[dict]]],
                  terms: Sequence[str] = MEASURED_TERMS) -> str:
    """Markdown, one line per (case, rank): "predicted / measured (error)" per term, in KiB.
    rows: (case label, measured per rank, predicted per rank)."""
    lines = ["| case | rank | " + " | ".join(terms) + " |", "|---|---:|" + "---:|" * len(terms)]
    for label, measured, predicted in rows:
        for r, (got, want, err) in enumerate(zip(measured, predicted, relative_errors(measured, predicted, terms))):
            cells = [f"{want[t] / 1024:,.1f} / {got[t] / 1024:,.1f} ({100 * err[t]:+.1f}%)" for t in terms]
            lines.append(f"| {label} | {r} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def calibration_rows(cases, dtype: torch.dtype = torch.float32) -> list[tuple[str, list[dict], list[dict]]]:
    """Measure and predict every (pp, run) of `cases` (one spawn per pp) on CPU."""
    cfg, b = CALIBRATION_MODEL, CALIBRATION_MICROBATCH_SIZE
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    rows = []
    for pp in sorted({pp for pp, _ in cases}):
        runs = [run for p, run in cases if p == pp]
        for run, got in zip(runs, measure_runs(cfg, pp=pp, runs=runs, microbatch_size=b, dtype=dtype)):
            want = predict(cfg, pp=pp, split=run.split, schedule=run.engine, microbatches=run.microbatches,
                           microbatch_size=b, dtype_bytes=dtype_bytes, optimizer="adamw")
            label = f"pp={pp} {run.engine} m={run.microbatches} split={'/'.join(map(str, run.split))}"
            rows.append((label, got, want))
    return rows


def main() -> None:
    print(f"{CALIBRATION_MODEL}, micro-batch size {CALIBRATION_MICROBATCH_SIZE}, AdamW; KiB predicted / measured\n")
    for name, cases, dtype in (("fp32", CALIBRATION_CASES, torch.float32),
                               ("bf16", CALIBRATION_BF16_CASES, torch.bfloat16)):
        print(f"{name} on CPU:\n\n" + summary_table(calibration_rows(cases, dtype)) + "\n")


if __name__ == "__main__":
    main()


__all__ = [
    "CALIBRATION_BF16_CASES",
    "CALIBRATION_CASES",
    "CALIBRATION_MICROBATCH_SIZE",
    "CALIBRATION_MODEL",
    "MEASURED_TERMS",
    "ProbeRun",
    "calibration_rows",
    "engine_schedule",
    "layers_per_stage",
    "measure",
    "measure_runs",
    "model_spec",
    "predict",
    "relative_errors",
    "summary_table",
    "table",
    "training_setup",
]
