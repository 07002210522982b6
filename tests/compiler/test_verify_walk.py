"""The verifier's one walk ([Note: one walk] in walk.py) is a second, faster proof of
all six rules. It is pinned here to the rule functions: on valid schedules of every
family (split backward, V placement, offload, caps, forward-only) and on edited ones
(instructions and caps), it passes exactly when every rule passes, and `verify` names
the same first error as running `RULES` one by one. Rule 4's check is compared with a
direct reading of it on the same edits."""

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeschedule import Instr, Op, Schedule, ScheduleError, compile_schedule
from pipeschedule.compiler.instr import edge_side
from pipeschedule.compiler.ir import BUF_OPS, BUFFERS, COMM_OPS, COMPUTE_OPS
from pipeschedule.compiler.offload import OffloadPolicy, add_offload
from pipeschedule.compiler.families import FAMILIES
from pipeschedule.compiler.passes import forward_only

from strategies import FAMILY_NAMES, examples, graph_schedules, schedules

checks = sys.modules["pipeschedule.compiler.verify"]  # the module (`pipeschedule.compiler.verify` is also the function)
walk = sys.modules["pipeschedule.compiler.walk"]


def outcome(run):
    """None when `run` passes, else the error's (rule, rank, index, text)."""
    try:
        run()
    except ScheduleError as err:
        return err.rule, err.rank, err.index, str(err)
    return None


@st.composite
def instructions(draw, schedule):
    """Any instruction a corrupted program might hold: stages, microbatches and peers a
    little past their ranges, every op and buffer."""
    op = draw(st.sampled_from(list(Op)))
    stage = draw(st.integers(0, schedule.num_stages))
    mb = draw(st.integers(0, schedule.microbatches))
    peer = draw(st.integers(0, schedule.pp)) if op in COMM_OPS else None
    buf = draw(st.sampled_from(BUFFERS)) if op in BUF_OPS else None
    return Instr(op, stage, mb, peer, buf, draw(peer_stages(op, buf, stage, schedule)))


@st.composite
def peer_stages(draw, op, buf, stage, schedule):
    """A peer stage for an instruction of (op, buf) at `stage`, on the side its edge lies
    ([Note: peer stage]); None always on a chain schedule and where it names no edge, and
    half of the time otherwise."""
    side = edge_side(op, buf)
    if schedule.is_chain or side == 0 or draw(st.booleans()):
        return None
    if side > 0:
        return draw(st.integers(stage + 1, schedule.num_stages + 1))
    return draw(st.integers(0, stage - 1)) if stage > 0 else None


# Random edits, and edits aimed at one check each: "reorder" puts an instruction right
# before or after another of the same (stage, mb) on its rank (a W before its B, a send
# before its compute, a RELOAD before its OFFLOAD, a FREE before a use); "carry" moves
# two of them together after a third (an OFFLOAD and its RELOAD after the FREE); "twin"
# repeats an instruction right after itself (a second B while its buffers still live);
# "trade" writes one instruction over another of its class (compute, communication, or
# FREE / OFFLOAD / RELOAD), often a near one, or repeats it right after itself and drops
# another of its class, so that no count the walk keeps is off (a second send in place
# of another); "retarget" moves an instruction to a neighbouring
# stage or microbatch, "repeer" sends or receives it from another rank.
MUTATIONS = ("drop", "duplicate", "move", "swap", "replace", "insert", "retarget", "repeer",
             "reorder", "reorder", "carry", "twin", "trade", "trade")


def op_class(op):
    return 0 if op in COMPUTE_OPS else 1 if op in COMM_OPS else 2


@st.composite
def mutants(draw, graphs=False):
    """A schedule of any family (with offload half of the time, forward-only a quarter
    of the time; on a random stage graph with `graphs`) with 1 to 3 edits of its
    programs, and a cap lowered on a sixth of them (rule 6)."""
    schedule = draw(graph_schedules(max_pp=5, max_m=6, max_v=3) if graphs else schedules(max_pp=5, max_m=6, max_v=3))
    if draw(st.integers(0, 3)) == 0:
        schedule = forward_only(schedule)
    params = dict(schedule.params)
    if draw(st.integers(0, 5)) == 0:
        params["cap"] = draw(st.integers(1, 2 * schedule.virtual) | st.lists(
            st.integers(1, 2 * schedule.virtual), min_size=schedule.pp, max_size=schedule.pp))
    programs = [list(p) for p in schedule.programs]
    for _ in range(draw(st.integers(1, 3))):  # valid schedules: the next test
        rank = draw(st.integers(0, schedule.pp - 1))
        program = programs[rank]
        kind = draw(st.sampled_from(MUTATIONS))
        if kind == "insert" or not program:
            program.insert(draw(st.integers(0, len(program))), draw(instructions(schedule)))
            continue
        # an op first, then one of its instructions: an index drawn directly is most
        # often one of the first, which are F and receives
        op = draw(st.sampled_from(sorted({i.op for i in program}, key=lambda o: o.value)))
        k = draw(st.sampled_from([n for n, i in enumerate(program) if i.op is op]))
        if kind == "drop":
            program.pop(k)
        elif kind == "duplicate":
            program.insert(draw(st.integers(0, len(program))), program[k])
        elif kind == "move":
            program.insert(draw(st.integers(0, len(program) - 1)), program.pop(k))
        elif kind == "swap":
            j = draw(st.integers(0, len(program) - 1))
            program[k], program[j] = program[j], program[k]
        elif kind == "replace":
            program[k] = draw(instructions(schedule))
        elif kind == "reorder":
            i = program[k]
            same = [j for j, other in enumerate(program) if j != k and (other.stage, other.mb) == (i.stage, i.mb)]
            if same:
                j = draw(st.sampled_from(same))
                program.pop(k)
                j = j - (j > k)
                program.insert(j + draw(st.sampled_from((0, 1))), i)
        elif kind == "carry":
            i = program[k]
            same = [j for j, other in enumerate(program) if j != k and (other.stage, other.mb) == (i.stage, i.mb)]
            if len(same) >= 2:
                j, t = draw(st.lists(st.sampled_from(same), min_size=2, max_size=2, unique=True))
                moved = [program[x] for x in sorted((k, j))]
                target = program[t]
                rest = [x for n, x in enumerate(program) if n not in (k, j)]
                at = next(n for n, x in enumerate(rest) if x is target) + 1
                program[:] = rest[:at] + moved + rest[at:]
        elif kind == "twin":
            program.insert(k + 1, program[k])
        elif kind == "trade":
            i = program[k]
            others = [j for j, other in enumerate(program) if op_class(other.op) == op_class(i.op) and other != i]
            near = [j for j in others if abs(j - k) <= 3]
            if others:
                j = draw(st.sampled_from(near if near and draw(st.booleans()) else others))
                if draw(st.booleans()):
                    program[j] = i
                else:
                    program.insert(k + 1, i)
                    program.pop(j + (j > k))
        elif kind == "repeer":
            i = program[k]
            if i.peer is not None:
                program[k] = Instr(i.op, i.stage, i.mb, draw(st.integers(0, schedule.pp)), None, i.peer_stage)
        else:  # retarget: the same op on a neighbouring stage or microbatch
            i = program[k]
            stage = max(0, i.stage + draw(st.sampled_from((-1, 0, 1))))
            mb = max(0, i.mb + draw(st.sampled_from((-1, 0, 1))))
            other = i.peer_stage if i.peer_stage is None or (i.peer_stage - stage) * (i.peer_stage - i.stage) > 0 \
                else None
            program[k] = Instr(i.op, stage, mb, i.peer, i.buf, other)
    return Schedule(schedule.name, schedule.pp, schedule.virtual, schedule.microbatches, schedule.placement,
                    tuple(map(tuple, programs)), params, schedule.forward_only, schedule.edges)


def first_error(schedule):
    """The first error of the rules run in RULES' order (each may assume that the rules
    before it passed), or None."""
    def one_by_one():
        for rule in checks.RULES:
            rule(schedule)

    return outcome(one_by_one)


def agree(schedule, whole=True):
    """The walk passes exactly when every rule does; and (`whole`) verify names the error
    that RULES one by one name. Returns that error, or None."""
    walked = walk.passes(schedule)
    separate = first_error(schedule)
    if schedule.forward_only:
        assert walked is False  # left to the separate rules
    else:
        assert walked == (separate is None), separate
    if whole:
        assert outcome(lambda: checks.verify(schedule)) == separate
    return separate


@settings(max_examples=examples(500), deadline=None)
@given(mutants())
def test_the_walk_agrees_with_the_rules(schedule):
    agree(schedule)


@settings(max_examples=examples(100), deadline=None)
@given(schedules(max_pp=6, max_m=8))
def test_valid_schedules_pass_the_walk(schedule):
    assert agree(schedule) is None
    assert walk.passes(schedule) is True


@settings(max_examples=examples(400), deadline=None)
@given(mutants(graphs=True))
def test_the_walk_agrees_with_the_rules_on_stage_graphs(schedule):
    agree(schedule)


@settings(max_examples=examples(100), deadline=None)
@given(graph_schedules(max_pp=6, max_m=8))
def test_valid_schedules_on_stage_graphs_pass_the_walk(schedule):
    assert agree(schedule) is None
    assert walk.passes(schedule) is True


def single_edits(program, pp, m):
    """Every aimed edit of one program ("twin", "reorder", "trade", "repeer" above) at
    every place: deterministic, so a check the walk loses is found on every run, not by
    chance."""
    n = len(program)
    for k, i in enumerate(program):
        yield program[:k] + program[k + 1:]  # drop
        yield program[:k + 1] + [i] + program[k + 1:]  # twin
        rest = program[:k] + program[k + 1:]
        for j, other in enumerate(rest):  # reorder: right before or after one of its (stage, mb)
            if (other.stage, other.mb) == (i.stage, i.mb):
                yield rest[:j] + [i] + rest[j:]
                yield rest[:j + 1] + [i] + rest[j + 1:]
        for j in range(max(0, k - 3), min(n, k + 4)):  # trade with a near one of its class
            if j != k and op_class(program[j].op) == op_class(i.op) and program[j] != i:
                yield program[:j] + [i] + program[j + 1:]
        twin = program[:k + 1] + [i] + program[k + 1:]
        for j, other in enumerate(program):  # trade: a twin, and another of its op dropped
            if j != k and other.op is i.op and other != i:
                yield twin[:j + (j > k)] + twin[j + (j > k) + 1:]
        if i.peer is not None:  # repeer, a rank out of range included
            for peer in range(pp + 1):
                if peer != i.peer:
                    yield program[:k] + [Instr(i.op, i.stage, i.mb, peer)] + program[k + 1:]
        yield program[:k] + [Instr(i.op, i.stage, m, i.peer, i.buf)] + program[k + 1:]  # a microbatch past m


def duplicated_messages(schedule):
    """Each message of `schedule` sent and received once more after the last step of
    both ranks, its buffers freed after the copy (the sender's act_out / grad_in FREE
    moved after it, a second FREE for the receiver's buffer, which the copy brings back):
    valid in every program and every batch, so only the rules' count of messages finds
    it. Yields the edited programs."""
    programs = [tuple(p) for p in schedule.programs]
    for rank, program in enumerate(programs):
        for send in program:
            if send.op not in (Op.SEND_F, Op.SEND_B):
                continue
            sent, op, stage, got = (("act_out", Op.RECV_F, send.stage + 1, "act_in") if send.op is Op.SEND_F
                                    else ("grad_in", Op.RECV_B, send.stage - 1, "grad_out"))
            freed = Instr(Op.FREE, send.stage, send.mb, buf=sent)
            edited = list(programs)
            edited[rank] = tuple(i for i in program if i != freed) + (send, freed)
            edited[send.peer] = programs[send.peer] + (Instr(op, stage, send.mb, rank),
                                                       Instr(Op.FREE, stage, send.mb, buf=got))
            yield tuple(edited)


SMALL = [(name, 2 if FAMILIES[name].takes_virtual else None) for name in FAMILY_NAMES]


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("name,virtual", SMALL)
def test_every_single_aimed_edit_of_small_schedules(name, virtual, pp):
    base = compile_schedule(name, pp=pp, microbatches=2, virtual=virtual)
    for schedule in (base, add_offload(base, OffloadPolicy(fraction=1.0, lead=0))):
        for rank, program in enumerate(schedule.programs):
            for edited in single_edits(list(program), schedule.pp, schedule.microbatches):
                programs = list(schedule.programs)
                programs[rank] = tuple(edited)
                agree(Schedule(schedule.name, schedule.pp, schedule.virtual, schedule.microbatches,
                               schedule.placement, tuple(programs), schedule.params), whole=False)


@pytest.mark.parametrize("name,virtual", SMALL)
def test_a_message_sent_and_received_twice(name, virtual):
    base = compile_schedule(name, pp=3, microbatches=2, virtual=virtual)
    edits = list(duplicated_messages(base))
    assert edits
    for programs in edits:
        schedule = Schedule(base.name, base.pp, base.virtual, base.microbatches, base.placement, programs,
                            base.params)
        assert agree(schedule, whole=False)[0] == "dependency"  # "second SEND_F of (stage s, mb k)"


# -- rule 4 ------------------------------------------------------------------------------------


def deadlock_by_messages(schedule):
    """Rule 4 read directly: a rank posts each batch when it reaches it, every message
    posted counts down what its partner batch waits for, and a rank moves past a batch
    whose count is 0. Returns the blocked ranks and the first step of each one's batch."""
    sends, recvs, batches, rank_batches = checks._communication(schedule)
    partners = [[] for _ in batches]
    for key, (_, out) in sends.items():
        for a, b in zip(out, recvs.get(key, ((), ()))[1]):
            partners[a].append(b)
            partners[b].append(a)
    unposted, posted = list(map(len, partners)), [False] * len(batches)
    nexts, moved = [0] * schedule.pp, True
    while moved:  # sweep the ranks until none moves
        moved = False
        for rank, mine in enumerate(rank_batches):
            while nexts[rank] < len(mine):
                batch = mine[nexts[rank]]
                if not posted[batch]:
                    posted[batch] = moved = True
                    for other in partners[batch]:
                        unposted[other] -= 1
                if unposted[batch]:
                    break
                nexts[rank] += 1
                moved = True
    return {r: batches[rank_batches[r][nexts[r]]][1] for r in range(schedule.pp) if nexts[r] < len(rank_batches[r])}


def deadlock_agrees(schedule) -> bool:
    """check_deadlock blocks the ranks, at the steps, that the direct reading does;
    returns whether the schedule deadlocks."""
    blocked = deadlock_by_messages(schedule)
    found = outcome(lambda: checks.check_deadlock(schedule))
    if not blocked:
        assert found is None
        return False
    rule, rank, index, text = found
    first = min(blocked)
    assert (rule, rank, index) == ("deadlock", first, blocked[first])
    shown = ", ".join(f"rank {r} at step {blocked[r]} ({schedule.programs[r][blocked[r]]})"
                      for r in sorted(blocked)[:8])
    assert shown in text
    return True


@settings(max_examples=examples(300), deadline=None)
@given(mutants())
def test_check_deadlock_agrees_with_the_direct_reading(schedule):
    deadlock_agrees(schedule)


@pytest.mark.parametrize("name,virtual", SMALL)
def test_check_deadlock_on_every_single_aimed_edit(name, virtual):
    base = compile_schedule(name, pp=3, microbatches=3, virtual=virtual)
    deadlocks = 0
    for rank, program in enumerate(base.programs):
        for edited in single_edits(list(program), base.pp, base.microbatches):
            programs = list(base.programs)
            programs[rank] = tuple(edited)
            deadlocks += deadlock_agrees(Schedule(base.name, base.pp, base.virtual, base.microbatches, base.placement,
                                                  tuple(programs), base.params))
    assert deadlocks > 0  # the comparison met deadlocks, not only schedules that finish
