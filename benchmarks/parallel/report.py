"""What the parallel benchmarks report per (engine, m), and their table and traces.

A case's rounds are dicts {"seconds", "loss", "spans": per rank or None, "ledger_peak_bytes":
per rank, and optionally "pipeline_s"}; `case_row` turns them into the measured pipeline,
bubble and peaks beside the simulator's prediction from the stage costs measured in those
rounds (benchmarks/parallel/predict.py); `compare` adds each row's ratio to our 1F1B and
to nanotron's, paired by round where both ran in one group.

[Note: what is compared] "seconds" is the whole step as the user runs it; "pipeline_s",
where given, its pipeline part alone (nanotron's trainer: from the first rank entering
`train_batch_iter` to the last leaving it, before the gradient sync, clipping and the
optimizer step, which take the same time under every engine). The simulator predicts the
pipeline part, so the error, the bubble and the ratios between engines are the pipeline's;
the whole step's median is reported beside it.
"""

from __future__ import annotations

import statistics

from benchmarks.parallel.predict import cost_model, late_split, measured_bubble, stage_costs, summary
from pipeschedule.simulate import simulate
from pipeschedule.compiler.spec import compile_spec, parse_spec

# nanotron's engines run the same orders as these of ours: their prediction is that
# order's under the costs our engine measured on the same layout.
SAME_ORDER = {"1f1b": "ps_1f1b", "afab": "ps_afab"}
REFERENCE = "ps_1f1b"
HOST_THREADS = "@threads"  # an engine name's suffix: the same schedule, a host thread per rank (gpu_partitions)


def schedule_of(name: str, pp: int, m: int):
    """The compiled schedule engine `name` runs (nanotron's own: ours in its order; a
    name ending in HOST_THREADS: the engine's own)."""
    name = name.removesuffix(HOST_THREADS)
    return compile_spec(parse_spec(SAME_ORDER.get(name, name)), pp=pp, microbatches=m)


def case_row(name: str, m: int, group: str, rounds: list[dict], schedule, link: dict,
             timed_rounds: list[dict] | None = None) -> dict:
    """One (engine, m): the measured figures and the prediction. `timed_rounds`: rounds
    whose spans give the costs (default `rounds`; for nanotron's engines, which keep no
    timeline, those of our engine of the same order)."""
    seconds = [r.get("pipeline_s", r["seconds"]) for r in rounds]  # [Note: what is compared]
    step = statistics.median(seconds)
    row = {"engine": name, "m": m, "group": group, "seconds": seconds, "median_s": step,
           "step_median_s": statistics.median(r["seconds"] for r in rounds),
           "losses": [r["loss"] for r in rounds], "ledger_peak_bytes": rounds[-1].get("ledger_peak_bytes"),
           "cuda_peak_bytes": rounds[-1].get("cuda_peak_bytes")}
    own = rounds[0]["spans"] is not None and rounds[0]["spans"][0] is not None
    timed = rounds if own else timed_rounds
    if not timed:
        return row
    costs = stage_costs([r["spans"] for r in timed], schedule.num_stages)
    cost = cost_model(costs, boundary_bytes=link["boundary_bytes"], latency_s=link["latency_s"],
                      bandwidth=link["bandwidth"])
    simulated = simulate(schedule, cost)
    row.update(stage_costs=costs, predicted=summary(simulated))
    if own:
        bubbles = [measured_bubble(r.get("pipeline_s", r["seconds"]), r["spans"]) for r in rounds]
        row["bubble_per_rank"] = [statistics.median(b[k] for b in bubbles) for k in range(schedule.pp)]
        row["bubble"] = statistics.mean(row["bubble_per_rank"])
        row["trace_spans"] = rounds[-1]["spans"]
        row["late"] = late_split(simulated, rounds[-1]["spans"])
        if rounds[0].get("host"):
            row["host"] = host_pacing(rounds)
            row["trace_host"] = rounds[-1]["host"]
        if rounds[0].get("executor"):
            row["executor_overhead_s"] = [statistics.median(r["executor"][k]["overhead_s"] for r in rounds)
                                          for k in range(schedule.pp)]
    row["error"] = step / row["predicted"]["step_s"] - 1
    return row


LAUNCH_S = 0.5e-3  # a block that starts within this of its enqueue waited for the host, not for data


def host_pacing(rounds: list[dict]) -> dict:
    """Where a step on one device waited for its host ([Note: measured timeline]): each
    round holds per rank the spans (device times from the rank's origin), "host" (the
    enqueue of each span, host times from the same origin), "offset_s" (the origin's
    host time in the step) and "enqueue_s" (when the host had enqueued the whole step).
    A span whose enqueue began after the rank's previous span had ended on the device
    (or after the step began), and that began on the device within LAUNCH_S of that
    enqueue (so its data was there: the device ran it as soon as the host gave it), left
    the rank's partition idle that long for the host: "host_wait_s" per rank, beside its
    whole idle time "idle_s". Medians over rounds; "enqueue_ms": the median host time to
    enqueue an F, B and W."""
    waits, idles, enqueue = [], [], {"F": [], "B": [], "W": []}
    for r in rounds:
        step = r.get("pipeline_s", r["seconds"])
        wait_row, idle_row = [], []
        for spans, host, offset in zip(r["spans"], r["host"], r["offset_s"]):
            waited, busy, previous = 0.0, 0.0, 0.0
            for (op, _s, _mb, start, end), (host_start, host_end) in zip(spans, host):
                if start - host_start <= LAUNCH_S:  # the device ran it as soon as it was enqueued
                    waited += min(max(offset + host_start - previous, 0.0), max(offset + start - previous, 0.0))
                busy += end - start
                previous = offset + end
                enqueue[op].append((host_end - host_start) * 1e3)
            wait_row.append(waited)
            idle_row.append(step - busy)
        waits.append(wait_row)
        idles.append(idle_row)
    ranks = range(len(waits[0]))
    return {"enqueue_s": statistics.median(r["enqueue_s"] for r in rounds),
            "host_wait_s": [statistics.median(w[k] for w in waits) for k in ranks],
            "idle_s": [statistics.median(i[k] for i in idles) for k in ranks],
            "enqueue_ms": {op: statistics.median(v) for op, v in enqueue.items() if v}}


def host_table(rows: list[dict]) -> list[str]:
    """The host's part of each row's idle time (`host_pacing`), a line per row that has it."""
    lines = ["| engine | m | step | host done enqueueing | idle per rank (ms) | of it waiting for the host (ms) | "
             "enqueue of an F / B / W (ms, median) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        host = r.get("host")
        if not host:
            continue
        ms = host["enqueue_ms"]
        lines.append(f"| `{r['engine']}` | {r['m']} | {r['median_s']:.3f} s | {host['enqueue_s']:.3f} s | "
                     + "/".join(f"{x * 1e3:.0f}" for x in host["idle_s"]) + " | "
                     + "/".join(f"{x * 1e3:.0f}" for x in host["host_wait_s"]) + " | "
                     + " / ".join(f"{ms[op]:.2f}" if op in ms else "-" for op in "FBW") + " |")
    return lines if len(lines) > 2 else []


def late_table(rows: list[dict]) -> list[str]:
    """Per row with its own timeline, where its last measured step differs from the simulated
    one (`late_split`): per rank, blocks longer (+) or shorter than simulated, and the idle
    between them longer or shorter."""
    lines = ["| engine | m | error | blocks vs simulated, ms per rank | gaps between blocks vs simulated, "
             "ms per rank |", "|---|---|---|---|---|"]
    for r in rows:
        if "late" in r:
            lines.append(f"| `{r['engine']}` | {r['m']} | {_pct(r.get('error'))} | "
                         + "/".join(f"{x * 1e3:+.0f}" for x in r["late"]["blocks_s"]) + " | "
                         + "/".join(f"{x * 1e3:+.0f}" for x in r["late"]["gaps_s"]) + " |")
    if len(lines) == 2:
        return []
    return ["Where each step differs from the simulated one (its last measured round; `predict.late_split`): "
            "longer gaps with matching blocks are waits the simulator does not have.", ""] + lines


def compare(rows: list[dict]) -> None:
    """Each row against our 1F1B and nanotron's at its m: measured and predicted ratios
    (paired by round where both ran in one group: the median of the rounds' ratios, and from
    four rounds on their quartiles) and the share of the predicted gain realised."""
    by = {(r["engine"], r["m"]): r for r in rows}
    for row in rows:
        for ref_name in (REFERENCE, "1f1b"):
            ref = by.get((ref_name, row["m"]))
            if ref is None or ref is row:
                continue
            same = ref["group"] == row["group"]
            ratios = [a / b for a, b in zip(row["seconds"], ref["seconds"])] if same else []
            measured = statistics.median(ratios) if same else row["median_s"] / ref["median_s"]
            entry = {"measured": measured, "paired": same}
            if len(ratios) >= 4:  # how far the rounds' ratios spread: the measured ratio's uncertainty
                quartiles = statistics.quantiles(ratios, n=4, method="inclusive")
                entry["quartiles"] = [quartiles[0], quartiles[2]]
            if "predicted" in row and "predicted" in ref:
                predicted = row["predicted"]["step_s"] / ref["predicted"]["step_s"]
                entry["predicted"] = predicted
                if abs(1 - predicted) >= 0.01:  # a share of a gain under 1% is noise
                    entry["realised"] = (1 - measured) / (1 - predicted)
            row["vs_" + ref_name] = entry


def losses_equal(rows: list[dict], reference: str) -> dict:
    """Per m: the reference engine's loss and the engines whose losses differ from it
    (exactly, and the largest difference)."""
    out = {}
    for m in sorted({r["m"] for r in rows}):
        ref = next((r for r in rows if r["engine"] == reference and r["m"] == m), None)
        if ref is None or ref["losses"][0] is None:
            continue
        value = ref["losses"][0]
        differ = sorted({r["engine"] for r in rows if r["m"] == m and any(x != value for x in r["losses"])})
        largest = max((abs(x - value) for r in rows if r["m"] == m for x in r["losses"] if x is not None), default=0)
        out[m] = {"reference": reference, "loss": value, "differ": differ, "largest_difference": largest}
    return out


def trace(row: dict) -> dict:
    """A Chrome / Perfetto trace of the row's last measured step: one track per rank, one
    event per F, B, W (microseconds)."""
    events = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": f"{row['engine']} m={row['m']}"}}]
    hosts = row.get("trace_host") or []
    for rank, spans in enumerate(row.get("trace_spans") or []):
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": rank, "args": {"name": f"rank {rank}"}})
        for op, stage, mb, start, end in spans:
            events.append({"name": f"{op} mb{mb} s{stage}", "cat": op, "ph": "X", "pid": 0, "tid": rank,
                           "ts": start * 1e6, "dur": (end - start) * 1e6, "args": {"stage": stage, "mb": mb}})
        if rank < len(hosts):  # the host's enqueue of each span, on a track of its own
            tid = 100 + rank
            events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": tid,
                           "args": {"name": f"rank {rank} host"}})
            for (op, stage, mb, _start, _end), (host_start, host_end) in zip(spans, hosts[rank]):
                events.append({"name": f"enqueue {op} mb{mb} s{stage}", "cat": "host", "ph": "X", "pid": 0,
                               "tid": tid, "ts": host_start * 1e6, "dur": (host_end - host_start) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _pct(x) -> str:
    return "" if x is None else f"{x:+.1%}"


def _vs(entry: dict) -> str:
    """'measured (predicted, realised)' of a `compare` entry."""
    if not entry:
        return ""
    text = f"{entry['measured']:.3f}"
    if "quartiles" in entry:
        text += " [{:.3f}-{:.3f}]".format(*entry["quartiles"])
    if "predicted" in entry:
        realised = entry.get("realised")
        text += f" ({entry['predicted']:.3f}" + ("" if realised is None else f", {realised:.0%}") + ")"
    return text + ("" if entry["paired"] else " unpaired")


def _row_line(r: dict) -> str:
    pred = r.get("predicted")
    predicted = "" if pred is None else f"{pred['step_s']:.3f} s"
    bubble = ("" if "bubble" not in r else f"{r['bubble']:.3f}") + ("" if pred is None else f" ({pred['bubble']:.3f})")
    peaks = "/".join(f"{b / 2**20:.0f}" if b else "-" for b in (r.get("ledger_peak_bytes") or []))
    whole = "" if r["step_median_s"] == r["median_s"] else f" ({r['step_median_s']:.3f} s)"
    return (f"| `{r['engine']}` | {r['m']} | {r['median_s']:.3f} s{whole} | {predicted} | {_pct(r.get('error'))} | "
            f"{bubble} | {_vs(r.get('vs_' + REFERENCE, {}))} | {_vs(r.get('vs_1f1b', {}))} | {peaks} |")


TABLE_HEAD = ["| engine | m | measured (whole step) | predicted | error | bubble measured (predicted) | vs ps_1f1b "
              "measured [quartiles of the paired rounds' ratios] (predicted, share of the predicted gain "
              "realised) | vs nanotron 1f1b | "
              "peak live MiB per rank (ledger) |",
              "|---|---|---|---|---|---|---|---|---|"]


def table(rows: list[dict]) -> list[str]:
    return TABLE_HEAD + [_row_line(r) for r in rows]


def footer(report: dict) -> list[str]:
    """Drift and loss lines."""
    lines = []
    drift = report.get("drift")
    if drift:
        change = drift["last_s"] / drift["first_s"] - 1
        lines += ["", f"Drift between the first and the last group: `{drift['engine']}` m={drift['m']} "
                      f"{drift['first_s']:.3f} s first, {drift['last_s']:.3f} s last ({change:+.1%})."]
    for m, eq in report["losses_equal"].items():
        lines.append(f"Losses at m={m}: `{eq['reference']}` {eq['loss']!r}; "
                     + ("every engine bitwise equal." if not eq["differ"] else
                        f"differ: {', '.join(eq['differ'])} (largest difference {eq['largest_difference']:.3g})."))
    return lines


def write(stem: str, summary: dict, markdown: str, out) -> None:
    """A run's results as `out/stem.json` and `.md`, and its traces under `out/stem_traces`."""
    from benchmarks.common import write_results

    write_traces(summary, out / f"{stem}_traces")
    write_results(stem, summary, markdown, out)


def not_run_lines(summary: dict) -> list[str]:
    """A line per case the run reported and did not run (out of memory, say)."""
    return [f"Not run: `{item['engine']}` m={item['m']}: {item['why']}." for item in summary.get("not_run", [])]


def write_traces(summary: dict, folder) -> list:
    """One Chrome trace per row that has spans, `folder/<engine>_m<m>.json`; the paths."""
    import json
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for row in summary["rows"]:
        if row.get("trace_spans"):
            name = row["engine"]
            for mark, by in ((":", "_"), ("=", ""), (",", "_"), ("/", "-"), ("@", "_")):
                name = name.replace(mark, by)
            paths.append(folder / f"{name}_m{row['m']}.json")
            paths[-1].write_text(json.dumps(trace(row)) + "\n")
    return paths
