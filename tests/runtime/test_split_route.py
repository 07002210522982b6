"""The split backward's route ([Note: split backward]): F.linear is rebound while a
`WeightGrads.deferring()` block is open, per thread, and ties are found after F by a walk
of the stage's graph. Each check here compares with an unsplit backward bitwise."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeschedule.runtime.split_backward import WeightGrads, not_deferring


def _pair(module_fn, seed: int = 0):
    torch.manual_seed(seed)
    module = module_fn()
    twin = module_fn()
    twin.load_state_dict(module.state_dict())
    return module, twin


def _split(module, x, *, outputs: bool = True):
    """Forward under deferring(), B, then W; returns (.grad at B by name, report, x.grad)."""
    store = WeightGrads()
    with store.deferring():
        y = module(x)
    store.close_forward(y if outputs else None)
    report = store.report(0, module.parameters())
    y.square().sum().backward()
    at_b = {name: p.grad is not None for name, p in module.named_parameters()}
    store.run()
    return at_b, report


def _reference(module, x):
    module(x).square().sum().backward()


def _same_grads(a, b) -> bool:
    return all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))


class MethodTie(nn.Module):
    """proj's weight is also used through a Tensor method (no F.linear): only the graph
    walk sees it."""

    def __init__(self):
        super().__init__()
        self.proj, self.out = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.proj(x)) + x @ self.proj.weight.t())


class MissedLinear(nn.Module):
    """A linear the route never sees (torch's op called directly, as a module that bound
    F.linear at import would), on a weight that a routed linear also uses; and one on a
    weight of its own."""

    def __init__(self):
        super().__init__()
        self.proj, self.own, self.out = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.proj(x)) + torch._C._nn.linear(x, self.proj.weight)
        return self.out(h + torch._C._nn.linear(x, self.own.weight, self.own.bias))


class InputTie(nn.Module):
    """A weight used as the *input* of another deferred linear: its gradient from that
    use comes at B, so its own linear computes at B too."""

    def __init__(self):
        super().__init__()
        self.proj, self.mix = nn.Linear(6, 6), nn.Linear(6, 4)

    def forward(self, x):
        return self.proj(x).sum() + self.mix(self.proj.weight).sum()


def test_a_tie_through_a_tensor_method_is_found_by_the_graph_walk():
    module, twin = _pair(MethodTie)
    x = torch.randn(4, 6)
    at_b, report = _split(module, x)
    _reference(twin, x)
    assert at_b == {"proj.weight": True, "proj.bias": True, "out.weight": False, "out.bias": False}
    assert (report.deferred, report.at_b, report.tied) == (2, 2, 2)
    assert _same_grads(module, twin)


def test_without_the_walk_that_tie_would_split_its_gradient():
    """What the walk prevents: proj's weight deferred while its other use accumulates at B."""
    module, twin = _pair(MethodTie)
    x = torch.randn(4, 6)
    at_b, report = _split(module, x, outputs=False)
    assert at_b["proj.weight"] and report.tied == 0  # the other use's part arrived at B, the linear's waits
    _reference(twin, x)
    assert torch.equal(module.out.weight.grad, twin.out.weight.grad)


def test_a_linear_the_route_misses_computes_at_b_and_ties_the_weights_it_shares():
    module, twin = _pair(MissedLinear)
    x = torch.randn(4, 6)
    at_b, report = _split(module, x)
    _reference(twin, x)
    assert at_b == {"proj.weight": True, "proj.bias": True, "own.weight": True, "own.bias": True,
                    "out.weight": False, "out.bias": False}
    assert (report.deferred, report.at_b, report.tied) == (2, 4, 2)
    assert _same_grads(module, twin)


def test_a_weight_used_as_another_linears_input_is_a_tie():
    module, twin = _pair(InputTie)
    x = torch.randn(4, 6)
    store = WeightGrads()
    with store.deferring():
        y = module(x)
    store.close_forward(y)
    y.backward()
    assert module.proj.weight.grad is not None and module.mix.weight.grad is None
    store.run()
    twin(x).backward()
    assert _same_grads(module, twin)


def test_not_deferring_nests_inside_deferring_and_counts_its_uses():
    torch.manual_seed(1)
    first, second, third = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 5)
    x = torch.randn(3, 5)
    store = WeightGrads()
    with store.deferring():
        h = first(x)
        with not_deferring():
            h = second(h) + F.linear(h, third.weight)  # plain: third's weight is used at B
            with not_deferring():
                h = second(h)
        y = third(h)  # deferred again, but tied to the plain use above
    store.close_forward()  # (no outputs: the plain F.linear calls alone show the tie)
    report = store.report(0, [*first.parameters(), *second.parameters(), *third.parameters()])
    assert len(store.records) == 2 and (report.deferred, report.tied) == (2, 2)
    y.sum().backward()
    assert [p.grad is None for p in (first.weight, second.weight, third.weight)] == [True, False, False]
    store.run()
    assert first.weight.grad is not None


def test_two_threads_defer_at_once_into_their_own_stores_and_a_third_runs_plain():
    torch.manual_seed(2)
    layers = [nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(3)]
    x = torch.randn(4, 8)
    stores, results, errors = [WeightGrads(), WeightGrads(), None], [None] * 3, []
    inside = threading.Barrier(3)

    def work(k: int) -> None:
        try:
            store = stores[k]
            with store.deferring() if store is not None else _nothing():
                inside.wait(timeout=10)  # every thread is in F at once
                ys = [layers[k](x) for _ in range(20)]
                inside.wait(timeout=10)
            results[k] = ys
        except Exception as exc:  # noqa: BLE001  (re-raised below, in the test's thread)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert F.linear is torch._C._nn.linear  # the route is out once every block closed
    for k in (0, 1):
        assert len(stores[k].records) == 40
        assert {id(r.weight) for r in stores[k].records} == {id(layers[k][0].weight), id(layers[k][2].weight)}
    assert all(type(y.grad_fn).__name__ != "_DeferredLinearBackward" for y in results[2])


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_the_route_is_restored_when_the_forward_raises():
    store = WeightGrads()
    with pytest.raises(RuntimeError, match="boom"):
        with store.deferring():
            nn.Linear(2, 2)(torch.randn(1, 2))
            raise RuntimeError("boom")
    assert F.linear is torch._C._nn.linear
    assert len(store.records) == 1


def test_a_deferring_block_inside_another_defers_into_its_own_store_until_it_ends():
    torch.manual_seed(3)
    first, second, third = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(2, 4)
    outer, inner = WeightGrads(), WeightGrads()
    with outer.deferring():
        h = first(x)
        with inner.deferring():
            h = second(h)
        y = third(h)
    assert [r.weight for r in outer.records] == [first.weight, third.weight]
    assert [r.weight for r in inner.records] == [second.weight]
    assert F.linear is torch._C._nn.linear
    for store in (outer, inner):
        store.close_forward(y)
    y.sum().backward()
    assert all(p.grad is None for p in (first.weight, second.weight, third.weight))
    outer.run()
    inner.run()
    assert all(p.grad is not None for p in (first.weight, second.weight, third.weight))
