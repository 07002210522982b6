"""Lowering: compute order -> + SEND/RECV -> + FREE.

Each pass is a pure function `Schedule -> Schedule`; `PASSES` lists them in order and
`lower` applies them. Every pass keeps the relative order of the instructions it is
given and only inserts new ones.
"""

from __future__ import annotations

from collections import defaultdict, deque

from pipeschedule.ir import COMM_OPS, Instr, Op, Schedule


def _channel_sends(schedule: Schedule):
    """For each (src, dst) rank pair, the tensors src sends in the order it sends them.

    A tensor is named by the instruction that receives it: (RECV_F, stage, mb) or
    (RECV_B, stage, mb).
    """
    channels: dict[tuple[int, int], deque] = defaultdict(deque)
    for rank, program in enumerate(schedule.programs):
        for i in program:
            if i.op is Op.F and schedule.sends_forward(i.stage):
                channels[rank, schedule.placement[i.stage + 1]].append((Op.RECV_F, i.stage + 1, i.mb))
            elif i.op is Op.B and schedule.sends_backward(i.stage):
                channels[rank, schedule.placement[i.stage - 1]].append((Op.RECV_B, i.stage - 1, i.mb))
    return channels


def add_communication(schedule: Schedule) -> Schedule:
    """Adds SEND_F after each F whose output leaves the rank, SEND_B after each B whose
    input gradient leaves it, and the matching receives before the compute that needs
    them. Input: compute only. Output: compute + communication.

    [Note: receive order] NCCL matches messages between two ranks by order alone, so a
    rank receives from a peer in exactly the order the peer sends. When a compute needs
    a tensor that the peer sends after others not yet received, those others are
    received first, in the same batch (early, never late). The sends after one compute
    and the receives before the next form one batch (as Megatron's
    send_forward_recv_backward does), which is what keeps 1F1B free of deadlock under
    rule 4.
    """
    channels = _channel_sends(schedule)
    programs = []
    for rank, program in enumerate(schedule.programs):
        received: set[tuple[Op, int, int]] = set()
        out: list[Instr] = []
        for i in program:
            need = None
            if i.op is Op.F and schedule.recvs_forward(i.stage):
                need = (Op.RECV_F, i.stage, i.mb), schedule.placement[i.stage - 1]
            elif i.op is Op.B and schedule.recvs_backward(i.stage):
                need = (Op.RECV_B, i.stage, i.mb), schedule.placement[i.stage + 1]
            if need is not None and need[0] not in received:
                tensor, src = need
                queue = channels[src, rank]
                while queue:
                    head = queue.popleft()
                    received.add(head)
                    out.append(Instr(head[0], head[1], head[2], peer=src))
                    if head == tensor:
                        break
                # If the peer never sends it, nothing is emitted: the verifier reports
                # the missing receive (rule 2) instead of this pass guessing.
            out.append(i)
            if i.op is Op.F and schedule.sends_forward(i.stage):
                out.append(Instr(Op.SEND_F, i.stage, i.mb, peer=schedule.placement[i.stage + 1]))
            elif i.op is Op.B and schedule.sends_backward(i.stage):
                out.append(Instr(Op.SEND_B, i.stage, i.mb, peer=schedule.placement[i.stage - 1]))
        programs.append(out)
    return schedule.replace_programs(programs)


def last_uses(schedule: Schedule, stage: int) -> dict[str, Op]:
    """For each buffer of a (stage, mb), the op of its last use ([Note: buffers])."""
    uses = {"act_in": Op.B, "stash": Op.W if schedule.split_backward else Op.B}
    if schedule.sends_forward(stage):
        uses["act_out"] = Op.SEND_F
    if stage + 1 < schedule.num_stages:
        uses["grad_out"] = Op.B
    if schedule.sends_backward(stage):
        uses["grad_in"] = Op.SEND_B
    return uses


def add_frees(schedule: Schedule) -> Schedule:
    """Adds one FREE per buffer right after its last use. When the last use is a
    communication instruction, the FREE goes after the whole run of communication it
    belongs to: that run is posted as one batch and completes as one, and a FREE inside
    it would split it. Input: compute + communication. Output: the full program.
    """
    split = schedule.split_backward
    programs = []
    for program in schedule.programs:
        out: list[Instr] = []
        pending: list[Instr] = []  # frees waiting for the current comm run to end
        for i in program:
            if i.op not in COMM_OPS and pending:
                out.extend(pending)
                pending = []
            out.append(i)
            if i.op is Op.B:
                frees = ["act_in"] + ([] if split else ["stash"])
                if i.stage + 1 < schedule.num_stages:
                    frees.append("grad_out")
                out.extend(Instr(Op.FREE, i.stage, i.mb, buf=b) for b in frees)
            elif i.op is Op.W:
                out.append(Instr(Op.FREE, i.stage, i.mb, buf="stash"))
            elif i.op is Op.SEND_F:
                pending.append(Instr(Op.FREE, i.stage, i.mb, buf="act_out"))
            elif i.op is Op.SEND_B:
                pending.append(Instr(Op.FREE, i.stage, i.mb, buf="grad_in"))
        out.extend(pending)
        programs.append(out)
    return schedule.replace_programs(programs)


PASSES = (add_communication, add_frees)


def lower(schedule: Schedule) -> Schedule:
    """Applies every pass of `PASSES` in order to a compute-only schedule."""
    for lowering_pass in PASSES:
        schedule = lowering_pass(schedule)
    return schedule
