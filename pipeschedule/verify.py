"""The verifier: proves a lowered schedule obeys the six rules of DESIGN.md.

`verify(schedule)` runs `RULES` in order and raises `ScheduleError` at the first
violation, naming the rule, the rank, the instruction, its program counter and the
microbatch, with the step x rank grid around it. The order of `RULES` matters only for
which rule is named when one edit breaks several: structure and coverage first (is every
instruction where it belongs, once), then data dependencies, matching, deadlock,
liveness and caps.
"""

from __future__ import annotations

from collections import defaultdict

from pipeschedule.errors import ScheduleError
from pipeschedule.ir import COMM_OPS, Instr, Op, Schedule

def grid(schedule: Schedule, rank: int, index: int, window: int = 4) -> str:
    """The steps around `index` of every rank, one column per rank, the bad cell marked."""
    lo, hi = max(0, index - window), index + window + 1
    ranks = range(max(0, rank - 3), min(schedule.pp, rank + 4))  # wide pipelines: the neighbours
    header = ["step"] + [f"rank {r}" for r in ranks]
    rows = []
    for step in range(lo, hi):
        cells = [str(step)]
        for r in ranks:
            program = schedule.programs[r]
            cell = str(program[step]) if step < len(program) else ""
            if r == rank and step == index:
                cell = f"[{cell}]"
            cells.append(cell)
        rows.append(cells + (["<-- ERROR HERE"] if step == index else []))
    widths = [max(len(row[c]) for row in [header] + rows if c < len(row)) for c in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    for row in rows:
        line = "  ".join(cell.ljust(w) for cell, w in zip(row, widths))
        lines.append(line + ("  " + row[-1] if len(row) > len(header) else ""))
    return "\n".join(line.rstrip() for line in lines)


def _fail(schedule: Schedule, rule: str, rank: int, index: int, message: str) -> ScheduleError:
    program = schedule.programs[rank]
    instr = program[index] if 0 <= index < len(program) else None
    where = f"rank {rank}, step {index}" + (f", instruction {instr}" if instr is not None else "")
    mb = instr.mb if instr is not None else None
    text = f"rule {rule}: {where}: {message}\n{grid(schedule, rank, max(index, 0))}"
    return ScheduleError(text, rule=rule, rank=rank, index=index, instr=instr, mb=mb)


# -- rule 1: coverage ------------------------------------------------------------------


def check_coverage(schedule: Schedule) -> None:
    """Every instruction names a stage of its own rank and a microbatch in range; each
    (stage, mb) has exactly one F and one B (and one W if the schedule splits the
    backward), in the order F, B, W; communication names a peer in range, not itself."""
    S, m, split = schedule.num_stages, schedule.microbatches, schedule.split_backward
    placement = schedule.placement
    for rank, program in enumerate(schedule.programs):
        seen: dict[tuple[Op, int, int], int] = {}
        for index, i in enumerate(program):
            if i.stage >= S or placement[i.stage] != rank:
                owner = f"rank {placement[i.stage]}" if i.stage < S else f"no rank (there are {S} stages)"
                raise _fail(schedule, "coverage", rank, index, f"stage {i.stage} belongs to {owner}")
            if i.mb >= m:
                raise _fail(schedule, "coverage", rank, index, f"microbatch {i.mb} is out of range 0..{m - 1}")
            if i.peer is not None and (i.peer >= schedule.pp or i.peer == rank):
                raise _fail(schedule, "coverage", rank, index, f"peer {i.peer} is not another rank in 0..{schedule.pp - 1}")
            if i.op is Op.F or i.op is Op.B or i.op is Op.W:
                key = (i.op, i.stage, i.mb)
                if key in seen:
                    raise _fail(schedule, "coverage", rank, index, f"second {i.op.value} of (stage {i.stage}, mb {i.mb}); the first is at step {seen[key]}")
                seen[key] = index
                if i.op is Op.B and (Op.F, i.stage, i.mb) not in seen:
                    raise _fail(schedule, "coverage", rank, index, f"B of (stage {i.stage}, mb {i.mb}) before its F")
                if i.op is Op.W and (Op.B, i.stage, i.mb) not in seen:
                    raise _fail(schedule, "coverage", rank, index, f"W of (stage {i.stage}, mb {i.mb}) before its B")
        ops = (Op.F, Op.B, Op.W) if split else (Op.F, Op.B)
        for stage in schedule.stages_of(rank):
            for mb in range(m):
                for op in ops:
                    if (op, stage, mb) not in seen:
                        raise _fail(schedule, "coverage", rank, len(program), f"no {op.value} for (stage {stage}, mb {mb})")


# -- rule 2: data dependencies ---------------------------------------------------------


def check_dependencies(schedule: Schedule) -> None:
    """F(s, mb) follows its RECV_F (or F(s-1, mb) on the same rank); B(s, mb) follows its
    RECV_B (or B(s+1, mb) on the same rank); each transfer exists exactly once, between
    the ranks of the two stages it connects. (That SEND_F follows its F and SEND_B its B
    is the liveness of act_out and grad_in, checked by check_liveness.)"""
    S, placement = schedule.num_stages, schedule.placement
    last = S - 1
    for rank, program in enumerate(schedule.programs):
        done: set[tuple[Op, int, int]] = set()
        for index, i in enumerate(program):
            op, s, mb = i.op, i.stage, i.mb
            if op is Op.F:
                if s > 0:
                    need = (Op.RECV_F, s, mb) if placement[s - 1] != rank else (Op.F, s - 1, mb)
                    if need not in done:
                        raise _fail(schedule, "dependency", rank, index, f"F(stage {s}, mb {mb}) runs before its input arrives: no {need[0].value} of (stage {need[1]}, mb {mb}) earlier on rank {rank}")
            elif op is Op.B:
                if s < last:
                    need = (Op.RECV_B, s, mb) if placement[s + 1] != rank else (Op.B, s + 1, mb)
                    if need not in done:
                        raise _fail(schedule, "dependency", rank, index, f"B(stage {s}, mb {mb}) runs before its output gradient arrives: no {need[0].value} of (stage {need[1]}, mb {mb}) earlier on rank {rank}")
            elif op in COMM_OPS:
                other = s + 1 if (op is Op.SEND_F or op is Op.RECV_B) else s - 1
                if not 0 <= other < S or placement[other] == rank:
                    raise _fail(schedule, "dependency", rank, index, f"{op.value} of stage {s} has no remote neighbour stage {other} to talk to")
                if i.peer != placement[other]:
                    raise _fail(schedule, "dependency", rank, index, f"peer is {i.peer}, but stage {other} runs on rank {placement[other]}")
                if (op, s, mb) in done:
                    raise _fail(schedule, "dependency", rank, index, f"second {op.value} of (stage {s}, mb {mb})")
                # A send before the compute that produces its tensor uses a buffer that
                # does not exist yet: check_liveness reports it, after check_matching has
                # had its say on the order of messages.
            done.add((op, s, mb))
        for s in schedule.stages_of(rank):
            for op, needed in ((Op.SEND_F, schedule.sends_forward(s)), (Op.SEND_B, schedule.sends_backward(s))):
                if needed:
                    for mb in range(schedule.microbatches):
                        if (op, s, mb) not in done:
                            raise _fail(schedule, "dependency", rank, len(program), f"no {op.value} of (stage {s}, mb {mb}): its consumer on another rank never gets it")


# -- rule 3: matching ------------------------------------------------------------------


def _channels(schedule: Schedule):
    """Per (src, dst): the sends in src's order and the receives in dst's order, each as
    (tensor, step), a tensor named by its receiving instruction (RECV_x, stage, mb)."""
    sends, recvs = defaultdict(list), defaultdict(list)
    for rank, program in enumerate(schedule.programs):
        for index, i in enumerate(program):
            if i.op is Op.SEND_F:
                sends[rank, i.peer].append(((Op.RECV_F, i.stage + 1, i.mb), index))
            elif i.op is Op.SEND_B:
                sends[rank, i.peer].append(((Op.RECV_B, i.stage - 1, i.mb), index))
            elif i.op is Op.RECV_F or i.op is Op.RECV_B:
                recvs[i.peer, rank].append(((i.op, i.stage, i.mb), index))
    return sends, recvs


def check_matching(schedule: Schedule) -> None:
    """For each ordered pair of ranks, the k-th send from a to b and the k-th receive on b
    from a carry the same tensor (NCCL matches by order alone)."""
    sends, recvs = _channels(schedule)
    for src, dst in sorted(set(sends) | set(recvs)):
        out, into = sends.get((src, dst), []), recvs.get((src, dst), [])
        for k, ((sent, s_index), (wanted, r_index)) in enumerate(zip(out, into)):
            if sent != wanted:
                name = lambda t: f"{'activation' if t[0] is Op.RECV_F else 'gradient'} for (stage {t[1]}, mb {t[2]})"
                raise _fail(schedule, "matching", dst, r_index, f"receive #{k} from rank {src} expects the {name(wanted)}, but rank {src}'s send #{k} (step {s_index}) carries the {name(sent)}")
        if len(out) != len(into):
            rank, index = (src, out[len(into)][1]) if len(out) > len(into) else (dst, into[len(out)][1])
            raise _fail(schedule, "matching", rank, index, f"rank {src} sends {len(out)} messages to rank {dst}, which receives {len(into)}")


# -- rule 4: deadlock ------------------------------------------------------------------


def comm_batches(schedule: Schedule):
    """Every maximal run of communication instructions as (rank, start, end), and for
    each batch the set of partner batches its operations are matched with."""
    batches: list[tuple[int, int, int]] = []
    batch_of: dict[tuple[int, int], int] = {}  # (rank, step) -> batch
    for rank, program in enumerate(schedule.programs):
        start = None
        for index in range(len(program) + 1):
            comm = index < len(program) and program[index].op in COMM_OPS
            if comm and start is None:
                start = index
            elif not comm and start is not None:
                for j in range(start, index):
                    batch_of[rank, j] = len(batches)
                batches.append((rank, start, index))
                start = None
    partners: list[set[int]] = [set() for _ in batches]
    sends, recvs = _channels(schedule)
    for key, out in sends.items():
        src, dst = key
        for (_, s_index), (_, r_index) in zip(out, recvs.get(key, [])):
            a, b = batch_of[src, s_index], batch_of[dst, r_index]
            partners[a].add(b)
            partners[b].add(a)
    return batches, batch_of, partners


def check_deadlock(schedule: Schedule) -> None:
    """Runs every program under rule 4's semantics: a batch is posted when its rank
    reaches it, and the rank moves past it once every partner batch is posted."""
    batches, batch_of, partners = comm_batches(schedule)
    posted = [False] * len(batches)
    pcs = [0] * schedule.pp
    waiting: dict[int, int] = {}  # batch -> rank blocked on it
    runnable = list(range(schedule.pp))
    while runnable:
        rank = runnable.pop()
        program, pc = schedule.programs[rank], pcs[rank]
        while pc < len(program):
            if program[pc].op not in COMM_OPS:
                pc += 1
                continue
            batch = batch_of[rank, pc]
            if not posted[batch]:
                posted[batch] = True
                for other in partners[batch]:  # wake ranks whose batch may now be complete
                    if other in waiting and all(posted[p] for p in partners[other]):
                        runnable.append(waiting.pop(other))
            if all(posted[p] for p in partners[batch]):
                pc = batches[batch][2]
            else:
                waiting[batch] = rank
                break
        pcs[rank] = pc
    blocked = [r for r in range(schedule.pp) if pcs[r] < len(schedule.programs[r])]
    if blocked:
        rank = blocked[0]
        states = ", ".join(f"rank {r} at step {pcs[r]} ({schedule.programs[r][pcs[r]]})" for r in blocked)
        raise _fail(schedule, "deadlock", rank, pcs[rank], f"the programs cannot finish: {states} wait for partners that never post")


# -- rule 5: liveness ------------------------------------------------------------------


def check_liveness(schedule: Schedule) -> None:
    """Every buffer is produced once, used only while live, and freed exactly once after
    its last use; nothing is live when the program ends ([Note: buffers] in ir.py)."""
    S, placement = schedule.num_stages, schedule.placement
    for rank, program in enumerate(schedule.programs):
        live: dict[tuple[str, int, int], int] = {}
        freed: dict[tuple[str, int, int], int] = {}

        def produce(buf, s, mb, index):
            key = (buf, s, mb)
            if key in live or key in freed:
                raise _fail(schedule, "liveness", rank, index, f"{buf} of (stage {s}, mb {mb}) produced a second time")
            live[key] = index

        def use(buf, s, mb, index):
            key = (buf, s, mb)
            if key not in live:
                state = f"freed at step {freed[key]}" if key in freed else "never produced"
                raise _fail(schedule, "liveness", rank, index, f"uses {buf} of (stage {s}, mb {mb}), which is {state}")

        for index, i in enumerate(program):
            op, s, mb = i.op, i.stage, i.mb
            if op is Op.F:
                if s == 0:
                    produce("act_in", s, mb, index)  # the data loader's input
                use("act_in", s, mb, index)
                produce("stash", s, mb, index)
                if schedule.sends_forward(s):
                    produce("act_out", s, mb, index)
                elif s + 1 < S:
                    produce("act_in", s + 1, mb, index)  # local hand-off
            elif op is Op.B:
                use("act_in", s, mb, index)
                use("stash", s, mb, index)
                if s + 1 < S:
                    use("grad_out", s, mb, index)
                if schedule.sends_backward(s):
                    produce("grad_in", s, mb, index)
                elif s > 0:
                    produce("grad_out", s - 1, mb, index)  # local hand-off
            elif op is Op.W:
                use("stash", s, mb, index)
            elif op is Op.RECV_F:
                produce("act_in", s, mb, index)
            elif op is Op.RECV_B:
                produce("grad_out", s, mb, index)
            elif op is Op.SEND_F or op is Op.SEND_B:
                buf, producer = ("act_out", "F") if op is Op.SEND_F else ("grad_in", "B")
                if (buf, s, mb) not in live and (buf, s, mb) not in freed:
                    raise _fail(schedule, "liveness", rank, index, f"{op.value} of (stage {s}, mb {mb}) runs before the {producer} that produces its {buf}")
                use(buf, s, mb, index)
            elif op is Op.FREE:
                key = (i.buf, s, mb)
                if key not in live:
                    state = f"already freed at step {freed[key]}" if key in freed else "never produced"
                    raise _fail(schedule, "liveness", rank, index, f"frees {i.buf} of (stage {s}, mb {mb}), which is {state}")
                del live[key]
                freed[key] = index
        if live:
            (buf, s, mb), index = min(live.items(), key=lambda kv: kv[1])
            raise _fail(schedule, "liveness", rank, index, f"{buf} of (stage {s}, mb {mb}) is never freed (a leak)")


# -- rule 6: caps ----------------------------------------------------------------------


def check_caps(schedule: Schedule) -> None:
    """The (stage, mb) whose F has run and whose B has not never outnumber the cap."""
    caps = schedule.caps()
    if caps is None:
        return
    for rank, program in enumerate(schedule.programs):
        inflight = 0
        for index, i in enumerate(program):
            if i.op is Op.F:
                inflight += 1
                if inflight > caps[rank]:
                    raise _fail(schedule, "cap", rank, index, f"{inflight} microbatch-stages in flight, cap is {caps[rank]}")
            elif i.op is Op.B:
                inflight -= 1


RULES = (check_coverage, check_dependencies, check_matching, check_deadlock, check_liveness, check_caps)


def verify(schedule: Schedule) -> None:
    """Raises ScheduleError at the first broken rule; returns None for a valid schedule."""
    for rule in RULES:
        rule(schedule)
