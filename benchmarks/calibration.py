"""Calibration: measured block times of the integration's Llama, turned into cost files.

`run_calibration` times one decoder layer, the embedding and the final norm + LM head +
loss with CUDA events (the host clock on CPU): forward (under no_grad), full backward,
and backward with the block's parameters frozen (input gradients only), so that
weight = full - input-only is the W of a split backward. `stage_costs` sums them per
stage into a `pipeschedule simulate --cost` file (milliseconds, bytes per ms) and
`simulate_cases` predicts each case's step time, bubble and tokens/s/GPU from it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict

import torch

from benchmarks.training import Case, compiled, sync, to_device
from benchmarks.llama.model import DecoderLayer, FinalNorm, LMHead, Loss, ModelConfig, TokenEmbedding


def _elapsed_ms(fn, device) -> float:
    """One run of fn, timed with CUDA events on a GPU and the host clock elsewhere."""
    if device.type != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _block_times(module, make_input, forward, device, repeats: int) -> dict:
    """Median forward, full backward and input-gradient-only backward of one block, in ms
    (two warm-up runs each); weight = full - input-only, the W of a split backward."""
    params = list(module.parameters())

    def fwd():
        with torch.no_grad():
            forward(make_input(False))

    times = {"forward": statistics.median(_elapsed_ms(fwd, device) for _ in range(repeats + 2))}
    for key, weights in (("backward", True), ("backward_input", False)):
        for p in params:
            p.requires_grad_(weights)
        samples = []
        for _ in range(repeats + 2):
            for p in params:
                p.grad = None
            out = forward(make_input(True))
            if not out.requires_grad:  # nothing upstream needs a gradient (the embedding's input)
                samples.append(0.0)
                continue
            grad = torch.ones_like(out) if out.dim() else None
            sync(device)
            samples.append(_elapsed_ms(lambda out=out, grad=grad: out.backward(grad), device))
        times[key] = statistics.median(samples[2:])
    for p in params:
        p.requires_grad_(True)
        p.grad = None
    times["weight"] = max(0.0, times["backward"] - times["backward_input"])
    return times


def run_calibration(cfg: ModelConfig, device, dtype, repeats: int, microbatch_size: int = 1) -> dict:
    """Forward / backward / input-only backward / weight times (ms) of one decoder layer,
    the embedding, and the final norm + LM head + loss, at `cfg`'s sequence length."""
    from benchmarks.llama.reference import microbatch

    batch = to_device(microbatch(cfg, microbatch_size, 0, 7), device)
    hidden = torch.randn(microbatch_size, cfg.seq, cfg.hidden, device=device, dtype=dtype)
    layer = DecoderLayer(cfg, 1).to(device=device, dtype=dtype)
    embedding = TokenEmbedding(cfg, 0).to(device=device, dtype=dtype)
    norm, head, loss = (FinalNorm(cfg, 2).to(device=device, dtype=dtype), LMHead(cfg, 3).to(device=device, dtype=dtype),
                        Loss(cfg, 4))
    tail = torch.nn.ModuleList([norm, head])

    def hidden_input(grad: bool):
        return hidden.detach().requires_grad_(grad)

    out = {
        "layer": _block_times(layer, hidden_input, lambda x: layer(x, None)["hidden_states"], device, repeats),
        "embedding": _block_times(embedding, lambda grad: batch["input_ids"],
                                  lambda ids: embedding(ids, None)["input_embeds"], device, repeats),
        "head_loss": _block_times(
            tail, hidden_input,
            lambda x: loss(head(norm(x)["hidden_states"])["logits"], batch["label_ids"], batch["label_mask"])["loss"],
            device, repeats),
    }
    return out


def simulate_cases(cfg: ModelConfig, costs: dict[int, dict], case_list: list[Case], *, pp: int,
                   microbatch_size: int = 1) -> list[dict]:
    """Simulated step time (ms), bubble and tokens/s/GPU of each case; `costs` by virtual."""
    from pipeschedule.simulate import CostModel, simulate

    out = []
    for case in case_list:
        schedule = compiled(case, pp)
        result = simulate(schedule, CostModel.from_dict(costs[case.virtual], schedule))
        tokens = case.microbatches * microbatch_size * cfg.seq
        out.append({"case": asdict(case), "step_ms": result.step_time, "bubble": result.bubble_fraction,
                    "tokens_per_s_per_gpu": tokens / (result.step_time / 1e3) / pp})
    return out
