"""Split backward: B computes input gradients, W the weight gradients it deferred.

[Note: split backward] In a schedule with W instructions (`Schedule.split_backward`)
the executor runs every F of a stage inside `WeightGrads.deferring()`, which rebinds
`torch.nn.functional.linear` (what `nn.Linear` calls, and what nanotron's tensor-parallel
linears call in their non-async modes, both looking it up at call time) to a router.
The thread's store catches each call whose weight is a leaf requiring grad, with grad
mode on. Such a call becomes one `_DeferredLinear` node that owns a private autograd
graph of the very same op, on a detached alias `x_` of the input:

    F   y_ = F.linear(x_, weight, bias) (private graph);  the stage sees y = y_.detach(),
        whose grad_fn is the _DeferredLinear node
    B   the node's backward differentiates the private graph for x_ only (autograd's
        engine computes only what is asked: the matmul's weight half is skipped) and
        keeps (y_, grad of y) for W; it returns no gradient for weight and bias
    W   one backward over every kept (y_, grad) of the (stage, mb), into the parameters:
        autograd runs the weight half of the same matmul nodes and accumulates into
        `.grad` through the parameters' own AccumulateGrad nodes (so hooks on them,
        DDP's included, fire at W)

Exactness: both halves run autograd's own derivative of the same op on the same saved
tensors, so the input gradient, each weight gradient and their accumulation into `.grad`
are bitwise those of an unsplit backward, provided W of each stage runs in microbatch
order (then every parameter accumulates in the reference's order). The nodes of the
outer graph keep their relative creation order, so contributions meeting in one
gradient (an input feeding two linears) are summed in the same order too.

What does not defer, and is computed at B as before:
- parameters not used through `F.linear` (norm weights, embeddings, convolutions), and
  linears the router never sees: torch's op called directly, or a `linear` bound from
  `torch.nn.functional` at import (a module global of torch.nn.functional itself is the
  rebound one);
- `F.linear` inside a custom autograd Function (grad mode is off there: nanotron's
  async-communication tensor-parallel linears), under `no_grad`, on tensor subclasses
  with their own `__torch_function__`, or with a weight that is not a leaf;
- a weight also used by some other differentiable op (a tied weight): its gradient must
  be summed with the other use's before it reaches `.grad`, as in the reference, so its
  linears compute their weight half at B. `close_forward(outputs)` decides it once F has
  returned, by a walk of the graph from the stage's outputs: a deferred parameter whose
  AccumulateGrad node is reached through any edge but a `_DeferredLinear` node's weight
  or bias edge (an op on the weight, a linear the router missed, the weight as another
  linear's input) is tied. Plain `F.linear` calls seen by the router (under
  `not_deferring()`, grad-free inputs...) note their leaf arguments as uses too, which is
  all `close_forward()` without outputs finds.
A stage where nothing defers runs the full backward at B and its W runs nothing; the
executor records that in `split_mode` and logs it once ([Note: executor semantics]).

Why a rebinding and not a `TorchFunctionMode` (the route until issue 40): a mode puts
every torch function of F through Python, 678 calls per F of six of the project's Llama
layers (hidden 384, seq 256, fp32), a fixed cost per call that grows against ops made
faster by threads: F +3.9% at 1 thread and +8.0% at 2 on a 2-core CPU (+6.4% and +10.0%
under nanotron's CPU mode `CudaToCpu`, whose calls it doubles); +37% at 4 threads per
rank of nanotron's Llama on 16 cores. The rebinding adds one Python call per linear (30
per such F) and the walk one visit per graph node (343, 0.3-0.5 ms): +1.5% and +3.1%
(+2.5% and +4.3% under `CudaToCpu`), medians of 60 paired rounds
(`python -m benchmarks.split_forward`, benchmarks/results/split_forward.md); on four pinned
cores of the 16-core machine under `CudaToCpu` at 4 threads, 1.10x where the mode cost 1.29x
(benchmarks/results/split_forward_16core.md). The router is installed
while any thread's `deferring()` is open (a lock and a count; the last to leave puts
back what it found, unless someone rebound it since) and reads a thread-local store, so
other threads (a data loader, ranks run as threads) run their linears plain or into their own
store.

Memory: from B to W a deferred linear holds its input (saved by the private matmul)
and its output gradient; `held_bytes` counts their storages (parameters and the given
`exclude` left out), which the ledger charges to the stash from B until W frees it.
Activation checkpointing inside a deferred stage must run its forward, both times, under
`not_deferring()` (its recomputation runs at B, outside `deferring()`, and must save what the
first run saved): its linears then compute their weight gradients at B. Layer recompute
does (integration/nanotron/pipeline/recompute.py). Their uses are still noted, so a deferred linear
sharing a weight with them computes at B too, as a tied weight does.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.autograd.variable import Variable

_LINEAR = F.linear  # torch._C._nn.linear, as torch binds it (what nn.Linear calls through F.linear)
_ACCUMULATE = torch._C._functions.AccumulateGrad
_DISABLED = torch._C._disabled_torch_function_impl


class _ThreadState(threading.local):
    store: WeightGrads | None = None  # the store this thread's F defers into
    depth = 0  # how many not_deferring() blocks this thread is in


_state = _ThreadState()
_route_lock = threading.Lock()
_route_users = 0  # deferring() blocks open, in every thread: F.linear is routed while > 0
_route_original = _LINEAR  # what F.linear was when the route went in


@dataclass(frozen=True)
class SplitReport:
    """How a stage's backward splits (from its first F of the step).

    mode        "split" when at least one parameter's gradient waits for W, "full" when
                none does (B runs the whole backward, W runs nothing)
    deferred    parameter tensors whose gradients W computes
    at_b        parameter tensors requiring grad whose gradients B computes
    tied        of those, weights of linears kept at B because another op also used them
    """

    stage: int
    mode: str
    deferred: int
    at_b: int
    tied: int

    def describe(self) -> str:
        if self.mode == "full":
            return (f"stage {self.stage}: no weight gradient can be deferred (no F.linear on a leaf parameter "
                    f"with grad enabled during its forward); B runs the full backward and W of stage "
                    f"{self.stage} runs nothing")
        extra = f", {self.tied} of them tied to another use" if self.tied else ""
        return (f"stage {self.stage}: W computes the gradients of {self.deferred} parameter tensor(s); "
                f"B computes {self.at_b}{extra}")


class _Record:
    """One deferred `F.linear` call of one (stage, mb)."""

    __slots__ = ("x", "leaf", "y", "weight", "bias", "grad", "at_b")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias
        self.x: torch.Tensor | None = None  # private input alias, until B
        self.leaf: torch.Tensor | None = None  # the same alias until W: the private graph's leaf, whose
        # storage host offload swaps out and back ([Note: host offload])
        self.y: GradientEdge | None = None  # the private output's node: the root of B and W
        self.grad: torch.Tensor | None = None  # output gradient, from B to W
        self.at_b = False  # tied: compute the weight half at B

    def params(self) -> list[torch.Tensor]:
        return [p for p in (self.weight, self.bias) if p is not None and p.requires_grad]


class _DeferredLinear(torch.autograd.Function):
    """`F.linear` whose weight half of the backward waits for W ([Note: split backward])."""

    @staticmethod
    def forward(ctx, x, weight, bias, record: _Record):
        with torch.enable_grad():
            x_ = x.detach()
            if x.requires_grad:
                x_.requires_grad_()
            y_ = _route_original(x_, weight, bias)
        # Only the private output's grad_fn is kept (as the root of B and W): its storage
        # belongs to the returned output, which the stage may release.
        record.x = record.leaf = x_
        record.y = get_gradient_edge(y_)
        ctx.record = record
        return y_.detach()

    @staticmethod
    def backward(ctx, grad):
        record: _Record = ctx.record
        want_x = ctx.needs_input_grad[0]
        if record.at_b:
            inputs = ([record.x] if want_x else []) + record.params()
            grads = list(_grad((record.y,), (grad,), inputs, keep_graph=False))
            gx = grads.pop(0) if want_x else None
            gw = grads.pop(0) if record.weight.requires_grad else None
            gb = grads.pop(0) if record.bias is not None and record.bias.requires_grad else None
            record.x = record.leaf = record.y = None
            return gx, gw, gb, None
        gx = _grad((record.y,), (grad,), [record.x], keep_graph=True)[0] if want_x else None
        record.grad = grad
        return gx, None, None, None


def _grad(roots, grads, inputs, *, keep_graph: bool):
    """torch.autograd.grad on gradient edges, through the engine directly (the engine
    checks each gradient against the node's recorded shape)."""
    return Variable._execution_engine.run_backward(
        tuple(roots), tuple(grads), keep_graph, False, tuple(inputs), True, False
    )


def _routed_linear(input, weight, bias=None):  # noqa: A002  (F.linear's names)
    """F.linear while a deferring() block is open in any thread: this thread's store's
    route, or the plain op where this thread defers into none."""
    store = _state.store
    if store is None:
        return _route_original(input, weight, bias)
    return store.linear(input, weight, bias)


def _route_in() -> None:
    global _route_users, _route_original
    with _route_lock:
        if _route_users == 0:
            _route_original = F.linear
            F.linear = _routed_linear
        _route_users += 1


def _route_out() -> None:
    global _route_users
    with _route_lock:
        _route_users -= 1
        if _route_users == 0 and F.linear is _routed_linear:  # (whoever rebound it since keeps theirs)
            F.linear = _route_original


_PLAIN_TYPES: dict[type, bool] = {torch.Tensor: True, torch.nn.Parameter: True}


def _plain_type(tensor) -> bool:
    """Whether `tensor` is a Tensor with no `__torch_function__` of its own (Parameter and
    its subclasses, nanotron's included, disable theirs)."""
    cls = type(tensor)
    plain = _PLAIN_TYPES.get(cls)
    if plain is None:
        plain = _PLAIN_TYPES[cls] = issubclass(cls, torch.Tensor) and cls.__torch_function__ is _DISABLED
    return plain


def _tensors(value) -> Iterator[torch.Tensor]:
    """The tensors of a stage's outputs: a tensor, or dicts, lists and tuples of them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _used_elsewhere(outputs, params: dict[int, torch.Tensor]) -> set[int]:
    """Ids of `params` whose AccumulateGrad node the backward from `outputs` reaches
    through an edge other than a deferred linear's weight or bias edge."""
    deferred_node = _DeferredLinear._backward_cls
    stack = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
    seen, found = set(stack), set()
    while stack:
        node = stack.pop()
        edges = node.next_functions
        if type(node) is deferred_node:
            edges = edges[:1]  # (input, weight, bias): the input's edge is B's, the others W's
        for child, _ in edges:
            if child is None or child in seen:
                continue
            seen.add(child)
            if type(child) is _ACCUMULATE:
                if id(child.variable) in params:
                    found.add(id(child.variable))
            else:
                stack.append(child)
    return found


@contextlib.contextmanager
def not_deferring() -> Iterator[None]:
    """Every F.linear of the body runs plain, inside `WeightGrads.deferring()` too: its
    weight gradient is computed at B ([Note: split backward], activation checkpointing)."""
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1


class WeightGrads:
    """The W part of one (stage, mb)'s stash: its deferred linears ([Note: split backward]).

    `deferring()` wraps the stage's forward; `close_forward()` follows it; B then runs
    through autograd as usual; `run()` is W.
    """

    def __init__(self) -> None:
        self.records: list[_Record] = []
        self._used: set[int] = set()  # ids of leaf tensors requiring grad that other ops used
        self._tied: set[int] = set()

    # -- F -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """F.linear of this thread defers into this store until the block ends."""
        _route_in()
        outer, _state.store = _state.store, self
        try:
            yield
        finally:
            _state.store = outer
            _route_out()

    def linear(self, input, weight, bias=None):  # noqa: A002  (F.linear's names)
        """F.linear(input, weight, bias) inside `deferring()`: deferred where it can be,
        else the plain op, whose leaf arguments count as uses (a tie) if it is differentiable."""
        if not torch.is_grad_enabled():
            return _route_original(input, weight, bias)
        if not _state.depth and self._deferrable(input, weight, bias):
            record = _Record(weight, bias)
            self.records.append(record)
            return _DeferredLinear.apply(input, weight, bias, record)
        out = _route_original(input, weight, bias)
        if getattr(out, "grad_fn", None) is not None:
            self._used.update(id(t) for t in (input, weight, bias)
                              if isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad)
        return out

    @staticmethod
    def _deferrable(input, weight, bias) -> bool:  # noqa: A002
        if not (isinstance(input, torch.Tensor) and isinstance(weight, torch.Tensor)):
            return False
        if not (weight.is_leaf and weight.requires_grad and _plain_type(input) and _plain_type(weight)):
            return False
        return bias is None or (isinstance(bias, torch.Tensor) and bias.is_leaf and _plain_type(bias))

    def close_forward(self, outputs=None) -> None:
        """After F: linears whose weight another differentiable op also used compute it at
        B. The uses are found in the graph of `outputs` (the stage's outputs: a tensor, or
        dicts, lists and tuples of them) and among the plain F.linear calls of F."""
        params = {id(p): p for record in self.records for p in record.params()}
        used = self._used
        if outputs is not None and params:
            used = used | _used_elsewhere(outputs, params)
        for record in self.records:
            if any(id(p) in used for p in record.params()):
                record.at_b = True
                self._tied.update(id(p) for p in record.params())
        self._used = set()

    def report(self, stage: int, params: Iterable[torch.Tensor]) -> SplitReport:
        deferred = {id(p) for r in self.records if not r.at_b for p in r.params()}
        trainable = {id(p) for p in params if p.requires_grad}
        at_b = trainable - deferred
        return SplitReport(stage, "split" if deferred else "full", len(deferred), len(at_b), len(self._tied & at_b))

    # -- B -----------------------------------------------------------------------------

    def held_bytes(self, exclude: set[int]) -> int:
        """Bytes W keeps from B on: the storages of the deferred matmuls' inputs and of
        their output gradients, each once, leaving out storages in `exclude`. Drops the
        input aliases (the private graph keeps what it saved)."""
        found: dict[int, int] = {}
        for record in self.records:
            tensors = (record.x, record.grad) if record.grad is not None else ()
            for tensor in tensors:
                if tensor is not None:
                    storage = tensor.untyped_storage()
                    if storage.data_ptr() not in exclude:
                        found[storage.data_ptr()] = storage.nbytes()
            record.x = None
        return sum(found.values())

    # -- W -----------------------------------------------------------------------------

    def run(self) -> None:
        """W: the weight halves of every linear whose B ran, in one backward, into `.grad`."""
        roots, grads, params, seen = [], [], [], set()
        for record in self.records:
            if record.grad is None:
                continue  # no gradient reached it at B (or it ran at B): nothing to add
            roots.append(record.y)
            grads.append(record.grad)
            for p in record.params():
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        self.records = []
        if roots:
            Variable._execution_engine.run_backward(tuple(roots), tuple(grads), False, False, tuple(params), True, True)

    def leaves(self) -> list[torch.Tensor]:
        """The private graphs' input leaves still held (their storages move with the stash
        at OFFLOAD: [Note: host offload])."""
        return [record.leaf for record in self.records if record.leaf is not None]

    @property
    def deferred(self) -> bool:
        return any(not r.at_b for r in self.records)


__all__ = ["SplitReport", "WeightGrads", "not_deferring"]
