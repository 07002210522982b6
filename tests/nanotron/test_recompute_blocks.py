"""`recompute=` on any PipelineBlock nanotron accepts ([Note: layer recompute] in
integration/nanotron/pipeline/recompute.py).

In one process (a one-rank gloo group, real PipelineBlocks): a property over chains of
every kind of block (block_chains.KINDS): recomputed blocks give bitwise the values,
requires_grad, gradients and RNG stream of plain ones; the same property finds a
counterexample for broken recomputes (the reentrant checkpoint `recompute=` used
before, torch's checkpoint without the RNG state). Then the ledger's view, refusals, the choice of
layers, and split backward. Spawned (gloo): pipeschedule's engines on models shaped as
nanotron's own pipeline tests, with and without recompute, and nanotron's AFAB.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, find, given, settings, strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import integration.nanotron  # noqa: F401  (first: repairs nanotron)
from nanotron.parallel.pipeline_parallel.p2p import P2P

from block_chains import KINDS, BlockChain, Job, NanotronChain, Run, initial_state, loss_of, run_engines
from integration.nanotron.pipeline.errors import EngineRuntimeError, LayoutError
from integration.nanotron.pipeline.layout import layer_mask
from integration.nanotron.pipeline.recompute import apply_recompute, is_recomputed, recomputed
from pipeschedule.runtime.ledger import saved_storages
from pipeschedule.runtime.split_backward import WeightGrads
from strategies import examples


@pytest.fixture(scope="module")
def p2p(tmp_path_factory):
    """nanotron's P2P over a one-rank gloo group: every block is built and run on rank 0."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield P2P(dist.group.WORLD, device=torch.device("cpu"))
    dist.destroy_process_group()


# -- running a chain, plain and recomputed -------------------------------------------------


def run_chain(p2p, kinds, seed: int, x_grad: bool, recompute=None):
    """Each block's outputs, the loss, every gradient and the RNG state after the step."""
    model = BlockChain(p2p, kinds, seed)
    if recompute is not None:
        recompute(model)
    state = initial_state(seed, x_grad)
    trace: list = []
    torch.manual_seed(seed)
    final = model(state, trace)
    loss = loss_of(final)
    if loss.requires_grad:
        loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return {"trace": trace, "loss": loss, "grads": grads, "x.grad": state["x"].grad, "rng": torch.get_rng_state()}


def differences(plain: dict, other: dict) -> list[str]:
    """What differs between two runs of one chain (bitwise; requires_grad of every output)."""
    found = []
    for index, (a, b) in enumerate(zip(plain["trace"], other["trace"])):
        if a.keys() != b.keys():
            found.append(f"block {index}: output keys {sorted(a)} != {sorted(b)}")
            continue
        for key in a:
            found += [f"block {index} {key!r}: {d}" for d in _value_differences(a[key], b[key])]
    found += [f"loss: {d}" for d in _value_differences(plain["loss"], other["loss"])]
    for name, grad in plain["grads"].items():
        if not _same(grad, other["grads"][name]):
            found.append(f"gradient of {name}: {_show(grad)} != {_show(other['grads'][name])}")
    if not _same(plain["x.grad"], other["x.grad"]):
        found.append("gradient of the chain's input x")
    if not torch.equal(plain["rng"], other["rng"]):
        found.append("the RNG stream after the step")
    return found


def _value_differences(a, b) -> list[str]:
    if isinstance(a, tuple) or isinstance(b, tuple):
        if not (isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b)):
            return [f"{_show(a)} != {_show(b)}"]
        return [d for x, y in zip(a, b) for d in _value_differences(x, y)]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        out = [] if _same(a.detach(), b.detach()) else ["values differ"]
        if a.requires_grad != b.requires_grad:
            out.append(f"requires_grad {a.requires_grad} != {b.requires_grad}")
        return out
    return [] if type(a) is type(b) and a == b else [f"{_show(a)} != {_show(b)}"]


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _show(value) -> str:
    return f"tensor{list(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)


def chain_differences(p2p, chain, recompute_of) -> list[str]:
    """`differences` between the plain chain and the chain recomputed by `recompute_of(flags)`;
    an exception in the recomputed run counts as one."""
    kinds, flags, seed, x_grad = chain
    plain = run_chain(p2p, kinds, seed, x_grad)
    try:
        other = run_chain(p2p, kinds, seed, x_grad, recompute_of(flags))
    except Exception as error:  # noqa: BLE001  (a broken recompute may raise anything)
        return [f"raised {type(error).__name__}: {error}"]
    return differences(plain, other)


@st.composite
def chains(draw):
    """(kinds, recompute flags with at least one set, seed, whether the input x requires grad)."""
    kinds = draw(st.lists(st.sampled_from(sorted(KINDS)), min_size=1, max_size=5))
    flags = draw(st.lists(st.booleans(), min_size=len(kinds), max_size=len(kinds)).filter(any))
    return kinds, flags, draw(st.integers(0, 10_000)), draw(st.booleans())


def ours(flags):
    """The engine's path: `apply_recompute` with the flagged blocks as the decoder layers."""

    def apply(model):
        blocks = list(model.blocks)
        apply_recompute(blocks, dict.fromkeys(map(id, blocks), 0), 0, "full", layers=flags, split_backward=False)
        assert [is_recomputed(b.pp_block) for b in blocks] == list(flags)

    return apply


@settings(max_examples=examples(300), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chain=chains())
def test_recomputed_blocks_equal_plain_blocks(p2p, chain):
    assert chain_differences(p2p, chain, ours) == []


def _storages(value) -> set[int]:
    if isinstance(value, torch.Tensor):
        return {value.untyped_storage().data_ptr()}
    items = value.values() if isinstance(value, dict) else value if isinstance(value, tuple) else ()
    return set().union(*map(_storages, items)) if items else set()


@settings(max_examples=examples(100), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chain=chains())
def test_recomputed_blocks_keep_only_their_inputs(p2p, chain):
    """Every block recomputed: what autograd keeps through the hooks in force around the
    chain (the ledger's, host offload's) is some of the blocks' tensor inputs, nothing else."""
    kinds, _, seed, x_grad = chain
    model = BlockChain(p2p, kinds, seed)
    ours([True] * len(kinds))(model)
    fed: list = []
    with saved_storages(set()) as kept:
        model(initial_state(seed, x_grad), [], fed)
    assert set(kept) <= _storages(tuple(fed))


# -- the property rejects broken recomputes ---------------------------------------------------


def reentrant(forward):
    """What `recompute=` did before this file's version: torch's reentrant checkpoint
    around `forward(**tensors) -> dict of tensors`."""

    def run(**inputs):
        names = tuple(inputs)
        out_names: list[str] = []

        def positional(*values):
            out = forward(**dict(zip(names, values)))
            out_names[:] = list(out)
            return tuple(out[name] for name in out_names)

        values = checkpoint(positional, *(inputs[name] for name in names), use_reentrant=True)
        return dict(zip(out_names, values))

    return run


def rerun_without_rng(forward):
    """torch's non-reentrant checkpoint, not restoring the RNG state for the rerun."""
    return functools.wraps(forward)(
        lambda *args, **kwargs: checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs))


def wrapped_with(wrapper):
    """Flagged blocks' modules' `forward` wrapped by `wrapper` (as the old code did)."""

    def of(flags):
        def apply(model):
            for block, flag in zip(model.blocks, flags):
                if flag:
                    block.pp_block.forward = wrapper(block.pp_block.forward)

        return apply

    return of


def minimal_counterexample(p2p, recompute_of):
    return find(chains(), lambda chain: bool(chain_differences(p2p, chain, recompute_of)),
                settings=settings(max_examples=1000, database=None, derandomize=True))


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")  # the old recompute's own warning
def test_the_property_finds_the_old_reentrant_recompute_wrong(p2p):
    kinds, flags, _, _ = minimal_counterexample(p2p, wrapped_with(reentrant))
    assert len(kinds) == 1 and flags == [True]  # one block is enough
    # and the two failures of issue 34, on nanotron's own block shapes:
    bare = chain_differences(p2p, (["linear"], [True], 0, True), wrapped_with(reentrant))
    assert bare and "IndexError" in bare[0] and "tensors used as indices" in bare[0], bare
    passed_through = chain_differences(p2p, (["linear_dummy"], [True], 0, True), wrapped_with(reentrant))
    assert "block 0 'y': requires_grad False != True" in passed_through, passed_through
    no_grad_input = chain_differences(p2p, (["scaled"], [True], 0, False), wrapped_with(reentrant))
    assert any(d.startswith("gradient of blocks.0.pp_block.weight") for d in no_grad_input), no_grad_input
    assert chain_differences(p2p, (["linear_dummy"], [True], 0, True), ours) == []


def test_the_property_finds_a_rerun_without_the_rng_state_wrong(p2p):
    kinds, flags, _, _ = minimal_counterexample(p2p, wrapped_with(rerun_without_rng))
    assert kinds == ["dropout"] and flags == [True]


# -- what recompute keeps, and when it reruns ------------------------------------------------


def test_the_ledger_sees_only_a_recomputed_blocks_inputs_and_the_rerun_happens_once_at_backward():
    mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), nn.Sigmoid())
    calls = []

    def counted(x):
        calls.append(1)
        return mlp(x)

    x0 = torch.randn(4, 16, requires_grad=True)
    x, other = x0 * 2, x0 * 3  # inputs that are not the stage input: the ledger counts them
    holders: list = []
    with saved_storages(set(), holders) as plain:
        mlp(x)
    with saved_storages(set(), holders) as found:
        out = recomputed(counted)(x)
    assert sum(found.values()) == x.nbytes < sum(plain.values())
    assert len(calls) == 1
    out.sum().backward()
    assert len(calls) == 2  # once in F, once in B
    with saved_storages({x.untyped_storage().data_ptr()}, []) as excluded:
        recomputed(lambda a, b: a * b)(x, other)  # an excluded input (the act_in) stays excluded
    assert sum(excluded.values()) == other.nbytes


def test_without_grad_a_recomputed_block_just_runs():
    mlp = nn.Linear(4, 4)
    with torch.no_grad(), saved_storages(set()) as found:
        out = recomputed(mlp)(torch.randn(2, 4))
    assert not out.requires_grad and found == {}


def test_a_block_modifying_its_input_in_place_is_refused():
    def scale_in_place(x):
        x.mul_(2)
        return {"x": x * 3}

    x = torch.randn(2, 3, requires_grad=True) * 1
    with pytest.raises(EngineRuntimeError, match=r"recompute: block \(test\) modifies 1 of its 1 tensor input\(s\) in "
                                                   r"place; its rerun in backward would see the modified values"):
        recomputed(scale_in_place, "block (test)")(x=x)


def test_a_block_saving_other_tensors_when_rerun_is_refused_at_backward():
    flips = iter([True, False])

    def moody(x):
        return torch.sigmoid(x) if next(flips) else torch.tanh(x) * x

    out = recomputed(moody, "block (test)")(torch.randn(2, 3, requires_grad=True))
    with pytest.raises(EngineRuntimeError, match=r"block \(test\) saved other tensors when rerun in backward than in "
                                                   r"its forward \(save 1: \[2, 3\] float32 on cpu, at F none\)"):
        out.sum().backward()


# -- which blocks are decoder layers, and refusals ---------------------------------------------


def nanotron_chain_blocks(p2p, pp: int = 2):
    """nanotron's DummyModel: linear and activation blocks per rank, then the loss; all
    built here on rank 0, with stage_of as the ranks would be."""
    model = NanotronChain(p2p, pp)
    blocks = [m for m in model.modules() if hasattr(m, "module_builder")]
    for block in blocks:
        block.build_and_set_rank(0)
    return blocks, {id(b): r for b, r in zip(blocks, model.ranks)}


@pytest.mark.parametrize("recompute, expected", [
    ("full", [True, False, True, False, True, False, False]),
    (1, [True, False, True, False, True, False, False]),
    ((0, 1, 1), [False, False, True, False, True, False, False]),
    (0, [False] * 7),
])
def test_decoder_layers_of_a_generic_model_are_the_blocks_of_its_most_repeated_builder(p2p, recompute, expected):
    blocks, stage_of = nanotron_chain_blocks(p2p, pp=3)
    layers = layer_mask([b.module_builder for b in blocks], [0] * len(blocks))
    assert layers == [b.module_builder is nn.Linear for b in blocks]
    apply_recompute(blocks, stage_of, 0, recompute, layers=layers, split_backward=False)
    assert [is_recomputed(b.pp_block) for b in blocks] == expected


def test_the_first_n_layers_of_each_stage_are_recomputed(p2p):
    chain = BlockChain(p2p, ["linear", "sigmoid", "linear", "linear", "linear"], seed=0)
    blocks = list(chain.blocks)
    stage_of = dict(zip(map(id, blocks), [0, 0, 0, 1, 1]))
    layers = [True, False, True, True, True]
    apply_recompute(blocks, stage_of, 0, 1, layers=layers, split_backward=False)
    assert [is_recomputed(b.pp_block) for b in blocks] == [True, False, False, True, False]


def test_a_model_without_decoder_layers_is_refused_in_one_line(p2p):
    chain = BlockChain(p2p, ["linear", "sigmoid"], seed=0)
    blocks = list(chain.blocks)
    with pytest.raises(LayoutError) as caught:
        apply_recompute(blocks, dict.fromkeys(map(id, blocks), 0), 0, "full", layers=[False, False],
                        split_backward=False)
    assert "\n" not in str(caught.value)
    assert str(caught.value).startswith("recompute=full: no block of this model is a decoder layer")
    apply_recompute(blocks, dict.fromkeys(map(id, blocks), 0), 0, 0, layers=[False, False], split_backward=False)


@pytest.mark.parametrize("layers", [[True, False], [False, False]])
def test_selective_without_attention_cores_is_refused_in_one_line(p2p, layers):
    chain = BlockChain(p2p, ["linear", "gate_function"], seed=0)
    blocks = list(chain.blocks)
    with pytest.raises(LayoutError, match=r"^recompute=selective: the model's decoder layers have no attention core "
                                          r"with nanotron's `checkpoint_attention` switch; use recompute=full or a "
                                          r"number of layers per stage$"):
        apply_recompute(blocks, dict.fromkeys(map(id, blocks), 0), 0, "selective", layers=layers,
                        split_backward=False)


# -- split backward ----------------------------------------------------------------------------


def test_under_split_backward_a_recomputed_block_computes_its_weight_grads_at_b():
    """A plain linear defers its weight half to W; the recomputed block computes its own
    at B; a deferred linear whose weight the recomputed block also uses computes at B
    too (a tied weight). Gradients bitwise those of an unsplit, unrecomputed backward."""
    torch.manual_seed(0)
    first, second, shared = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
    x = torch.randn(4, 8)

    def block(h):
        return torch.tanh(second(h)) + F.linear(h, shared.weight)

    def step(split: bool, recompute: bool):
        for p in (*first.parameters(), *second.parameters(), *shared.parameters()):
            p.grad = None
        weights = WeightGrads()
        body = recomputed(block) if recompute else block
        with weights.deferring() if split else contextlib.nullcontext():
            out = body(shared(first(x)))
        weights.close_forward()
        out.sum().backward()
        at_b = {name: p.grad is not None for name, p in (("first", first.weight), ("second", second.weight),
                                                         ("shared", shared.weight))}
        report = weights.report(0, [*first.parameters(), *second.parameters(), *shared.parameters()])
        weights.run()
        return at_b, report, [p.grad.clone() for p in (*first.parameters(), *second.parameters(), *shared.parameters())]

    _, _, reference = step(split=False, recompute=False)
    at_b, report, grads = step(split=True, recompute=True)
    assert at_b == {"first": False, "second": True, "shared": True}
    assert (report.mode, report.deferred, report.tied) == ("split", 2, 2)  # first's weight and bias wait for W
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))


# -- pipeschedule's engines over gloo, nanotron's block shapes --------------------------------

ENGINES = ("ps_afab", "ps_1f1b", "capped_1f1b:cap=1", "zb_h1")


def with_recompute(engine: str, recompute: str) -> str:
    return f"{engine}{',' if ':' in engine else ':'}recompute={recompute}"


def pp2_runs() -> tuple[Run, ...]:
    runs = []
    for model in ("nanotron_chain", "nanotron_no_grad"):
        runs.append(Run(model, "afab"))
        for engine in ENGINES:
            runs += [Run(model, engine), Run(model, with_recompute(engine, "full"))]
        runs += [Run(model, "ps_1f1b:recompute=1"), Run(model, "ps_1f1b:recompute=0/2")]
    for engine in ("capped_1f1b:cap=1,split=2/2", "ps_afab:split=2/2", "interleaved_1f1b:virtual=2,split=1/1/1/1",
                   "zbv:split=1/1/1/1", "v_half:split=1/1/1/1", "v_min:split=1/1/1/1"):
        runs += [Run("layers", engine), Run("layers", with_recompute(engine, "full"))]
    runs += [Run("layers", "v_min:recompute=1/0/0/1,split=1/1/1/1"),
             Run("layers", "ps_afab:split=2/2,recompute=full,offload=0"),
             Run("layers", "ps_afab:split=2/2,recompute=full,offload=0/1,stream=1")]
    return tuple(runs)


def pp4_runs() -> tuple[Run, ...]:
    runs = []
    for model in ("nanotron_chain", "nanotron_no_grad"):
        runs.append(Run(model, "afab", microbatches=7))
        for engine in ("ps_1f1b", "zb_h1"):
            runs += [Run(model, engine, 7), Run(model, with_recompute(engine, "full"), 7)]
    return tuple(runs)


@functools.cache
def job(pp: int) -> dict:
    results = run_engines(Job(pp, pp2_runs() if pp == 2 else pp4_runs()))
    return {(r["run"].model, r["run"].engine): r for r in results}


def plain_engine(engine: str) -> str:
    """The engine value without recompute (nor offload: it changes where, not what)."""
    name, _, params = engine.partition(":")
    kept = [p for p in params.split(",") if p and not p.startswith(("recompute=", "offload=", "stream="))]
    return name + (":" + ",".join(kept) if kept else "")


def assert_bitwise(run: dict, reference: dict) -> None:
    assert run["error"] is None, run["error"]
    assert reference["error"] is None, reference["error"]
    assert run["losses"].equal(reference["losses"]), (run["run"], run["losses"], reference["losses"])
    assert run["grads"].keys() == reference["grads"].keys()
    for name, grad in reference["grads"].items():
        assert grad is not None and run["grads"][name] is not None, (run["run"], name)
        assert run["grads"][name].equal(grad), (run["run"], name, (run["grads"][name] - grad).abs().max())


@pytest.mark.spawn
@pytest.mark.parametrize("pp", [2, 4])
def test_engines_with_recompute_train_nanotrons_block_models_as_without(pp):
    runs = job(pp)
    for (model, engine), run in runs.items():
        if engine == "afab":
            continue
        assert_bitwise(run, runs[model, plain_engine(engine)])
        if model != "layers":  # and nanotron's own AFAB on nanotron's shapes
            assert_bitwise(run, runs[model, "afab"])


@pytest.mark.spawn
def test_the_ledger_measures_a_recomputed_stash():
    """Four layers (MLP, gate, dropout, MLP) at split 2/2, one microbatch in flight: with
    recompute=full rank 0 keeps the data loader's x and y and layer 1's input, rank 1 the
    received y (a copy: it takes no gradient) and layer 3's input, each a 3 x 6 float32
    tensor; offload moves rank 0's stashes to host memory whole."""
    runs = job(2)
    one = 3 * 6 * 4
    plain = runs["layers", "capped_1f1b:cap=1,split=2/2"]["stash"]
    assert runs["layers", "capped_1f1b:cap=1,split=2/2,recompute=full"]["stash"] == [3 * one, 2 * one]
    assert plain[0] > 6 * one and plain[1] > 6 * one
    offloaded = runs["layers", "ps_afab:split=2/2,recompute=full,offload=0"]
    assert offloaded["host_stash"] == [5 * 3 * one, 0]  # AFAB: all five microbatches' stashes at once
    streamed = runs["layers", "ps_afab:split=2/2,recompute=full,offload=0/1,stream=1"]
    assert streamed["host_stash"] == [5 * 3 * one, 5 * 2 * one]
