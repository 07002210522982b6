"""Cost-aware compilation ([Note: cost-aware timing] in pipeschedule/compiler/timing.py):
with a `cost`, the list-scheduled families order by it and lowering places messages by
it; every result still passes every rule, and unit costs give exactly the cost-less
schedule."""

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeschedule import compile_schedule, verify
from pipeschedule.errors import ParameterError
from pipeschedule.compiler.ir import Op
from pipeschedule.compiler.families import FAMILIES, family_virtual, generate
from pipeschedule.simulate import CostModel, simulate
from strategies import examples

ALL_FAMILIES = tuple(FAMILIES)


def virtual_of(name: str):
    return 2 if FAMILIES[name].takes_virtual else None


def low_cap(name: str) -> int:
    """The least cap a family takes: one stage-microbatch in each stage of a rank."""
    return family_virtual(name, virtual_of(name))


@st.composite
def costed_params(draw):
    name = draw(st.sampled_from(ALL_FAMILIES))
    pp = draw(st.integers(1, 6))
    m = draw(st.integers(1, 16))
    virtual = family_virtual(name, virtual_of(name))
    stages = pp * virtual
    time = st.floats(0.05, 20, allow_nan=False, allow_infinity=False)
    cost = [(draw(time), draw(time), draw(time) if FAMILIES[name].split_backward else draw(st.sampled_from((0.0, 1.0))))
            for _ in range(stages)]
    cap = None
    takes_cap = FAMILIES[name].takes_cap
    if takes_cap and draw(st.booleans()):
        low = low_cap(name)
        cap = draw(st.integers(low, low + 2 * pp)) if draw(st.booleans()) else \
            draw(st.lists(st.integers(low, low + 2 * pp), min_size=pp, max_size=pp))
    return name, pp, m, virtual, cap, cost


@settings(max_examples=examples(200))
@given(costed_params())
def test_every_cost_aware_schedule_passes_every_rule(case):
    name, pp, m, virtual, cap, cost = case
    schedule = compile_schedule(name, pp=pp, microbatches=m, virtual=virtual_of(name),
                                cap=cap, cost=cost)  # verifies all six rules
    verify(schedule)
    # and it runs to the end in the simulator under the very cost it was built for
    forward, backward, weight = zip(*cost)
    result = simulate(schedule, CostModel(forward, backward, weight, {}))
    assert result.step_time > 0


def unit(name: str, stages: int):
    return [(1, 1, 1) if FAMILIES[name].split_backward else (1, 2, 0)] * stages


COMM = {Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B}


def batches(program):
    """The program with each run of communication (posted as one batch, rule 4) as a
    sorted tuple: the order inside a batch does not change what runs."""
    out, run = [], []
    for i in program:
        if i.op in COMM:
            run.append(i)
            continue
        if run:
            out.append(tuple(sorted(run, key=str)))
            run = []
        out.append(i)
    if run:
        out.append(tuple(sorted(run, key=str)))
    return out


@pytest.mark.parametrize("name", ALL_FAMILIES)
@pytest.mark.parametrize("pp,m", [(1, 3), (2, 5), (4, 8), (4, 3), (5, 16), (8, 12)])
def test_unit_costs_give_the_cost_less_schedule(name, pp, m):
    """Unit costs (and any multiple of them) give the cost-less compute order, and the
    cost-less lowered programs instruction for instruction, except that for a split
    backward the messages inside one batch may come in another order: cost-less lowering
    dates a message by `UNIT_COST` (B = 2) while the split unit cost has B = 1."""
    virtual = virtual_of(name)
    caps = [None]
    if FAMILIES[name].takes_cap:
        caps += [max(low_cap(name), pp // 2)]
    for cap in caps:
        plain = compile_schedule(name, pp=pp, microbatches=m, virtual=virtual, cap=cap)
        compute = generate(name, pp=pp, microbatches=m, virtual=virtual, cap=cap).programs
        stages = pp * family_virtual(name, virtual)
        for cost in (unit(name, stages), [tuple(Fraction(3) * x for x in t) for t in unit(name, stages)]):
            assert generate(name, pp=pp, microbatches=m, virtual=virtual, cap=cap, cost=cost).programs == compute
            costed = compile_schedule(name, pp=pp, microbatches=m, virtual=virtual, cap=cap, cost=cost)
            if FAMILIES[name].split_backward:
                assert [batches(p) for p in costed.programs] == [batches(p) for p in plain.programs]
            else:
                assert costed.programs == plain.programs, (name, pp, m, cap, cost[0])


def test_a_cost_model_is_accepted_and_changes_the_order():
    # measured-like times: W far cheaper than B, the last stage heavy
    pp, m = 4, 8
    forward = (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0)
    backward = (1.4, 1.4, 1.4, 1.4, 1.4, 1.4, 1.4, 2.6)
    weight = (0.3,) * 8
    cost = CostModel(forward, backward, weight, {})
    plain = compile_schedule("zbv", pp=pp, microbatches=m)
    costed = compile_schedule("zbv", pp=pp, microbatches=m, cost=cost)
    assert costed.programs != plain.programs
    assert simulate(costed, cost).step_time <= simulate(plain, cost).step_time


@pytest.mark.parametrize("cost,match", [
    ([(1, 2, 0)] * 3, "3 forward times, but the schedule has 4 stages"),
    ([(1, -2, 0)] * 4, "backward time of stage 0"),
    ([(0, 0, 0)] * 4, "all 0"),
    ("fast", "CostModel or one"),
])
def test_bad_costs_are_refused(cost, match):
    with pytest.raises(ParameterError, match=match):
        generate("capped_1f1b", pp=4, microbatches=4, cost=cost)


# -- the moonshot figure (benchmarks/moonshot.py), from the H200 block times ----------------

# benchmarks/results/gpu.json, calibration_ms (ms): (forward, full backward, weight part)
LAYER = (1.653328001499176, 2.835935950279236, 0.5697280168533325)
EMBEDDING = (0.05628800019621849, 0.422447994351387, 0.422447994351387)
HEAD_LOSS = (1.7257919907569885, 2.8124799728393555, 0.7627999782562256)


FIGURE_THROUGHPUT = 1.143  # of 1F1B's: >= 0.95, the moonshot's target
FIGURE_RANK0 = 0.1572  # rank 0's peak stash, of 1F1B's: <= 0.5


def measured_cost(split, split_backward):
    """The cost benchmarks.moonshot builds for `split` (decoder layers per stage; the
    embedding on the first stage, the head and loss on the last), message costs left out."""
    from benchmarks.llama.memory import llama_footprints
    from pipeschedule.plan.memory import ModelSpec, TrainingSetup

    model = ModelSpec("benchmark-llama", layers=16, hidden=2048, heads=16, kv_heads=8, ffn=5632, vocab=32000)
    setup = TrainingSetup(tp=1, dp=1, seq=4096, micro_batch=1, sequence_parallel=False, flash=True, param_bytes=2,
                          act_bytes=2, fp32_grad_accum=False, ddp_buckets=False, activation_formula="llama",
                          optimizer="adam")
    stash = tuple(fp.stash_bytes for fp in llama_footprints(model, setup, split))
    times = []
    for s, layers in enumerate(split):
        blocks = [(LAYER, layers)] + [(EMBEDDING, 1)] * (s == 0) + [(HEAD_LOSS, 1)] * (s == len(split) - 1)
        f, full, w = (sum(block[k] * n for block, n in blocks) for k in range(3))
        times.append((f, full - w, w) if split_backward else (f, full, 0.0))
    forward, backward, weight = zip(*times)
    return times, CostModel(forward, backward, weight, {"stash": stash})


def test_moonshot_figure_zbv_resplit_beats_1f1b_at_a_fraction_of_rank0_memory():
    """pp=4, m=8: 1F1B at its best split of benchmarks.moonshot's search (4-5-4-3) against
    ZB-V with the head stage light (0-3-3-3-2-2-2-1: rank 0 runs the embedding, one layer
    and the head), both compiled with the measured cost; free messages here."""
    ref_times, ref_cost = measured_cost((4, 5, 4, 3), False)
    ref = simulate(compile_schedule("1f1b", pp=4, microbatches=8, cost=ref_times), ref_cost)
    times, cost = measured_cost((0, 3, 3, 3, 2, 2, 2, 1), True)
    zbv = simulate(compile_schedule("zbv", pp=4, microbatches=8, cost=times), cost)
    unit_ordered = simulate(compile_schedule("zbv", pp=4, microbatches=8), cost)
    assert round(ref.step_time / zbv.step_time, 4) == FIGURE_THROUGHPUT
    assert round(zbv.peak_bytes[0] / ref.peak_bytes[0], 4) == FIGURE_RANK0
    assert ref.step_time / unit_ordered.step_time < 0.9  # the unit-cost order of the same split falls short


@pytest.mark.parametrize("name", ["1f1b", "zb_h1", "zbv", "interleaved_1f1b"])
def test_only_the_ratios_of_the_times_matter_even_near_the_float_limit(name):
    """`stage_times` scales the times by a power of two (exact), so costs scaled by one
    order and place exactly as the originals, and times near the largest float do not
    overflow the sums of `asap` (they made lowering place messages that deadlock)."""
    stages = 2 * 3 if name in ("zbv", "interleaved_1f1b") else 3
    cost = [(1.0 + s, 2.5 + s / 3, 0.7 if FAMILIES[name].split_backward else 0.0) for s in range(stages)]
    virtual = 2 if name == "interleaved_1f1b" else None
    base = compile_schedule(name, pp=3, microbatches=7, virtual=virtual, cost=cost)
    for scale in (2.0 ** -40, 2.0 ** 900, 2.0 ** 1020 / 4):
        scaled = [tuple(x * scale for x in t) for t in cost]
        assert compile_schedule(name, pp=3, microbatches=7, virtual=virtual, cost=scaled).programs == base.programs


@pytest.mark.parametrize("bad", [10**400, float("inf"), float("nan"), -1])
def test_a_time_no_float_holds_is_refused(bad):
    with pytest.raises(ParameterError, match="finite number >= 0"):
        compile_schedule("1f1b", pp=2, microbatches=4, cost=[(bad, 1, 0), (1, 1, 0)])
    with pytest.raises(ParameterError, match="finite"):
        CostModel([bad, 1], [1, 1], [0, 0], {})


def test_a_simulation_whose_sums_overflow_is_refused():
    schedule = compile_schedule("1f1b", pp=2, microbatches=4)
    with pytest.raises(ParameterError, match="overflow"):
        simulate(schedule, CostModel([1e308, 1e308], [1e308, 1e308], [0, 0], {}))
