"""Do SM partitions of one GPU run at the same time? A probe of every route we know.

    python -m benchmarks.parallel.sm_probe [--out DIR] [--parts 4] [--size 8192] [--reps 12]

For each route, `--parts` partitions of the GPU's SMs (an equal share each) run the same
work: `--reps` bf16 matmuls of size^3 per partition. The route's time with every partition
busy at once, over the time of one partition alone, is its overlap ratio: 1.0 when the
partitions run side by side, `--parts` when they run one after another. Routes:

  torch_green      torch.cuda.green_contexts.GreenContext.create(num_sms=k) and its Stream()
  driver_green     the CUDA driver's green contexts through the cuda-bindings package:
                   cuDevSmResourceSplitByCount into `parts` groups, cuGreenCtxCreate, and
                   a non-blocking stream per context from cuGreenCtxStreamCreate
  driver_green_balanced  the same, each context also given its own work queues (a
                   workqueue-config resource of scope GREEN_CTX_BALANCED: CUDA 13.1 drivers on)
  driver_green_ctx the same contexts, each stream made with cuStreamCreate while the green
                   context (cuCtxFromGreenCtx) is current
  plain_streams    no partition: `parts` ordinary streams (each kernel may take every SM)
  mps              `parts` processes under the CUDA MPS daemon, each limited to 100/parts %
                   of the SMs by CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (only when
                   nvidia-cuda-mps-control is on the PATH; the daemon is started and quit here)

The green routes are `sm_partitions`' (pipeschedule/runtime/partitioned.py), what the
benchmarks run. All work of one timing is enqueued from one host thread before a single synchronize, so
the GPU sets the pace. Writes parallel_sm_probe.json under --out (default: nothing written).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path


def _matmul_inputs(size: int, parts: int):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    return [(torch.randn(size, size, device="cuda", dtype=torch.bfloat16, generator=gen),
             torch.randn(size, size, device="cuda", dtype=torch.bfloat16, generator=gen)) for _ in range(parts)]


def _timed(streams, inputs, reps: int, which: list[int]) -> float:
    """Seconds for `reps` matmuls on each stream in `which`, all enqueued, then one sync."""
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        for k in which:
            with torch.cuda.stream(streams[k]):
                a, b = inputs[k]
                torch.mm(a, b)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure_streams(name: str, streams, inputs, reps: int, size: int) -> dict:
    parts = len(streams)
    _timed(streams, inputs, 2, list(range(parts)))  # warm-up: handles, workspaces, clocks
    alone = min(_timed(streams, inputs, reps, [0]) for _ in range(2))
    together = min(_timed(streams, inputs, reps, list(range(parts))) for _ in range(2))
    flops = 2 * size**3 * reps
    return {"route": name, "ok": True, "alone_s": alone, "together_s": together,
            "overlap_ratio": together / alone, "tflops_one_partition": flops / alone / 1e12,
            "tflops_all_partitions": flops * parts / together / 1e12}


def _partitions(route: str):
    def make(parts: int, sms: int):
        from pipeschedule.runtime.partitioned import sm_partitions

        return sm_partitions(parts, route=route)
    return make


def driver_green_ctx(parts: int, sms: int):
    """Green contexts from the driver, each stream made by cuStreamCreate while the context
    (cuCtxFromGreenCtx) is current, rather than by cuGreenCtxStreamCreate."""
    import torch
    from cuda.bindings import driver

    def check(result):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver call failed: {err}")
        return rest[0] if len(rest) == 1 else rest

    contexts, _ = _partitions("driver")(parts, sms)
    streams = []
    for ctx in contexts:
        check(driver.cuCtxPushCurrent(check(driver.cuCtxFromGreenCtx(ctx))))
        try:
            raw = check(driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
        finally:
            check(driver.cuCtxPopCurrent())
        streams.append(torch.cuda.ExternalStream(int(raw)))
    return contexts, streams


ROUTES = {"torch_green": _partitions("torch"), "driver_green": _partitions("driver"),
          "driver_green_balanced": _partitions("balanced"), "driver_green_ctx": driver_green_ctx,
          "plain_streams": _partitions("streams")}


def run_routes(parts: int, size: int, reps: int) -> list[dict]:
    import torch

    total = torch.cuda.get_device_properties(0).multi_processor_count
    sms = (total // parts) // 8 * 8  # partitions come in multiples of the device's SM granularity
    inputs = _matmul_inputs(size, parts)
    rows = []
    for name, make in ROUTES.items():
        try:
            keep, streams = make(parts, sms)
            row = measure_streams(name, streams, inputs, reps, size)
            row["sms_per_partition"] = sms if name != "plain_streams" else total
            del keep
        except Exception as err:  # a route that does not exist here is a finding, not a failure
            row = {"route": name, "ok": False, "error": f"{type(err).__name__}: {err}",
                   "trace": traceback.format_exc(limit=3)}
        print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
        rows.append(row)
    return rows


def _mps_worker(size: int, reps: int, start_at: float) -> None:
    """One MPS client: waits for the common start, times its matmuls, prints seconds."""
    import torch

    inputs = _matmul_inputs(size, 1)
    stream = torch.cuda.current_stream()
    _timed([stream], inputs, 2, [0])
    while time.time() < start_at:
        time.sleep(0.001)
    print(json.dumps({"seconds": _timed([stream], inputs, reps, [0])}), flush=True)


def run_mps(parts: int, size: int, reps: int) -> dict:
    from benchmarks.parallel import mps

    try:
        with mps.daemon() as daemon_env:
            env = dict(os.environ, **daemon_env)

            def clients(n: int) -> list[float]:
                start_at = time.time() + 15.0
                share = dict(env, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(100 // parts))
                procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.parallel.sm_probe", "--mps-worker",
                                           str(start_at), "--size", str(size), "--reps", str(reps)],
                                          env=share, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                         for _ in range(n)]
                seconds = []
                for proc in procs:
                    out, err = proc.communicate(timeout=90)
                    if proc.returncode != 0:
                        raise RuntimeError(f"mps client failed: {err.strip()[-400:]}")
                    seconds.append(json.loads(out.strip().splitlines()[-1])["seconds"])
                return seconds

            try:
                alone = clients(1)[0]
                together = max(clients(parts))
            finally:
                print("mps control.log tail:", mps.log_tail(daemon_env), flush=True)
    except Exception as err:
        return {"route": "mps", "ok": False, "error": f"{type(err).__name__}: {err}"}
    flops = 2 * size**3 * reps
    return {"route": "mps", "ok": True, "alone_s": alone, "together_s": together, "overlap_ratio": together / alone,
            "tflops_one_partition": flops / alone / 1e12, "tflops_all_partitions": flops * parts / together / 1e12,
            "sms_per_partition": f"{100 // parts}% of SMs"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for parallel_sm_probe.json (default: print only)")
    parser.add_argument("--parts", type=int, default=4, help="partitions (pipeline ranks), default 4")
    parser.add_argument("--size", type=int, default=8192, help="matmul size, default 8192")
    parser.add_argument("--reps", type=int, default=12, help="matmuls per partition per timing, default 12")
    parser.add_argument("--no-mps", action="store_true", help="leave the MPS route out")
    parser.add_argument("--mps-worker", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mps_worker is not None:
        _mps_worker(args.size, args.reps, args.mps_worker)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("sm_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
            "sms": torch.cuda.get_device_properties(0).multi_processor_count,
            "driver": subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                     capture_output=True, text=True).stdout.strip(),
            "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}
    try:
        import importlib.metadata as md
        info["cuda_bindings"] = md.version("cuda-bindings")
    except Exception:
        info["cuda_bindings"] = None
    print(json.dumps(info), flush=True)
    rows = run_routes(args.parts, args.size, args.reps)
    if not args.no_mps:
        row = run_mps(args.parts, args.size, args.reps)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "parallel_sm_probe.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1) + "\n")
    print(f"{'route':18} {'alone s':>8} {'together s':>10} {'overlap':>8}  (1.0 = side by side, {args.parts} = serial)")
    for row in rows:
        if row.get("ok"):
            print(f"{row['route']:18} {row['alone_s']:8.3f} {row['together_s']:10.3f} {row['overlap_ratio']:8.2f}")
        else:
            print(f"{row['route']:18} failed: {row['error'][:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
