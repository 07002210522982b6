"""A stage's forward F under the split backward's route: plain, the old route, the new one.

    python -m benchmarks.split_forward                   # CPU, threads 1, 2, 4 (those the machine has)
    python -m benchmarks.split_forward --threads 1,4,16  # other thread counts
    python -m benchmarks.split_forward --cuda-to-cpu     # all three under nanotron's CPU mode as well
    python -m benchmarks.split_forward --smoke           # tiny model, few rounds, nothing written

The stage: six of the project's Llama decoder layers (`benchmarks.llama.model`, nn.Linear
projections, einops, SDPA), hidden 384, heads 6, kv heads 2, ffn 1024, seq 256, one
sequence, fp32: one stage of the 24-layer model at pp=4 that
`benchmarks.parallel.trainer_groups` measures with nanotron's Llama. Variants, run in
turn each round (rotated), timed from the call to the stage's output:

    plain   F as 1F1B runs it
    mode    the route before issue 40: a `TorchFunctionMode` that sees every torch
            function of F, defers linears into a `WeightGrads` and notes every other
            op's leaf arguments (reproduced here: `OldRoute`)
    route   `WeightGrads.deferring()` (F.linear rebound for this thread) and
            `close_forward(outputs)` (the tie walk over the stage's graph)

Also printed: torch-function calls per F (what the mode intercepts), the linears and
graph nodes per F, the walk's time, and a check that the route's gradients are bitwise
those of the plain backward. `--cuda-to-cpu` runs a second set under `CudaToCpu`, the
mode nanotron's trainer keeps entered on CPU ([Note: nanotron over gloo]).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from benchmarks.common import RESULTS, git_commit, machine, rotated, write_results
from benchmarks.llama.model import DecoderLayer, ModelConfig
from pipeschedule.runtime import split_backward
from pipeschedule.runtime.split_backward import WeightGrads

STAGE = dict(hidden=384, layers=24, heads=6, kv_heads=2, ffn=1024, vocab=2048, seq=256)
STAGE_LAYERS = 6
SMOKE = dict(hidden=32, layers=8, heads=4, kv_heads=2, ffn=64, vocab=128, seq=16)
VARIANTS = ("plain", "mode", "route")


class OldRoute(TorchFunctionMode):
    """The route before issue 40, over the same store: every torch function of F comes here."""

    def __init__(self, store: WeightGrads):
        super().__init__()
        self.store = store

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not torch.is_grad_enabled():
            return func(*args, **kwargs)
        if func is split_backward._LINEAR and not types and self.store._deferrable(*args, **kwargs):
            return self.store.linear(*args, **kwargs)  # (the route is out: this defers, nothing else)
        out = func(*args, **kwargs)
        if _differentiable(out):
            self.store._used.update(id(a) for a in (*args, *kwargs.values())
                                    if isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad)
        return out


def _differentiable(out) -> bool:
    if isinstance(out, torch.Tensor):
        return out.grad_fn is not None
    return isinstance(out, (list, tuple)) and any(isinstance(t, torch.Tensor) and t.grad_fn is not None for t in out)


class Counting(TorchFunctionMode):
    calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        Counting.calls += 1
        return func(*args, **(kwargs or {}))


class Stage(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(layers))
        self.register_buffer("mask", torch.ones(1, cfg.seq, dtype=torch.bool), persistent=False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x, self.mask)["hidden_states"]
        return x


def forward(stage: Stage, x: torch.Tensor, variant: str):
    """(output, store or None) of one F."""
    if variant == "plain":
        return stage(x), None
    store = WeightGrads()
    if variant == "mode":
        with OldRoute(store):
            y = stage(x)
        store.close_forward()
    else:
        with store.deferring():
            y = stage(x)
        store.close_forward(y)
    return y, store


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(stage: Stage, x: torch.Tensor, rounds: int, outer) -> dict:
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    walks = []
    with outer():
        for r in range(rounds):
            for variant in rotated(list(VARIANTS), r):
                _sync(x.device)
                start = time.perf_counter()
                y, _ = forward(stage, x, variant)
                _sync(x.device)
                times[variant].append(time.perf_counter() - start)
                del y
            store = WeightGrads()
            with store.deferring():
                y = stage(x)
            start = time.perf_counter()
            store.close_forward(y)
            walks.append(time.perf_counter() - start)
            del y, store
    ms = {v: 1e3 * statistics.median(t) for v, t in times.items()}
    ratio = {v: statistics.median(a / p for a, p in zip(times[v], times["plain"])) for v in ("mode", "route")}
    return {"ms": ms, "ratio": ratio, "walk_ms": 1e3 * statistics.median(walks)}


def census(stage: Stage, x: torch.Tensor) -> dict:
    """Torch-function calls, linears and graph nodes of one F."""
    Counting.calls = 0
    with Counting():
        stage(x)
    store = WeightGrads()
    with store.deferring():
        y = stage(x)
    nodes, stack = set(), [y.grad_fn]
    while stack:
        for child, _ in stack.pop().next_functions:
            if child is not None and child not in nodes:
                nodes.add(child)
                stack.append(child)
    return {"torch_function_calls": Counting.calls, "linears": len(store.records), "graph_nodes": len(nodes) + 1}


def bitwise(stage: Stage, x: torch.Tensor) -> bool:
    """The route's gradients (B, then W) against the plain backward's."""
    grads = {}
    for variant in ("plain", "route"):
        stage.zero_grad(set_to_none=True)
        y, store = forward(stage, x, variant)
        y.square().mean().backward()
        if store is not None:
            store.run()
        grads[variant] = [p.grad.clone() for p in stage.parameters()]
    stage.zero_grad(set_to_none=True)
    return all(torch.equal(a, b) for a, b in zip(grads["plain"], grads["route"]))


def markdown(result: dict) -> str:
    meta, census_ = result["meta"], result["census"]
    m = meta["machine"]
    lines = [
        "# A stage's forward under the split backward's route", "",
        f"Date: {meta['date']}  ",
        f"Machine: {m['cpu_model']}, {m['cpu_count']} CPUs, {m['platform']}  ",
        f"Python {m['python']}, torch {m['torch']}; device {meta['device']}; 1-minute load average at the end: "
        f"{m['load_average_1m_at_end']}  ",
        f"Commit: {meta['commit']}  ",
        f"Stage: {meta['stage_layers']} layers of `benchmarks.llama.model` at {meta['model']}, fp32, one sequence; "
        f"{meta['rounds']} rounds, the variants in turn (rotated), medians", "",
        f"Per F: {census_['torch_function_calls']} torch-function calls (each passes through the old mode), "
        f"{census_['linears']} linears (the route's only Python calls), {census_['graph_nodes']} graph nodes "
        f"(the tie walk). Route gradients bitwise the plain backward's: {result['bitwise']}.", "",
        "| under | threads | plain ms | mode ms | route ms | mode / plain | route / plain "
        "| mode's extra µs per torch call | walk ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        ms, ratio = row["ms"], row["ratio"]
        per_call = 1e3 * (ms["mode"] - ms["plain"]) / census_["torch_function_calls"]
        lines.append(f"| {row['under']} | {row['threads']} | {ms['plain']:.2f} | {ms['mode']:.2f} | {ms['route']:.2f} "
                     f"| {ratio['mode']:.3f} | {ratio['route']:.3f} | {per_call:.2f} | {row['walk_ms']:.3f} |")
    lines += ["", "Ratios are medians of the per-round ratios. On a shared machine other processes (the load "
                  "average above) slow every variant and the figures carry that load; compare ratios of one run, "
                  "not across runs."]
    return "\n".join(lines) + "\n"


def _threads(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--threads {text!r}: give positive integers separated by commas, e.g. 1,4")
    return values


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, 3 rounds, write nothing")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=_threads, default=None, help="comma-separated (default 1,2,4 up to the CPUs)")
    parser.add_argument("--cuda-to-cpu", action="store_true", help="also measure under nanotron's CudaToCpu mode")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = parser.parse_args(argv)
    cfg = ModelConfig(**(SMOKE if args.smoke else STAGE))
    rounds = 3 if args.smoke else args.rounds
    threads = args.threads or [t for t in (1, 2, 4) if t <= (os.cpu_count() or 1)]
    device = torch.device(args.device)
    torch.manual_seed(0)
    stage = Stage(cfg, 2 if args.smoke else STAGE_LAYERS).to(device)
    x = torch.randn(1, cfg.seq, cfg.hidden, device=device, requires_grad=True)
    unders = [("-", _Nothing)]
    if args.cuda_to_cpu:
        from integration.nanotron.patches.gloo import CudaToCpu  # noqa: PLC0415  (nanotron's patches: on request)
        unders.append(("CudaToCpu", CudaToCpu))
    info = census(stage, x)
    exact = bitwise(stage, x)
    print(f"per F: {info['torch_function_calls']} torch-function calls, {info['linears']} linears, "
          f"{info['graph_nodes']} graph nodes; route gradients bitwise: {exact}")
    rows = []
    for name, outer in unders:
        for n in threads:
            torch.set_num_threads(n)
            forward(stage, x, "route")  # warm-up
            row = {"under": name, "threads": n, **measure(stage, x, rounds, outer)}
            rows.append(row)
            ms, ratio = row["ms"], row["ratio"]
            print(f"under {name:<9} threads {n:2d}: plain {ms['plain']:8.2f} ms  mode {ms['mode']:8.2f} ms "
                  f"({ratio['mode']:.3f}x)  route {ms['route']:8.2f} ms ({ratio['route']:.3f}x)  "
                  f"walk {row['walk_ms']:.3f} ms", flush=True)
    result = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "machine": machine(), "commit": git_commit(), "device": str(device), "rounds": rounds,
                       "model": {k: v for k, v in vars(cfg).items() if k in STAGE},
                       "stage_layers": len(stage.layers)},
              "census": info, "bitwise": exact, "rows": rows}
    if not exact:
        raise SystemExit("split_forward: the route's gradients differ from the plain backward's")
    if not args.smoke:
        paths = write_results("split_forward", result, markdown(result))
        print("wrote " + " and ".join(str(p.relative_to(RESULTS.parent.parent)) for p in paths))


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
