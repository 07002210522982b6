"""The executor's rules, checked in one process (in-process transport): dispatch, the
buffer table, local hand-off on a V-shaped placement, output release, the ledger's
stash accounting, metadata, outputs and error paths."""

from __future__ import annotations

import contextlib
import math
import re

import pytest
import torch
from torch import nn

from pipeschedule.checks import shown
from pipeschedule.errors import ParameterError
from pipeschedule.compiler.families import generate
from pipeschedule.compiler.ir import Instr, Op, Schedule
from pipeschedule.compiler.passes import lower
from pipeschedule.runtime import (
    Executor, InProcessPipeline, InProcessTransport, InProcessWorld, ModuleStages, RemoteOutput, RuntimeScheduleError,
    ScheduleMismatchError, TensorMeta,
    run_in_process,
)

from replay import replay_high_water
from runtime_helpers import BATCH, grads, loss_fn, make_chunks, make_data, reference, width


def _pipeline(schedule, chunks=None, **kwargs):
    chunks = chunks or make_chunks(schedule.num_stages)
    return InProcessPipeline(schedule, ModuleStages(chunks, loss_fn), **kwargs), chunks


def _edit(schedule, rank, drop=None, add=()):
    """rank's program without the first instruction whose text is `drop`, plus `add`."""
    program = [i for i in schedule.programs[rank]]
    if drop is not None:
        program.remove(Instr.parse(drop))
    programs = list(schedule.programs)
    programs[rank] = program + list(add)
    return schedule.replace_programs(programs)


def v_shape(m: int) -> Schedule:
    """pp=2, 4 stages placed 0,1,1,0: stages 1 and 2 share rank 1 (local hand-off), as
    do 3 and 0 across the turn. All forwards of a stage, then all backwards."""
    def order(first, second):
        return [Instr(op, s, mb) for op, stages in ((Op.F, (first, second)), (Op.B, (second, first)))
                for s in stages for mb in range(m)]
    return lower(Schedule("v_shape", 2, 2, m, (0, 1, 1, 0), (tuple(order(0, 3)), tuple(order(1, 2)))))


def test_v_shape_local_hand_off_is_exact():
    schedule = v_shape(3)
    assert not schedule.sends_forward(1) and not schedule.sends_backward(2)
    inputs, targets = make_data(4, 3)
    pipeline, chunks = _pipeline(schedule)
    outputs = pipeline.step(inputs, targets)
    expected_chunks = make_chunks(4)
    expected = reference(expected_chunks, inputs, targets)
    assert [o["loss"] for o in outputs[0]] == expected  # rank 0 runs the last stage
    assert outputs[1] == [RemoteOutput(0)] * 3
    ours, theirs = grads(chunks, range(4)), grads(expected_chunks, range(4))
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    for rank, executor in enumerate(pipeline.executors):
        assert len(executor.buffers) == 0 and executor.ledger.live_total == 0
        assert replay_high_water(schedule, rank, executor.ledger.sizes) == executor.ledger.high_total
        assert [pc for pc, _, _ in executor.ledger.trace] == list(range(len(schedule.programs[rank])))


def test_unknown_op_raises():
    schedule = lower(generate("1f1b", pp=1, microbatches=1))
    pipeline = _pipeline(schedule)[0]
    del pipeline.executors[0]._dispatch[Op.B]  # an op the table does not know
    with pytest.raises(RuntimeScheduleError, match=r"no handler for op B \(0B0\)"):
        pipeline.step(*make_data(1, 1))


def test_w_after_its_stash_was_freed_raises():
    schedule = lower(generate("1f1b", pp=1, microbatches=1))
    schedule = _edit(schedule, 0, add=[Instr(Op.W, 0, 0)])  # after B's FREE of the stash
    with pytest.raises(RuntimeScheduleError, match=r"0W0 needs stash of \(stage 0, mb 0\), which is not held"):
        _pipeline(schedule)[0].step(*make_data(1, 1))


def test_free_of_a_missing_buffer_and_a_leftover_buffer_raise():
    schedule = lower(generate("1f1b", pp=2, microbatches=2))
    twice = _edit(schedule, 1, add=[Instr(Op.FREE, 1, 0, buf="stash")])
    with pytest.raises(RuntimeScheduleError, match=r"FREE of stash of \(stage 1, mb 0\), which is not held"):
        _pipeline(twice)[0].step(*make_data(2, 2))
    kept = _edit(schedule, 0, drop="0FREE1:stash")
    with pytest.raises(RuntimeScheduleError,
                       match=r"buffers still held at the end of the step \(never freed\): stash\(0, 1\)"):
        _pipeline(kept)[0].step(*make_data(2, 2))


def test_a_failed_executor_refuses_further_steps():
    schedule = _edit(lower(generate("1f1b", pp=1, microbatches=1)), 0, add=[Instr(Op.W, 0, 0)])
    pipeline, _ = _pipeline(schedule)
    with pytest.raises(RuntimeScheduleError):
        pipeline.step(*make_data(1, 1))
    with pytest.raises(RuntimeScheduleError, match="stopped with an error in an earlier step"):
        pipeline.step(*make_data(1, 1))


def test_in_process_deadlock_is_reported_at_once():
    schedule = _edit(lower(generate("1f1b", pp=2, microbatches=2)), 0, drop="0SEND_F1@1")
    with pytest.raises(RuntimeScheduleError, match="every unfinished rank waits") as caught:
        _pipeline(schedule)[0].step(*make_data(2, 2))
    assert "rank 0, step 0" in str(caught.value) and "rank 1, step 0" in str(caught.value)


def test_sent_outputs_are_released_but_backward_still_runs():
    schedule = lower(generate("1f1b", pp=2, microbatches=3))
    outputs = []

    class Recording(ModuleStages):
        def forward(self, stage, mb, act_in, target):
            out = super().forward(stage, mb, act_in, target)
            if stage == 0:
                outputs.append(out)
            return out

    chunks = make_chunks(2)
    pipeline = InProcessPipeline(schedule, Recording(chunks, loss_fn))
    inputs, targets = make_data(2, 3)
    pipeline.step(inputs, targets)
    assert [o.numel() for o in outputs] == [0, 0, 0]  # storage gone at FREE act_out
    assert all(o.grad_fn is not None for o in outputs)
    expected = make_chunks(2)
    reference(expected, inputs, targets)
    assert all(torch.equal(a, b) for a, b in zip(grads(chunks, [0, 1]).values(), grads(expected, [0, 1]).values()))


def test_an_output_that_autograd_saves_survives_its_release():
    # Sigmoid saves its output for backward; stage 0's output is emptied at FREE act_out,
    # which must not reach what autograd saved. The ledger counts that storage in stash too.
    def chunks():
        torch.manual_seed(0)
        return [nn.Sequential(nn.Linear(4, 4), nn.Sigmoid()), nn.Sequential(nn.Linear(4, 4), nn.Tanh())]

    schedule = lower(generate("1f1b", pp=2, microbatches=3))
    ours, expected = chunks(), chunks()
    pipeline, _ = _pipeline(schedule, ours)
    inputs, targets = [torch.randn(2, 4) for _ in range(3)], [torch.randn(2, 4) for _ in range(3)]
    pipeline.step(inputs, targets)
    reference(expected, inputs, targets)
    assert all(torch.equal(a, b) for a, b in zip(grads(ours, [0, 1]).values(), grads(expected, [0, 1]).values()))
    assert pipeline.executors[0].ledger.sizes["stash", 0, 0] == 2 * 4 * 4


def test_identity_first_stage_keeps_the_callers_input_and_sends_zero_gradients():
    # Stage 0 returns its input (no parameters, no grad): its output must not be emptied,
    # and stage 1 still sends a gradient (zeros) because the schedule has SEND_B.
    schedule = lower(generate("1f1b", pp=2, microbatches=2))
    chunks = [nn.Identity(), make_chunks(2)[1]]
    chunks[1][0] = nn.Linear(width(0), width(1) + 4)
    pipeline, _ = _pipeline(schedule, chunks)
    inputs, _ = make_data(2, 2)
    kept = [x.clone() for x in inputs]
    pipeline.step(inputs, [torch.zeros(BATCH, width(2))] * 2)
    assert all(torch.equal(a, b) for a, b in zip(inputs, kept))
    assert all(p.grad is not None for p in chunks[1].parameters())


def test_stash_leaves_out_parameters_act_in_and_target_but_counts_saved_outputs():
    schedule = lower(generate("1f1b", pp=2, microbatches=1))
    chunks = [nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Sigmoid())]
    pipeline, _ = _pipeline(schedule, chunks)
    pipeline.step([torch.randn(2, 4)], [torch.randn(2, 4)])
    # Linear saves its input (act_in) and weight (a parameter): nothing of its own.
    assert pipeline.executors[0].ledger.sizes["stash", 0, 0] == 0
    # Stage 1: sigmoid saves its output, and mse_loss saves the same tensor as its input:
    # one storage of 2*4 floats. The Linear saves only act_in and its weight; the target
    # is the caller's.
    assert pipeline.executors[1].ledger.sizes["stash", 1, 0] == 2 * 4 * 4
    assert pipeline.executors[0].ledger.sizes["act_out", 0, 0] == 2 * 4 * 4


def test_shapes_given_up_front_publish_nothing_and_change_nothing():
    schedule = lower(generate("interleaved_1f1b", pp=2, microbatches=3, virtual=2))
    inputs, targets = make_data(4, 3)
    shapes = {s: TensorMeta((BATCH, width(s + 1)), torch.float32) for s in range(3)}
    given, chunks_given = _pipeline(schedule, shapes=shapes)
    learned, chunks_learned = _pipeline(schedule)
    assert given.step(inputs, targets) == learned.step(inputs, targets)
    assert not _shape_keys(given)
    assert len(_shape_keys(learned)) == 3
    a, b = grads(chunks_given, range(4)), grads(chunks_learned, range(4))
    assert all(torch.equal(a[k], b[k]) for k in a)


def _shape_keys(pipeline) -> list[str]:
    """The shapes published in the pipeline's world (every rank also publishes its
    schedule at its first step: [Note: schedule agreement])."""
    return [key for key in pipeline.executors[0].transport.world.metadata if "/meta/" in key]


def test_in_process_mismatch_names_both_shapes():
    schedule = lower(generate("1f1b", pp=2, microbatches=1))
    world = InProcessWorld(2)
    stages = ModuleStages(make_chunks(2), loss_fn)
    executors = [
        Executor(schedule, 0, stages, world.transport(0), shapes={0: TensorMeta((BATCH, width(1)), torch.float32)}),
        Executor(schedule, 1, stages, world.transport(1), shapes={0: TensorMeta((BATCH, 5), torch.float32)}),
    ]
    # compared at the first step, before any message ([Note: schedule agreement]); it used to surface only at the
    # delivery in one process, and over gloo not at all (a smaller message landed in a larger buffer)
    with pytest.raises(ScheduleMismatchError,
                       match=r'(?s)rank 1, .*boundary shapes given '
                             r'\(shapes= \{"0": "float32\|3,5\|1"\} vs \{"0": "float32\|3,12\|1"\}'):
        run_in_process(executors, *make_data(2, 1))


def test_losses_are_scaled_by_one_over_m_and_detached():
    schedule = lower(generate("afab", pp=1, microbatches=4))
    chunks = make_chunks(1)
    inputs, targets = make_data(1, 4)
    (outputs,) = _pipeline(schedule, chunks)[0].step(inputs, targets)
    for mb, output in enumerate(outputs):
        assert not output["loss"].requires_grad
        assert torch.equal(output["loss"], loss_fn(make_chunks(1)[0](inputs[mb]), targets[mb]).detach() / 4)


def test_step_checks_its_inputs():
    schedule = lower(generate("1f1b", pp=1, microbatches=2))
    pipeline, _ = _pipeline(schedule)
    with pytest.raises(RuntimeScheduleError, match="1 inputs given for 2 microbatches"):
        pipeline.step([torch.zeros(BATCH, width(0))], None)
    with pytest.raises(RuntimeScheduleError, match="runs stage 0 and needs inputs"):
        _pipeline(schedule)[0].step(None, None)


def test_a_rank_outside_the_schedule_is_refused():
    schedule = lower(generate("1f1b", pp=2, microbatches=2))
    world = InProcessWorld(2)
    for rank in (2, -1, 1.0, "1", True):
        with pytest.raises(ParameterError, match=rf"rank {re.escape(shown(rank))} is not a rank of '1f1b' "
                                                 r"\(pp=2: ranks 0..1, an int\)"):
            Executor(schedule, rank, ModuleStages(make_chunks(2), loss_fn), world.transport(0))


def test_the_executor_refuses_what_it_cannot_run():
    """A compute order (not lowered), a watchdog timeout that is no number of seconds > 0, a
    negative history, ModuleStages with too few chunks: each named at construction, not
    deep inside a step."""
    order = generate("1f1b", pp=2, microbatches=2)
    world = InProcessWorld(2)
    stages = ModuleStages(make_chunks(2), loss_fn)
    with pytest.raises(ParameterError, match="is a compute order .* lower it first"):
        Executor(order, 0, stages, world.transport(0))
    schedule = lower(order)
    for timeout in (None, 0, -1, float("nan"), "30"):
        expected = rf"timeout must be a number of seconds > 0 .* got {re.escape(shown(timeout))}"
        with pytest.raises(ParameterError, match=expected):
            Executor(schedule, 0, stages, world.transport(0), timeout=timeout)
    executor = Executor(schedule, 0, stages, world.transport(0), timeout=math.inf)  # no watchdog: accepted
    with pytest.raises(ParameterError, match="timeout must be"):
        executor.step(make_data(2, 2)[0], timeout=float("nan"))
    with pytest.raises(ParameterError, match="history must be an integer >= 0, got -1"):
        Executor(schedule, 0, stages, world.transport(0), history=-1)
    with pytest.raises(ParameterError, match="ModuleStages has 1 chunks for the 2 stages"):  # stage 0 took the loss
        Executor(schedule, 0, ModuleStages(make_chunks(1), loss_fn), world.transport(0))


def test_a_loss_without_a_graph_is_refused():
    """plain PyTorch refuses `loss.backward()` here; the executor used to skip the backward and leave every
    gradient 0"""
    schedule = lower(generate("1f1b", pp=2, microbatches=2))
    chunks = make_chunks(2)
    pipeline = InProcessPipeline(schedule, ModuleStages(chunks, lambda out, target: loss_fn(out, target).detach()))
    with pytest.raises(RuntimeScheduleError, match="loss that does not require grad"):
        pipeline.step(*make_data(2, 2))


class _StoreGone(InProcessTransport):
    """A transport whose abort signal cannot be read or written: the store's server exited."""

    def aborted(self):
        raise RuntimeError("Connection reset by peer")

    def abort(self, message):
        raise RuntimeError("Connection reset by peer")


def test_a_store_that_went_away_is_named_where_the_rank_waits():
    """It used to escape as the store's own error, from inside the watchdog and from the
    failure handler, with no rank, instruction or batch."""
    schedule = lower(generate("1f1b", pp=2, microbatches=2))
    world = InProcessWorld(2)
    executor = Executor(schedule, 0, ModuleStages(make_chunks(2), loss_fn), _StoreGone(world, 0), timeout=5)
    with pytest.raises(RuntimeScheduleError, match=r"rank 0, step 0, pc 0 \(comparing schedules.*cannot reach the "
                                                   r"store .*RuntimeError: Connection reset by peer"):
        executor.step(make_data(2, 2)[0])


def _broken_loss(out, target):
    raise IndexError("the model's own bug")


def test_a_stage_error_names_the_model_code_that_raised():
    """A launcher prints the error in one line; the model's file and line used to be lost
    (nanotron's own engine printed the whole traceback)."""
    schedule = lower(generate("1f1b", pp=2, microbatches=2))
    pipeline = InProcessPipeline(schedule, ModuleStages(make_chunks(2), _broken_loss))
    expected = r"IndexError: the model's own bug \(raised at .*test_runtime_unit\.py:\d+ in _broken_loss\)"
    with pytest.raises(RuntimeScheduleError, match=expected):
        pipeline.step(*make_data(2, 2))


def test_around_gradients_wraps_every_b_and_w_and_nothing_else():
    """[Note: executor hooks]: every B and W of the program, in program order, runs inside
    the caller's context, and every parameter gradient is computed inside one of them."""
    schedule = lower(generate("zb_h1", pp=2, microbatches=2))  # split backward: B and W
    entered: list[list[Instr]] = [[], []]
    inside: list[Instr | None] = [None]
    grads_at: list[Instr | None] = []  # for each parameter gradient computed, the B or W around it

    def around(rank):
        @contextlib.contextmanager
        def context(instr):
            entered[rank].append(instr)
            inside[0] = instr
            try:
                yield
            finally:
                inside[0] = None
        return context

    chunks = make_chunks(2)
    for chunk in chunks:
        for p in chunk.parameters():
            p.register_hook(lambda g: grads_at.append(inside[0]))
    world = InProcessWorld(2)
    executors = [Executor(schedule, r, ModuleStages(chunks, loss_fn), world.transport(r), around_gradients=around(r))
                 for r in range(2)]
    run_in_process(executors, *make_data(2, 2))
    for rank in range(2):
        expected = [i for i in schedule.programs[rank] if i.op in (Op.B, Op.W)]
        assert entered[rank] == expected and {i.op for i in expected} == {Op.B, Op.W}
    assert grads_at and None not in grads_at  # every weight gradient computed inside a B or W
    executors[0].around_gradients = None  # set between steps: the next step runs without it
    executors[1].around_gradients = None
    entered[0].clear()
    run_in_process(executors, *make_data(2, 2))
    assert entered[0] == []


def test_side_inputs_join_the_stash_signature():
    """[Note: executor hooks]: an F whose side input has a new shape is measured afresh;
    without side inputs, microbatches of one shape are measured once per stage."""
    schedule = lower(generate("1f1b", pp=2, microbatches=3))
    plain, _ = _pipeline(schedule)
    plain.step(*make_data(2, 3))
    assert [e.times.measured for e in plain.executors] == [1, 1]
    sides = {mb: torch.zeros(mb + 1) for mb in range(3)}  # one shape per microbatch
    seen = []
    side, _ = _pipeline(schedule, side_inputs=lambda i: seen.append(i) or sides[i.mb])
    side.step(*make_data(2, 3))
    assert [e.times.measured for e in side.executors] == [3, 3]
    assert sorted((i.stage, i.mb) for i in seen) == [(s, mb) for s in range(2) for mb in range(3)]


def test_hooks_that_are_not_functions_are_refused():
    schedule = lower(generate("1f1b", pp=2, microbatches=1))
    world = InProcessWorld(2)
    for name in ("around_gradients", "side_inputs"):
        with pytest.raises(ParameterError, match=f"{name}=3: give a function of the instruction, or None"):
            Executor(schedule, 0, ModuleStages(make_chunks(2), loss_fn), world.transport(0), **{name: 3})
