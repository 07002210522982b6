"""The replay of one rank's program with measured buffer sizes: what a simulator fed
those sizes predicts (the runtime tests hold the ledger to it; the simulator tests
hold the simulator to it). Pure Python."""

from __future__ import annotations

from pipeschedule.compiler.ir import Op


def replay_high_water(schedule, rank, sizes, resized=None) -> int:
    """Peak of the sum of live buffers when rank's program is replayed with the measured
    per-buffer sizes: what a simulator fed those sizes predicts. Buffers appear at the
    instruction that produces them ([Note: buffers]) and go at their FREE. With `resized`
    (a split backward's `ledger.resized`), a stash counts its F size from F to B and its
    W part from B to its FREE."""
    resized = resized or {}
    live = peak = 0
    last = schedule.num_stages - 1
    for i in schedule.programs[rank]:
        made = []
        if i.op is Op.F:
            made = ["stash"] + (["act_out"] if schedule.sends_forward(i.stage) else [])
            made += [("act_in", i.stage)] if i.stage == 0 else []
            if i.stage < last and not schedule.sends_forward(i.stage):
                made.append(("act_in", i.stage + 1))
        elif i.op is Op.RECV_F:
            made = ["act_in"]
        elif i.op is Op.RECV_B:
            made = ["grad_out"]
        elif i.op is Op.B:
            key = ("stash", i.stage, i.mb)
            if key in resized:
                live += resized[key] - sizes[key]
            if i.stage > 0:
                made = ["grad_in"] if schedule.sends_backward(i.stage) else [("grad_out", i.stage - 1)]
        elif i.op is Op.FREE:
            live -= resized.get((i.buf, i.stage, i.mb), sizes[i.buf, i.stage, i.mb])
        for item in made:
            buf, stage = item if isinstance(item, tuple) else (item, i.stage)
            live += sizes[buf, stage, i.mb]
        peak = max(peak, live)
    return peak
