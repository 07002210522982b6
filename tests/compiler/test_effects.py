"""The table of instruction effects ([Note: instruction effects] in
pipeschedule/compiler/effects.py): what it says of the ops there are, checked against the
programs the compiler writes, and a toy op added the way the Note says an op is added
(its `Op` member, its row, one executor handler), to a copy of the package, then
verified, simulated and executed with nothing else changed."""

import difflib
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from pipeschedule import compile_schedule
from pipeschedule.compiler import effects, timing
from pipeschedule.compiler.effects import (
    BUF_OPS, COMM_OPS, COMPUTE_OPS, COPY_OPS, COVERED, EFFECTS, RECV_OPS, SEND_OPS, Op, boundary_keys, keys_of,
    last_readers, waits,
)
from pipeschedule.compiler.passes import forward_only

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "pipeschedule")
F, B, W = Op.F, Op.B, Op.W


def test_the_rows_give_the_classes_of_ops():
    assert set(EFFECTS) == set(Op)
    assert COMPUTE_OPS == {F, B, W} and COVERED == (F, B, W)
    assert SEND_OPS == {Op.SEND_F, Op.SEND_B} and RECV_OPS == {Op.RECV_F, Op.RECV_B}
    assert COMM_OPS == SEND_OPS | RECV_OPS and COPY_OPS == {Op.OFFLOAD, Op.RELOAD}
    assert BUF_OPS == {Op.FREE, Op.OFFLOAD, Op.RELOAD}
    assert [EFFECTS[op].inflight for op in (F, B, W)] == [1, -1, 0]
    assert {op: EFFECTS[op].buffer for op in COMM_OPS} == {
        Op.SEND_F: "act_out", Op.RECV_F: "act_in", Op.SEND_B: "grad_in", Op.RECV_B: "grad_out"}


def test_waits_and_last_readers_follow_from_the_buffers():
    assert {op: waits(op, COVERED) for op in COVERED} == timing._CHAIN_WAITS
    assert timing._CHAIN_FAST  # so asap takes the chain's loop, its fast path
    assert waits(B, (F, B)) == ((F, 0), (B, 1))
    assert last_readers(compile_schedule("1f1b", pp=2, microbatches=2)) == {"act_in": B, "stash": B, "grad_out": B}
    assert last_readers(compile_schedule("zb_h1", pp=2, microbatches=2))["stash"] is W
    assert last_readers(forward_only(compile_schedule("1f1b", pp=2, microbatches=2))) == {"act_in": F}


def test_keys_resolve_hand_offs_and_edges():
    # zbv at pp=2: stages 1 and 2 share rank 1 (the V's turn), stage 0 and 3 rank 0
    v = compile_schedule("zbv", pp=2, microbatches=1)
    assert keys_of(v, F, 0).makes == (("stash", 0, None), ("act_in", 0, None), ("act_out", 0, None))
    assert keys_of(v, F, 1).makes == (("stash", 1, None), ("act_in", 2, None))  # handed over on rank 1
    assert keys_of(v, B, 2).makes == (("grad_out", 1, None),)  # ... and back
    assert keys_of(v, B, 1).reads == (("act_in", 1, None), ("stash", 1, None), ("grad_out", 1, None))
    assert keys_of(v, B, 3).reads == (("act_in", 3, None), ("stash", 3, None))  # the loss is here
    assert keys_of(v, Op.SEND_F, 0, 7).reads == (("act_out", 0, 7),)  # a message: its own edge
    assert keys_of(v, Op.FREE, 2, None, "stash").frees == (("stash", 2, None),)
    graph = compile_schedule("1f1b", pp=3, microbatches=1, edges=[[0, 1], [0, 2], [1, 2]])
    assert keys_of(graph, F, 0).makes == (("stash", 0, None), ("act_in", 0, None), ("act_out", 0, None),
                                          ("act_out", 0, 2))
    assert keys_of(graph, B, 2).makes == (("grad_in", 2, 0), ("grad_in", 2, None))


@pytest.mark.parametrize("name, kwargs", [("1f1b", {}), ("zbv", {}), ("interleaved_1f1b", {"virtual": 2}),
                                          ("v_half", {}), ("1f1b", {"edges": [[0, 1], [0, 2], [1, 3], [2, 3]]})])
def test_the_table_agrees_with_the_lowered_programs(name, kwargs):
    """Every buffer is freed once ([Note: buffers]): the FREEs the lowering wrote of each
    (stage, mb) are exactly the buffers `buffer_keys` says it owns, and the buffers its
    messages carry are `boundary_keys`; the same for the evaluation form."""
    pp = 4 if "edges" in kwargs else 2
    for schedule in (compile_schedule(name, pp=pp, microbatches=3, **kwargs),):
        for s in (schedule, forward_only(schedule)):
            freed = {}
            for program in s.programs:
                for i in program:
                    if i.op is Op.FREE:
                        freed.setdefault((i.stage, i.mb), []).append((i.buf, i.peer_stage))
            for (stage, mb), keys in freed.items():
                assert sorted(keys, key=str) == sorted(s.buffer_keys(stage), key=str), (stage, mb)
            carried = {(EFFECTS[i.op].buffer, i.stage, i.peer_stage) for p in s.programs for i in p if i.op in COMM_OPS}
            assert carried == boundary_keys(s)


# -- a toy op, added as [Note: instruction effects] says ---------------------------------

TOY_ROW = '    Op.PROBE: Effects(INSTANT, "read one buffer of (stage, mb), which must be live", reads=(NAMED,)),\n'
TOY_HANDLER = '''\
    def _probe(self, i: Instr) -> None:
        """PROBE: the buffer it names, read (it must be held)."""
        self.probed = getattr(self, "probed", 0) + 1
        self.buffers.need(i.buf, i, i.peer_stage)

'''
# file -> (anchor, what goes right after it): an edit each, the whole of adding the op
PATCHES = {
    "compiler/effects.py": [
        ('    RELOAD = "RELOAD"\n', '    PROBE = "PROBE"\n'),
        ('moves_to="device"),\n', TOY_ROW),
    ],
    "runtime/executor.py": [
        ("            Op.OFFLOAD: self._offload, Op.RELOAD: self._reload,\n", "            Op.PROBE: self._probe,\n"),
        ("    # -- host offload ([Note: host offload]) ----", None),  # the handler goes right before it
    ],
}

SCRIPT = textwrap.dedent('''
    import torch
    from torch import nn
    from pipeschedule import Instr, Op, Schedule, ScheduleError, compile_schedule, verify
    from pipeschedule.compiler import walk
    from pipeschedule.compiler.verify import RULES
    from pipeschedule.runtime import InProcessPipeline, ModuleStages
    from pipeschedule.simulate import simulate

    assert "PROBE" in Op.__members__, "not the patched copy"

    def probed(schedule, where):
        """A PROBE of the stash right before each B and W (or, `where="late"`, one after
        the last FREE of a stash, which reads a freed buffer)."""
        programs = []
        for program in schedule.programs:
            out = []
            for i in program:
                if where == "early" and i.op in (Op.B, Op.W):
                    out.append(Instr(Op.PROBE, i.stage, i.mb, buf="stash"))
                out.append(i)
                if where == "late" and i.op is Op.FREE and i.buf == "stash" and not any(
                        x.op is Op.PROBE for x in out):
                    out.append(Instr(Op.PROBE, i.stage, i.mb, buf="stash"))
            programs.append(tuple(out))
        return schedule.replace_programs(programs)

    def run(schedule):
        torch.manual_seed(0)
        S = schedule.num_stages
        chunks = [nn.Sequential(nn.Linear(6, 6), nn.GELU()) for _ in range(S)]
        inputs = [torch.randn(2, 6) for _ in range(schedule.microbatches)]
        targets = [torch.randn(2, 6) for _ in range(schedule.microbatches)]
        pipe = InProcessPipeline(schedule, ModuleStages(chunks, nn.functional.mse_loss))
        outputs = pipe.step(inputs, targets)
        losses = [o["loss"] for out in outputs for o in out if isinstance(o, dict)]
        grads = [p.grad.clone() for c in chunks for p in c.parameters()]
        return losses, grads, sum(getattr(e, "probed", 0) for e in pipe.executors)

    for name, kwargs in (("1f1b", {}), ("zbv", {}), ("interleaved_1f1b", {"virtual": 2})):
        plain = compile_schedule(name, pp=2, microbatches=3, **kwargs)
        toy = probed(plain, "early")
        assert walk.passes(toy), name  # verify's fast path proves it
        for rule in RULES:  # and the six rules one by one
            rule(toy)
        verify(toy)
        assert Schedule.from_text(toy.to_text()) == toy and Schedule.from_json(toy.to_json()) == toy
        a, b = simulate(plain), simulate(toy)
        assert (a.step_time, a.peak_bytes, a.peak_inflight) == (b.step_time, b.peak_bytes, b.peak_inflight), name
        late = probed(plain, "late")
        assert not walk.passes(late)
        try:
            verify(late)
            raise AssertionError("a PROBE of a freed stash passed")
        except ScheduleError as err:
            assert err.rule == "liveness" and err.instr.op is Op.PROBE and "freed at step" in str(err), str(err)
        losses, grads, n = run(plain)
        losses_toy, grads_toy, n_toy = run(toy)
        assert n == 0 and n_toy == sum(1 for p in toy.programs for i in p if i.op is Op.PROBE) > 0
        assert all(torch.equal(x, y) for x, y in zip(losses + grads, losses_toy + grads_toy)), name
        print(name, "ok", n_toy, "probes")
''')


def patched_copy(tmp_path) -> str:
    """A copy of the package with the toy op added by `PATCHES`; returns its parent."""
    root = tmp_path / "tree"
    shutil.copytree(PACKAGE, root / "pipeschedule", ignore=shutil.ignore_patterns("__pycache__"))
    for name, edits in PATCHES.items():
        path = root / "pipeschedule" / name
        text = path.read_text()
        for anchor, after in edits:
            assert text.count(anchor) == 1, f"{name}: {anchor!r} is not there once: update the toy op's patch"
            text = text.replace(anchor, anchor + after) if after is not None else \
                text.replace(anchor, TOY_HANDLER + anchor)
        path.write_text(text)
    return str(root)


def changed_files(tree: str) -> dict[str, list[str]]:
    """Per file of the copy that differs from the package, its added lines."""
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            original = os.path.join(folder, name)
            relative = os.path.relpath(original, PACKAGE)
            with open(original) as a, open(os.path.join(tree, "pipeschedule", relative)) as b:
                old, new = a.read().splitlines(), b.read().splitlines()
            if old != new:
                out[relative] = [line[1:] for line in difflib.unified_diff(old, new, lineterm="", n=0)
                                 if line.startswith("+") and not line.startswith("+++")]
    return out


@pytest.mark.spawn
def test_a_toy_op_needs_its_row_and_a_handler_only(tmp_path):
    """PROBE reads one buffer and takes no time. Added to a copy of the package as a member
    of Op, one row and one executor handler, it is verified (the walk and the six rules),
    refused where it reads a freed buffer, simulated (nothing changes: no time, no bytes)
    and executed (losses and gradients bitwise those without it): no other file changed."""
    tree = patched_copy(tmp_path)
    changed = changed_files(tree)
    assert set(changed) == {"compiler/effects.py", "runtime/executor.py"} and len(changed) <= 4
    assert changed["compiler/effects.py"] == ['    PROBE = "PROBE"', TOY_ROW.rstrip("\n")]
    assert len(changed["runtime/executor.py"]) == 1 + len(TOY_HANDLER.splitlines())  # the dispatch entry, the handler
    env = dict(os.environ, PYTHONPATH=tree)
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                          cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count(" ok ") == 3, done.stdout
    assert effects.Op.__members__.keys() == {op.name for op in Op}  # this process's package is untouched
