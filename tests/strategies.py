"""Hypothesis strategies over the whole schedule parameter space.

The families and what each takes come from the package's own records
(`pipeschedule.compiler.families.FAMILIES`), so a family added there is drawn here
without a second list: split backward (W) and V placement
come with their families; offload (OFFLOAD / RELOAD, `pipeschedule.compiler.offload.add_offload`)
is drawn on top of any of them by `schedules`. Stage graphs other than the chain
([Note: stage graph] in pipeschedule/compiler/graph.py) are drawn by `stage_graphs`, and
schedules on them by `graph_schedules`.
"""

from hypothesis import settings, strategies as st

from pipeschedule import compile_schedule
from pipeschedule.compiler.families import FAMILIES, family_virtual
from pipeschedule.compiler.offload import OffloadPolicy, add_offload

FAMILY_NAMES = tuple(sorted(FAMILIES))


def examples(full: int) -> int:
    """The examples a property test that wants `full` of them draws under the active
    Hypothesis profile: all of them in the whole suite (profile max_examples 100), a
    tenth in the inner loop (`-m "not spawn"`: profile "inner", 10; tests/conftest.py)."""
    return max(10, full * settings().max_examples // 100)


@st.composite
def schedule_params(draw, max_pp=16, max_m=64, max_v=4, families=FAMILY_NAMES):
    """(family, compile_schedule keyword arguments): a family of `families`, pp, m, and
    virtual and cap where the family takes them (a cap half of the time, one int or one
    per rank, never below the stages a rank runs: each holds at least one microbatch in
    each of its stages)."""
    family = draw(st.sampled_from(families))
    record = FAMILIES[family]
    pp = draw(st.integers(1, max_pp))
    m = draw(st.integers(1, max_m))
    params = {"pp": pp, "microbatches": m}
    if record.takes_virtual:
        params["virtual"] = draw(st.integers(1, max_v))
    if record.takes_cap and draw(st.booleans()):
        low = family_virtual(family, params.get("virtual"))
        cap = st.integers(low, low + 2 * pp)
        params["cap"] = draw(st.lists(cap, min_size=pp, max_size=pp) if draw(st.booleans()) else cap)
    return family, params


def build(family, params, check=True):
    return compile_schedule(family, check=check, **params)


@st.composite
def offload_policies(draw, pp):
    """An `OffloadPolicy` for a schedule of pp ranks: a fraction (one or per rank), a
    lead (one or per rank), all ranks or some."""
    fraction = st.sampled_from((0.0, 0.25, 0.5, 1.0))
    lead = st.integers(0, 3)
    ranks = None
    if draw(st.booleans()):
        ranks = tuple(draw(st.lists(st.integers(0, pp - 1), min_size=1, max_size=pp, unique=True)))
    return OffloadPolicy(
        fraction=draw(st.tuples(*[fraction] * pp) if draw(st.booleans()) else fraction),
        ranks=ranks,
        lead=draw(st.tuples(*[lead] * pp) if draw(st.booleans()) else lead),
    )


@st.composite
def schedules(draw, max_pp=16, max_m=64, max_v=4, offload=True):
    """A compiled (lowered, verified) schedule of any family, with OFFLOAD / RELOAD of
    stashes added half of the time when `offload`."""
    family, params = draw(schedule_params(max_pp=max_pp, max_m=max_m, max_v=max_v))
    schedule = build(family, params)
    if offload and draw(st.booleans()):
        schedule = add_offload(schedule, draw(offload_policies(schedule.pp)))
    return schedule


@st.composite
def stage_graphs(draw, num_stages, max_producers=3):
    """Edges of a random stage graph over `num_stages` stages: each stage but 0 consumes
    1 to `max_producers` earlier stages, and a stage left without a consumer feeds a
    later one (so skip connections, several consumers and several producers, the chain
    among them)."""
    edges = set()
    for t in range(1, num_stages):
        producers = draw(st.lists(st.integers(0, t - 1), min_size=1, max_size=min(t, max_producers), unique=True))
        edges |= {(s, t) for s in producers}
    for s in range(num_stages - 1):
        if not any(a == s for a, _ in edges):
            edges.add((s, draw(st.integers(s + 1, num_stages - 1))))
    return sorted(edges)


@st.composite
def graph_schedules(draw, max_pp=8, max_m=16, max_v=3, offload=True):
    """A compiled (lowered, verified) schedule of any family on a random stage graph
    (`stage_graphs`), with OFFLOAD / RELOAD of stashes added half of the time when
    `offload`."""
    family, params = draw(schedule_params(max_pp=max_pp, max_m=max_m, max_v=max_v))
    stages = params["pp"] * family_virtual(family, params.get("virtual"))
    schedule = compile_schedule(family, edges=draw(stage_graphs(stages)), **params)
    if offload and draw(st.booleans()):
        schedule = add_offload(schedule, draw(offload_policies(schedule.pp)))
    return schedule
