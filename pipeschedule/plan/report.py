"""How a plan is shown: text tables, one JSON object, a PNG bar chart of memory per stage.

matplotlib is imported inside `plan_png` only (through `simulate.render.new_figure`), so the
rest never needs it.
"""

from __future__ import annotations

from pipeschedule.plan.memory import GiB, builds_ddp
from pipeschedule.plan.nanotron_yaml import plan_yaml


def _gib(value: float) -> str:
    return f"{value / GiB:.1f}"


def _split(split) -> str:
    return "/".join(str(n) for n in split) if split else "-"


def _title(plan, index: int, candidate) -> str:
    tag = "nanotron default" if candidate is plan.default else f"{candidate.split_kind} split"
    return f"#{index + 1} {candidate.label}, {tag} {_split(candidate.split)}"


def assumptions(config) -> list[str]:
    """The modelling assumptions a plan rests on, one line each."""
    st = config.setup
    half = {"float16": "fp16", "float32": "fp32"}.get(config.dtype_name, "bf16")  # model.dtype's short name
    if st.fp32_grad_accum:
        state = (f"{half} weights; fp32 grad accumulator for every parameter; fp32 master weights and Adam "
                 f"moments{' sharded over dp (ZeRO-1)' if st.zero_stage == 1 else ''} "
                 f"(nanotron accumulate_grad_in_fp32: true); {half} grads counted at the end of each backward")
    else:
        sharded = " sharded over dp (ZeRO-1)" if st.zero_stage == 1 else ""
        state = (f"{half} weights and grads; Adam moments in {half}{sharded} "
                 "(accumulate_grad_in_fp32: false)")
    ddp = f"; DDP {half} grad buckets (dp > 1 without ZeRO)" if builds_ddp(st) and st.ddp_buckets else ""
    lines = [
        "memory: " + state + ddp,
        (f"activations: {st.activation_formula} formula ({st.attention}), recompute {st.recompute}, sequence "
         f"parallel {'on' if st.sequence_parallel else 'off'}, async TP linears {'on' if st.tp_async else 'off'}; "
         "peaks of different kinds added"),
        (f"time: {config.gpu_tflops:g} TFLOP/s x mfu {config.mfu:g}; p2p {config.p2p_bandwidth / 1e9:g} GB/s, "
         f"{config.p2p_latency * 1e6:g} us; plus DP gradient reduction at {config.dp_bandwidth / 1e9:g} GB/s and the "
         f"optimizer step at {config.hbm_bandwidth / 1e12:g} TB/s (step s = pipeline + that tail)"),
    ]
    return lines


def plan_to_dict(plan) -> dict:
    c = plan.config
    index = {id(x): i for i, x in enumerate(plan.candidates)}
    return {
        "model": c.model.to_dict() | {"params": c.model.total_params()},
        "layout": {"pp": c.pp, "tp": c.setup.tp, "dp": c.setup.dp, "zero_stage": c.setup.zero_stage,
                   "seq": c.setup.seq, "micro_batch": c.setup.micro_batch, "microbatches": c.microbatches,
                   "recompute": c.setup.recompute, "sequence_parallel": c.setup.sequence_parallel,
                   "flash": not c.setup.scores_materialised, "fp32_grad_accum": c.setup.fp32_grad_accum,
                   "activation_formula": c.setup.activation_formula,
                   "tp_async": c.setup.tp_async, "attention": c.setup.attention},
        "gpu": {"name": c.gpu_name, "memory": c.gpu_memory, "reserve": c.reserve, "budget": c.budget,
                "tflops": c.gpu_tflops, "mfu": c.mfu},
        "assumptions": assumptions(c),
        "default": index[id(plan.default)],
        "recommended": index[id(plan.recommended)] if plan.recommended else None,
        "yaml": (plan_yaml(c, plan.recommended, nanotron_default=plan.recommended is plan.default)
                 if plan.recommended else None),
        "offload_option": (plan.candidates.index(plan.offload_option) if plan.offload_option is not None else None),
        "candidates": [x.to_dict() for x in plan.candidates],
        "zero1_default": plan.zero1_default.to_dict() if plan.zero1_default else None,
        "dropped": [{"schedule": name, "why": why} for name, why in plan.dropped],
        "stats": dict(plan.stats),
    } | ({"offload": plan.offload} if plan.offload is not None else {})


def _row(plan, i, cand) -> str:
    peak = cand.peak
    fits = "yes" if cand.fits else "no"
    where = f"{_gib(peak.total)} (r{peak.rank})" if peak else "-"
    step = f"{cand.step_time:8.2f}" if cand.step_time else "       -"
    tok = f"{cand.tokens_per_gpu:9.0f}" if cand.tokens_per_gpu else "        -"
    rel = f"{cand.relative:6.3f}" if cand.relative else "     -"
    kind = "nanotron default" if cand is plan.default else cand.split_kind
    if cand is not plan.default and cand.gap is not None:  # "best found <2.7%": no split is faster by more
        kind += f" <{cand.gap:.1%}" if cand.gap < 0.1 else f" <{cand.gap:.0%}"
    mark = "*" if cand is plan.recommended else " "
    width = max(22, 3 * max(len(x.split or ()) for x in plan.candidates))
    return (f"{mark}{i + 1:3d}  {cand.label:<{_label_width(plan)}} {kind:<16} {_split(cand.split):<{width}} "
            f"{fits:<4} {where:<13} "
            f"{step} {tok} {rel}")


def _label_width(plan) -> int:
    return max([26] + [len(x.label) for x in plan.candidates])


def memory_table(plan, index: int, candidate) -> list[str]:
    lines = [f"Memory per GPU in GiB, {_title(plan, index, candidate)}:"]
    if not candidate.memory:
        return lines + ["  " + (candidate.note or "not evaluated")]
    ranks = candidate.memory
    w = max(9, 2 + max(len(",".join(f"{s}({n})" for s, n in zip(r.stages, r.layers))) for r in ranks))
    lines.append("  " + f"{'term':<34}" + "".join(f"{'rank ' + str(r.rank):>{w}}" for r in ranks))
    lines.append("  " + f"{'stages (layers)':<34}" + "".join(
        f"{','.join(f'{s}({n})' for s, n in zip(r.stages, r.layers)):>{w}}" for r in ranks))
    lines.append("  " + f"{'in flight (peak)':<34}" + "".join(f"{r.inflight:>{w}}" for r in ranks))
    terms = []
    for r in ranks:
        for key in r.terms:
            if key not in terms:
                terms.append(key)
    for key in terms:
        lines.append("  " + f"{key:<34}" + "".join(f"{_gib(r.terms.get(key, 0)):>{w}}" for r in ranks))
    lines.append("  " + f"{'total':<34}" + "".join(f"{_gib(r.total):>{w}}" for r in ranks))
    lines.append("  " + f"{'budget':<34}" + "".join(f"{_gib(r.budget):>{w}}" for r in ranks))
    lines.append("  " + f"{'fits':<34}" + "".join(f"{'yes' if r.fits else 'NO':>{w}}" for r in ranks))
    if candidate.note:
        lines.append("  note: " + candidate.note)
    return lines


def plan_to_text(plan, tables: str = "all") -> str:
    c, m, st = plan.config, plan.config.model, plan.config.setup
    out = [
        (f"Plan for {m.name}: {m.layers} layers, hidden {m.hidden}, {m.heads} heads ({m.kv_heads} kv), ffn {m.ffn}, "
        f"vocab {m.vocab}: {m.total_params() / 1e9:.1f} B parameters"),
        (f"Layout: pp={c.pp} tp={st.tp} dp={st.dp} ZeRO-{st.zero_stage}; seq {st.seq}, micro-batch {st.micro_batch}, "
        f"{c.microbatches} microbatches per replica"),
        (f"GPU: {c.gpu_name}, {_gib(c.gpu_memory)} GiB, reserve {_gib(c.reserve)} GiB -> budget {_gib(c.budget)} GiB "
         "per GPU"),
    ]
    out += ["Assumptions:"] + ["  " + line for line in assumptions(c)]
    out.append("")
    width = max(22, 3 * max(len(x.split or ()) for x in plan.candidates))
    out.append(f"{'#':>4}  {'schedule':<{_label_width(plan)}} {'split':<16} {'layers per stage':<{width}} {'fits':<4} "
               f"{'peak GiB':<13} {'step s':>8} {'tok/s/GPU':>9} {'vs default':>6}")
    for i, cand in enumerate(plan.candidates):
        out.append(_row(plan, i, cand))
        if cand.note and not cand.memory:
            out.append(f"{'':6}{cand.note}")
    tried = plan.stats.get("virtual_tried")
    if tried is not None:
        out.append("  interleaving tried at virtual " + (", ".join(map(str, tried)) if tried else "none")
                   + f" (counts 2..{c.virtual}, --virtual)")
    for name, why in plan.dropped:
        out.append(f"  not listed: {name}: {why}")
    out += [
        "split: nanotron = nanotron's own; optimal = the least step time of all splits that fit (proven; the simulated",
        "  pipeline plus the tail after it, DP reduction, all-gather and optimizer step, which the search counts too);",
        "  nanotron=optimal = both; no better = proven unable to beat a row above (split: the best it simulated);",
        "  best found = search stopped at its node limit or the run's search budget (<x%: no split of it is faster",
        "  by more, the search's bound);",
        "  least overflow = no split fits, this one overflows least",
    ]
    out.append("")
    rec = plan.recommended
    where = f"dp={st.dp}, ZeRO-{st.zero_stage}, recompute {st.recompute}"
    if rec is None:
        out.append(f"Fastest that fits at {where}: nothing fits. Lower the in-flight activations (recompute, smaller "
                   "micro-batch), shard the optimizer (ZeRO-1 with dp > 1) or use more GPUs.")
    else:
        i = plan.candidates.index(rec)
        peak = rec.peak
        out.append(f"Fastest that fits at {where}: #{i + 1} {rec.label} with split {_split(rec.split)}: "
                   f"{rec.relative:.3f}x the simulated throughput of this plan's nanotron default, peak "
                   f"{_gib(peak.total)} of {_gib(peak.budget)} GiB (rank {peak.rank}); "
                   f"pp_engine: {rec.engine(rec is plan.default)}")
        if rec.note:
            out.append("  note: " + rec.note)
    option = plan.offload_option
    if option is not None:
        i = plan.candidates.index(option)
        out.append(f"Offload option (its host link is not trusted for a recommendation, [Note: offload advice]): "
                   f"#{i + 1} {option.label}, {option.relative:.3f}x; pp_engine: {option.engine()}")
    if plan.offload is not None:
        out += offload_lines(plan)
    z = plan.zero1_default
    if z is not None:
        peak = z.peak
        verdict = "fits" if z.fits else f"still does not fit ({_gib(peak.overflow)} GiB over)"
        out.append(f"Hint: with ZeRO-1 (optimizer.zero_stage: 1) at dp={st.dp}, nanotron's default {verdict}: "
                   f"peak {_gib(peak.total)} of {_gib(peak.budget)} GiB (rank {peak.rank}) at "
                   f"{z.tokens_per_gpu / plan.default.tokens_per_gpu:.3f}x the default's throughput.")
    if tables != "none":
        shown = plan.candidates if tables == "all" else [x for x in (plan.default, rec) if x is not None]
        seen = set()
        for cand in shown:
            if id(cand) in seen:
                continue
            seen.add(id(cand))
            out.append("")
            out += memory_table(plan, plan.candidates.index(cand), cand)
    return "\n".join(out) + "\n"


def offload_lines(plan) -> list[str]:
    """The offload section: what moving stashes to the host adds to the recommendation."""
    o = plan.offload
    how = f"chosen within a {o['budget']:.1%} step-time budget" if o["auto"] else "as given"
    which = "the recommendation" if plan.recommended is not None else "nanotron's default"
    lines = [f"Offload for {which} ({o['policy']}, {how}; host link {o['host_bandwidth'] / 1e9:g} GB/s per direction):"]
    lines.append("  stashes offloaded per rank: " + ", ".join(f"{k}/{n}" for k, n in o["offloaded"]))
    lines.append("  activations GiB per rank: " + ", ".join(
        f"{_gib(a)} -> {_gib(b)}" for a, b in zip(o["activations"], o["activations_offload"]))
        + "; on the host: " + ", ".join(_gib(h) for h in o["host_bytes"]))
    lines.append(f"  saves {_gib(o['saved_on_tightest'])} GiB on rank {o['tightest_rank']} (the tightest) "
                 "at a predicted "
                 f"slowdown of {o['slowdown']:.2%} (step {o['step_time_s']:.3f} s -> {o['step_time_offload_s']:.3f} s)")
    return lines


def plan_png(plan, path: str) -> None:
    """Stacked bars of memory per rank by term, nanotron's default beside the
    recommendation, with the budget as a line."""
    from pipeschedule.simulate.render import new_figure, save_png

    shown = [plan.default] + ([plan.recommended] if plan.recommended and plan.recommended is not plan.default else [])
    fig = new_figure(figsize=(5.5 * len(shown), 4.5))
    axes = fig.subplots(1, len(shown), sharey=True, squeeze=False)
    terms = []
    for cand in shown:
        for r in cand.memory:
            terms += [k for k in r.terms if k not in terms]
    from matplotlib import colormaps

    colors = colormaps["tab20"].colors
    for ax, cand in zip(axes[0], shown):
        index = plan.candidates.index(cand)
        bottom = [0.0] * len(cand.memory)
        for k, key in enumerate(terms):
            values = [r.terms.get(key, 0) / GiB for r in cand.memory]
            ax.bar([f"rank {r.rank}" for r in cand.memory], values, bottom=bottom, color=colors[k % len(colors)],
                   label=key)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.axhline(plan.config.budget / GiB, color="black", linestyle="--", linewidth=1, label="budget")
        ax.set_title(_title(plan, index, cand), fontsize=9)
        ax.set_ylabel("GiB per GPU")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7)
    fig.tight_layout(rect=(0, 0.18, 1, 1))
    fig.set_dpi(120)
    save_png(fig, path)


__all__ = ["assumptions", "memory_table", "plan_png", "plan_to_dict", "plan_to_text"]
