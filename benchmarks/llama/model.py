"""A small Llama-style model built from nanotron `PipelineBlock`s, for reference runs.

Blocks, in forward order, with nanotron Llama's input and output keys (so data-loader
dicts and the engines see what they see with nanotron's own model):

    token_embedding  {input_ids, input_mask}               -> {input_embeds}
    decoder[i]       {hidden_states, sequence_mask}        -> {hidden_states, sequence_mask}
    final_norm       {input}                               -> {hidden_states}
    lm_head          {x}                                   -> {logits}   (fp32)
    loss             {sharded_logits, label_ids, label_mask} -> {loss}

A decoder layer is pre-norm: RMSNorm, rotary causal attention through
`F.scaled_dot_product_attention` with grouped key/value heads, residual, RMSNorm, SwiGLU
MLP, residual. Tensors are [batch, seq, ...] throughout (nanotron's Llama uses
[seq, batch] after the embedding; nothing here depends on it). The sequence mask travels
with the hidden states from stage to stage, as in nanotron's Llama, so every boundary
also sends a tensor that does not require grad; attention here is causal only (the
mask is not applied to keys) and the loss is the label-masked mean.

[Note: deterministic init] Every block initialises its own parameters when built, from a
`torch.Generator` on CPU seeded by (config seed, block index), in fp32, then casts. So
the weights of a block do not depend on pp, split, device or which rank builds it: a
pp=1 model and a pp=4 model are identical parameter by parameter.

Building: `build_llama(cfg, p2p, block_ranks)` calls each block's
`build_and_set_rank(rank)`; `block_ranks` comes from `integration.nanotron.pipeline.split`
(`llama_block_ranks` wraps the usual cases). nanotron's own `build_model` also works on
this model (it exposes `get_block_compute_costs`), which is how the split arithmetic is
checked against nanotron's.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn

import integration.nanotron  # noqa: F401  (first: nanotron 0.4 imports once repaired; installs the patches)
import nanotron.distributed as nanotron_dist
from nanotron.models.base import NanotronModel
from nanotron.parallel.pipeline_parallel.block import PipelineBlock
from nanotron.parallel.pipeline_parallel.p2p import P2P

from integration.nanotron.pipeline import split as splits
from pipeschedule.checks import check_int
from pipeschedule.compiler.generators.common import round_robin


@dataclass(frozen=True)
class ModelConfig:
    """Size of the model. Every field is validated on construction.

    hidden     model width
    layers     decoder layers
    heads      query heads; hidden must divide by it, head size must be even (rotary)
    kv_heads   key/value heads (GQA); heads must divide by it
    ffn        SwiGLU inner width
    vocab      vocabulary size
    seq        sequence length of a sample
    seed       weight seed ([Note: deterministic init])
    init_std   standard deviation of every projection and embedding weight
    """

    hidden: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 128
    vocab: int = 256
    seq: int = 16
    seed: int = 0
    init_std: float = 0.02
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "seq"):
            check_int(f"ModelConfig.{name}", getattr(self, name))
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden {self.hidden} must divide by heads {self.heads} (remainder {self.hidden % self.heads})"
            )
        if (self.hidden // self.heads) % 2:
            raise ValueError(
                f"head size hidden/heads = {self.hidden}/{self.heads} = {self.hidden // self.heads} "
                "must be even for rotary"
            )
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} must divide by kv_heads {self.kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def block_costs(self) -> list[int]:
        """nanotron's compute cost of each block ([Note: nanotron's split])."""
        return splits.llama_block_costs(
            hidden=self.hidden, heads=self.heads, ffn=self.ffn, vocab=self.vocab, layers=self.layers
        )


def block_seed(seed: int, block_index: int) -> int:
    """A 63-bit seed for block `block_index` of a model seeded with `seed`."""
    digest = hashlib.blake2b(f"pipeschedule-llama:{seed}:{block_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class _SeededBlock(nn.Module):
    """Base of the block modules: `reset_parameters()` per [Note: deterministic init]."""

    norm_suffixes = ("norm.weight",)

    def __init__(self, cfg: ModelConfig, block_index: int):
        super().__init__()
        self.cfg = cfg
        self.block_index = block_index

    @torch.no_grad()
    def reset_parameters(self) -> None:
        generator = torch.Generator(device="cpu").manual_seed(block_seed(self.cfg.seed, self.block_index))
        for name, param in self.named_parameters():  # registration order: fixed by the class
            if name.endswith(self.norm_suffixes):
                param.fill_(1.0)
            else:
                value = torch.randn(param.shape, generator=generator, dtype=torch.float32) * self.cfg.init_std
                param.copy_(value.to(device=param.device, dtype=param.dtype))


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))  # statistics in at least fp32
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of x [batch, heads, seq, head_dim] (rotate-half form)."""
    seq, dim = x.shape[-2], x.shape[-1]
    dtype = torch.promote_types(x.dtype, torch.float32)  # angles in at least fp32, even for bf16 x
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=x.device, dtype=dtype) / dim))
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=dtype), inv_freq)  # [seq, dim/2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class TokenEmbedding(_SeededBlock):
    def __init__(self, cfg: ModelConfig, block_index: int):
        super().__init__(cfg, block_index)
        self.weight = nn.Parameter(torch.empty(cfg.vocab, cfg.hidden))
        self.reset_parameters()

    def forward(self, input_ids: torch.Tensor, input_mask: torch.Tensor):
        return {"input_embeds": F.embedding(input_ids, self.weight)}


class DecoderLayer(_SeededBlock):
    def __init__(self, cfg: ModelConfig, block_index: int):
        super().__init__(cfg, block_index)
        h, d = cfg.hidden, cfg.head_dim
        self.input_norm = RMSNorm(h, cfg.norm_eps)
        self.q_proj = nn.Linear(h, cfg.heads * d, bias=False)
        self.kv_proj = nn.Linear(h, 2 * cfg.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.heads * d, h, bias=False)
        self.post_attention_norm = RMSNorm(h, cfg.norm_eps)
        self.gate_up_proj = nn.Linear(h, 2 * cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, h, bias=False)
        self.reset_parameters()

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        q = rearrange(self.q_proj(x), "b s (h d) -> b h s d", h=cfg.heads)
        k, v = rearrange(self.kv_proj(x), "b s (two g d) -> two b g s d", two=2, g=cfg.kv_heads)
        q, k = rotary(q, cfg.rope_theta), rotary(k, cfg.rope_theta)
        group = cfg.heads // cfg.kv_heads
        k = repeat(k, "b g s d -> b (g r) s d", r=group)
        v = repeat(v, "b g s d -> b (g r) s d", r=group)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(rearrange(out, "b h s d -> b s (h d)"))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def forward(self, hidden_states: torch.Tensor, sequence_mask: torch.Tensor):
        hidden_states = hidden_states + self.attention(self.input_norm(hidden_states))
        hidden_states = hidden_states + self.mlp(self.post_attention_norm(hidden_states))
        return {"hidden_states": hidden_states, "sequence_mask": sequence_mask}


class FinalNorm(_SeededBlock):
    norm_suffixes = ("weight",)

    def __init__(self, cfg: ModelConfig, block_index: int):
        super().__init__(cfg, block_index)
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.reset_parameters()

    def forward(self, input: torch.Tensor):  # noqa: A002  (nanotron's key name)
        return {"hidden_states": self.norm(input)}


class LMHead(_SeededBlock):
    """Projection to the vocabulary; returns fp32 logits (nanotron's lm_head + cast_to_fp32)."""

    def __init__(self, cfg: ModelConfig, block_index: int):
        super().__init__(cfg, block_index)
        self.weight = nn.Parameter(torch.empty(cfg.vocab, cfg.hidden))
        self.reset_parameters()

    def forward(self, x: torch.Tensor):
        return {"logits": F.linear(x, self.weight).float()}


class Loss(_SeededBlock):
    """Token cross-entropy, mean over tokens where label_mask is set (nanotron's masked mean)."""

    def __init__(self, cfg: ModelConfig, block_index: int):
        super().__init__(cfg, block_index)

    def forward(self, sharded_logits: torch.Tensor, label_ids: torch.Tensor, label_mask: torch.Tensor):
        per_token = F.cross_entropy(
            rearrange(sharded_logits, "b s v -> (b s) v"), rearrange(label_ids, "b s -> (b s)"), reduction="none"
        )
        mask = rearrange(label_mask, "b s -> (b s)").to(per_token.dtype)
        return {"loss": (per_token * mask).sum() / mask.sum()}


class PipelinedLlama(NanotronModel):
    """The model: declares every PipelineBlock; `build_llama` builds the local ones.

    `forward(input_ids, input_mask, label_ids, label_mask)` returns `{"loss": ...}`: a
    tensor on the rank holding the loss block, a TensorPointer elsewhere, which is what
    nanotron's engines expect. A `StashMeter` attached as `stash_meter` sees every tensor
    saved for backward during forward, and every tensor handed to a block on another rank.
    """

    def __init__(self, cfg: ModelConfig, p2p: P2P):
        super().__init__()
        self.config = cfg
        self.p2p = p2p
        self.stash_meter = None

        def block(builder, index, inputs, outputs):
            return PipelineBlock(
                p2p=p2p, module_builder=builder, module_kwargs={"cfg": cfg, "block_index": index},
                module_input_keys=set(inputs), module_output_keys=set(outputs),
            )

        last = splits.num_blocks(cfg.layers) - 1
        self.token_embedding = block(TokenEmbedding, 0, {"input_ids", "input_mask"}, {"input_embeds"})
        self.decoder = nn.ModuleList([
            block(DecoderLayer, 1 + i, {"hidden_states", "sequence_mask"}, {"hidden_states", "sequence_mask"})
            for i in range(cfg.layers)
        ])
        self.final_norm = block(FinalNorm, last - 2, {"input"}, {"hidden_states"})
        self.lm_head = block(LMHead, last - 1, {"x"}, {"logits"})
        self.loss = block(Loss, last, {"sharded_logits", "label_ids", "label_mask"}, {"loss"})

    def pipeline_blocks(self) -> list[PipelineBlock]:
        """The blocks in forward order (the order `split` numbers them in)."""
        return [self.token_embedding, *self.decoder, self.final_norm, self.lm_head, self.loss]

    def get_block_compute_costs(self) -> dict:
        """nanotron's interface for `build_model`: cost per module builder."""
        costs = self.config.block_costs()
        return {DecoderLayer: costs[1], LMHead: costs[-2]} if self.config.layers else {LMHead: costs[-2]}

    def init_model_randomly(self, config=None) -> None:
        """Re-initialise the local blocks from the model seed; `config` is ignored."""
        for module in self.modules():
            if isinstance(module, _SeededBlock):
                module.reset_parameters()

    def forward(self, input_ids, input_mask, label_ids, label_mask):
        meter = self.stash_meter
        context = meter.recording() if meter is not None else contextlib.nullcontext()
        with context:
            out = self._call(self.token_embedding, input_ids=input_ids, input_mask=input_mask)
            state = {"hidden_states": out["input_embeds"], "sequence_mask": input_mask}
            for layer in self.decoder:
                state = self._call(layer, **state)
            hidden = self._call(self.final_norm, input=state["hidden_states"])["hidden_states"]
            logits = self._call(self.lm_head, x=hidden)["logits"]
            loss = self._call(self.loss, sharded_logits=logits, label_ids=label_ids, label_mask=label_mask)["loss"]
        return {"loss": loss}

    def _call(self, block: PipelineBlock, **inputs):
        meter = self.stash_meter
        if meter is not None and block.rank != nanotron_dist.get_rank(self.p2p.pg):
            for name, value in inputs.items():
                if isinstance(value, torch.Tensor):
                    meter.track_stage_output(value, name)  # this tensor leaves the rank
        return block(**inputs)


def llama_block_ranks(
    cfg: ModelConfig, pp: int, *, split: Sequence[int] | None = None, placement: Sequence[int] | None = None
) -> list[int]:
    """Rank of each block.

    split      decoder layers per stage (len = number of stages), or None for nanotron's
               cost-balanced split ([Note: nanotron's split])
    placement  rank of each stage; default 0..pp-1, or round-robin when a split lists a
               multiple of pp stages (interleaving, e.g. [0, 1, 0, 1])
    """
    if placement is None:
        stages = len(split) if split is not None else pp
        if stages % pp:
            raise ValueError(f"split lists {stages} stages, not a multiple of pp = {pp}; give placement")
        placement = round_robin(pp, stages // pp)
    placement = list(placement)
    if sorted(set(placement)) != list(range(pp)):
        raise ValueError(f"placement {placement} must use every rank 0..{pp - 1}")
    if split is None:
        stages = splits.nanotron_block_stages(cfg.block_costs(), len(placement))
    else:
        if len(split) != len(placement):
            raise ValueError(f"split lists {len(split)} stages but placement has {len(placement)}")
        stages = splits.explicit_block_stages(split, cfg.layers)
    return splits.block_ranks(stages, placement)


def build_llama(
    cfg: ModelConfig,
    p2p: P2P,
    block_ranks: Sequence[int],
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> PipelinedLlama:
    """Declare the model, build the blocks this rank owns, move them to device and dtype."""
    model = PipelinedLlama(cfg, p2p)
    blocks = model.pipeline_blocks()
    if len(block_ranks) != len(blocks):
        raise ValueError(f"block_ranks has {len(block_ranks)} entries; the model has {len(blocks)} blocks")
    for block, rank in zip(blocks, block_ranks, strict=True):
        block.build_and_set_rank(rank)
    model.input_pp_rank = block_ranks[0]
    model.output_pp_rank = block_ranks[-1]
    return model.to(device=device, dtype=dtype)


def count_parameters(cfg: ModelConfig) -> int:
    """Total parameters of the whole model (all stages)."""
    h, d = cfg.hidden, cfg.head_dim
    layer = 2 * h + h * cfg.heads * d + h * 2 * cfg.kv_heads * d + cfg.heads * d * h + h * 2 * cfg.ffn + cfg.ffn * h
    return cfg.vocab * h + cfg.layers * layer + h + cfg.vocab * h


__all__ = [
    "ModelConfig", "PipelinedLlama", "build_llama", "llama_block_ranks", "block_seed", "count_parameters",
]
