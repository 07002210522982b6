"""The flash-attn stand-in (integration/nanotron/flash_attn_standin.py).

Each function is checked against a naive reference written here (explicit loops over
sequences, heads, rows and keys, in float64), whose masks are transcribed from
flash-attn's documentation. nanotron 0.4's own `LlamaForTraining` is then built and
trained with the stand-in on CPU, in a subprocess so that this process's sys.modules
keeps no `flash_attn`; install()'s cases also run in fresh interpreters.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

from integration.nanotron import flash_attn_standin as standin
from integration.nanotron.flash_attn_standin import (
    RotaryEmbedding,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    index_first_axis,
    layer_norm_fn,
    pad_input,
    unpad_input,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.dirname(os.path.abspath(__file__))

# -- naive references ----------------------------------------------------------------------


def flash_mask(i: int, j: int, sq: int, sk: int, causal: bool, window=(-1, -1)) -> bool:
    """flash-attn's documented rule: query i of a sequence may see key j. The causal mask
    is aligned to the bottom-right corner; a window keeps
    [i + sk - sq - left, i + sk - sq + right]; causal means right = 0."""
    left, right = window
    if causal:
        right = 0
    shift = sk - sq
    return (left < 0 or j >= i + shift - left) and (right < 0 or j <= i + shift + right)


def top_left_mask(i: int, j: int, sq: int, sk: int, causal: bool, window=(-1, -1)) -> bool:  # noqa: ARG001
    """A wrong alignment (torch's is_causal): query i sees keys 0..i."""
    return not causal or j <= i


def reference_attention(q, k, v, cu_q, cu_k, *, causal=False, window=(-1, -1), scale=None, mask=flash_mask):
    """Packed sequences, one sequence and one head at a time, an explicit masked softmax in
    float64; a row that sees no key is zero, and so are rows past cu_q[-1]."""
    q, k, v = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    heads, group = q.shape[1], q.shape[1] // k.shape[1]
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    pieces = []
    for b in range(len(starts_q) - 1):
        q0, k0 = starts_q[b], starts_k[b]
        sq, sk = starts_q[b + 1] - q0, starts_k[b + 1] - k0
        allowed = torch.tensor([[mask(i, j, sq, sk, causal, window) for j in range(sk)] for i in range(sq)],
                               dtype=torch.bool).reshape(sq, sk)
        by_head = []
        for h in range(heads):
            kv_head = h // group  # heads 0..group-1 of q read kv head 0, and so on
            scores = q[q0:q0 + sq, h] @ k[k0:k0 + sk, kv_head].T * scale
            weights = torch.softmax(scores.masked_fill(~allowed, -1e9), dim=-1) * allowed  # a row with no key: 0
            by_head.append(weights @ v[k0:k0 + sk, kv_head])
        pieces.append(torch.stack(by_head, dim=1))
    pieces.append(torch.zeros(q.shape[0] - starts_q[-1], heads, v.shape[-1], dtype=torch.float64))
    return torch.cat(pieces, dim=0)


def reference_norm(x, weight, bias, residual=None, *, eps, rms):
    """Row by row in float64: (out, x + residual)."""
    summed = x.double() if residual is None else x.double() + residual.double()
    rows = []
    for row in summed.reshape(-1, summed.shape[-1]):
        mean = 0.0 if rms else row.sum() / row.numel()
        variance = ((row - mean) ** 2).sum() / row.numel()
        normed = (row - mean) / torch.sqrt(variance + eps) * weight.double()
        rows.append(normed if bias is None else normed + bias.double())
    return torch.stack(rows).reshape(summed.shape), summed


def reference_rotary(x, positions, *, dim, base=10000.0, interleaved):
    """x (b, s, h, d), positions (b, s): each pair of features (2m, 2m+1) (interleaved)
    or (m, m + dim/2) taken as a complex number and multiplied by
    exp(1j * position * base**(-2m/dim)), in float64; features past dim unchanged."""
    features = list(x.double().unbind(-1))  # each (b, s, h)
    for m in range(dim // 2):
        a, c = (2 * m, 2 * m + 1) if interleaved else (m, m + dim // 2)
        angle = positions.double()[:, :, None] * base ** (-2 * m / dim)
        z = torch.complex(features[a], features[c]) * torch.complex(torch.cos(angle), torch.sin(angle))
        features[a], features[c] = z.real, z.imag
    return torch.stack(features, dim=-1)


def packed(lengths, heads, dim, *, seed, dtype=torch.float64, extra_rows=0):
    """Random rows for sequences of `lengths` (+ unused rows), and their int32 cu_seqlens."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(sum(lengths) + extra_rows, heads, dim, generator=generator, dtype=torch.float64).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return rows, cu


def attention_inputs(lengths_q, lengths_k, heads, kv_heads, *, dim=8, dtype=torch.float64, extra_rows=0):
    q, cu_q = packed(lengths_q, heads, dim, seed=1, dtype=dtype, extra_rows=extra_rows)
    k, cu_k = packed(lengths_k, kv_heads, dim, seed=2, dtype=dtype)
    v, _ = packed(lengths_k, kv_heads, dim, seed=3, dtype=dtype)
    return q, k, v, cu_q, cu_k


def varlen(q, k, v, cu_q, cu_k, **kwargs):
    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, int((cu_q[1:] - cu_q[:-1]).max()),
                                  int((cu_k[1:] - cu_k[:-1]).max()), **kwargs)


# -- flash_attn_varlen_func ----------------------------------------------------------------

SELF_LENGTHS = [5, 1, 7, 3]
HEADS = [(4, 4), (4, 2), (6, 1)]  # MHA, GQA, MQA


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_varlen_matches_the_reference(heads, kv_heads, causal):
    q, k, v, cu_q, cu_k = attention_inputs(SELF_LENGTHS, SELF_LENGTHS, heads, kv_heads)
    out = varlen(q, k, v, cu_q, cu_k, causal=causal)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out, reference_attention(q, k, v, cu_q, cu_k, causal=causal), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_with_seqlen_q_other_than_seqlen_k_aligns_bottom_right(causal):
    # (2 q, 5 k), (5 q, 2 k): rows 0-2 see no key when causal, (3, 3), (0 q, 4 k), (2 q, 0 k)
    lengths_q, lengths_k = [2, 5, 3, 0, 2], [5, 2, 3, 4, 0]
    q, k, v, cu_q, cu_k = attention_inputs(lengths_q, lengths_k, 4, 2)
    out = varlen(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=0.3)
    torch.testing.assert_close(out, reference_attention(q, k, v, cu_q, cu_k, causal=causal, scale=0.3),
                               rtol=1e-12, atol=1e-12)
    if causal:  # flash-attn's documented example: seqlen_q = 5, seqlen_k = 2 keeps rows 3 and 4
        second = out[2:7]
        assert second[:3].eq(0).all() and second[3:].ne(0).all()
    assert out[-2:].eq(0).all()  # no keys: zeros


@pytest.mark.parametrize("window,causal", [((2, 0), True), ((1, 1), False), ((-1, 2), False), ((0, -1), False)])
def test_varlen_sliding_window(window, causal):
    lengths_q, lengths_k = [6, 3, 4], [6, 5, 2]
    q, k, v, cu_q, cu_k = attention_inputs(lengths_q, lengths_k, 2, 1)
    out = varlen(q, k, v, cu_q, cu_k, causal=causal, window_size=window)
    torch.testing.assert_close(out, reference_attention(q, k, v, cu_q, cu_k, causal=causal, window=window),
                               rtol=1e-12, atol=1e-12)


def test_varlen_rows_past_the_last_sequence_are_zero():
    q, k, v, cu_q, cu_k = attention_inputs([3, 2], [3, 2], 2, 2, extra_rows=3)
    out = varlen(q, k, v, cu_q, cu_k, causal=True)
    assert out.shape == q.shape and out[5:].eq(0).all()
    torch.testing.assert_close(out, reference_attention(q, k, v, cu_q, cu_k, causal=True), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_varlen_keeps_the_input_dtype(dtype, tolerance):
    q, k, v, cu_q, cu_k = attention_inputs(SELF_LENGTHS, SELF_LENGTHS, 4, 2, dtype=dtype)
    out = varlen(q, k, v, cu_q, cu_k, causal=True)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, cu_q, cu_k, causal=True),
                               rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("lengths_q,lengths_k,causal,window", [
    ([3, 2], [3, 2], True, (-1, -1)),   # is_causal path
    ([2, 3], [4, 2], True, (-1, -1)),   # explicit bottom-right mask, a row without keys
    ([3, 2], [3, 3], False, (1, 0)),    # window
    ([3, 2], [3, 2], False, (-1, -1)),  # no mask
])
def test_varlen_gradients(lengths_q, lengths_k, causal, window):
    q, k, v, cu_q, cu_k = attention_inputs(lengths_q, lengths_k, 2, 1, dim=4, extra_rows=1)
    for t in (q, k, v):
        t.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda q, k, v: varlen(q, k, v, cu_q, cu_k, causal=causal, window_size=window),
                                    (q, k, v), fast_mode=True)  # the full comparison is the next test


def test_varlen_gradients_match_the_reference():
    q, k, v, cu_q, cu_k = attention_inputs([5, 3, 6], [5, 4, 6], 4, 2)
    for t in (q, k, v):
        t.requires_grad_(True)
    weights = torch.randn(q.shape[0], 4, 8, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    ours = torch.autograd.grad((varlen(q, k, v, cu_q, cu_k, causal=True) * weights).sum(), (q, k, v))
    theirs = torch.autograd.grad((reference_attention(q, k, v, cu_q, cu_k, causal=True) * weights).sum(), (q, k, v))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_varlen_is_deterministic_on_cpu():
    def run():
        q, k, v, cu_q, cu_k = attention_inputs([40, 17, 64, 7], [40, 17, 64, 7], 8, 2, dim=16, dtype=torch.float32)
        for t in (q, k, v):
            t.requires_grad_(True)
        out = varlen(q, k, v, cu_q, cu_k, causal=True)
        out.pow(2).sum().backward()
        return out.detach(), q.grad, k.grad, v.grad

    first, second = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(first, second))


# -- the references can tell a wrong answer from a right one ------------------------------


def test_a_top_left_causal_alignment_is_caught():
    lengths_q, lengths_k = [2, 5], [5, 2]
    q, k, v, cu_q, cu_k = attention_inputs(lengths_q, lengths_k, 2, 2)
    out = varlen(q, k, v, cu_q, cu_k, causal=True)
    wrong = reference_attention(q, k, v, cu_q, cu_k, causal=True, mask=top_left_mask)
    assert not torch.allclose(out, wrong, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(out, reference_attention(q, k, v, cu_q, cu_k, causal=True), rtol=1e-12, atol=1e-12)


def test_wrong_cu_seqlens_are_caught():
    q, k, v, cu_q, cu_k = attention_inputs([4, 4], [4, 4], 2, 2)
    shifted = torch.tensor([0, 3, 8], dtype=torch.int32)  # the boundary one row too early
    wrong = varlen(q, k, v, shifted, shifted, causal=True)
    assert not torch.allclose(wrong, reference_attention(q, k, v, cu_q, cu_k, causal=True), rtol=1e-3, atol=1e-3)


def test_wrong_gqa_grouping_is_caught():
    q, k, v, cu_q, cu_k = attention_inputs([4, 3], [4, 3], 4, 2)
    out = varlen(q, k, v, cu_q, cu_k)
    # heads taken round-robin (h % kv_heads) instead of in groups (h // group)
    wrong = reference_attention(q, k.repeat(1, 2, 1), v.repeat(1, 2, 1), cu_q, cu_k)
    assert not torch.allclose(out, wrong, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("call,message", [
    (lambda a: varlen(*a, dropout_p=0.1), "dropout_p=0.1 is not supported"),
    (lambda a: varlen(*a, return_attn_probs=True), "return_attn_probs=True is not supported"),
    (lambda a: varlen(*a, alibi_slopes=torch.ones(2)), "alibi_slopes=<tensor (2,)"),
    (lambda a: varlen(*a, softcap=30.0), "softcap=30.0 is not supported"),
])
def test_unsupported_arguments_are_refused(call, message):
    with pytest.raises(NotImplementedError, match=re.escape(message)) as error:
        call(attention_inputs([3], [3], 2, 2))
    assert "flash_attn_varlen_func" in str(error.value) and "only" in str(error.value)


def test_bad_inputs_name_the_value():
    q, k, v, cu_q, cu_k = attention_inputs([3, 2], [3, 2], 4, 2)
    with pytest.raises(ValueError, match="cu_seqlens_q=<tensor \\(3,\\) torch.int64>; expected a 1-D torch.int32"):
        flash_attn_varlen_func(q, k, v, cu_q.long(), cu_k, 3, 3)
    with pytest.raises(ValueError, match="q has 4 heads and k, v 3"):
        flash_attn_varlen_func(q, k.repeat(1, 2, 1)[:, :3], v.repeat(1, 2, 1)[:, :3], cu_q, cu_k, 3, 3)
    with pytest.raises(ValueError, match="length 3 > max_seqlen=2"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2, 3)
    with pytest.raises(ValueError, match=r"cu_seqlens_k=\[0, 3, 9\]; expected .* <= 5"):
        flash_attn_varlen_func(q, k, v, cu_q, torch.tensor([0, 3, 9], dtype=torch.int32), 3, 9)
    with pytest.raises(ValueError, match="window_size=\\(-2, 0\\)"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, window_size=(-2, 0))


# -- flash_attn_with_kvcache ---------------------------------------------------------------


def test_kvcache_appends_and_attends_bottom_right():
    batch, cache_len, heads, kv_heads, dim = 2, 8, 4, 2, 8
    g = torch.Generator().manual_seed(4)
    k_cache = torch.randn(batch, cache_len, kv_heads, dim, generator=g, dtype=torch.float64)
    v_cache = torch.randn(batch, cache_len, kv_heads, dim, generator=g, dtype=torch.float64)
    q = torch.randn(batch, 2, heads, dim, generator=g, dtype=torch.float64)
    k_new = torch.randn(batch, 2, kv_heads, dim, generator=g, dtype=torch.float64)
    v_new = torch.randn(batch, 2, kv_heads, dim, generator=g, dtype=torch.float64)
    lengths = torch.tensor([3, 5], dtype=torch.int32)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, causal=True)
    for b, length in enumerate(lengths.tolist()):
        assert torch.equal(k_cache[b, length:length + 2], k_new[b])
        assert torch.equal(v_cache[b, length:length + 2], v_new[b])
        untouched = [p for p in range(cache_len) if not length <= p < length + 2]
        assert torch.equal(k_cache[b, untouched], before_k[b, untouched])
        assert torch.equal(v_cache[b, untouched], before_v[b, untouched])
        used = length + 2
        expected = reference_attention(q[b], k_cache[b, :used], v_cache[b, :used],
                                       torch.tensor([0, 2], dtype=torch.int32),
                                       torch.tensor([0, used], dtype=torch.int32), causal=True)
        torch.testing.assert_close(out[b], expected, rtol=1e-12, atol=1e-12)


def test_kvcache_refuses_what_it_does_not_do():
    cache = torch.zeros(1, 4, 1, 8)
    q = torch.zeros(1, 1, 2, 8)
    with pytest.raises(NotImplementedError, match="flash_attn_with_kvcache: rotary_cos=<tensor"):
        flash_attn_with_kvcache(q, cache, cache.clone(), rotary_cos=torch.zeros(4, 4), rotary_sin=torch.zeros(4, 4))
    with pytest.raises(NotImplementedError, match="has no backward"):
        flash_attn_with_kvcache(q.requires_grad_(True), cache, cache.clone(), cache_seqlens=1)
    with pytest.raises(ValueError, match="cache_seqlens 3 \\+ 2 new keys does not fit in a cache of 4"):
        flash_attn_with_kvcache(torch.zeros(1, 2, 2, 8), cache, cache.clone(), torch.zeros(1, 2, 1, 8),
                                torch.zeros(1, 2, 1, 8), cache_seqlens=3)


# -- layer_norm_fn -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rms", [True, False])
@pytest.mark.parametrize("with_residual,prenorm,residual_in_fp32", [
    (False, False, False), (True, False, False), (True, True, False), (False, True, False), (False, True, True),
    (True, True, True),
])
def test_layer_norm_matches_the_reference(dtype, tolerance, rms, with_residual, prenorm, residual_in_fp32):
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 4, 16, generator=g) * 3 + 1).to(dtype)
    residual = torch.randn(3, 4, 16, generator=g).to(dtype) if with_residual else None
    weight = torch.randn(16, generator=g).to(dtype)
    bias = None if rms else torch.randn(16, generator=g).to(dtype)
    result = layer_norm_fn(x, weight, bias, residual=residual, eps=1e-5, prenorm=prenorm,
                           residual_in_fp32=residual_in_fp32, is_rms_norm=rms)
    expected, summed = reference_norm(x, weight, bias, residual, eps=1e-5, rms=rms)
    out = result[0] if prenorm else result
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)
    if prenorm:
        residual_out = result[1]
        # flash-attn: the sum in residual's dtype, fp32 if residual_in_fp32, else x itself
        expected_dtype = residual.dtype if with_residual else (torch.float32 if residual_in_fp32 else dtype)
        assert residual_out.dtype == expected_dtype
        if not with_residual and not residual_in_fp32:
            assert residual_out is x
        torch.testing.assert_close(residual_out.double(), summed, rtol=tolerance, atol=tolerance)


def test_layer_norm_normalises_the_unrounded_sum():
    x = torch.tensor([[1.0, 2.0 ** -9, 0.0, 3.0]], dtype=torch.bfloat16)
    residual = torch.tensor([[256.0, 2.0 ** -9, 1.0, -3.0]], dtype=torch.bfloat16)
    out, residual_out = layer_norm_fn(x, torch.ones(4), None, residual=residual, prenorm=True, is_rms_norm=True)
    assert residual_out[0, 0].item() == 256.0  # 257 rounds to 256 in bf16 ...
    expected, _ = reference_norm(x, torch.ones(4), None, residual, eps=1e-6, rms=True)  # ... the norm reads 257
    torch.testing.assert_close(out.double(), expected.to(torch.bfloat16).double())


@pytest.mark.parametrize("rms", [True, False])
def test_layer_norm_gradients(rms):
    g = torch.Generator().manual_seed(6)
    x, residual = (torch.randn(2, 3, 6, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    weight = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    bias = None if rms else torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    inputs = (x, residual, weight) if rms else (x, residual, weight, bias)

    def both_outputs(x, residual, weight, bias=None):
        out, summed = layer_norm_fn(x, weight, bias, residual=residual, prenorm=True, is_rms_norm=rms)
        return out, summed

    assert torch.autograd.gradcheck(both_outputs, inputs)


def test_layer_norm_refuses_dropout():
    refusal = "layer_norm_fn: dropout_p=0.1 is not supported .* only dropout_p=0.0$"
    with pytest.raises(NotImplementedError, match=refusal):
        layer_norm_fn(torch.zeros(2, 4), torch.ones(4), None, dropout_p=0.1)
    with pytest.raises(ValueError, match="weight has shape \\(3,\\); expected \\(4,\\)"):
        layer_norm_fn(torch.zeros(2, 4), torch.ones(3), None)


def test_layer_norm_with_return_dropout_mask_appends_none_masks():
    x, weight = torch.randn(2, 4), torch.ones(4)
    out, residual_out, mask, mask1 = layer_norm_fn(x, weight, None, prenorm=True, return_dropout_mask=True)
    assert mask is None and mask1 is None and residual_out is x
    assert torch.equal(out, layer_norm_fn(x, weight, None))


# -- RotaryEmbedding -----------------------------------------------------------------------


def rotary_inputs(*shape, seed=7, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def test_rotary_q_and_kv_as_nanotron_trains_with_it():
    # nanotron: FlashRotaryEmbedding(dim=d_qk, interleaved=True)(q, kv=kv), q (b, s, h, d), kv (b, s, 2, hk, d)
    rotary = RotaryEmbedding(dim=8, interleaved=True)
    q, kv = rotary_inputs(2, 6, 4, 8), rotary_inputs(2, 6, 2, 2, 8, seed=8)
    q_before, kv_before = q.clone(), kv.clone()
    q_out, kv_out = rotary(q, kv=kv)
    positions = torch.arange(6).expand(2, 6)
    torch.testing.assert_close(q_out, reference_rotary(q, positions, dim=8, interleaved=True), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kv_out[:, :, 0], reference_rotary(kv[:, :, 0], positions, dim=8, interleaved=True),
                               rtol=1e-6, atol=1e-6)
    assert torch.equal(kv_out[:, :, 1], kv[:, :, 1])  # values are not rotated
    assert torch.equal(q, q_before) and torch.equal(kv, kv_before)  # out of place


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_packed_qkv_partial_dim_and_offsets(interleaved):
    rotary = RotaryEmbedding(dim=4, base=500.0, interleaved=interleaved)  # rotates 4 of 8 features
    qkv = rotary_inputs(2, 5, 3, 2, 8)
    out = rotary(qkv, seqlen_offset=3)
    positions = (torch.arange(5) + 3).expand(2, 5)
    for part in (0, 1):
        torch.testing.assert_close(out[:, :, part], reference_rotary(qkv[:, :, part], positions, dim=4, base=500.0,
                                                                     interleaved=interleaved), rtol=1e-6, atol=1e-6)
    assert torch.equal(out[:, :, 2], qkv[:, :, 2])
    # GQA packing (b, s, hq + 2*hk, d), one offset per sequence
    gqa = rotary_inputs(2, 5, 4 + 2 * 1, 8)
    offsets = torch.tensor([0, 7])
    out = rotary(gqa, seqlen_offset=offsets, num_heads_q=4)
    positions = torch.arange(5)[None, :] + offsets[:, None]
    torch.testing.assert_close(out[:, :, :5], reference_rotary(gqa[:, :, :5], positions, dim=4, base=500.0,
                                                               interleaved=interleaved), rtol=1e-6, atol=1e-6)
    assert torch.equal(out[:, :, 5:], gqa[:, :, 5:])


def test_rotary_bf16_and_gradients():
    rotary = RotaryEmbedding(dim=8, interleaved=True)
    q, kv = rotary_inputs(1, 4, 2, 8, dtype=torch.bfloat16), rotary_inputs(1, 4, 2, 1, 8, dtype=torch.bfloat16)
    q_out, kv_out = rotary(q, kv=kv)
    assert q_out.dtype == kv_out.dtype == torch.bfloat16
    torch.testing.assert_close(q_out.double(), reference_rotary(q, torch.arange(4)[None], dim=8, interleaved=True),
                               rtol=2e-2, atol=2e-2)
    q = rotary_inputs(1, 3, 2, 8).requires_grad_(True)
    kv = rotary_inputs(1, 3, 2, 1, 8).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda q, kv: rotary(q, kv=kv), (q, kv))


def test_rotary_refuses_xpos():
    with pytest.raises(NotImplementedError, match="scale_base=512 \\(XPos\\) is not supported"):
        RotaryEmbedding(dim=8, scale_base=512)


# -- bert_padding --------------------------------------------------------------------------


def test_unpad_and_pad_input():
    g = torch.Generator().manual_seed(10)
    hidden = torch.randn(3, 5, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool)
    rows, indices, cu_seqlens, longest = unpad_input(hidden, mask)
    expected = [hidden[b, s] for b in range(3) for s in range(5) if mask[b, s]]
    assert torch.equal(rows, torch.stack(expected)) and longest == 5 and isinstance(longest, int)
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 3, 8, 9]
    assert indices.tolist() == [b * 5 + s for b in range(3) for s in range(5) if mask[b, s]]
    padded = pad_input(rows, indices, 3, 5)
    assert torch.equal(padded, hidden * mask[:, :, None, None])
    padded.sum().backward()
    assert torch.equal(hidden.grad, mask[:, :, None, None].double().expand_as(hidden))
    assert torch.equal(index_first_axis(hidden.flatten(0, 1), indices), rows)


# -- on a GPU (skipped without one) -------------------------------------------------------

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@CUDA
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_on_cuda_every_function_matches_the_reference(dtype, tolerance):
    inputs = attention_inputs([5, 1, 7, 3, 2], [5, 1, 7, 3, 6], 4, 2, dtype=dtype, extra_rows=2)
    q, k, v = (t.cuda().requires_grad_(True) for t in inputs[:3])
    cu_q, cu_k = (t.cuda() for t in inputs[3:])
    weights = torch.randn(q.shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    for causal in (False, True):
        out = varlen(q, k, v, cu_q, cu_k, causal=causal)
        assert out.device.type == "cuda" and out.dtype == dtype
        expected = reference_attention(*inputs, causal=causal)
        torch.testing.assert_close(out.double().cpu(), expected, rtol=tolerance, atol=tolerance)
        ours = torch.autograd.grad((out.double().cpu() * weights).sum(), (q, k, v))
        cpu = [t.detach().double().requires_grad_(True) for t in inputs[:3]]
        theirs = torch.autograd.grad((reference_attention(*cpu, *inputs[3:], causal=causal) * weights).sum(), cpu)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a.double().cpu(), b, rtol=10 * tolerance, atol=10 * tolerance)
    x, weight = torch.randn(4, 8, 32, dtype=dtype, device="cuda"), torch.randn(32, dtype=dtype, device="cuda")
    out = layer_norm_fn(x, weight, None, is_rms_norm=True)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double().cpu(), reference_norm(x.cpu(), weight.cpu(), None, eps=1e-6, rms=True)[0],
                               rtol=tolerance, atol=tolerance)
    q, kv = torch.randn(2, 6, 4, 8, dtype=dtype, device="cuda"), torch.randn(2, 6, 2, 2, 8, dtype=dtype, device="cuda")
    q_out, _ = RotaryEmbedding(dim=8, interleaved=True)(q, kv=kv)
    torch.testing.assert_close(q_out.double().cpu(), reference_rotary(q.cpu(), torch.arange(6).expand(2, 6), dim=8,
                                                                      interleaved=True), rtol=tolerance, atol=tolerance)


@CUDA
def test_on_cuda_causal_attention_does_not_materialise_the_scores():
    """At s = 4096, 32 heads, bf16, one score matrix would take 1 GiB; under torch's fused
    kernels (is_causal) what autograd keeps for backward (the activation memory a pipeline
    stage holds per microbatch) stays far below that, as with flash-attn. Measured as the
    storages autograd saves; the kernels' transient workspaces are not counted (a peak-memory
    bound here failed on the H200 at 8.8 GB while the stash of nanotron's Llama per layer
    showed no score matrix: benchmarks/results/trainer.md)."""
    s, heads, kv_heads, dim = 4096, 32, 8, 128
    q = torch.randn(s, heads, dim, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    k, v = (torch.randn(s, kv_heads, dim, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(2))
    cu = torch.tensor([0, s], dtype=torch.int32, device="cuda")
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = flash_attn_varlen_func(q, k, v, cu, cu, s, s, causal=True)
    out.sum().backward()
    scores = s * s * heads * 2
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v))
    assert sum(saved.values()) - inputs < scores / 4, (sum(saved.values()), scores)


# -- install() in fresh interpreters -------------------------------------------------------


def python(code: str, *, path_first: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path_first, ROOT, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_test_process_has_no_flash_attn():
    assert "flash_attn" not in sys.modules and "nanotron.models.llama" not in sys.modules


@pytest.mark.spawn
def test_install_lets_nanotron_import_and_is_idempotent():
    out = python("""
        import sys, types, importlib.machinery
        from integration.nanotron import flash_attn_standin as standin

        # a nanotron user still being imported: refused, nothing registered
        half = types.ModuleType("nanotron.nn.layer_norm")
        half.__spec__ = importlib.machinery.ModuleSpec("nanotron.nn.layer_norm", None)
        half.__spec__._initializing = True
        sys.modules["nanotron.nn.layer_norm"] = half
        try:
            standin.install()
        except ImportError as error:
            print("HALF:", error)
        assert "flash_attn" not in sys.modules
        del sys.modules["nanotron.nn.layer_norm"]

        # without flash-attn nanotron's Llama does not import; a failed import leaves nothing behind
        try:
            import nanotron.models.llama
        except ModuleNotFoundError as error:
            print("BEFORE:", error)
        assert standin.install() is True and standin.install() is True
        for name in standin.MODULE_NAMES:
            assert getattr(sys.modules[name], standin.MARK) is True, name
        from flash_attn import bert_padding
        from flash_attn.flash_attn_interface import flash_attn_varlen_func
        from flash_attn.layers.rotary import RotaryEmbedding
        from flash_attn.ops.triton.layer_norm import layer_norm_fn
        import flash_attn
        import nanotron.models.llama as llama, nanotron.nn.layer_norm as ln, nanotron.models.starcoder2 as sc2
        assert llama.flash_attn_varlen_func is standin.flash_attn_varlen_func
        assert llama.FlashRotaryEmbedding is standin.RotaryEmbedding and ln.layer_norm_fn is standin.layer_norm_fn
        assert llama.bert_padding is sys.modules["flash_attn.bert_padding"] and sc2._flash_supports_window_size
        assert standin.install(force=True) is True
        print("VERSION:", flash_attn.__version__)
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("HALF: flash-attn stand-in: install() was called while nanotron.nn.layer_norm is being imported"
            in out.stdout)
    assert "BEFORE: No module named 'flash_attn'" in out.stdout
    assert "VERSION: 2.5.0+pipeschedule.standin" in out.stdout


FAKE_FLASH_ATTN = {  # a flash-attn that imports (for the "real one is there" cases)
    "flash_attn/__init__.py": "__version__ = 'fake'\n",
    "flash_attn/bert_padding.py": "def unpad_input(*a): ...\ndef pad_input(*a): ...\n",
    "flash_attn/flash_attn_interface.py": "def flash_attn_varlen_func(*a, **k): ...\n"
                                          "def flash_attn_with_kvcache(*a, **k): ...\n",
    "flash_attn/layers/__init__.py": "",
    "flash_attn/layers/rotary.py": "class RotaryEmbedding:\n    pass\n",
    "flash_attn/ops/__init__.py": "",
    "flash_attn/ops/triton/__init__.py": "",
    "flash_attn/ops/triton/layer_norm.py": "def layer_norm_fn(*a, **k): ...\n",
}


@pytest.mark.spawn
def test_install_leaves_a_real_flash_attn_alone_unless_forced(tmp_path):
    for relative, text in FAKE_FLASH_ATTN.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    out = python("""
        import sys
        from integration.nanotron import flash_attn_standin as standin
        assert standin.real_flash_attn_imports()
        assert standin.install() is False and not standin.is_installed()
        import flash_attn, nanotron.nn.layer_norm
        assert flash_attn.__version__ == "fake"
        try:
            standin.install(force=True)  # too late: nanotron.nn.layer_norm holds the other layer_norm_fn
        except ImportError as error:
            print("LATE:", error)
        assert sys.modules["flash_attn"] is flash_attn
        del sys.modules["nanotron.nn.layer_norm"]  # as in a fresh process
        assert standin.install(force=True) is True and standin.is_installed()
        assert all(getattr(module, standin.MARK, False) for name, module in sys.modules.items()
                   if name.split(".")[0] == "flash_attn")
        import nanotron.models.llama as llama
        assert llama.flash_attn_varlen_func is standin.flash_attn_varlen_func
    """, path_first=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("LATE: flash-attn stand-in: nanotron.nn.layer_norm is already imported, with layer_norm_fn bound to "
            "flash_attn.ops.triton.layer_norm.layer_norm_fn") in out.stdout


# -- nanotron's own LlamaForTraining on CPU ------------------------------------------------


@contextlib.contextmanager
def cpu_p2p_in(llama_module):
    """nanotron's LlamaModel builds `P2P(pp_pg, device=torch.device("cuda"))`
    (nanotron/models/llama.py:672), whose metadata buffers fail on a CPU-only torch:
    build it on CPU, over gloo (integration.nanotron.patches.cpu)."""
    from integration.nanotron.patches.cpu import cpu_p2p

    original = llama_module.P2P
    llama_module.P2P = lambda pg, device: cpu_p2p(pg)
    try:
        yield
    finally:
        llama_module.P2P = original


class NaiveRotary(torch.nn.Module):
    """The rotary as nanotron's training path calls it, through `reference_rotary`."""

    def __init__(self, stand_in: RotaryEmbedding):
        super().__init__()
        self.dim, self.base, self.interleaved = stand_in.dim, stand_in.base, stand_in.interleaved

    def forward(self, q, kv):
        positions = torch.arange(q.shape[1]).expand(q.shape[0], q.shape[1])
        rotate = lambda x: reference_rotary(x, positions, dim=self.dim, base=self.base,  # noqa: E731
                                            interleaved=self.interleaved).to(x.dtype)
        return rotate(q), torch.stack([rotate(kv[:, :, 0]), kv[:, :, 1]], dim=2)


@contextlib.contextmanager
def naive_flash_attn(llama_module, layer_norm_module, model, *, causal_attention=True):
    """Swap all three stand-ins inside a built nanotron Llama for the references above."""

    def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                  causal, return_attn_probs):
        assert dropout_p == 0.0 and softmax_scale is None and not return_attn_probs
        return reference_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal and causal_attention).to(q.dtype)

    def norm(x, weight, bias, residual, eps, dropout_p, prenorm, residual_in_fp32, is_rms_norm, return_dropout_mask):
        assert residual is None and not prenorm and not return_dropout_mask and dropout_p == 0.0  # Llama's calls
        return reference_norm(x, weight, bias, eps=eps, rms=is_rms_norm)[0].to(x.dtype)

    attentions = [m for m in model.modules() if isinstance(m, llama_module.CausalSelfAttention)]
    originals = (llama_module.flash_attn_varlen_func, layer_norm_module.layer_norm_fn,
                 [m.flash_rotary_embedding for m in attentions])
    llama_module.flash_attn_varlen_func, layer_norm_module.layer_norm_fn = attention, norm
    for m in attentions:
        m.flash_rotary_embedding = NaiveRotary(m.flash_rotary_embedding)
    try:
        yield
    finally:
        llama_module.flash_attn_varlen_func, layer_norm_module.layer_norm_fn = originals[:2]
        for m, rotary in zip(attentions, originals[2]):
            m.flash_rotary_embedding = rotary


def llama_checks() -> dict:
    """Run in a fresh interpreter (see test_nanotron_llama_trains_with_the_stand_in)."""
    assert standin.install() is True
    import integration.nanotron  # noqa: F401  (repairs nanotron 0.4's import cycle; imported first)
    import torch.distributed as dist

    os.environ.update(RANK="0", WORLD_SIZE="1")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            return _llama_checks()
        finally:
            dist.destroy_process_group()


def _llama_checks() -> dict:
    import nanotron.models.llama as llama
    import nanotron.nn.layer_norm as layer_norm
    from nanotron.config import LlamaConfig
    from nanotron.models.base import build_model

    from integration.nanotron.patches.cpu import cpu_parallel_context

    context = cpu_parallel_context(tp=1, pp=1, dp=1)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=16)

    def build(dtype):
        torch.manual_seed(0)
        with cpu_p2p_in(llama):
            return build_model(
                model_builder=lambda: llama.LlamaForTraining(config=config, parallel_context=context,
                                                             parallel_config=None),
                parallel_context=context, dtype=dtype,
                device=torch.device("cpu"),  # build_model's default is "cuda" (nanotron/models/base.py:159)
            )

    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    everything = torch.ones(2, 16, dtype=torch.bool)  # see the test: nanotron's training path needs no padding
    batch = {"input_ids": ids, "input_mask": everything, "label_ids": ids.roll(-1, dims=1), "label_mask": everything}

    def loss_and_grads(model):
        model.zero_grad(set_to_none=True)
        loss = model(**batch)["loss"]
        loss.backward()
        return loss.detach(), {name: p.grad for name, p in model.named_parameters()}

    model = build(torch.float32)
    loss, grads = loss_and_grads(model)
    again_loss, again_grads = loss_and_grads(build(torch.float32))
    with naive_flash_attn(llama, layer_norm, model):
        naive_loss, naive_grads = loss_and_grads(model)
    with naive_flash_attn(llama, layer_norm, model, causal_attention=False):
        non_causal_loss, _ = loss_and_grads(model)
    sgd_losses = []  # plain SGD, written out (torch.optim would import torch._dynamo: seconds)
    for _ in range(5):
        step_loss, step_grads = loss_and_grads(model)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                parameter -= 0.5 * step_grads[name]
        sgd_losses.append(step_loss.item())
    bf16_loss, bf16_grads = loss_and_grads(build(torch.bfloat16))
    return {
        "loss": loss.item(),
        "parameters": len(grads),
        "without_gradient": [name for name, g in grads.items() if g is None or not g.isfinite().all() or not g.any()],
        "bitwise_identical": torch.equal(loss, again_loss)
        and all(torch.equal(grads[n], again_grads[n]) for n in grads),
        "naive_loss_difference": abs(loss.item() - naive_loss.item()),
        "naive_grad_difference": max(((grads[n] - naive_grads[n]).abs().max() / naive_grads[n].abs().max()).item()
                                     for n in grads),
        "non_causal_loss_difference": abs(loss.item() - non_causal_loss.item()),
        "sgd_losses": sgd_losses,
        "bf16_loss": bf16_loss.item(),
        "bf16_dtypes": sorted({str(g.dtype) for g in bf16_grads.values() if g is not None}),
        "bf16_without_gradient": [name for name, g in bf16_grads.items() if g is None or not g.isfinite().all()],
    }


@pytest.mark.spawn
def test_nanotron_llama_trains_with_the_stand_in():
    out = python(f"""
        import json, sys
        sys.path.insert(0, {TESTS!r})
        import test_flash_attn_standin
        print("RESULT:", json.dumps(test_flash_attn_standin.llama_checks()))
    """)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.split("RESULT:", 1)[1])
    assert math.isfinite(result["loss"]) and result["parameters"] == 15
    assert result["without_gradient"] == []
    assert result["bitwise_identical"]
    # the model's attention, norms and rotary equal the float64 references ...
    assert result["naive_loss_difference"] < 1e-5 and result["naive_grad_difference"] < 1e-4, result
    # ... and that comparison would see a non-causal attention
    assert result["non_causal_loss_difference"] > 1e-3, result
    losses = result["sgd_losses"]
    assert losses[0] == pytest.approx(result["loss"], abs=0) and losses[-1] < losses[0] - 0.1, losses
    assert math.isfinite(result["bf16_loss"]) and result["bf16_without_gradient"] == []
    assert result["bf16_dtypes"] == ["torch.bfloat16"]
