"""Activation recomputation of decoder layers, chosen in `pp_engine` (`recompute=`).

[Note: layer recompute] nanotron 0.4 has no setting for it, so it travels in the engine's
value ([Note: pp_engine syntax]):

    recompute=full        every decoder layer of every stage
    recompute=N           the first N decoder layers of every stage
    recompute=N0/N1/...   the first N_s decoder layers of stage s (pp * virtual entries)
    recompute=selective   nanotron's own selective recomputation: each layer's attention
                          core (`CoreAttention.checkpoint_attention`, nanotron's
                          `checkpoint_method`), which keeps the s^2 attention scores out
                          of the stash

Which blocks are decoder layers: those `split=` counts (`layout.layer_mask`), the blocks
built by the module builder that builds the most blocks (on a tie, the builder whose first
block comes first); when every builder builds one block, the first block with a compute
cost (`get_block_compute_costs`). In nanotron's Llama these are the decoder layers; the
embedding, final norm, LM head and loss run plain. In a model of plain PipelineBlocks
(nanotron's pipeline tests: an nn.Linear block and an activation block per rank, then a
loss) they are the blocks of its most repeated builder, the nn.Linear blocks there, and
the other blocks run plain. "First" counts in forward order within a stage. A model with
no decoder layer (every builder builds one block and no block has a cost) is refused
unless recompute asks for none: nothing would be recomputed. `selective` is refused
where the decoder layers have no attention core with nanotron's switch.

How a recomputed block runs (`recomputed`, which wraps the block's module):

    F   the block's forward runs as it would, with grad on, so its outputs (a tensor or a
        dict, tensors that require grad or not, other values), their requires_grad and
        its autograd graph are the plain block's; but each tensor autograd saves inside
        it is replaced by a slot (a saved-tensor hook), and only the block's tensor
        inputs are kept, saved through the saved-tensor hooks in force around the block
        by a small node (`_Anchor`), so the ledger counts them and host offload moves them
    B   the first slot autograd unpacks reruns the forward on those inputs (the RNG and
        autocast state of F restored) and fills every slot; autograd then runs the plain
        block's own graph

Exactness: B runs the plain block's graph node for node, so gradients reach the block's
inputs and parameters through the same nodes in the same order, and each saved tensor is
recomputed by the same op on the same values. Values and gradients are therefore bitwise
those of the plain block, given forward kernels that are deterministic (all of them on
CPU; on GPU a few, such as index_add, are not). A forward that saves other tensors when
rerun (control flow that depends on something besides its inputs and the RNG) raises at
B; a forward that modifies a tensor input in place is refused at F (the rerun would see
the modified values). Tensors inside inputs are found in dicts, lists and tuples; one
inside any other object is used as it is (not kept through the hooks, so not counted).
Under `torch.no_grad` (evaluation) the block just runs.

Under a split backward (zb_h1 and the V shapes) both runs are under `not_deferring()`
([Note: split backward]): the rerun happens inside B, outside the forward that defers
weight gradients, so a recomputed layer's linears compute their weight gradients at B and
W has nothing of that layer to do. `apply_recompute` returns a line saying so, which the
engine logs once at its first step.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import weakref
from typing import Callable, Sequence

import torch
from torch.autograd.graph import saved_tensors_hooks

from integration.nanotron.pipeline.errors import EngineRuntimeError, LayoutError
from pipeschedule.runtime.split_backward import not_deferring

_WRAPPED = "__pipeschedule_recompute__"
_AUTOCAST_DEVICES = ("cpu", "cuda")


def apply_recompute(blocks: Sequence, stage_of: dict[int, int], rank: int, recompute, *, layers: Sequence[bool],
                    split_backward: bool) -> str:
    """Make this rank's chosen decoder layers (`layers` marks them among `blocks`)
    recompute ([Note: layer recompute]); returns what a split backward cannot defer
    because of it ("" when nothing)."""
    local = [b for b in blocks if b.rank == rank]
    is_layer = {id(b): flag for b, flag in zip(blocks, layers)}
    stages = sorted({stage_of[id(b)] for b in local})
    if recompute == "selective":
        _selective(local, is_layer, model_has_layers=any(layers))
        return ""
    if not any(layers) and _asks_for_some(recompute):
        raise LayoutError(
            f"recompute={_text(recompute)}: no block of this model is a decoder layer (the blocks of the module "
            f"builder that builds the most blocks; here each of its {len(blocks)} blocks has its own builder and "
            "none has a compute cost), so nothing would be recomputed; build the repeated blocks with one module "
            "builder, or leave recompute out"
        )
    chosen = []
    for stage in stages:
        stage_layers = [b for b in local if stage_of[id(b)] == stage and is_layer[id(b)]]
        chosen += stage_layers[: _count(recompute, stage, len(stage_layers))]
    for block in chosen:
        _wrap(block, f"block {blocks.index(block)} ({_builder_name(block)}, stage {stage_of[id(block)]})")
    if split_backward and chosen:
        per_stage = {s: sum(stage_of[id(b)] == s for b in chosen) for s in stages}
        listed = ", ".join(f"stage {s}: {n}" for s, n in per_stage.items() if n)
        return (f"recomputed decoder layers compute their weight gradients at B, not W (a split backward cannot defer "
                f"inside a recomputed layer): {listed}")
    return ""


def _selective(local: Sequence, is_layer: dict[int, bool], *, model_has_layers: bool) -> None:
    cores = [m for b in local if is_layer[id(b)] and isinstance(b.pp_block, torch.nn.Module)
             for m in b.pp_block.modules() if hasattr(m, "checkpoint_attention")]
    if not cores and (not model_has_layers or any(is_layer[id(b)] for b in local)):
        raise LayoutError("recompute=selective: the model's decoder layers have no attention core with nanotron's "
                          "`checkpoint_attention` switch; use recompute=full or a number of layers per stage")
    for core in cores:
        core.checkpoint_attention = True


def _count(recompute, stage: int, available: int) -> int:
    if recompute == "full":
        return available
    if isinstance(recompute, tuple):
        return min(recompute[stage], available)
    return min(int(recompute), available)


def _asks_for_some(recompute) -> bool:
    if recompute == "full":
        return True
    return any(recompute) if isinstance(recompute, tuple) else int(recompute) > 0


def _text(recompute) -> str:
    return "/".join(map(str, recompute)) if isinstance(recompute, tuple) else str(recompute)


def _builder_name(block) -> str:
    builder = block.module_builder
    return getattr(builder, "__qualname__", None) or type(builder).__name__


def _wrap(block, name: str) -> None:
    """Recompute `block`'s module: its `forward` when it is an nn.Module (whose parameters
    must stay registered), else the callable itself (a builder may return a function)."""
    target = block.pp_block
    if isinstance(target, torch.nn.Module):
        if not is_recomputed(target):
            target.forward = recomputed(target.forward, name)
    elif not is_recomputed(target):
        block.pp_block = recomputed(target, name)


def is_recomputed(module) -> bool:
    """Whether `module` (a block's module, or the callable a builder returned) recomputes."""
    return bool(getattr(getattr(module, "forward", module), _WRAPPED, False))


def recomputed(forward: Callable, name: str = "block") -> Callable:
    """`forward`, whose saved tensors are recomputed in backward ([Note: layer recompute]);
    `name` says which block in errors."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return _Call(forward, name, args, kwargs).first_run(args, kwargs)

    setattr(run, _WRAPPED, True)
    return run


class _Slot:
    """What autograd keeps for one tensor saved inside a recomputed call: the call and the
    position of the save in its order of saves."""

    __slots__ = ("call", "index", "__weakref__")

    def __init__(self, call: _Call, index: int):
        self.call, self.index = call, index


class _Call:
    """One call of a recomputed forward, from its F until autograd lets go of its slots.

    Holds no reference to the call's graph or outputs (autograd holds the slots, the slots
    hold this), so it goes when the graph goes."""

    def __init__(self, forward: Callable, name: str, args: tuple, kwargs: dict):
        self.forward, self.name = forward, name
        self.tensors: list[torch.Tensor] = []
        self.template = _hollow((args, kwargs), self.tensors, {})  # the call, its tensors replaced by _At
        self.requires_grad = [t.requires_grad for t in self.tensors]
        self.state = _State.capture(self.tensors)
        self.slots: list[weakref.ref] = []  # in order of saves
        self.metas: list[tuple] = []  # what each saved tensor looked like at F
        self.recomputed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # _Slot -> tensor
        self.anchor: torch.Tensor | None = None  # its grad_fn holds the inputs, saved through the outer hooks

    # -- F -----------------------------------------------------------------------------

    def first_run(self, args: tuple, kwargs: dict):
        versions = [t._version for t in self.tensors]
        with not_deferring(), saved_tensors_hooks(self._pack, _unpack):
            out = self.forward(*args, **kwargs)
        changed = [i for i, (t, v) in enumerate(zip(self.tensors, versions)) if t._version != v]
        if changed:
            raise EngineRuntimeError(
                f"recompute: {self.name} modifies {len(changed)} of its {len(self.tensors)} tensor input(s) in place; "
                "its rerun in backward would see the modified values. Recompute only blocks that leave their inputs "
                "as they are (recompute=N with fewer layers, or no recompute)"
            )
        if self.slots and self.tensors:
            handle = torch.empty(0, requires_grad=True)  # makes autograd keep the node and its saves
            self.anchor = _Anchor.apply(handle, *(t.detach() for t in self.tensors))
        self.tensors = []  # from now on the anchor holds them
        return out

    def _pack(self, tensor: torch.Tensor) -> _Slot:
        slot = _Slot(self, len(self.slots))
        self.slots.append(weakref.ref(slot))
        self.metas.append(_meta(tensor))
        return slot

    # -- B -----------------------------------------------------------------------------

    def unpack(self, slot: _Slot) -> torch.Tensor:
        if slot not in self.recomputed:
            self._rerun()
        found = self.recomputed.get(slot)
        if found is None:
            raise EngineRuntimeError(
                f"recompute: {self.name} saved fewer tensors when rerun in backward than in its forward; its "
                "forward must save the same tensors given the same inputs (no control flow on other state)"
            )
        return found

    def _rerun(self) -> None:
        saved = self.anchor.grad_fn.saved_tensors if self.anchor is not None else ()
        inputs = [t.detach().requires_grad_(wanted) for t, wanted in zip(saved, self.requires_grad)]
        args, kwargs = _fill(self.template, inputs)
        position = 0

        def pack(tensor: torch.Tensor) -> None:
            nonlocal position
            if position >= len(self.slots) or _meta(tensor) != self.metas[position]:
                raise EngineRuntimeError(
                    f"recompute: {self.name} saved other tensors when rerun in backward than in its forward (save "
                    f"{position}: {_describe(_meta(tensor))}, at F "
                    f"{_describe(self.metas[position]) if position < len(self.metas) else 'none'}); its forward "
                    "must save the same tensors given the same inputs (no control flow on other state)"
                )
            slot = self.slots[position]()
            if slot is not None:  # None: autograd already let go of it (a node that ran)
                self.recomputed[slot] = tensor.detach()
            position += 1

        with self.state.restored(), torch.enable_grad(), not_deferring(), saved_tensors_hooks(pack, _unpack):
            self.forward(*args, **kwargs)


def _unpack(slot: _Slot) -> torch.Tensor:
    return slot.call.unpack(slot)


class _Anchor(torch.autograd.Function):
    """Saves a recomputed call's inputs through the saved-tensor hooks in force (the
    ledger's, host offload's); never differentiated (its output is used by nothing)."""

    @staticmethod
    def forward(ctx, handle, *tensors):
        ctx.save_for_backward(*tensors)
        return handle.new_empty(0)

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover  (its output takes no part in any loss)
        return (None,) * (1 + len(ctx.saved_tensors))


class _State:
    """The RNG and autocast state a forward ran under, to rerun it under the same."""

    def __init__(self, cpu_rng, cuda_rng: dict, autocast: list):
        self.cpu_rng, self.cuda_rng, self.autocast = cpu_rng, cuda_rng, autocast

    @classmethod
    def capture(cls, tensors: Sequence[torch.Tensor]) -> _State:
        cuda_rng = {}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            devices = {t.device.index for t in tensors if t.is_cuda} | {torch.cuda.current_device()}
            cuda_rng = {d: torch.cuda.get_rng_state(d) for d in sorted(devices)}
        autocast = [(device, torch.get_autocast_dtype(device)) for device in _AUTOCAST_DEVICES
                    if torch.is_autocast_enabled(device)]
        return cls(torch.get_rng_state(), cuda_rng, autocast)

    @contextlib.contextmanager
    def restored(self):
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=list(self.cuda_rng), device_type="cuda"))
            torch.set_rng_state(self.cpu_rng)
            for device, state in self.cuda_rng.items():
                torch.cuda.set_rng_state(state, device)
            for device, dtype in self.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            yield


class _At:
    """Where a tensor sat in a call's arguments: its index among the call's tensors."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _hollow(value, tensors: list, seen: dict):
    """`value` with each tensor (in dicts, lists and tuples) replaced by an `_At`; the
    tensors are appended to `tensors`, each once (`seen`: id -> index)."""
    if isinstance(value, torch.Tensor):
        if id(value) not in seen:
            seen[id(value)] = len(tensors)
            tensors.append(value)
        return _At(seen[id(value)])
    return _map(value, lambda item: _hollow(item, tensors, seen))


def _fill(template, tensors: Sequence[torch.Tensor]):
    """`_hollow`'s inverse: the value with each `_At` replaced by its tensor."""
    if isinstance(template, _At):
        return tensors[template.index]
    return _map(template, lambda item: _fill(item, tensors))


def _map(value, fn):
    if isinstance(value, dict):
        out = copy.copy(value)  # keeps the dict's type (OrderedDict, ...)
        for key in out:
            out[key] = fn(value[key])
        return out
    if type(value) in (list, tuple):
        return type(value)(fn(item) for item in value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(fn(item) for item in value))
    return value


def _meta(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape), tensor.dtype, tensor.device


def _describe(meta: tuple) -> str:
    shape, dtype, device = meta
    return f"{list(shape)} {str(dtype).removeprefix('torch.')} on {device}"


__all__ = ["apply_recompute", "is_recomputed", "recomputed"]
