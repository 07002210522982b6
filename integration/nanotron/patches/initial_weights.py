"""Initial weights that depend on the seed and on each parameter's name, never on the layout.

[Note: same initial weights] nanotron's `LlamaForTraining.init_model_randomly` draws
every parameter a rank holds from the one global torch stream, in the order the rank
holds them, each tensor-parallel rank its own shard. A model laid out differently
(another split, interleaved or V placement, another tp) therefore starts from other
weights, and the first loss differs with the engine (4.874508 under `1f1b`, 4.868939
under `interleaved_1f1b:virtual=2`, same YAML). `init_model_randomly` below keeps
nanotron's distributions and removes the dependence:

- What a parameter gets is nanotron's rule for its module kind (read from nanotron 0.4's
  `models/llama.py`): `TensorParallelColumnLinear` and `TensorParallelEmbedding` weights
  N(0, std), `TensorParallelRowLinear` weights N(0, std / sqrt(2 * num_hidden_layers)),
  `TritonRMSNorm` weights 1, every bias 0, with std = `model.init_method.std`; any other
  module is refused, as nanotron's own does.
- The values are those of the full (unsharded) tensor, drawn in blocks along the
  dimension nanotron's tensor parallelism splits (dim 1 of a row linear's weight, dim 0
  otherwise: a property of the module, not of tp), each block a run of whole slices
  (`block_length`, a function of the full shape only); block k of the parameter named n
  comes from a CPU generator seeded by `block_seed(general.seed, n, k)`. A rank draws
  only the blocks that meet its shard and copies its part, as nanotron's sharding
  metadata (`ShardedInfo.local_global_slices_pairs`) maps it, so tp=1 and tp=2 hold the
  same full tensor.
- The name is nanotron's: the tied name for a tied parameter (so the embedding and a
  tied LM head start equal on whichever ranks they live), the module path otherwise.
  Decoder layers are named by their index in the model (`model.decoder.3...`), which no
  split or placement changes.

Drawn in fp32 on the CPU whatever the device and dtype (then copied, and cast), so a GPU
run draws the values a CPU run does. The cost is a CPU draw of each rank's share of the
model: about 70 million values a second on the 2-core test machine, so Llama3-70B at
pp=4, tp=4 (about 4.4e9 values per rank) takes about a minute. nanotron's trainer then
averages the parameters over dp and over each tie group, as before; equal values average
to themselves exactly over two ranks (x + x is exact), and to the same value whatever the
layout over more.

Applied by the build hook ([Note: build hook] in patches/trainer.py) to every model whose
`init_model_randomly` is nanotron's Llama's, under nanotron's engines too: a run launched
with `import integration.nanotron` starts from these weights whatever `pp_engine` says.
"""

from __future__ import annotations

import hashlib
import math
import sys
import types
from dataclasses import dataclass

import torch

from integration.nanotron.pipeline.errors import UnsupportedConfigError

BLOCK_NUMEL = 1 << 22  # values per seeded block, at least one row (16 MiB of fp32)


def block_seed(seed: int, name: str, block: int) -> int:
    """The generator seed of block `block` of the parameter named `name`."""
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def block_length(full_shape: tuple[int, ...], dim: int) -> int:
    """Indices of `dim` per seeded block (at least one): a function of the full shape only."""
    slice_numel = math.prod(full_shape) // full_shape[dim] if full_shape[dim] else 0
    return max(1, BLOCK_NUMEL // max(slice_numel, 1))


@dataclass(frozen=True)
class Draw:
    """What a parameter starts as: N(0, std) where `std` is given, drawn in blocks along
    `dim` (the dimension tensor parallelism splits), else the constant `value`."""

    std: float | None = None
    value: float = 0.0
    dim: int = 0


def nanotron_llama_draw(module, attr: str, *, std: float, num_layers: int) -> Draw:
    """nanotron 0.4's Llama rule for parameter `attr` of `module`."""
    from nanotron.nn.layer_norm import TritonRMSNorm
    from nanotron.parallel.tensor_parallel.nn import (
        TensorParallelColumnLinear,
        TensorParallelEmbedding,
        TensorParallelRowLinear,
    )

    if attr == "bias":
        return Draw(value=0.0)
    if isinstance(module, TritonRMSNorm):
        return Draw(value=1.0)
    if isinstance(module, (TensorParallelColumnLinear, TensorParallelEmbedding)):
        return Draw(std=std)
    if isinstance(module, TensorParallelRowLinear):
        return Draw(std=std / math.sqrt(2 * num_layers), dim=1)
    raise UnsupportedConfigError(
        f"no initial-weight rule for {attr!r} of a {type(module).__name__} (nanotron's Llama initialises "
        "TensorParallelColumnLinear, TensorParallelRowLinear, TensorParallelEmbedding and TritonRMSNorm)")


@torch.no_grad()
def fill(param: torch.Tensor, *, name: str, std: float, seed: int, dim: int = 0) -> None:
    """Write into `param` its part of the full tensor whose blocks along `dim` are drawn
    from N(0, std) with `block_seed(seed, name, k)` ([Note: same initial weights])."""
    full_shape, pairs = _shard_map(param)
    length, step = full_shape[dim], block_length(full_shape, dim)
    spans = [(pair_global[dim].indices(length), local, pair_global) for local, pair_global in pairs]
    needed = sorted({k for (start, stop, _), _, _ in spans if start < stop
                     for k in range(start // step, (stop - 1) // step + 1)})
    for k in needed:
        low, high = k * step, min(length, (k + 1) * step)
        generator = torch.Generator(device="cpu").manual_seed(block_seed(seed, name, k))
        block_shape = tuple(high - low if d == dim else size for d, size in enumerate(full_shape))
        values = torch.empty(block_shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=generator)
        for (start, stop, _), local, pair_global in spans:
            first, last = max(low, start), min(high, stop)
            if first >= last:
                continue
            local_start = local[dim].indices(param.shape[dim])[0] + first - start
            target = param[_along(dim, local, slice(local_start, local_start + last - first))]
            target.copy_(values[_along(dim, pair_global, slice(first - low, last - low))])


def _along(dim: int, slices: tuple[slice, ...], replacement: slice) -> tuple[slice, ...]:
    """`slices` with the one of `dim` replaced."""
    return tuple(replacement if d == dim else s for d, s in enumerate(slices))


def _shard_map(param) -> tuple[tuple[int, ...], list[tuple[tuple[slice, ...], tuple[slice, ...]]]]:
    """The full shape of `param` and its (local slices, global slices) pairs; steps of 1."""
    if getattr(param, "is_sharded", False):
        info = param.get_sharded_info()
        full_shape = tuple(info.unsharded_shape)
        pairs = [(tuple(p.local_slices), tuple(p.global_slices)) for p in info.local_global_slices_pairs]
    else:
        full_shape = tuple(param.shape)
        whole = tuple(slice(None) for _ in full_shape)
        pairs = [(whole, whole)]
    for local, pair_global in pairs:
        if any(s.step not in (None, 1) for s in (*local, *pair_global)):
            raise UnsupportedConfigError(f"a shard with a strided slice ({local} <- {pair_global}) cannot be "
                                         "initialised by name; nanotron shards in contiguous slices")
    if not full_shape:
        raise UnsupportedConfigError("a 0-dimensional parameter cannot be drawn in blocks; nanotron's Llama has none")
    return full_shape, pairs


@torch.no_grad()
def init_model_randomly(model, config) -> None:
    """nanotron's `LlamaForTraining.init_model_randomly`, with each parameter drawn by
    name ([Note: same initial weights]); the same arguments."""
    std = config.model.init_method.std
    num_layers = config.model.model_config.num_hidden_layers
    seed = config.general.seed
    prefixes = {id(module): f"{name}." for name, module in model.named_modules()}
    prefixes[id(model)] = ""
    for full_name, param in model.named_parameters():
        module_name, attr = full_name.rsplit(".", 1)
        module = model.get_submodule(module_name)
        name = param.get_tied_info().get_full_name_from_module_id_to_prefix(prefixes) if param.is_tied else full_name
        draw = nanotron_llama_draw(module, attr, std=std, num_layers=num_layers)
        if draw.std is None:
            param.fill_(draw.value)
        else:
            fill(param, name=name, std=draw.std, seed=seed, dim=draw.dim)


def is_nanotron_llama(model) -> bool:
    """True for a model whose `init_model_randomly` is nanotron's Llama's (not a subclass's own)."""
    llama = sys.modules.get("nanotron.models.llama")
    cls = getattr(llama, "LlamaForTraining", None)
    return (cls is not None and isinstance(model, cls)
            and type(model).init_model_randomly is cls.init_model_randomly)


def attach(model) -> bool:
    """Give `model` the by-name initialisation if it is nanotron's Llama; True if given."""
    if not is_nanotron_llama(model):
        return False
    model.init_model_randomly = types.MethodType(init_model_randomly, model)
    return True


__all__ = ["BLOCK_NUMEL", "Draw", "attach", "block_length", "block_seed", "fill", "init_model_randomly",
           "is_nanotron_llama", "nanotron_llama_draw"]
