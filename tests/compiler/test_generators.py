import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeschedule import ParameterError, compile_schedule, generate
from pipeschedule.compiler.families import FAMILIES
from pipeschedule.compiler.generators.one_f_one_b import default_cap, effective_caps
from strategies import examples


def order(schedule, rank):
    return " ".join(str(i) for i in schedule.programs[rank])


def test_golden_1f1b_pp4_m6():
    s = generate("1f1b", pp=4, microbatches=6)
    assert order(s, 0) == "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5"
    assert order(s, 1) == "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1B4 1B5"
    assert order(s, 2) == "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2B5"
    assert order(s, 3) == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5"


def test_golden_afab_and_capped():
    s = generate("afab", pp=2, microbatches=3)
    assert order(s, 1) == "1F0 1F1 1F2 1B0 1B1 1B2"
    s = generate("capped_1f1b", pp=4, microbatches=6, cap=2)
    assert s.params == {"cap": [2, 2, 2, 1]}
    assert order(s, 0) == "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0F4 0B3 0F5 0B4 0B5"
    assert order(s, 3) == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5"


def test_golden_interleaved_lowered_pp2_v2_m4():
    s = compile_schedule("interleaved_1f1b", pp=2, microbatches=4, virtual=2)
    assert s.placement == (0, 1, 0, 1)
    compute = [str(i) for i in s.programs[0] if i.op.value in "FBW"]
    # Megatron's order: warmup 2(pp-1) + (v-1)pp = 4 forwards, then pairs, then backwards.
    assert compute == "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3".split()


@settings(max_examples=examples(60))
@given(st.integers(1, 16), st.integers(1, 64))
def test_cap_pp_is_1f1b_instruction_for_instruction(pp, m):
    plain = compile_schedule("1f1b", pp=pp, microbatches=m)
    for cap in (pp, pp + 3, [pp] * pp):
        capped = compile_schedule("capped_1f1b", pp=pp, microbatches=m, cap=cap)
        assert capped.programs == plain.programs


@given(st.integers(1, 16), st.integers(1, 64), st.data())
def test_caps_are_clipped_to_pp_minus_r_and_never_grow(pp, m, data):
    cap = data.draw(st.lists(st.integers(1, 2 * pp), min_size=pp, max_size=pp))
    caps = effective_caps(cap, pp, m)
    for r in range(pp):
        assert caps[r] <= min(cap[r], pp - r, m)
        assert r == 0 or caps[r] <= caps[r - 1]
    assert caps[0] == min(cap[0], pp, m)


def test_default_cap_is_half_of_pp():
    assert [default_cap(p) for p in (1, 2, 3, 4, 8)] == [1, 1, 2, 2, 4]
    assert generate("capped_1f1b", pp=4, microbatches=8).params == {"cap": [2, 2, 2, 1]}


@settings(max_examples=examples(40))
@given(st.integers(1, 8), st.integers(1, 40), st.integers(1, 4))
def test_interleaved_accepts_every_microbatch_count(pp, m, v):
    s = compile_schedule("interleaved_1f1b", pp=pp, microbatches=m, virtual=v)
    assert s.num_stages == pp * v and s.placement == tuple(x % pp for x in range(pp * v))


def test_interleaved_v1_is_1f1b():
    for pp, m in ((4, 8), (3, 5), (1, 1)):
        assert compile_schedule("interleaved_1f1b", pp=pp, microbatches=m, virtual=1).programs == \
            compile_schedule("1f1b", pp=pp, microbatches=m).programs


def test_interleaved_takes_the_faster_grouping_and_a_cap_the_leaner():
    """[Note: interleaved groups]: m=6 at pp=4 runs PyTorch's one round of 6 (22.5, as
    PyTorch's Interleaved1F1B), holding [12, 11, 9, 7]; a cap at the leaner grouping's peak
    selects it (groups of 4 and 2: 27.5 with [11, 9, 7, 5]); groups of pp where m is a
    multiple of pp."""
    from pipeschedule.simulate import simulate

    def figures(**kw):
        result = simulate(compile_schedule("interleaved_1f1b", pp=4, microbatches=6, virtual=2, **kw))
        return result.step_time, result.peak_inflight

    assert figures() == figures(cap=12) == (22.5, (12, 11, 9, 7))
    assert figures(cap=11) == figures(cap=[11, 9, 7, 5]) == (27.5, (11, 9, 7, 5))
    for pp, m in ((4, 8), (3, 9), (8, 16)):
        assert simulate(compile_schedule("interleaved_1f1b", pp=pp, microbatches=m, virtual=2)).peak_inflight == \
            tuple(2 * (pp - r - 1) + pp + 1 for r in range(pp))


def test_capped_interleaved_keeps_its_cap():
    s = generate("interleaved_1f1b", pp=4, microbatches=8, virtual=2, cap=4)
    assert s.name == "capped_interleaved_1f1b" and s.params["cap"] == [4, 4, 4, 4]
    with pytest.raises(ParameterError, match="cap 1 is below virtual=2"):
        generate("interleaved_1f1b", pp=4, microbatches=8, virtual=2, cap=1)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(name="1f1b", pp=0, microbatches=4), "pp must be an integer >= 1, got 0"),
        (dict(name="1f1b", pp=4, microbatches=0), "microbatches must be an integer >= 1, got 0"),
        (dict(name="1f1b", pp=4, microbatches=-3), "microbatches must be an integer >= 1, got -3"),
        (dict(name="capped_1f1b", pp=4, microbatches=4, cap=0), "cap must be an integer >= 1, got 0"),
        (dict(name="capped_1f1b", pp=4, microbatches=4, cap=[1, 2]), "cap list has 2 entries, but pp = 4"),
        (dict(name="capped_1f1b", pp=2, microbatches=4, cap=[1, 0]), "cap[1] must be an integer >= 1, got 0"),
        (dict(name="zigzag", pp=4, microbatches=4), "unknown schedule 'zigzag'; accepted: afab, 1f1b"),
        (dict(name="interleaved_1f1b", pp=4, microbatches=4, virtual=0), "virtual must be an integer >= 1, got 0"),
        (dict(name="1f1b", pp=4, microbatches=4, virtual=2), "1f1b takes no virtual stages (got virtual=2)"),
        (dict(name="afab", pp=4, microbatches=4, cap=2), "afab takes no cap (got cap=2)"),
        (dict(name="1f1b", pp=2.5, microbatches=4), "pp must be an integer >= 1, got 2.5"),
    ],
)
def test_bad_parameters_name_the_value(kwargs, fragment):
    name = kwargs.pop("name")
    with pytest.raises(ParameterError) as info:
        generate(name, **kwargs)
    assert fragment in str(info.value)


# -- asap: the timing generators and lowering rely on ----------------------------------

def reference_asap(programs, durations, last):
    """asap written the plain way: sweep every rank until none moves."""
    from pipeschedule.compiler.ir import Op
    ends, starts = {}, [[None] * len(p) for p in programs]
    pcs, free = [0] * len(programs), [0] * len(programs)
    moved = True
    while moved:
        moved = False
        for r, program in enumerate(programs):
            while pcs[r] < len(program):
                i = program[pcs[r]]
                needs = {Op.F: [(Op.F, i.stage - 1)] if i.stage else [],
                         Op.B: [(Op.F, i.stage)] + ([(Op.B, i.stage + 1)] if i.stage < last else []),
                         Op.W: [(Op.B, i.stage)]}[i.op]
                if any((op, s, i.mb) not in ends for op, s in needs):
                    break
                start = max([free[r]] + [ends[op, s, i.mb] for op, s in needs])
                starts[r][pcs[r]] = start
                free[r] = ends[i.op, i.stage, i.mb] = start + durations[i.op]
                pcs[r] += 1
                moved = True
    return starts, [r for r, p in enumerate(programs) if pcs[r] < len(p)]


@settings(max_examples=examples(60), deadline=None)
@given(st.sampled_from(sorted(FAMILIES)),
       st.integers(1, 5), st.integers(1, 6), st.randoms(use_true_random=False), st.booleans())
def test_asap_equals_the_plain_sweep(name, pp, m, rng, shuffle):
    """On every family's order, and on shuffled orders (which may block: then the same
    ranks are reported stuck, with the same partial starts)."""
    from pipeschedule.compiler.timing import asap, unit_cost
    schedule = generate(name, pp=pp, microbatches=m)
    programs = [list(p) for p in schedule.programs]
    if shuffle:
        for program in programs:
            rng.shuffle(program)
    got = asap(schedule.num_stages, programs)
    assert got == reference_asap(programs, unit_cost(programs), schedule.num_stages - 1)
    assert shuffle or got[1] == []


def test_asap_is_linear_in_pp():
    """1F1B's backward wave climbs one rank per sweep: sweeping all ranks until none
    moves took pp sweeps of pp ranks (1.5 s at pp=2000, minutes at pp=100000)."""
    import time
    from pipeschedule.compiler.gcpause import gc_paused
    from pipeschedule.compiler.timing import asap

    @gc_paused  # as lowering runs it: the collector's passes over a growing heap are not asap's
    def seconds(pp):
        schedule = generate("1f1b", pp=pp, microbatches=1)
        t0 = time.process_time()
        starts, stuck = asap(schedule.num_stages, schedule.programs)
        assert not stuck and starts[0][-1] == 3 * pp - 2  # F down (pp), B back up (2 each)
        return time.process_time() - t0

    small, large = min(seconds(400) for _ in range(3)), seconds(8000)  # 8000: within MAX_STAGES
    assert large < 2.0 and large < 100 * max(small, 1e-3)  # 20x the ranks: linear ~20x, quadratic ~400x


@pytest.mark.parametrize("pp", range(1, 9))
def test_megatron_regime_never_blocks(pp):
    """[Note: Megatron's regime]: the interleaved generator skips asap there, so the
    order must be free of cycles without its warmups raised."""
    from pipeschedule.compiler.generators import interleaved
    from pipeschedule.compiler.generators.common import compute_templates, interleave_1f1b
    from pipeschedule.compiler.timing import asap
    for virtual in range(1, 5):
        for microbatches in range(pp, 4 * pp + 1, pp):
            warm = interleaved._megatron_warmups(pp, virtual, pp)
            if max(warm) > virtual * microbatches or not interleaved.megatron_regime(pp, microbatches, pp, warm, warm):
                continue
            orders = [interleaved._orders(pp, virtual, microbatches, r, pp) for r in range(pp)]
            table = compute_templates(pp * virtual)
            programs = [interleave_1f1b(f, b, w, table) for (f, b), w in zip(orders, warm)]
            assert asap(pp * virtual, programs)[1] == [], (pp, virtual, microbatches)
