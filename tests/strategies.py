"""Hypothesis strategies over the whole schedule parameter space."""

from hypothesis import strategies as st

from pipeschedule import compile_schedule

FAMILIES = ("afab", "1f1b", "capped_1f1b", "interleaved_1f1b", "capped_interleaved")


@st.composite
def schedule_params(draw, max_pp=16, max_m=64, max_v=4):
    family = draw(st.sampled_from(FAMILIES))
    pp = draw(st.integers(1, max_pp))
    m = draw(st.integers(1, max_m))
    params = {"pp": pp, "microbatches": m}
    if family in ("interleaved_1f1b", "capped_interleaved"):
        v = draw(st.integers(1, max_v))
        params["virtual"] = v
        if family == "capped_interleaved":
            per_rank = draw(st.booleans())
            low = v  # an interleaved rank holds at least one microbatch per chunk
            if per_rank:
                params["cap"] = draw(st.lists(st.integers(low, low + 2 * pp), min_size=pp, max_size=pp))
            else:
                params["cap"] = draw(st.integers(low, low + 2 * pp))
        family = "interleaved_1f1b"
    elif family == "capped_1f1b":
        if draw(st.booleans()):
            params["cap"] = draw(st.lists(st.integers(1, pp), min_size=pp, max_size=pp))
        else:
            params["cap"] = draw(st.integers(1, pp))
    return family, params


def build(family, params, check=True):
    return compile_schedule(family, check=check, **params)
