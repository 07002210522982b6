"""The Llama-style model's pieces and the layer splits, in one process (no torch.distributed)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from integration.nanotron.pipeline import split as splits
from benchmarks.llama.model import DecoderLayer, Loss, ModelConfig, TokenEmbedding, block_seed, rotary
from pipeschedule.compiler.generators.common import round_robin
from pipeschedule.errors import ParameterError

CFG = ModelConfig(hidden=32, layers=4, heads=4, kv_heads=2, ffn=48, vocab=64, seq=10, seed=3)


def naive_layer(layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
    """The decoder layer written out without einops or SDPA, heads one by one."""
    cfg = layer.cfg
    d, group = cfg.head_dim, cfg.heads // cfg.kv_heads

    def norm(t, weight):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * weight

    h = norm(x, layer.input_norm.weight)
    q, kv = h @ layer.q_proj.weight.T, h @ layer.kv_proj.weight.T
    k_all, v_all = kv[..., : cfg.kv_heads * d], kv[..., cfg.kv_heads * d:]
    seq = x.shape[1]
    causal = torch.ones(seq, seq).tril().bool()
    heads = []
    for head in range(cfg.heads):
        kv_head = head // group
        qh = rotary(q[..., head * d:(head + 1) * d].unsqueeze(1), cfg.rope_theta).squeeze(1)
        kh = rotary(k_all[..., kv_head * d:(kv_head + 1) * d].unsqueeze(1), cfg.rope_theta).squeeze(1)
        vh = v_all[..., kv_head * d:(kv_head + 1) * d]
        scores = (qh @ kh.transpose(-1, -2)) / math.sqrt(d)
        heads.append(scores.masked_fill(~causal, float("-inf")).softmax(-1) @ vh)
    x = x + torch.cat(heads, dim=-1) @ layer.o_proj.weight.T
    g = norm(x, layer.post_attention_norm.weight) @ layer.gate_up_proj.weight.T
    gate, up = g[..., : cfg.ffn], g[..., cfg.ffn:]
    return x + (F.silu(gate) * up) @ layer.down_proj.weight.T


def test_decoder_layer_matches_the_written_out_version():
    layer = DecoderLayer(CFG, 1).double()
    x = torch.randn(2, CFG.seq, CFG.hidden, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mask = torch.ones(2, CFG.seq, dtype=torch.bool)
    out = layer(hidden_states=x, sequence_mask=mask)
    assert out["sequence_mask"] is mask
    torch.testing.assert_close(out["hidden_states"], naive_layer(layer, x), rtol=1e-10, atol=1e-10)


def test_decoder_layer_is_causal():
    layer = DecoderLayer(CFG, 2)
    x = torch.randn(1, CFG.seq, CFG.hidden)
    y = x.clone()
    y[:, 6:] += 1.0
    mask = torch.ones(1, CFG.seq, dtype=torch.bool)
    a = layer(hidden_states=x, sequence_mask=mask)["hidden_states"]
    b = layer(hidden_states=y, sequence_mask=mask)["hidden_states"]
    assert torch.equal(a[:, :6], b[:, :6]) and not torch.equal(a[:, 6:], b[:, 6:])


def test_rotary_scores_depend_on_relative_position_only():
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)
    seq = 12
    rq, rk = rotary(q.expand(1, 1, seq, 8), 10000.0), rotary(k.expand(1, 1, seq, 8), 10000.0)
    scores = (rq @ rk.transpose(-1, -2))[0, 0]
    for shift in range(1, 5):
        diag = scores.diagonal(-shift)
        torch.testing.assert_close(diag, diag[:1].expand_as(diag), rtol=1e-12, atol=1e-12)


def test_loss_is_the_label_masked_mean():
    logits = torch.randn(2, 5, 7)
    labels = torch.randint(0, 7, (2, 5))
    mask = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    got = Loss(CFG, 9)(sharded_logits=logits, label_ids=labels, label_mask=mask)["loss"]
    expected = F.cross_entropy(logits[mask], labels[mask])
    torch.testing.assert_close(got, expected)


def test_init_depends_on_seed_and_block_only():
    a, b = DecoderLayer(CFG, 3), DecoderLayer(CFG, 3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    c = DecoderLayer(CFG, 4)
    assert not torch.equal(a.q_proj.weight, c.q_proj.weight)
    assert torch.equal(a.input_norm.weight, torch.ones(CFG.hidden))
    emb = TokenEmbedding(ModelConfig(**{**CFG.__dict__, "seed": 4}), 0)
    assert not torch.equal(emb.weight, TokenEmbedding(CFG, 0).weight)
    assert block_seed(0, 0) != block_seed(0, 1) != block_seed(1, 0)
    assert 0 <= block_seed(7, 3) < 2**63  # a valid torch seed, from a hash (stable across processes)


def test_model_config_validates():
    for fields, reason in (
        ({"hidden": 30, "heads": 4}, "must divide by heads"),
        ({"heads": 4, "kv_heads": 3}, "divide by kv_heads"),
        ({"hidden": 12, "heads": 4}, "must be even"),
        ({"layers": 0}, "integer >= 1"),
    ):
        with pytest.raises(ValueError, match=reason):
            ModelConfig(**fields)


# -- splits -------------------------------------------------------------------------------


def test_llama3_70b_nanotron_split():
    costs = splits.llama_block_costs(hidden=8192, heads=64, ffn=28672, vocab=128256, layers=80)
    stages = splits.nanotron_block_stages(costs, 4)
    assert splits.layers_per_stage(stages, 4) == [21, 20, 20, 19]
    assert stages[0] == 0 and stages[-3:] == [3, 3, 3]  # embedding first, norm/head/loss last


def test_explicit_split():
    assert splits.explicit_block_stages([1, 2, 1], 4) == [0, 0, 1, 1, 2, 2, 2, 2]
    assert splits.explicit_block_stages([0, 4], 4) == [0, 1, 1, 1, 1, 1, 1, 1]
    interleaved = splits.block_ranks(splits.explicit_block_stages([1, 1, 1, 1], 4), round_robin(2, 2))
    assert interleaved == [0, 0, 1, 0, 1, 1, 1, 1]
    with pytest.raises(ParameterError, match="1\\+2 = 3 decoder layers, but the model has 4"):
        splits.explicit_block_stages([1, 2], 4)
    with pytest.raises(ParameterError, match="integers >= 0"):
        splits.explicit_block_stages([5, -1], 4)


def test_round_robin_placement():
    assert round_robin(2, 2) == [0, 1, 0, 1]
    assert round_robin(4, 1) == [0, 1, 2, 3]


@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=40), st.integers(1, 8))
def test_nanotron_split_shape(costs, stages_count):
    stages = splits.nanotron_block_stages(costs, stages_count)
    assert stages[0] == 0 and len(stages) == len(costs)
    assert all(0 <= b - a <= 1 for a, b in itertools.pairwise(stages))
    assert stages[-1] < stages_count
