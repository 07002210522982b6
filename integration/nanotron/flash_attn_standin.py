"""A pure-torch stand-in for the parts of flash-attn that nanotron 0.4 imports.

[Note: flash-attn stand-in] nanotron 0.4 imports flash-attn at module level:

    nanotron/models/llama.py:20-25      bert_padding, flash_attn_varlen_func,
                                        flash_attn_with_kvcache, layers.rotary.RotaryEmbedding
    nanotron/nn/layer_norm.py:2         ops.triton.layer_norm.layer_norm_fn
    nanotron/models/starcoder2.py:27-30 bert_padding, flash_attn_varlen_func, flash_attn_with_kvcache

flash-attn needs CUDA to build and is installed neither on the CPU machines nor on the GPU
machine the benchmarks run on. `install()` registers modules under the eight names those
imports reach (`flash_attn`, `flash_attn.bert_padding`, `flash_attn.flash_attn_interface`,
`flash_attn.layers`, `flash_attn.layers.rotary`, `flash_attn.ops`, `flash_attn.ops.triton`,
`flash_attn.ops.triton.layer_norm`), holding the functions below, written in plain torch
(CPU and CUDA; fp32, bf16, fp16 and, for tests, fp64; differentiable through ordinary
autograd). It does nothing where the real flash-attn imports, unless forced.

The API copied is flash-attn 2.5's (nanotron 0.4 asks for `flash-attn>=2.5.0`, and unpacks
four values from `unpad_input`, which 2.6 changed to five). What each function reproduces,
read from nanotron's call sites and flash-attn's documentation:

- `flash_attn_varlen_func`: sequences packed along the first axis, sequence i being rows
  `cu_seqlens[i]:cu_seqlens[i+1]` of q (and of k, v with `cu_seqlens_k`); GQA/MQA, query
  head h reading key/value head `h // (nheads_q // nheads_k)`; scale `1/sqrt(headdim)` by
  default; the causal mask aligned to the bottom-right corner (query i of a sequence sees
  key j iff `j <= i + seqlen_k - seqlen_q`); `window_size=(left, right)` (starcoder2 uses
  it) keeping keys `[i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]`, -1
  meaning unbounded and causal meaning right = 0; a query row that sees no key gives zeros.
  Each sequence is one `torch.nn.functional.scaled_dot_product_attention` call (k, v
  repeated to q's heads), with `is_causal=True` or no mask where that is the same mask,
  so on CUDA torch's fused kernels can run and the scores are not materialised, as with
  flash-attn; other masks are passed explicitly. Output dtype = input dtype. Memory: what
  autograd keeps for backward holds k and v repeated to q's heads, (nheads_q - nheads_k)
  * seqlen * headdim * 2 elements per layer more than flash-attn keeps (SDPA's own
  `enable_gqa` would avoid it, but only its flash and math kernels take it on CUDA, and
  the math kernel materialises the scores).
- `flash_attn_with_kvcache` (nanotron's decoding path): k, v written into the caches in
  place at `cache_seqlens`, then attention of q over the first `cache_seqlens + seqlen_new`
  cached keys with the masks above; no backward, as in flash-attn.
- `layer_norm_fn` (`TritonRMSNorm`, `TritonLayerNorm`): x (+ residual) summed and
  normalised (LayerNorm or RMSNorm over the last axis, biased variance,
  `rstd = 1/sqrt(var + eps)`) in fp32, weight and bias applied in fp32, output cast to
  x's dtype. With `prenorm=True` it returns `(out, residual_out)`: the sum x + residual
  in residual's dtype (fp32 under `residual_in_fp32`), or x itself when there is no
  residual and no dtype change. As in flash-attn's kernel, the normalisation reads the
  fp32 sum, not its rounded copy. With `return_dropout_mask=True` the masks are None
  (dropout is 0).
- `RotaryEmbedding(dim, base=10000.0, interleaved=False, ...)`: `forward(qkv, kv=None,
  seqlen_offset=0, ...)` rotates q and k (qkv packed as (b, s, 3, h, d) or
  (b, s, hq + 2hk, d) with `num_heads_q`; or q with kv packed as (b, s, 2, hk, d), which
  nanotron's training path uses with `interleaved=True`), leaving v and the features past
  `dim` unchanged. Frequencies `base ** (-2i/dim)` and positions `seqlen_offset + t` in
  fp32; cos and sin rounded to x's dtype as flash-attn caches them; the rotation computed
  in fp32. interleaved: pairs (0, 1), (2, 3), ... (GPT-J); otherwise halves (GPT-NeoX).
- `bert_padding`: `unpad_input` (4-tuple: rows, indices, int32 cu_seqlens, max length),
  `pad_input` (zeros where the mask was 0), `index_first_axis`, `index_put_first_axis`.

Not reproduced (each refused with NotImplementedError naming the function and argument):
dropout_p > 0, alibi_slopes, softcap, paged KV (block_table), return_attn_probs, the
kv-cache's rotary / cache_batch_idx / cache_leftpad / return_softmax_lse, XPos
(scale_base), the parallel norm (x1, weight1, bias1) and rowscale. Deliberate differences:
numerics (torch's kernels block, accumulate and round differently from flash-attn's, which
for one rounds the probabilities to bf16 before P.V), so results agree with flash-attn to
rounding, not bitwise; rows of a varlen output past
`cu_seqlens_q[-1]` are zeros (flash-attn leaves them unwritten); RotaryEmbedding returns
new tensors and leaves its inputs unchanged (flash-attn rotates in place and returns its
inputs; nanotron uses only the returned values); fp32 and fp64 are accepted (flash-attn
refuses them in attention); each varlen call reads cu_seqlens on the host (a device sync
on CUDA). On CPU everything is deterministic: two identical runs give identical bits.

One nanotron fact to know when reading its training path: `CoreAttention` (llama.py:205-225)
builds cu_seqlens from the sequence mask but passes q, k, v still padded, so a mask with
zeros misplaces the sequences, with flash-attn as with this stand-in; nanotron's training
batches carry full masks.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from typing import Optional, Union

import torch
import torch.nn.functional as F

from integration.nanotron.pipeline.errors import AdapterImportError, StandInError, StandInUnsupported

API_VERSION = "2.5.0"  # the flash-attn API copied; see [Note: flash-attn stand-in]
MARK = "__pipeschedule_flash_attn_standin__"  # set on every module install() registers

# -- attention -----------------------------------------------------------------------------


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,  # noqa: ARG001  (always deterministic on CPU)
    return_attn_probs: bool = False,
    block_table: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention over packed variable-length sequences; see [Note: flash-attn stand-in].

    q: (total_q, nheads, headdim); k: (total_k, nheads_k, headdim); v: (total_k, nheads_k,
    headdim_v); cu_seqlens_*: int32 (batch + 1,). Returns (total_q, nheads, headdim_v).
    """
    name = "flash_attn_varlen_func"
    _refuse(name, dropout_p=(dropout_p, 0.0), softcap=(softcap, 0.0), alibi_slopes=(alibi_slopes, None),
            return_attn_probs=(return_attn_probs, False), block_table=(block_table, None))
    _check_qkv(name, q, k, v, batch_dims=0)
    left, right = _window(name, window_size, causal)
    starts_q = _sequence_starts(name, "cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
    starts_k = _sequence_starts(name, "cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
    if len(starts_q) != len(starts_k):
        raise StandInError(f"{name}: cu_seqlens_q has {len(starts_q)} entries and cu_seqlens_k {len(starts_k)}; "
                         "both must have batch + 1")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    pieces = [
        _attend(q[q0:q1], k[k0:k1], v[k0:k1], scale=scale, left=left, right=right)
        for (q0, q1), (k0, k1) in zip(zip(starts_q, starts_q[1:]), zip(starts_k, starts_k[1:]))
    ]
    unused_rows = q.shape[0] - starts_q[-1]
    if unused_rows:  # rows past the last sequence: flash-attn leaves them unwritten
        pieces.append(q.new_zeros((unused_rows, q.shape[1], v.shape[-1])))
    return torch.cat(pieces, dim=0)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens: Union[int, torch.Tensor, None] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,  # noqa: ARG001  (only meaningful with rotary_cos, refused)
    alibi_slopes: Optional[torch.Tensor] = None,
    num_splits: int = 0,  # noqa: ARG001  (a kernel tuning knob)
    return_softmax_lse: bool = False,
) -> torch.Tensor:
    """Attention of q over a KV cache, after writing k, v into it in place.

    q: (batch, seqlen_q, nheads, headdim); k_cache, v_cache: (batch, seqlen_cache, nheads_k,
    headdim); k, v: (batch, seqlen_new, nheads_k, headdim) or None; cache_seqlens: int or
    int32 (batch,), the number of valid entries of each cache before k, v are appended.
    Sequence b attends to its first `cache_seqlens[b] + seqlen_new` cache entries.
    Returns (batch, seqlen_q, nheads, headdim). No backward (nor has flash-attn's).
    """
    name = "flash_attn_with_kvcache"
    _refuse(name, rotary_cos=(rotary_cos, None), rotary_sin=(rotary_sin, None),
            cache_batch_idx=(cache_batch_idx, None), cache_leftpad=(cache_leftpad, None),
            block_table=(block_table, None), softcap=(softcap, 0.0), alibi_slopes=(alibi_slopes, None),
            return_softmax_lse=(return_softmax_lse, False))
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k_cache, v_cache, k, v)):
        raise StandInUnsupported(f"{name} has no backward (nor has flash-attn's); call it under torch.no_grad() "
                                  "or torch.inference_mode(), or use flash_attn_varlen_func for training")
    _check_qkv(name, q, k_cache, v_cache, batch_dims=1)
    if (k is None) != (v is None):
        raise StandInError(f"{name}: pass both k and v or neither (got k={_describe(k)}, v={_describe(v)})")
    batch, seqlen_cache = k_cache.shape[0], k_cache.shape[1]
    if q.shape[0] != batch:
        raise StandInError(f"{name}: q has batch {q.shape[0]} but k_cache has {batch}; "
                         "cache_batch_idx (which would allow this) is not supported")
    seqlen_new = 0
    if k is not None:
        _check_qkv(name, q, k, v, batch_dims=1)
        if k.shape[0] != batch or k.shape[2:] != k_cache.shape[2:] or v.shape[2:] != v_cache.shape[2:]:
            raise StandInError(f"{name}: k {tuple(k.shape)} / v {tuple(v.shape)} do not fit k_cache "
                             f"{tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)}; expected "
                             "(batch, seqlen_new, nheads_k, d)")
        seqlen_new = k.shape[1]
    lengths = _cache_lengths(name, cache_seqlens, batch, seqlen_cache, seqlen_new)
    left, right = _window(name, window_size, causal)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    outputs = []
    for b, length in enumerate(lengths):
        if k is not None:
            k_cache[b, length:length + seqlen_new] = k[b]
            v_cache[b, length:length + seqlen_new] = v[b]
        used = length + seqlen_new
        outputs.append(_attend(q[b], k_cache[b, :used], v_cache[b, :used], scale=scale, left=left, right=right))
    return torch.stack(outputs, dim=0)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, left: int, right: int) -> torch.Tensor:
    """One sequence: q (sq, h, d), k (sk, hk, d), v (sk, hk, dv) -> (sq, h, dv).

    Query i sees key j iff `i + shift - left <= j <= i + shift + right` with
    `shift = sk - sq` (a bound of -1 is absent): the bottom-right alignment of
    [Note: flash-attn stand-in]. The rows that see at least one key are one contiguous
    range [first, last]; the others are zeros.
    """
    sq, heads, sk = q.shape[0], q.shape[1], k.shape[0]
    shift = sk - sq
    first = 0 if right < 0 else max(0, -shift - right)
    last = sq - 1 if left < 0 else min(sq - 1, sk - 1 - shift + left)
    if sk == 0 or first > last:
        return q.new_zeros((sq, heads, v.shape[-1]))
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # q head h reads kv head h // group
    rows = q[first:last + 1]
    mask, is_causal = None, False
    if left < 0 and right < 0:
        pass  # every key
    elif left < 0 and right == 0 and shift == 0:
        is_causal = True  # torch's is_causal is top-left aligned, which is the same when sq == sk
    else:
        i = torch.arange(first, last + 1, device=q.device)[:, None] + shift
        j = torch.arange(sk, device=q.device)[None, :]
        mask = torch.ones((rows.shape[0], sk), dtype=torch.bool, device=q.device)
        if left >= 0:
            mask &= j >= i - left
        if right >= 0:
            mask &= j <= i + right
    # (1, h, s, d): torch's fused CUDA kernels (flash, memory-efficient) take 4-D inputs
    # only; given 3-D ones it falls back to the math kernel, which builds the s x s scores
    out = F.scaled_dot_product_attention(
        rows.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
        is_causal=is_causal, scale=scale,
    )[0].transpose(0, 1)
    if first == 0 and last == sq - 1:
        return out
    before = q.new_zeros((first, heads, v.shape[-1]))
    after = q.new_zeros((sq - 1 - last, heads, v.shape[-1]))
    return torch.cat([before, out, after], dim=0)


# -- layer norm ----------------------------------------------------------------------------


def layer_norm_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    residual: Optional[torch.Tensor] = None,
    x1: Optional[torch.Tensor] = None,
    weight1: Optional[torch.Tensor] = None,
    bias1: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    dropout_p: float = 0.0,
    rowscale: Optional[torch.Tensor] = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
    is_rms_norm: bool = False,
    return_dropout_mask: bool = False,
):
    """LayerNorm / RMSNorm of `x (+ residual)` over the last axis, computed in fp32.

    Returns `out`, or `(out, residual_out)` with prenorm; with return_dropout_mask, two
    None masks are appended. See [Note: flash-attn stand-in] for the dtypes.
    """
    name = "layer_norm_fn"
    _refuse(name, dropout_p=(dropout_p, 0.0), x1=(x1, None), weight1=(weight1, None), bias1=(bias1, None),
            rowscale=(rowscale, None))
    features = x.shape[-1]
    if weight.shape != (features,):
        raise StandInError(f"{name}: weight has shape {tuple(weight.shape)}; expected ({features},), x's last axis")
    if bias is not None and bias.shape != (features,):
        raise StandInError(f"{name}: bias has shape {tuple(bias.shape)}; expected ({features},) or None")
    if residual is not None and residual.shape != x.shape:
        raise StandInError(f"{name}: residual has shape {tuple(residual.shape)}; expected x's {tuple(x.shape)}")
    compute = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    summed = x.to(compute) if residual is None else x.to(compute) + residual.to(compute)
    residual_dtype = residual.dtype if residual is not None else (torch.float32 if residual_in_fp32 else x.dtype)
    residual_out = x if residual is None and residual_dtype == x.dtype else summed.to(residual_dtype)
    if is_rms_norm:
        centred = summed
    else:
        centred = summed - summed.mean(dim=-1, keepdim=True)
    rstd = torch.rsqrt(centred.square().mean(dim=-1, keepdim=True) + eps)
    out = centred * rstd * weight.to(compute)
    if bias is not None:
        out = out + bias.to(compute)
    out = out.to(x.dtype)
    result = (out, residual_out) if prenorm else (out,)
    if return_dropout_mask:
        result += (None, None)  # dropout_mask, dropout_mask1: none without dropout
    return result if len(result) > 1 else out


# -- rotary --------------------------------------------------------------------------------


class RotaryEmbedding(torch.nn.Module):
    """Rotary position embedding with flash-attn's constructor and forward.

    Stateless: cos and sin are recomputed at every call from `dim` and `base` (flash-attn
    caches them and keeps an `inv_freq` buffer; neither is a parameter, so checkpoints
    are unaffected). See [Note: flash-attn stand-in].
    """

    def __init__(self, dim: int, base: float = 10000.0, interleaved: bool = False, scale_base=None,
                 pos_idx_in_fp32: bool = True, device=None):  # noqa: ARG002  (positions are always fp32)
        super().__init__()
        if scale_base is not None:
            raise StandInUnsupported(f"RotaryEmbedding: scale_base={scale_base!r} (XPos) is not supported; "
                                      "only scale_base=None")
        if dim <= 0 or dim % 2:
            raise StandInError(f"RotaryEmbedding: dim={dim}; expected a positive even number of rotated features")
        self.dim = dim
        self.base = float(base)
        self.interleaved = interleaved
        self.scale_base = None

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}, interleaved={self.interleaved}, stand-in"

    def forward(self, qkv: torch.Tensor, kv: Optional[torch.Tensor] = None,
                seqlen_offset: Union[int, torch.Tensor] = 0, max_seqlen: Optional[int] = None,  # noqa: ARG002
                num_heads_q: Optional[int] = None):
        """qkv: (b, s, 3, h, d), or (b, s, hq + 2*hk, d) with num_heads_q; or, with kv
        (b, s, 2, hk, d), q (b, s, h, d). Returns the rotated qkv, or (q, kv)."""
        name = "RotaryEmbedding.forward"
        if qkv.shape[-1] < self.dim:
            raise StandInError(f"{name}: head dim {qkv.shape[-1]} is smaller than the rotary dim {self.dim}")
        cos, sin = self._cos_sin(qkv, seqlen_offset)
        if kv is not None:
            if qkv.dim() != 4 or kv.dim() != 5 or kv.shape[2] != 2 or kv.shape[:2] != qkv.shape[:2]:
                raise StandInError(f"{name}: with kv, expected q (b, s, h, d) and kv (b, s, 2, hk, d); "
                                 f"got q {tuple(qkv.shape)} and kv {tuple(kv.shape)}")
            keys = self._rotate(kv[:, :, 0], cos, sin)
            return self._rotate(qkv, cos, sin), torch.stack([keys, kv[:, :, 1]], dim=2)
        if qkv.dim() == 5 and qkv.shape[2] == 3:
            q, k = self._rotate(qkv[:, :, 0], cos, sin), self._rotate(qkv[:, :, 1], cos, sin)
            return torch.stack([q, k, qkv[:, :, 2]], dim=2)
        if qkv.dim() == 4 and num_heads_q is not None and (qkv.shape[2] - num_heads_q) % 2 == 0:
            rotated = num_heads_q + (qkv.shape[2] - num_heads_q) // 2  # q heads, then k heads
            return torch.cat([self._rotate(qkv[:, :, :rotated], cos, sin), qkv[:, :, rotated:]], dim=2)
        raise StandInError(f"{name}: qkv has shape {tuple(qkv.shape)}; expected (b, s, 3, h, d), "
                         f"or (b, s, hq + 2*hk, d) with num_heads_q (got {num_heads_q}), or q (b, s, h, d) with kv")

    def _cos_sin(self, x: torch.Tensor, seqlen_offset: Union[int, torch.Tensor]):
        """cos, sin of shape (b or 1, s, 1, dim/2) in x's dtype, from fp32 angles."""
        seqlen = x.shape[1]
        positions = torch.arange(seqlen, device=x.device, dtype=torch.float32)
        if isinstance(seqlen_offset, torch.Tensor):
            if seqlen_offset.shape != (x.shape[0],):
                raise StandInError(f"RotaryEmbedding.forward: seqlen_offset has shape {tuple(seqlen_offset.shape)}; "
                                 f"expected an int or ({x.shape[0]},), one offset per sequence")
            positions = seqlen_offset.to(device=x.device, dtype=torch.float32)[:, None] + positions
        else:
            positions = (positions + seqlen_offset)[None, :]
        inv_freq = 1.0 / self.base ** (torch.arange(0, self.dim, 2, device=x.device, dtype=torch.float32) / self.dim)
        angles = positions[..., None] * inv_freq  # (b or 1, s, dim/2)
        return torch.cos(angles).to(x.dtype)[:, :, None, :], torch.sin(angles).to(x.dtype)[:, :, None, :]

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate the first `dim` features of x (b, s, h, d) in fp32; cast back to x's dtype."""
        compute = torch.promote_types(x.dtype, torch.float32)
        rotated, passed = x[..., :self.dim].to(compute), x[..., self.dim:]
        cos, sin = cos.to(compute), sin.to(compute)
        if self.interleaved:
            x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
        else:
            x1, x2 = rotated.chunk(2, dim=-1)
        y1, y2 = x1 * cos - x2 * sin, x1 * sin + x2 * cos
        rotated = torch.stack([y1, y2], dim=-1).flatten(-2) if self.interleaved else torch.cat([y1, y2], dim=-1)
        return torch.cat([rotated.to(x.dtype), passed], dim=-1)


# -- bert_padding --------------------------------------------------------------------------


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:  # noqa: A002  (flash-attn's name)
    """`input[indices]` along the first axis; input has at least two axes."""
    if input.dim() < 2:
        raise StandInError(f"index_first_axis: input has shape {tuple(input.shape)}; expected at least 2 axes")
    return input.index_select(0, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    """Zeros of first axis `first_axis_dim` with `values` placed at rows `indices`."""
    zeros = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return zeros.index_copy(0, indices, values)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor):
    """(batch, seqlen, ...) with mask (batch, seqlen) -> (rows of the kept tokens, their
    indices in the flattened input, int32 cu_seqlens (batch + 1,), longest length as int)."""
    if attention_mask.shape != hidden_states.shape[:2]:
        raise StandInError(f"unpad_input: attention_mask has shape {tuple(attention_mask.shape)}; expected "
                         f"hidden_states' first two axes {tuple(hidden_states.shape[:2])}")
    lengths = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten()).flatten()
    cu_seqlens = F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    rows = index_first_axis(hidden_states.flatten(0, 1), indices)
    return rows, indices, cu_seqlens, int(lengths.max().item())


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of unpad_input: (total, ...) -> (batch, seqlen, ...), zeros where masked."""
    return index_put_first_axis(hidden_states, indices, batch * seqlen).unflatten(0, (batch, seqlen))


# -- argument checks -----------------------------------------------------------------------


def _refuse(function: str, **arguments) -> None:
    """NotImplementedError for the first argument that is not at its one supported value."""
    for argument, (value, supported) in arguments.items():
        if supported is None:
            unsupported = value is not None
        else:
            unsupported = value != supported
        if unsupported:
            raise StandInUnsupported(
                f"{function}: {argument}={_describe(value)} is not supported by the flash-attn stand-in "
                f"(integration.nanotron.flash_attn_standin); only {argument}={supported!r}"
            )


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)} {value.dtype}>"
    return repr(value)


def _check_qkv(function: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, batch_dims: int) -> None:
    """q (..., s, h, d), k (..., s_k, hk, d), v (..., s_k, hk, dv): one dtype, one device, h % hk == 0."""
    rank = 3 + batch_dims
    for label, tensor in (("q", q), ("k", k), ("v", v)):
        if tensor.dim() != rank:
            raise StandInError(f"{function}: {label} has shape {tuple(tensor.shape)}; expected {rank} axes "
                             f"({'batch, ' if batch_dims else ''}tokens, heads, head dim)")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise StandInError(f"{function}: q, k, v must share dtype and device; got {q.dtype}/{q.device}, "
                         f"{k.dtype}/{k.device}, {v.dtype}/{v.device}")
    if not q.is_floating_point():
        raise StandInError(f"{function}: q has dtype {q.dtype}; expected a floating-point dtype")
    if k.shape[:-1] != v.shape[:-1]:
        raise StandInError(f"{function}: k {tuple(k.shape)} and v {tuple(v.shape)} differ before the head dim")
    if q.shape[-1] != k.shape[-1]:
        raise StandInError(f"{function}: q has head dim {q.shape[-1]} and k {k.shape[-1]}; they must be equal")
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if kv_heads == 0 or heads % kv_heads:
        raise StandInError(f"{function}: q has {heads} heads and k, v {kv_heads}; "
                         "the number of q heads must be a multiple of the number of k/v heads")


def _window(function: str, window_size, causal: bool) -> tuple[int, int]:
    """(left, right) bounds; -1 is unbounded; causal sets right to 0."""
    try:
        left, right = (int(bound) for bound in window_size)
    except (TypeError, ValueError):
        raise StandInError(f"{function}: window_size={window_size!r}; expected a pair (left, right) of ints") from None
    if left < -1 or right < -1:
        raise StandInError(f"{function}: window_size={window_size!r}; each bound must be >= 0, or -1 for unbounded")
    return left, (0 if causal else right)


def _sequence_starts(function: str, label: str, cu_seqlens: torch.Tensor, total: int, max_seqlen) -> list[int]:
    """cu_seqlens as a host list, checked: int32, 1-D, starts at 0, non-decreasing, within
    `total` rows, no sequence longer than `max_seqlen`."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise StandInError(f"{function}: {label}={_describe(cu_seqlens)}; expected a 1-D torch.int32 tensor "
                         "of batch + 1 cumulative lengths")
    starts = cu_seqlens.tolist()
    lengths = [end - start for start, end in zip(starts, starts[1:])]
    if len(starts) < 2 or starts[0] != 0 or min(lengths) < 0 or starts[-1] > total:  # (`or` stops at len < 2)
        raise StandInError(f"{function}: {label}={starts}; expected 0 = c[0] <= c[1] <= ... <= c[-1] <= {total} "
                         "(the number of rows), with at least one sequence")
    longest = max(lengths)
    if longest > int(max_seqlen):
        raise StandInError(f"{function}: {label} holds a sequence of length {longest} > max_seqlen={int(max_seqlen)}")
    return starts


def _cache_lengths(function: str, cache_seqlens, batch: int, seqlen_cache: int, seqlen_new: int) -> list[int]:
    """Valid entries of each cache before the new keys; the new keys must fit."""
    if cache_seqlens is None:
        if seqlen_new:
            raise StandInError(f"{function}: k and v were given without cache_seqlens; say where to append them")
        lengths = [seqlen_cache] * batch
    elif isinstance(cache_seqlens, int):
        lengths = [cache_seqlens] * batch
    elif isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.shape == (batch,) \
            and not cache_seqlens.is_floating_point():
        lengths = cache_seqlens.tolist()
    else:
        raise StandInError(f"{function}: cache_seqlens={_describe(cache_seqlens)}; expected an int or an integer "
                         f"tensor of shape ({batch},)")
    for b, length in enumerate(lengths):
        if length < 0 or length + seqlen_new > seqlen_cache:
            raise StandInError(f"{function}: sequence {b}: cache_seqlens {length} + {seqlen_new} new keys does not fit "
                             f"in a cache of {seqlen_cache} entries")
    return lengths


# -- installation --------------------------------------------------------------------------

# Each module name, and what it holds.
_CONTENTS: dict[str, dict[str, object]] = {
    "flash_attn.bert_padding": {"unpad_input": unpad_input, "pad_input": pad_input,
                                "index_first_axis": index_first_axis, "index_put_first_axis": index_put_first_axis},
    "flash_attn.flash_attn_interface": {"flash_attn_varlen_func": flash_attn_varlen_func,
                                        "flash_attn_with_kvcache": flash_attn_with_kvcache},
    "flash_attn.layers.rotary": {"RotaryEmbedding": RotaryEmbedding},
    "flash_attn.ops.triton.layer_norm": {"layer_norm_fn": layer_norm_fn},
    "flash_attn": {"__version__": f"{API_VERSION}+pipeschedule.standin",
                   "flash_attn_varlen_func": flash_attn_varlen_func,
                   "flash_attn_with_kvcache": flash_attn_with_kvcache},
    "flash_attn.layers": {},
    "flash_attn.ops": {},
    "flash_attn.ops.triton": {},
}
MODULE_NAMES = tuple(sorted(_CONTENTS))
_PACKAGES = frozenset(name for name in MODULE_NAMES if any(other.startswith(name + ".") for other in MODULE_NAMES))

# nanotron modules that bind a flash-attn name at import: the name, and its stand-in.
_NANOTRON_USERS = {
    "nanotron.models.llama": ("flash_attn_varlen_func", flash_attn_varlen_func),
    "nanotron.models.starcoder2": ("flash_attn_varlen_func", flash_attn_varlen_func),
    "nanotron.nn.layer_norm": ("layer_norm_fn", layer_norm_fn),
}


def is_installed() -> bool:
    """True when `flash_attn` in sys.modules is this stand-in."""
    return getattr(sys.modules.get("flash_attn"), MARK, False) is True


def real_flash_attn_imports() -> bool:
    """True when the real flash-attn and every module nanotron imports from it import."""
    if is_installed():
        return False
    try:
        for name in MODULE_NAMES:
            importlib.import_module(name)
    except Exception:  # noqa: BLE001  (a broken CUDA build raises OSError, RuntimeError, ...)
        return False
    return True


def install(force: bool = False) -> bool:
    """Register the stand-in modules under flash-attn's names; see [Note: flash-attn stand-in].

    Returns False, doing nothing, when the real flash-attn imports and not `force`;
    True when the stand-in is (now, or already) installed. Idempotent. Call it before
    anything imports `nanotron.models.llama`, `nanotron.models.starcoder2` or
    `nanotron.nn.layer_norm`; a module of these already imported with another flash-attn,
    or still being imported, raises ImportError. (An import of them that failed because
    flash-attn was missing leaves nothing behind; import again after install().)
    """
    if is_installed():
        return True
    if not force and real_flash_attn_imports():
        return False
    _check_no_user_imported()
    for name in [name for name in sys.modules if name == "flash_attn" or name.startswith("flash_attn.")]:
        del sys.modules[name]  # leftovers of a real flash-attn that failed to import, or was overridden by force
    modules = {name: _make_module(name) for name in MODULE_NAMES}
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    sys.modules.update(modules)
    return True


def _make_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name, f"flash-attn stand-in ({__name__}); see [Note: flash-attn stand-in] there")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, origin=__file__, is_package=name in _PACKAGES)
    module.__file__ = __file__
    if name in _PACKAGES:
        module.__path__ = []  # a package: submodules are found in sys.modules only
    setattr(module, MARK, True)
    for attribute, value in _CONTENTS[name].items():
        setattr(module, attribute, value)
    return module


def _check_no_user_imported() -> None:
    """ImportError if a nanotron module that binds flash-attn names at import is in sys.modules."""
    for name, (attribute, stand_in) in _NANOTRON_USERS.items():
        module = sys.modules.get(name)
        if module is None:
            continue
        if getattr(getattr(module, "__spec__", None), "_initializing", False):
            raise AdapterImportError(f"flash-attn stand-in: install() was called while {name} is being imported; "
                              f"call it before anything imports {name}")
        bound = getattr(module, attribute, None)
        if bound is stand_in:
            continue  # imported with this stand-in earlier (its sys.modules entries were removed since)
        raise AdapterImportError(
            f"flash-attn stand-in: {name} is already imported, with {attribute} bound to "
            f"{getattr(bound, '__module__', '?')}.{getattr(bound, '__qualname__', repr(bound))}; the stand-in would "
            f"not reach it. Call install() before anything imports {name} (in a fresh process)"
        )
