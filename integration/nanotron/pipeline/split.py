"""Which pipeline stage and rank each block of a Llama-style model goes to.

A model is a list of blocks in forward order:

    embedding, decoder layer 0 .. L-1, final norm, LM head, loss

A *stage* is a contiguous run of blocks; stage s runs on rank `placement[s]`. Without
interleaving there are pp stages and placement is 0..pp-1; with `virtual` chunks per rank
there are pp * virtual stages, placed round-robin by default (`[0, 1, 0, 1]` for pp=2,
virtual=2: `pipeschedule.compiler.generators.common.round_robin`), which is nanotron's
`build_model(target_pp_ranks=...)` convention.

Two ways to split, both pure functions of numbers (no torch):

- `explicit_block_stages`: decoder layers per stage as given; the embedding goes with
  stage 0, the final norm, LM head and loss with the last stage.
- `nanotron_block_stages`: nanotron 0.4's `build_model` arithmetic, reproduced (see
  [Note: nanotron's split] in pipeschedule/plan/partition.py); `llama_block_costs` gives
  nanotron's Llama costs.
"""

from __future__ import annotations

from typing import Sequence

from pipeschedule.checks import is_int
from pipeschedule.errors import ParameterError
from pipeschedule.plan.partition import nanotron_assignment, nanotron_layer_cost

HEAD_BLOCKS = 1  # embedding
TAIL_BLOCKS = 3  # final norm, LM head, loss


def num_blocks(num_layers: int) -> int:
    return HEAD_BLOCKS + num_layers + TAIL_BLOCKS


def llama_block_costs(*, hidden: int, heads: int, ffn: int, vocab: int, layers: int) -> list[int]:
    """nanotron's `LlamaModel.get_block_compute_costs`, one entry per block of our model.

    A decoder layer costs 4 * heads * (hidden / heads) * hidden + 3 * ffn * hidden (GQA is
    ignored: k and v are priced as full heads), the LM head vocab * hidden, everything
    else 0.
    """
    layer = nanotron_layer_cost(hidden=hidden, heads=heads, ffn=ffn)
    return [0] + [layer] * layers + [0, vocab * hidden, 0]


def nanotron_block_stages(costs: Sequence[int], num_stages: int) -> list[int]:
    """Stage of each block under nanotron 0.4's cost-balanced assignment (see
    [Note: nanotron's split] in pipeschedule/plan/partition.py, and `nanotron_output_pp_rank`)."""
    if num_stages < 1:
        raise ParameterError(f"number of stages must be >= 1, got {num_stages}")
    return nanotron_assignment(costs, num_stages) if costs else []


def nanotron_output_pp_rank(block_stages: Sequence[int], placement: Sequence[int]) -> int:
    """The `output_pp_rank` nanotron's `build_model` sets, which is not always the loss's rank.

    `build_model` sets `output_pp_rank = target_pp_ranks[k]` with k the stage index after
    the walk of [Note: nanotron's split] (partition.py). The last block's cumulative cost is the total,
    which exceeds T_k for every k < S - 1, so k ends one past the loss block's stage
    whenever that stage is not the last: with empty trailing stages nanotron's data
    loader would deliver the labels to a rank that does not run the loss. Engines should
    take the output rank from the loss block (`block.rank`), not from `output_pp_rank`.
    """
    last = block_stages[-1]
    return placement[min(last + 1, len(placement) - 1)]


def explicit_block_stages(split: Sequence[int], num_layers: int) -> list[int]:
    """Stage of each block when stage s holds split[s] decoder layers."""
    if len(split) < 1 or not all(is_int(n) and n >= 0 for n in split):
        raise ParameterError(f"split must list decoder layers per stage as integers >= 0, got {list(split)}")
    if sum(split) != num_layers:
        raise ParameterError(
            f"split {'+'.join(map(str, split))} = {sum(split)} decoder layers, but the model has {num_layers}"
        )
    stages = [0]  # embedding
    for s, count in enumerate(split):
        stages.extend([s] * count)
    stages.extend([len(split) - 1] * TAIL_BLOCKS)
    return stages


def block_ranks(block_stages: Sequence[int], placement: Sequence[int]) -> list[int]:
    """Rank of each block: the rank of its stage."""
    return [placement[s] for s in block_stages]


def layers_per_stage(block_stages: Sequence[int], num_stages: int) -> list[int]:
    """Decoder layers on each stage (the `split` that `block_stages` amounts to)."""
    counts = [0] * num_stages
    for s in block_stages[HEAD_BLOCKS:len(block_stages) - TAIL_BLOCKS]:
        counts[s] += 1
    return counts
