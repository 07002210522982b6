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

A recomputed layer runs its forward under `torch.utils.checkpoint` (the reentrant form,
whose saved inputs pass through saved-tensor hooks, so the ledger and host offload see
them): F keeps only the layer's inputs, B runs its forward again and then its backward.
Values and gradients are bitwise those of the plain layer (same ops on the same inputs;
the RNG state is restored for the rerun).

Under a split backward (zb_h1 and the V shapes) the rerun happens inside B, outside the
forward that defers weight gradients, so a recomputed layer's linears compute their weight
gradients at B and W has nothing of that layer to do. `apply_recompute` returns a line
saying so, which the engine logs once at its first step.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.utils.checkpoint import checkpoint

from integration.nanotron.errors import LayoutError

_WRAPPED = "__pipeschedule_recompute__"


def apply_recompute(blocks: Sequence, stage_of: dict[int, int], rank: int, recompute, *, layers: Sequence[bool],
                    split_backward: bool) -> str:
    """Make this rank's chosen decoder layers (`layers` marks them among `blocks`)
    recompute ([Note: layer recompute]); returns what a split backward cannot defer
    because of it ("" when nothing)."""
    local = [b for b in blocks if b.rank == rank]
    is_layer = {id(b): flag for b, flag in zip(blocks, layers)}
    stages = sorted({stage_of[id(b)] for b in local})
    chosen = []
    for stage in stages:
        stage_layers = [b for b in local if stage_of[id(b)] == stage and is_layer[id(b)]]
        chosen += stage_layers[: _count(recompute, stage, len(stage_layers))]
    if recompute == "selective":
        cores = [m for b in local if is_layer[id(b)] for m in b.pp_block.modules()
                 if hasattr(m, "checkpoint_attention")]
        if not cores and any(is_layer[id(b)] for b in local):
            raise LayoutError("recompute=selective: the model's decoder layers have no attention core with nanotron's "
                              "`checkpoint_attention` switch; use recompute=full or a number of layers per stage")
        for core in cores:
            core.checkpoint_attention = True
        return ""
    for block in chosen:
        module = block.pp_block
        if not getattr(module, _WRAPPED, False):
            module.forward = _checkpointed(module.forward)
            setattr(module, _WRAPPED, True)
    if split_backward and chosen:
        per_stage = {s: sum(stage_of[id(b)] == s for b in chosen) for s in stages}
        listed = ", ".join(f"stage {s}: {n}" for s, n in per_stage.items() if n)
        return (f"recomputed decoder layers compute their weight gradients at B, not W (a split backward cannot defer "
                f"inside a recomputed layer): {listed}")
    return ""


def _count(recompute, stage: int, available: int) -> int:
    if recompute in ("full",):
        return available
    if recompute == "selective":
        return 0
    if isinstance(recompute, tuple):
        return min(recompute[stage], available)
    return min(int(recompute), available)


def _checkpointed(forward):
    """`forward(**tensors) -> dict of tensors`, run under reentrant checkpointing."""

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


def is_recomputed(module: torch.nn.Module) -> bool:
    return bool(getattr(module, _WRAPPED, False))


__all__ = ["apply_recompute", "is_recomputed"]
